package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// reconcileLoop runs Reconcile every ReconcileInterval, and SweepJobs
// every SweepInterval, until ctx ends. Recovery is periodic, not a one-shot
// pass at start-up (DESIGN.md, recovery rules); errors are counted and
// logged, and the next pass tries again.
func (e *Engine) reconcileLoop(ctx context.Context, checkQueues func()) {
	t := time.NewTicker(e.cfg.ReconcileInterval)
	defer t.Stop()
	lastSweep := e.cfg.Now().Add(-e.cfg.SweepInterval + e.cfg.ReconcileInterval) // first sweep soon after start
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			checkQueues()
			if err := e.Reconcile(ctx); err != nil && ctx.Err() == nil {
				e.ctr.reconcileErrors.Add(1)
				e.log.Warn("reconcile pass incomplete; retrying next interval", "err", err)
			}
			if now := e.cfg.Now(); now.Sub(lastSweep) >= e.cfg.SweepInterval {
				lastSweep = now
				if err := e.SweepJobs(ctx); err != nil && ctx.Err() == nil {
					e.ctr.reconcileErrors.Add(1)
					e.log.Warn("retention sweep incomplete; retrying later", "err", err)
				}
			}
		}
	}
}

// Reconcile makes one pass over the jobs that may still change: the active
// entries of the job index, never a finished job. For each it reads the
// checkpoint and repairs what a lost message or a crash left:
//
//   - an index entry without a checkpoint older than OrphanGrace (a client
//     died between the two writes that create a job) is removed;
//   - a finished job still indexed as active (an engine died between the
//     terminal checkpoint and the index) gets its final history published
//     and its index entry moved;
//   - a pending job whose start request was lost is started;
//   - a running job whose attempt is overdue is looked up in the work and
//     inbox streams: a step message still queued waits for a worker (or,
//     past its last possible delivery, is a dead letter); a result waiting
//     is left to the inbox; neither means the attempt was lost, and it is
//     declared so (a retryable timeout, or needs_reconciliation when the
//     effect may have happened and no retry is left);
//   - a job waiting on an effect that was resolved meanwhile (the signal
//     was lost) goes on;
//   - a job blocked on its definition goes on once it is stored again;
//   - a dispatch waiting for a flow limit is woken again (its wake-up may
//     have been lost), and the flow bucket's slots whose holders no longer
//     name them are released (reconcileFlow).
//
// Every write is a compare-and-swap on the revision read, so a job that
// moved on meanwhile is left alone. It returns the first error after
// trying every job; each failure is also counted.
func (e *Engine) Reconcile(ctx context.Context) error {
	now := e.cfg.Now()
	var entries []kv.IndexEntry
	if err := e.store.Jobs.Active(ctx, func(ie kv.IndexEntry) bool {
		entries = append(entries, ie)
		return true
	}); err != nil {
		return err
	}
	e.ctr.activeJobs.Store(int64(len(entries)))
	var (
		mu       sync.Mutex
		firstErr error
		oldest   time.Duration
		waiting  atomic.Int64
		wg       sync.WaitGroup
	)
	sem := make(chan struct{}, 16)
	for _, ie := range entries {
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		sem <- struct{}{}
		go func(ie kv.IndexEntry) {
			defer func() { <-sem; wg.Done() }()
			age, w, err := e.reconcileJob(ctx, ie, now)
			mu.Lock()
			defer mu.Unlock()
			oldest = max(oldest, age)
			if w {
				waiting.Add(1)
			}
			if err != nil {
				e.ctr.reconcileErrors.Add(1)
				if firstErr == nil {
					firstErr = err
				}
			}
		}(ie)
	}
	wg.Wait()
	if err := e.reconcileFlow(ctx); err != nil && ctx.Err() == nil {
		e.ctr.reconcileErrors.Add(1)
		if firstErr == nil {
			firstErr = err
		}
	}
	e.ctr.oldestRunning.Store(oldest.Milliseconds())
	e.ctr.waitingForWorkers.Store(waiting.Load())
	return firstErr
}

// reconcileJob handles one active index entry. It returns the age of a
// running job's checkpoint and whether its step waits for a worker.
func (e *Engine) reconcileJob(ctx context.Context, ie kv.IndexEntry, now time.Time) (age time.Duration, waiting bool, err error) {
	ent, err := e.store.Checkpoints.Get(ctx, ie.Job)
	switch {
	case errors.Is(err, schemas.ErrNotFound):
		if now.Sub(ie.CreatedAt) <= e.cfg.OrphanGrace {
			return 0, false, nil // its client may still be writing the checkpoint
		}
		if err := e.store.Jobs.Remove(ctx, ie.Key, ie.Revision); err != nil {
			return 0, false, fmt.Errorf("reconcile job %s: remove its orphan index entry: %w", ie.Job, err)
		}
		e.ctr.indexRepaired.Add(1)
		e.log.Info("removed an index entry whose job was never created (its client died between the two writes)", "job", ie.Job)
		return 0, false, nil
	case errors.Is(err, schemas.ErrQuarantined):
		e.ctr.quarantined.Add(1)
		if e.quiet.allow("quarantine/"+ie.Job, now) {
			e.log.Error("job quarantined: its checkpoint cannot be trusted; fix or delete it by hand", "job", ie.Job, "err", err)
		}
		return 0, false, nil
	case err != nil:
		return 0, false, fmt.Errorf("reconcile job %s: %w", ie.Job, err)
	}
	cp := ent.Checkpoint
	if ie.Key != kv.ActiveKey(cp.Workflow, cp.JobID) {
		// A start of the id under another workflow that lost to the job
		// stored (a client that died before it took its entry back).
		if err := e.store.Jobs.Remove(ctx, ie.Key, ie.Revision); err != nil {
			return 0, false, fmt.Errorf("reconcile job %s: remove the index entry %s of another workflow: %w", ie.Job, ie.Key, err)
		}
		e.ctr.indexRepaired.Add(1)
		e.log.Info("removed an index entry that names another workflow than the job's", "job", ie.Job, "entry", ie.Key, "workflow", cp.Workflow)
		return 0, false, nil
	}
	if at := cp.DeadlineAt; at != nil && !cp.Status.Terminal() && now.After(at.Add(timerGrace+2*e.store.Config.InboxAckWait)) {
		// Its deadline's timer did not come (or came early by this clock).
		e.log.Warn("a job's deadline passed and its timer did not stop it: stopping it", "job", cp.JobID, "deadline", at)
		if err := e.store.SendSignal(ctx, schemas.Signal{Job: cp.JobID, Type: schemas.SignalJobDeadline, By: "the job's deadline", At: *at},
			cp.MsgPrefix()+"/deadline/"+now.UTC().Format(time.RFC3339)); err != nil {
			return 0, false, fmt.Errorf("reconcile job %s: %w", cp.JobID, err)
		}
	}
	switch cp.Status {
	case schemas.JobCompleted, schemas.JobFailed, schemas.JobCancelled:
		return 0, false, e.finishEnded(ctx, ent, ie.Revision)
	case schemas.JobPending:
		if now.Sub(cp.UpdatedAt) > e.cfg.ReconcileInterval {
			return 0, false, e.startPending(ctx, ent, now)
		}
	case schemas.JobRunning:
		age = now.Sub(cp.UpdatedAt)
		if cp.Fan != nil {
			// A parallel step's branches that are child jobs.
			for _, d := range cp.Fan.Running {
				if d.Child != "" {
					if err := e.checkChild(ctx, cp, d, now); err != nil {
						return age, false, err
					}
				}
			}
		}
		if waitingFlow(cp) {
			// Recorded, not published: a wake-up may have been lost.
			if err := e.nudgeWaiting(ctx, cp, now); err != nil {
				return age, false, fmt.Errorf("reconcile job %s: %w", cp.JobID, err)
			}
		}
		if cp.Current == nil || cp.Current.Held || cp.Current.Waiting != nil || (cp.Current.Wait != "" && cp.Current.Due == nil) {
			return age, false, nil
		}
		if cp.Current.Due != nil {
			return age, false, e.checkSleep(ctx, cp, now)
		}
		if cp.Current.Child != "" {
			return age, false, e.checkChild(ctx, cp, cp.Current, now)
		}
		waiting, err = e.checkOverdue(ctx, ent, now)
		return age, waiting, err
	case schemas.JobWaitingApproval:
		return 0, false, e.checkGate(ctx, cp, now)
	case schemas.JobNeedsReconciliation:
		return 0, false, e.resumeResolved(ctx, ent, now)
	case schemas.JobBlocked:
		return 0, false, e.unblockDefinition(ctx, ent, now)
	}
	return 0, false, nil
}

// timerGrace is how long past its due time a timer may take to arrive
// before the reconciler delivers it itself.
const timerGrace = time.Minute

// checkSleep delivers the result of cp's sleep whose timer is overdue by
// timerGrace (its schedule lost, say): the dedup id is the timer's, and a
// second copy is stale.
func (e *Engine) checkSleep(ctx context.Context, cp *schemas.Checkpoint, now time.Time) error {
	d := cp.Current
	if now.Before(d.Due.Add(timerGrace + 2*e.store.Config.InboxAckWait)) {
		return nil
	}
	if d.Wait != "" {
		e.log.Warn("a wait's timeout did not fire: delivering it", "job", cp.JobID, "step", d.Step, "due", d.Due)
		return e.store.SendSignal(ctx, schemas.Signal{Job: cp.JobID, Type: schemas.SignalWaitTimeout, Key: d.MsgID, By: "the wait's timeout", At: *d.Due}, d.MsgID+"/timeout")
	}
	out, _ := json.Marshal(map[string]int64{"slept_ms": d.Due.Sub(d.DispatchedAt).Milliseconds()})
	e.log.Warn("a sleep's timer did not fire: delivering it", "job", cp.JobID, "step", d.Step, "due", d.Due)
	return e.sendResult(ctx, &schemas.StepResult{Job: cp.JobID, Step: d.Step, Attempt: d.Attempt, Output: out}, d.MsgID)
}

// checkGate expires cp's open gate whose expiry timer is overdue by
// timerGrace.
func (e *Engine) checkGate(ctx context.Context, cp *schemas.Checkpoint, now time.Time) error {
	if cp.Current == nil || cp.Current.Gate == "" {
		return nil
	}
	a := cp.ApprovalByID(cp.Current.Gate)
	if a == nil || a.ExpiresAt == nil || now.Before(a.ExpiresAt.Add(timerGrace+2*e.store.Config.InboxAckWait)) {
		return nil
	}
	e.log.Warn("an approval's expiry timer did not fire: expiring it", "job", cp.JobID, "gate", a.ID)
	return e.store.SendSignal(ctx, schemas.Signal{Job: cp.JobID, Type: schemas.SignalApprovalExpired, Key: a.ID, By: "the gate's expiry", At: *a.ExpiresAt},
		cp.MsgPrefix()+"/expire/"+a.ID)
}

// finishEnded completes what the engine that finished a job could not:
// its last events stored, its index entry moved to ended.
func (e *Engine) finishEnded(ctx context.Context, ent kv.Entry, activeRev uint64) error {
	cp := ent.Checkpoint
	if len(cp.Events) > 0 {
		last, err := e.store.History.LastSeq(ctx, cp.JobID)
		if err != nil {
			return fmt.Errorf("reconcile job %s: %w", cp.JobID, err)
		}
		if last < cp.Seq {
			f, err := e.publishOutbox(cp)
			if err == nil {
				wctx, cancel := context.WithTimeout(ctx, e.cfg.PublishTimeout)
				err = waitAll(wctx, []jetstream.PubAckFuture{f})
				cancel()
			}
			if err != nil {
				return fmt.Errorf("reconcile job %s: publish its final history: %w", cp.JobID, err)
			}
			e.ctr.historyRepublished.Add(1)
		}
	}
	if err := e.store.Jobs.End(ctx, cp, activeRev); err != nil {
		return fmt.Errorf("reconcile job %s: %w", cp.JobID, err)
	}
	e.ctr.indexRepaired.Add(1)
	e.log.Info("finished indexing a job whose engine stopped before it could", "job", cp.JobID, "status", cp.Status)
	return nil
}

// checkOverdue declares a running job's attempt lost when the facts say
// so; see Reconcile. It reports whether the step waits for a worker.
func (e *Engine) checkOverdue(ctx context.Context, ent kv.Entry, now time.Time) (waiting bool, err error) {
	cp := ent.Checkpoint
	cur := cp.Current
	def, err := e.store.Definitions.Get(ctx, cp.DefinitionHash)
	if err != nil {
		if errors.Is(err, schemas.ErrNotFound) {
			return false, nil // the next message of the job blocks it
		}
		return false, fmt.Errorf("reconcile job %s: %w", cp.JobID, err)
	}
	s := def.Step(cur.Step)
	if s == nil {
		return false, nil
	}
	from := cur.DispatchedAt
	if nb := cur.NotBefore; nb != nil && nb.After(from) {
		from = *nb
	}
	timeout := def.TimeoutOf(s)
	ackWait := e.store.Config.WorkAckWait
	if now.Before(from.Add(timeout + 2*ackWait + e.cfg.StallGrace)) {
		return false, nil
	}
	facts, err := e.dispatchFacts(ctx, cp)
	if err != nil {
		return false, fmt.Errorf("reconcile job %s: %w", cp.JobID, err)
	}
	switch {
	case facts.answered:
		return false, nil // its result waits in the inbox
	case facts.queued:
		if md := e.store.Config.WorkMaxDeliver; md > 0 {
			// Every delivery lasts at most the step's timeout plus a lease;
			// past the last one the message is never delivered again.
			horizon := time.Duration(md) * (timeout + ackWait)
			if now.Sub(facts.stored) > horizon+e.cfg.StallGrace {
				return false, e.deadLetterStep(ctx, cp.JobID, cur.Step, cur.Attempt, cur.Item, cur.MsgID, cur.EffectKey, facts.seq, uint64(md),
					"its message reached the pool's last delivery and no engine heard of it")
			}
		}
		if e.quiet.allow("waiting/"+cp.JobID, now) {
			e.log.Warn("step waits for a worker of its pool", "job", cp.JobID, "step", cur.Step, "pool", cur.Pool,
				"waited", now.Sub(from).Round(time.Second))
		}
		return true, nil
	}
	return false, e.loseAttempt(ctx, ent, now)
}

// dispatchState is what the streams say of a job's current dispatch.
type dispatchState struct {
	queued   bool // its step message is in the work stream
	seq      uint64
	stored   time.Time
	answered bool // its result is in the inbox
}

// dispatchFacts looks cp's current dispatch up: first in the work stream,
// then in the inbox. The order matters: a worker publishes its result
// before it acknowledges the step message, so "not queued, not answered"
// read in this order means the result was never published (or was applied
// since, which the compare-and-swap of whatever the caller writes finds).
func (e *Engine) dispatchFacts(ctx context.Context, cp *schemas.Checkpoint) (dispatchState, error) {
	cur := cp.Current
	var f dispatchState
	q, ok, err := e.store.Queues.StepQueued(ctx, cur.Pool, cp.JobID)
	if err != nil {
		return f, err
	}
	if ok && q.Attempt == cur.Attempt {
		f.queued, f.seq, f.stored = true, q.Seq, q.Stored
		return f, nil
	}
	f.answered, err = e.store.Queues.ResultWaiting(ctx, cp.JobID, cur.Step, cur.Attempt)
	return f, err
}

// effectState reads the ledger state of key ("" for pure steps).
func (e *Engine) effectState(ctx context.Context, key string) (schemas.EffectState, error) {
	if key == "" {
		return "", nil
	}
	ent, err := e.store.Effects.Get(ctx, key)
	if errors.Is(err, schemas.ErrNotFound) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read effect %s: %w", key, err)
	}
	return ent.Record.State, nil
}

func (e *Engine) loseAttempt(ctx context.Context, ent kv.Entry, now time.Time) error {
	cur := ent.Checkpoint.Current
	state, err := e.effectState(ctx, cur.EffectKey)
	if err != nil {
		return fmt.Errorf("reconcile job %s: %w", ent.Checkpoint.JobID, err)
	}
	waited := now.Sub(cur.DispatchedAt).Round(time.Millisecond)
	written, err := e.transitionOne(ctx, ent, "reconcile/"+cur.MsgID, now, func(c *compiled, next *schemas.Checkpoint) []event {
		res := &schemas.StepResult{Job: next.JobID, Step: cur.Step, Attempt: cur.Attempt, EffectKey: cur.EffectKey, EffectState: state,
			Error: &schemas.Error{
				Code: schemas.CodeTimeout, Retryable: true,
				Message: fmt.Sprintf("no result %v after dispatch, and neither its step message nor its result is in the streams: the attempt is declared lost", waited),
			}}
		_, evs := applyResult(c, next, res, now)
		return evs
	})
	if written {
		e.ctr.lost.Add(1)
		e.log.Warn("declared attempt lost", "job", ent.Checkpoint.JobID, "step", cur.Step, "attempt", cur.Attempt, "waited", waited)
	}
	return err
}

// startPending starts a job its client created but no engine started (the
// start request was lost), with a compare-and-swap on the revision read.
func (e *Engine) startPending(ctx context.Context, ent kv.Entry, now time.Time) error {
	// The cause is not the start request's id: that request, if it arrives
	// after all, must read as a late duplicate, not as a redelivery to act
	// on again.
	written, err := e.transitionOne(ctx, ent, "reconcile/start", now, func(c *compiled, next *schemas.Checkpoint) []event {
		return startJob(c, next, now)
	})
	if written {
		e.ctr.jobsStarted.Add(1)
		e.log.Info("started a pending job whose start request was lost", "job", ent.Checkpoint.JobID)
	}
	return err
}

// resumeResolved unblocks a job whose effect was resolved while the signal
// that says so was lost, or was settled by a late answer.
func (e *Engine) resumeResolved(ctx context.Context, ent kv.Entry, now time.Time) error {
	b := ent.Checkpoint.Blocked
	if b == nil {
		return nil
	}
	eff, err := e.store.Effects.Get(ctx, b.EffectKey)
	if errors.Is(err, schemas.ErrNotFound) {
		return nil // nothing to resolve yet: a person decides
	}
	if err != nil {
		return fmt.Errorf("reconcile job %s: %w", ent.Checkpoint.JobID, err)
	}
	if r := eff.Record; r.State != schemas.EffectReconciled && r.State != schemas.EffectConfirmed {
		return nil // still waiting for a person
	}
	by := eff.Record.ReconciledBy
	_, err = e.transitionOne(ctx, ent, "reconcile/resolved/"+b.EffectKey, now, func(c *compiled, next *schemas.Checkpoint) []event {
		_, evs := applySignal(c, next, &schemas.Signal{Job: next.JobID, Type: schemas.SignalEffectResolved, Key: b.EffectKey, By: by}, now)
		return evs
	})
	return err
}

// unblockDefinition lets a job blocked on its definition go on once the
// definition can be loaded again; its kept messages then apply as usual.
func (e *Engine) unblockDefinition(ctx context.Context, ent kv.Entry, now time.Time) error {
	cp := ent.Checkpoint
	if _, err := e.store.Definitions.Get(ctx, cp.DefinitionHash); err != nil {
		if errors.Is(err, schemas.ErrNotFound) || errors.Is(err, schemas.ErrDefinitionInvalid) {
			return nil // still missing
		}
		return fmt.Errorf("reconcile job %s: %w", cp.JobID, err)
	}
	written, err := e.transitionOne(ctx, ent, "reconcile/unblocked", now, func(c *compiled, next *schemas.Checkpoint) []event {
		if next.Status != schemas.JobBlocked {
			return nil
		}
		evs := []event{unblockJob(next)}
		if next.Status == schemas.JobPending {
			evs = append(evs, startJob(c, next, now)...)
		}
		return evs
	})
	if written {
		e.ctr.definitionUnblocked.Add(1)
		e.log.Info("job unblocked: its definition can be loaded again", "job", cp.JobID)
	}
	return err
}

// transitionOne writes one transition that the engine decided by itself
// (the reconciler, a requeue) rather than from an inbox message: apply
// changes a copy of ent's checkpoint and returns its events (none: nothing
// to write). Like every transition, it first makes sure the checkpoint's
// own events are stored, and writes with a compare-and-swap on ent's
// revision; a job that moved on meanwhile is left alone (written false, no
// error). Then the dispatch, if any, and the events are published; err is
// the first failure of the write or the publications.
func (e *Engine) transitionOne(ctx context.Context, ent kv.Entry, cause string, now time.Time,
	apply func(c *compiled, next *schemas.Checkpoint) []event) (written bool, err error) {
	cp := ent.Checkpoint
	base := &cached{cp: cp, rev: ent.Revision, size: ent.Size}
	if cp.Flush {
		last, err := e.store.History.LastSeq(ctx, cp.JobID)
		if err != nil {
			return false, err
		}
		base.published.Store(last)
	}
	p := &plan{job: cp.JobID, base: base, fresh: true}
	if err := e.definition(ctx, p, cp.DefinitionHash); err != nil {
		return false, err
	}
	if err := checkConsistent(p.def, cp); err != nil {
		return false, err
	}
	next := cloneCheckpoint(cp)
	next.Events = nil
	evs := apply(p.def, next)
	if len(evs) == 0 {
		return false, nil
	}
	next.Seq, next.UpdatedAt, next.Writer, next.Cause = cp.Seq+1, now, e.incarnation, cause
	e.setOutbox(cp, next, evs, now)
	p.next = next
	p.sends = newDispatches(cp, next)
	p.dispatch = len(p.sends) > 0
	if next.Status == schemas.JobNeedsReconciliation && cp.Status != schemas.JobNeedsReconciliation && next.Blocked != nil {
		p.markAmbiguous = []string{next.Blocked.EffectKey}
	}
	e.storeOutboxes(ctx, []*plan{p})
	if p.err != nil {
		return false, p.err
	}
	if conflicts := e.write(ctx, []*plan{p}); len(conflicts) > 0 || p.err != nil {
		return false, p.err
	}
	e.finish(ctx, e.startPublish(ctx, []*plan{p}))
	return true, p.err
}
