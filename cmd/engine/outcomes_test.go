package main

// Unknown outcomes, end to end (issue 8): a job never fails, nor takes
// on_error, while one of its effects may have happened and is not recorded
// as happened or not. It stops in needs_reconciliation, naming the effect,
// its class, its key and the last error, and a person's resolution moves
// it on: "not happened" calls again under the same idempotency key,
// "happened" takes the given result. Shared keys (a step-level
// idempotency_key) are fenced per job, settled for every job at once and
// kept by the retention sweep while a job uses them. Every test runs a real
// embedded nats-server; the dead-letter and overtaken-worker cases run real
// worker processes and kill or stop them.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// ocTestdata is the path of a workflow in this package's testdata.
func ocTestdata(name string) string {
	return filepath.Join(testsupport.ModuleRoot(), "cmd/engine/testdata", name)
}

// ocProvider is an idempotent HTTP provider for tests of slow answers. It
// performs the effect on the first request with an Idempotency-Key and
// stores its answer; every later request with the key gets that answer.
// Answers are held until release is called: the first answer of each key
// always, replays too when holdReplays is set. A held request whose client
// gives up (a step timeout) ends without an answer; its effect stands.
type ocProvider struct {
	holdReplays bool
	srv         *httptest.Server

	mu       sync.Mutex
	calls    map[string]int    // requests per key
	effects  map[string]int    // effects performed per key
	answers  map[string]string // the answer of each key's effect
	released chan struct{}     // closed by release
}

func newOCProvider(t *testing.T, holdReplays bool) *ocProvider {
	p := &ocProvider{holdReplays: holdReplays, calls: map[string]int{}, effects: map[string]int{},
		answers: map[string]string{}, released: make(chan struct{})}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		key := r.Header.Get("Idempotency-Key")
		p.mu.Lock()
		p.calls[key]++
		answer, replay := p.answers[key]
		if !replay {
			p.effects[key]++
			answer = fmt.Sprintf(`{"id": "ch_%06d", "key": %q}`, len(p.answers)+1, key)
			p.answers[key] = answer
		}
		released := p.released
		p.mu.Unlock()
		if !replay || p.holdReplays {
			select {
			case <-released:
			case <-r.Context().Done():
				return // the caller gave up; the effect was performed all the same
			}
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, answer)
	}))
	t.Cleanup(p.srv.Close)
	t.Cleanup(p.release) // runs first: no handler left waiting
	return p
}

// release lets every held answer, and every later one, go out at once.
func (p *ocProvider) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.released:
	default:
		close(p.released)
	}
}

// count returns the requests and the effects for key.
func (p *ocProvider) count(key string) (calls, effects int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls[key], p.effects[key]
}

func (p *ocProvider) answer(key string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.answers[key]
}

// ocGate answers POST {"job": ...} at once, except for the jobs it holds,
// which wait until open.
type ocGate struct {
	srv     *httptest.Server
	held    map[string]bool
	open    chan struct{}
	once    sync.Once
	mu      sync.Mutex
	arrived map[string]int
}

func newOCGate(t *testing.T, held ...string) *ocGate {
	g := &ocGate{held: map[string]bool{}, open: make(chan struct{}), arrived: map[string]int{}}
	for _, j := range held {
		g.held[j] = true
	}
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Job string `json:"job"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		g.mu.Lock()
		g.arrived[body.Job]++
		g.mu.Unlock()
		if g.held[body.Job] {
			select {
			case <-g.open:
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"passed": %q}`, body.Job)
	}))
	t.Cleanup(g.srv.Close)
	t.Cleanup(g.release)
	return g
}

func (g *ocGate) release() { g.once.Do(func() { close(g.open) }) }

func (g *ocGate) reached(job string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.arrived[job] > 0
}

// ocCheckBlocked asserts that a job needing reconciliation names its
// effect: the step, the key, the class and the last error, in the job view
// and in `engine status JOB --output json` when natsURL is set.
func ocCheckBlocked(t *testing.T, v *client.JobView, natsURL, step, key string, class schemas.EffectClass, code schemas.Code) {
	t.Helper()
	if v.Status != schemas.JobNeedsReconciliation {
		t.Fatalf("job %s: %s (error %v); want needs_reconciliation", v.ID, v.Status, v.Error)
	}
	check := func(where string, b *schemas.Blocked) {
		t.Helper()
		if b == nil {
			t.Fatalf("%s: no blocked section", where)
		}
		if b.Step != step || b.EffectKey != key || b.Class != class || b.Reason == "" {
			t.Errorf("%s: blocked %+v; want step %s, effect %s, class %s, with a reason", where, b, step, key, class)
		}
		if b.LastError == nil || b.LastError.Code != code || b.LastError.Message == "" {
			t.Errorf("%s: last error %+v; want code %s with a message", where, b.LastError, code)
		}
	}
	check("job "+v.ID, v.Blocked)
	if v.Error != nil {
		t.Errorf("job %s needs reconciliation but carries a job error: %v", v.ID, v.Error)
	}
	if natsURL == "" {
		return
	}
	out, errOut, exit := effCLI(t, natsURL, "status", v.ID, "--output", "json")
	if exit != 0 {
		t.Fatalf("engine status %s: exit %d: %s", v.ID, exit, errOut)
	}
	var got struct {
		Status  schemas.JobStatus `json:"status"`
		Blocked *schemas.Blocked  `json:"blocked"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("engine status --output json: %v\n%s", err, out)
	}
	if got.Status != schemas.JobNeedsReconciliation {
		t.Errorf("engine status: status %s, want needs_reconciliation", got.Status)
	}
	check("engine status --output json", got.Blocked)
}

// ocNoFailure asserts that a job's history never says it failed.
func ocNoFailure(t *testing.T, evs []schemas.HistoryEvent) {
	t.Helper()
	if n := len(effEvents(evs, schemas.EventJobFailed, "")); n != 0 {
		t.Errorf("history has %d job.failed events for a job whose effect may have happened: %s", n, effTypes(evs))
	}
}

// ocWaitRecord waits until the record under key is in state.
func ocWaitRecord(t *testing.T, cl *client.Client, key string, state schemas.EffectState) *schemas.EffectRecord {
	t.Helper()
	var rec *schemas.EffectRecord
	testsupport.Eventually(t, 10*time.Second, func() bool {
		r, err := cl.Effect(context.Background(), key)
		if err == nil {
			rec = r
		}
		return err == nil && r.State == state
	}, "effect %s never became %s (last: %v)", key, state, effLazy(func() string { return fmt.Sprintf("%+v", rec) }))
	return rec
}

// TestOutcomeUnsafeTimeout: the mail goes out and its answer comes after
// the step's timeout. The job must not fail: it stops in
// needs_reconciliation, is listed by `engine list --status`, its effect is
// listed ambiguous with class, key and last error, and resolving it as
// happened completes the job without a second mail.
func TestOutcomeUnsafeTimeout(t *testing.T) {
	t.Parallel()
	const job = "slow-mail"
	key := job + "/notify"
	b := effSetup(t, effOptions{
		tcp:      true,
		workflow: ocTestdata("slow-mail.yaml"),
		// Far past the 500ms step timeout; the handler returns as soon as
		// the worker gives up.
		demo: map[string]demo.Options{demo.NameMail: {Delay: 30 * time.Second}},
	})
	url := b.srv.URL()
	b.start(job)
	v := b.waitStopped(job)
	ocCheckBlocked(t, v, url, "notify", key, schemas.EffectUnsafe, schemas.CodeAmbiguous)
	b.checkProvider(demo.NameMail, key, 1, 1)

	out, errOut, exit := effCLI(t, url, "list", "--status", "needs_reconciliation", "--output", "json")
	var page client.JobPage
	if err := json.Unmarshal([]byte(out), &page); exit != 0 || err != nil {
		t.Fatalf("engine list --status needs_reconciliation: exit %d, %v: %s%s", exit, err, out, errOut)
	}
	if len(page.Jobs) != 1 || page.Jobs[0].ID != job || page.Jobs[0].Status != schemas.JobNeedsReconciliation {
		t.Errorf("engine list --status needs_reconciliation: %+v; want only %s", page.Jobs, job)
	}
	if failed, err := b.client.List(context.Background(), client.ListFilter{Status: schemas.JobFailed}); err != nil || len(failed.Jobs) != 0 {
		t.Errorf("failed jobs: %+v, %v; want none", failed.Jobs, err)
	}

	out, errOut, exit = effCLI(t, url, "effects", "list", "--state", "ambiguous", "--output", "json")
	var list struct {
		Effects []*schemas.EffectRecord `json:"effects"`
	}
	if err := json.Unmarshal([]byte(out), &list); exit != 0 || err != nil {
		t.Fatalf("engine effects list --state ambiguous: exit %d, %v: %s%s", exit, err, out, errOut)
	}
	if len(list.Effects) != 1 {
		t.Fatalf("ambiguous effects: %s; want just %s", out, key)
	}
	rec := list.Effects[0]
	if rec.Key != key || rec.Class != schemas.EffectUnsafe || rec.State != schemas.EffectAmbiguous || rec.Calls != 1 ||
		rec.LastError == nil || rec.LastError.Message == "" || rec.Reason == "" {
		t.Errorf("ambiguous effect: %+v; want %s, unsafe, after 1 call, with its last error and a reason", rec, key)
	}
	evs := b.history(job)
	ocNoFailure(t, evs)
	if len(effEvents(evs, schemas.EventStepBlocked, "notify")) != 1 || len(effEvents(evs, schemas.EventEffectAmbiguous, "notify")) == 0 {
		t.Errorf("history: want notify blocked once and its effect ambiguous: %s", effTypes(evs))
	}

	out, errOut, exit = effCLI(t, url, "effects", "resolve", key, "--happened", "--external-id", "msg_000001", "--by", "ops")
	if exit != 0 || !strings.Contains(out, "Job "+job+" resumes") {
		t.Fatalf("effects resolve --happened: exit %d: %s%s; want the job to resume", exit, out, errOut)
	}
	v = b.waitStatus(job, schemas.JobCompleted)
	if v.Blocked != nil || v.Error != nil {
		t.Errorf("completed job: blocked %+v, error %v", v.Blocked, v.Error)
	}
	b.checkProvider(demo.NameMail, key, 1, 1)
	var outbox demo.Outbox
	resilGetJSON(t, b.svc[demo.NameMail].URL+"/v1/outbox", &outbox)
	if len(outbox.Messages) != 1 {
		t.Errorf("outbox holds %d messages, want the one sent", len(outbox.Messages))
	}
	if rec := b.record(key); rec.State != schemas.EffectReconciled || rec.Happened == nil || !*rec.Happened || rec.ExternalID != "msg_000001" {
		t.Errorf("record after resolving: %+v", rec)
	}
	evs = b.history(job)
	ocNoFailure(t, evs)
	for _, typ := range []string{schemas.EventEffectReconciled, schemas.EventStepUnblocked, schemas.EventEffectReplayed} {
		if len(effEvents(evs, typ, "notify")) != 1 {
			t.Errorf("history: want one %s for notify: %s", typ, effTypes(evs))
		}
	}
	if len(effEvents(evs, schemas.EventEffectDispatched, "notify")) != 1 || len(effEvents(evs, schemas.EventJobCompleted, "")) != 1 {
		t.Errorf("history: want notify dispatched once and the job completed once: %s", effTypes(evs))
	}
}

// TestOutcomeIdempotentTimeouts: a provider that performs the charge and
// answers only after the step's timeout, on every attempt. After its last
// attempt the job stops in needs_reconciliation and the record, dispatched
// so far, is marked ambiguous and listed. Resolved "not happened" (the
// provider fast again), the step calls again with the same key and the
// provider answers with the one charge it made; resolved "happened" with a
// result file, the result becomes the step's output and nothing is called.
func TestOutcomeIdempotentTimeouts(t *testing.T) {
	t.Parallel()
	const notJob, happenedJob = "charge-not-happened", "charge-happened"
	notKey, happenedKey := notJob+"/charge", happenedJob+"/charge"
	p := newOCProvider(t, true)
	b := effSetup(t, effOptions{tcp: true, noWorker: true, workflow: ocTestdata("slow-charge.yaml")})
	b.env.Services["slowpay"] = p.srv.URL
	b.worker = b.startWorker(steps.WorkerConfig{ID: "worker-1"})
	url := b.srv.URL()
	b.start(notJob)
	b.start(happenedJob)

	for _, job := range []string{notJob, happenedJob} {
		key := job + "/charge"
		v := b.waitStopped(job)
		ocCheckBlocked(t, v, url, "charge", key, schemas.EffectIdempotent, schemas.CodeTimeout)
		if len(v.Steps) != 1 || v.Steps[0].Attempts != 3 || v.Steps[0].Status != schemas.StepBlocked {
			t.Errorf("job %s steps %+v; want charge blocked after its 3 attempts", job, v.Steps)
		}
		rec := ocWaitRecord(t, b.client, key, schemas.EffectAmbiguous)
		if rec.Class != schemas.EffectIdempotent || rec.Calls != 3 || rec.LastError == nil || !strings.Contains(rec.Reason, "failed for good") {
			t.Errorf("record %s: %+v; want idempotent, 3 calls, the last error, and why it is ambiguous", key, rec)
		}
		if calls, effects := p.count(key); calls != 3 || effects != 1 {
			t.Errorf("provider for %s: %d calls, %d effects; want 3 and 1", key, calls, effects)
		}
		evs := b.history(job)
		ocNoFailure(t, evs)
		failed := effEvents(evs, schemas.EventStepFailed, "charge")
		if len(failed) != 3 || !failed[0].Data.Retrying || !failed[1].Data.Retrying || failed[2].Data.Retrying ||
			!strings.Contains(failed[2].Data.Reason, "may have happened") {
			t.Errorf("history of %s: want two retried failures, then one for good that says the effect may have happened: %s", job, effTypes(evs))
		}
		if len(effEvents(evs, schemas.EventStepBlocked, "charge")) != 1 || len(effEvents(evs, schemas.EventEffectAmbiguous, "charge")) != 1 {
			t.Errorf("history of %s: want charge blocked and its effect ambiguous once: %s", job, effTypes(evs))
		}
	}
	amb, err := b.client.Effects(context.Background(), client.EffectFilter{State: schemas.EffectAmbiguous})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, r := range amb {
		keys = append(keys, r.Key)
	}
	slices.Sort(keys)
	if want := []string{happenedKey, notKey}; !slices.Equal(keys, want) {
		t.Errorf("ambiguous effects %v, want %v", keys, want)
	}
	if st := b.engine.Stats(); st.MarkedAmbiguous != 2 || st.JobsFailed != 0 {
		t.Errorf("engine: %d effects marked ambiguous, %d jobs failed; want 2 and 0", st.MarkedAmbiguous, st.JobsFailed)
	}

	// Not happened: the provider answers at once now; the step calls with
	// the same key and gets the charge made the first time.
	p.release()
	got, err := b.client.ResolveEffect(context.Background(), notKey, schemas.EffectResolution{By: "ops", Note: "no charge in the dashboard"})
	if err != nil {
		t.Fatalf("resolve %s: %v", notKey, err)
	}
	if !slices.Equal(got.Resumed, []string{notJob}) || got.State != schemas.EffectReconciled {
		t.Errorf("resolve %s: %+v, resumed %v", notKey, got.EffectRecord, got.Resumed)
	}
	v := b.waitStatus(notJob, schemas.JobCompleted)
	if calls, effects := p.count(notKey); calls != 4 || effects != 1 {
		t.Errorf("provider for %s: %d calls, %d effects; want 4 (one after the resolution) and 1", notKey, calls, effects)
	}
	if charge := stateField(t, v, "charge"); !jsonEqual(charge, []byte(p.answer(notKey))) {
		t.Errorf("state.charge = %s, want the provider's answer %s", charge, p.answer(notKey))
	}
	var answered struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal([]byte(p.answer(notKey)), &answered); err != nil {
		t.Fatal(err)
	}
	if rec := b.record(notKey); rec.State != schemas.EffectConfirmed || rec.Calls != 4 || rec.ExternalID != answered.ID {
		t.Errorf("record %s: %+v; want confirmed after 4 calls with the provider's id", notKey, rec)
	}

	// Happened, with the result from a file: no further call.
	resultFile := filepath.Join(t.TempDir(), "result.json")
	result := `{"id": "ch_by_hand", "amount_cents": 4999}`
	if err := os.WriteFile(resultFile, []byte(result), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, exit := effCLI(t, url, "effects", "resolve", happenedKey, "--happened", "--external-id", "ch_by_hand", "--result", resultFile, "--by", "ops")
	if exit != 0 || !strings.Contains(out, "Job "+happenedJob+" resumes") {
		t.Fatalf("effects resolve --happened --result: exit %d: %s%s", exit, out, errOut)
	}
	v = b.waitStatus(happenedJob, schemas.JobCompleted)
	if charge := stateField(t, v, "charge"); !jsonEqual(charge, []byte(result)) {
		t.Errorf("state.charge = %s, want the --result file %s", charge, result)
	}
	if calls, effects := p.count(happenedKey); calls != 3 || effects != 1 {
		t.Errorf("provider for %s: %d calls, %d effects; want still 3 and 1", happenedKey, calls, effects)
	}
	if rec := b.record(happenedKey); rec.State != schemas.EffectReconciled || rec.ExternalID != "ch_by_hand" || !jsonEqual(rec.Result, []byte(result)) {
		t.Errorf("record %s: %+v", happenedKey, rec)
	}
	for _, job := range []string{notJob, happenedJob} {
		ocNoFailure(t, b.history(job))
	}
}

// TestOutcomeDeadLetter: a step whose worker process dies after its call
// on every delivery is dead-lettered after WAYMARK_WORK_MAX_DELIVER (3)
// deliveries. The engine reads the ledger: the idempotent charge's record
// says dispatched, so its job stops in needs_reconciliation (the effect
// marked ambiguous) instead of failing, and its history says why; a pure
// step dead-lettered beside it fails with the poison-step reason.
func TestOutcomeDeadLetter(t *testing.T) {
	t.Parallel()
	log := resilLogger(t)
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	cfg := kv.Config{InboxAckWait: time.Second, WorkAckWait: time.Second, WorkMaxDeliver: 3}
	store := srv.Store(t, cfg)
	cl := client.New(store)
	eng := resilEngine(t, srv.Store(t, cfg), log)
	pay, err := demo.Start(context.Background(), demo.NamePayments, demo.Options{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pay.Close() })

	workerBin := testsupport.Binary(t, "worker")
	env := []string{
		// Each worker process kills itself the first time it is back from
		// the charge's call, and the first time it receives the poison.
		"WAYMARK_FAILPOINTS=" + failpoint.WorkerAfterRemoteCommit + "=crash/charge," + failpoint.WorkerAfterReceive + "=crash/poison",
		"WAYMARK_WORK_MAX_DELIVER=3",
		"WAYMARK_WORK_ACK_WAIT=1s",
		"WAYMARK_INBOX_ACK_WAIT=1s",
	}
	startWorker := func() *proc {
		return spawn(t, env, workerBin, "--nats-url="+srv.URL(), "--concurrency=1", "--service="+demo.NamePayments+"="+pay.URL)
	}
	workers := []*proc{startWorker(), startWorker()}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const charged, poisoned = "dead-charge", "dead-pure"
	key := charged + "/charge"
	if _, err := cl.Start(ctx, loadDef(t, ocTestdata("charge.yaml")), nil, client.StartOptions{JobID: charged}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Start(ctx, resilDef(t, resilPoisonWorkflow), nil, client.StartOptions{JobID: poisoned}); err != nil {
		t.Fatal(err)
	}

	// Restart every worker that dies, until both jobs stop.
	crashes := map[string]int{}
	final := map[string]*client.JobView{}
	deadline := time.Now().Add(40 * time.Second)
	for len(final) < 2 {
		for _, job := range []string{charged, poisoned} {
			if v, err := cl.Job(ctx, job); err == nil && v.Status.Stopped() {
				final[job] = v
			}
		}
		for i, w := range workers {
			select {
			case <-w.done:
				w.waitKilled(t, time.Second)
				switch errOut := w.errOut.String(); {
				case strings.Contains(errOut, "failpoint "+failpoint.WorkerAfterRemoteCommit):
					crashes["charge"]++
				case strings.Contains(errOut, "failpoint "+failpoint.WorkerAfterReceive):
					crashes["poison"]++
				default:
					t.Fatalf("a worker died, but not at a failpoint:\n%s", lastLines(errOut, 20))
				}
				workers[i] = startWorker()
			default:
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("jobs stopped: %v within 40s (worker crashes %v)", final, crashes)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	t.Logf("worker crashes %v; engine %+v", crashes, eng.Stats())

	v := final[charged]
	ocCheckBlocked(t, v, "", "charge", key, schemas.EffectIdempotent, schemas.CodeStepFailed)
	if msg := v.Blocked.LastError.Message; !strings.Contains(msg, "poison step") || !strings.Contains(msg, "delivered 3 times") {
		t.Errorf("blocked job's last error %q does not say the step was dead-lettered after 3 deliveries", msg)
	}
	rec := ocWaitRecord(t, cl, key, schemas.EffectAmbiguous)
	st := pay.Stats()
	if st.Effects[key] != 1 || st.Calls[key] != rec.Calls || rec.Calls < 1 || rec.Calls > 3 {
		t.Errorf("payments for %s: %d calls, %d charges; ledger %d calls; want one charge, 1 to 3 calls, counted alike", key, st.Calls[key], st.Effects[key], rec.Calls)
	}
	if !strings.Contains(rec.Reason, "poison step") {
		t.Errorf("ambiguous record's reason %q does not say the step was dead-lettered", rec.Reason)
	}
	if amb, err := cl.Effects(ctx, client.EffectFilter{State: schemas.EffectAmbiguous}); err != nil || len(amb) != 1 || amb[0].Key != key {
		t.Errorf("ambiguous effects: %v, %v; want just %s", amb, err, key)
	}
	evs, err := cl.History(ctx, charged)
	if err != nil {
		t.Fatal(err)
	}
	ocNoFailure(t, evs)
	failed := effEvents(evs, schemas.EventStepFailed, "charge")
	if len(failed) != 1 || failed[0].Data.Retrying || !strings.Contains(failed[0].Data.Reason, "may have happened") ||
		failed[0].Data.Error == nil || !strings.Contains(failed[0].Data.Error.Message, "poison step") || failed[0].Data.EffectState != string(schemas.EffectDispatched) {
		t.Errorf("history of %s: want one failure for good of charge, as a poison step whose effect was dispatched and may have happened: %+v", charged, failed)
	}
	if len(effEvents(evs, schemas.EventStepBlocked, "charge")) != 1 || len(effEvents(evs, schemas.EventEffectAmbiguous, "charge")) != 1 {
		t.Errorf("history of %s: want charge blocked and its effect ambiguous: %s", charged, effTypes(evs))
	}

	p := final[poisoned]
	if p.Status != schemas.JobFailed || p.Error == nil || !strings.Contains(p.Error.Message, "poison step") || !strings.Contains(p.Error.Message, "delivered 3 times") {
		t.Errorf("pure dead letter: %s (%v); want failed as a poison step delivered 3 times", p.Status, p.Error)
	}
	if p.Blocked != nil {
		t.Errorf("pure dead letter is blocked on %+v", p.Blocked)
	}
	pevs, err := cl.History(ctx, poisoned)
	if err != nil {
		t.Fatal(err)
	}
	if len(effEvents(pevs, schemas.EventJobFailed, "")) != 1 || len(effEvents(pevs, schemas.EventStepBlocked, "")) != 0 {
		t.Errorf("history of %s: want the job failed and nothing blocked: %s", poisoned, effTypes(pevs))
	}
	if s := eng.Stats(); s.DeadLetters < 2 || s.MarkedAmbiguous != 1 || s.JobsFailed != 1 {
		t.Errorf("engine: %d dead letters, %d marked ambiguous, %d jobs failed; want 2 or more, 1, 1", s.DeadLetters, s.MarkedAmbiguous, s.JobsFailed)
	}

	// The person finds the charge: the job completes with it and nothing
	// is called again (no worker reaches the call, so none dies).
	result := json.RawMessage(`{"id": "ch_000001"}`)
	res, err := cl.ResolveEffect(ctx, key, schemas.EffectResolution{Happened: true, ExternalID: "ch_000001", Result: result, By: "ops"})
	if err != nil || !slices.Equal(res.Resumed, []string{charged}) {
		t.Fatalf("resolve %s: %+v, %v; want %s resumed", key, res, err, charged)
	}
	var done *client.JobView
	testsupport.Eventually(t, 20*time.Second, func() bool {
		done, err = cl.Job(ctx, charged)
		return err == nil && done.Status.Terminal()
	}, "job %s did not end after the resolution (last: %v)", charged, effLazy(func() string { return fmt.Sprintf("%+v %v", done, err) }))
	if done.Status != schemas.JobCompleted || !jsonEqual(stateField(t, done, "charge"), result) {
		t.Errorf("job %s after the resolution: %s, state %s; want completed with the given result", charged, done.Status, done.State)
	}
	if n := pay.Stats().Calls[key]; n != st.Calls[key] {
		t.Errorf("payments called %d times for %s after the resolution; want none", n-st.Calls[key], key)
	}
}

// ocMetricsURL waits for a worker process started with --metrics to say
// where it serves them.
func ocMetricsURL(t *testing.T, p *proc) string {
	t.Helper()
	re := regexp.MustCompile(`metrics: (http://\S+/metrics)`)
	var url string
	testsupport.Eventually(t, 20*time.Second, func() bool {
		if m := re.FindStringSubmatch(p.out.String()); m != nil {
			url = m[1]
			return true
		}
		return false
	}, "the worker never said where it serves metrics:\n%s", effLazy(p.out.String))
	return url
}

// ocCounter reads one waymark_worker_<name>_total counter.
func ocCounter(t *testing.T, url, name string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	prefix := "waymark_worker_" + name + "_total "
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), prefix); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				t.Fatalf("%s: %q: %v", url, sc.Text(), err)
			}
			return v
		}
	}
	t.Fatalf("%s has no %s", url, strings.TrimSpace(prefix))
	return 0
}

// TestOutcomeOvertakenWorker: worker process A is stopped (SIGSTOP) inside
// an idempotent call, beyond its one-second lease; the step goes to worker
// process B, which calls again with the same key, gets the provider's one
// answer, confirms and completes the job. A is continued after its answer
// came: it was already inside the call when it was overtaken, so the call
// was made, but it writes nothing to the ledger, publishes no result and
// logs that a later delivery overtook it. One effect, one completion, one
// effect.confirmed.
func TestOutcomeOvertakenWorker(t *testing.T) {
	t.Parallel()
	log := resilLogger(t)
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	cfg := kv.Config{InboxAckWait: time.Second, WorkAckWait: time.Second}
	store := srv.Store(t, cfg)
	cl := client.New(store)
	eng := resilEngine(t, srv.Store(t, cfg), log)
	p := newOCProvider(t, false)

	workerBin := testsupport.Binary(t, "worker")
	env := []string{"WAYMARK_WORK_ACK_WAIT=1s", "WAYMARK_INBOX_ACK_WAIT=1s", "WAYMARK_LOG_LEVEL=info"}
	// One step at a time: a stopped A has no pull request open, so the
	// next delivery goes to B.
	args := []string{"--nats-url=" + srv.URL(), "--service=hold=" + p.srv.URL, "--concurrency=1", "--metrics=127.0.0.1:0"}
	a := spawn(t, env, workerBin, args...)
	t.Cleanup(func() { _ = syscall.Kill(a.cmd.Process.Pid, syscall.SIGCONT) }) // before it is killed
	aMetrics := ocMetricsURL(t, a)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const job = "overtaken"
	key := job + "/charge"
	if _, err := cl.Start(ctx, loadDef(t, ocTestdata("held-charge.yaml")), nil, client.StartOptions{JobID: job}); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool { calls, _ := p.count(key); return calls == 1 },
		"worker A never called the provider")
	if err := syscall.Kill(a.cmd.Process.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	bw := spawn(t, env, workerBin, args...)
	bMetrics := ocMetricsURL(t, bw)

	v := resilWaitStopped(t, cl, job, 20*time.Second)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("job %s: %s (%v), want completed by worker B", job, v.Status, v.Error)
	}
	host, _ := os.Hostname()
	aID, bID := host+"-"+strconv.Itoa(a.cmd.Process.Pid), host+"-"+strconv.Itoa(bw.cmd.Process.Pid)
	settled, err := store.Effects.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if r := settled.Record; r.State != schemas.EffectConfirmed || r.Worker != bID || r.Attempt != 1 || r.Delivery != 2 || r.Calls != 2 {
		t.Fatalf("ledger before A continues: %s by %s (A is %s), attempt %d delivery %d, %d calls; want confirmed by B on delivery 2 of attempt 1 after 2 calls",
			r.State, r.Worker, aID, r.Attempt, r.Delivery, r.Calls)
	}
	if calls, effects := p.count(key); calls != 2 || effects != 1 {
		t.Errorf("provider before A continues: %d calls, %d effects; want 2 and 1", calls, effects)
	}

	// A's answer goes out, then A goes on.
	p.release()
	if err := syscall.Kill(a.cmd.Process.Pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// Wait until A is done with its delivery, whichever way it ends: it
	// says it was overtaken, or it drops the attempt as stale, or it
	// reports, or it writes the ledger.
	overtaken := func() bool { return strings.Contains(a.errOut.String(), "overtaken by a later delivery") }
	testsupport.Eventually(t, 20*time.Second, func() bool {
		if overtaken() {
			return true
		}
		for _, c := range []string{"stale_attempts", "results_published", "steps_succeeded", "steps_failed"} {
			if ocCounter(t, aMetrics, c) > 0 {
				return true
			}
		}
		ent, err := store.Effects.Get(ctx, key)
		return err == nil && ent.Revision != settled.Revision
	}, "worker A never finished its delivery after it was continued:\n%s", effLazy(func() string { return lastLines(a.errOut.String(), 20) }))
	if !overtaken() {
		t.Errorf("worker A's log does not say it was overtaken:\n%s", lastLines(a.errOut.String(), 20))
	}
	if n := ocCounter(t, aMetrics, "stale_attempts"); n != 0 {
		t.Errorf("worker A dropped %v attempts as stale; want it to know it was overtaken", n)
	}
	if n := ocCounter(t, aMetrics, "results_published"); n != 0 {
		t.Errorf("worker A published %v results after it was overtaken; want none", n)
	}
	if n := ocCounter(t, aMetrics, "steps_started"); n != 1 {
		t.Errorf("worker A started %v steps, want 1", n)
	}
	if n := ocCounter(t, bMetrics, "results_published"); n != 1 {
		t.Errorf("worker B published %v results, want 1", n)
	}
	after, err := store.Effects.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if after.Revision != settled.Revision || after.Record.Worker != bID {
		t.Errorf("worker A wrote the ledger after it was overtaken: revision %d -> %d, last writer %s (B is %s)",
			settled.Revision, after.Revision, after.Record.Worker, bID)
	}
	if calls, effects := p.count(key); calls != 2 || effects != 1 {
		t.Errorf("provider: %d calls, %d effects; want 2 and 1", calls, effects)
	}
	v, err = cl.Job(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	if v.Status != schemas.JobCompleted || v.Steps[0].Attempts != 1 || !jsonEqual(stateField(t, v, "charge"), []byte(p.answer(key))) {
		t.Errorf("job %s, charge dispatched %d times, state %s; want completed after one dispatch with the provider's answer", v.Status, v.Steps[0].Attempts, v.State)
	}
	evs, err := cl.History(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(effEvents(evs, schemas.EventEffectConfirmed, "charge")); n != 1 {
		t.Errorf("history has %d effect.confirmed for %s, want 1: %s", n, key, effTypes(evs))
	}
	if len(effEvents(evs, schemas.EventJobCompleted, "")) != 1 || len(effEvents(evs, schemas.EventStepCompleted, "charge")) != 1 {
		t.Errorf("history: want the step and the job completed once: %s", effTypes(evs))
	}
	if s := eng.Stats(); s.JobsCompleted != 1 || s.ResultsApplied != 1 || s.StaleDropped != 0 {
		t.Errorf("engine: %d jobs completed, %d results applied, %d stale results; want 1, 1, 0", s.JobsCompleted, s.ResultsApplied, s.StaleDropped)
	}
}

// TestOutcomeSharedKey: two jobs for one order share the mail step's
// ledger record (idempotency_key: "{{.state.order_id}}"). The first's mail
// goes out and its answer is lost, so the record is ambiguous; the second
// finds it ambiguous and waits on it too; one resolution settles both, and
// the mail was sent once. Then retention: a third job that used the record
// and still runs keeps it through a sweep of the first two (it passes to
// the third); once the third is swept too the record is gone, and a fourth
// job for the order creates it again.
func TestOutcomeSharedKey(t *testing.T) {
	t.Parallel()
	const first, second, third, fourth = "shared-1", "shared-2", "shared-3", "shared-4"
	retention := time.Second
	var clock effClock
	wf := ocTestdata("shared-order.yaml")
	def := loadDef(t, wf)
	input, err := os.ReadFile(filepath.Join(testsupport.ModuleRoot(), "examples/effects/input.json"))
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := schemas.ParseEffectKey("notify", def.Step("notify").IdempotencyKey)
	if err != nil {
		t.Fatal(err)
	}
	key, err := schemas.EffectKey(def, def.Step("notify"), first, first, 1, tmpl, input, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(key, "shared-order/notify/k-") {
		t.Fatalf("shared key %q, want shared-order/notify/k-<digest>", key)
	}
	gate := newOCGate(t, third)
	b := effSetup(t, effOptions{
		tcp:      true,
		noWorker: true,
		workflow: wf,
		kv:       kv.Config{JobRetention: retention},
		// No background reconciler or sweep: this test sweeps, and moves
		// the clock, itself.
		engine: engine.Config{Now: clock.Now, ReconcileInterval: -1},
		demo:   map[string]demo.Options{demo.NameMail: {DropAfterCommit: dropFirst(key)}},
	})
	b.env.Services["gate"] = gate.srv.URL
	b.worker = b.startWorker(steps.WorkerConfig{ID: "worker-1"})
	ctx := context.Background()

	b.start(first)
	v := b.waitStopped(first)
	ocCheckBlocked(t, v, "", "notify", key, schemas.EffectUnsafe, schemas.CodeAmbiguous)
	b.checkProvider(demo.NameMail, key, 1, 1)
	if rec := b.record(key); rec.State != schemas.EffectAmbiguous || rec.Job != first {
		t.Fatalf("record %s: %+v; want ambiguous, created by %s", key, rec, first)
	}

	b.start(second)
	v = b.waitStopped(second)
	ocCheckBlocked(t, v, "", "notify", key, schemas.EffectUnsafe, schemas.CodeAmbiguous)
	testsupport.Eventually(t, 10*time.Second, func() bool {
		r, err := b.client.Effect(ctx, key)
		return err == nil && slices.Contains(r.SharedBy, second)
	}, "%s never recorded as waiting on %s", second, key)
	b.checkProvider(demo.NameMail, key, 1, 1)
	if rec := b.record(key); rec.State != schemas.EffectAmbiguous || rec.Job != first || rec.Calls != 1 {
		t.Fatalf("record %s after the second job: %+v; want still ambiguous, %s's, after one call", key, rec, first)
	}

	result := json.RawMessage(`{"id": "msg_000001"}`)
	res, err := b.client.ResolveEffect(ctx, key, schemas.EffectResolution{Happened: true, ExternalID: "msg_000001", Result: result, By: "ops"})
	if err != nil {
		t.Fatalf("resolve %s: %v", key, err)
	}
	if got := slices.Sorted(slices.Values(res.Resumed)); !slices.Equal(got, []string{first, second}) {
		t.Errorf("resolution resumed %v, want both %s and %s", res.Resumed, first, second)
	}
	for _, job := range []string{first, second} {
		v := b.waitStatus(job, schemas.JobCompleted)
		if mail := stateField(t, v, "mail"); !jsonEqual(mail, result) {
			t.Errorf("job %s: state.mail = %s, want the resolution's result", job, mail)
		}
		evs := b.history(job)
		ocNoFailure(t, evs)
		if len(effEvents(evs, schemas.EventEffectReconciled, "notify")) != 1 || len(effEvents(evs, schemas.EventStepUnblocked, "notify")) != 1 {
			t.Errorf("history of %s: want the resolution and the unblocking: %s", job, effTypes(evs))
		}
	}
	b.checkProvider(demo.NameMail, key, 1, 1)

	// A third job for the order takes the settled result and is held in
	// its next step: it still runs, and it uses the record.
	b.start(third)
	testsupport.Eventually(t, 20*time.Second, func() bool { return gate.reached(third) }, "%s never reached its held step", third)
	if rec := b.record(key); !slices.Contains(rec.SharedBy, third) {
		t.Fatalf("record %s: shared by %v; want %s among them", key, rec.SharedBy, third)
	}
	b.checkProvider(demo.NameMail, key, 1, 1)
	sweep := func(at time.Time) {
		t.Helper()
		clock.Set(at)
		defer clock.Set(time.Time{})
		if err := b.engine.SweepJobs(ctx); err != nil {
			t.Fatalf("sweep: %v", err)
		}
	}
	sweep(time.Now().Add(time.Hour))
	if st := b.engine.Stats(); st.JobsSwept != 2 || st.EffectsSwept != 0 {
		t.Errorf("sweep while %s runs: %d jobs, %d effects swept; want 2 and 0", third, st.JobsSwept, st.EffectsSwept)
	}
	for _, job := range []string{first, second} {
		if _, err := b.client.Job(ctx, job); !errors.Is(err, schemas.ErrNotFound) {
			t.Errorf("job %s after the sweep: %v, want ErrNotFound", job, err)
		}
	}
	rec, err := b.client.Effect(ctx, key)
	if err != nil {
		t.Fatalf("the record %s a running job uses was swept: %v", key, err)
	}
	if rec.Job != third || len(rec.SharedBy) != 0 || !rec.Settled() {
		t.Errorf("record after the sweep: job %s, shared by %v, %s; want it passed on to %s alone, still settled", rec.Job, rec.SharedBy, rec.State, third)
	}

	gate.release()
	v = b.waitStatus(third, schemas.JobCompleted)
	if mail := stateField(t, v, "mail"); !jsonEqual(mail, result) {
		t.Errorf("job %s: state.mail = %s, want the settled result", third, mail)
	}
	sweep(v.CompletedAt.Add(time.Hour))
	if _, err := b.client.Effect(ctx, key); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("record %s after its last job was swept: %v, want ErrNotFound", key, err)
	}
	if st := b.engine.Stats(); st.JobsSwept != 3 || st.EffectsSwept != 1 {
		t.Errorf("after sweeping %s: %d jobs, %d effects swept; want 3 and 1", third, st.JobsSwept, st.EffectsSwept)
	}

	// The key was swept: a new job for the order creates it again (and the
	// mail goes out again: nothing remembers the first).
	b.start(fourth)
	v = b.waitStatus(fourth, schemas.JobCompleted)
	rec = b.record(key)
	if rec.Job != fourth || rec.State != schemas.EffectConfirmed || rec.Calls != 1 || len(rec.SharedBy) != 0 {
		t.Errorf("record created again: %+v; want %s's, confirmed after one call", rec, fourth)
	}
	b.checkProvider(demo.NameMail, key, 2, 2)
	if mail := stateField(t, v, "mail"); !jsonEqual(mail, []byte(`{"id": "msg_000002"}`)) {
		t.Errorf("job %s: state.mail = %s, want the second message", fourth, mail)
	}
}

// TestOutcomeResolutionMovesNothing: an effect that is ambiguous while
// every job using it has ended (forced here by writing the record of a
// completed job back to ambiguous) cannot be resolved: the decision would
// move nothing, so it is refused (ErrNothingToResume, exit 2) with the
// job's status, and the record is left as it was.
func TestOutcomeResolutionMovesNothing(t *testing.T) {
	t.Parallel()
	const job = "ended"
	key := job + "/charge"
	b := effSetup(t, effOptions{tcp: true, workflow: ocTestdata("charge.yaml")})
	b.start(job)
	if v := b.waitStopped(job); v.Status != schemas.JobCompleted {
		t.Fatalf("job %s: %s (%v), want completed", job, v.Status, v.Error)
	}
	ctx := context.Background()
	if _, err := b.client.ResolveEffect(ctx, key, schemas.EffectResolution{Happened: true, By: "ops"}); !errors.Is(err, client.ErrNotAmbiguous) ||
		!strings.Contains(err.Error(), "confirmed") {
		t.Errorf("resolving a confirmed effect: %v; want ErrNotAmbiguous saying it is confirmed", err)
	}

	ent, err := b.store.Effects.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	forced := *ent.Record
	forced.State, forced.Reason = schemas.EffectAmbiguous, "forced by the test"
	rev, err := b.store.Effects.Update(ctx, &forced, ent.Revision)
	if err != nil {
		t.Fatal(err)
	}

	for _, happened := range []bool{true, false} {
		_, err := b.client.ResolveEffect(ctx, key, schemas.EffectResolution{Happened: happened, By: "ops"})
		if !errors.Is(err, client.ErrNothingToResume) || !strings.Contains(err.Error(), "job "+job+" is completed") {
			t.Errorf("resolve (happened %v) an effect whose job completed: %v; want ErrNothingToResume naming the job's status", happened, err)
		}
	}
	for _, answer := range []string{"--happened", "--not-happened"} {
		_, errOut, exit := effCLI(t, b.srv.URL(), "effects", "resolve", key, answer, "--by", "ops")
		if exit != 2 || !strings.Contains(errOut, "job "+job+" is completed") || !strings.Contains(errOut, "move nothing") {
			t.Errorf("effects resolve %s: exit %d: %s; want exit 2 saying the job is completed and nothing would move", answer, exit, errOut)
		}
	}
	after, err := b.store.Effects.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if after.Revision != rev || after.Record.State != schemas.EffectAmbiguous || after.Record.ReconciledBy != "" || after.Record.Happened != nil {
		t.Errorf("refused resolutions changed the record: revision %d -> %d, %+v", rev, after.Revision, after.Record)
	}
	evs := b.history(job)
	if n := len(effEvents(evs, schemas.EventEffectReconciled, "")); n != 0 {
		t.Errorf("history records %d resolutions that were refused: %s", n, effTypes(evs))
	}
	if v, err := b.client.Job(ctx, job); err != nil || v.Status != schemas.JobCompleted {
		t.Errorf("job %s: %v, %v; want still completed", job, v, err)
	}
}

// TestOutcomeSharedKeyFencedPerJob: fencing by (attempt, delivery) only
// compares attempts of one job. A first job for an order is refused twice
// (429: nothing happened) and fails, leaving the shared record prepared by
// its attempt 2; a second job for the order, on its attempt 1, is not
// "overtaken" by that record: it sends the mail and completes, and the
// record says which job's attempt wrote it.
func TestOutcomeSharedKeyFencedPerJob(t *testing.T) {
	t.Parallel()
	const refused, second = "fenced-1", "fenced-2"
	var mu sync.Mutex
	calls, sent := 0, map[string]int{}
	mail := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		defer mu.Unlock()
		calls++
		w.Header().Set("Content-Type", "application/json")
		if calls <= 2 {
			w.WriteHeader(http.StatusTooManyRequests)
			_, _ = io.WriteString(w, `{"error": "slow down; nothing was sent"}`)
			return
		}
		sent[r.Header.Get("Idempotency-Key")]++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id": "msg_%06d"}`, calls)
	}))
	t.Cleanup(mail.Close)
	gate := newOCGate(t)
	b := effSetup(t, effOptions{noWorker: true, workflow: ocTestdata("shared-order.yaml")})
	b.env.Services["mail"] = mail.URL // in place of the bundled one
	b.env.Services["gate"] = gate.srv.URL
	b.worker = b.startWorker(steps.WorkerConfig{ID: "worker-1"})

	b.start(refused)
	v := b.waitStopped(refused)
	if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, "429") {
		t.Fatalf("job %s: %s (%v); want failed by the refusals (nothing was sent)", refused, v.Status, v.Error)
	}
	recs, err := b.client.Effects(context.Background(), client.EffectFilter{Job: refused})
	if err != nil || len(recs) != 1 {
		t.Fatalf("effects of %s: %v, %v; want the shared record", refused, recs, err)
	}
	key := recs[0].Key
	if r := recs[0]; r.State != schemas.EffectPrepared || r.Attempt != 2 || r.Job != refused || r.Calls != 2 {
		t.Fatalf("record %s: %+v; want prepared by %s's attempt 2 after 2 calls", key, r, refused)
	}

	b.start(second)
	testsupport.Eventually(t, 15*time.Second, func() bool {
		v, err = b.client.Job(context.Background(), second)
		return err == nil && v.Status.Stopped()
	}, "job %s never stopped: another job's higher attempt fenced it out? (worker %+v)", second, effLazy(func() string { return fmt.Sprintf("%+v", b.worker.Stats()) }))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("job %s: %s (%v); want completed: another job's higher attempt must not fence it out", second, v.Status, v.Error)
	}
	rec := b.record(key)
	if rec.State != schemas.EffectConfirmed || rec.Job != refused || rec.AttemptOf != second || rec.Attempt != 1 || !slices.Contains(rec.SharedBy, second) || rec.Calls != 3 {
		t.Errorf("record %s: %+v; want confirmed, created by %s, written by %s's attempt 1, shared by it, after 3 calls", key, rec, refused, second)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 3 || sent[key] != 1 {
		t.Errorf("mail: %d calls, %d sent for %s; want 3 calls (2 refused) and one mail", calls, sent[key], key)
	}
	if st := b.worker.Stats(); st.Overtaken != 0 || st.Stale != 0 {
		t.Errorf("worker: %d overtaken, %d stale attempts; want none", st.Overtaken, st.Stale)
	}
}

// TestOutcomeSharedKeyNotHappened: the mail service fails the first job's
// call with a 503 (nobody knows whether it sent), the second job for the
// order waits on the same ambiguous record, and a person says it did not
// happen: both jobs go on, one of them sends the mail, the other takes its
// result, and the mail goes out once.
func TestOutcomeSharedKeyNotHappened(t *testing.T) {
	t.Parallel()
	const first, second = "again-1", "again-2"
	gate := newOCGate(t)
	b := effSetup(t, effOptions{noWorker: true, workflow: ocTestdata("shared-order.yaml"),
		demo: map[string]demo.Options{demo.NameMail: {FailNext: 1}}})
	b.env.Services["gate"] = gate.srv.URL
	b.worker = b.startWorker(steps.WorkerConfig{ID: "worker-1"})
	ctx := context.Background()

	b.start(first)
	v := b.waitStopped(first)
	if v.Status != schemas.JobNeedsReconciliation || v.Blocked == nil {
		t.Fatalf("job %s: %s (%v); want needs_reconciliation", first, v.Status, v.Error)
	}
	key := v.Blocked.EffectKey
	b.start(second)
	v = b.waitStopped(second)
	ocCheckBlocked(t, v, "", "notify", key, schemas.EffectUnsafe, schemas.CodeAmbiguous)
	testsupport.Eventually(t, 10*time.Second, func() bool {
		r, err := b.client.Effect(ctx, key)
		return err == nil && slices.Contains(r.SharedBy, second)
	}, "%s never recorded as waiting on %s", second, key)
	b.checkProvider(demo.NameMail, key, 1, 0)

	res, err := b.client.ResolveEffect(ctx, key, schemas.EffectResolution{By: "ops", Note: "not in the outbox"})
	if err != nil {
		t.Fatalf("resolve %s: %v", key, err)
	}
	if got := slices.Sorted(slices.Values(res.Resumed)); !slices.Equal(got, []string{first, second}) {
		t.Errorf("resolution resumed %v, want %s and %s", res.Resumed, first, second)
	}
	var mails []json.RawMessage
	for _, job := range []string{first, second} {
		var v *client.JobView
		testsupport.Eventually(t, 15*time.Second, func() bool {
			v, err = b.client.Job(ctx, job)
			return err == nil && v.Status.Terminal()
		}, "job %s did not end after the resolution (last: %v)", job, effLazy(func() string { return fmt.Sprintf("%+v %v", v, err) }))
		if v.Status != schemas.JobCompleted {
			t.Errorf("job %s: %s (%v), want completed", job, v.Status, v.Error)
		}
		mails = append(mails, stateField(t, v, "mail"))
		evs := b.history(job)
		ocNoFailure(t, evs)
		// The job that found the other one's call under way waited for its
		// outcome without using up an attempt: it did not block again, and
		// the effect was not declared ambiguous while the call was made.
		unblocked := slices.IndexFunc(evs, func(e schemas.HistoryEvent) bool { return e.Type == schemas.EventStepUnblocked })
		if unblocked >= 0 {
			for _, e := range evs[unblocked:] {
				if e.Type == schemas.EventStepBlocked || e.Type == schemas.EventEffectAmbiguous {
					t.Errorf("job %s: %s after the resolution: %s", job, e.Type, effTypes(evs))
				}
			}
		}
	}
	b.checkProvider(demo.NameMail, key, 2, 1)
	if !jsonEqual(mails[0], []byte(`{"id": "msg_000001"}`)) || !jsonEqual(mails[1], mails[0]) {
		t.Errorf("state.mail of the two jobs: %s and %s; want both the one message sent", mails[0], mails[1])
	}
	if rec := b.record(key); !rec.Settled() || rec.Calls != 2 || rec.ExternalID != "msg_000001" {
		t.Errorf("record %s: %+v; want settled with the message sent, after 2 calls", key, rec)
	}
}
