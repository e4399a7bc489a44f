package trigger_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine/trigger"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

type syncBuffer = testsupport.SyncBuffer

// TestCrashAfterStartRealProcess kills a real engine serve (SIGKILL, by
// the failpoint trigger.after_start) after it started an event's job and
// before it recorded the event; the event sent again to a new engine
// answers that job, marked duplicate, and the deployment holds one job.
func TestCrashAfterStartRealProcess(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	st := srv.Store(t, kv.Config{})
	ctx := context.Background()
	def, err := schemas.Load("testdata/orders.yaml", schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Definitions.Put(ctx, def); err != nil {
		t.Fatal(err)
	}
	bin := testsupport.Binary(t, "engine")
	serve := func(env ...string) (addr string, cmd *exec.Cmd, out *syncBuffer, done chan struct{}) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr = ln.Addr().String()
		_ = ln.Close()
		cmd = exec.Command(bin, "serve", "--nats-url", srv.URL(), "--http", addr, "--workers", "1")
		out = &syncBuffer{}
		cmd.Stdout, cmd.Stderr = out, out
		cmd.Env = append(os.Environ(), env...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done = make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
		testsupport.Eventually(t, 30*time.Second, func() bool {
			resp, err := http.Get("http://" + addr + "/healthz")
			if err == nil {
				resp.Body.Close()
			}
			return err == nil
		}, "engine serve never answered on %s: %s", addr, out)
		return addr, cmd, out, done
	}
	post := func(addr string) (*http.Response, error) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/events", strings.NewReader(orderData))
		for k, v := range binary("crash-real-1", "/shop/eu") {
			req.Header.Set(k, v)
		}
		return http.DefaultClient.Do(req)
	}

	addr, _, out, done := serve("WAYMARK_FAILPOINTS=" + "trigger.after_start=crash")
	if resp, err := post(addr); err == nil {
		resp.Body.Close()
		t.Fatalf("the engine answered %d; the failpoint should have killed it first: %s", resp.StatusCode, out)
	}
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("the engine did not die at the failpoint: %s", out)
	}
	if !strings.Contains(out.String(), "failpoint trigger.after_start: crashing") {
		t.Fatalf("the engine died elsewhere: %s", out)
	}
	id := schemas.TriggerJobID("orders", "created", "/shop/eu", "crash-real-1")
	if _, err := st.Checkpoints.Get(ctx, id); err != nil {
		t.Fatalf("the job was not stored before the crash: %v", err)
	}
	if _, err := st.Events.Get(ctx, "/shop/eu", "crash-real-1"); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("the event was recorded before the crash: %v", err)
	}

	addr, _, out, _ = serve()
	resp, err := post(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var a trigger.Answer
	if err := decodeJSON(resp, &a); err != nil || resp.StatusCode != http.StatusAccepted || len(a.Jobs) != 1 || a.Jobs[0].JobID != id || !a.Jobs[0].Duplicate {
		t.Fatalf("after the restart: %d %+v %v\n%s", resp.StatusCode, a, err, out)
	}
	if rec, err := st.Events.Get(ctx, "/shop/eu", "crash-real-1"); err != nil || rec.Jobs[0].JobID != id {
		t.Fatalf("record after the restart: %+v %v", rec, err)
	}
	testsupport.Eventually(t, 30*time.Second, func() bool {
		ent, err := st.Checkpoints.Get(ctx, id)
		return err == nil && ent.Checkpoint.Status == schemas.JobCompleted
	}, "job %s never completed after the restart", id)
}
