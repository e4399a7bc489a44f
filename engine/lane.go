package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// lane handles the messages of its share of jobs: it blocks for one, takes
// whatever else is already waiting (up to BatchSize), and handles them as
// one batch, so that a busy engine makes fewer, larger rounds of writes.
//
// The lane handles every message it is given until ch is closed; ctx
// carries that work, which a stop does not cut short (the engine bounds
// it).
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
			e.finish(ctx, st)
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
		// Also while the engine stops: a message handed back would wait out
		// its ack wait once the server restarts (an embedded server does,
		// with the engine), since the server keeps it as delivered.
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
	// later: give the message back to be delivered again after this long
	// (a flow wake-up that came before the checkpoint it is for).
	later time.Duration
}

// plan is what a batch does to one job.
type plan struct {
	job   string
	items []*inboxItem
	base  *cached // as loaded; nil for a job that does not exist
	fresh bool    // base was read from KV in this batch
	// leader: base was read from the bucket's stream leader, not by a
	// direct get a lagging replica may answer; wantLeader asks for that
	// read before a message is dropped as stale.
	leader, wantLeader bool
	def                *compiled
	next               *schemas.Checkpoint // to write; nil when nothing changed
	rev                uint64              // written at
	entry              *cached             // next as cached when written (base when republishing)
	// dispatch: publish sends, next's dispatches that are new (or, after a
	// crash, again).
	dispatch bool
	sends    []*schemas.Dispatch
	// republish: nothing to write; publish base's events (and, with
	// dispatch, base.Current) again, under the ids they had.
	republish bool
	// markAmbiguous names the effects whose ledger records must say
	// "ambiguous" once next is written (a step failed for good while its
	// effect may have happened).
	markAmbiguous []string
	// keep: the job is blocked (its definition cannot be loaded); its
	// messages are handed back with keepDelay instead of acknowledged.
	keep      bool
	keepDelay time.Duration
	err       error
	tally     tally // counted once the plan is settled
	// conflicted: this plan lost a compare-and-swap in this batch, so
	// another handler was alive and applying the same messages moments ago.
	conflicted bool
	// flowSlots: concurrency slots taken for the plan's dispatches in this
	// batch, by message id: a decision made again after a conflict takes
	// the same ones; released after the write if it does not name them.
	flowSlots map[string]string
	// flowDrop: slots (and the message ids they were handed to) that a
	// flow wake-up offered to a dispatch that no longer waits: released
	// once the plan is settled.
	flowDrop [][2]string
	// stopped: the transition stopped the job with work in flight (its
	// deadline passed): after the write, as after a cancel, its queued
	// step messages are removed and its child jobs cancelled.
	stopped bool
}

// written is the checkpoint the plan leaves current: next once written,
// else base's (republishing); nil when there is none.
func (p *plan) written() *schemas.Checkpoint {
	switch {
	case p.next != nil && p.rev != 0:
		return p.next
	case p.republish && p.base != nil:
		return p.base.cp
	}
	return nil
}

// dispatchedSteps are the steps the plan's transition dispatches, each
// once, for failpoints; [""] when none (a failpoint without a step still
// fires).
func (p *plan) dispatchedSteps() []string {
	if p.next == nil || len(p.sends) == 0 {
		return []string{""}
	}
	var out []string
	for _, d := range p.sends {
		if !slices.Contains(out, d.Step) {
			out = append(out, d.Step)
		}
	}
	return out
}

// injectSteps runs failpoint point once for each step p dispatches.
func (e *Engine) injectSteps(ctx context.Context, point string, p *plan) {
	for _, s := range p.dispatchedSteps() {
		e.fp.InjectStep(ctx, point, s)
	}
}

// tally is what deciding a plan found, counted only when it is settled so
// that a decision made again after a conflict is not counted twice.
type tally struct {
	started, rejected, applied, stale, resumes, republished, completed, failed uint64
	blocked, unblocked, definitionBlocked, cancelled, controls                 uint64
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
			if redo := e.safeDecide(ctx, p); redo {
				again = append(again, p)
				continue
			}
			if p.next != nil && p.err == nil {
				writes = append(writes, p)
			}
		}
		e.admitFlow(ctx, writes)
		writes = slices.DeleteFunc(writes, func(p *plan) bool { return p.next == nil || p.err != nil })
		e.storeOutboxes(ctx, writes)
		again = append(again, e.write(ctx, writes)...)
		pending = again
	}
	if len(plans) == 0 {
		return nil
	}
	return e.startPublish(ctx, plans)
}

// safeDecide is decide, with a panic contained: an input that crashes the
// decision (a bug, or a checkpoint inconsistent in a way the decoder did
// not catch) fails that plan, is logged and counted, and leaves the
// engine running; the messages are handed back for a later try.
func (e *Engine) safeDecide(ctx context.Context, p *plan) (redo bool) {
	defer func() {
		if r := recover(); r != nil {
			buf := make([]byte, 4096)
			buf = buf[:runtime.Stack(buf, false)]
			e.ctr.panics.Add(1)
			p.next, p.republish, p.dispatch, p.sends = nil, false, false, nil
			if f, ok := r.(fanFault); ok {
				p.err = fmt.Errorf("job %s: %w", p.job, f.err)
				e.log.Warn("a map's outputs could not be read; the job's messages are handed back", "job", p.job, "err", f.err)
				redo = false
				return
			}
			p.err = fmt.Errorf("job %s: %w: %v", p.job, errPanicked, r)
			e.log.Error("contained a panic while deciding a transition; the job's messages are held back", "job", p.job, "panic", fmt.Sprint(r), "stack", string(buf))
			redo = false
		}
	}()
	if e.cfg.beforeDecide != nil {
		e.cfg.beforeDecide(p.job)
	}
	return e.decide(ctx, p)
}

// errPanicked: deciding a job's transition panicked (contained).
var errPanicked = errors.New("deciding the transition panicked")

// handleBatchSync handles a batch to the end: decide, write, publish,
// acknowledge. For callers without a lane (tests).
func (e *Engine) handleBatchSync(ctx context.Context, msgs []jetstream.Msg) {
	if st := e.handleBatch(ctx, msgs); st != nil {
		e.finish(ctx, st)
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
// demanded or the job is not cached, else from KV (concurrently). A
// checkpoint read from KV whose events this engine did not publish itself
// is checked against the history stream, which says whether they are
// stored.
func (e *Engine) load(ctx context.Context, ps []*plan, fresh bool) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for _, p := range ps {
		p.next, p.dispatch, p.sends, p.republish, p.markAmbiguous, p.keep, p.entry = nil, false, nil, false, nil, false, nil
		p.flowDrop = nil
		p.err, p.tally = nil, tally{}
		if !fresh {
			if c, ok := e.cache.get(p.job); ok {
				p.base, p.fresh, p.leader = c, false, false
				continue
			}
		}
		wg.Add(1)
		sem <- struct{}{}
		go func(p *plan) {
			defer func() { <-sem; wg.Done() }()
			get := e.store.Checkpoints.Get
			p.leader = p.wantLeader
			if p.leader {
				get = e.store.Checkpoints.GetFromLeader
			}
			ent, err := get(ctx, p.job)
			p.fresh = true
			switch {
			case errors.Is(err, schemas.ErrNotFound):
				p.base = nil
				return
			case err != nil:
				p.err = err
				return
			}
			c := &cached{cp: ent.Checkpoint, rev: ent.Revision, size: ent.Size}
			if c.cp.Flush {
				// Its outbox was to be published after the write, by an engine
				// that may have died: the stream says whether it is stored.
				last, err := e.store.History.LastSeq(ctx, p.job)
				if err != nil {
					p.err = err
					return
				}
				c.published.Store(last)
			}
			p.base = c
			e.cache.add(p.job, c)
		}(p)
	}
	wg.Wait()
}

// storeOutboxes makes sure, before the plans' checkpoints are written,
// that the outboxes their base checkpoints were to publish are stored in
// the history stream: it waits for this engine's own publication if one
// is in flight, and publishes (again, under the same id) what is still not
// known to be stored. A plan whose base outbox cannot be stored fails (its
// messages are handed back): writing over it would lose it.
func (e *Engine) storeOutboxes(ctx context.Context, ps []*plan) {
	var need []*plan
	for _, p := range ps {
		if p.base == nil || p.base.knownPublished() {
			continue
		}
		if ch := p.base.flushing; ch != nil {
			t := time.NewTimer(e.cfg.PublishTimeout)
			select {
			case <-ch:
			case <-t.C:
			case <-ctx.Done():
			}
			t.Stop()
			if p.base.knownPublished() {
				continue
			}
		}
		need = append(need, p)
	}
	if len(need) == 0 {
		return
	}
	wctx, cancel := context.WithTimeout(ctx, e.cfg.PublishTimeout)
	defer cancel()
	type sent struct {
		p *plan
		f jetstream.PubAckFuture
	}
	var all []sent
	for _, p := range need {
		f, err := e.publishOutbox(p.base.cp)
		if err != nil {
			p.err = err
			continue
		}
		all = append(all, sent{p, f})
		e.ctr.historyRepublished.Add(1)
	}
	for _, s := range all {
		if err := waitAll(wctx, []jetstream.PubAckFuture{s.f}); err != nil {
			s.p.err = fmt.Errorf("job %s: store the history of checkpoint %d before writing the next: %w", s.p.job, s.p.base.cp.Seq, err)
			continue
		}
		s.p.base.published.Store(s.p.base.cp.Seq)
	}
}

// write sends every plan's checkpoint as a compare-and-swap, all in flight
// at once, and returns the plans that lost to another writer (to decide
// again from a fresh read).
func (e *Engine) write(ctx context.Context, ps []*plan) (conflicts []*plan) {
	var todo []*plan
	for _, p := range ps {
		if p.err == nil && p.next != nil {
			todo = append(todo, p)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	for _, p := range todo {
		e.injectSteps(ctx, failpoint.EngineBeforeCheckpoint, p)
	}
	type inflight struct {
		p *plan
		w *kv.PendingWrite
	}
	fl := make([]inflight, 0, len(todo))
	for _, p := range todo {
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
			err = e.saveValues(ctx, p.next)
		}
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
			e.cache.remove(f.p.job)
			e.log.Debug("checkpoint conflict; deciding again", "job", f.p.job)
			f.p.conflicted = true
			conflicts = append(conflicts, f.p)
		case err != nil:
			e.cache.remove(f.p.job) // outcome unknown: read before deciding again
			f.p.err = err
		default:
			f.p.rev = rev
			e.ctr.transitions.Add(1)
			c := &cached{cp: f.p.next, rev: rev, size: f.w.Size()}
			if f.p.next.Flush {
				c.flushing = make(chan struct{})
			}
			f.p.entry = c
			if parked(f.p.next) {
				// It waits for a person or a timer, maybe for days: the
				// cache is for jobs that move.
				e.cache.remove(f.p.job)
			} else {
				e.cache.add(f.p.job, c)
			}
			e.ctr.progress(e.cfg.Now())
			if e.cfg.OnWrite != nil {
				e.cfg.OnWrite(f.p.next)
			}
			if f.p.base != nil {
				e.dropFanValues(wctx, f.p.base.cp, f.p.next)
			}
		}
	}
	for _, f := range fl {
		if f.p.rev != 0 {
			e.injectSteps(ctx, failpoint.EngineAfterCheckpoint, f.p)
		}
	}
	return conflicts
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
	e.setOutbox(p.base.cp, cp, []event{ev}, now)
	p.next, p.dispatch, p.sends, p.markAmbiguous = cp, false, nil, nil
	p.tally.completed, p.tally.failed = 0, 1
	e.log.Warn("job failed: its state would exceed a size limit", "job", cp.JobID, "err", failed)
	return true
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
			c.jobsCancelled.Add(t.cancelled)
			c.definitionBlocked.Add(t.definitionBlocked)
		}
		for _, it := range p.items {
			if it.done {
				continue
			}
			switch {
			case it.handBack && p.err == nil:
				_ = it.msg.NakWithDelay(2 * e.store.Config.InboxAckWait)
			case it.later > 0 && p.err == nil:
				_ = it.msg.NakWithDelay(it.later)
			case p.keep && p.err == nil:
				_ = it.msg.NakWithDelay(p.keepDelay)
			case p.err != nil:
				e.ctr.handleErrors.Add(1)
				delay := time.Second
				switch {
				case errors.Is(p.err, schemas.ErrQuarantined):
					delay = 30 * time.Second // a person must act first
				case errors.Is(p.err, errPanicked):
					delay = e.store.Config.InboxAckWait // a bug: try again, not in a loop
				}
				_ = it.msg.NakWithDelay(delay)
			default:
				_ = it.msg.Ack()
			}
		}
		if p.err != nil {
			switch {
			case kv.IsStorageFull(p.err):
				e.ctr.storageFull.Add(1)
				if e.quiet.allow("storage/"+p.job, e.cfg.Now()) {
					e.log.Warn("JetStream storage is full: the job waits, its messages kept, until space is freed", "job", p.job, "err", p.err)
				}
			case errors.Is(p.err, schemas.ErrQuarantined):
				e.ctr.quarantined.Add(1)
				if e.quiet.allow("quarantine/"+p.job, e.cfg.Now()) {
					e.log.Error("job quarantined: its checkpoint cannot be trusted; fix or delete it by hand", "job", p.job, "err", p.err)
				}
			case e.quiet.allow("error/"+p.job, e.cfg.Now()):
				e.log.Warn("inbox messages left for redelivery", "job", p.job, "err", p.err)
			}
		}
	}
}
