package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// gate is an HTTP service whose calls wait until it is opened.
type gate struct {
	open    chan struct{}
	once    sync.Once
	waiting atomic.Int64
	srv     *httptest.Server
}

func newGate(t *testing.T) *gate {
	g := &gate{open: make(chan struct{})}
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.waiting.Add(1)
		select {
		case <-g.open:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"path": %q}`, r.URL.Path)
	}))
	t.Cleanup(func() { g.release(); g.srv.Close() })
	return g
}

func (g *gate) release() { g.once.Do(func() { close(g.open) }) }

// insufficientResources is the server's JSInsufficientResourcesErr code
// (storage full), which nats.go does not name.
const insufficientResources jetstream.ErrorCode = 10023

func isStorageFull(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == insufficientResources
}

// fill publishes into a ballast stream until the server refuses even a
// small message, and returns how much it stored.
func fill(t *testing.T, ctx context.Context, js jetstream.JetStream) int {
	t.Helper()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BALLAST", Subjects: []string{"ballast"}}); err != nil {
		t.Fatal(err)
	}
	stored := 0
	for _, size := range []int{64 << 10, 4 << 10, 256, 16} {
		chunk := make([]byte, size)
		for range (16 << 20) / size { // bounded: the limit is far below
			_, err := js.Publish(ctx, "ballast", chunk)
			if isStorageFull(err) {
				break
			}
			if err != nil {
				t.Fatalf("ballast: %v", err)
			}
			stored += size
		}
	}
	return stored
}

// TestStorageFullWhileJobsRun fills the embedded server's storage
// (--max-store) while jobs are in flight: writes must fail loudly (the
// engine's and workers' logs and a refused start say why), no job may
// fail or lose a step, and every job must complete once space is freed.
func TestStorageFullWhileJobsRun(t *testing.T) {
	t.Parallel()
	const jobs = 6
	g := newGate(t)
	addr := freeAddr(t)
	url := "nats://" + addr
	eng := spawn(t, nil, testsupport.Binary(t, "engine"), "serve", "--listen", addr, "--http=", "--data-dir", t.TempDir(),
		"--sync", "interval", "--max-store", "4MiB", "--workers", "8", "--service", "gate="+g.srv.URL)
	testsupport.Eventually(t, 20*time.Second, func() bool { return strings.Contains(eng.out.String(), "engine running") },
		"engine serve did not start:\n%s", lazy(eng.errOut.String))

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	wf := "testdata/gated.yaml"
	for i := range jobs {
		if out, errOut, code := engineCLI(t, ctx, url, "start", wf, "--job-id", fmt.Sprintf("full-%d", i)); code != 0 {
			t.Fatalf("start: exit %d\n%s%s", code, out, errOut)
		}
	}
	testsupport.Eventually(t, 20*time.Second, func() bool { return g.waiting.Load() >= jobs },
		"only %v of %d first calls reached the gate", lazyInt(g.waiting.Load), jobs)

	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	store, err := kv.Open(ctx, js, crashKV, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ballast: %d bytes stored before the server refused", fill(t, ctx, js))

	// Full: a new job is refused loudly, and the calls in flight return.
	_, errOut, code := engineCLI(t, ctx, url, "start", wf, "--job-id", "refused")
	if code == 0 || !strings.Contains(errOut, "JetStream's storage is full") || !strings.Contains(errOut, "--max-store") {
		t.Errorf("start while storage is full: exit %d, stderr %q; want a failure saying storage is full and how to raise it", code, errOut)
	}
	g.release()
	testsupport.Eventually(t, 30*time.Second, func() bool {
		return strings.Contains(strings.ToLower(eng.errOut.String()), "insufficient")
	}, "no process logged the refused writes:\n%s", lazy(eng.errOut.String))
	// Loudly: at warn or above, by Waymark's own engine or worker (the
	// default log level is warn), not only by the server.
	loud := loudStorageError.MatchString(eng.errOut.String())
	for i := range jobs {
		e, err := store.Checkpoints.Get(ctx, fmt.Sprintf("full-%d", i))
		if err != nil {
			t.Fatalf("job full-%d while full: %v", i, err)
		}
		if e.Checkpoint.Status == schemas.JobFailed {
			t.Errorf("job full-%d failed while storage was full: %v", i, e.Checkpoint.Error)
		}
	}

	// Space freed: every job goes on and completes with every step's output.
	if err := js.DeleteStream(ctx, "BALLAST"); err != nil {
		t.Fatal(err)
	}
	for i := range jobs {
		cp := waitStatus(t, store, fmt.Sprintf("full-%d", i), schemas.JobCompleted, 60*time.Second)
		var state map[string]struct{ Path string }
		if err := json.Unmarshal(cp.State, &state); err != nil {
			t.Fatalf("job full-%d: state %s: %v", i, cp.State, err)
		}
		attempts := map[string]int{}
		for _, step := range []string{"a", "b", "c", "d"} {
			if state[step].Path != "/"+step {
				t.Errorf("job full-%d: state %s lacks step %s's output", i, cp.State, step)
			}
			if r := cp.Steps[step]; r != nil {
				attempts[step] = r.Attempts
			}
		}
		t.Logf("job full-%d completed; attempts per step (absent: 1) %v", i, attempts)
	}
	if !loud {
		t.Errorf("no Waymark engine or worker line at warn or above reported the refused writes:\n%s", eng.errOut.String())
	}
}

// loudStorageError matches a Waymark engine or worker log line at warn or
// above that reports a write refused for lack of storage.
var loudStorageError = regexp.MustCompile(`(?m)^.*level=(WARN|ERROR).*component=(engine|worker).*(insufficient resources|10023).*$`)

type lazyInt func() int64

func (f lazyInt) String() string { return fmt.Sprint(f()) }
