package workercli

import (
	"context"
	"encoding/json"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
)

type syncBuf = testsupport.SyncBuffer

// TestWorkerProbesFollowTheServer: a worker's --metrics server answers
// /readyz 200 while its server runs, 503 with a reason while it is down,
// and 200 again once it is back; /healthz stays 200 while reconnecting.
func TestWorkerProbesFollowTheServer(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	srv.Store(t, kv.Config{}) // the engine's layout, as an engine would create it
	var out, errb syncBuf
	cmd := New(&out, &errb, nil)
	cmd.SetArgs([]string{"--nats-url", srv.URL(), "--metrics", "127.0.0.1:0", "--log-level", "debug"})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()
	t.Cleanup(func() {
		stop()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("worker did not stop")
		}
	})
	re := regexp.MustCompile(`metrics: (http://\S+)/metrics`)
	var base string
	testsupport.Eventually(t, 30*time.Second, func() bool {
		if m := re.FindStringSubmatch(out.String()); m != nil {
			base = m[1]
		}
		return base != ""
	}, "worker did not print its metrics address: %s %s", &out, &errb)
	probe := func(path string) (int, map[string]any) {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		return resp.StatusCode, body
	}
	if code, body := probe("/readyz"); code != 200 {
		t.Fatalf("readyz: %d %v", code, body)
	}
	srv.Stop()
	var last map[string]any
	testsupport.Eventually(t, 10*time.Second, func() bool {
		code, body := probe("/readyz")
		last = body
		return code == 503 && body["reason"] != nil
	}, "readyz not 503 with the server down: %v", &last)
	if code, _ := probe("/healthz"); code != 200 {
		t.Fatalf("healthz while reconnecting: %d", code)
	}
	srv.Restart(t)
	testsupport.Eventually(t, 30*time.Second, func() bool {
		code, body := probe("/readyz")
		last = body
		return code == 200
	}, "readyz not back to 200 after the server returned: %v", &last)
}
