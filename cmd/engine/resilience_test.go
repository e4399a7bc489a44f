package main

// Resilience tests: what DESIGN.md's failure model promises when a worker
// stalls past its lease, when the NATS server restarts under a running job,
// when a step kills every worker that takes it, and when engine and worker
// processes are killed at random. Every test runs a real embedded
// nats-server; the ones that need a crash kill real processes with SIGKILL.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// resilKV is the layout of the lease tests: a one-second lease, so that a
// stalled worker loses its step quickly.
var resilKV = kv.Config{InboxAckWait: time.Second, WorkAckWait: time.Second}

// resilDef parses a workflow written in YAML with the engine's checks.
func resilDef(t *testing.T, src string) *schemas.Definition {
	t.Helper()
	def, err := schemas.Parse(strings.ReplaceAll(t.Name(), "/", "_")+".yaml", []byte(src),
		schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatalf("parse workflow: %v", err)
	}
	return def
}

// resilLogger collects the log of the in-process engine and workers, and
// prints its tail if the test fails. Register it first: its cleanup then
// runs last, after everything that logs has stopped.
func resilLogger(t *testing.T) *slog.Logger {
	buf := &syncBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log of the in-process engine and workers:\n%s", lastLines(buf.String(), 60))
		}
	})
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// resilEngine runs an in-process engine on store until the test ends.
// The reconciler is off: these tests are about other recovery paths.
func resilEngine(t *testing.T, store *kv.Store, log *slog.Logger) *engine.Engine {
	t.Helper()
	return resilRunEngine(t, engine.Config{Store: store, Logger: log, ReconcileInterval: -1})
}

// resilRunEngine runs an engine with cfg until the test ends.
func resilRunEngine(t *testing.T, cfg engine.Config) *engine.Engine {
	t.Helper()
	e, err := engine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := e.Run(ctx); err != nil {
			t.Errorf("engine run: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return e
}

// resilWorker runs an in-process worker named id on store until the test
// ends, running up to concurrency steps at once (0: the default).
func resilWorker(t *testing.T, store *kv.Store, env *steps.Env, fp *failpoint.Set, id string, concurrency int, log *slog.Logger) *steps.Worker {
	t.Helper()
	return resilRunWorker(t, steps.WorkerConfig{Store: store, Env: env, ID: id, Failpoints: fp, Concurrency: concurrency, Logger: log})
}

// resilRunWorker runs a worker with cfg until the test ends.
func resilRunWorker(t *testing.T, cfg steps.WorkerConfig) *steps.Worker {
	t.Helper()
	if cfg.FetchWait == 0 {
		cfg.FetchWait = 200 * time.Millisecond // a stop waits for the last pull
	}
	w, err := steps.NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := w.Run(ctx); err != nil {
			t.Errorf("worker %s: %v", cfg.ID, err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return w
}

// resilPoolWorker runs an in-process worker of pool until the test ends.
func resilPoolWorker(t *testing.T, store *kv.Store, env *steps.Env, id, pool string, log *slog.Logger) *steps.Worker {
	t.Helper()
	return resilRunWorker(t, steps.WorkerConfig{Store: store, Env: env, ID: id, Pool: pool, Logger: log})
}

func resilFailpoints(t *testing.T, spec string) *failpoint.Set {
	t.Helper()
	fp, err := failpoint.Parse(spec)
	if err != nil {
		t.Fatal(err)
	}
	return fp
}

// resilLazy formats when a failure message is printed, not when the
// condition polling starts.
type resilLazy func() string

func (f resilLazy) String() string { return f() }

// resilWaitStopped polls the job's checkpoint until the job stops
// (completed, failed, or waiting for a person). Polling, not a watch: it
// keeps working across a server restart.
func resilWaitStopped(t *testing.T, cl *client.Client, id string, timeout time.Duration) *client.JobView {
	t.Helper()
	var v *client.JobView
	var last error
	testsupport.Eventually(t, timeout, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		v, last = cl.Job(ctx, id)
		return last == nil && v.Status.Stopped()
	}, "job %s did not stop (last read: %v)", id, resilLazy(func() string { return fmt.Sprintf("%+v, err %v", v, last) }))
	return v
}

// resilHistory waits until job's history holds its terminal event, then
// counts the events by "type" and by "type step".
func resilHistory(t *testing.T, cl *client.Client, id string) map[string]int {
	t.Helper()
	var counts map[string]int
	testsupport.Eventually(t, 10*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		evs, err := cl.History(ctx, id)
		if err != nil {
			return false
		}
		counts = map[string]int{}
		for _, h := range evs {
			counts[h.Type]++
			if h.Data.Step != "" {
				counts[h.Type+" "+h.Data.Step]++
			}
		}
		return counts[schemas.EventJobCompleted]+counts[schemas.EventJobFailed] > 0
	}, "the history of job %s never recorded its end", id)
	return counts
}

// resilGate is a connection to an in-process server that the test can
// freeze: while frozen, nothing the client writes reaches the server. A
// worker on a frozen connection behaves like a stalled process (a long GC
// pause, a VM migration, SIGSTOP): it sends no heartbeat and no write, so
// its lease runs out while it still holds the step.
type resilGate struct {
	srv  *testsupport.Server
	mu   sync.Mutex
	open chan struct{} // closed while traffic flows
}

func newResilGate(srv *testsupport.Server) *resilGate {
	open := make(chan struct{})
	close(open)
	return &resilGate{srv: srv, open: open}
}

// InProcessConn implements nats.InProcessConnProvider.
func (g *resilGate) InProcessConn() (net.Conn, error) {
	c, err := g.srv.InProcessConn()
	if err != nil {
		return nil, err
	}
	return &resilGatedConn{Conn: c, g: g}, nil
}

func (g *resilGate) freeze() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
		g.open = make(chan struct{})
	default:
	}
}

func (g *resilGate) thaw() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

type resilGatedConn struct {
	net.Conn
	g *resilGate
}

func (c *resilGatedConn) Write(p []byte) (int, error) {
	c.g.mu.Lock()
	open := c.g.open
	c.g.mu.Unlock()
	<-open
	return c.Conn.Write(p)
}

// resilStore opens the layout over its own connection through gate.
func resilStore(t *testing.T, gate *resilGate, name string, cfg kv.Config) *kv.Store {
	t.Helper()
	nc, err := nats.Connect("", nats.InProcessServer(gate), nats.Name(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return testsupport.OpenStore(t, nc, cfg)
}

// resilRaceBundle is one lease-race case: a server, the test's store and client,
// an in-process engine, and one bundled provider.
type resilRaceBundle struct {
	srv    *testsupport.Server
	store  *kv.Store
	client *client.Client
	eng    *engine.Engine
	svc    *demo.Running
	env    *steps.Env
	log    *slog.Logger
}

func resilSetupRace(t *testing.T, service string) *resilRaceBundle {
	t.Helper()
	b := &resilRaceBundle{log: resilLogger(t)}
	b.srv = testsupport.StartServer(t, testsupport.ServerOptions{})
	b.store = b.srv.Store(t, resilKV)
	b.client = client.New(b.store)
	svc, err := demo.Start(context.Background(), service, demo.Options{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Close() })
	b.svc = svc
	b.env = &steps.Env{Services: map[string]string{service: svc.URL}}
	b.eng = resilEngine(t, b.srv.Store(t, resilKV), b.log)
	return b
}

// workInFlight reports the default pool's consumer counts: messages
// delivered and not yet acknowledged, and messages not yet delivered.
func (b *resilRaceBundle) workInFlight() (ackPending int, pending uint64, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	cons, err := b.store.JS.Consumer(ctx, b.store.Names.WorkStream, b.store.Names.WorkConsumer(schemas.DefaultPool))
	if err != nil {
		return 0, 0, err
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return 0, 0, err
	}
	return info.NumAckPending, info.NumPending, nil
}

// checkCompletedOnce checks that the engine applied one result and
// completed the job once. Its counters move just after the checkpoint
// write and the history publish, so wait for them first.
func (b *resilRaceBundle) checkCompletedOnce(t *testing.T) {
	t.Helper()
	testsupport.Eventually(t, 5*time.Second, func() bool { return b.eng.Stats().JobsCompleted >= 1 },
		"the engine never counted the job completed")
	if s := b.eng.Stats(); s.JobsCompleted != 1 || s.ResultsApplied != 1 {
		t.Errorf("engine: %d jobs completed, %d results applied; want 1 and 1", s.JobsCompleted, s.ResultsApplied)
	}
}

const resilChargeWorkflow = `
name: race-charge
version: 1
defaults:
  timeout: 20s
  retry: {max_attempts: 1}
steps:
  - id: charge
    kind: http
    effect: idempotent
    with:
      method: POST
      url: '{{service "payments"}}/v1/charges'
      body: '{"amount_cents": 500, "currency": "eur", "order_id": {{json .job}}}'
    save_as: charge
`

const resilMailWorkflow = `
name: race-mail
version: 1
defaults:
  timeout: 20s
  retry: {max_attempts: 1}
steps:
  - id: notify
    kind: http
    effect: unsafe
    with:
      method: POST
      url: '{{service "mail"}}/v1/send'
      body: '{"to": "customer@example.com", "subject": {{json .job}}}'
    save_as: mail
`

// TestWorkersRaceAfterLeaseExpiry: a worker (A) stalls past its one-second
// lease holding a step; the step is delivered again to another worker (B),
// which performs it. When A wakes it must not call the provider again, and
// the job completes once. A serves the pool alone until it holds the step,
// so the stalled worker is always A; it runs one step at a time, so it has
// no pull request open while it stalls and the next delivery is B's.
func TestWorkersRaceAfterLeaseExpiry(t *testing.T) {
	t.Parallel()

	// A stalls right after receiving the step, before anything is
	// recorded: no heartbeat has started, so its lease simply runs out.
	// B performs the charge; A, awake, finds the job moved on (the
	// checkpoint fence) and drops its delivery without calling or
	// publishing.
	t.Run("stalled after receive", func(t *testing.T) {
		t.Parallel()
		b := resilSetupRace(t, demo.NamePayments)
		def := resilDef(t, resilChargeWorkflow)
		a := resilWorker(t, b.srv.Store(t, resilKV), b.env, resilFailpoints(t, "worker.after_receive=delay=4s"), "worker-a", 1, b.log)

		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		const job = "race-receive"
		if _, err := b.client.Start(ctx, def, nil, client.StartOptions{JobID: job}); err != nil {
			t.Fatal(err)
		}
		testsupport.Eventually(t, 10*time.Second, func() bool {
			ack, pending, err := b.workInFlight()
			return err == nil && ack == 1 && pending == 0
		}, "worker A never took the step")
		bw := resilWorker(t, b.srv.Store(t, resilKV), b.env, resilFailpoints(t, ""), "worker-b", 0, b.log)

		v := resilWaitStopped(t, b.client, job, 20*time.Second)
		if v.Status != schemas.JobCompleted {
			t.Fatalf("job %s: %v", v.Status, v.Error)
		}
		testsupport.Eventually(t, 10*time.Second, func() bool { return a.Stats().Stale == 1 },
			"worker A never dropped its stale delivery: %v", resilLazy(func() string { return fmt.Sprintf("%+v", a.Stats()) }))

		if s := a.Stats(); s.Published != 0 || s.ReplayedEffects != 0 || s.Succeeded != 0 || s.Failed != 0 {
			t.Errorf("stalled worker A, after waking: %+v; want only one stale attempt: no result, no replay", s)
		}
		if s := bw.Stats(); s.Published != 1 || s.Redeliveries != 1 {
			t.Errorf("worker B: %+v; want the redelivered step performed and one result published", s)
		}
		key := job + "/charge"
		st := b.svc.Stats()
		if st.Calls[key] != 1 || st.Effects[key] != 1 || len(st.Calls) != 1 {
			t.Errorf("payments: calls %v, effects %v; want exactly one call and one charge for %s", st.Calls, st.Effects, key)
		}
		rec, err := b.store.Effects.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if rec.Record.State != schemas.EffectConfirmed || rec.Record.Worker != "worker-b" || rec.Record.Delivery != 2 || rec.Record.Calls != 1 {
			t.Errorf("ledger: %s by %s, delivery %d, %d calls; want confirmed by worker-b on delivery 2 after one call",
				rec.Record.State, rec.Record.Worker, rec.Record.Delivery, rec.Record.Calls)
		}
		if v.Steps[0].Attempts != 1 || v.ResumeCount != 1 {
			t.Errorf("step dispatched %d times, resume_count %d; want 1 and 1 (one redelivery)", v.Steps[0].Attempts, v.ResumeCount)
		}
		h := resilHistory(t, b.client, job)
		if h[schemas.EventJobCompleted] != 1 || h[schemas.EventStepCompleted] != 1 {
			t.Errorf("history: %d job.completed, %d step.completed; want 1 each", h[schemas.EventJobCompleted], h[schemas.EventStepCompleted])
		}
		b.checkCompletedOnce(t)
	})

	// A stalls after recording the effect prepared, holding the step, and
	// its whole process is frozen (no heartbeats: its connection is
	// held), so its lease runs out. B, a later delivery, takes the effect
	// over, sends the mail once and confirms. A wakes, loses the
	// compare-and-swap on the record, finds it confirmed, and does not
	// send. Mail is unsafe: a second send could never be taken back.
	t.Run("stalled after prepared", func(t *testing.T) {
		t.Parallel()
		b := resilSetupRace(t, demo.NameMail)
		def := resilDef(t, resilMailWorkflow)
		gate := newResilGate(b.srv)
		a := resilWorker(t, resilStore(t, gate, "worker-a", resilKV), b.env, resilFailpoints(t, "worker.after_prepared=delay=4s"), "worker-a", 1, b.log)
		t.Cleanup(gate.thaw) // before A is stopped: it may be blocked writing

		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		const job = "race-prepared"
		key := job + "/notify"
		if _, err := b.client.Start(ctx, def, nil, client.StartOptions{JobID: job}); err != nil {
			t.Fatal(err)
		}
		testsupport.Eventually(t, 10*time.Second, func() bool {
			ent, err := b.store.Effects.Get(ctx, key)
			return err == nil && ent.Record.State == schemas.EffectPrepared && ent.Record.Worker == "worker-a"
		}, "worker A never recorded the effect prepared")
		gate.freeze()
		bw := resilWorker(t, b.srv.Store(t, resilKV), b.env, resilFailpoints(t, ""), "worker-b", 0, b.log)

		v := resilWaitStopped(t, b.client, job, 20*time.Second)
		if v.Status != schemas.JobCompleted {
			t.Fatalf("job %s: %v", v.Status, v.Error)
		}
		settled, err := b.store.Effects.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if r := settled.Record; r.State != schemas.EffectConfirmed || r.Worker != "worker-b" || r.Delivery != 2 || r.Calls != 1 {
			t.Fatalf("ledger before A wakes: %s by %s, delivery %d, %d calls; want confirmed by worker-b on delivery 2 after one call",
				r.State, r.Worker, r.Delivery, r.Calls)
		}
		if st := b.svc.Stats(); st.Calls[key] != 1 {
			t.Fatalf("mail calls before A wakes: %v; want 1", st.Calls)
		}
		gate.thaw()
		testsupport.Eventually(t, 10*time.Second, func() bool { s := a.Stats(); return s.Succeeded+s.Failed+s.Stale == 1 },
			"worker A never finished its stalled delivery: %v", resilLazy(func() string { return fmt.Sprintf("%+v", a.Stats()) }))

		t.Logf("stalled worker A after waking: %+v", a.Stats())
		if s := a.Stats(); s.ReplayedEffects+s.Stale != 1 || s.AmbiguousEffects != 0 || s.Failed != 0 {
			t.Errorf("stalled worker A, after waking: %+v; want its delivery answered from the ledger or dropped", s)
		}
		if s := bw.Stats(); s.Published != 1 || s.Redeliveries != 1 {
			t.Errorf("worker B: %+v; want the redelivered step performed and one result published", s)
		}
		st := b.svc.Stats()
		if st.Calls[key] != 1 || st.Effects[key] != 1 || len(st.Calls) != 1 {
			t.Errorf("mail: calls %v, effects %v; want exactly one mail sent for %s", st.Calls, st.Effects, key)
		}
		after, err := b.store.Effects.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if after.Revision != settled.Revision {
			t.Errorf("worker A wrote the settled record after waking: revision %d -> %d (%s by %s)",
				settled.Revision, after.Revision, after.Record.State, after.Record.Worker)
		}
		v, err = b.client.Job(ctx, job)
		if err != nil {
			t.Fatal(err)
		}
		if v.Status != schemas.JobCompleted || v.Steps[0].Attempts != 1 {
			t.Errorf("job %s, step dispatched %d times; want completed after one dispatch", v.Status, v.Steps[0].Attempts)
		}
		h := resilHistory(t, b.client, job)
		if h[schemas.EventJobCompleted] != 1 || h[schemas.EventStepCompleted] != 1 || h[schemas.EventEffectAmbiguous] != 0 {
			t.Errorf("history: %d job.completed, %d step.completed, %d effect.ambiguous; want 1, 1, 0",
				h[schemas.EventJobCompleted], h[schemas.EventStepCompleted], h[schemas.EventEffectAmbiguous])
		}
		b.checkCompletedOnce(t)
	})

	// A sends the mail, then its process freezes before the ledger hears
	// of it; its lease runs out. B finds the effect dispatched with no
	// outcome, and mail is unsafe: B declares it ambiguous and the job
	// stops for a person. A wakes with the answer in hand: the outcome is
	// known after all, so A reconciles the effect as happened with its
	// result, the job is told and completes, and no second mail is sent.
	t.Run("late answer settles an ambiguous effect", func(t *testing.T) {
		t.Parallel()
		b := resilSetupRace(t, demo.NameMail)
		def := resilDef(t, resilMailWorkflow)
		gate := newResilGate(b.srv)
		a := resilWorker(t, resilStore(t, gate, "worker-a", resilKV), b.env, resilFailpoints(t, "worker.after_remote_commit=delay=4s"), "worker-a", 1, b.log)
		t.Cleanup(gate.thaw)

		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		const job = "race-late"
		key := job + "/notify"
		if _, err := b.client.Start(ctx, def, nil, client.StartOptions{JobID: job}); err != nil {
			t.Fatal(err)
		}
		testsupport.Eventually(t, 10*time.Second, func() bool { return b.svc.Stats().Calls[key] == 1 },
			"worker A never sent the mail")
		gate.freeze()
		bw := resilWorker(t, b.srv.Store(t, resilKV), b.env, resilFailpoints(t, ""), "worker-b", 0, b.log)
		testsupport.Eventually(t, 20*time.Second, func() bool {
			v, err := b.client.Job(ctx, job)
			return err == nil && v.Status == schemas.JobNeedsReconciliation
		}, "worker B never declared the effect ambiguous")
		gate.thaw()

		// The settlement re-dispatches the step, which is answered from
		// the ledger: wait for the job to end.
		var v *client.JobView
		testsupport.Eventually(t, 20*time.Second, func() bool {
			v, _ = b.client.Job(ctx, job)
			return v != nil && v.Status.Terminal()
		}, "the job did not end after worker A's late answer: worker A %v", resilLazy(func() string { return fmt.Sprintf("%+v", a.Stats()) }))
		if v.Status != schemas.JobCompleted {
			t.Fatalf("job %s: %v", v.Status, v.Error)
		}
		if st := b.svc.Stats(); st.Calls[key] != 1 || st.Effects[key] != 1 {
			t.Errorf("mail: calls %v, effects %v; want one mail", st.Calls, st.Effects)
		}
		ent, err := b.store.Effects.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		r := ent.Record
		if r.State != schemas.EffectReconciled || r.Happened == nil || !*r.Happened || !strings.Contains(r.ReconciledBy, "worker-a") || len(r.Result) == 0 {
			t.Errorf("ledger: %s happened=%v by %q result %s; want reconciled as happened by worker-a with its result", r.State, r.Happened, r.ReconciledBy, r.Result)
		}
		if s := a.Stats(); s.SettledLate != 1 || s.Published != 0 {
			t.Errorf("worker A: %+v; want one late settlement and no result published", s)
		}
		if s := bw.Stats(); s.AmbiguousEffects != 1 {
			t.Errorf("worker B: %+v; want the effect declared ambiguous once", s)
		}
		h := resilHistory(t, b.client, job)
		if h[schemas.EventEffectAmbiguous] != 1 || h[schemas.EventEffectReconciled] != 1 || h[schemas.EventJobCompleted] != 1 {
			t.Errorf("history: %d effect.ambiguous, %d effect.reconciled, %d job.completed; want 1 each",
				h[schemas.EventEffectAmbiguous], h[schemas.EventEffectReconciled], h[schemas.EventJobCompleted])
		}
	})
}

// resilKeyCounter is an HTTP provider that counts calls per Idempotency-Key and
// holds calls to /slow until released.
type resilKeyCounter struct {
	mu      sync.Mutex
	calls   map[string]int // "path key" -> calls
	release chan struct{}
	srv     *httptest.Server
}

func newResilKeyCounter(t *testing.T) *resilKeyCounter {
	c := &resilKeyCounter{calls: map[string]int{}, release: make(chan struct{})}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		c.mu.Lock()
		c.calls[r.URL.Path+" "+r.Header.Get("Idempotency-Key")]++
		c.mu.Unlock()
		if r.URL.Path == "/slow" {
			select {
			case <-c.release:
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"path": %q}`, r.URL.Path)
	}))
	t.Cleanup(c.srv.Close)
	t.Cleanup(c.releaseAll) // runs first: no handler left waiting
	return c
}

func (c *resilKeyCounter) releaseAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-c.release:
	default:
		close(c.release)
	}
}

func (c *resilKeyCounter) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.calls))
	for k, v := range c.calls {
		out[k] = v
	}
	return out
}

const resilRestartWorkflow = `
name: restart
version: 1
defaults:
  timeout: 30s
  retry: {max_attempts: 3, backoff: {initial: 100ms, max: 1s}}
steps:
  - id: slow
    kind: http
    with: {method: POST, url: '{{service "svc"}}/slow', body: '{"job": {{json .job}}}'}
    save_as: slow
    next: [{to: after}]
  - id: after
    kind: http
    with: {method: POST, url: '{{service "svc"}}/after', body: '{"seen": {{json .state.slow}}}'}
    save_as: after
`

// TestServerRestartMidJob restarts the embedded nats-server (file storage
// kept) while a step is running on a worker: the engine and the worker,
// connected over TCP, reconnect; the worker keeps its lease on the step
// (its heartbeats resume, the step is not delivered again); the step's
// result is recorded and applied, and the job completes with every call
// made once and no step completed twice.
func TestServerRestartMidJob(t *testing.T) {
	t.Parallel()
	log := resilLogger(t)
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	// A restart takes well under the lease; heartbeats every second.
	cfg := kv.Config{InboxAckWait: 2 * time.Second, WorkAckWait: 3 * time.Second}
	store := srv.Store(t, cfg)
	cl := client.New(store)
	svc := newResilKeyCounter(t)
	engStore := srv.Store(t, cfg)
	workStore := srv.Store(t, cfg)
	eng := resilEngine(t, engStore, log)
	w := resilWorker(t, workStore, &steps.Env{Services: map[string]string{"svc": svc.srv.URL}}, nil, "worker", 0, log)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const job = "restart-1"
	if _, err := cl.Start(ctx, resilDef(t, resilRestartWorkflow), nil, client.StartOptions{JobID: job}); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		return svc.snapshot()["/slow "+job+"/slow"] == 1 && w.Stats().Heartbeats >= 1
	}, "the slow step never reached the provider with its lease extended")

	began := time.Now()
	srv.Restart(t)
	t.Logf("nats-server restarted in %v with the step in flight", time.Since(began).Round(time.Millisecond))
	testsupport.Eventually(t, 20*time.Second, func() bool {
		if !engStore.JS.Conn().IsConnected() || !workStore.JS.Conn().IsConnected() {
			return false
		}
		actx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err := workStore.JS.AccountInfo(actx)
		return err == nil
	}, "engine and worker did not reconnect")
	// Hold the step past the lease after the restart: only heartbeats that
	// reach the restarted server keep it from being delivered again.
	beats := w.Stats().Heartbeats
	testsupport.Eventually(t, 20*time.Second, func() bool { return w.Stats().Heartbeats >= beats+4 },
		"the worker's heartbeats did not resume after the restart")
	cons, err := workStore.JS.Consumer(ctx, store.Names.WorkStream, store.Names.WorkConsumer(schemas.DefaultPool))
	if err != nil {
		t.Fatal(err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.NumAckPending != 1 || info.NumRedelivered != 0 {
		t.Errorf("work consumer after the restart: %d in flight, %d redelivered; want the step still held by its first delivery",
			info.NumAckPending, info.NumRedelivered)
	}
	svc.releaseAll()

	v := resilWaitStopped(t, cl, job, 30*time.Second)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("job %s: %v", v.Status, v.Error)
	}
	t.Logf("job completed after the restart: resume_count %d; engine %+v; worker %+v", v.ResumeCount, eng.Stats(), w.Stats())
	want := map[string]int{"/slow " + job + "/slow": 1, "/after " + job + "/after": 1}
	if got := svc.snapshot(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("calls per path and Idempotency-Key: %v; want %v", got, want)
	}
	if s := w.Stats(); s.Redeliveries != 0 || s.Published != 2 {
		t.Errorf("worker: %+v; want both steps run once, nothing delivered again", s)
	}
	for _, s := range v.Steps {
		if s.Status != schemas.StepCompleted || s.Attempts != 1 {
			t.Errorf("step %s: %s after %d dispatches; want completed after 1", s.ID, s.Status, s.Attempts)
		}
	}
	h := resilHistory(t, cl, job)
	for _, step := range []string{"slow", "after"} {
		if n := h[schemas.EventStepCompleted+" "+step]; n != 1 {
			t.Errorf("step %s completed %d times in the history; want once", step, n)
		}
	}
	if h[schemas.EventJobCompleted] != 1 {
		t.Errorf("job completed %d times in the history; want once", h[schemas.EventJobCompleted])
	}
}

const resilPoisonWorkflow = `
name: poison
version: 1
steps:
  - id: poison
    kind: noop
`

const resilHealthyWorkflow = `
name: healthy
version: 1
steps:
  - id: first
    kind: noop
    with: {output: {first: true}}
    next: [{to: second}]
  - id: second
    kind: noop
    with: {output: {second: true}}
`

// TestPoisonStepIsDeadLettered: a step whose worker process dies on every
// delivery (a poison message) is delivered WAYMARK_WORK_MAX_DELIVER times,
// then dead-lettered: its job fails with the reason, the message leaves the
// pool, and a healthy job started beside it on the same pool completes
// meanwhile.
func TestPoisonStepIsDeadLettered(t *testing.T) {
	t.Parallel()
	log := resilLogger(t)
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	cfg := kv.Config{InboxAckWait: time.Second, WorkAckWait: time.Second, WorkMaxDeliver: 3}
	store := srv.Store(t, cfg)
	cl := client.New(store)
	eng := resilEngine(t, srv.Store(t, cfg), log)

	workerBin := testsupport.Binary(t, "worker")
	env := []string{
		"WAYMARK_FAILPOINTS=worker.after_receive=crash/poison",
		"WAYMARK_WORK_MAX_DELIVER=3",
		"WAYMARK_WORK_ACK_WAIT=1s",
		"WAYMARK_INBOX_ACK_WAIT=1s",
	}
	// One step at a time per worker, so the healthy job's steps never die
	// beside the poison in one process.
	startWorker := func() *proc { return spawn(t, env, workerBin, "--nats-url="+srv.URL(), "--concurrency=1") }
	workers := []*proc{startWorker(), startWorker()}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := cl.Start(ctx, resilDef(t, resilPoisonWorkflow), nil, client.StartOptions{JobID: "poisoned"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Start(ctx, resilDef(t, resilHealthyWorkflow), nil, client.StartOptions{JobID: "healthy"}); err != nil {
		t.Fatal(err)
	}

	// Restart every worker that dies, until the poisoned job stops.
	crashes := 0
	deadline := time.Now().Add(30 * time.Second)
	var poisoned *client.JobView
	for {
		v, err := cl.Job(ctx, "poisoned")
		if err == nil && v.Status.Stopped() {
			poisoned = v
			break
		}
		for i, w := range workers {
			select {
			case <-w.done:
				w.waitKilled(t, time.Second)
				if !strings.Contains(w.errOut.String(), "failpoint "+failpoint.WorkerAfterReceive) {
					t.Fatalf("a worker died, but not on the poison step:\n%s", lastLines(w.errOut.String(), 20))
				}
				crashes++
				workers[i] = startWorker()
			default:
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the poisoned job did not stop within 30s (%d worker crashes)", crashes)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	healthy := resilWaitStopped(t, cl, "healthy", 10*time.Second)
	t.Logf("poisoned job %s after %d worker crashes: %v; engine %+v", poisoned.Status, crashes, poisoned.Error, eng.Stats())

	if poisoned.Status != schemas.JobFailed || poisoned.Error == nil {
		t.Fatalf("poisoned job: %s (%v); want failed", poisoned.Status, poisoned.Error)
	}
	if msg := poisoned.Error.Message; !strings.Contains(msg, "poison step") || !strings.Contains(msg, "delivered 3 times") {
		t.Errorf("poisoned job's error %q does not say it was delivered the maximum number of times (3)", msg)
	}
	if crashes < 1 || crashes > 3 {
		t.Errorf("%d workers died on the poison step; want 1 to 3 (one per delivery, at most max deliver)", crashes)
	}
	if s := eng.Stats(); s.DeadLetters < 1 {
		t.Errorf("engine counted %d dead letters; want at least 1", s.DeadLetters)
	}
	if healthy.Status != schemas.JobCompleted {
		t.Fatalf("healthy job beside the poison: %s (%v); want completed", healthy.Status, healthy.Error)
	}
	if healthy.CompletedAt == nil || poisoned.CompletedAt == nil || !healthy.CompletedAt.Before(*poisoned.CompletedAt) {
		t.Errorf("healthy job completed at %v, the poisoned one stopped at %v: the pool was blocked", healthy.CompletedAt, poisoned.CompletedAt)
	}
	// The dead letter does not stay in the pool: no worker dies on it again.
	testsupport.Eventually(t, 10*time.Second, func() bool {
		s, err := store.JS.Stream(ctx, store.Names.WorkStream)
		if err != nil {
			return false
		}
		info, err := s.Info(ctx)
		return err == nil && info.State.Msgs == 0
	}, "step messages left in the work stream after both jobs stopped")
	for _, w := range workers {
		select {
		case <-w.done:
			t.Errorf("a worker died after the poison step was dead-lettered:\n%s", lastLines(w.errOut.String(), 10))
		default:
		}
	}
}

// resilSoakProc is one of the soak's processes, restarted whenever it is
// killed.
type resilSoakProc struct {
	name  string
	bin   string
	args  []string
	p     *proc
	kills int
}

// resilSoakEnv is the layout every process of the soak shares (and the test's
// own store: resilSoakKV).
var resilSoakEnv = []string{
	"WAYMARK_INBOX_ACK_WAIT=1s",
	"WAYMARK_WORK_ACK_WAIT=1s",
	"WAYMARK_LOG_LEVEL=warn",
}

var resilSoakKV = kv.Config{InboxAckWait: time.Second, WorkAckWait: time.Second}

func (sp *resilSoakProc) start() error {
	p := &proc{cmd: exec.Command(sp.bin, sp.args...), out: &syncBuffer{}, errOut: &syncBuffer{}, done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), resilSoakEnv...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.errOut
	if err := p.cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", sp.name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	sp.p = p
	return nil
}

// kill sends SIGKILL and waits for the process to be gone. It reports an
// error if the process had died by itself.
func (sp *resilSoakProc) kill() error {
	select {
	case <-sp.p.done:
		return fmt.Errorf("%s died by itself (%v):\n%s", sp.name, sp.p.err, lastLines(sp.p.errOut.String(), 20))
	default:
	}
	_ = sp.p.cmd.Process.Signal(syscall.SIGKILL)
	<-sp.p.done
	sp.kills++
	return nil
}

// TestSoakRandomKills runs jobs while SIGKILLing a random one of the
// engine and two worker processes every 200-800ms and restarting it at
// once; then it stops killing and waits for every job. Every job must
// complete, and at the providers no idempotency key may have more than one
// effect. By default 30 jobs and 20s of kills; WAYMARK_SOAK=10m kills for
// that long with proportionally more jobs (give go test a -timeout above
// it). WAYMARK_SOAK_SEED replays a kill schedule.
func TestSoakRandomKills(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("the soak kills processes for 20s; skipped with -short")
	}
	killFor, jobs := 20*time.Second, 30
	if s := os.Getenv("WAYMARK_SOAK"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			t.Fatalf("WAYMARK_SOAK=%q: want a duration such as 10m", s)
		}
		killFor, jobs = d, max(30, int(30*d/(20*time.Second)))
	}
	seed := seedFromEnv(t, "WAYMARK_SOAK_SEED")
	rng := rand.New(rand.NewPCG(uint64(seed), 0x5eed))
	t.Logf("soak: %d jobs, %v of kills, seed %d (WAYMARK_SOAK_SEED=%d replays the kill schedule)", jobs, killFor, seed, seed)
	began := time.Now()

	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	store := srv.Store(t, resilSoakKV)
	cl := client.New(store)
	dir := t.TempDir()
	// A short delay between the effect and its answer widens the window
	// in which a worker dies with the effect performed and unrecorded.
	services := startDemos(t, dir, 300*time.Millisecond)
	natsURL := "--nats-url=" + srv.URL()
	svcArgs := []string{natsURL,
		"--service=" + demo.NamePayments + "=" + services[demo.NamePayments].URL,
		"--service=" + demo.NameRecords + "=" + services[demo.NameRecords].URL}
	procs := []*resilSoakProc{
		{name: "engine", bin: testsupport.Binary(t, "engine"), args: []string{"serve", natsURL, "--http=", "--workers=0"}},
		{name: "worker-1", bin: testsupport.Binary(t, "worker"), args: svcArgs},
		{name: "worker-2", bin: testsupport.Binary(t, "engine"), args: append([]string{"worker"}, svcArgs...)},
	}
	for _, sp := range procs {
		if err := sp.start(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, sp := range procs {
			_ = sp.p.cmd.Process.Kill()
			<-sp.p.done
			if t.Failed() {
				t.Logf("stderr of %s (last incarnation of %d):\n%s", sp.name, sp.kills+1, lastLines(sp.p.errOut.String(), 30))
			}
		}
	})

	def := loadDef(t, "testdata/soak.yaml")
	ids := make([]string, jobs)
	for i := range ids {
		ids[i] = fmt.Sprintf("soak-%04d", i+1)
	}
	// Jobs start throughout the first three quarters of the kill window,
	// so that kills land on jobs at every stage.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	startErr := make(chan error, 1)
	go func() {
		defer close(startErr)
		spread := killFor * 3 / 4
		for i, id := range ids {
			if wait := time.Until(began.Add(spread * time.Duration(i) / time.Duration(jobs))); wait > 0 {
				select {
				case <-time.After(wait): // pacing the workload
				case <-ctx.Done():
					return
				}
			}
			input := json.RawMessage(fmt.Sprintf(`{"order_id": %q, "amount_cents": %d}`, id, 100+i))
			if _, err := cl.Start(ctx, def, input, client.StartOptions{JobID: id}); err != nil {
				startErr <- err
				return
			}
		}
	}()

	killsEnd := time.Now().Add(killFor)
	for time.Now().Before(killsEnd) {
		time.Sleep(time.Duration(200+rng.IntN(601)) * time.Millisecond) // the workload, not synchronisation
		sp := procs[rng.IntN(len(procs))]
		if err := sp.kill(); err != nil {
			t.Fatal(err)
		}
		if err := sp.start(); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-startErr; err != nil {
		t.Fatalf("start jobs: %v", err)
	}
	killed := time.Now()
	kills := 0
	var perProc []string
	for _, sp := range procs {
		kills += sp.kills
		perProc = append(perProc, fmt.Sprintf("%s %d", sp.name, sp.kills))
	}

	// Every job must stop, by the recovery paths that take seconds (inbox
	// and work redelivery): a job left to the reconciler's lost-attempt
	// deadline (the step timeout, two work ack waits and 30s) fails this.
	settle := 30*time.Second + killFor/10
	final := map[string]client.JobSummary{}
	for stopped := 0; stopped < jobs; {
		if time.Since(killed) > settle {
			t.Fatalf("%d of %d jobs stopped within %v of the last kill; still running: %s", stopped, jobs, settle, resilSoakUnfinished(ids, final))
		}
		time.Sleep(100 * time.Millisecond) // poll interval
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		list, err := cl.List(lctx, client.ListFilter{Workflow: def.Name, Limit: jobs + 1})
		cancel()
		if err != nil {
			continue
		}
		for _, s := range list.Jobs {
			final[s.ID] = s
		}
		stopped = 0
		for _, id := range ids {
			if s, ok := final[id]; ok && s.Status.Stopped() {
				stopped++
			}
		}
	}
	settled := time.Since(killed)

	resumes := 0
	for _, id := range ids {
		s := final[id]
		resumes += s.ResumeCount
		if s.Status != schemas.JobCompleted {
			t.Errorf("job %s %s: %v", id, s.Status, s.Error)
		}
	}
	// Duplicates two ways: a key whose effect a provider performed twice,
	// and an order charged or recorded twice (under whatever key).
	duplicates, retried := 0, 0
	perOrder := map[string]int{}
	for _, name := range []string{demo.NamePayments, demo.NameRecords} {
		st := services[name].Stats()
		for key, n := range st.Effects {
			if n > 1 {
				duplicates++
				t.Errorf("%s performed the effect of %s %d times", name, key, n)
			}
		}
		for key, n := range st.Calls {
			if n > st.Effects[key] {
				retried++
			}
		}
		step := map[string]string{demo.NamePayments: "charge", demo.NameRecords: "record"}[name]
		for _, id := range ids {
			if n := st.Effects[id+"/"+step]; n != 1 {
				t.Errorf("%s: %d effects for job %s's key %s/%s; want exactly one", name, n, id, id, step)
			}
		}
	}
	var charges demo.ChargeList
	resilGetJSON(t, services[demo.NamePayments].URL+"/v1/charges", &charges)
	for _, c := range charges.Charges {
		perOrder["charge "+c.OrderID]++
	}
	var records demo.RecordList
	resilGetJSON(t, services[demo.NameRecords].URL+"/v1/records", &records)
	for _, r := range records.Records {
		var body struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(r.Body, &body); err != nil {
			t.Fatalf("record %s: %v", r.ID, err)
		}
		perOrder["record "+body.OrderID]++
	}
	for what, n := range perOrder {
		if n > 1 {
			duplicates++
			t.Errorf("order %s %d times", what, n)
		}
	}
	if len(charges.Charges) != jobs || len(records.Records) != jobs {
		t.Errorf("%d charges and %d records for %d jobs; want one of each per job", len(charges.Charges), len(records.Records), jobs)
	}
	t.Logf("soak: %d jobs completed of %d; %d kills (%s) over %v; %d duplicate effects; %d keys called again after a lost answer; %d resumes; all stopped %v after the last kill; %v in all",
		resilSoakCount(final, ids, schemas.JobCompleted), jobs, kills, strings.Join(perProc, ", "), killFor, duplicates, retried, resumes,
		settled.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
}

// resilGetJSON decodes the JSON answer to GET url into v.
func resilGetJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

func resilSoakCount(final map[string]client.JobSummary, ids []string, status schemas.JobStatus) int {
	n := 0
	for _, id := range ids {
		if final[id].Status == status {
			n++
		}
	}
	return n
}

// resilSoakUnfinished describes the jobs that have not stopped, for a failure
// message.
func resilSoakUnfinished(ids []string, final map[string]client.JobSummary) string {
	var out []string
	for _, id := range ids {
		s, ok := final[id]
		switch {
		case !ok:
			out = append(out, id+" (no checkpoint)")
		case !s.Status.Stopped():
			out = append(out, fmt.Sprintf("%s (%s at %s, updated %v ago)", id, s.Status, s.CurrentStep, time.Since(s.UpdatedAt).Round(time.Millisecond)))
		}
	}
	sort.Strings(out)
	if len(out) > 20 {
		out = append(out[:20], fmt.Sprintf("and %d more", len(out)-20))
	}
	return strings.Join(out, ", ")
}

const resilMailPoolWorkflow = `
name: memq-mail
version: 1
defaults:
  timeout: 2s
  retry: {max_attempts: 1}
steps:
  - id: send
    kind: http
    effect: unsafe
    pool: mail
    with: {method: POST, url: '{{service "svc"}}/mail', body: '{}'}
`

// TestMemoryQueuesLostInARestart runs with WAYMARK_QUEUE_STORAGE=memory
// and restarts the nats-server while one job's idempotent step is running
// on a worker and another job's unsafe step waits in the queue of a pool
// nobody serves yet: the work and inbox queues are gone, checkpoints and
// the effect ledger are not. The engine sees the queue epoch missing and
// dispatches both steps again from their checkpoints under new attempt
// numbers: the idempotent one at once (a second call carries the same
// Idempotency-Key), the unsafe one only once its first attempt must have
// ended (timeout + grace), so it is never declared ambiguous while a call
// may be under way. Both jobs complete; the mail is sent once.
func TestMemoryQueuesLostInARestart(t *testing.T) {
	t.Parallel()
	log := resilLogger(t)
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	cfg := kv.Config{InboxAckWait: 2 * time.Second, WorkAckWait: 3 * time.Second, QueueStorage: kv.QueueMemory}
	store := srv.Store(t, cfg)
	cl := client.New(store)
	svc := newResilKeyCounter(t)
	const grace = 500 * time.Millisecond
	eng := resilRunEngine(t, engine.Config{Store: srv.Store(t, cfg), Logger: log, ReconcileInterval: -1, StallGrace: grace})
	env := &steps.Env{Services: map[string]string{"svc": svc.srv.URL}}
	w := resilWorker(t, srv.Store(t, cfg), env, nil, "worker", 0, log)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const slowJob, mailJob = "memq-1", "memq-mail"
	if _, err := cl.Start(ctx, resilDef(t, resilRestartWorkflow), nil, client.StartOptions{JobID: slowJob}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Start(ctx, resilDef(t, resilMailPoolWorkflow), nil, client.StartOptions{JobID: mailJob}); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err := cl.Job(ctx, mailJob)
		return svc.snapshot()["/slow "+slowJob+"/slow"] == 1 && err == nil && v.Current != nil
	}, "the slow step never reached the provider, or the mail step was never dispatched")
	if st := streamStorage(t, store, store.Names.WorkStream); st != jetstream.MemoryStorage {
		t.Fatalf("work stream storage %v, want memory", st)
	}

	restarted := time.Now()
	srv.Restart(t)
	testsupport.Eventually(t, 20*time.Second, func() bool { return eng.Stats().Requeued >= 1 },
		"the engine did not dispatch the running step again after the queues were lost")
	resilPoolWorker(t, srv.Store(t, cfg), env, "mail-worker", "mail", log)
	svc.releaseAll()

	for _, job := range []string{slowJob, mailJob} {
		v := resilWaitStopped(t, cl, job, 30*time.Second)
		if v.Status != schemas.JobCompleted {
			t.Fatalf("job %s %s: %v", job, v.Status, v.Error)
		}
	}
	t.Logf("jobs completed after losing the queues: engine %+v; worker %+v", eng.Stats(), w.Stats())
	calls := svc.snapshot()
	for k, n := range calls {
		switch {
		case strings.HasPrefix(k, "/slow "):
			if k != "/slow "+slowJob+"/slow" {
				t.Errorf("slow step called with key %q; want every call under %s/slow", k, slowJob)
			}
		case strings.HasPrefix(k, "/after "), strings.HasPrefix(k, "/mail "):
			if n != 1 {
				t.Errorf("%s called %d times; want once", k, n)
			}
		}
	}
	if calls["/after "+slowJob+"/after"] != 1 {
		t.Errorf("calls %v: the step after the slow one was not called once", calls)
	}
	mails := 0
	for k, n := range calls {
		if strings.HasPrefix(k, "/mail ") {
			mails += n
		}
	}
	if mails != 1 {
		t.Errorf("mail sent %d times; want once (calls %v)", mails, calls)
	}
	// The unsafe step was dispatched again only after its first attempt's
	// timeout (2s) had passed since the queues were lost.
	evs, err := cl.History(ctx, mailJob)
	if err != nil {
		t.Fatal(err)
	}
	var again *schemas.HistoryEvent
	for i := range evs {
		if evs[i].Type == schemas.EventStepDispatched && evs[i].Data.Attempt == 2 {
			again = &evs[i]
		}
	}
	if again == nil {
		t.Fatalf("no second dispatch of the mail step in its history")
	}
	if d := again.Time.Sub(restarted); d < 2*time.Second {
		t.Errorf("unsafe step dispatched again %v after the restart; want no sooner than its 2s timeout", d)
	}
	if !strings.Contains(again.Data.Reason, "lost with the queues") {
		t.Errorf("second dispatch reason %q; want it to say the message was lost with the queues", again.Data.Reason)
	}
}

func streamStorage(t *testing.T, store *kv.Store, name string) jetstream.StorageType {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := store.JS.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	return st.CachedInfo().Config.Storage
}
