package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
	)
}

// bundle is one test's world: a server, a store, an engine running, a
// client, and a fake worker that answers step messages with respond.
type bundle struct {
	t      *testing.T
	srv    *testsupport.Server
	store  *kv.Store
	engine *Engine
	client *client.Client
	cancel context.CancelFunc
	done   chan struct{}
}

type setupOptions struct {
	noEngine bool
	kv       kv.Config
	engine   Config
	// cluster runs the test on a three-node JetStream cluster, every
	// stream and bucket with three replicas (b.srv is nil then).
	cluster bool
}

func setup(t *testing.T, o setupOptions) *bundle {
	t.Helper()
	if o.kv.InboxAckWait == 0 {
		o.kv.InboxAckWait = 2 * time.Second
	}
	if o.kv.WorkAckWait == 0 {
		o.kv.WorkAckWait = 2 * time.Second
	}
	var srv *testsupport.Server
	var st *kv.Store
	if o.cluster {
		o.kv.Replicas = 3
		c := testsupport.StartCluster(t, 3)
		st = c.Store(t, o.kv)
		// Every stream of the layout has a leader and current replicas
		// before the test begins (a fresh cluster elects them a moment
		// after creating the streams: until then, "no responders").
		lctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		names := st.JS.StreamNames(lctx)
		for name := range names.Name() {
			c.StreamLeader(t, st.JS, name, 30*time.Second)
		}
		cancel()
		if err := names.Err(); err != nil {
			t.Fatal(err)
		}
	} else {
		srv = testsupport.StartServer(t, testsupport.ServerOptions{})
		st = srv.Store(t, o.kv)
	}
	b := &bundle{t: t, srv: srv, store: st, client: client.New(st), done: make(chan struct{})}
	if o.noEngine {
		close(b.done)
		return b
	}
	o.engine.Store = st
	if o.engine.ReconcileInterval == 0 {
		o.engine.ReconcileInterval = -1
	}
	e, err := New(o.engine)
	if err != nil {
		t.Fatal(err)
	}
	b.engine = e
	ctx, cancel := context.WithCancel(context.Background())
	b.cancel = cancel
	go func() {
		defer close(b.done)
		if err := e.Run(ctx); err != nil {
			t.Errorf("engine run: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-b.done })
	return b
}

// worker answers step messages of the default pool with respond until the
// test ends. respond returns the output, or an error result.
func (b *bundle) worker(respond func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error)) *atomic.Int64 {
	t := b.t
	var calls atomic.Int64
	cons, err := b.store.EnsureWorkConsumer(context.Background(), schemas.DefaultPool)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		sm, err := schemas.DecodeStepMessage(m.Headers(), m.Data())
		if err != nil {
			t.Errorf("decode step message: %v", err)
			return
		}
		if sm.NotBefore != nil && time.Until(*sm.NotBefore) > 0 {
			_ = m.NakWithDelay(time.Until(*sm.NotBefore))
			return
		}
		calls.Add(1)
		out, e := respond(sm)
		res := schemas.StepResult{Job: sm.Job, Step: sm.Step, Attempt: sm.Attempt, Item: sm.Item, Output: out, Error: e, DurationMs: 1}
		b.publishResultID(&res, m.Headers().Get(jetstream.MsgIDHeader)+"/result")
		_ = m.Ack()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Stop)
	return &calls
}

func (b *bundle) publishResult(res *schemas.StepResult) {
	b.t.Helper()
	b.publishResultID(res, schemas.ResultMsgID(res.Job, res.Step, res.Attempt))
}

// publishResultID publishes res under the dedup id id.
func (b *bundle) publishResultID(res *schemas.StepResult, id string) {
	b.t.Helper()
	m := nats.NewMsg(b.store.Names.InboxSubject(kv.InboxResult, res.Job))
	m.Data, _ = schemas.EncodeStepResult(res, m.Header)
	m.Header.Set(jetstream.MsgIDHeader, id)
	if _, err := b.store.JS.PublishMsg(context.Background(), m); err != nil {
		b.t.Fatalf("publish result: %v", err)
	}
}

func (b *bundle) define(yaml string) *schemas.Definition {
	b.t.Helper()
	def, err := schemas.Parse(b.t.Name()+".yaml", []byte(yaml), schemas.LoadOptions{Checks: []schemas.CheckFunc{Check}})
	if err != nil {
		b.t.Fatal(err)
	}
	return def
}

func (b *bundle) start(def *schemas.Definition, input string, id string) string {
	b.t.Helper()
	res, err := b.client.Start(context.Background(), def, json.RawMessage(input), client.StartOptions{JobID: id})
	if err != nil {
		b.t.Fatalf("start: %v", err)
	}
	return res.JobID
}

func (b *bundle) wait(id string) *client.JobView {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := b.client.Wait(ctx, id, nil)
	if err != nil {
		b.t.Fatalf("wait for %s: %v", id, err)
	}
	return v
}

func stepOf(v *client.JobView, id string) client.StepView {
	for _, s := range v.Steps {
		if s.ID == id {
			return s
		}
	}
	return client.StepView{}
}

const threeSteps = `
name: three
version: 1
input_schema: {type: object, required: [n], properties: {n: {type: integer}}}
defaults: {retry: {max_attempts: 3, backoff: {initial: 10ms, max: 50ms}}}
steps:
  - id: a
    kind: noop
    save_as: a
    next: [{to: b}]
  - id: b
    kind: noop
    save_as: b
    next:
      - {to: big, when: "state.n > 10"}
      - {to: c}
  - id: big
    kind: noop
    save_as: big
  - id: c
    kind: noop
    save_as: c
`

func echo(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
	return json.RawMessage(fmt.Sprintf(`{"step": %q, "attempt": %d}`, sm.Step, sm.Attempt)), nil
}

func TestJobRunsToCompletionAndFollowsConditions(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	def := b.define(threeSteps)
	small := b.start(def, `{"n": 1}`, "small")
	large := b.start(def, `{"n": 42}`, "")

	v := b.wait(small)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status = %s, error %v", v.Status, v.Error)
	}
	var st map[string]any
	if err := json.Unmarshal(v.State, &st); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c"} {
		if _, ok := st[k]; !ok {
			t.Errorf("state lacks %q: %s", k, v.State)
		}
	}
	if _, ok := st["big"]; ok {
		t.Errorf("small job took the big branch: %s", v.State)
	}
	if s := stepOf(v, "big"); s.Status != schemas.StepPending || s.Attempts != 0 {
		t.Errorf("big step = %+v, want pending with no attempts", s)
	}
	for _, id := range []string{"a", "b", "c"} {
		if s := stepOf(v, id); s.Status != schemas.StepCompleted || s.Attempts != 1 {
			t.Errorf("step %s = %+v, want completed after 1 attempt", id, s)
		}
	}
	if v.DefinitionHash != def.Hash || v.ResumeCount != 0 {
		t.Errorf("hash %s resume %d", v.DefinitionHash, v.ResumeCount)
	}

	lv := b.wait(large)
	if s := stepOf(lv, "big"); s.Status != schemas.StepCompleted {
		t.Errorf("large job: big step %+v, want completed", s)
	}
	if s := stepOf(lv, "c"); s.Status != schemas.StepPending {
		t.Errorf("large job: c step %+v, want pending", s)
	}

	evs, err := b.client.History(context.Background(), small)
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, e := range evs {
		types = append(types, e.Type+">"+e.Data.Next)
	}
	// A dispatch caused by a completion is folded into the completion.
	want := []string{schemas.EventJobStarted + ">", schemas.EventStepDispatched + ">", schemas.EventStepCompleted + ">b",
		schemas.EventStepCompleted + ">c", schemas.EventStepCompleted + ">", schemas.EventJobCompleted + ">"}
	if fmt.Sprint(types) != fmt.Sprint(want) {
		t.Errorf("history = %v\nwant      %v", types, want)
	}
}

func TestRetryWithBackoffThenSucceed(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	var failures atomic.Int64
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "b" && sm.RunAttempt < 3 {
			failures.Add(1)
			return nil, &schemas.Error{Code: schemas.CodeProvider, Message: "upstream 503", Retryable: true}
		}
		return echo(sm)
	})
	v := b.wait(b.start(b.define(threeSteps), `{"n": 1}`, ""))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s: %v", v.Status, v.Error)
	}
	if s := stepOf(v, "b"); s.Attempts != 3 || s.LastError != nil {
		t.Errorf("step b = %+v, want 3 attempts and no error left", s)
	}
	if failures.Load() != 2 {
		t.Errorf("failures = %d, want 2", failures.Load())
	}
}

func TestExhaustedRetriesFailTheJobWithTheReason(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "b" {
			return nil, &schemas.Error{Code: schemas.CodeProvider, Message: "card declined by issuer", Retryable: true}
		}
		return echo(sm)
	})
	v := b.wait(b.start(b.define(threeSteps), `{"n": 1}`, ""))
	if v.Status != schemas.JobFailed {
		t.Fatalf("status %s, want failed", v.Status)
	}
	if v.Error == nil || v.Error.Step != "b" || v.Error.Attempt != 3 || !errors.Is(v.Error, &schemas.Error{Code: schemas.CodeProvider}) {
		t.Fatalf("error = %+v, want provider error at b@3", v.Error)
	}
	if s := stepOf(v, "b"); s.Status != schemas.StepFailed || s.Attempts != 3 {
		t.Errorf("step b = %+v", s)
	}
	var st map[string]any
	_ = json.Unmarshal(v.State, &st)
	if _, ok := st["a"]; !ok {
		t.Errorf("earlier state lost: %s", v.State)
	}
}

func TestNonRetryableErrorFollowsOnError(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "charge" {
			return nil, &schemas.Error{Code: schemas.CodeProvider, Message: "400 invalid card"}
		}
		return echo(sm)
	})
	def := b.define(`
name: onerror
version: 1
steps:
  - {id: charge, kind: noop, on_error: apologise}
  - {id: ship, kind: noop}
  - {id: apologise, kind: noop, save_as: apology}
`)
	v := b.wait(b.start(def, `{}`, ""))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s: %v", v.Status, v.Error)
	}
	if s := stepOf(v, "charge"); s.Status != schemas.StepFailed || s.Attempts != 1 {
		t.Errorf("charge = %+v, want failed after 1 attempt (non-retryable)", s)
	}
	if s := stepOf(v, "apologise"); s.Status != schemas.StepCompleted {
		t.Errorf("apologise = %+v", s)
	}
	if s := stepOf(v, "ship"); s.Status != schemas.StepPending {
		t.Errorf("ship = %+v, want pending", s)
	}
}

func TestOutputViolatingSchemaIsRetriedThenFailsKeepingState(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "score" {
			return json.RawMessage(`{"score": "high"}`), nil
		}
		return echo(sm)
	})
	def := b.define(`
name: outschema
version: 1
defaults: {retry: {max_attempts: 2, backoff: {initial: 10ms}}}
steps:
  - {id: a, kind: noop, save_as: a, next: [{to: score}]}
  - id: score
    kind: noop
    output_schema: {type: object, required: [score], properties: {score: {type: number}}}
`)
	v := b.wait(b.start(def, `{}`, ""))
	if v.Status != schemas.JobFailed || v.Error == nil || v.Error.Code != schemas.CodeOutputInvalid {
		t.Fatalf("status %s error %+v, want failed with output_invalid", v.Status, v.Error)
	}
	if s := stepOf(v, "score"); s.Attempts != 2 {
		t.Errorf("score attempts = %d, want 2", s.Attempts)
	}
	if !containsAll(v.Error.Message, "/score", "number") {
		t.Errorf("error does not quote the schema violation: %s", v.Error.Message)
	}
	if !containsAll(string(v.State), `"a"`) || containsAll(string(v.State), "high") {
		t.Errorf("state = %s, want a's output and nothing of score's", v.State)
	}
}

func TestStaleResultIsDroppedAndCounted(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	release := make(chan struct{})
	var once sync.Once
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "b" {
			if sm.RunAttempt == 1 {
				return nil, &schemas.Error{Code: schemas.CodeTimeout, Message: "slow", Retryable: true}
			}
			once.Do(func() { <-release }) // hold attempt 2 until the stale result is in
		}
		return echo(sm)
	})
	def := b.define(threeSteps)
	id := b.start(def, `{"n": 1}`, "stale")
	testsupport.Eventually(t, 20*time.Second, func() bool {
		v, err := b.client.Job(context.Background(), id)
		return err == nil && v.Current != nil && v.Current.Step == "b" && v.Current.Attempt == 2
	}, "step b never reached attempt 2")
	before, _ := b.client.Job(context.Background(), id)
	// Attempt 1's result came already (a failure). A second one, as if
	// sent again after the stream's duplicate window, must not apply.
	late := &schemas.StepResult{Job: id, Step: "b", Attempt: 1, Output: json.RawMessage(`{"late": true}`)}
	m := nats.NewMsg(b.store.Names.InboxSubject(kv.InboxResult, id))
	m.Data, _ = schemas.EncodeStepResult(late, m.Header)
	m.Header.Set(jetstream.MsgIDHeader, schemas.ResultMsgID(id, "b", 1)+"/after-window")
	if _, err := b.store.JS.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.engine.Stats().StaleDropped == 1 }, "stale result not counted")
	after, _ := b.client.Job(context.Background(), id)
	if after.Seq != before.Seq || string(after.State) != string(before.State) {
		t.Errorf("stale result changed the checkpoint: seq %d→%d state %s→%s", before.Seq, after.Seq, before.State, after.State)
	}
	close(release)
	if v := b.wait(id); v.Status != schemas.JobCompleted || containsAll(string(v.State), "late") {
		t.Fatalf("status %s state %s", v.Status, v.State)
	}
}

func TestTwoEnginesApplyingOneResultAdvanceTheJobOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	def := b.define(threeSteps)
	id := b.start(def, `{"n": 1}`, "race")
	// Two engines share the inbox consumer, but the race must be on the
	// same message: both read the checkpoint, then both write.
	mk := func() *Engine {
		e, err := New(Config{Store: b.store, ReconcileInterval: -1})
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	e1, e2 := mk(), mk()
	ctx := context.Background()
	// Create the job with one engine, directly from the start message.
	startMsg := fetchInbox(t, b.store, 1)
	e1.handleBatchSync(ctx, startMsg)
	ent, err := b.store.Checkpoints.Get(ctx, id)
	if err != nil || ent.Checkpoint.Current == nil || ent.Checkpoint.Current.Step != "a" {
		t.Fatalf("job not started: %+v %v", ent.Checkpoint, err)
	}
	b.publishResult(&schemas.StepResult{Job: id, Step: "a", Attempt: 1, Output: json.RawMessage(`{"x": 1}`)})
	resultMsg := fetchInbox(t, b.store, 1)
	var ready sync.WaitGroup
	ready.Add(2)
	gate := make(chan struct{})
	hook := func(string) { ready.Done(); <-gate }
	e1.beforeWrite, e2.beforeWrite = hook, hook
	var wg sync.WaitGroup
	for _, e := range []*Engine{e1, e2} {
		wg.Add(1)
		go func(e *Engine) {
			defer wg.Done()
			e.handleBatchSync(ctx, resultMsg)
		}(e)
	}
	ready.Wait() // both decided from the same revision
	close(gate)
	wg.Wait()
	e1.beforeWrite, e2.beforeWrite = nil, nil

	s1, s2 := e1.Stats(), e2.Stats()
	if got := s1.ResultsApplied + s2.ResultsApplied; got != 1 {
		t.Errorf("results applied = %d, want exactly 1", got)
	}
	if got := s1.CASConflicts + s2.CASConflicts; got != 1 {
		t.Errorf("CAS conflicts = %d, want 1", got)
	}
	if got := s1.Resumes + s2.Resumes + s1.Republished + s2.Republished; got != 0 {
		t.Errorf("resumes+republished = %d, want 0: the loser must not mistake a live rival for a crash", got)
	}
	after, _ := b.store.Checkpoints.Get(ctx, id)
	if after.Checkpoint.Seq != ent.Checkpoint.Seq+1 {
		t.Errorf("seq %d → %d, want one step", ent.Checkpoint.Seq, after.Checkpoint.Seq)
	}
	if v := client.NewJobView(after.Checkpoint, def); stepOf(v, "a").Status != schemas.StepCompleted || after.Checkpoint.Current == nil || after.Checkpoint.Current.Step != "b" {
		t.Errorf("job did not advance to b: %+v current %+v", stepOf(v, "a"), after.Checkpoint.Current)
	}
	if n := workMessages(t, b.store); n != 2 { // a@1 and b@1, nothing twice
		t.Errorf("work stream holds %d messages, want 2", n)
	}
}

func TestRejectedStartStoresNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	def := b.define(threeSteps)
	ctx := context.Background()
	_, err := b.client.Start(ctx, def, json.RawMessage(`{"n": "many"}`), client.StartOptions{JobID: "bad"})
	if !errors.Is(err, schemas.ErrInputInvalid) {
		t.Fatalf("err = %v, want ErrInputInvalid", err)
	}
	if !containsAll(err.Error(), "/n", "integer") {
		t.Errorf("error does not say where: %v", err)
	}
	if _, err := b.store.Checkpoints.Get(ctx, "bad"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("checkpoint stored for a rejected job: %v", err)
	}
	if _, err := b.store.Definitions.Get(ctx, def.Hash); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("definition stored for a rejected job: %v", err)
	}
	for _, stream := range []string{b.store.Names.InboxStream, b.store.Names.WorkStream} {
		s, _ := b.store.JS.Stream(ctx, stream)
		info, _ := s.Info(ctx)
		if info.State.Msgs != 0 {
			t.Errorf("%s holds %d messages after a rejected start", stream, info.State.Msgs)
		}
	}
	for _, bad := range []string{"", "a.b", "x y", "../etc"} {
		if _, err := b.client.Start(ctx, def, json.RawMessage(`{"n": 1}`), client.StartOptions{JobID: bad + "!"}); !errors.Is(err, schemas.ErrInputInvalid) {
			t.Errorf("job id %q accepted: %v", bad+"!", err)
		}
	}
}

func TestStartingAnExistingIDAttaches(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	def := b.define(threeSteps)
	id := b.start(def, `{"n": 1}`, "same")
	b.wait(id)
	res, err := b.client.Start(context.Background(), def, json.RawMessage(`{"n": 1}`), client.StartOptions{JobID: id})
	if err != nil || !res.Attached || res.Mismatch != "" {
		t.Fatalf("second start = %+v, %v; want attached without mismatch", res, err)
	}
	res, err = b.client.Start(context.Background(), def, json.RawMessage(`{"n": 2}`), client.StartOptions{JobID: id})
	if !res.Attached || res.Mismatch == "" || !errors.Is(err, schemas.ErrConflict) {
		t.Errorf("start with other input = %+v, %v; want attached with a mismatch note and ErrConflict", res, err)
	}
	// Counters are added when a batch settles, which may come after the
	// job's later transitions (acknowledgements are awaited off the lane).
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.engine.Stats().JobsStarted >= 1 }, "the start was never counted")
	if got := b.engine.Stats().JobsStarted; got != 1 {
		t.Errorf("jobs started = %d, want 1", got)
	}
}

func TestQuarantinedCheckpointIsNeverOverwritten(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := context.Background()
	kvb, err := b.store.JS.KeyValue(ctx, b.store.Names.CheckpointBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kvb.Put(ctx, "garbled", []byte(`{"schema": 1, "id": "garbled", "seq": `)); err != nil {
		t.Fatal(err)
	}
	if _, err := b.client.Job(ctx, "garbled"); !errors.Is(err, schemas.ErrQuarantined) {
		t.Fatalf("Job = %v, want ErrQuarantined", err)
	}
	b.publishResult(&schemas.StepResult{Job: "garbled", Step: "a", Attempt: 1, Output: json.RawMessage(`{}`)})
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.engine.Stats().HandleErrors >= 1 }, "engine did not refuse the quarantined job")
	e, _ := kvb.Get(ctx, "garbled")
	if string(e.Value()) != `{"schema": 1, "id": "garbled", "seq": ` {
		t.Errorf("quarantined checkpoint rewritten: %s", e.Value())
	}
}

// TestHistoryOfAQuarantinedJob: the history of a job whose checkpoint no
// longer decodes is what the stream holds, for the person fixing it.
func TestHistoryOfAQuarantinedJob(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	ctx := context.Background()
	id := b.start(b.define(threeSteps), `{"n": 1}`, "spoilt")
	b.wait(id)
	testsupport.Eventually(t, 10*time.Second, func() bool {
		seq, err := b.store.History.LastSeq(ctx, id)
		return err == nil && seq > 0
	}, "no history stored")
	kvb, err := b.store.JS.KeyValue(ctx, b.store.Names.CheckpointBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kvb.Put(ctx, id, []byte(`{"schema": 1, "id": "spoilt", `)); err != nil {
		t.Fatal(err)
	}
	evs, err := b.client.History(ctx, id)
	if err != nil || len(evs) == 0 || evs[0].Type != schemas.EventJobStarted {
		t.Fatalf("history of a quarantined job: %d events, %v; want the stream's, from job.started", len(evs), err)
	}
	if _, err := b.client.History(ctx, "never-ran"); err != nil {
		t.Errorf("history of an unknown job: %v, want none and no error", err)
	}
}

func TestReconcilerDeclaresALostAttemptAndRetries(t *testing.T) {
	t.Parallel()
	var clock atomic.Int64
	clock.Store(time.Now().UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()) }
	b := setup(t, setupOptions{engine: Config{Now: now, StallGrace: time.Second}})
	// A message the stream lost: published, then purged before any worker
	// took it. Only the reconciler can notice.
	def := b.define(`
name: lost
version: 1
steps:
  - {id: a, kind: noop, timeout: 1s, pool: slow}
`)
	id := b.start(def, `{}`, "lost")
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err := b.client.Job(context.Background(), id)
		return err == nil && v.Current != nil
	}, "job not started")
	// The "slow" pool has a consumer (a worker came and went) and no worker
	// now. While its message is queued, the step is waiting, not lost.
	if _, err := b.store.EnsureWorkConsumer(context.Background(), "slow"); err != nil {
		t.Fatal(err)
	}
	clock.Add(int64(10 * time.Second))
	if err := b.engine.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.engine.Stats().AttemptsLost; got != 0 {
		t.Fatalf("declared lost while its message waits in the queue: %d", got)
	}
	clock.Add(-int64(10 * time.Second))
	// Purge the message (the stream lost it), then move the clock past
	// timeout + 2 x ack wait + grace.
	s, _ := b.store.JS.Stream(context.Background(), b.store.Names.WorkStream)
	if err := s.Purge(context.Background(), jetstream.WithPurgeSubject(b.store.Names.WorkSubject("slow", id))); err != nil {
		t.Fatal(err)
	}
	if err := b.engine.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.engine.Stats().AttemptsLost; got != 0 {
		t.Fatalf("declared lost before its deadline: %d", got)
	}
	clock.Add(int64(10 * time.Second))
	if err := b.engine.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	v, _ := b.client.Job(context.Background(), id)
	if b.engine.Stats().AttemptsLost != 1 || v.Current == nil || v.Current.Attempt != 2 {
		t.Fatalf("lost=%d current=%+v, want attempt 2 dispatched", b.engine.Stats().AttemptsLost, v.Current)
	}
	if s := stepOf(v, "a"); s.LastError == nil || s.LastError.Code != schemas.CodeTimeout {
		t.Errorf("step a = %+v, want a timeout recorded", s)
	}
	if n := workMessages(t, b.store); n != 1 {
		t.Errorf("work stream holds %d, want the new attempt's message", n)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, x := range subs {
		if !strings.Contains(s, x) {
			return false
		}
	}
	return true
}

// fetchInbox takes n messages from the engines' inbox consumer, for tests
// that hand the same real message to more than one engine.
func fetchInbox(t *testing.T, st *kv.Store, n int) []jetstream.Msg {
	t.Helper()
	cons, err := st.EngineConsumer(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(n, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	for m := range batch.Messages() {
		out = append(out, m)
	}
	if len(out) != n {
		t.Fatalf("fetched %d inbox messages, want %d (%v)", len(out), n, batch.Error())
	}
	return out
}

func workMessages(t *testing.T, st *kv.Store) uint64 {
	t.Helper()
	s, err := st.JS.Stream(context.Background(), st.Names.WorkStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// TestStateOverTheSizeLimitFailsTheJobOnce: members under the value
// threshold stay in the checkpoint; once they make the state too large
// for a step message the job fails at once, keeping what it had.
func TestStateOverTheSizeLimitFailsTheJobOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{kv: kv.Config{MaxValueBytes: 64 << 10, MaxMessageBytes: 64 << 10, ValueThreshold: 31 << 10}})
	big := json.RawMessage(`{"blob": "` + strings.Repeat("x", 30<<10) + `"}`)
	var calls atomic.Int64
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		calls.Add(1)
		return big, nil
	})
	def := b.define(`
name: grows
version: 1
steps:
  - {id: a, kind: noop, save_as: a, next: [{to: b}]}
  - {id: b, kind: noop, save_as: b, next: [{to: c}]}
  - {id: c, kind: noop, save_as: c}
`)
	v := b.wait(b.start(def, `{}`, "grows"))
	if v.Status != schemas.JobFailed || v.Error == nil || v.Error.Code != schemas.CodeTooLarge || v.Error.Step != "b" {
		t.Fatalf("status %s error %+v, want failed with too_large at step b", v.Status, v.Error)
	}
	if !strings.Contains(v.Error.Message, "bytes") || !strings.Contains(string(v.State), `"a"`) || strings.Contains(string(v.State), `"b"`) {
		t.Errorf("error %q / state keeps a and not b? %.80s", v.Error.Message, v.State)
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("worker called %d times, want 2 (a, then b; nothing again)", n)
	}
	if got := b.engine.Stats().HandleErrors; got != 0 {
		t.Errorf("handle errors = %d: the oversized result was retried", got)
	}

	_, err := b.client.Start(context.Background(), def, paddedInput(70<<10), client.StartOptions{JobID: "huge"})
	if !errors.Is(err, schemas.ErrTooLarge) {
		t.Fatalf("start with a huge input: %v, want ErrTooLarge", err)
	}
	if _, err := b.store.Checkpoints.Get(context.Background(), "huge"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("a checkpoint was stored for the rejected start: %v", err)
	}
}

func TestEndlessLoopStopsAtMaxSteps(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	calls := b.worker(echo)
	def := b.define(`
name: forever
version: 1
max_steps: 25
steps:
  - {id: a, kind: noop, next: [{to: b}]}
  - {id: b, kind: noop, next: [{to: a}]}
`)
	v := b.wait(b.start(def, `{}`, "forever"))
	if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, "max_steps 25") {
		t.Fatalf("status %s error %+v, want failed at the step limit", v.Status, v.Error)
	}
	if n := calls.Load(); n != 25 {
		t.Errorf("steps run = %d, want 25", n)
	}
}

func TestLostStartRequestIsStartedByTheReconciler(t *testing.T) {
	t.Parallel()
	var clock atomic.Int64
	clock.Store(time.Now().UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()) }
	b := setup(t, setupOptions{noEngine: true})
	def := b.define(threeSteps)
	id := b.start(def, `{"n": 1}`, "lost-start")
	if v, err := b.client.Job(context.Background(), id); err != nil || v.Status != schemas.JobPending {
		t.Fatalf("after Start: %+v %v, want a pending job", v, err)
	}
	// The start request is lost before any engine reads it.
	s, _ := b.store.JS.Stream(context.Background(), b.store.Names.InboxStream)
	if err := s.Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	e, err := New(Config{Store: b.store, Now: now, ReconcileInterval: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if v, _ := b.client.Job(context.Background(), id); v.Status != schemas.JobPending {
		t.Fatalf("started before the grace passed: %s", v.Status)
	}
	clock.Add(int64(5 * time.Second))
	if err := e.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.worker(echo)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = e.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s: %v", v.Status, v.Error)
	}
}
