package steps

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// TestRateLimitIsSharedByWorkers: a 429 with Retry-After seen by one
// worker holds the provider (for that key) in JetStream; another worker's
// call then waits without reaching the provider. Both attempts end as
// CodeWaiting with the time to wait (the engine dispatches them again then,
// without using up an attempt); once it has passed, calls go through.
func TestRateLimitIsSharedByWorkers(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	st := srv.Store(t, kv.Config{})
	var calls atomic.Int64
	w := liveWires[0]
	b := setupModel(t, w, func(ctx context.Context, req fakemodel.Request) fakemodel.Response {
		if calls.Add(1) == 1 {
			return fakemodel.Response{Status: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"1"}}, Text: "slow down"}
		}
		return fakemodel.Response{Text: `{"label": "bug"}`}
	}, ModelAuto, map[string]string{w.keyEnv: testKey})
	b.env.RateLimits = st.Limits // what NewWorker gives every worker of the deployment
	def := parseDef(t, modelWorkflow(w.provider, ""))
	first, second := mustPrepare(t, def, "classify", b.env), mustPrepare(t, def, "classify", b.env)
	call := func() *Call {
		c := newCall(def, "classify", modelState)
		c.Vars = map[string]string{"tone": "terse"}
		return c
	}
	waiting := func(err error) *schemas.Error {
		t.Helper()
		var e *schemas.Error
		if !errors.As(err, &e) || e.Code != schemas.CodeWaiting || e.RetryAfterMs <= 0 || e.RetryAfterMs > 1000 {
			t.Fatalf("error %v, want CodeWaiting with a wait of at most 1s", err)
		}
		return e
	}
	_, err := first.Run(t.Context(), call())
	waiting(err)
	_, err = second.Run(t.Context(), call())
	if e := waiting(err); calls.Load() != 1 {
		t.Fatalf("the second worker called the provider while it was rate limited (%d calls): %v", calls.Load(), e)
	}
	testsupport.Eventually(t, 5*time.Second, func() bool {
		_, err := second.Run(t.Context(), call())
		return err == nil
	}, "calls never went through after the wait")
	if n := calls.Load(); n != 2 {
		t.Errorf("provider calls %d, want 2 (the 429, then one after the wait)", n)
	}
}
