package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Engine applies inbox messages (job starts, step results) to checkpoints
// and dispatches the steps that become eligible. It keeps no state between
// messages that correctness depends on: its checkpoint cache only saves
// reads, and every write is a compare-and-swap. Any number of engines may
// share one inbox consumer.
type Engine struct {
	cfg      Config
	store    *kv.Store
	log      *slog.Logger
	compiled *compiledCache
	cache    *lru.Cache[string, *cached]
	ctr      counters
	fp       *failpoint.Set
	// incarnation names this engine process's life, so that it counts one
	// resume per job however many of the job's messages a crash left.
	incarnation string

	// beforeWrite, when set (tests), runs after a transition is decided
	// and before its checkpoint write is sent.
	beforeWrite func(job string)
}

// cached is a checkpoint as this engine last read or wrote it.
type cached struct {
	cp  *schemas.Checkpoint
	rev uint64
	// flushedSeq: this engine published cp's events up to this sequence to
	// the history stream itself. Set by the lane's settler after the lane
	// has moved on, hence atomic.
	flushedSeq atomic.Uint64
}

// New returns an Engine. Errors name the bad Config field.
func New(cfg Config) (*Engine, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cache, err := lru.New[string, *cached](cfg.CacheSize)
	if err != nil {
		return nil, fmt.Errorf("engine cache: %w", err)
	}
	return &Engine{
		cfg:      cfg,
		store:    cfg.Store,
		log:      cfg.Logger.With("component", "engine"),
		compiled: newCompiledCache(256),
		cache:    cache,
		fp:       cfg.Failpoints,

		incarnation: nuid.Next(),
	}, nil
}

// Run consumes the inbox until ctx ends, then stops taking messages,
// finishes the batches in hand (bounded by PublishTimeout) and returns
// nil. Messages not acknowledged by then are redelivered to another engine
// or to the next Run. Errors: the inbox consumer could not be opened.
func (e *Engine) Run(ctx context.Context) error {
	e.ctr.started.Store(e.cfg.Now().UnixNano())
	cons, err := e.store.EngineConsumer(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	// Queues that were lost (memory queues after a server restart) are
	// recreated before anything else; what they held is dispatched again
	// from the checkpoints, some of it at once, some once it is safe.
	var lostAt time.Time
	var requeueAgain <-chan time.Time // set while steps wait for their turn
	requeue := func() {
		requeueAgain = nil
		if lostAt.IsZero() {
			return
		}
		waiting, err := e.Requeue(ctx, lostAt)
		switch {
		case err != nil:
			e.ctr.reconcileErrors.Add(1)
			e.log.Warn("requeue after lost queues incomplete; will try again", "err", err)
			requeueAgain = time.After(time.Second)
		case waiting > 0:
			e.log.Debug("lookup and unsafe steps wait for their first attempt to end before they are dispatched again", "jobs", waiting)
			requeueAgain = time.After(time.Second)
		default:
			lostAt = time.Time{}
		}
	}
	if e.recoverQueues(ctx) {
		lostAt = e.cfg.Now()
		requeue()
	}
	lanes := make([]chan jetstream.Msg, e.cfg.Lanes)
	var wg sync.WaitGroup
	for i := range lanes {
		lanes[i] = make(chan jetstream.Msg, e.cfg.BatchSize)
		wg.Add(1)
		go func(ch chan jetstream.Msg) {
			defer wg.Done()
			e.lane(ctx, ch)
		}(lanes[i])
	}
	names := e.store.Names
	lost := make(chan struct{}, 1) // the inbox consumer is gone (its stream was lost)
	signalLost := func() {
		select {
		case lost <- struct{}{}:
		default:
		}
	}
	if nc := e.store.JS.Conn(); nc != nil {
		prev := nc.Opts.ReconnectedCB
		nc.SetReconnectHandler(func(c *nats.Conn) {
			if prev != nil {
				prev(c)
			}
			signalLost() // check the queues: the server may have restarted
		})
	}
	consume := func(cons jetstream.Consumer) (jetstream.ConsumeContext, error) {
		return cons.Consume(func(m jetstream.Msg) {
			_, job, _ := names.ParseInboxSubject(m.Subject())
			h := fnv.New32a()
			_, _ = h.Write([]byte(job))
			lanes[h.Sum32()%uint32(len(lanes))] <- m
		},
			jetstream.PullMaxMessages(e.cfg.BatchSize*2),
			jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
				if ctx.Err() != nil || errors.Is(err, nats.ErrConnectionClosed) {
					return
				}
				if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrNoHeartbeat) ||
					errors.Is(err, nats.ErrNoResponders) {
					signalLost()
				}
				e.log.Warn("inbox consumer", "err", err)
			}))
	}
	cc, err := consume(cons)
	if err != nil {
		for _, ch := range lanes {
			close(ch)
		}
		wg.Wait()
		return fmt.Errorf("consume inbox: %w", err)
	}
	stopDead, err := e.watchDeadLetters(ctx)
	if err != nil {
		e.log.Warn("poison steps will only be caught by the reconciler", "err", err)
		stopDead = func() {}
	}
	defer stopDead()
	if e.cfg.ReconcileInterval > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.reconcileLoop(ctx, signalLost)
		}()
	}
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
		case <-requeueAgain:
			requeue()
		case <-lost:
			// Make sure the layout exists, rebuild lost queues, and consume
			// again from a consumer that exists.
			if !e.recoverQueues(ctx) {
				requeue() // steps still waiting for their turn
				continue
			}
			lostAt = e.cfg.Now()
			requeue()
			if c, err := e.store.EngineConsumer(ctx); err == nil {
				if next, err := consume(c); err == nil {
					cc.Stop()
					<-cc.Closed()
					cc = next
				}
			}
		}
	}
	cc.Stop()
	<-cc.Closed()
	for _, ch := range lanes {
		close(ch)
	}
	wg.Wait()
	return nil
}

// recoverQueues checks the queue epoch and, when the queues were lost,
// recreates the layout and marks the queues anew. It reports whether they
// were lost; the caller dispatches again what they held (Requeue). Errors
// are logged and retried at the next check.
func (e *Engine) recoverQueues(ctx context.Context) bool {
	intact, err := e.store.QueuesIntact(ctx)
	if err != nil {
		e.log.Warn("cannot check the queues; will try again", "err", err)
		return false
	}
	if intact {
		return false
	}
	if err := e.store.Reopen(ctx); err != nil {
		e.log.Warn("cannot recreate the layout; will try again", "err", err)
		return false
	}
	if err := e.store.MarkQueues(ctx); err != nil {
		e.log.Warn("cannot mark the queues; will try again", "err", err)
		return false
	}
	e.log.Info("the queues were lost or never marked; running jobs are dispatched again from their checkpoints")
	return true
}

// lane handles the messages of its share of jobs: it blocks for one, takes
// whatever else is already waiting (up to BatchSize), and handles them as
// one batch, so that a busy engine makes fewer, larger rounds of writes.
func (e *Engine) lane(ctx context.Context, ch chan jetstream.Msg) {
	// The lane decides and writes; a settler waits for each batch's
	// publications and then acknowledges its messages. The lane does not
	// wait for them, so the next batch is decided while the last one's
	// dispatches are still in flight.
	settlements := make(chan *settlement, 16)
	settled := make(chan struct{})
	go func() {
		defer close(settled)
		for st := range settlements {
			e.finishPublish(ctx, st)
			for _, p := range st.plans {
				e.fp.InjectStep(ctx, failpoint.EngineAfterDispatch, p.dispatchedStep())
			}
			e.settle(st.plans)
		}
	}()
	defer func() { close(settlements); <-settled }()
	batch := make([]jetstream.Msg, 0, e.cfg.BatchSize)
	for m := range ch {
		batch = append(batch[:0], m)
	drain:
		for len(batch) < e.cfg.BatchSize {
			select {
			case m, ok := <-ch:
				if !ok {
					break drain
				}
				batch = append(batch, m)
			default:
				break drain
			}
		}
		if ctx.Err() != nil {
			continue // shutting down: leave them for redelivery
		}
		if st := e.handleBatch(ctx, batch); st != nil {
			settlements <- st
		}
	}
}

// inboxItem is one decoded inbox message.
type inboxItem struct {
	msg       jetstream.Msg
	kind, job string
	msgID     string
	delivered uint64
	start     *schemas.StartRequest
	result    *schemas.StepResult
	signal    *schemas.Signal
	done      bool // settled (acked, naked or termed)
	// handBack: another live handler applied this message concurrently;
	// give it back (delayed) instead of acknowledging, so that if that
	// handler dies before publishing, the message returns.
	handBack bool
}

// plan is what a batch does to one job.
type plan struct {
	job   string
	items []*inboxItem
	base  *cached // as loaded; nil for a job that does not exist
	fresh bool    // base was read from KV in this batch
	def   *compiled
	next  *schemas.Checkpoint // to write; nil when nothing changed
	rev   uint64              // written at
	// dispatch: publish next.Current (new, or again after a crash).
	dispatch bool
	err      error
	tally    tally // counted once the plan is settled
	// flush: publish next's pending events to the history stream now.
	flush bool
	// conflicted: this plan lost a compare-and-swap in this batch, so
	// another handler was alive and applying the same messages moments ago.
	conflicted bool
}

// checkMessageSize refuses a transition whose dispatch could not be
// published: the step message carries the state.
func (e *Engine) checkMessageSize(cp *schemas.Checkpoint) error {
	if cp.Current == nil {
		return nil
	}
	if limit := int(e.store.Config.MaxMessageBytes) - 8192; len(cp.State) > limit {
		return &schemas.Error{Code: schemas.CodeTooLarge, Job: cp.JobID,
			Message: fmt.Sprintf("state is %d bytes; a step message may carry at most %d", len(cp.State), limit)}
	}
	return nil
}

// tooLarge replaces a transition that cannot be stored (its state is over
// a size limit) with one that fails the job and keeps the state it had: a
// non-retryable error naming the job, the step and the sizes, never an
// endless redelivery. A start that cannot be stored is rejected. It
// reports whether there is a checkpoint to write.
func (e *Engine) tooLarge(p *plan, cause error) bool {
	se := schemas.AsError(cause)
	if p.base == nil {
		for _, it := range p.items {
			if it.start != nil && !it.done {
				_ = it.msg.TermWithReason(se.Error())
				it.done = true
				p.tally.rejected++
				p.tally.started = 0
			}
		}
		e.log.Warn("rejected job start", "job", p.job, "err", se)
		p.next = nil
		return false
	}
	now := e.cfg.Now()
	cp := cloneCheckpoint(p.base.cp)
	failed := &schemas.Error{Code: schemas.CodeTooLarge, Job: cp.JobID,
		Message: se.Message + "; keep large values elsewhere and references in state"}
	if cur := p.base.cp.Current; cur != nil {
		failed.Step, failed.Attempt = cur.Step, cur.Attempt
		if rec := cp.Steps[cur.Step]; rec != nil {
			rec.Status, rec.LastError = schemas.StepFailed, failed
		}
	}
	ev := failJob(cp, failed, now)
	cp.Seq = p.base.cp.Seq + 1
	cp.UpdatedAt, cp.Writer, cp.Cause = now, e.incarnation, p.next.Cause
	cp.Events = unflushed(cp.Events, p.base.flushedSeq.Load())
	cp.Events = append(cp.Events, stamp([]event{ev}, cp.Seq, now)...)
	p.next, p.dispatch, p.flush = cp, false, true
	p.tally.completed, p.tally.failed = 0, 1
	e.log.Warn("job failed: its state would exceed a size limit", "job", cp.JobID, "err", failed)
	return true
}

// unflushed returns the events after sequence flushed. The result may
// share evs's array: callers append to it only when it is a fresh copy.
func unflushed(evs []schemas.Event, flushed uint64) []schemas.Event {
	i := 0
	for i < len(evs) && evs[i].Data.Seq <= flushed {
		i++
	}
	if i == len(evs) {
		return nil
	}
	return append([]schemas.Event(nil), evs[i:]...)
}

// transitions counts the checkpoint sequences events belong to.
func transitions(evs []schemas.Event) int {
	n := 0
	var last uint64
	for _, ev := range evs {
		if ev.Data.Seq != last {
			n++
			last = ev.Data.Seq
		}
	}
	return n
}

// dispatchedStep is the step the plan's transition dispatches, for
// failpoints; "" when none.
func (p *plan) dispatchedStep() string {
	if p.next != nil && p.next.Current != nil {
		return p.next.Current.Step
	}
	return ""
}

// tally is what deciding a plan found, counted only when it is settled so
// that a decision made again after a conflict is not counted twice.
type tally struct {
	started, rejected, applied, stale, resumes, republished, completed, failed uint64
	blocked, unblocked                                                         uint64
}

// handleBatch decides and writes a batch and starts its publications; the
// returned settlement finishes them (nil when there is nothing to settle).
func (e *Engine) handleBatch(ctx context.Context, msgs []jetstream.Msg) *settlement {
	var items []*inboxItem
	for _, m := range msgs {
		if it := e.decode(m); it != nil {
			items = append(items, it)
		}
	}
	for _, it := range items {
		step := ""
		if it.result != nil {
			step = it.result.Step
		}
		e.fp.InjectStep(ctx, failpoint.EngineAfterIntake, step)
		if it.delivered > 1 {
			e.ctr.inboxRedelivered.Add(1)
		}
	}
	byJob := map[string]*plan{}
	var plans []*plan
	for _, it := range items {
		p := byJob[it.job]
		if p == nil {
			p = &plan{job: it.job}
			byJob[it.job] = p
			plans = append(plans, p)
		}
		p.items = append(p.items, it)
	}

	pending := plans
	for round := 0; len(pending) > 0; round++ {
		if round == 8 {
			for _, p := range pending {
				p.err = fmt.Errorf("job %s: gave up after %d compare-and-swap conflicts in one batch", p.job, round)
			}
			break
		}
		e.load(ctx, pending, round > 0)
		var writes []*plan
		var again []*plan
		for _, p := range pending {
			if p.err != nil {
				continue
			}
			if redo := e.decide(ctx, p); redo {
				again = append(again, p)
				continue
			}
			if p.next != nil {
				writes = append(writes, p)
			}
		}
		again = append(again, e.write(ctx, writes)...)
		pending = again
	}
	if len(plans) == 0 {
		return nil
	}
	return e.startPublish(plans)
}

// handleBatchSync handles a batch to the end: decide, write, publish,
// acknowledge. For callers without a lane (tests, the reconciler).
func (e *Engine) handleBatchSync(ctx context.Context, msgs []jetstream.Msg) {
	if st := e.handleBatch(ctx, msgs); st != nil {
		e.finishPublish(ctx, st)
		for _, p := range st.plans {
			e.fp.InjectStep(ctx, failpoint.EngineAfterDispatch, p.dispatchedStep())
		}
		e.settle(st.plans)
	}
}

// decode parses an inbox message. Garbage is terminated (never redelivered)
// with a reason; it returns nil for it.
func (e *Engine) decode(m jetstream.Msg) *inboxItem {
	kind, job, ok := e.store.Names.ParseInboxSubject(m.Subject())
	it := &inboxItem{msg: m, kind: kind, job: job, msgID: m.Headers().Get(jetstream.MsgIDHeader)}
	if md, err := m.Metadata(); err == nil {
		it.delivered = md.NumDelivered
	}
	var err error
	switch {
	case !ok:
		err = fmt.Errorf("subject %q is not an inbox subject", m.Subject())
	case kind == kv.InboxStart:
		it.start = new(schemas.StartRequest)
		if err = json.Unmarshal(m.Data(), it.start); err == nil && it.start.JobID != job {
			err = fmt.Errorf("start request for job %q on the subject of job %q", it.start.JobID, job)
		}
	case kind == kv.InboxResult:
		if it.result, err = schemas.DecodeStepResult(m.Headers(), m.Data()); err == nil && it.result.Job != job {
			err = fmt.Errorf("result for job %q on the subject of job %q", it.result.Job, job)
		}
	case kind == kv.InboxSignal:
		it.signal = new(schemas.Signal)
		if err = json.Unmarshal(m.Data(), it.signal); err == nil && it.signal.Job != job {
			err = fmt.Errorf("signal for job %q on the subject of job %q", it.signal.Job, job)
		}
	default:
		err = fmt.Errorf("unknown inbox message kind %q", kind)
	}
	if err != nil {
		e.log.Error("dropping malformed inbox message", "subject", m.Subject(), "msg_id", it.msgID, "err", err)
		_ = m.TermWithReason("malformed: " + err.Error())
		return nil
	}
	return it
}

// load fills p.base for each plan: from the cache unless fresh is
// demanded or the job is not cached, else from KV (concurrently).
func (e *Engine) load(ctx context.Context, ps []*plan, fresh bool) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for _, p := range ps {
		p.next, p.dispatch, p.err, p.tally = nil, false, nil, tally{}
		if !fresh {
			if c, ok := e.cache.Get(p.job); ok {
				p.base, p.fresh = c, false
				continue
			}
		}
		wg.Add(1)
		sem <- struct{}{}
		go func(p *plan) {
			defer func() { <-sem; wg.Done() }()
			ent, err := e.store.Checkpoints.Get(ctx, p.job)
			p.fresh = true
			switch {
			case errors.Is(err, schemas.ErrNotFound):
				p.base = nil
			case err != nil:
				p.err = err
			default:
				p.base = &cached{cp: ent.Checkpoint, rev: ent.Revision}
				e.cache.Add(p.job, p.base)
			}
		}(p)
	}
	wg.Wait()
}

// decide applies p's messages to its base checkpoint. It returns true when
// a message looked stale against a cached checkpoint: the caller reloads
// and decides again, since the cache may be behind another engine.
func (e *Engine) decide(ctx context.Context, p *plan) (redo bool) {
	now := e.cfg.Now()
	var cp *schemas.Checkpoint
	var carried []schemas.Event
	if p.base != nil {
		cp = cloneCheckpoint(p.base.cp)
		// Events not known to be in the history stream stay in the
		// checkpoint (the outbox) until a flush publishes them.
		carried = unflushed(cp.Events, p.base.flushedSeq.Load())
		if err := e.definition(ctx, p, cp.DefinitionHash); err != nil {
			return false
		}
	}
	var evs []event
	changed, republish := false, false
	cause := ""
	// A redelivered inbox message means its first handler died or stalled
	// past the ack wait; a redelivered step message, the same of a worker.
	// Either makes this transition a recovery: one resume per plan.
	recovered, workerRecovered := "", false
	for _, it := range p.items {
		if it.done {
			continue
		}
		if it.delivered > 1 && recovered == "" {
			recovered = "an inbox message was delivered again: an engine died or stalled before finishing it"
		}
		// The message that produced the checkpoint, seen again: its first
		// handler died (or stalled) after writing, maybe before publishing.
		// The delivery count cannot tell, since a server that crashed too
		// may have forgotten the first delivery; the dedup id can.
		isCause := cp != nil && it.msgID == cp.Cause && !cp.Status.Terminal()
		if isCause && p.conflicted {
			it.handBack = true
			continue
		}
		switch {
		case it.start != nil:
			if cp == nil {
				if err := e.definition(ctx, p, it.start.DefinitionHash); err != nil {
					return false
				}
				c, startEvs, err := newJob(p.def, it.start, it.msgID, now)
				if err != nil {
					p.tally.rejected++
					e.log.Warn("rejected job start", "job", it.job, "err", err)
					_ = it.msg.TermWithReason(err.Error())
					it.done = true
					continue
				}
				cp, evs, changed, cause = c, startEvs, true, it.msgID
				p.tally.started++
				continue
			}
			if cp.Status == schemas.JobPending {
				// Created by its client: start it.
				evs = append(evs, startJob(p.def, cp, now)...)
				changed, cause = true, it.msgID
				p.tally.started++
				continue
			}
			if !p.fresh {
				return true
			}
			if isCause {
				republish = true
			}
		case it.result != nil:
			e.fp.InjectStep(ctx, failpoint.EngineAfterResultReceived, it.result.Step)
			if cp == nil {
				p.tally.stale++
				e.log.Warn("dropping result for unknown job", "job", it.job, "step", it.result.Step, "attempt", it.result.Attempt)
				continue
			}
			out, resEvs := applyResult(p.def, cp, it.result, now)
			if out == outcomeStale {
				if !p.fresh && !changed {
					return true
				}
				if isCause {
					republish = true
					continue
				}
				p.tally.stale++
				e.log.Debug("dropping stale result", "job", it.job, "step", it.result.Step, "attempt", it.result.Attempt)
				continue
			}
			if it.result.Redelivered {
				recovered = "the step message was delivered again: a worker died or stalled past its lease"
				workerRecovered = true
			}
			p.tally.applied++
			if cp.Status == schemas.JobNeedsReconciliation {
				p.tally.blocked++
			}
			evs = append(evs, resEvs...)
			changed, cause = true, it.msgID
		case it.signal != nil:
			if cp == nil {
				p.tally.stale++
				continue
			}
			out, sigEvs := applySignal(p.def, cp, it.signal, now)
			if out == outcomeStale {
				if !p.fresh && !changed {
					return true
				}
				if isCause {
					republish = true
					continue
				}
				p.tally.stale++
				e.log.Info("ignoring signal the job is not waiting for", "job", it.job, "type", it.signal.Type, "key", it.signal.Key)
				continue
			}
			p.tally.unblocked++
			evs = append(evs, sigEvs...)
			changed, cause = true, it.msgID
		}
	}
	if republish && !changed {
		// Publish the dispatch and events of the checkpoint again, same ids.
		p.tally.republished++
		carried = cp.Events
		changed, cause = true, cp.Cause
		if recovered == "" {
			recovered = "the inbox message that produced the last checkpoint came again: an engine died or stalled before finishing it"
		}
	}
	if recovered == "" && e.cfg.SoleEngine && changed && p.base != nil && p.base.cp.Writer != "" && p.base.cp.Writer != e.incarnation && !p.base.cp.Status.Terminal() {
		recovered = "a new engine process took the job over from its checkpoint"
	}
	// One crash can leave several of a job's messages to be delivered
	// again; the engine that picks them up counts one resume for them all.
	if recovered != "" && cp != nil && (workerRecovered || cp.ResumedBy != e.incarnation) {
		cp.ResumeCount++
		if !workerRecovered {
			cp.ResumedBy = e.incarnation
		}
		p.tally.resumes++
		evs = append([]event{{typ: schemas.EventJobResumed, data: schemas.HistoryData{Job: cp.JobID, Reason: recovered}}}, evs...)
		if !changed {
			changed, cause = true, cp.Cause
		}
	}
	if !changed {
		return false
	}
	if p.base != nil {
		cp.Seq = p.base.cp.Seq + 1
	}
	cp.UpdatedAt = now
	cp.Cause = cause
	cp.Writer = e.incarnation
	cp.Events = append(carried, stamp(evs, cp.Seq, now)...)
	p.next = cp
	p.flush = republish || cp.Status.Stopped() || transitions(cp.Events) >= e.cfg.HistoryBatch
	p.dispatch = cp.Current != nil && (republish || p.base == nil || p.base.cp.Current == nil || p.base.cp.Current.MsgID != cp.Current.MsgID)
	switch cp.Status {
	case schemas.JobCompleted:
		p.tally.completed++
	case schemas.JobFailed:
		p.tally.failed++
	}
	return false
}

func (e *Engine) definition(ctx context.Context, p *plan, hash string) error {
	if p.def != nil && p.def.def.Hash == hash {
		return nil
	}
	def, err := e.store.Definitions.Get(ctx, hash)
	if err == nil {
		p.def, err = e.compiled.get(def)
	}
	if err != nil {
		p.err = fmt.Errorf("job %s: definition %s: %w", p.job, hash, err)
	}
	return err
}

// write sends every plan's checkpoint as a compare-and-swap, all in flight
// at once, and returns the plans that lost to another writer (to decide
// again from a fresh read).
func (e *Engine) write(ctx context.Context, ps []*plan) (conflicts []*plan) {
	if len(ps) == 0 {
		return nil
	}
	for _, p := range ps {
		e.fp.InjectStep(ctx, failpoint.EngineBeforeCheckpoint, p.dispatchedStep())
	}
	type inflight struct {
		p *plan
		w *kv.PendingWrite
	}
	fl := make([]inflight, 0, len(ps))
	for _, p := range ps {
		if e.beforeWrite != nil {
			e.beforeWrite(p.job)
		}
		var rev uint64
		if p.base != nil {
			rev = p.base.rev
		}
		var w *kv.PendingWrite
		err := e.checkMessageSize(p.next)
		if err == nil {
			w, err = e.store.Checkpoints.WriteAsync(p.next, rev)
		}
		if errors.Is(err, schemas.ErrTooLarge) && e.tooLarge(p, err) {
			w, err = e.store.Checkpoints.WriteAsync(p.next, rev)
		}
		if p.next == nil {
			continue // a start too large to store: rejected
		}
		if err != nil {
			p.err = err
			continue
		}
		fl = append(fl, inflight{p, w})
	}
	wctx, cancel := context.WithTimeout(ctx, e.cfg.PublishTimeout)
	defer cancel()
	for _, f := range fl {
		rev, err := f.w.Wait(wctx)
		switch {
		case errors.Is(err, schemas.ErrConflict):
			e.ctr.conflicts.Add(1)
			e.cache.Remove(f.p.job)
			e.log.Debug("checkpoint conflict; deciding again", "job", f.p.job)
			f.p.conflicted = true
			conflicts = append(conflicts, f.p)
		case err != nil:
			e.cache.Remove(f.p.job) // outcome unknown: read before deciding again
			f.p.err = err
		default:
			f.p.rev = rev
			e.ctr.transitions.Add(1)
			e.cache.Add(f.p.job, &cached{cp: f.p.next, rev: rev})
			e.ctr.progress(e.cfg.Now())
			if e.cfg.OnWrite != nil {
				e.cfg.OnWrite(f.p.next)
			}
		}
	}
	for _, f := range fl {
		if f.p.rev != 0 {
			e.fp.InjectStep(ctx, failpoint.EngineAfterCheckpoint, f.p.dispatchedStep())
		}
	}
	return conflicts
}

// publish sends each written plan's history events and dispatch, all in
// flight at once, with dedup ids so that publishing again after a crash
// adds nothing.
// settlement is a batch whose publications are in flight.
type settlement struct {
	plans    []*plan
	inflight []inflight
}

type inflight struct {
	p *plan
	f jetstream.PubAckFuture
}

// startPublish sends each written plan's history events and dispatch, all
// in flight at once, with dedup ids so that publishing again after a crash
// adds nothing.
func (e *Engine) startPublish(ps []*plan) *settlement {
	st := &settlement{plans: ps}
	js := e.store.JS
	names := e.store.Names
	for _, p := range ps {
		if p.err != nil || p.next == nil {
			continue
		}
		cp := p.next
		var ids []string
		var bodies [][]byte
		if p.flush {
			ids, bodies = historyBatches(cp.JobID, cp.Events)
		}
		for i := range ids {
			m := nats.NewMsg(names.HistorySubject(cp.JobID))
			m.Data = bodies[i]
			m.Header.Set(jetstream.MsgIDHeader, ids[i])
			m.Header.Set("Content-Type", schemas.HistoryContentType)
			f, err := js.PublishMsgAsync(m)
			if err != nil {
				p.err = fmt.Errorf("publish history of job %s: %w", cp.JobID, err)
				break
			}
			st.inflight = append(st.inflight, inflight{p, f})
		}
		if p.err == nil && p.dispatch {
			m, err := e.stepMessage(p)
			if err == nil {
				var f jetstream.PubAckFuture
				if f, err = js.PublishMsgAsync(m); err == nil {
					st.inflight = append(st.inflight, inflight{p, f})
				}
			}
			if err != nil {
				p.err = fmt.Errorf("dispatch %s of job %s: %w", cp.Current.MsgID, cp.JobID, err)
			}
		}
	}
	return st
}

// finishPublish waits for a settlement's acknowledgements and marks what
// was published.
func (e *Engine) finishPublish(ctx context.Context, st *settlement) {
	// Publications already sent are waited for even when the engine is
	// stopping: their acknowledgements are on the way, and a clean stop
	// should not leave its last batch for redelivery.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.PublishTimeout)
	defer cancel()
	for _, f := range st.inflight {
		select {
		case <-f.f.Ok():
		case err := <-f.f.Err():
			if f.p.err == nil {
				f.p.err = fmt.Errorf("publish for job %s: %w", f.p.job, err)
			}
		case <-wctx.Done():
			if f.p.err == nil {
				f.p.err = fmt.Errorf("publish for job %s: no acknowledgement: %w", f.p.job, wctx.Err())
			}
		}
	}
	for _, p := range st.plans {
		if p.next == nil || p.rev == 0 || p.err != nil {
			continue
		}
		if p.dispatch {
			e.ctr.dispatched.Add(1)
		}
		if c, ok := e.cache.Peek(p.job); ok && c.cp == p.next && p.flush {
			c.flushedSeq.Store(p.next.Seq)
		}
	}
}

// stepMessage builds the step message of p.next.Current.
func (e *Engine) stepMessage(p *plan) (*nats.Msg, error) {
	cp := p.next
	d := cp.Current
	rec := cp.Steps[d.Step]
	sm := schemas.StepMessage{
		Job:            cp.JobID,
		Step:           d.Step,
		Attempt:        d.Attempt,
		RunAttempt:     d.RunAttempt,
		DefinitionHash: cp.DefinitionHash,
		State:          cp.State,
		Vars:           cp.Vars,
		NotBefore:      d.NotBefore,
		IdempotencyKey: IdempotencyKey(cp.JobID, d.Step, rec.Runs),
	}
	m := nats.NewMsg(e.store.Names.WorkSubject(d.Pool))
	data, err := schemas.EncodeStepMessage(&sm, m.Header)
	if err != nil {
		return nil, err
	}
	if max := int(e.store.Config.MaxMessageBytes); len(data) > max {
		return nil, &schemas.Error{Code: schemas.CodeTooLarge, Job: cp.JobID, Step: d.Step, Attempt: d.Attempt,
			Message: fmt.Sprintf("step message is %d bytes; the limit is %d", len(data), max)}
	}
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, d.MsgID)
	return m, nil
}

// IdempotencyKey derives the key of one logical action: the run-th run of
// step in job. Every attempt of that run carries the same key; nothing
// else ever does.
func IdempotencyKey(job, step string, run int) string {
	if run <= 1 {
		return job + "/" + step
	}
	return fmt.Sprintf("%s/%s/run-%d", job, step, run)
}

// settle acknowledges the messages of plans that finished, and hands the
// others back for redelivery.
func (e *Engine) settle(ps []*plan) {
	for _, p := range ps {
		if p.err == nil {
			t, c := p.tally, &e.ctr
			c.jobsStarted.Add(t.started)
			c.jobsRejected.Add(t.rejected)
			c.applied.Add(t.applied)
			c.stale.Add(t.stale)
			c.resumes.Add(t.resumes)
			c.republished.Add(t.republished)
			c.jobsCompleted.Add(t.completed)
			c.jobsFailed.Add(t.failed)
			c.blocked.Add(t.blocked)
			c.unblocked.Add(t.unblocked)
		}
		for _, it := range p.items {
			if it.done {
				continue
			}
			if it.handBack && p.err == nil {
				_ = it.msg.NakWithDelay(2 * e.store.Config.InboxAckWait)
				continue
			}
			if p.err != nil {
				e.ctr.handleErrors.Add(1)
				delay := time.Second
				if errors.Is(p.err, schemas.ErrQuarantined) {
					delay = 30 * time.Second // a person must act first
				}
				_ = it.msg.NakWithDelay(delay)
				continue
			}
			_ = it.msg.Ack()
		}
		if p.err != nil {
			if errors.Is(p.err, schemas.ErrQuarantined) {
				e.log.Error("job quarantined: its checkpoint cannot be trusted; fix or delete it by hand", "job", p.job, "err", p.err)
			} else {
				e.log.Warn("inbox messages left for redelivery", "job", p.job, "err", p.err)
			}
		}
	}
}
