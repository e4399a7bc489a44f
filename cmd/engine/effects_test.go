package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/api"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/cli"
	"github.com/waymark-dev/waymark/internal/crashtest"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// These tests prove the effect ledger (DESIGN.md invariants 4 and 5) on
// examples/effects: one step of each effect class against the bundled
// providers, payments (idempotent), records (lookup) and mail (unsafe).
// Each runs a real embedded nats-server, an in-process engine and worker,
// and the providers, whose counters say how often each key was called and
// how often its effect was performed.

// effStepsOfExample are the steps of examples/effects, in order.
var effStepsOfExample = []string{"charge", "record", "notify"}

// effBundle is one test's world: a server, the Waymark layout, an engine,
// a worker and the three bundled providers.
type effBundle struct {
	t      *testing.T
	srv    *testsupport.Server
	store  *kv.Store
	client *client.Client
	engine *engine.Engine
	worker *steps.Worker
	env    *steps.Env
	svc    map[string]*demo.Running
	def    *schemas.Definition
	input  json.RawMessage
	logs   *syncBuffer
}

type effOptions struct {
	tcp      bool                    // the server listens on a loopback port (for the CLI)
	kv       kv.Config               // the layout
	engine   engine.Config           // Store and Logger are filled in
	noWorker bool                    // start no worker (the test starts its own)
	demo     map[string]demo.Options // per provider; Dir is filled in
	workflow string                  // default examples/effects/workflow.yaml
}

func effSetup(t *testing.T, o effOptions) *effBundle {
	t.Helper()
	b := &effBundle{t: t, logs: &syncBuffer{}, svc: map[string]*demo.Running{}}
	b.srv = testsupport.StartServer(t, testsupport.ServerOptions{TCP: o.tcp})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("engine and worker log:\n%s", lastLines(b.logs.String(), 80))
		}
	})
	b.store = b.srv.Store(t, o.kv)
	b.client = client.New(b.store)
	b.env = &steps.Env{ModelMode: steps.ModelReplay, Services: map[string]string{}}
	for _, name := range []string{demo.NamePayments, demo.NameRecords, demo.NameMail} {
		opts := o.demo[name]
		opts.Dir = filepath.Join(t.TempDir(), name)
		r, err := demo.Start(context.Background(), name, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Close() })
		b.svc[name] = r
		b.env.Services[name] = r.URL
	}
	root := testsupport.ModuleRoot()
	wf := o.workflow
	if wf == "" {
		wf = filepath.Join(root, "examples/effects/workflow.yaml")
	}
	def, err := schemas.Load(wf, schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().Check(b.env)}})
	if err != nil {
		t.Fatal(err)
	}
	b.def = def
	if b.input, err = os.ReadFile(filepath.Join(root, "examples/effects/input.json")); err != nil {
		t.Fatal(err)
	}
	cfg := o.engine
	cfg.Store, cfg.Logger = b.store, b.logger("engine")
	if b.engine, err = engine.New(cfg); err != nil {
		t.Fatal(err)
	}
	b.run(b.engine.Run)
	if !o.noWorker {
		b.worker = b.startWorker(steps.WorkerConfig{ID: "worker-1"})
	}
	return b
}

func (b *effBundle) logger(component string) *slog.Logger {
	return slog.New(slog.NewTextHandler(b.logs, &slog.HandlerOptions{Level: slog.LevelInfo})).With("test", component)
}

// run runs fn until the test ends, then stops it and waits for it.
func (b *effBundle) run(fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	b.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			b.t.Errorf("run: %v", err)
		}
	})
}

// startWorker starts an in-process worker on the bundle's store and
// providers; cfg's Store, Env and Logger are filled in.
func (b *effBundle) startWorker(cfg steps.WorkerConfig) *steps.Worker {
	b.t.Helper()
	cfg.Store, cfg.Env, cfg.Logger = b.store, b.env, b.logger(cfg.ID)
	if cfg.FetchWait == 0 {
		cfg.FetchWait = 200 * time.Millisecond // a stop waits for the last pull
	}
	w, err := steps.NewWorker(cfg)
	if err != nil {
		b.t.Fatal(err)
	}
	b.run(w.Run)
	return w
}

func (b *effBundle) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	b.t.Cleanup(cancel)
	return ctx
}

func (b *effBundle) start(job string) {
	b.t.Helper()
	if _, err := b.client.Start(b.ctx(), b.def, b.input, client.StartOptions{JobID: job}); err != nil {
		b.t.Fatalf("start %s: %v", job, err)
	}
}

// waitStopped waits until job completes, fails or waits for a person.
func (b *effBundle) waitStopped(job string) *client.JobView {
	b.t.Helper()
	v, err := b.client.Wait(b.ctx(), job, nil)
	if err != nil {
		b.t.Fatalf("wait for %s: %v", job, err)
	}
	return v
}

// waitStatus polls job until it has status. (Wait would return at once for
// a job still waiting for a person that was just told to go on.)
func (b *effBundle) waitStatus(job string, status schemas.JobStatus) *client.JobView {
	b.t.Helper()
	var v *client.JobView
	var last string
	testsupport.Eventually(b.t, 30*time.Second, func() bool {
		var err error
		v, err = b.client.Job(context.Background(), job)
		if err != nil {
			last = err.Error()
			return false
		}
		last = string(v.Status)
		return v.Status == status
	}, "job %s never became %s (last: %v)", job, status, effLazy(func() string { return last }))
	return v
}

// effLazy is formatted when a failure is reported, not when it is set up.
type effLazy func() string

func (f effLazy) String() string { return f() }

func (b *effBundle) stats(service string) demo.Stats { return b.svc[service].Stats() }

// checkProvider asserts a provider's counters for key.
func (b *effBundle) checkProvider(service, key string, calls, effects int) {
	b.t.Helper()
	st := b.stats(service)
	if st.Calls[key] != calls || st.Effects[key] != effects {
		b.t.Errorf("%s for %s: %d calls and %d effects, want %d and %d (all: %+v)", service, key, st.Calls[key], st.Effects[key], calls, effects, st)
	}
}

func (b *effBundle) record(key string) *schemas.EffectRecord {
	b.t.Helper()
	r, err := b.client.Effect(context.Background(), key)
	if err != nil {
		b.t.Fatalf("effect %s: %v", key, err)
	}
	return r
}

func (b *effBundle) history(job string) []schemas.HistoryEvent {
	b.t.Helper()
	evs, err := b.client.History(b.ctx(), job)
	if err != nil {
		b.t.Fatalf("history of %s: %v", job, err)
	}
	return evs
}

// effEvents returns the events of type typ (and step, unless empty).
func effEvents(evs []schemas.HistoryEvent, typ, step string) []schemas.HistoryEvent {
	var out []schemas.HistoryEvent
	for _, e := range evs {
		if e.Type == typ && (step == "" || e.Data.Step == step) {
			out = append(out, e)
		}
	}
	return out
}

func effTypes(evs []schemas.HistoryEvent) string {
	var s []string
	for _, e := range evs {
		s = append(s, strings.TrimPrefix(e.Type, "dev.waymark.")+"("+e.Data.Step+")")
	}
	return strings.Join(s, " ")
}

// stateField returns one top-level member of a job's state.
func stateField(t *testing.T, v *client.JobView, name string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(v.State, &m); err != nil {
		t.Fatalf("state of %s: %v", v.ID, err)
	}
	return m[name]
}

func jsonEqual(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

// dropFirst makes a provider lose its answer to the first request with
// key that performed the effect.
func dropFirst(key string) func(string) bool {
	var n atomic.Int32
	return func(k string) bool { return k == key && n.Add(1) == 1 }
}

// TestEffectLedgerCrashMatrix crashes a real engine or worker process at
// every failpoint in every step of examples/effects and resumes it: each
// effect is performed exactly once, every job completes with all three
// effects confirmed, except a worker that dies after the mail went out and
// before the ledger heard of it: mail can neither deduplicate nor be
// asked, so that job stops for a person with the effect ambiguous.
func TestEffectLedgerCrashMatrix(t *testing.T) {
	t.Parallel()
	root := testsupport.ModuleRoot()
	wf := filepath.Join(root, "examples/effects/workflow.yaml")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	began := time.Now()
	rep, err := crashtest.Run(ctx, crashtest.Config{
		Binary:   testsupport.Binary(t, "engine"),
		Workflow: wf,
		Input:    filepath.Join(root, "examples/effects/input.json"),
		Parallel: 4,
		Dir:      t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	points := rep.Sorted(loadDef(t, wf))

	var matrix strings.Builder
	tw := tabwriter.NewWriter(&matrix, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FAILPOINT\tSTEP (CLASS)\tCRASHED\tFINAL STATUS\tRESUMES\tCALLS/KEY\tEFFECTS/KEY\tLEDGER\tSECONDS")
	for _, p := range points {
		status := p.FinalStatus
		if p.Error != "" {
			status = "ERROR"
		}
		var ledger []string
		for st, n := range p.Ledger {
			ledger = append(ledger, fmt.Sprintf("%s=%d", st, n))
		}
		slices.Sort(ledger)
		fmt.Fprintf(tw, "%s\t%s (%s)\t%v\t%s\t%d\t%d\t%d\t%s\t%.1f\n", p.Failpoint, p.Step, p.EffectClass, p.Reached, status,
			p.ResumeCount, p.MaxCallsPerKey, p.MaxEffectsPerKey, strings.Join(ledger, " "), p.Seconds)
	}
	_ = tw.Flush()
	t.Logf("crash matrix of examples/effects (%d cases in %v):\n%s", len(points), time.Since(began).Round(100*time.Millisecond), matrix.String())

	seen := map[string]bool{}
	for _, p := range points {
		seen[p.Failpoint+" "+p.Step] = true
	}
	for _, fp := range crashtest.Cases() {
		for _, s := range effStepsOfExample {
			if !seen[fp+" "+s] {
				t.Errorf("no case for %s in %s", fp, s)
			}
		}
	}
	if want := len(crashtest.Cases()) * len(effStepsOfExample); len(points) != want {
		t.Errorf("%d cases, want %d", len(points), want)
	}

	// The cases that must stop for a person: the effect's outcome is
	// known nowhere, and its provider can neither deduplicate it (the mail)
	// nor be asked, or every delivery died after the call (a dead letter).
	// Every other case completes.
	blocked := map[string]bool{
		failpoint.WorkerAfterRemoteCommit + " notify": true,
		crashtest.SlowProvider + " notify":            true,
		crashtest.DeadLetter + " charge":              true,
		crashtest.DeadLetter + " notify":              true,
	}
	for _, p := range points {
		name := p.Failpoint + " in " + p.Step
		if p.Error != "" {
			t.Errorf("%s: %s", name, p.Error)
			continue
		}
		if !p.Reached {
			t.Errorf("%s: the process never crashed at the point", name)
		}
		if p.MaxEffectsPerKey > 1 {
			t.Errorf("%s: an effect was performed %d times: %v", name, p.MaxEffectsPerKey, p.Effects)
		}
		hasEvent := func(typ, step string) bool {
			for i, h := range p.History {
				if h == typ && (step == "" || p.HistorySteps[i] == step) {
					return true
				}
			}
			return false
		}
		at := slices.Index(effStepsOfExample, p.Step)
		if blocked[p.Failpoint+" "+p.Step] {
			if p.FinalStatus != string(schemas.JobNeedsReconciliation) {
				t.Errorf("%s: final status %s, want needs_reconciliation", name, p.FinalStatus)
			}
			if want := map[string]int{"ambiguous": 1, "confirmed": at}; !equalCounts(p.Ledger, want) && !(at == 0 && equalCounts(p.Ledger, map[string]int{"ambiguous": 1})) {
				t.Errorf("%s: ledger %v, want %v", name, p.Ledger, want)
			}
			if !hasEvent("effect.ambiguous", p.Step) || !hasEvent("step.blocked", p.Step) || hasEvent("job.failed", "") {
				t.Errorf("%s: history lacks effect.ambiguous and step.blocked for %s, or has job.failed: %v", name, p.Step, p.History)
			}
			for i, s := range effStepsOfExample {
				want := 1 // up to the blocked step, whose effect happened (its outcome is what nobody knows)
				if i > at {
					want = 0
				}
				if n := p.Effects["crashtest/"+s]; n != want {
					t.Errorf("%s: effect of %s performed %d times, want %d", name, s, n, want)
				}
			}
			continue
		}
		for _, s := range effStepsOfExample {
			if n := p.Effects["crashtest/"+s]; n != 1 {
				t.Errorf("%s: effect of %s performed %d times, want once", name, s, n)
			}
		}
		if p.FinalStatus != string(schemas.JobCompleted) {
			t.Errorf("%s: final status %s, want completed", name, p.FinalStatus)
		}
		if want := map[string]int{"confirmed": 3}; !equalCounts(p.Ledger, want) {
			t.Errorf("%s: ledger %v, want %v", name, p.Ledger, want)
		}
		for _, s := range effStepsOfExample {
			if !hasEvent("effect.confirmed", s) {
				t.Errorf("%s: history has no effect.confirmed for %s: %v %v", name, s, p.History, p.HistorySteps)
			}
		}
	}
}

func equalCounts(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range b {
		if a[k] != v {
			return false
		}
	}
	return true
}

// TestAmbiguousEffectResolvedAsHappened: the mail goes out and its answer
// is lost, so the unsafe effect is ambiguous and the job waits for a
// person. Once they say it happened (with the provider's id and result),
// the job completes with that result as the step's output, and the mail
// is not sent again.
func TestAmbiguousEffectResolvedAsHappened(t *testing.T) {
	t.Parallel()
	const job = "resolve-happened"
	key := job + "/notify"
	b := effSetup(t, effOptions{demo: map[string]demo.Options{
		demo.NameMail: {DropAfterCommit: dropFirst(key)},
	}})
	b.start(job)
	v := b.waitStopped(job)
	if v.Status != schemas.JobNeedsReconciliation || v.Blocked == nil || v.Blocked.EffectKey != key || v.Blocked.Step != "notify" {
		t.Fatalf("job %s: status %s, blocked %+v; want needs_reconciliation blocked on %s", job, v.Status, v.Blocked, key)
	}
	rec := b.record(key)
	if rec.State != schemas.EffectAmbiguous || rec.Reason == "" || rec.Class != schemas.EffectUnsafe || rec.Calls != 1 {
		t.Fatalf("record %s: state %s, class %s, calls %d, reason %q; want ambiguous, unsafe, 1 call, with a reason", key, rec.State, rec.Class, rec.Calls, rec.Reason)
	}
	b.checkProvider(demo.NameMail, key, 1, 1)
	amb, err := b.client.Effects(context.Background(), client.EffectFilter{Job: job, State: schemas.EffectAmbiguous})
	if err != nil || len(amb) != 1 || amb[0].Key != key {
		t.Fatalf("ambiguous effects of %s: %v, %v; want just %s", job, amb, err, key)
	}

	result := json.RawMessage(`{"id": "msg_000001", "found_in": "outbox"}`)
	res := schemas.EffectResolution{Happened: true, ExternalID: "msg_000001", Result: result, By: "ops", Note: "found it in the outbox"}
	got, err := b.client.ResolveEffect(context.Background(), key, res)
	if err != nil {
		t.Fatalf("resolve: %v", err)
	}
	if r := got.EffectRecord; r.State != schemas.EffectReconciled || r.Happened == nil || !*r.Happened || r.ReconciledBy != "ops" || !slices.Equal(got.Resumed, []string{job}) {
		t.Fatalf("resolve returned %+v (resumed %v)", r, got.Resumed)
	}
	v = b.waitStatus(job, schemas.JobCompleted)
	if mail := stateField(t, v, "mail"); !jsonEqual(mail, result) {
		t.Errorf("state.mail = %s, want the resolution's result %s", mail, result)
	}
	b.checkProvider(demo.NameMail, key, 1, 1)
	rec = b.record(key)
	if rec.State != schemas.EffectReconciled || rec.ReconciledBy != "ops" || rec.Happened == nil || !*rec.Happened ||
		rec.ExternalID != "msg_000001" || !jsonEqual(rec.Result, result) || rec.ResultDigest == "" || rec.Note != res.Note {
		t.Errorf("record after resolving: %+v", rec)
	}
	if st := b.worker.Stats(); st.ReplayedEffects != 1 || st.AmbiguousEffects != 1 {
		t.Errorf("worker: %d effects replayed, %d ambiguous; want 1 and 1", st.ReplayedEffects, st.AmbiguousEffects)
	}
	if st := b.engine.Stats(); st.JobsBlocked != 1 || st.EffectsResolved != 1 {
		t.Errorf("engine: %d jobs blocked, %d resolved; want 1 and 1", st.JobsBlocked, st.EffectsResolved)
	}

	evs := b.history(job)
	for _, want := range []struct{ typ, step string }{
		{schemas.EventEffectAmbiguous, "notify"},
		{schemas.EventStepBlocked, "notify"},
		{schemas.EventEffectReconciled, "notify"},
		{schemas.EventStepUnblocked, "notify"},
		{schemas.EventEffectReplayed, "notify"},
		{schemas.EventJobCompleted, ""},
	} {
		if len(effEvents(evs, want.typ, want.step)) == 0 {
			t.Errorf("history has no %s for %q: %s", want.typ, want.step, effTypes(evs))
		}
	}
	for _, typ := range []string{schemas.EventEffectReconciled, schemas.EventStepUnblocked} {
		for _, e := range effEvents(evs, typ, "notify") {
			if e.Data.By != "ops" || e.Data.EffectKey != key {
				t.Errorf("%s: by %q, key %q; want ops and %s", typ, e.Data.By, e.Data.EffectKey, key)
			}
		}
	}
	if blocked := effEvents(evs, schemas.EventStepBlocked, "notify"); len(blocked) > 0 && blocked[0].Data.EffectKey != key {
		t.Errorf("step.blocked names effect %q, want %s", blocked[0].Data.EffectKey, key)
	}
	if len(effEvents(evs, schemas.EventEffectDispatched, "notify")) != 1 {
		t.Errorf("notify dispatched more than once: %s", effTypes(evs))
	}

	// Resolving again announces the decision again and changes nothing.
	again, err := b.client.ResolveEffect(context.Background(), key, res)
	if err != nil || again.State != schemas.EffectReconciled || again.ReconciledBy != "ops" {
		t.Errorf("resolving again: %+v, %v; want the reconciled record and no error", again, err)
	}

	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		key     string
		res     schemas.EffectResolution
		wantErr error
	}{
		{name: "confirmed effect", key: job + "/charge", res: schemas.EffectResolution{Happened: true, By: "ops"}, wantErr: client.ErrNotAmbiguous},
		{name: "unknown key", key: "nobody/nothing", res: schemas.EffectResolution{Happened: true, By: "ops"}, wantErr: schemas.ErrNotFound},
		{name: "nobody decides", key: key, res: schemas.EffectResolution{Happened: true}, wantErr: schemas.ErrInputInvalid},
		{name: "not happened with a result", key: key, res: schemas.EffectResolution{Result: json.RawMessage(`{}`), By: "ops"}, wantErr: schemas.ErrInputInvalid},
		{name: "not happened with an external id", key: key, res: schemas.EffectResolution{ExternalID: "x", By: "ops"}, wantErr: schemas.ErrInputInvalid},
		{name: "result not JSON", key: key, res: schemas.EffectResolution{Happened: true, Result: json.RawMessage(`{"id":`), By: "ops"}, wantErr: schemas.ErrInputInvalid},
		{name: "deadline passed", ctx: expired, key: key, res: schemas.EffectResolution{Happened: true, By: "ops"}, wantErr: context.DeadlineExceeded},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := tt.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			got, err := b.client.ResolveEffect(ctx, tt.key, tt.res)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("ResolveEffect(%s) = %+v, %v; want %v", tt.key, got, err, tt.wantErr)
			}
		})
	}
	if rec := b.record(key); rec.ReconciledBy != "ops" || !*rec.Happened {
		t.Errorf("failed resolutions changed the record: %+v", rec)
	}
	if rec := b.record(job + "/charge"); rec.State != schemas.EffectConfirmed {
		t.Errorf("resolving a confirmed effect changed it: %+v", rec)
	}
	b.checkProvider(demo.NameMail, key, 1, 1)
}

// TestAmbiguousEffectResolvedAsNotHappened: mail answers 503, so nobody
// knows whether it sent; once a person says it did not, the step calls
// again and the mail goes out once.
func TestAmbiguousEffectResolvedAsNotHappened(t *testing.T) {
	t.Parallel()
	const job = "resolve-not-happened"
	key := job + "/notify"
	b := effSetup(t, effOptions{demo: map[string]demo.Options{demo.NameMail: {FailNext: 1}}})
	b.start(job)
	v := b.waitStopped(job)
	if v.Status != schemas.JobNeedsReconciliation || v.Blocked == nil || v.Blocked.EffectKey != key {
		t.Fatalf("job %s: status %s, blocked %+v; want needs_reconciliation on %s", job, v.Status, v.Blocked, key)
	}
	rec := b.record(key)
	if rec.State != schemas.EffectAmbiguous || !strings.Contains(rec.Reason, "503") {
		t.Fatalf("record %s: state %s, reason %q; want ambiguous because of the 503", key, rec.State, rec.Reason)
	}
	b.checkProvider(demo.NameMail, key, 1, 0)

	got, err := b.client.ResolveEffect(context.Background(), key, schemas.EffectResolution{By: "ops", Note: "not in the outbox"})
	if err != nil {
		t.Fatalf("resolve: %v", err)
	}
	if r := got.EffectRecord; r.State != schemas.EffectReconciled || r.Happened == nil || *r.Happened {
		t.Fatalf("resolve returned %+v, want reconciled as not happened", r)
	}
	v = b.waitStatus(job, schemas.JobCompleted)
	b.checkProvider(demo.NameMail, key, 2, 1)
	if mail := stateField(t, v, "mail"); !jsonEqual(mail, []byte(`{"id": "msg_000001"}`)) {
		t.Errorf("state.mail = %s, want the message sent after the resolution", mail)
	}
	rec = b.record(key)
	if rec.State != schemas.EffectConfirmed || rec.Calls != 2 || rec.ExternalID != "msg_000001" {
		t.Errorf("record: state %s, calls %d, external id %q; want confirmed after 2 calls, msg_000001", rec.State, rec.Calls, rec.ExternalID)
	}
	evs := b.history(job)
	unblocked := slices.IndexFunc(evs, func(e schemas.HistoryEvent) bool { return e.Type == schemas.EventStepUnblocked })
	if unblocked < 0 || len(effEvents(evs[unblocked:], schemas.EventEffectConfirmed, "notify")) != 1 ||
		len(effEvents(evs, schemas.EventEffectReconciled, "notify")) != 1 {
		t.Errorf("history does not show the resolution, then the mail sent and confirmed: %s", effTypes(evs))
	}
	if st := b.worker.Stats(); st.ReplayedEffects != 0 {
		t.Errorf("worker replayed %d effects; a not-happened effect must be performed", st.ReplayedEffects)
	}
}

// effCLI runs the engine CLI in this process and returns its output and
// the exit code the binary would return.
func effCLI(t *testing.T, natsURL string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	cmd := cli.NewEngineCommand(&out, &errOut)
	cmd.SetArgs(append(args, "--nats-url", natsURL))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cmd.ExecuteContext(ctx); err != nil {
		code = 1
		var ee *cli.ExitError
		if errors.As(err, &ee) {
			code = ee.Code
		}
		fmt.Fprintln(&errOut, "error:", err)
	}
	return out.String(), errOut.String(), code
}

// TestEffectsCLI drives both resolutions through `engine effects list` and
// `engine effects resolve`, as an operator would.
func TestEffectsCLI(t *testing.T) {
	t.Parallel()
	const happenedJob, notJob = "cli-happened", "cli-not-happened"
	b := effSetup(t, effOptions{tcp: true, demo: map[string]demo.Options{
		demo.NameMail: {DropAfterCommit: dropFirst(happenedJob + "/notify")},
	}})
	url := b.srv.URL()
	dir := t.TempDir()
	resultFile := filepath.Join(dir, "result.json")
	if err := os.WriteFile(resultFile, []byte(`{"id": "msg_000001", "by_hand": true}`), 0o644); err != nil {
		t.Fatal(err)
	}
	badFile := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(badFile, []byte(`{"id": `), 0o644); err != nil {
		t.Fatal(err)
	}

	b.start(happenedJob)
	if v := b.waitStopped(happenedJob); v.Status != schemas.JobNeedsReconciliation {
		t.Fatalf("job %s: %s, want needs_reconciliation", happenedJob, v.Status)
	}
	out, errOut, code := effCLI(t, url, "effects", "list", "--job", happenedJob, "--state", "ambiguous", "--output", "json")
	if code != 0 {
		t.Fatalf("effects list: exit %d: %s", code, errOut)
	}
	var list struct {
		Effects []*schemas.EffectRecord `json:"effects"`
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatalf("effects list --output json: %v\n%s", err, out)
	}
	key := happenedJob + "/notify"
	if len(list.Effects) != 1 || list.Effects[0].Key != key || list.Effects[0].State != schemas.EffectAmbiguous || list.Effects[0].Reason == "" {
		t.Fatalf("effects list: %s; want only %s, ambiguous, with a reason", out, key)
	}
	out, _, code = effCLI(t, url, "effects", "list", "--job", happenedJob)
	if code != 0 || !strings.Contains(out, "KEY") || strings.Count(out, happenedJob+"/") != 3 || !strings.Contains(out, "ambiguous") {
		t.Errorf("effects list (text): exit %d:\n%s", code, out)
	}
	// What a person must decide is in the text status and the listing.
	out, _, code = effCLI(t, url, "status", happenedJob)
	if code != 0 || !strings.Contains(out, "waits on  effect "+key+" of step notify (unsafe)") || !strings.Contains(out, "engine effects resolve "+key) {
		t.Errorf("status (text) of a job needing reconciliation: exit %d:\n%s", code, out)
	}
	out, _, code = effCLI(t, url, "list", "--status", "needs_reconciliation")
	if code != 0 || !regexp.MustCompile(happenedJob+`\s+\S+\s+needs_reconciliation\s+notify\s`).MatchString(out) {
		t.Errorf("list --status needs_reconciliation: exit %d; want the job with its step:\n%s", code, out)
	}

	for _, tc := range []struct {
		name string
		args []string
	}{
		{"unknown state", []string{"effects", "list", "--state", "maybe"}},
		{"both answers", []string{"effects", "resolve", key, "--happened", "--not-happened", "--by", "ops"}},
		{"no answer", []string{"effects", "resolve", key, "--by", "ops"}},
		{"result not JSON", []string{"effects", "resolve", key, "--happened", "--result", badFile, "--by", "ops"}},
		{"result of what did not happen", []string{"effects", "resolve", key, "--not-happened", "--result", resultFile, "--by", "ops"}},
		{"confirmed effect", []string{"effects", "resolve", happenedJob + "/charge", "--happened", "--by", "ops"}},
		{"unknown key", []string{"effects", "resolve", "nobody/nothing", "--happened", "--by", "ops"}},
	} {
		if _, errOut, code := effCLI(t, url, tc.args...); code != 2 {
			t.Errorf("%s: exit %d, want 2: %s", tc.name, code, errOut)
		}
	}
	if rec := b.record(key); rec.State != schemas.EffectAmbiguous {
		t.Fatalf("rejected resolutions changed the record: %+v", rec)
	}

	out, errOut, code = effCLI(t, url, "effects", "resolve", key, "--happened", "--external-id", "msg_000001", "--result", resultFile, "--by", "ops")
	if code != 0 {
		t.Fatalf("effects resolve: exit %d: %s", code, errOut)
	}
	if want := "effect " + key + " reconciled by ops: happened"; !strings.Contains(out, want) || !strings.Contains(out, "Job "+happenedJob+" resumes") {
		t.Errorf("effects resolve printed %q, want %q and that the job resumes", out, want)
	}
	v := b.waitStatus(happenedJob, schemas.JobCompleted)
	if mail := stateField(t, v, "mail"); !jsonEqual(mail, []byte(`{"id": "msg_000001", "by_hand": true}`)) {
		t.Errorf("state.mail = %s, want the --result file", mail)
	}
	b.checkProvider(demo.NameMail, key, 1, 1)
	out, errOut, code = effCLI(t, url, "effects", "resolve", key, "--happened", "--by", "ops", "--output", "json")
	var again schemas.EffectRecord
	if code != 0 || json.Unmarshal([]byte(out), &again) != nil || again.State != schemas.EffectReconciled || again.ExternalID != "msg_000001" {
		t.Errorf("resolving again: exit %d: %s%s", code, out, errOut)
	}
	// Another decision on a decided effect is refused, and changes nothing.
	for name, args := range map[string][]string{
		"the other way":       {"--not-happened"},
		"another external id": {"--happened", "--external-id", "msg_999"},
	} {
		_, errOut, code := effCLI(t, url, append([]string{"effects", "resolve", key, "--by", "ops"}, args...)...)
		if code != 2 || !strings.Contains(errOut, "already decided it happened") {
			t.Errorf("resolving %s: exit %d: %s; want exit 2 saying it was decided", name, code, errOut)
		}
	}
	if rec := b.record(key); rec.ExternalID != "msg_000001" || rec.Happened == nil || !*rec.Happened {
		t.Errorf("refused decisions changed the record: %+v", rec)
	}

	// The mail service fails its next request with 503: nobody knows.
	b.svc[demo.NameMail].Service.FailNext(1)
	b.start(notJob)
	if v := b.waitStopped(notJob); v.Status != schemas.JobNeedsReconciliation {
		t.Fatalf("job %s: %s, want needs_reconciliation", notJob, v.Status)
	}
	notKey := notJob + "/notify"
	out, errOut, code = effCLI(t, url, "effects", "list", "--state", "ambiguous", "-o", "json")
	if err := json.Unmarshal([]byte(out), &list); code != 0 || err != nil || len(list.Effects) != 1 || list.Effects[0].Key != notKey {
		t.Fatalf("ambiguous effects: exit %d: %s%s; want only %s", code, out, errOut, notKey)
	}
	out, errOut, code = effCLI(t, url, "effects", "resolve", notKey, "--not-happened", "--by", "ops", "--note", "not in the outbox")
	if code != 0 || !strings.Contains(out, "did not happen; the step will perform it") {
		t.Fatalf("effects resolve --not-happened: exit %d: %s%s", code, out, errOut)
	}
	b.waitStatus(notJob, schemas.JobCompleted)
	b.checkProvider(demo.NameMail, notKey, 2, 1)
	if rec := b.record(notKey); rec.State != schemas.EffectConfirmed || rec.Calls != 2 {
		t.Errorf("record %s: %+v; want confirmed after a second call", notKey, rec)
	}
}

// TestEffectsHTTPAPI covers the effects endpoints of the engine's API.
func TestEffectsHTTPAPI(t *testing.T) {
	t.Parallel()
	const job = "api-job"
	key := job + "/notify"
	b := effSetup(t, effOptions{demo: map[string]demo.Options{demo.NameMail: {DropAfterCommit: dropFirst(key)}}})
	api := httptest.NewServer((&api.API{Client: b.client}).Handler())
	t.Cleanup(api.Close)
	b.start(job)
	if v := b.waitStopped(job); v.Status != schemas.JobNeedsReconciliation {
		t.Fatalf("job %s: %s, want needs_reconciliation", job, v.Status)
	}

	do := func(method, path, body string) (int, []byte) {
		t.Helper()
		req, err := http.NewRequest(method, api.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, data
	}
	var list struct {
		Effects []*schemas.EffectRecord `json:"effects"`
	}
	status, body := do("GET", "/v1/effects?job="+job+"&state=ambiguous", "")
	if err := json.Unmarshal(body, &list); status != 200 || err != nil || len(list.Effects) != 1 || list.Effects[0].Key != key {
		t.Fatalf("GET /v1/effects?job&state: %d %s; want only %s", status, body, key)
	}
	status, body = do("GET", "/v1/effects?job="+job, "")
	if err := json.Unmarshal(body, &list); status != 200 || err != nil || len(list.Effects) != 3 {
		t.Fatalf("GET /v1/effects?job: %d %s; want the job's 3 effects", status, body)
	}
	status, body = do("GET", "/v1/effects?job=nobody", "")
	if status != 200 || !jsonEqual(body, []byte(`{"effects": []}`)) {
		t.Errorf("GET /v1/effects?job=nobody: %d %s; want an empty list", status, body)
	}
	var rec schemas.EffectRecord
	status, body = do("GET", "/v1/effects/"+key, "")
	if err := json.Unmarshal(body, &rec); status != 200 || err != nil || rec.Key != key || rec.State != schemas.EffectAmbiguous {
		t.Fatalf("GET /v1/effects/%s: %d %s", key, status, body)
	}

	errorCode := func(body []byte) string {
		var e struct {
			Error struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		_ = json.Unmarshal(body, &e)
		return e.Error.Code
	}
	for _, tc := range []struct {
		name, method, path, body string
		status                   int
		code                     string
	}{
		{"unknown effect", "GET", "/v1/effects/nobody/nothing", "", 404, "not_found"},
		{"resolve unknown effect", "POST", "/v1/effects/resolve", `{"key": "nobody/nothing", "happened": true, "by": "ops"}`, 404, "not_found"},
		{"resolve confirmed effect", "POST", "/v1/effects/resolve", `{"key": "` + job + `/charge", "happened": true, "by": "ops"}`, 409, "conflict"},
		{"body not JSON", "POST", "/v1/effects/resolve", `{"key": `, 400, "input_invalid"},
		{"unknown field", "POST", "/v1/effects/resolve", `{"key": "` + key + `", "happened": true, "by": "ops", "sure": true}`, 400, "input_invalid"},
		{"no key", "POST", "/v1/effects/resolve", `{"happened": true, "by": "ops"}`, 400, "input_invalid"},
		{"nobody decides", "POST", "/v1/effects/resolve", `{"key": "` + key + `", "happened": true}`, 400, "input_invalid"},
		{"not happened with a result", "POST", "/v1/effects/resolve", `{"key": "` + key + `", "happened": false, "result": {"id": 1}, "by": "ops"}`, 400, "input_invalid"},
	} {
		status, body := do(tc.method, tc.path, tc.body)
		if status != tc.status || errorCode(body) != tc.code {
			t.Errorf("%s: %s %s: %d %s; want %d with code %s", tc.name, tc.method, tc.path, status, body, tc.status, tc.code)
		}
	}
	if rec := b.record(key); rec.State != schemas.EffectAmbiguous {
		t.Fatalf("rejected requests changed the record: %+v", rec)
	}

	status, body = do("POST", "/v1/effects/resolve", `{"key": "`+key+`", "happened": true, "external_id": "msg_000001", "result": {"id": "msg_000001"}, "by": "ops"}`)
	if err := json.Unmarshal(body, &rec); status != 200 || err != nil || rec.State != schemas.EffectReconciled || rec.ReconciledBy != "ops" {
		t.Fatalf("POST /v1/effects/resolve: %d %s", status, body)
	}
	v := b.waitStatus(job, schemas.JobCompleted)
	if mail := stateField(t, v, "mail"); !jsonEqual(mail, []byte(`{"id": "msg_000001"}`)) {
		t.Errorf("state.mail = %s", mail)
	}
	b.checkProvider(demo.NameMail, key, 1, 1)
	status, body = do("POST", "/v1/effects/resolve", `{"key": "`+key+`", "happened": true, "by": "ops"}`)
	if status != 200 {
		t.Errorf("resolving again: %d %s; want 200", status, body)
	}
}

// TestIdempotentAndLookupRetries: a provider that performs the effect and
// loses its answer. The idempotent payments is called again with the same
// key and replays its answer; records is asked whether the write with the
// key happened and is not written again.
func TestIdempotentAndLookupRetries(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		service string
		step    string
		calls   int // at the provider, for the step's key
		ledger  int // calls the ledger counted
	}{
		{name: "idempotent payments replays", service: demo.NamePayments, step: "charge", calls: 2, ledger: 2},
		{name: "lookup records is asked", service: demo.NameRecords, step: "record", calls: 1, ledger: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			job := "retry-" + tt.step
			key := job + "/" + tt.step
			b := effSetup(t, effOptions{demo: map[string]demo.Options{tt.service: {DropAfterCommit: dropFirst(key)}}})
			b.start(job)
			v := b.waitStopped(job)
			if v.Status != schemas.JobCompleted {
				t.Fatalf("job %s: %s (%v), want completed", job, v.Status, v.Error)
			}
			b.checkProvider(tt.service, key, tt.calls, 1)
			b.checkProvider(demo.NamePayments, job+"/charge", map[bool]int{true: 2, false: 1}[tt.step == "charge"], 1)
			b.checkProvider(demo.NameRecords, job+"/record", 1, 1)
			b.checkProvider(demo.NameMail, job+"/notify", 1, 1)
			rec := b.record(key)
			if rec.State != schemas.EffectConfirmed || rec.Calls != tt.ledger {
				t.Errorf("record %s: state %s, %d calls; want confirmed after %d", key, rec.State, rec.Calls, tt.ledger)
			}
			for _, s := range v.Steps {
				want := 1
				if s.ID == tt.step {
					want = 2 // the attempt that lost the answer failed; the next one settled it
				}
				if s.Attempts != want {
					t.Errorf("step %s: %d attempts, want %d", s.ID, s.Attempts, want)
				}
			}
			// The saved output is the provider's first answer: the charge
			// or record made once.
			out := stateField(t, v, tt.step)
			var got struct {
				ID string `json:"id"`
			}
			if err := json.Unmarshal(out, &got); err != nil || (got.ID != "ch_000001" && got.ID != "rec_000001") || rec.ExternalID != got.ID {
				t.Errorf("state.%s = %s, external id %q; want the one %s made", tt.step, out, rec.ExternalID, tt.service)
			}
			evs := b.history(job)
			failed := effEvents(evs, schemas.EventStepFailed, tt.step)
			if len(failed) != 1 || !failed[0].Data.Retrying {
				t.Errorf("history: want one retried failure of %s: %s", tt.step, effTypes(evs))
			}
			if n := len(effEvents(evs, schemas.EventEffectAmbiguous, "")); n != 0 {
				t.Errorf("history: %d ambiguous effects: %s", n, effTypes(evs))
			}
		})
	}
}

// TestDedupOutlivesTheDuplicateWindow: a step message delivered again
// after the work stream's duplicate window (here 1s) is not caught by
// JetStream; the effect ledger answers it from the record, without
// calling the provider (DESIGN.md invariant 5).
func TestDedupOutlivesTheDuplicateWindow(t *testing.T) {
	t.Parallel()
	const job = "dedup"
	key := job + "/charge"
	window := time.Second
	b := effSetup(t, effOptions{
		kv:       kv.Config{Duplicates: window},
		noWorker: true,
		workflow: filepath.Join(testsupport.ModuleRoot(), "cmd/engine/testdata/charge.yaml"),
	})
	// The first worker confirms the effect in the ledger, then stalls
	// before it publishes the result: the attempt stays current. With one
	// slot, it takes no other message meanwhile.
	fps, err := failpoint.Parse("worker.after_confirm=delay=5s")
	if err != nil {
		t.Fatal(err)
	}
	first := b.startWorker(steps.WorkerConfig{ID: "worker-1", Concurrency: 1, Failpoints: fps})
	b.start(job)
	testsupport.Eventually(t, 20*time.Second, func() bool {
		r, err := b.client.Effect(context.Background(), key)
		return err == nil && r.State == schemas.EffectConfirmed
	}, "effect %s never confirmed", key)
	b.checkProvider(demo.NamePayments, key, 1, 1)

	ent, err := b.store.Checkpoints.Get(context.Background(), job)
	if err != nil {
		t.Fatal(err)
	}
	cur := ent.Checkpoint.Current
	if ent.Checkpoint.Status != schemas.JobRunning || cur == nil || cur.Step != "charge" || cur.Attempt != 1 {
		t.Fatalf("checkpoint: status %s, current %+v; want charge attempt 1 still in hand", ent.Checkpoint.Status, cur)
	}
	stream, err := b.store.JS.Stream(context.Background(), b.store.Names.WorkStream)
	if err != nil {
		t.Fatal(err)
	}
	orig, err := stream.GetLastMsgForSubject(context.Background(), b.store.Names.WorkSubject(cur.Pool, job))
	if err != nil {
		t.Fatalf("the step message in hand: %v", err)
	}
	if id := orig.Header.Get(jetstream.MsgIDHeader); id != cur.MsgID || id != schemas.StepMsgID(ent.Checkpoint.MsgPrefix(), "charge", 1) {
		t.Fatalf("step message id %q, checkpoint says %q", id, cur.MsgID)
	}
	sm, err := schemas.DecodeStepMessage(orig.Header, orig.Data)
	if err != nil {
		t.Fatal(err)
	}
	republish := func() *jetstream.PubAck {
		t.Helper()
		m := nats.NewMsg(b.store.Names.WorkSubject(cur.Pool, job))
		if m.Data, err = schemas.EncodeStepMessage(sm, m.Header); err != nil {
			t.Fatal(err)
		}
		m.Header.Set(jetstream.MsgIDHeader, cur.MsgID)
		ack, err := b.store.JS.PublishMsg(context.Background(), m)
		if err != nil {
			t.Fatal(err)
		}
		return ack
	}
	// Within the window the stream itself drops the copy; show it, as long
	// as the window has surely not passed yet (orig.Time is when the
	// server stored the original).
	if time.Since(orig.Time) < window/2 {
		if ack := republish(); !ack.Duplicate {
			t.Fatalf("a copy published within the duplicate window was stored (seq %d): the message id differs from the original's", ack.Sequence)
		}
	}
	testsupport.Eventually(t, 10*time.Second, func() bool { return time.Since(orig.Time) > window+500*time.Millisecond },
		"the duplicate window never passed")
	if ack := republish(); ack.Duplicate {
		t.Fatalf("the copy published %v after the original was still a duplicate; the window is %v", time.Since(orig.Time), window)
	}

	second := b.startWorker(steps.WorkerConfig{ID: "worker-2"})
	v := b.waitStopped(job)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("job %s: %s (%v), want completed", job, v.Status, v.Error)
	}
	st := second.Stats()
	if st.ReplayedEffects != 1 || st.Published != 1 {
		t.Errorf("second worker: %d replayed effects, %d results published; want 1 and 1 (%+v)", st.ReplayedEffects, st.Published, st)
	}
	b.checkProvider(demo.NamePayments, key, 1, 1)
	if rec := b.record(key); rec.Calls != 1 || rec.Worker != "worker-1" {
		t.Errorf("record: %d calls by %s; want 1 by worker-1", rec.Calls, rec.Worker)
	}
	var charge struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(stateField(t, v, "charge"), &charge); err != nil || charge.ID != "ch_000001" {
		t.Errorf("state.charge = %s, want ch_000001 from the ledger", stateField(t, v, "charge"))
	}
	evs := b.history(job)
	if len(effEvents(evs, schemas.EventEffectReplayed, "charge")) != 1 || len(effEvents(evs, schemas.EventEffectConfirmed, "charge")) != 1 {
		t.Errorf("history: want charge confirmed once and replayed once: %s", effTypes(evs))
	}
	// The stalled worker wakes up to find the attempt settled by someone
	// else: it publishes nothing.
	testsupport.Eventually(t, 15*time.Second, func() bool { return first.Stats().Stale == 1 },
		"the stalled worker never dropped its attempt (%v)", effLazy(func() string { return fmt.Sprintf("%+v", first.Stats()) }))
	if st := first.Stats(); st.Published != 0 {
		t.Errorf("the stalled worker published %d results", st.Published)
	}
}

// effClock is a clock a test sets; zero means the real time.
type effClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *effClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.now.IsZero() {
		return time.Now()
	}
	return c.now
}

func (c *effClock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}

// effGate holds whoever waits on ch until open.
type effGate struct {
	ch   chan struct{}
	once sync.Once
}

func newEffGate() *effGate { return &effGate{ch: make(chan struct{})} }

func (g *effGate) open() { g.once.Do(func() { close(g.ch) }) }

// TestJobRetention: a job's checkpoint, history, index entry and effect
// records stay while it runs, however old, and for JobRetention after it
// completed; then a sweep removes them all, and only them.
func TestJobRetention(t *testing.T) {
	t.Parallel()
	const done, running = "retained-done", "retained-running"
	retention := time.Second
	var clock effClock
	// Both jobs are held in their mail call until the test lets them go.
	held := map[string]*effGate{done + "/notify": newEffGate(), running + "/notify": newEffGate()}
	var entered sync.Map
	b := effSetup(t, effOptions{
		kv: kv.Config{JobRetention: retention},
		// No background reconciler or sweep: this test sweeps, and moves
		// the clock, itself.
		engine: engine.Config{Now: clock.Now, ReconcileInterval: -1},
		demo: map[string]demo.Options{demo.NameMail: {BeforeCommit: func(key string) {
			entered.Store(key, true)
			if g := held[key]; g != nil {
				<-g.ch
			}
		}}},
	})
	t.Cleanup(func() { // before the providers close
		for _, g := range held {
			g.open()
		}
	})
	b.start(done)
	b.start(running)
	for key := range held {
		testsupport.Eventually(t, 20*time.Second, func() bool { _, ok := entered.Load(key); return ok }, "%s never called", key)
	}
	ctx := context.Background()
	count := func(job string) int {
		recs, err := b.client.Effects(ctx, client.EffectFilter{Job: job})
		if err != nil {
			t.Fatal(err)
		}
		return len(recs)
	}
	sweep := func(at time.Time) {
		t.Helper()
		clock.Set(at)
		defer clock.Set(time.Time{})
		if err := b.engine.SweepJobs(ctx); err != nil {
			t.Fatalf("sweep: %v", err)
		}
	}

	// Running jobs: nothing is swept, however late it is.
	sweep(time.Now().Add(1000 * time.Hour))
	if n, m := count(done), count(running); n != 3 || m != 3 || b.engine.Stats().EffectsSwept != 0 {
		t.Fatalf("after a sweep while both jobs run: %d and %d records (want 3 and 3), %d swept", n, m, b.engine.Stats().EffectsSwept)
	}

	held[done+"/notify"].open()
	v := b.waitStopped(done)
	if v.Status != schemas.JobCompleted || v.CompletedAt == nil {
		t.Fatalf("job %s: %s, want completed", done, v.Status)
	}
	ended := *v.CompletedAt
	// The sweep reads the index of ended jobs, which follows the last
	// checkpoint.
	testsupport.Eventually(t, 20*time.Second, func() bool {
		page, err := b.client.List(ctx, client.ListFilter{Status: schemas.JobCompleted})
		return err == nil && len(page.Jobs) == 1 && page.Jobs[0].ID == done
	}, "job %s never listed as completed", done)

	sweep(ended.Add(retention / 2))
	if n := count(done); n != 3 || b.engine.Stats().EffectsSwept != 0 {
		t.Fatalf("within the retention: %d records of %s left (want 3), %d swept", n, done, b.engine.Stats().EffectsSwept)
	}
	sweep(ended.Add(retention + time.Second))
	if n := count(done); n != 0 || b.engine.Stats().EffectsSwept != 3 {
		t.Fatalf("after the retention: %d records of %s left (want 0), %d swept (want 3)", n, done, b.engine.Stats().EffectsSwept)
	}
	if _, err := b.client.Effect(ctx, done+"/charge"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("swept record: %v, want ErrNotFound", err)
	}
	if _, err := b.client.Job(ctx, done); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("swept job: %v, want ErrNotFound", err)
	}
	if evs, err := b.client.History(ctx, done); err != nil || len(evs) != 0 {
		t.Errorf("swept job's history: %d events, %v; want none", len(evs), err)
	}
	if page, err := b.client.List(ctx, client.ListFilter{Status: schemas.JobCompleted}); err != nil || len(page.Jobs) != 0 {
		t.Errorf("completed jobs after the sweep: %+v, %v; want none", page.Jobs, err)
	}
	if b.engine.Stats().JobsSwept != 1 {
		t.Errorf("jobs swept: %d, want 1", b.engine.Stats().JobsSwept)
	}
	// A swept id can be started again.
	b.start(done)
	if n := count(running); n != 3 {
		t.Errorf("the running job lost records: %d left, want 3", n)
	}
	held[done+"/notify"].open()
	b.waitStatus(done, schemas.JobCompleted)
	sweep(ended.Add(1000 * time.Hour))
	if n := count(running); n != 3 || b.engine.Stats().EffectsSwept != 6 {
		t.Errorf("a late sweep: %d records of the running job left (want 3), %d swept (want 6: the restarted job's too)", n, b.engine.Stats().EffectsSwept)
	}
	if v, err := b.client.Job(ctx, running); err != nil || v.Status != schemas.JobRunning {
		t.Fatalf("job %s: %v %v, want still running", running, v, err)
	}
}

// TestSweepWithoutDefinitionThenReuse: a finished job whose definition was
// deleted by hand is swept with its effect records all the same (found by
// reading the ledger), and a job started again under its id performs its
// own effects instead of replaying the old job's. A record an earlier job
// left behind (its checkpoint removed by hand, no sweep) is not taken for
// the new job's effect either.
func TestSweepWithoutDefinitionThenReuse(t *testing.T) {
	t.Parallel()
	const job = "reused"
	var clock effClock
	b := effSetup(t, effOptions{
		kv:     kv.Config{JobRetention: time.Second},
		engine: engine.Config{Now: clock.Now, ReconcileInterval: -1},
	})
	ctx := b.ctx()
	count := func() int {
		recs, err := b.client.Effects(ctx, client.EffectFilter{Job: job})
		if err != nil {
			t.Fatal(err)
		}
		return len(recs)
	}
	// Effects the providers performed (not calls: a provider answers a key
	// it remembers with its old result, and performs nothing).
	calls := func() int {
		n := 0
		for _, svc := range []string{demo.NamePayments, demo.NameRecords, demo.NameMail} {
			for _, c := range b.stats(svc).Effects {
				n += c
			}
		}
		return n
	}
	b.start(job)
	v := b.waitStopped(job)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("job %s: %s", job, v.Status)
	}
	if n := count(); n != 3 {
		t.Fatalf("%d effect records, want 3", n)
	}
	firstCalls := calls()
	// The sweep reads the ended index entry, which follows the checkpoint.
	testsupport.Eventually(t, 10*time.Second, func() bool {
		_, err := b.store.Jobs.Get(ctx, kv.EndedKey(schemas.JobCompleted, v.Workflow, job))
		return err == nil
	}, "job %s has no ended index entry", job)

	defs, err := b.store.JS.KeyValue(ctx, b.store.Names.DefinitionBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := defs.Purge(ctx, b.def.Hash); err != nil {
		t.Fatal(err)
	}
	// A store of its own: the bundle's has the definition cached.
	sweeper, err := engine.New(engine.Config{Store: b.srv.Store(t, kv.Config{JobRetention: time.Second}), Now: clock.Now, ReconcileInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	clock.Set(v.CompletedAt.Add(time.Hour))
	err = sweeper.SweepJobs(ctx)
	clock.Set(time.Time{})
	if err != nil {
		t.Fatalf("sweep: %v", err)
	}
	if n := count(); n != 0 {
		t.Fatalf("after the sweep: %d effect records of %s left, want 0", n, job)
	}
	if _, err := b.client.Job(ctx, job); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("swept job: %v, want ErrNotFound", err)
	}

	// The id again: every effect is performed anew (the providers are
	// called), and its checkpoint then removed by hand, leaving records.
	if err := b.store.Definitions.Put(ctx, b.def); err != nil {
		t.Fatal(err)
	}
	b.start(job)
	if v := b.waitStopped(job); v.Status != schemas.JobCompleted {
		t.Fatalf("job %s again: %s", job, v.Status)
	}
	secondCalls := calls()
	if secondCalls < 2*firstCalls {
		t.Fatalf("the providers had %d calls after the first job and %d after the second; the second job replayed the first's effects", firstCalls, secondCalls)
	}
	cps, err := b.store.JS.KeyValue(ctx, b.store.Names.CheckpointBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := cps.Purge(ctx, job); err != nil {
		t.Fatal(err)
	}
	jobs, err := b.store.JS.KeyValue(ctx, b.store.Names.JobsBucket)
	if err != nil {
		t.Fatal(err)
	}
	lister, err := jobs.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for k := range lister.Keys() {
		if strings.HasSuffix(k, "."+job) && (strings.HasPrefix(k, "active.") || strings.HasPrefix(k, "ended.")) {
			if err := jobs.Purge(ctx, k); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := count(); n != 3 {
		t.Fatalf("%d records left behind, want 3", n)
	}
	b.start(job)
	if v := b.waitStopped(job); v.Status != schemas.JobCompleted {
		t.Fatalf("job %s a third time: %s", job, v.Status)
	}
	if n := calls(); n < secondCalls+firstCalls {
		t.Errorf("the providers had %d calls before the third job and %d after; it replayed records another job left", secondCalls, n)
	}
	for _, ev := range b.history(job) {
		if ev.Type == schemas.EventEffectReplayed {
			t.Errorf("third job's history replays an effect: %+v", ev.Data)
		}
	}
}
