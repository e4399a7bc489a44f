package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"
)

// TestDropAfterCommit: the effect is performed and persisted, the client
// gets a connection error, and a retry with the same key is safe for every
// class but unsafe.
func TestDropAfterCommit(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		retryStatus int
		wantEffects int // after the retry
	}{
		{NameTickets, http.StatusOK, 1},
		{NamePayments, http.StatusOK, 1},
		{NameRecords, http.StatusOK, 1},
		{NameMail, http.StatusCreated, 2}, // the hazard an unsafe effect carries
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var dropped atomic.Bool // drop the first answer only
			b := setup(t, tt.name, Options{DropAfterCommit: func(key string) bool {
				return key == "lost" && dropped.CompareAndSwap(false, true)
			}})
			req := effectRequests[tt.name]
			if r, err := req.send(b, "lost"); err == nil {
				t.Fatalf("dropped request answered %d %s; want a connection error", r.status, r.body)
			}
			b.wantCounts("lost", 1, 1) // it happened

			b.restart() // and it was persisted before the drop
			b.wantCounts("lost", 1, 1)

			r, err := req.send(b, "lost")
			if err != nil {
				t.Fatalf("retry: %v", err)
			}
			r.want(t, tt.retryStatus)
			if tt.name != NameMail && !bytes.Contains(r.body, []byte(firstID[tt.name])) {
				t.Errorf("retry answered %s, want the first effect %s", r.body, firstID[tt.name])
			}
			b.wantCounts("lost", 2, tt.wantEffects)
		})
	}
}

func TestFailNext(t *testing.T) {
	t.Parallel()
	b := setup(t, NamePayments, Options{FailNext: 2})
	req := effectRequests[NamePayments]
	for i := range 2 {
		r, err := req.send(b, "k")
		if err != nil {
			t.Fatal(err)
		}
		r.wantError(t, http.StatusServiceUnavailable, CodeUnavailable, "nothing was done")
		if i == 0 {
			b.wantCounts("k", 1, 0)
		}
	}
	r, err := req.send(b, "k")
	if err != nil {
		t.Fatal(err)
	}
	r.want(t, http.StatusCreated)
	b.wantCounts("k", 3, 1)

	// Re-armed at run time, from Go and over HTTP.
	b.run.Service.FailNext(1)
	b.must("GET", "/v1/charges", "").wantError(t, http.StatusServiceUnavailable, CodeUnavailable, "FailNext")
	b.must("GET", "/v1/charges", "").want(t, http.StatusOK)
	f := decode[Faults](t, b.must("POST", "/v1/_faults", `{"fail_next": 1}`).want(t, http.StatusOK).body)
	if f.FailNext != 1 || f.DropNext != 0 {
		t.Errorf("POST /v1/_faults = %+v", f)
	}
	b.must("GET", "/v1/charges", "").want(t, http.StatusServiceUnavailable)
	if f := decode[Faults](t, b.must("GET", "/v1/_faults", "").want(t, http.StatusOK).body); f.FailNext != 0 {
		t.Errorf("fail_next after use = %d", f.FailNext)
	}
	b.must("POST", "/v1/_faults", `{"fail_next": -1}`).wantError(t, http.StatusBadRequest, CodeInvalidRequest, "fail_next")
}

// TestDropNext arms a drop over HTTP, as a crash test driving a separate
// process would.
func TestDropNext(t *testing.T) {
	t.Parallel()
	b := setup(t, NameMail, Options{})
	b.must("POST", "/v1/_faults", `{"drop_next": 1}`).want(t, http.StatusOK)
	req := effectRequests[NameMail]
	if _, err := req.send(b, "k"); err == nil {
		t.Fatal("want a connection error")
	}
	if r, err := req.send(b, "k"); err != nil || r.status != http.StatusCreated {
		t.Fatalf("second send: %v %+v", err, r)
	}
	b.wantCounts("k", 2, 2)
}

// TestDelay: the effect is persisted before the delayed answer, and a
// client that gives up leaves it in place: an ambiguous outcome.
func TestDelay(t *testing.T) {
	t.Parallel()
	b := setup(t, NameTickets, Options{Delay: time.Hour})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := sendWith(ctx, b.client, b.run.URL, "POST", "/v1/tickets/batch", `{"tickets": [{"title": "slow"}]}`, IdempotencyKeyHeader, "slow")
		done <- err
	}()
	checkFor(t, 10*time.Second, func() error {
		if n := b.run.Stats().Effects["slow"]; n != 1 {
			return fmt.Errorf("effects[slow] = %d", n)
		}
		return nil
	})
	cancel() // the caller's timeout
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("client error = %v, want context.Canceled", err)
	}
	// The retry is a replay, not delayed.
	r := b.must("POST", "/v1/tickets/batch", `{"tickets": [{"title": "slow"}]}`, IdempotencyKeyHeader, "slow").want(t, http.StatusOK)
	if r.header.Get(ReplayedHeader) != "true" {
		t.Errorf("retry not marked replayed: %v", r.header)
	}
}

// TestGoTransportResends documents a trap for callers: on a reused
// keep-alive connection, net/http resends a request carrying an
// Idempotency-Key when the connection closes before the answer. The caller
// sees only the second answer; for an unsafe effect that is a second send.
func TestGoTransportResends(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		wantStatus  int
		wantEffects int
	}{
		{NameTickets, http.StatusOK, 1},
		{NameMail, http.StatusCreated, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tt.name, Options{})
			tr := &http.Transport{}
			t.Cleanup(tr.CloseIdleConnections)
			c := &http.Client{Transport: tr}
			// Leave an idle connection for the next request to reuse.
			if _, err := sendWith(t.Context(), c, b.run.URL, "GET", "/v1/_stats", ""); err != nil {
				t.Fatal(err)
			}
			b.run.Service.DropNext(1)
			req := effectRequests[tt.name]
			r, err := sendWith(t.Context(), c, b.run.URL, req.method, req.path, req.body, IdempotencyKeyHeader, "k")
			if err != nil {
				t.Fatalf("want the transport's silent resend to answer; got %v", err)
			}
			r.want(t, tt.wantStatus)
			b.wantCounts("k", 2, tt.wantEffects)
		})
	}
}

func TestStartStopsWithContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	run, err := Start(ctx, NameRecords, Options{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = run.Close() })
	tr := &http.Transport{DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	if _, err := sendWith(t.Context(), c, run.URL, "GET", "/v1/_stats", ""); err != nil {
		t.Fatal(err)
	}
	cancel()
	checkFor(t, 10*time.Second, func() error {
		if _, err := sendWith(t.Context(), c, run.URL, "GET", "/v1/_stats", ""); err == nil {
			return errors.New("still serving")
		}
		return nil
	})
	if err := run.Close(); err != nil {
		t.Errorf("Close after the context ended: %v", err)
	}
}
