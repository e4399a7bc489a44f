package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Requeue dispatches again, from the checkpoints, the step messages that
// lost queues held: the current step of every running job dispatched
// before lostAt whose step message is not in the work stream, whose
// result is not in the inbox, and for which the inbox holds nothing else
// (a redelivered message brings the engine that takes it to the job).
// Memory queues lose everything in a server restart; what a worker
// published into the new queues since is left alone. A dispatch is looked
// at only once PublishGrace has passed since it was recorded, so that a
// live engine's publication under way is not taken for a loss. The step
// goes under a new attempt number (a late result of the old attempt is
// dropped as stale, and its worker is fenced out of the ledger) without
// using up a retry. Pure and idempotent steps are dispatched at once:
// running them twice is safe. Lookup and unsafe steps whose effect the
// ledger records as dispatched wait until the old attempt must have
// ended, lostAt plus the step's timeout plus StallGrace: asking the
// provider whether the effect happened, or declaring it ambiguous, while
// the first call may still be under way would be wrong. Without such a
// record no call was made, and they go at once. Jobs blocked on an effect that was resolved meanwhile
// (the signal was lost too) are resumed. It reads only the jobs the index
// lists as active. It returns how many jobs still wait for their turn, and
// the first error.
func (e *Engine) Requeue(ctx context.Context, lostAt time.Time) (waiting int, err error) {
	now := e.cfg.Now()
	var due, blocked []kv.Entry
	fans := map[string][]string{} // job -> message ids of fan dispatches to send again
	var fanEnts []kv.Entry
	var firstErr error
	note := func(err error) {
		if err != nil && firstErr == nil {
			firstErr = err
		}
	}
	err = e.store.Jobs.Active(ctx, func(ie kv.IndexEntry) bool {
		ent, err := e.store.Checkpoints.Get(ctx, ie.Job)
		switch {
		case errors.Is(err, schemas.ErrNotFound), errors.Is(err, schemas.ErrQuarantined):
			return true // the reconciler sees to them
		case err != nil:
			note(fmt.Errorf("requeue job %s: %w", ie.Job, err))
			return true
		}
		cp := ent.Checkpoint
		switch {
		case cp.Status == schemas.JobRunning && cp.Current != nil && cp.Current.DispatchedAt.Before(lostAt) &&
			!cp.Current.Held && cp.Current.Waiting == nil && cp.Current.Due == nil && cp.Current.Wait == "": // held or waiting: not sent; timers and waits are not in the queues
			if now.Before(cp.Current.DispatchedAt.Add(PublishGrace)) {
				waiting++ // its publication may still be under way
				return true
			}
			if missing, err := e.queuesLost(ctx, cp); err != nil || !missing {
				note(err)
				return true
			}
			def, err := e.store.Definitions.Get(ctx, cp.DefinitionHash)
			if err != nil {
				note(fmt.Errorf("requeue job %s: %w", ie.Job, err))
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
				// Only a call under way must be waited for: the ledger says
				// dispatched. With no record, or one only prepared, no call
				// was made (the next attempt fences out any worker still
				// about to make one); a confirmed one is replayed.
				state, err := e.effectState(ctx, cp.Current.EffectKey)
				if err != nil {
					note(err)
					return true
				}
				if state == schemas.EffectDispatched && now.Before(lostAt.Add(def.TimeoutOf(s)+e.cfg.StallGrace)) {
					waiting++
					return true
				}
				due = append(due, ent)
			}
		case cp.Fan != nil && (cp.Status == schemas.JobRunning || cp.Status == schemas.JobNeedsReconciliation):
			ids, wait, err := e.lostFanDispatches(ctx, cp, lostAt, now)
			waiting += wait
			note(err)
			if len(ids) > 0 {
				fans[cp.JobID] = ids
				fanEnts = append(fanEnts, ent)
			}
			if cp.Status == schemas.JobNeedsReconciliation && cp.Blocked != nil {
				blocked = append(blocked, ent)
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
		note(e.redispatchLostQueue(ctx, ent, now))
	}
	for _, ent := range fanEnts {
		note(e.redispatchLostFan(ctx, ent, fans[ent.Checkpoint.JobID], now))
	}
	for _, ent := range blocked {
		note(e.resumeResolved(ctx, ent, now))
	}
	return waiting, firstErr
}

// PublishGrace is how long after a dispatch is recorded its step message
// must be in the work stream (an engine publishes it right after the
// checkpoint) before Requeue takes its absence for a loss.
const PublishGrace = 2 * time.Second

// queuesLost reports whether cp's current dispatch left nothing in the
// queues: no inbox message for the job, no step message of its attempt,
// no result of it. The order of the reads makes the answer safe while
// engines and workers go on: an engine publishes a dispatch before it
// acknowledges the inbox message that caused it, and a worker publishes a
// result before it acknowledges the step message, so each read finds what
// the one before it saw leave.
func (e *Engine) queuesLost(ctx context.Context, cp *schemas.Checkpoint) (bool, error) {
	pending, err := e.store.Queues.InboxPending(ctx, cp.JobID)
	if err != nil || pending {
		return false, err
	}
	missing, err := e.dispatchMissing(ctx, cp)
	if err != nil {
		return false, fmt.Errorf("requeue job %s: %w", cp.JobID, err)
	}
	return missing, nil
}

// redispatchLostQueue writes a new attempt of a running job's current step
// whose message was lost, and publishes it. A job that moved on meanwhile
// is left alone.
func (e *Engine) redispatchLostQueue(ctx context.Context, ent kv.Entry, now time.Time) error {
	written, err := e.transitionOne(ctx, ent, "requeue/"+ent.Checkpoint.Current.MsgID, now, func(_ *compiled, next *schemas.Checkpoint) []event {
		return []event{redispatchLost(next, now)}
	})
	if written && err == nil {
		e.ctr.requeued.Add(1)
	}
	return err
}

// lostFanDispatches returns the message ids of the fan dispatches of cp
// recorded before lostAt that the lost queues held, and how many must
// still wait for their turn. A fan's dispatches share the job's work
// subject, so the streams cannot say which message is there: every
// dispatch recorded before the loss is taken as lost (a copy of one still
// queued is harmless: the worker's fencing and the ledger see to it),
// unless the inbox holds something for the job, whose engine decides
// first. Lookup and unsafe dispatches whose effect the ledger records as
// dispatched wait as Requeue says.
func (e *Engine) lostFanDispatches(ctx context.Context, cp *schemas.Checkpoint, lostAt, now time.Time) (ids []string, waiting int, err error) {
	var old []*schemas.Dispatch
	for _, d := range cp.Fan.Running {
		if !d.DispatchedAt.Before(lostAt) || d.Held || d.Waiting != nil {
			continue
		}
		if now.Before(d.DispatchedAt.Add(PublishGrace)) {
			waiting++
			continue
		}
		old = append(old, d)
	}
	if len(old) == 0 {
		return nil, waiting, nil
	}
	pending, err := e.store.Queues.InboxPending(ctx, cp.JobID)
	if err != nil || pending {
		return nil, waiting, err
	}
	def, err := e.store.Definitions.Get(ctx, cp.DefinitionHash)
	if err != nil {
		return nil, waiting, fmt.Errorf("requeue job %s: %w", cp.JobID, err)
	}
	for _, d := range old {
		s := def.Step(d.Step)
		if s == nil {
			continue
		}
		switch def.EffectOf(s) {
		case schemas.EffectPure, schemas.EffectIdempotent:
		default:
			state, err := e.effectState(ctx, d.EffectKey)
			if err != nil {
				return nil, waiting, err
			}
			if state == schemas.EffectDispatched && now.Before(lostAt.Add(def.TimeoutOf(s)+e.cfg.StallGrace)) {
				waiting++
				continue
			}
		}
		ids = append(ids, d.MsgID)
	}
	return ids, waiting, nil
}

// redispatchLostFan gives each of the fan dispatches ids (still in flight
// when the transition is written) a new attempt and message id, without
// using up a retry, and publishes them.
func (e *Engine) redispatchLostFan(ctx context.Context, ent kv.Entry, ids []string, now time.Time) error {
	written, err := e.transitionOne(ctx, ent, "requeue/"+ids[0], now, func(c *compiled, next *schemas.Checkpoint) []event {
		if next.Fan == nil {
			return nil
		}
		var evs []event
		for i, d := range next.Fan.Running {
			if !slices.Contains(ids, d.MsgID) {
				continue
			}
			nd := *d
			nd.Attempt++
			nd.DispatchedAt = now
			if nd.Item > 0 {
				nd.MsgID = schemas.ItemMsgID(next.MsgPrefix(), nd.Step, next.Fan.Run, nd.Item, nd.Attempt)
			} else {
				rec := next.Steps[nd.Step]
				if rec == nil {
					continue
				}
				rec.Attempts++
				nd.Attempt = rec.Attempts
				nd.MsgID = schemas.StepMsgID(next.MsgPrefix(), nd.Step, nd.Attempt)
			}
			next.Fan.Running[i] = &nd
			evs = append(evs, event{typ: schemas.EventStepDispatched, data: schemas.HistoryData{Job: next.JobID, Step: nd.Step, Attempt: nd.Attempt, Item: nd.Item,
				Status: string(schemas.StepDispatched), Reason: "its message was lost with the queues (a server restart with memory queues): dispatched again"}})
		}
		return evs
	})
	if written && err == nil {
		e.ctr.requeued.Add(1)
	}
	return err
}
