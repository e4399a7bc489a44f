package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// reconcileLoop runs Reconcile every ReconcileInterval until ctx ends.
// Recovery is periodic, not a one-shot pass at start-up (DESIGN.md,
// recovery rules); errors are counted and logged, and the next pass tries
// again.
func (e *Engine) reconcileLoop(ctx context.Context, checkQueues func()) {
	t := time.NewTicker(e.cfg.ReconcileInterval)
	defer t.Stop()
	var lastSweep time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			checkQueues()
			if err := e.Reconcile(ctx); err != nil && ctx.Err() == nil {
				e.ctr.reconcileErrors.Add(1)
				e.log.Warn("reconcile pass failed; retrying next interval", "err", err)
			}
			if now := e.cfg.Now(); now.Sub(lastSweep) >= e.cfg.EffectSweepInterval {
				lastSweep = now
				if err := e.SweepEffects(ctx); err != nil && ctx.Err() == nil {
					e.ctr.reconcileErrors.Add(1)
					e.log.Warn("effect sweep failed; retrying later", "err", err)
				}
			}
		}
	}
}

// SweepEffects removes effect records whose job ended more than the
// layout's EffectRetention ago (or whose job no longer exists and which
// have not changed for that long). Records of jobs that have not ended are
// kept, however old: the ledger outlives the duplicate window for the
// job's whole life (DESIGN.md invariant 5).
func (e *Engine) SweepEffects(ctx context.Context) error {
	now := e.cfg.Now()
	keep := e.store.Config.EffectRetention
	ended := map[string]*time.Time{} // job → when it ended; nil: running
	gone := map[string]bool{}
	var doomed []string
	var firstErr error
	err := e.store.Effects.List(ctx, func(ent kv.EffectEntry) bool {
		r := ent.Record
		when, seen := ended[r.Job]
		if !seen && !gone[r.Job] {
			got, err := e.store.Checkpoints.Get(ctx, r.Job)
			switch {
			case errors.Is(err, schemas.ErrNotFound):
				gone[r.Job] = true
			case err != nil:
				if firstErr == nil && !errors.Is(err, schemas.ErrQuarantined) {
					firstErr = err
				}
				ended[r.Job] = nil
			default:
				if got.Checkpoint.Status.Terminal() {
					when = got.Checkpoint.CompletedAt
				}
				ended[r.Job] = when
			}
		}
		switch {
		case gone[r.Job] && now.Sub(r.UpdatedAt) > keep:
			doomed = append(doomed, r.Key)
		case when != nil && now.Sub(*when) > keep:
			doomed = append(doomed, r.Key)
		}
		return true
	})
	if err != nil {
		return err
	}
	for _, k := range doomed {
		if err := e.store.Effects.Delete(ctx, k); err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		e.ctr.swept.Add(1)
	}
	return firstErr
}

// Reconcile makes one pass over the running jobs and declares lost every
// attempt whose result is overdue: no result within the step's timeout,
// twice the work ack wait and StallGrace after it was dispatched (or after
// its retry delay). A lost attempt counts as a retryable timeout: the step
// is attempted again with a new attempt number under its retry policy, and
// a late result of the lost attempt is dropped as stale. Every write is a
// compare-and-swap on the revision read, so a job that moved on meanwhile
// is left alone. It returns the first error after trying every job.
func (e *Engine) Reconcile(ctx context.Context) error {
	now := e.cfg.Now()
	var firstErr error
	var overdue, pending []kv.Entry
	var oldest time.Duration
	err := e.store.Checkpoints.List(ctx, func(job string, ent kv.Entry, err error) bool {
		if err != nil {
			if firstErr == nil && !errors.Is(err, schemas.ErrQuarantined) {
				firstErr = err
			}
			return true
		}
		cp := ent.Checkpoint
		if cp.Status == schemas.JobRunning {
			oldest = max(oldest, now.Sub(cp.UpdatedAt))
		}
		if cp.Status == schemas.JobPending && now.Sub(cp.UpdatedAt) > e.cfg.ReconcileInterval {
			// Its client stored it and then its start request was lost.
			pending = append(pending, ent)
			return true
		}
		if cp.Status != schemas.JobRunning || cp.Current == nil {
			return true
		}
		def, err := e.store.Definitions.Get(ctx, cp.DefinitionHash)
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("reconcile job %s: %w", job, err)
			}
			return true
		}
		s := def.Step(cp.Current.Step)
		if s == nil {
			return true
		}
		from := cp.Current.DispatchedAt
		if nb := cp.Current.NotBefore; nb != nil && nb.After(from) {
			from = *nb
		}
		deadline := from.Add(def.TimeoutOf(s) + 2*e.store.Config.WorkAckWait + e.cfg.StallGrace)
		if now.After(deadline) {
			overdue = append(overdue, ent)
		}
		return true
	})
	if err != nil {
		return err
	}
	e.ctr.oldestRunning.Store(oldest.Milliseconds())
	for _, ent := range pending {
		if err := e.startPending(ctx, ent, now); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	waiting := map[string]bool{} // pool → its queue holds undelivered messages
	for _, ent := range overdue {
		pool := ent.Checkpoint.Current.Pool
		w, checked := waiting[pool]
		if !checked {
			w = e.poolBacklogged(ctx, pool)
			waiting[pool] = w
		}
		if w {
			// The step message is most likely still queued, waiting for a
			// worker of its pool: not lost, and not worth an attempt.
			e.log.Warn("step waits for a worker of its pool", "job", ent.Checkpoint.JobID, "step", ent.Checkpoint.Current.Step, "pool", pool)
			continue
		}
		if err := e.loseAttempt(ctx, ent, now); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	return firstErr
}

func (e *Engine) loseAttempt(ctx context.Context, ent kv.Entry, now time.Time) error {
	cur := ent.Checkpoint.Current
	waited := now.Sub(cur.DispatchedAt).Round(time.Millisecond)
	written, err := e.transitionOne(ctx, ent, "reconcile/"+cur.MsgID, now, true, func(c *compiled, next *schemas.Checkpoint) []event {
		res := &schemas.StepResult{Job: next.JobID, Step: cur.Step, Attempt: cur.Attempt, Error: &schemas.Error{
			Code: schemas.CodeTimeout, Retryable: true,
			Message: fmt.Sprintf("no result %v after dispatch: the attempt is declared lost", waited),
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

// poolBacklogged reports whether pool's queue may still hold undelivered
// step messages: no worker has ever served the pool (its consumer does not
// exist), or its consumer has messages not yet delivered. An error counts
// as backlogged: losing an attempt needs certainty.
func (e *Engine) poolBacklogged(ctx context.Context, pool string) bool {
	c, err := e.store.JS.Consumer(ctx, e.store.Names.WorkStream, e.store.Names.WorkConsumer(pool))
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return true
	}
	if err != nil {
		return true
	}
	info, err := c.Info(ctx)
	if err != nil {
		return true
	}
	return info.NumPending > 0
}

// startPending starts a job its client created but no engine started (the
// start request was lost), with a compare-and-swap on the revision read.
func (e *Engine) startPending(ctx context.Context, ent kv.Entry, now time.Time) error {
	// The cause is not the start request's id: that request, if it arrives
	// after all, must read as a late duplicate, not as a redelivery to act
	// on again.
	written, err := e.transitionOne(ctx, ent, "reconcile/start", now, false, func(c *compiled, next *schemas.Checkpoint) []event {
		return startJob(c, next, now)
	})
	if written {
		e.ctr.jobsStarted.Add(1)
		e.log.Info("started a pending job whose start request was lost", "job", ent.Checkpoint.JobID)
	}
	return err
}

// transitionOne writes one transition that the engine decided by itself
// (the reconciler, a requeue) rather than from an inbox message: apply
// changes a copy of ent's checkpoint and returns its events (none: nothing
// to write). The write is a compare-and-swap on ent's revision; a job that
// moved on meanwhile is left alone (written false, no error). Then the
// dispatch, if any, and, with flush, the events are published; err is the
// first failure of the write or the publications.
func (e *Engine) transitionOne(ctx context.Context, ent kv.Entry, cause string, now time.Time, flush bool,
	apply func(c *compiled, next *schemas.Checkpoint) []event) (written bool, err error) {
	cp := ent.Checkpoint
	p := &plan{job: cp.JobID, base: &cached{cp: cp, rev: ent.Revision}, fresh: true}
	if err := e.definition(ctx, p, cp.DefinitionHash); err != nil {
		return false, err
	}
	next := cloneCheckpoint(cp)
	evs := apply(p.def, next)
	if len(evs) == 0 {
		return false, nil
	}
	next.Seq, next.UpdatedAt, next.Writer, next.Cause = cp.Seq+1, now, e.incarnation, cause
	next.Events = append(next.Events, stamp(evs, next.Seq, now)...)
	p.next, p.dispatch, p.flush = next, next.Current != nil, flush
	if conflicts := e.write(ctx, []*plan{p}); len(conflicts) > 0 || p.err != nil {
		return false, p.err
	}
	e.finishPublish(ctx, e.startPublish([]*plan{p}))
	return true, p.err
}

// Requeue dispatches again, from the checkpoints, the step messages that
// lost queues held: the current step of every running job dispatched
// before lostAt, under a new attempt number (a late result of the old
// attempt is dropped as stale, and its worker is fenced out of the ledger)
// without using up a retry. Pure and idempotent steps are dispatched at
// once: running them twice is safe. Lookup and unsafe steps wait until the
// old attempt must have ended, lostAt plus the step's timeout plus
// StallGrace: asking the provider whether the effect happened, or
// declaring it ambiguous, while the first call may still be under way
// would be wrong. Jobs blocked on an effect that was resolved meanwhile
// (the signal was lost too) are resumed. It returns how many jobs still
// wait for their turn, and the first error.
func (e *Engine) Requeue(ctx context.Context, lostAt time.Time) (waiting int, err error) {
	now := e.cfg.Now()
	var due, blocked []kv.Entry
	var firstErr error
	err = e.store.Checkpoints.List(ctx, func(job string, ent kv.Entry, err error) bool {
		if err != nil {
			return true
		}
		cp := ent.Checkpoint
		switch {
		case cp.Status == schemas.JobRunning && cp.Current != nil && cp.Current.DispatchedAt.Before(lostAt):
			def, err := e.store.Definitions.Get(ctx, cp.DefinitionHash)
			if err != nil {
				if firstErr == nil {
					firstErr = fmt.Errorf("requeue job %s: %w", job, err)
				}
				return true
			}
			s := def.Step(cp.Current.Step)
			if s == nil {
				return true
			}
			switch def.EffectOf(s) {
			case schemas.EffectPure, schemas.EffectIdempotent:
				due = append(due, ent)
			default:
				if now.Before(lostAt.Add(def.TimeoutOf(s) + e.cfg.StallGrace)) {
					waiting++
					return true
				}
				due = append(due, ent)
			}
		case cp.Status == schemas.JobNeedsReconciliation && cp.Blocked != nil:
			blocked = append(blocked, ent)
		}
		return true
	})
	if err != nil {
		return waiting, err
	}
	for _, ent := range due {
		if err := e.redispatch(ctx, ent, now); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	for _, ent := range blocked {
		if err := e.resumeResolved(ctx, ent, now); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	return waiting, firstErr
}

// redispatch writes a new attempt of a running job's current step whose
// message was lost, and publishes it. A job that moved on meanwhile is
// left alone.
func (e *Engine) redispatch(ctx context.Context, ent kv.Entry, now time.Time) error {
	written, err := e.transitionOne(ctx, ent, "requeue/"+ent.Checkpoint.Current.MsgID, now, false, func(_ *compiled, next *schemas.Checkpoint) []event {
		return []event{redispatchLost(next, now)}
	})
	if written && err == nil {
		e.ctr.requeued.Add(1)
	}
	return err
}

// resumeResolved unblocks a job whose effect was resolved while the signal
// that says so was lost.
func (e *Engine) resumeResolved(ctx context.Context, ent kv.Entry, now time.Time) error {
	key := ent.Checkpoint.Blocked.EffectKey
	eff, err := e.store.Effects.Get(ctx, key)
	if err != nil || eff.Record.State != schemas.EffectReconciled {
		return nil // still waiting for a person
	}
	_, err = e.transitionOne(ctx, ent, "reconcile/resolved/"+key, now, false, func(c *compiled, next *schemas.Checkpoint) []event {
		_, evs := applySignal(c, next, &schemas.Signal{Job: next.JobID, Type: schemas.SignalEffectResolved, Key: key, By: eff.Record.ReconciledBy}, now)
		return evs
	})
	return err
}
