package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Layout settings every process of a crash test shares: short ack waits so
// that redelivery after a crash takes about a second.
var crashEnv = []string{
	"WAYMARK_INBOX_ACK_WAIT=1s",
	"WAYMARK_WORK_ACK_WAIT=2s",
	"WAYMARK_LOG_LEVEL=info",
}

var crashKV = kv.Config{InboxAckWait: time.Second, WorkAckWait: 2 * time.Second}

// counter is an HTTP service that counts calls per path and per
// Idempotency-Key.
type counter struct {
	mu    sync.Mutex
	calls map[string]int
	keys  map[string]int
	srv   *httptest.Server
}

func newCounter(t *testing.T) *counter {
	c := &counter{calls: map[string]int{}, keys: map[string]int{}}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		c.mu.Lock()
		c.calls[r.URL.Path]++
		c.keys[r.Header.Get("Idempotency-Key")]++
		n := c.calls[r.URL.Path]
		c.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"path": %q, "call": %d, "request_bytes": %d}`, r.URL.Path, n, len(body))
	}))
	t.Cleanup(c.srv.Close)
	return c
}

func (c *counter) count(path string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[path]
}

// proc is a child process of the test, killed when the test ends.
type proc struct {
	cmd    *exec.Cmd
	out    *syncBuffer // stdout
	errOut *syncBuffer // stderr
	done   chan struct{}
	err    error
}

type syncBuffer = testsupport.SyncBuffer

func spawn(t *testing.T, env []string, bin string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(bin, args...), out: &syncBuffer{}, errOut: &syncBuffer{}, done: make(chan struct{})}
	p.cmd.Env = append(append(os.Environ(), crashEnv...), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.errOut
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("output of %s %v:\n%s\nstderr:\n%s", filepath.Base(bin), args, p.out.String(), lastLines(p.errOut.String(), 40))
		}
	})
	return p
}

// waitKilled waits for the process to die by SIGKILL, as a crash failpoint
// makes it.
// commandRunner returns a function that runs the engine binary bin with
// args and then extra (--nats-url, say), under env, and returns the
// process and its exit status once it ended (60 s at most).
func commandRunner(t *testing.T, env []string, bin string, extra ...string) func(args ...string) (*proc, int) {
	return func(args ...string) (*proc, int) {
		t.Helper()
		p := spawn(t, env, bin, append(args, extra...)...)
		select {
		case <-p.done:
		case <-time.After(60 * time.Second):
			t.Fatalf("engine %v did not finish", args)
		}
		var ee *exec.ExitError
		if errors.As(p.err, &ee) {
			return p, ee.ExitCode()
		}
		return p, 0
	}
}

func (p *proc) waitKilled(t *testing.T, timeout time.Duration) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("process still running after %v; its failpoint never fired", timeout)
	}
	var ee *exec.ExitError
	if !errors.As(p.err, &ee) {
		t.Fatalf("process exited with %v, want killed", p.err)
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("process ended with %v, want SIGKILL", p.err)
	}
}

func loadDef(t *testing.T, path string) *schemas.Definition {
	t.Helper()
	def, err := schemas.Load(path, schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatal(err)
	}
	return def
}

func TestCrashedEngineResumesWithoutRunningCompletedSteps(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		failpoint string
	}{
		{"after checkpoint before dispatch", "engine.after_checkpoint=crash@2"},
		{"after dispatch before ack", "engine.after_dispatch=crash@2"},
		{"after result received before apply", "engine.after_result_received=crash@2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
			count := newCounter(t)
			store := srv.Store(t, crashKV)
			bin := testsupport.Binary(t, "engine")
			nats := "--nats-url=" + srv.URL()
			spawn(t, nil, testsupport.Binary(t, "worker"), nats, "--service=count="+count.srv.URL)
			first := spawn(t, []string{"WAYMARK_FAILPOINTS=" + tc.failpoint}, bin, "serve", nats, "--http=", "--workers=0")

			cl := client.New(store)
			def := loadDef(t, "testdata/three-calls.yaml")
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			res, err := cl.Start(ctx, def, json.RawMessage(`{}`), client.StartOptions{JobID: "crash"})
			if err != nil {
				t.Fatal(err)
			}
			first.waitKilled(t, 30*time.Second)
			if !strings.Contains(first.errOut.String(), "failpoint "+strings.SplitN(tc.failpoint, "=", 2)[0]) {
				t.Fatalf("engine died, but not at %s:\n%s", tc.failpoint, lastLines(first.errOut.String(), 20))
			}
			spawn(t, nil, bin, "serve", nats, "--http=", "--workers=0")

			v, err := cl.Wait(ctx, res.JobID, nil)
			if err != nil {
				t.Fatal(err)
			}
			if v.Status != schemas.JobCompleted {
				t.Fatalf("status %s: %v", v.Status, v.Error)
			}
			// A crash after the dispatch was published leaves nothing for the
			// job to wait on: it may complete before the dead engine's
			// unacknowledged result comes back (one ack wait), which is then
			// stale and recovers nothing (a finished job is never written
			// again): resume_count is 0 or 1. The other crashes need the
			// redelivery to go on: 1.
			if tc.failpoint == "engine.after_dispatch=crash@2" {
				if v.ResumeCount > 1 {
					t.Errorf("resume_count = %d, want at most 1", v.ResumeCount)
				}
			} else if v.ResumeCount != 1 {
				t.Errorf("resume_count = %d, want 1", v.ResumeCount)
			}
			for _, s := range v.Steps {
				if s.Attempts != 1 {
					t.Errorf("step %s dispatched %d times, want once", s.ID, s.Attempts)
				}
			}
			for _, p := range []string{"/a", "/b", "/c"} {
				if n := count.count(p); n != 1 {
					t.Errorf("%s called %d times, want exactly once", p, n)
				}
			}
		})
	}
}

func TestCrashedWorkerResumes(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	count := newCounter(t)
	store := srv.Store(t, crashKV)
	nats := "--nats-url=" + srv.URL()
	worker := testsupport.Binary(t, "worker")
	svc := "--service=count=" + count.srv.URL
	// The worker dies holding step b, before running it.
	first := spawn(t, []string{"WAYMARK_FAILPOINTS=worker.after_receive=crash@2"}, worker, nats, svc)
	spawn(t, nil, testsupport.Binary(t, "engine"), "serve", nats, "--http=", "--workers=0")

	cl := client.New(store)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := cl.Start(ctx, loadDef(t, "testdata/three-calls.yaml"), nil, client.StartOptions{JobID: "worker-crash"})
	if err != nil {
		t.Fatal(err)
	}
	first.waitKilled(t, 30*time.Second)
	spawn(t, nil, worker, nats, svc)
	v, err := cl.Wait(ctx, res.JobID, nil)
	if err != nil {
		t.Fatal(err)
	}
	if v.Status != schemas.JobCompleted || v.ResumeCount != 1 {
		evs, _ := cl.History(ctx, res.JobID)
		for _, e := range evs {
			t.Logf("%s %s %s %d %s", e.ID, e.Type, e.Data.Step, e.Data.Attempt, e.Data.Reason)
		}
		t.Fatalf("status %s resume_count %d, want completed after 1 resume", v.Status, v.ResumeCount)
	}
	for _, p := range []string{"/a", "/b", "/c"} {
		if n := count.count(p); n != 1 {
			t.Errorf("%s called %d times, want exactly once", p, n)
		}
	}
}

// TestRunAgainAfterCrashFinishesTheSameJob is the README's promise: kill
// `engine run --job-id X` mid-job, run the same command again, and job X
// finishes with every ticket filed once.
func TestRunAgainAfterCrashFinishesTheSameJob(t *testing.T) {
	t.Parallel()
	bin := testsupport.Binary(t, "engine")
	root := testsupport.ModuleRoot()
	dir := t.TempDir()
	args := []string{"run", filepath.Join(root, "examples/quickstart/workflow.yaml"),
		"--input", filepath.Join(root, "examples/quickstart/input.json"),
		"--job-id", "triage-1", "--data-dir", dir, "--sync", "always", "--output", "json"}
	env := []string{"WAYMARK_MODEL_MODE=replay"}
	// Die after the checkpoint that records file_tickets' dispatch, before
	// the dispatch is published.
	first := spawn(t, append(env, "WAYMARK_FAILPOINTS=engine.after_checkpoint=crash@2"), bin, args...)
	first.waitKilled(t, 60*time.Second)

	second := spawn(t, env, bin, args...)
	select {
	case <-second.done:
	case <-time.After(60 * time.Second):
		t.Fatal("second run did not finish")
	}
	if second.err != nil {
		t.Fatalf("second run: %v\n%s", second.err, second.out.String())
	}
	out := second.out.String()
	var v client.JobView
	if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &v); err != nil {
		t.Fatalf("decode job record: %v\n%s", err, out)
	}
	if v.ID != "triage-1" || v.Status != schemas.JobCompleted || v.ResumeCount != 1 {
		t.Fatalf("job %s status %s resume_count %d, want triage-1 completed after 1 resume", v.ID, v.Status, v.ResumeCount)
	}
	for _, s := range v.Steps {
		if s.Attempts != 1 {
			t.Errorf("step %s dispatched %d times", s.ID, s.Attempts)
		}
	}
	tickets, err := os.ReadFile(filepath.Join(dir, "demo", "tickets", "tickets.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(tickets, []byte("\n")); n != 5 {
		t.Errorf("tickets.jsonl holds %d tickets, want the 5 filed once", n)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// TestCleanStopOfEmbeddedServe stops a busy `engine serve` (embedded
// server, its own worker) with SIGTERM and starts it again on the same data
// directory: the batches and steps in hand are finished, not handed back
// (the restarted server would keep a message handed back as delivered and
// wait out its ack wait, a minute here), so every job goes on at once and
// none counts a resume.
func TestCleanStopOfEmbeddedServe(t *testing.T) {
	t.Parallel()
	bin := testsupport.Binary(t, "engine")
	dir := t.TempDir()
	env := []string{"WAYMARK_INBOX_ACK_WAIT=60s", "WAYMARK_WORK_ACK_WAIT=60s"}
	args := []string{"serve", "--data-dir", dir, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--sync", "always"}
	apiOf := func(p *proc) string {
		var url string
		testsupport.Eventually(t, 30*time.Second, func() bool {
			for _, line := range strings.Split(p.out.String(), "\n") {
				if u, ok := strings.CutPrefix(line, "http: "); ok {
					url = strings.Fields(u)[0]
					return true
				}
			}
			return false
		}, "serve printed no API address")
		return url
	}
	call := func(method, url, body string, v any) {
		t.Helper()
		req, _ := http.NewRequest(method, url, strings.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		if resp.StatusCode >= 300 {
			t.Fatalf("%s %s: %d %s", method, url, resp.StatusCode, data)
		}
		if v != nil {
			if err := json.Unmarshal(data, v); err != nil {
				t.Fatalf("%s %s: %v: %s", method, url, err, data)
			}
		}
	}
	first := spawn(t, env, bin, args...)
	api := apiOf(first)
	call("POST", api+"/v1/workflows", testsupport.NoopChain("long", 300), nil)
	const jobs = 20
	for i := range jobs {
		call("POST", api+"/v1/jobs", fmt.Sprintf(`{"workflow": "long", "job_id": "busy-%d"}`, i), nil)
	}
	testsupport.Eventually(t, 30*time.Second, func() bool {
		var v client.JobView
		call("GET", fmt.Sprintf("%s/v1/jobs/busy-%d", api, jobs-1), "", &v)
		return v.Seq > 20
	}, "the jobs never got going")
	if err := first.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-first.done:
	case <-time.After(30 * time.Second):
		t.Fatal("serve still running 30s after SIGTERM")
	}
	if first.err != nil {
		t.Fatalf("serve exited with %v after SIGTERM, want 0", first.err)
	}

	second := spawn(t, env, bin, args...)
	api = apiOf(second)
	testsupport.Eventually(t, 40*time.Second, func() bool {
		var page client.JobPage
		call("GET", api+"/v1/jobs?status=completed&limit=100", "", &page)
		return len(page.Jobs) == jobs
	}, "not every job completed within 40s of the restart: a message left to its ack wait (60s)?")
	for i := range jobs {
		var v client.JobView
		call("GET", fmt.Sprintf("%s/v1/jobs/busy-%d", api, i), "", &v)
		if v.ResumeCount != 0 {
			t.Errorf("job busy-%d: resume_count %d after a clean stop, want 0", i, v.ResumeCount)
		}
	}
}
