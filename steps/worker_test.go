package steps

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// workerWorkflow holds a step of every shape the worker tests need. The
// kinds echo, panic and wait are registered by setupWorker; alien is not.
const workerWorkflow = `
name: worker
version: 1
assets:
  cassette: cassette.json
steps:
  - id: echo
    kind: echo
    effect: pure
    output_schema:
      type: object
      required: [answer]
      properties: {answer: {type: string}}
  - id: strict
    kind: echo
    effect: pure
    input_schema:
      type: object
      required: [report]
      properties: {report: {type: string}}
  - id: boom
    kind: panic
    effect: pure
  - id: slow
    kind: linger
    effect: pure
    timeout: 200ms
  - id: long
    kind: linger
    effect: pure
  - id: alien
    kind: alien
  - id: noop
    kind: noop
    with: {output: {ok: true}}
  - id: file
    kind: http
    with:
      url: '{{service "tickets"}}/tickets'
      body: '{"title": {{json .state.title}}}'
  - id: classify
    kind: model
    output_schema:
      type: object
      required: [label]
      properties: {label: {enum: [recorded]}}
    with:
      provider: anthropic
      model: model-test
      prompt: "Classify: {{untrusted .state.title}}"
      cassette: cassette
`

// workerBundle is one test's world: an embedded nats-server, the store
// over it, a definition stored there, a ticket service for http steps, and
// a worker whose test kinds count their runs.
type workerBundle struct {
	t       *testing.T
	srv     *testsupport.Server
	store   *kv.Store
	def     *schemas.Definition
	tickets *httptest.Server
	reg     *Registry
	env     *Env

	mu      sync.Mutex
	runs    map[string]int       // job -> runs of a test kind
	started map[string]time.Time // job -> start of the latest run
	tickReq []*http.Request
}

type workerOptions struct {
	kv      kv.Config
	cfg     WorkerConfig // Store, Registry and Env are filled in
	noStart bool
}

func setupWorker(t *testing.T, o workerOptions) *workerBundle {
	t.Helper()
	b := &workerBundle{t: t, runs: map[string]int{}, started: map[string]time.Time{}}
	b.srv = testsupport.StartServer(t, testsupport.ServerOptions{})
	b.store = b.srv.Store(t, o.kv)
	b.def = parseDef(t, workerWorkflow)
	if err := b.store.Definitions.Put(t.Context(), b.def); err != nil {
		t.Fatal(err)
	}
	b.tickets = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.mu.Lock()
		b.tickReq = append(b.tickReq, r)
		b.mu.Unlock()
		_, _ = io.WriteString(w, `{"id": "T-1"}`)
	}))
	t.Cleanup(b.tickets.Close)
	b.env = &Env{Services: map[string]string{"tickets": b.tickets.URL}, HTTPClient: b.tickets.Client(), ModelMode: ModelReplay}

	b.reg = Builtins()
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	// echo returns state.out, or the whole state.
	must(b.reg.Register("echo", Func(func(_ context.Context, c *Call) (any, error) {
		b.ran(c.Job)
		st, err := c.StateMap()
		if err != nil {
			return nil, err
		}
		if out, ok := st["out"]; ok {
			return out, nil
		}
		return st, nil
	})))
	must(b.reg.Register("panic", Func(func(_ context.Context, c *Call) (any, error) {
		b.ran(c.Job)
		var m map[string]any
		m["x"] = 1 // a nil map: the classic
		return m, nil
	})))
	// wait runs for state.ms milliseconds, or until its context ends.
	must(b.reg.Register("linger", Func(func(ctx context.Context, c *Call) (any, error) {
		b.ran(c.Job)
		st, err := c.StateMap()
		if err != nil {
			return nil, err
		}
		ms, _ := st["ms"].(float64)
		t := time.NewTimer(time.Duration(ms) * time.Millisecond)
		defer t.Stop()
		select {
		case <-t.C:
			return map[string]any{"waited_ms": ms}, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	})))
	if !o.noStart {
		b.start(o.cfg)
	}
	return b
}

func (b *workerBundle) ran(job string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.runs[job]++
	b.started[job] = time.Now()
}

func (b *workerBundle) runsOf(job string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.runs[job]
}

// start runs a worker until the returned stop is called or the test ends.
// stop waits for Run to return and fails the test unless it returned nil.
func (b *workerBundle) start(cfg WorkerConfig) (*Worker, func()) {
	t := b.t
	t.Helper()
	cfg.Store = b.store
	if cfg.Registry == nil {
		cfg.Registry = b.reg
	}
	if cfg.Env == nil {
		cfg.Env = b.env
	}
	if cfg.ID == "" {
		cfg.ID = "worker-under-test"
	}
	if cfg.Logger == nil {
		// The worker stops in t.Cleanup, so it never logs after the test.
		cfg.Logger = slog.New(slog.NewTextHandler(t.Output(), nil))
	}
	if cfg.FetchWait == 0 {
		cfg.FetchWait = 200 * time.Millisecond // a stop waits for the last pull
	}
	w, err := NewWorker(cfg)
	if err != nil {
		t.Fatalf("NewWorker: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run = %v, want nil after its context ended", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Run did not return within 30s of its context ending")
			}
		})
	}
	t.Cleanup(stop)
	return w, stop
}

// send publishes one attempt of step to the pool, filling in what a
// dispatch would.
func (b *workerBundle) send(sm schemas.StepMessage) schemas.StepMessage {
	b.t.Helper()
	if sm.DefinitionHash == "" {
		sm.DefinitionHash = b.def.Hash
	}
	if sm.Attempt == 0 {
		sm.Attempt = 1
	}
	if sm.RunAttempt == 0 {
		sm.RunAttempt = 1
	}
	if sm.IdempotencyKey == "" {
		sm.IdempotencyKey = sm.Job + "/" + sm.Step + "/run-1"
	}
	if len(sm.State) == 0 {
		sm.State = json.RawMessage(`{}`)
	}
	b.recordDispatch(sm)
	h := nats.Header{}
	data, err := schemas.EncodeStepMessage(&sm, h)
	if err != nil {
		b.t.Fatal(err)
	}
	b.publishRaw(h, data, schemas.StepMsgID(sm.Job, sm.Step, sm.Attempt))
	return sm
}

// recordDispatch writes the job's checkpoint as the engine does before it
// publishes a step (intent before action): effectful steps check it.
func (b *workerBundle) recordDispatch(sm schemas.StepMessage) {
	b.t.Helper()
	ctx := context.Background()
	now := time.Now().UTC()
	cp := &schemas.Checkpoint{Schema: schemas.CheckpointSchema, JobID: sm.Job, Workflow: b.def.Name, Version: b.def.Version,
		DefinitionHash: sm.DefinitionHash, Seq: 1, Status: schemas.JobRunning, State: sm.State, CreatedAt: now, UpdatedAt: now,
		Current: &schemas.Dispatch{Step: sm.Step, Attempt: sm.Attempt, RunAttempt: sm.RunAttempt, MsgID: schemas.StepMsgID(sm.Job, sm.Step, sm.Attempt), Pool: "default", DispatchedAt: now}}
	ent, err := b.store.Checkpoints.Get(ctx, sm.Job)
	switch {
	case errors.Is(err, schemas.ErrNotFound):
		_, err = b.store.Checkpoints.Create(ctx, cp)
	case err == nil:
		cp.Seq = ent.Checkpoint.Seq + 1
		_, err = b.store.Checkpoints.Update(ctx, cp, ent.Revision)
	}
	if err != nil {
		b.t.Fatalf("record dispatch of %s: %v", sm.Job, err)
	}
}

// publishRaw publishes a step message as it is, headers and body.
func (b *workerBundle) publishRaw(h nats.Header, data []byte, msgID string) {
	b.t.Helper()
	job := "job"
	if v := h[schemas.HeaderJob]; len(v) > 0 && v[0] != "" {
		job = v[0]
	}
	m := nats.NewMsg(b.store.Names.WorkSubject(schemas.DefaultPool, job))
	for k, v := range h {
		m.Header[k] = v
	}
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, msgID)
	if _, err := b.store.JS.PublishMsg(b.t.Context(), m); err != nil {
		b.t.Fatalf("publish step message: %v", err)
	}
}

// lastResult returns the latest result of job in the inbox, or nil.
func (b *workerBundle) lastResult(job string) *schemas.StepResult {
	b.t.Helper()
	st, err := b.store.JS.Stream(b.t.Context(), b.store.Names.InboxStream)
	if err != nil {
		b.t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(b.t.Context(), b.store.Names.InboxSubject(kv.InboxResult, job))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		b.t.Fatalf("read inbox: %v", err)
	}
	res, err := schemas.DecodeStepResult(m.Header, m.Data)
	if err != nil {
		b.t.Fatalf("decode result %s: %v", m.Data, err)
	}
	if got, want := m.Header.Get(jetstream.MsgIDHeader), schemas.ResultMsgID(res.Job, res.Step, res.Attempt); got != want {
		b.t.Errorf("result Nats-Msg-Id = %q, want %q", got, want)
	}
	return res
}

// result waits for job's result in the inbox.
func (b *workerBundle) result(job string) *schemas.StepResult {
	b.t.Helper()
	var res *schemas.StepResult
	testsupport.Eventually(b.t, 20*time.Second, func() bool {
		res = b.lastResult(job)
		return res != nil
	}, "no result for job %s in the inbox", job)
	return res
}

// workMessages counts the step messages still in the work stream: waiting,
// or delivered and not yet acknowledged.
func (b *workerBundle) workMessages() uint64 {
	b.t.Helper()
	st, err := b.store.JS.Stream(b.t.Context(), b.store.Names.WorkStream)
	if err != nil {
		b.t.Fatal(err)
	}
	info, err := st.Info(b.t.Context())
	if err != nil {
		b.t.Fatal(err)
	}
	return info.State.Msgs
}

func (b *workerBundle) waitWorkEmpty() {
	b.t.Helper()
	testsupport.Eventually(b.t, 10*time.Second, func() bool { return b.workMessages() == 0 },
		"the work stream still holds %d step message(s): not acknowledged", b.workMessages())
}

func TestWorkerResults(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name          string
		step          string
		state         string
		kv            kv.Config
		wantOutput    string
		wantCode      schemas.Code
		wantRetryable bool
		wantMessage   []string
	}{
		{name: "success", step: "echo", state: `{"out": {"answer": "forty-two"}}`, wantOutput: `{"answer":"forty-two"}`},
		{name: "builtin noop", step: "noop", wantOutput: `{"ok":true}`},
		{name: "model step replays its cassette", step: "classify", state: `{"title": "crash"}`, wantOutput: `{"label":"recorded","score":0.5}`},
		{name: "http step", step: "file", state: `{"title": "crash"}`, wantOutput: `{"id": "T-1"}`}, // as the service sent it
		{name: "input passes input_schema", step: "strict", state: `{"report": "it crashed", "out": {"seen": true}}`, wantOutput: `{"seen":true}`},
		{name: "output fails output_schema", step: "echo", state: `{"out": {"answer": 42}}`,
			wantCode: schemas.CodeOutputInvalid, wantRetryable: true,
			wantMessage: []string{"output does not match the step's output_schema: at /answer:", "string"}},
		{name: "output missing a required field", step: "echo", state: `{"out": {}}`,
			wantCode: schemas.CodeOutputInvalid, wantRetryable: true, wantMessage: []string{"answer"}},
		{name: "state fails input_schema", step: "strict", state: `{"report": 7}`,
			wantCode: schemas.CodeInputInvalid, wantRetryable: false,
			wantMessage: []string{"state does not match the step's input_schema: at /report:"}},
		{name: "panic", step: "boom",
			wantCode: schemas.CodeStepFailed, wantRetryable: false,
			wantMessage: []string{"step panicked: assignment to entry in nil map", "worker_test.go"}},
		{name: "past its timeout", step: "slow", state: `{"ms": 60000}`,
			wantCode: schemas.CodeTimeout, wantRetryable: true,
			wantMessage: []string{"step ran past its timeout of 200ms", "context deadline exceeded"}},
		{name: "step not in the definition", step: "ghost",
			wantCode: schemas.CodeDefinitionInvalid, wantMessage: []string{`has no step "ghost"`}},
		{name: "output over the message limit", step: "echo", kv: kv.Config{MaxMessageBytes: 8192},
			state:    `{"out": {"answer": "` + strings.Repeat("a", 5000) + `"}}`,
			wantCode: schemas.CodeTooLarge, wantMessage: []string{"output is 5", "bytes; the limit is 4096"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setupWorker(t, workerOptions{kv: tt.kv})
			job := "job-" + tt.step
			sm := b.send(schemas.StepMessage{Job: job, Step: tt.step, Attempt: 3, RunAttempt: 1, State: json.RawMessage(tt.state)})
			res := b.result(job)

			if res.Job != job || res.Step != tt.step || res.Attempt != 3 || res.Worker != "worker-under-test" {
				t.Errorf("result names %s/%s@%d by %q, want %s/%s@3 by worker-under-test", res.Job, res.Step, res.Attempt, res.Worker, job, tt.step)
			}
			if res.Redelivered {
				t.Error("Redelivered = true on the first delivery")
			}
			if tt.wantCode == "" {
				if res.Error != nil {
					t.Fatalf("result error = %v, want output %s", res.Error, tt.wantOutput)
				}
				if string(res.Output) != tt.wantOutput {
					t.Errorf("output = %s, want %s", res.Output, tt.wantOutput)
				}
			} else {
				if res.Error == nil {
					t.Fatalf("result output = %s, want error %s", res.Output, tt.wantCode)
				}
				if res.Error.Code != tt.wantCode || res.Error.Retryable != tt.wantRetryable || res.Output != nil {
					t.Fatalf("result = error %v (retryable %v), output %s; want %s (retryable %v) and no output",
						res.Error, res.Error.Retryable, res.Output, tt.wantCode, tt.wantRetryable)
				}
				if !errors.Is(res.Error, &schemas.Error{Code: tt.wantCode}) {
					t.Errorf("decoded result error does not match its sentinel")
				}
				for _, s := range tt.wantMessage {
					if !strings.Contains(res.Error.Message, s) {
						t.Errorf("message %q does not contain %q", res.Error.Message, s)
					}
				}
			}
			// Acknowledged once the result is in the inbox.
			b.waitWorkEmpty()

			if tt.step == "file" {
				b.mu.Lock()
				defer b.mu.Unlock()
				if len(b.tickReq) != 1 || b.tickReq[0].Header.Get("Idempotency-Key") != sm.IdempotencyKey {
					t.Errorf("ticket service got %d requests, want 1 with Idempotency-Key %q", len(b.tickReq), sm.IdempotencyKey)
				}
			}
		})
	}
}

func TestWorkerCustomKind(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{noStart: true})
	reg := NewRegistry()
	var got *Call
	var mu sync.Mutex
	if err := reg.Register("echo", Func(func(_ context.Context, c *Call) (any, error) {
		mu.Lock()
		defer mu.Unlock()
		got = c
		return map[string]any{"answer": "from " + c.Job + " attempt " + c.Vars["n"]}, nil
	})); err != nil {
		t.Fatal(err)
	}
	b.start(WorkerConfig{Registry: reg})
	b.send(schemas.StepMessage{Job: "job-custom", Step: "echo", Attempt: 4, RunAttempt: 2, Vars: map[string]string{"n": "two"},
		State: json.RawMessage(`{"k": 1}`), IdempotencyKey: "idem-1"})
	res := b.result("job-custom")
	if res.Error != nil || string(res.Output) != `{"answer":"from job-custom attempt two"}` {
		t.Fatalf("result = %s / %v", res.Output, res.Error)
	}
	mu.Lock()
	defer mu.Unlock()
	if got.Attempt != 4 || got.RunAttempt != 2 || got.IdempotencyKey != "idem-1" || string(got.State) != `{"k": 1}` ||
		got.Step.ID != "echo" || got.Definition.Hash != b.def.Hash || got.Logger() == nil ||
		// The worker's Env, with the deployment's shared rate limits added.
		got.Env == nil || got.Env.HTTPClient != b.env.HTTPClient || got.Env.ModelMode != b.env.ModelMode || got.Env.RateLimits == nil {
		t.Errorf("the kind saw Call %+v", got)
	}
}

func TestWorkerKeepsServingAfterPanic(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{cfg: WorkerConfig{Concurrency: 1}})
	b.send(schemas.StepMessage{Job: "job-boom", Step: "boom"})
	if res := b.result("job-boom"); res.Error == nil || res.Error.Retryable || !strings.Contains(res.Error.Message, "step panicked") {
		t.Fatalf("panic result = %+v", res.Error)
	}
	b.send(schemas.StepMessage{Job: "job-after", Step: "echo", State: json.RawMessage(`{"out": {"answer": "still here"}}`)})
	if res := b.result("job-after"); res.Error != nil || string(res.Output) != `{"answer":"still here"}` {
		t.Fatalf("result after a panic = %s / %v", res.Output, res.Error)
	}
	b.waitWorkEmpty()
}

func TestWorkerHoldsUntilNotBefore(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{noStart: true})
	w, _ := b.start(WorkerConfig{})
	notBefore := time.Now().Add(1500 * time.Millisecond)
	b.send(schemas.StepMessage{Job: "job-later", Step: "echo", Attempt: 2, RunAttempt: 2, NotBefore: &notBefore,
		State: json.RawMessage(`{"out": {"answer": "later"}}`)})

	testsupport.Eventually(t, 10*time.Second, func() bool { return w.Stats().Held > 0 }, "the worker never held the message back")
	if n := b.runsOf("job-later"); n != 0 && time.Now().Before(notBefore) {
		t.Fatalf("the step ran %d time(s) before not_before", n)
	}
	if res := b.lastResult("job-later"); res != nil && time.Now().Before(notBefore) {
		t.Fatalf("a result arrived before not_before: %+v", res)
	}

	res := b.result("job-later")
	if res.Error != nil || string(res.Output) != `{"answer":"later"}` {
		t.Fatalf("result = %s / %v", res.Output, res.Error)
	}
	b.mu.Lock()
	started := b.started["job-later"]
	b.mu.Unlock()
	if started.Before(notBefore) {
		t.Errorf("the step started %v before not_before", notBefore.Sub(started))
	}
	if b.runsOf("job-later") != 1 {
		t.Errorf("the step ran %d times, want 1", b.runsOf("job-later"))
	}
	if res.Redelivered || w.Stats().Redeliveries != 0 {
		t.Errorf("Redelivered = %v, stats %+v: holding for a retry delay is not a redelivery", res.Redelivered, w.Stats())
	}
	b.waitWorkEmpty()
}

func TestWorkerHeartbeats(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{kv: kv.Config{WorkAckWait: 600 * time.Millisecond}, noStart: true})
	w, _ := b.start(WorkerConfig{})
	b.send(schemas.StepMessage{Job: "job-long", Step: "long", State: json.RawMessage(`{"ms": 2000}`)})
	res := b.result("job-long")
	if res.Error != nil {
		t.Fatalf("result error: %v", res.Error)
	}
	if res.DurationMs < 2000 {
		t.Errorf("DurationMs = %d, want at least 2000", res.DurationMs)
	}
	st := w.Stats()
	if n := b.runsOf("job-long"); n != 1 || res.Redelivered || st.Redeliveries != 0 {
		t.Errorf("ran %d times, Redelivered %v, stats %+v: the lease ran out under a running step", n, res.Redelivered, st)
	}
	if st.Heartbeats == 0 {
		t.Errorf("stats %+v: no heartbeats during a step over three times the ack wait", st)
	}
	b.waitWorkEmpty()
}

// TestWorkerAcksAfterResult holds the worker between publishing a result
// and acknowledging its message: the result is in the inbox while the
// step message is still in the work stream.
func TestWorkerAcksAfterResult(t *testing.T) {
	t.Parallel()
	fp, err := failpoint.Parse(failpoint.WorkerAfterResultPublish + "=delay=10m")
	if err != nil {
		t.Fatal(err)
	}
	b := setupWorker(t, workerOptions{noStart: true})
	_, stop := b.start(WorkerConfig{Failpoints: fp, DrainTimeout: 100 * time.Millisecond})
	b.send(schemas.StepMessage{Job: "job-ack", Step: "echo", State: json.RawMessage(`{"out": {"answer": "a"}}`)})
	b.result("job-ack")
	if n := b.workMessages(); n != 1 {
		t.Fatalf("work stream holds %d messages while the worker is between publish and ack, want 1", n)
	}
	stop() // ends the failpoint's delay; the worker acknowledges
	b.waitWorkEmpty()
}

func TestWorkerRedelivery(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{kv: kv.Config{WorkAckWait: 300 * time.Millisecond}, noStart: true})
	b.send(schemas.StepMessage{Job: "job-again", Step: "echo", State: json.RawMessage(`{"out": {"answer": "again"}}`)})

	// A worker that took the message and died without a word.
	cons, err := b.store.EnsureWorkConsumer(t.Context(), schemas.DefaultPool)
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	taken := 0
	for range batch.Messages() {
		taken++
	}
	if taken != 1 {
		t.Fatalf("took %d messages, want 1 (%v)", taken, batch.Error())
	}

	w, _ := b.start(WorkerConfig{})
	res := b.result("job-again")
	if res.Error != nil || !res.Redelivered || w.Stats().Redeliveries != 1 {
		t.Errorf("result %+v, stats %+v: want a success marked redelivered", res, w.Stats())
	}
	b.waitWorkEmpty()
}

// TestWorkerStopHandsBack stops a worker in the middle of a step: Run
// returns nil, no result is published, and the message goes back to the
// pool for another worker, which sees it as redelivered.
func TestWorkerStopHandsBack(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{noStart: true})
	_, stop := b.start(WorkerConfig{DrainTimeout: 100 * time.Millisecond})
	b.send(schemas.StepMessage{Job: "job-stop", Step: "long", State: json.RawMessage(`{"ms": 600000}`)})
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.runsOf("job-stop") == 1 }, "the step never started")
	stop()
	if res := b.lastResult("job-stop"); res != nil {
		t.Fatalf("a stopping worker published %+v", res)
	}
	if n := b.workMessages(); n != 1 {
		t.Fatalf("work stream holds %d messages after the stop, want the step message back", n)
	}

	reg := NewRegistry()
	_ = reg.Register("linger", Func(func(context.Context, *Call) (any, error) { return map[string]any{"quick": true}, nil }))
	w2, _ := b.start(WorkerConfig{Registry: reg, ID: "second"})
	res := b.result("job-stop")
	if res.Error != nil || res.Worker != "second" || !res.Redelivered || w2.Stats().Redeliveries != 1 {
		t.Errorf("result %+v, stats %+v: want the second worker's success, marked redelivered", res, w2.Stats())
	}
	b.waitWorkEmpty()
}

// TestWorkerStopDrains stops a worker while a short step runs: the step
// finishes within the drain time and its result is reported.
func TestWorkerStopDrains(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{noStart: true})
	_, stop := b.start(WorkerConfig{DrainTimeout: 30 * time.Second})
	b.send(schemas.StepMessage{Job: "job-drain", Step: "long", State: json.RawMessage(`{"ms": 400}`)})
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.runsOf("job-drain") == 1 }, "the step never started")
	stop()
	res := b.lastResult("job-drain")
	if res == nil || res.Error != nil {
		t.Fatalf("result after a stop mid-step = %+v, want the step's success reported", res)
	}
	b.waitWorkEmpty()
}

func TestWorkerRunEndedContext(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{noStart: true})
	w, err := NewWorker(WorkerConfig{Store: b.store, Registry: b.reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := w.Run(ctx); err != nil {
		t.Errorf("Run with an ended context = %v, want nil: stopping while starting is a clean stop", err)
	}
}

func TestWorkerDropsMalformedMessages(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{cfg: WorkerConfig{Concurrency: 1}})
	good := func() nats.Header {
		h := nats.Header{}
		if _, err := schemas.EncodeStepMessage(&schemas.StepMessage{Job: "job-x", Step: "echo", Attempt: 1, RunAttempt: 1, DefinitionHash: b.def.Hash}, h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	spoils := []func(nats.Header){
		func(h nats.Header) { clear(h) },
		func(h nats.Header) { h.Del(schemas.HeaderJob) },
		func(h nats.Header) { h.Del(schemas.HeaderStep) },
		func(h nats.Header) { h.Del(schemas.HeaderDefinition) },
		func(h nats.Header) { h.Set(schemas.HeaderAttempt, "0") },
		func(h nats.Header) { h.Set(schemas.HeaderAttempt, "one") },
		func(h nats.Header) { h.Set(schemas.HeaderNotBefore, "tomorrow") },
		func(h nats.Header) { h.Set(schemas.HeaderVars, "{") },
	}
	for i, spoil := range spoils {
		h := good()
		spoil(h)
		b.publishRaw(h, []byte(`{"out": {"answer": "x"}}`), "malformed-"+strconv.Itoa(i))
	}
	b.send(schemas.StepMessage{Job: "job-fine", Step: "echo", State: json.RawMessage(`{"out": {"answer": "fine"}}`)})
	if res := b.result("job-fine"); res.Error != nil {
		t.Fatalf("result after malformed messages: %v", res.Error)
	}
	// Terminated messages leave the work queue; nothing is redelivered.
	b.waitWorkEmpty()
	if res := b.lastResult("job-x"); res != nil {
		t.Errorf("a malformed message produced a result: %+v", res)
	}
}

func TestNewWorker(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	store := srv.Store(t, kv.Config{WorkAckWait: 3 * time.Second})
	tests := []struct {
		name    string
		cfg     WorkerConfig
		wantErr string
	}{
		{name: "no store", cfg: WorkerConfig{}, wantErr: "Store is required"},
		{name: "negative concurrency", cfg: WorkerConfig{Store: store, Concurrency: -1}, wantErr: "Concurrency -1: want 1..100000"},
		{name: "huge concurrency", cfg: WorkerConfig{Store: store, Concurrency: 100001}, wantErr: "Concurrency 100001"},
		{name: "heartbeat at the ack wait", cfg: WorkerConfig{Store: store, Heartbeat: 3 * time.Second}, wantErr: "Heartbeat 3s: want above 0 and below the work ack wait 3s"},
		{name: "negative heartbeat", cfg: WorkerConfig{Store: store, Heartbeat: -time.Second}, wantErr: "Heartbeat -1s"},
		{name: "defaults", cfg: WorkerConfig{Store: store}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			w, err := NewWorker(tt.cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("NewWorker = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			c := w.cfg
			if c.Pool != schemas.DefaultPool || c.Concurrency != DefaultConcurrency || c.Heartbeat != time.Second ||
				c.FetchWait != DefaultFetchWait || c.ID == "" || c.Registry == nil || c.Env == nil || c.Logger == nil {
				t.Errorf("defaults = %+v", c)
			}
			if got := strings.Join(c.Registry.Names(), ","); got != "agent,http,mcp,model,noop,store" {
				t.Errorf("default registry = %s, want the builtins", got)
			}
		})
	}
}

// TestWorkerWithoutAServiceHandsTheStepBack: a worker that lacks a service
// the step names gives the step back for another worker instead of failing
// it; a worker that has the service performs it.
func TestWorkerWithoutAServiceHandsTheStepBack(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		calls.Add(1)
		_, _ = w.Write([]byte(`{"id": "T-1"}`))
	}))
	t.Cleanup(srv.Close)
	b := setupWorker(t, workerOptions{kv: kv.Config{WorkAckWait: time.Second}, noStart: true})
	without, stopWithout := b.start(WorkerConfig{Env: &Env{}, ID: "without"})
	b.send(schemas.StepMessage{Job: "job-svc", Step: "file", State: json.RawMessage(`{"title": "x"}`)})
	testsupport.Eventually(t, 10*time.Second, func() bool { return without.Stats().Started >= 1 }, "the step never reached the worker without the service")
	stopWithout()
	if res := b.lastResult("job-svc"); res != nil {
		t.Fatalf("the worker without the service reported %+v; it should hand the step back", res)
	}
	b.start(WorkerConfig{Env: &Env{Services: map[string]string{"tickets": srv.URL}}, ID: "with"})
	res := b.result("job-svc")
	if res.Error != nil || res.Worker != "with" || calls.Load() != 1 {
		t.Fatalf("result %+v after %d calls, want the worker with the service to succeed once", res, calls.Load())
	}
}

// TestNoWorkerWithTheServiceFailsTheStepSayingWhy: when every delivery
// reaches workers without the service, the last one reports the attempt
// failed with code missing_service naming the flag to give, and the
// effect ledger was never touched.
func TestNoWorkerWithTheServiceFailsTheStepSayingWhy(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{kv: kv.Config{WorkAckWait: time.Second, WorkMaxDeliver: 3}, noStart: true})
	b.start(WorkerConfig{Env: &Env{Services: map[string]string{"other": "http://127.0.0.1:1"}}, ID: "without"})
	b.send(schemas.StepMessage{Job: "job-nosvc", Step: "file", State: json.RawMessage(`{"title": "x"}`)})
	res := b.result("job-nosvc")
	if res.Error == nil || res.Error.Code != schemas.CodeMissingService || res.Error.Retryable ||
		!strings.Contains(res.Error.Message, `service "tickets"`) || !strings.Contains(res.Error.Message, "--service tickets=URL") {
		t.Fatalf("result %+v; want a missing_service failure naming the flag", res.Error)
	}
	n := 0
	if err := b.store.Effects.List(context.Background(), func(kv.EffectEntry) bool { n++; return true }); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d effect records written for a step no worker could run", n)
	}
}

// TestWorkerWithoutTheKindHandsTheStepBack: a worker that lacks the step's
// kind (engine serve's built-in worker beside a custom one on the same
// pool) gives the step back instead of failing the job; a worker with the
// kind performs it.
func TestWorkerWithoutTheKindHandsTheStepBack(t *testing.T) {
	t.Parallel()
	b := setupWorker(t, workerOptions{kv: kv.Config{WorkAckWait: time.Second}, noStart: true})
	without, stopWithout := b.start(WorkerConfig{Env: &Env{}, ID: "without", Registry: Builtins()})
	b.send(schemas.StepMessage{Job: "job-kind", Step: "echo", State: json.RawMessage(`{"out": {"answer": "yes"}}`)})
	testsupport.Eventually(t, 10*time.Second, func() bool { return without.Stats().Started >= 1 }, "the step never reached the worker without the kind")
	stopWithout()
	if res := b.lastResult("job-kind"); res != nil {
		t.Fatalf("the worker without the kind reported %+v; it should hand the step back", res)
	}
	b.start(WorkerConfig{ID: "with"})
	res := b.result("job-kind")
	if res.Error != nil || res.Worker != "with" {
		t.Fatalf("result %+v; want the worker with the kind to succeed", res)
	}
}
