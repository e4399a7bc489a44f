package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/steps"
)

// clusterKV is the layout of the cluster test: every stream and bucket
// with three replicas, and one-second ack waits so that what a lost node
// took with it comes back within seconds.
var clusterKV = kv.Config{Replicas: 3, InboxAckWait: time.Second, WorkAckWait: time.Second}

// TestClusterLosesItsLeaders runs jobs of the soak workflow (an
// idempotent charge and a looked-up record per job) with an in-process
// engine and worker on a three-node JetStream cluster whose streams and
// buckets have three replicas. Mid-run it shuts down the server that
// leads the checkpoint bucket's stream, starts more jobs while it is
// down, and restarts it; then the same with the server that leads the
// work stream. Nothing may be lost (every job completes, by the recovery
// paths that take seconds) and nothing applied twice (chaosVerify:
// checkpoints, history, effects, ledger). The engine and the worker have
// their default settings; the log says how long each node's loss held the
// jobs up.
func TestClusterLosesItsLeaders(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("the cluster test shuts down cluster nodes under running jobs; skipped with -short")
	}
	began := time.Now()
	log := resilLogger(t)
	c := testsupport.StartCluster(t, 3)
	store := c.Store(t, clusterKV)
	js := store.JS
	// Every stream of the layout, buckets included, has three replicas.
	lctx, lcancel := context.WithTimeout(context.Background(), 10*time.Second)
	streams := js.ListStreams(lctx)
	n := 0
	for info := range streams.Info() {
		n++
		if info.Config.Replicas != 3 {
			t.Errorf("stream %s has %d replicas; want 3", info.Config.Name, info.Config.Replicas)
		}
	}
	if err := streams.Err(); err != nil {
		t.Fatal(err)
	}
	lcancel()
	if n < 5 {
		t.Fatalf("%d streams on the cluster; want the whole layout (work, inbox, history, three buckets, ...)", n)
	}
	clusterReady := time.Since(began)

	dir := t.TempDir()
	services := startDemos(t, dir, 50*time.Millisecond)
	env := &steps.Env{Services: map[string]string{}}
	for name, r := range services {
		env.Services[name] = r.URL
	}
	watch := startChaosWatch(t, store)
	resilRunEngine(t, engine.Config{Store: c.Store(t, clusterKV), Logger: log})
	resilRunWorker(t, steps.WorkerConfig{Store: c.Store(t, clusterKV), Env: env, ID: "worker", Logger: log})
	cl := client.New(c.Store(t, clusterKV))
	def := loadDef(t, "testdata/soak.yaml")

	var ids []string
	// startJobs starts n more jobs, retrying each while the cluster elects
	// a leader (Start attaches to a job it already stored).
	startJobs := func(n int) []string {
		var batch []string
		for range n {
			id := fmt.Sprintf("cluster-%04d", len(ids)+1)
			input := json.RawMessage(fmt.Sprintf(`{"order_id": %q, "amount_cents": %d}`, id, 100+len(ids)))
			var err error
			testsupport.Eventually(t, 20*time.Second, func() bool {
				sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				defer cancel()
				_, err = cl.Start(sctx, def, input, client.StartOptions{JobID: id})
				return err == nil
			}, "start job %s: %v", id, lazyErr{&err})
			ids = append(ids, id)
			batch = append(batch, id)
		}
		return batch
	}
	// waitStopped waits until every job of batch has stopped. The bound
	// covers what losing a node costs today: requests in flight to it get no
	// answer, so the engine waits out its publish timeout (10s) and the
	// worker its step timeout (10s, the soak workflow's) before they try
	// again. A job left to the reconciler's lost-attempt deadline (the step
	// timeout, two work ack waits and 30s) fails it.
	waitStopped := func(batch []string, what string, trace func() string) {
		testsupport.Eventually(t, 40*time.Second, func() bool { return watch.stopped(batch) == len(batch) },
			"%s: jobs still running: %s (stopped jobs over time: %s)", what, resilLazy(func() string { return watch.unfinished(batch) }), resilLazy(trace))
	}
	const perPhase = 60

	// trace samples how many jobs of batch have stopped, every 500ms from
	// since until the returned function is called; that returns the
	// samples.
	trace := func(batch []string, since time.Time) func() string {
		done := make(chan struct{})
		var samples []string
		finished := make(chan struct{})
		go func() {
			defer close(finished)
			tick := time.NewTicker(500 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-done:
					return
				case <-tick.C:
					samples = append(samples, fmt.Sprintf("%.1fs:%d", time.Since(since).Seconds(), watch.stopped(batch)))
				}
			}
		}()
		var once sync.Once
		t.Cleanup(func() { once.Do(func() { close(done); <-finished }) }) // stops it when a wait fails
		return func() string {
			once.Do(func() { close(done); <-finished })
			return strings.Join(samples, " ")
		}
	}
	for _, stream := range []string{"KV_" + store.Names.CheckpointBucket, store.Names.WorkStream} {
		c.WaitStreamsCurrent(t, js, 30*time.Second)
		batch := startJobs(perPhase)
		// Mid-run: some jobs of the batch have completed, others not.
		testsupport.Eventually(t, 20*time.Second, func() bool { return watch.stopped(batch) >= perPhase/4 },
			"no progress before shutting down the leader of %s", stream)
		leader := c.StreamLeader(t, js, stream, 30*time.Second)
		running := len(batch) - watch.stopped(batch)
		down := time.Now()
		c.Stop(leader)
		newLeader := c.StreamLeader(t, js, stream, 30*time.Second)
		elected := time.Since(down)
		// The cluster goes on with two nodes: the jobs in flight and the
		// jobs started now complete while the old leader is down.
		batch = append(batch, startJobs(perPhase/2)...)
		stopTrace := trace(batch, down)
		waitStopped(batch, "with "+leader.Name+" down", stopTrace)
		whileDown := time.Since(down)
		c.Restart(t, leader)
		t.Logf("cluster: %s: leader %s shut down with %d of %d jobs running, %s led after %v; all %d completed with it down in %v (stopped jobs over time: %s); back after %v",
			stream, leader.Name, running, perPhase, newLeader.Name, elected.Round(time.Millisecond), len(batch), whileDown.Round(time.Millisecond), stopTrace(), time.Since(down).Round(time.Millisecond))
	}
	// And once both are back.
	c.WaitStreamsCurrent(t, js, 30*time.Second)
	startJobs(perPhase / 2)
	lastTrace := trace(ids, time.Now())
	waitStopped(ids, "after both restarts", lastTrace)
	lastTrace()

	out := chaosVerify(t, store, watch, services, def, ids, 3)
	t.Logf("cluster: %d jobs completed of %d in %v (cluster ready in %v); %s", out.completed, len(ids), time.Since(began).Round(time.Millisecond), clusterReady.Round(time.Millisecond), out)
}

// lazyErr prints an error variable when a wait fails, not when it starts.
type lazyErr struct{ err *error }

func (l lazyErr) String() string {
	if *l.err == nil {
		return "no error"
	}
	var apiErr *jetstream.APIError
	if errors.As(*l.err, &apiErr) {
		return fmt.Sprintf("%v (JetStream error code %d)", *l.err, apiErr.ErrorCode)
	}
	return fmt.Sprint(*l.err)
}
