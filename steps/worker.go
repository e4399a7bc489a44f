package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"text/template"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps/providers"
)

// Defaults for WorkerConfig.
const (
	DefaultConcurrency  = 64
	DefaultFetchWait    = 2 * time.Second
	DefaultDrainTimeout = 10 * time.Second
	resultPublishTries  = 6
	resultPublishTimout = 10 * time.Second
	shutdownHandBack    = time.Second // redelivery delay of a step in hand at shutdown
)

// WorkerConfig configures a Worker. Zero fields take the defaults stated.
type WorkerConfig struct {
	// Store is the opened JetStream layout. Required.
	Store *kv.Store
	// Registry holds the kinds this worker performs; nil means Builtins().
	Registry *Registry
	// Env gives kinds services, API keys and the model mode; nil means the
	// zero Env.
	Env *Env
	// Pool is the worker pool to serve. Default "default".
	Pool string
	// Concurrency caps steps run at once. Default 64. Model and HTTP steps
	// mostly wait on the network, so this can be far above the CPU count.
	Concurrency int
	// ID names the worker in results and logs. Default host-pid.
	ID string
	// Heartbeat is how often a running step extends its lease with an
	// InProgress acknowledgement. Default a third of the work ack wait.
	Heartbeat time.Duration
	// FetchWait bounds one pull request, and so how long a stop waits for
	// the last one to end (see Run). Default 2s.
	FetchWait time.Duration
	// DrainTimeout is how long steps in hand may run on after Run's context
	// ends, to finish and report; then they are cancelled and handed back.
	// Default 10s.
	DrainTimeout time.Duration
	// Logger receives the worker's log; nil means slog.Default().
	Logger *slog.Logger
	// Failpoints injects faults at named points; nil injects nothing.
	Failpoints *failpoint.Set
}

// Worker pulls step messages of one pool and runs them. Any number of
// workers may serve a pool; each message goes to one of them at a time.
type Worker struct {
	cfg      WorkerConfig
	store    *kv.Store
	log      *slog.Logger
	prepared *lru.Cache[string, *preparedStep]
	mu       sync.Mutex // serialises preparation
	ctr      workerCounters
}

type preparedStep struct {
	step        *schemas.Step
	def         *schemas.Definition
	runner      Runner
	input       *schemas.Validator
	output      *schemas.Validator
	keyTemplate *template.Template // the step's idempotency_key, if any
	err         error              // preparation failed: every attempt fails with it
	missingKind bool               // this worker lacks the step's kind: hand the step back
	// missingService is a service the step's settings name (service "x")
	// that this worker was not given: the step is handed back before the
	// ledger is touched.
	missingService *MissingServiceError
}

// NewWorker returns a Worker. Errors name the bad field.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	if cfg.Store == nil {
		return nil, fmt.Errorf("worker config: Store is required")
	}
	if cfg.Registry == nil {
		cfg.Registry = Builtins()
	}
	if cfg.Env == nil {
		cfg.Env = &Env{}
	}
	if cfg.Env.RateLimits == nil && cfg.Store != nil && cfg.Store.Limits != nil {
		env := *cfg.Env // the caller's is left as it is
		env.RateLimits = cfg.Store.Limits
		cfg.Env = &env
	}
	if cfg.Pool == "" {
		cfg.Pool = schemas.DefaultPool
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.Concurrency < 1 || cfg.Concurrency > 100000 {
		return nil, fmt.Errorf("worker config: Concurrency %d: want 1..100000", cfg.Concurrency)
	}
	if cfg.ID == "" {
		host, _ := os.Hostname()
		cfg.ID = host + "-" + strconv.Itoa(os.Getpid())
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = cfg.Store.Config.WorkAckWait / 3
	}
	if cfg.Heartbeat <= 0 || cfg.Heartbeat >= cfg.Store.Config.WorkAckWait {
		return nil, fmt.Errorf("worker config: Heartbeat %v: want above 0 and below the work ack wait %v", cfg.Heartbeat, cfg.Store.Config.WorkAckWait)
	}
	if cfg.FetchWait == 0 {
		cfg.FetchWait = DefaultFetchWait
	}
	if cfg.DrainTimeout == 0 {
		cfg.DrainTimeout = DefaultDrainTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cache, _ := lru.New[string, *preparedStep](1024)
	return &Worker{cfg: cfg, store: cfg.Store, prepared: cache,
		log: cfg.Logger.With("component", "worker", "pool", cfg.Pool, "worker", cfg.ID)}, nil
}

// Run serves the pool until ctx ends, then stops taking steps and waits
// for those in hand, up to DrainTimeout: those that finish are reported as
// usual; those still running then are cancelled and their messages go back
// for redelivery. It returns nil after a clean stop. Errors: the pool's
// consumer could not be created.
func (w *Worker) Run(ctx context.Context) error {
	cons, err := w.store.EnsureWorkConsumer(ctx, w.cfg.Pool)
	if err != nil {
		if ctx.Err() != nil {
			return nil // stopped while starting: still a clean stop
		}
		return err
	}
	// Steps in hand outlive ctx by DrainTimeout: a worker asked to stop
	// finishes the calls it has started (and reports them) rather than
	// abandon them half done, which would make their outcome unknown.
	runCtx, cancelRun := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRun()
	stopDrain := context.AfterFunc(ctx, func() {
		t := time.NewTimer(w.cfg.DrainTimeout)
		defer t.Stop()
		select {
		case <-t.C:
			cancelRun()
		case <-runCtx.Done():
		}
	})
	defer stopDrain()
	slots := make(chan struct{}, w.cfg.Concurrency)
	var wg sync.WaitGroup
	defer func() { wg.Wait(); cancelRun() }()
	for ctx.Err() == nil {
		// Pull only as many messages as there are free slots, so no message
		// waits in a local buffer while its lease runs out.
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		n := 1
	reserve:
		for n < w.cfg.Concurrency {
			select {
			case slots <- struct{}{}:
				n++
			default:
				break reserve
			}
		}
		// The pull request outlives a stop: the server cannot be told to
		// drop it, and what it delivered to a request the client no longer
		// waits for would sit out its lease. So a stop lets the fetch end
		// (at most FetchWait) and runs what it brings, like every step in
		// hand: one handed back would wait out its lease too once the
		// server restarts (an embedded one does, with the worker), since
		// the server keeps it as delivered.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.FetchWait)
		batch, err := cons.Fetch(n, jetstream.FetchContext(fctx))
		got := 0
		if err == nil {
			for m := range batch.Messages() {
				got++
				wg.Add(1)
				go func() {
					defer func() { <-slots; wg.Done() }()
					w.handle(runCtx, m)
				}()
			}
			err = batch.Error()
		}
		cancel()
		for i := got; i < n; i++ {
			<-slots
		}
		if err != nil && ctx.Err() == nil && (errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrConsumerDeleted) ||
			errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrNoHeartbeat) || errors.Is(err, nats.ErrNoResponders)) {
			// The pool's consumer is gone (memory queues lost in a server
			// restart, say): recreate the layout and the consumer.
			if rerr := w.store.Reopen(ctx); rerr == nil {
				if c, cerr := w.store.EnsureWorkConsumer(ctx, w.cfg.Pool); cerr == nil {
					cons = c
					continue
				}
			}
		}
		if err != nil && ctx.Err() == nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, nats.ErrTimeout) {
			w.log.Warn("fetch step messages", "err", err)
			select {
			case <-time.After(500 * time.Millisecond):
			case <-ctx.Done():
			}
		}
	}
	return nil
}

// handle runs one delivery of a step message to the end: a result
// published and the message acknowledged, or the message handed back.
func (w *Worker) handle(ctx context.Context, m jetstream.Msg) {
	var delivered uint64 = 1
	if md, err := m.Metadata(); err == nil {
		delivered = md.NumDelivered
	}
	sm, err := schemas.DecodeStepMessage(m.Headers(), m.Data())
	if err != nil {
		w.log.Error("dropping malformed step message", "subject", m.Subject(), "err", err)
		_ = m.TermWithReason(err.Error())
		return
	}
	log := &lazyLog{base: w.log, sm: sm}
	w.cfg.Failpoints.InjectStep(ctx, failpoint.WorkerAfterReceive, failpointStep(sm.Step, sm.Tool))
	if sm.NotBefore != nil {
		if wait := time.Until(*sm.NotBefore); wait > 0 {
			w.ctr.held.Add(1)
			_ = m.NakWithDelay(wait)
			return
		}
	}
	redelivered := delivered > 1
	if sm.NotBefore != nil {
		redelivered = delivered > 2 // one delivery was held back for the retry delay
	}
	if redelivered {
		w.ctr.redeliveries.Add(1)
	}
	replayedPure := redelivered
	w.ctr.started.Add(1)
	ps, err := w.prepare(ctx, sm.DefinitionHash, sm.Step, sm.Tool)
	if errors.Is(err, schemas.ErrNotFound) || errors.Is(err, schemas.ErrDefinitionInvalid) {
		// Not the step's failure: the engine blocks the job until the
		// definition is stored again, then dispatches the step anew.
		log.Warn("the step's definition cannot be loaded; telling the engine", "err", err)
		res := &schemas.StepResult{Job: sm.Job, Step: sm.Step, Attempt: sm.Attempt, Item: sm.Item, Worker: w.cfg.ID,
			Error: &schemas.Error{Code: schemas.CodeDefinitionMissing, Message: fmt.Sprintf("definition %s: %v", sm.DefinitionHash, err)}}
		if err := w.publishResult(ctx, res, m.Headers().Get(jetstream.MsgIDHeader)); err != nil {
			_ = m.NakWithDelay(time.Second)
			return
		}
		_ = m.Ack()
		return
	}
	if err != nil {
		// The definition could not be read: transient, try again soon.
		log.Warn("cannot load definition; retrying", "err", err)
		_ = m.NakWithDelay(time.Second)
		return
	}
	if ps.missingKind || ps.missingService != nil {
		// A custom worker beside engine serve's built-in one, say, or a
		// worker started without the step's --service.
		w.cannotRun(ctx, m, sm, ps, delivered, log)
		return
	}
	if replayedPure && ps.step != nil && ps.def.EffectOf(ps.step) == schemas.EffectPure {
		w.ctr.replayedPure.Add(1) // a pure step runs again: harmless, counted
	}
	res, stale := w.run(ctx, m, ps, sm, delivered, log)
	var missing *MissingServiceError
	if res != nil && res.Error != nil && errors.As(res.Error, &missing) {
		// A service name computed at run time.
		named := *ps
		named.missingService = missing
		w.cannotRun(ctx, m, sm, &named, delivered, log)
		return
	}
	switch stale {
	case staleAttempt:
		// The engine has moved past this attempt: nothing to report,
		// nothing to run again.
		w.ctr.stale.Add(1)
		log.Info("attempt is no longer current; dropping it")
		_ = m.Ack()
		return
	case staleOvertaken:
		// A later delivery of this message owns the effect: this worker
		// neither writes nor reports, and leaves the message to it.
		w.ctr.overtaken.Add(1)
		log.Info("overtaken by a later delivery of this step; dropping this one without a report")
		return
	}
	if ctx.Err() != nil {
		// Shutting down: the attempt's outcome is not trustworthy; hand
		// the message back. Not at once: this worker's last pull request
		// may still be open on the server (the client unsubscribes from it
		// just after the fetch ends), and an immediate redelivery could go
		// to it and sit unseen until the ack wait runs out. The server
		// drops a pull request whose subscriber is gone, so after a short
		// delay the message goes to a live worker.
		_ = m.NakWithDelay(shutdownHandBack)
		return
	}
	res.Redelivered = redelivered
	res.Worker = w.cfg.ID
	if err := w.publishResult(ctx, res, m.Headers().Get(jetstream.MsgIDHeader)); err != nil {
		if kv.IsStorageFull(err) {
			w.ctr.storageFull.Add(1)
			log.Warn("JetStream storage is full: the result could not be published; the step runs again on redelivery once space is freed", "err", err)
			_ = m.NakWithDelay(time.Second)
			return
		}
		log.Error("result not published; the step will run again on redelivery", "err", err)
		_ = m.NakWithDelay(time.Second)
		return
	}
	w.cfg.Failpoints.InjectStep(ctx, failpoint.WorkerAfterResultPublish, failpointStep(sm.Step, sm.Tool))
	if ps.step != nil && ps.def.EffectOf(ps.step) != schemas.EffectPure {
		// Wait for the server to confirm the acknowledgement: a lost one
		// would deliver the step again, and the effect would be attempted
		// again (safely, by its idempotency key, but needlessly). The result
		// is out, so acknowledge even when the worker is stopping.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resultPublishTimout)
		defer cancel()
		if err := m.DoubleAck(actx); err != nil {
			log.Warn("acknowledgement not confirmed; the step may be delivered again", "err", err)
		}
		return
	}
	_ = m.Ack()
}

// run performs the attempt and returns its result, with the lease
// extended by heartbeats while the kind runs.
// Why an attempt produced no result to publish.
const (
	notStale       = iota
	staleAttempt   // the engine moved past the attempt
	staleOvertaken // a later delivery of the step message owns its effect
)

func (w *Worker) run(ctx context.Context, m jetstream.Msg, ps *preparedStep, sm *schemas.StepMessage, delivered uint64, log *lazyLog) (*schemas.StepResult, int) {
	res := &schemas.StepResult{Job: sm.Job, Step: sm.Step, Attempt: sm.Attempt, Item: sm.Item}
	fail := func(e *schemas.Error) (*schemas.StepResult, int) {
		w.ctr.failed.Add(1)
		res.Error = e
		res.Output = nil
		if kv.IsStorageFull(e) {
			// Not the step's failure: the deployment's storage is full, and
			// the attempt is retried once space is freed.
			w.ctr.storageFull.Add(1)
			log.Warn("JetStream storage is full: the attempt could not record its progress and will be tried again", "code", e.Code, "err", e.Message, "effect_state", res.EffectState)
		} else {
			log.Info("step attempt failed", "code", e.Code, "retryable", e.Retryable, "err", e.Message, "effect_state", res.EffectState)
		}
		return res, notStale
	}
	if ps.err != nil {
		return fail(&schemas.Error{Code: schemas.CodeDefinitionInvalid, Message: ps.err.Error()})
	}
	if schemas.HasRefs(sm.State) {
		state, err := w.resolveState(ctx, sm)
		if err != nil {
			return fail(err)
		}
		sm.State = state
	}
	call := &Call{
		Job: sm.Job, Step: ps.step, Definition: ps.def, Attempt: sm.Attempt, RunAttempt: sm.RunAttempt,
		State: sm.State, Vars: sm.Vars, IdempotencyKey: sm.IdempotencyKey, Env: w.cfg.Env, lazy: log,
		Item: sm.Item, ItemName: sm.ItemName, ItemValue: sm.ItemValue, Tool: sm.Tool, Turn: sm.Turn, Scope: sm.Scope, ScopeOf: sm.ScopeOf, Session: w.store.Session,
	}
	if sm.Turn > 0 {
		msgs, err := w.transcript(ctx, sm)
		if err != nil {
			return fail(err)
		}
		call.Transcript = msgs
		call.Stream = w.streamer(sm)
		defer w.endStream(sm) // before the result is published: the watchers' cue
	}
	if ps.input != nil {
		// A map item's input_schema is the item's.
		in, what := sm.State, "state"
		if sm.Item > 0 {
			in, what = sm.ItemValue, fmt.Sprintf("item %d", sm.Item-1)
		}
		if err := ps.input.ValidateJSON(in); err != nil {
			return fail(&schemas.Error{Code: schemas.CodeInputInvalid, Message: what + " does not match the step's input_schema: " + err.Error()})
		}
	}
	effectful := ps.def.EffectOf(ps.step) != schemas.EffectPure
	if !effectful && (sm.Turn > 0 || sm.Tool != "") {
		// An agent's model turn or pure tool call: if the engine has its
		// result already, or the inbox holds it for the engine (a delivery
		// again, after a crash; the count of deliveries cannot tell, as a
		// server that crashed too may have forgotten the first), the call is
		// not made a second time. Two reads, small beside a model call, in
		// this order: the engine acknowledges a result only after writing
		// the checkpoint that applies it, so a result gone from the inbox
		// is in the checkpoint read after.
		if ok, err := w.store.Queues.ResultPending(ctx, sm.Job, sm.Step, sm.Attempt, sm.Item); err == nil && ok {
			w.ctr.answered.Add(1)
			return nil, staleAttempt
		}
		if err := w.fence(ctx, call); errors.Is(err, errStaleAttempt) {
			return nil, staleAttempt
		}
	}
	if effectful {
		key := sm.EffectKey // computed by the engine
		if key == "" {
			var err error
			if key, err = ps.effectKey(call); err != nil {
				return fail(&schemas.Error{Code: schemas.CodeInputInvalid, Message: "idempotency_key: " + err.Error()})
			}
		}
		call.IdempotencyKey = key
		res.EffectKey = key
	}
	timeout := ps.def.TimeoutOf(ps.step)
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	stop := w.heartbeat(m, time.Now().Add(timeout+w.cfg.Heartbeat))
	start := time.Now()
	var out any
	var err error
	if effectful {
		out, err = w.runEffect(rctx, ps, call, delivered, &res.EffectState)
	} else {
		out, err = safeRun(rctx, ps.runner, call)
	}
	stop()
	res.DurationMs = time.Since(start).Milliseconds()
	switch {
	case errors.Is(err, errStaleAttempt):
		return nil, staleAttempt
	case errors.Is(err, errOvertaken):
		return nil, staleOvertaken
	}
	if err != nil {
		e := toError(err)
		if rctx.Err() == context.DeadlineExceeded && ctx.Err() == nil && e.Code != schemas.CodeAmbiguous {
			// An ambiguous effect keeps its code: the job must stop for a
			// person, not retry or fail.
			e = &schemas.Error{Code: schemas.CodeTimeout, Retryable: true, Message: fmt.Sprintf("step ran past its timeout of %v: %s", timeout, e.Message)}
		}
		return fail(e)
	}
	raw, err := encodeOutput(out)
	if err != nil {
		return fail(&schemas.Error{Code: schemas.CodeOutputInvalid, Message: err.Error()})
	}
	if limit := int(w.store.Config.MaxMessageBytes) - 4096; len(raw) > limit {
		return fail(&schemas.Error{Code: schemas.CodeTooLarge, Message: fmt.Sprintf("output is %d bytes; the limit is %d", len(raw), limit)})
	}
	if ps.output != nil {
		if err := ps.output.ValidateJSON(raw); err != nil {
			return fail(&schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true, Message: "output does not match the step's output_schema: " + err.Error()})
		}
	}
	w.ctr.succeeded.Add(1)
	res.Output = raw
	res.EffectState = ""
	return res, notStale
}

// safeRun calls the runner, turning a panic in step code into a
// non-retryable error instead of a dead worker.
func safeRun(ctx context.Context, r Runner, c *Call) (out any, err error) {
	defer func() {
		if p := recover(); p != nil {
			buf := make([]byte, 4096)
			buf = buf[:runtime.Stack(buf, false)]
			err = NonRetryable(fmt.Errorf("step panicked: %v\n%s", p, buf))
		}
		out, err = c.scrubResult(out, err) // no secret the call resolved leaves the worker
	}()
	return r.Run(ctx, c)
}

func encodeOutput(out any) (json.RawMessage, error) {
	if o, ok := out.(*Outcome); ok {
		out = o.Output
	}
	switch v := out.(type) {
	case nil:
		return json.RawMessage("null"), nil
	case json.RawMessage:
		if !json.Valid(v) {
			return nil, fmt.Errorf("output is not valid JSON")
		}
		return v, nil
	case []byte:
		if !json.Valid(v) {
			return nil, fmt.Errorf("output is not valid JSON")
		}
		return json.RawMessage(v), nil
	}
	b, err := schemas.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("encode output: %w", err)
	}
	return b, nil
}

// lazyLog is a logger with an attempt's job, step and attempt attached,
// built on first use: most attempts log nothing. One goroutine uses it.
type lazyLog struct {
	base *slog.Logger
	sm   *schemas.StepMessage
	l    *slog.Logger
}

func (l *lazyLog) get() *slog.Logger {
	if l.l == nil {
		l.l = l.base.With("job", l.sm.Job, "step", l.sm.Step, "attempt", l.sm.Attempt)
	}
	return l.l
}

func (l *lazyLog) Info(msg string, args ...any)  { l.get().Info(msg, args...) }
func (l *lazyLog) Warn(msg string, args ...any)  { l.get().Warn(msg, args...) }
func (l *lazyLog) Error(msg string, args ...any) { l.get().Error(msg, args...) }

// heartbeat extends m's lease every Heartbeat until the returned stop is
// called, or until the step runs past until. It costs a timer, not a
// goroutine: most steps end before the first beat.
func (w *Worker) heartbeat(m jetstream.Msg, until time.Time) (stop func()) {
	var mu sync.Mutex
	stopped := false
	var t *time.Timer
	var beat func()
	beat = func() {
		mu.Lock()
		defer mu.Unlock()
		if stopped {
			return
		}
		if time.Now().After(until) {
			// The step ignores its deadline: stop extending the lease, so
			// the message goes to another worker.
			w.log.Warn("step ran past its timeout and ignores cancellation; letting its lease expire")
			return
		}
		if err := m.InProgress(); err == nil {
			w.ctr.heartbeats.Add(1)
		}
		t.Reset(w.cfg.Heartbeat)
	}
	mu.Lock()
	t = time.AfterFunc(w.cfg.Heartbeat, beat)
	mu.Unlock()
	return func() {
		mu.Lock()
		stopped = true
		t.Stop()
		mu.Unlock()
	}
}

// resolveState returns sm's state with the values it refers to read from
// the value store. A value that cannot be read is a retryable error.
func (w *Worker) resolveState(ctx context.Context, sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
	if w.store.Values == nil || sm.ValueOwner == "" {
		return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: "the state refers to stored values and the step message names no owner for them"}
	}
	state, err := w.store.Values.Resolve(ctx, sm.ValueOwner, sm.State)
	if err != nil {
		return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Retryable: true, Message: "read the state's stored values: " + err.Error()}
	}
	return state, nil
}

// streamer returns the function that publishes an agent turn's text on
// the job's stream subject, best effort: core NATS, nothing stored, a
// lost piece only a gap in what a watcher sees.
func (w *Worker) streamer(sm *schemas.StepMessage) func(string) {
	nc := w.store.JS.Conn()
	subj := w.store.Names.StreamSubject(sm.Job)
	turn, attempt := strconv.Itoa(sm.Turn), strconv.Itoa(sm.Attempt)
	return func(text string) {
		if text == "" {
			return
		}
		m := nats.NewMsg(subj)
		m.Header.Set(schemas.HeaderStep, sm.Step)
		m.Header.Set(schemas.HeaderTurn, turn)
		m.Header.Set(schemas.HeaderAttempt, attempt)
		m.Data = []byte(text)
		_ = nc.PublishMsg(m)
	}
}

// endStream publishes the end of an agent turn's text on the job's stream
// subject: a message without data, header HeaderStreamEnd, so that a
// watcher prints the text before the turn's result.
func (w *Worker) endStream(sm *schemas.StepMessage) {
	m := nats.NewMsg(w.store.Names.StreamSubject(sm.Job))
	m.Header.Set(schemas.HeaderStep, sm.Step)
	m.Header.Set(schemas.HeaderTurn, strconv.Itoa(sm.Turn))
	m.Header.Set(schemas.HeaderAttempt, strconv.Itoa(sm.Attempt))
	m.Header.Set(schemas.HeaderStreamEnd, "true")
	_ = w.store.JS.Conn().PublishMsg(m)
}

// transcript reads an agent turn's transcript parts from the value store.
// A part that cannot be read is a retryable error.
func (w *Worker) transcript(ctx context.Context, sm *schemas.StepMessage) ([]providers.Message, *schemas.Error) {
	if len(sm.Transcript) == 0 {
		return nil, nil
	}
	if w.store.Values == nil || sm.ValueOwner == "" {
		return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: "the agent turn's transcript is stored by reference and the step message names no owner for it"}
	}
	var msgs []providers.Message
	for _, p := range sm.Transcript {
		data, err := w.store.Values.Get(ctx, sm.ValueOwner, p.Ref())
		if err != nil {
			return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Retryable: true, Message: fmt.Sprintf("read transcript part %s: %v", p.Digest, err)}
		}
		var part []providers.Message
		if err := json.Unmarshal(data, &part); err != nil || len(part) != p.Messages {
			return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: fmt.Sprintf("transcript part %s does not hold %d messages", p.Digest, p.Messages)}
		}
		msgs = append(msgs, part...)
	}
	return msgs, nil
}

// publishResult sends res to the engine's inbox, trying again on errors:
// the dedup id (the step message's id and "/result") makes a repeat
// harmless.
func (w *Worker) publishResult(ctx context.Context, res *schemas.StepResult, stepMsgID string) error {
	m := nats.NewMsg(w.store.Names.InboxSubject(kv.InboxResult, res.Job))
	data, err := schemas.EncodeStepResult(res, m.Header)
	if err != nil {
		return fmt.Errorf("encode result: %w", err)
	}
	m.Data = data
	id := stepMsgID + "/result"
	if stepMsgID == "" {
		id = schemas.ResultMsgID(res.Job, res.Step, res.Attempt)
	}
	m.Header.Set(jetstream.MsgIDHeader, id)
	delay := 100 * time.Millisecond
	for try := 1; ; try++ {
		err = w.publishWait(ctx, m)
		if err == nil {
			w.ctr.published.Add(1)
			return nil
		}
		if try == resultPublishTries || ctx.Err() != nil {
			return fmt.Errorf("publish result %s: %w", id, err)
		}
		select {
		case <-time.After(delay):
		case <-ctx.Done():
		}
		delay *= 2
	}
}

// publishWait publishes m (through the inbox's group commit where the
// store has one) and waits for its acknowledgement, at most
// resultPublishTimout.
func (w *Worker) publishWait(ctx context.Context, m *nats.Msg) error {
	f, err := w.store.PublishAsync(m)
	if err != nil {
		return err
	}
	t := time.NewTimer(resultPublishTimout)
	defer t.Stop()
	select {
	case <-f.Ok():
		return nil
	case err := <-f.Err():
		return err
	case <-t.C:
		return fmt.Errorf("no acknowledgement within %v", resultPublishTimout)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// prepare returns the prepared step, preparing it once per definition.
//
// A tool call (tool not empty) of an agent step is prepared as the step
// the tool describes (schemas.ToolStep).
func (w *Worker) prepare(ctx context.Context, hash, stepID, tool string) (*preparedStep, error) {
	key := hash + "/" + stepID + "/" + tool
	if ps, ok := w.prepared.Get(key); ok {
		return ps, nil
	}
	def, err := w.store.Definitions.Get(ctx, hash)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if ps, ok := w.prepared.Get(key); ok {
		return ps, nil
	}
	ps := &preparedStep{def: def}
	idx := def.StepIndex(stepID)
	if idx < 0 {
		ps.err = fmt.Errorf("definition %s has no step %q", hash, stepID)
		w.prepared.Add(key, ps)
		return ps, nil
	}
	ps.step = &def.Steps[idx]
	if tool != "" {
		t := ps.step.ToolOf(tool)
		if ps.step.Kind != schemas.KindAgent || t == nil {
			ps.err = fmt.Errorf("step %q of definition %s has no tool %q", stepID, hash, tool)
			w.prepared.Add(key, ps)
			return ps, nil
		}
		ps.step = schemas.ToolStep(ps.step, t)
	}
	kind, ok := w.cfg.Registry.Lookup(ps.step.Kind)
	switch {
	case !ok:
		ps.err = fmt.Errorf("this worker has no step kind %q (it has: %v)", ps.step.Kind, w.cfg.Registry.Names())
		ps.missingKind = true
	default:
		ps.runner, ps.err = kind.Prepare(&Prep{Definition: def, Step: ps.step, Index: idx, Env: w.cfg.Env, Tool: tool})
	}
	if ps.err == nil {
		ps.missingService = missingService(ps.step.With, w.cfg.Env)
	}
	if ps.err == nil && ps.step.IdempotencyKey != "" {
		ps.keyTemplate, ps.err = parseTemplate(stepID+".idempotency_key", ps.step.IdempotencyKey, w.cfg.Env)
	}
	if ps.err == nil {
		ps.input, ps.err = schemas.CompileSchema(stepID+".input_schema", ps.step.InputSchema)
	}
	if ps.err == nil && ps.step.Kind != schemas.KindAgent {
		// An agent's output_schema is its final answer's: the engine checks it.
		ps.output, ps.err = schemas.CompileSchema(stepID+".output_schema", ps.step.OutputSchema)
	}
	w.prepared.Add(key, ps)
	return ps, nil
}

// WorkerStats are a worker's counters since it started.
type WorkerStats struct {
	// ReplayedEffects counts attempts answered from the ledger without a
	// call (the effect had already happened); AmbiguousEffects, effects
	// declared ambiguous; SettledLate, ambiguous effects this worker
	// reconciled as happened because its own call returned after all;
	// Stale, attempts dropped because the engine had moved on.
	ReplayedEffects  uint64 `json:"replayed_effects"`
	ReplayedPure     uint64 `json:"replayed_pure_steps"` // pure steps run again on a redelivery
	AmbiguousEffects uint64 `json:"ambiguous_effects"`
	SettledLate      uint64 `json:"effects_settled_late"`
	Stale            uint64 `json:"stale_attempts"`
	// Overtaken counts deliveries dropped without a report because a later
	// delivery of the same step message owned the effect (a lease that ran
	// out under a stalled worker).
	Overtaken uint64 `json:"overtaken"`
	// StorageFull counts writes this worker saw refused because
	// JetStream's storage is full (the attempt is tried again later).
	StorageFull uint64 `json:"storage_full"`
	// Answered counts agent turns and pure tool calls delivered again
	// whose result was already waiting for the engine: not run again.
	Answered     uint64 `json:"answered_before"`
	Started      uint64 `json:"steps_started"`
	Succeeded    uint64 `json:"steps_succeeded"`
	Failed       uint64 `json:"steps_failed"`
	Redeliveries uint64 `json:"redeliveries"` // deliveries after a worker died or stalled
	Held         uint64 `json:"held_for_retry_delay"`
	Published    uint64 `json:"results_published"`
	Heartbeats   uint64 `json:"heartbeats"`
}

type workerCounters struct {
	started, succeeded, failed, redeliveries, held, published, heartbeats atomic.Uint64
	replayedEffects, ambiguousEffects, stale, replayedPure, settledLate   atomic.Uint64
	overtaken, storageFull, answered                                      atomic.Uint64
}

// Stats returns a snapshot of the worker's counters. Safe for concurrent use.
func (w *Worker) Stats() WorkerStats {
	c := &w.ctr
	return WorkerStats{ReplayedEffects: c.replayedEffects.Load(), ReplayedPure: c.replayedPure.Load(), AmbiguousEffects: c.ambiguousEffects.Load(), SettledLate: c.settledLate.Load(), Stale: c.stale.Load(), Overtaken: c.overtaken.Load(), StorageFull: c.storageFull.Load(), Answered: c.answered.Load(),
		Started: c.started.Load(), Succeeded: c.succeeded.Load(), Failed: c.failed.Load(),
		Redeliveries: c.redeliveries.Load(), Held: c.held.Load(), Published: c.published.Load(), Heartbeats: c.heartbeats.Load()}
}

// cannotRun hands back a step this worker lacks the kind or a service
// for; on the step message's last delivery (the work consumer's max
// deliveries) it reports the attempt failed instead, saying what no
// worker of the pool had, so that the job does not end as a poison step.
func (w *Worker) cannotRun(ctx context.Context, m jetstream.Msg, sm *schemas.StepMessage, ps *preparedStep, delivered uint64, log *lazyLog) {
	what, code := "the step's kind "+strconv.Quote(ps.step.Kind), schemas.CodeUnknownKind
	if !ps.missingKind {
		what, code = "service "+strconv.Quote(ps.missingService.Name), schemas.CodeMissingService
	}
	if delivered < uint64(w.store.Config.WorkMaxDeliver) {
		log.Warn("this worker lacks "+what+"; handing the step back for a worker that has it", "delivery", delivered)
		w.handBackDelay(m)
		return
	}
	msg := fmt.Sprintf("no worker of pool %s that took this step has %s (handed back %d times); ", w.cfg.Pool, what, delivered-1)
	if ps.missingKind {
		msg += fmt.Sprintf("run a worker that registers the kind (this one has: %v)", w.cfg.Registry.Names())
	} else {
		msg += ps.missingService.Error()
	}
	log.Error("no worker could run the step; reporting it failed", "reason", msg)
	res := &schemas.StepResult{Job: sm.Job, Step: sm.Step, Attempt: sm.Attempt, Item: sm.Item, Worker: w.cfg.ID,
		Error: &schemas.Error{Code: code, Message: msg}}
	if err := w.publishResult(ctx, res, m.Headers().Get(jetstream.MsgIDHeader)); err != nil {
		_ = m.NakWithDelay(time.Second)
		return
	}
	_ = m.Ack()
}

// handBackDelay gives a step this worker cannot perform (it lacks the
// kind or a service) back to the pool, where another worker may have what
// it needs, rather than failing it; see cannotRun.
func (w *Worker) handBackDelay(m jetstream.Msg) {
	_ = m.NakWithDelay(min(max(w.store.Config.WorkAckWait/6, 100*time.Millisecond), 5*time.Second))
}

// failpointStep names a step attempt for failpoints: the step, or for an
// agent's tool call "<step>.<tool>" (crash/<step> matches both).
func failpointStep(step, tool string) string {
	if tool == "" {
		return step
	}
	return step + "." + tool
}

func (c *Call) failpointStep() string { return failpointStep(c.Step.ID, c.Tool) }
