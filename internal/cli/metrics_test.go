package cli

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// TestMetricsFollowTheCounters runs one two-step job through an engine and
// a worker and reads their Prometheus counters as /metrics serves them.
func TestMetricsFollowTheCounters(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	store := srv.Store(t, kv.Config{})
	eng, err := engine.New(engine.Config{Store: srv.Store(t, kv.Config{}), ReconcileInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	w, err := steps.NewWorker(steps.WorkerConfig{Store: srv.Store(t, kv.Config{})})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{}, 2)
	for _, run := range []func(context.Context) error{eng.Run, w.Run} {
		go func() { _ = run(rctx); done <- struct{}{} }()
	}
	defer func() { stop(); <-done; <-done }()

	def, err := schemas.Parse("m.yaml", []byte("name: m\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    next: [{to: b}]\n  - id: b\n    kind: noop\n"),
		schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatal(err)
	}
	cl := client.New(store)
	res, err := cl.Start(ctx, def, nil, client.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := cl.Wait(ctx, res.JobID, nil); err != nil || v.Status != schemas.JobCompleted {
		t.Fatalf("job: %v %v", v, err)
	}

	reg := prometheus.NewRegistry()
	registerEngineMetrics(reg, eng)
	registerWorkerMetrics(reg, w)
	var got map[string]float64
	testsupport.Eventually(t, 5*time.Second, func() bool {
		got = gather(t, reg)
		return got["waymark_engine_jobs_completed_total"] == 1 && got["waymark_worker_steps_succeeded_total"] == 2
	}, "metrics never showed the job: %v", lazyMap{&got})
	for name, want := range map[string]float64{
		"waymark_engine_jobs_started_total":         1,
		"waymark_engine_steps_dispatched_total":     2,
		"waymark_engine_results_applied_total":      2,
		"waymark_engine_requeued_total":             0,
		"waymark_worker_results_published_total":    2,
		"waymark_worker_effects_settled_late_total": 0,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s = %v (served %v), want %v", name, v, ok, want)
		}
	}
	if got["waymark_engine_first_progress_seconds"] <= 0 {
		t.Errorf("first progress %v s; want it set once the engine applied a transition", got["waymark_engine_first_progress_seconds"])
	}
}

func gather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch {
			case m.GetCounter() != nil:
				out[mf.GetName()] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[mf.GetName()] = m.GetGauge().GetValue()
			}
		}
	}
	return out
}

// lazyMap prints a map when a wait fails.
type lazyMap struct{ m *map[string]float64 }

func (l lazyMap) String() string { return fmt.Sprint(*l.m) }
