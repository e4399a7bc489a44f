package engine

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/schemas"
)

// decide applies p's messages to its base checkpoint and fills p with
// what to write and publish. It returns true when a message looked stale
// against a cached checkpoint: the caller reloads and decides again, since
// the cache may be behind another engine. It does no I/O but reading the
// definition.
func (e *Engine) decide(ctx context.Context, p *plan) (redo bool) {
	now := e.cfg.Now()
	var cp *schemas.Checkpoint
	if p.base != nil {
		cp = cloneCheckpoint(p.base.cp)
	}
	var evs []event
	changed, republish := false, false
	cause := ""
	// needDef loads the pinned definition. A job whose definition cannot
	// be loaded is blocked (once) and its messages kept until it can.
	needDef := func(hash string) bool {
		err := e.definition(ctx, p, hash)
		if err == nil {
			p.err = nil
			if cp != nil && cp.Status == schemas.JobBlocked && cp.BlockedFrom != "" {
				evs = append(evs, unblockJob(cp))
				changed, cause = true, p.base.cp.Cause
			}
			return true
		}
		var missing *definitionMissing
		if !errors.As(err, &missing) {
			return false // a passing fault: p.err hands the messages back
		}
		p.err = nil
		p.keep, p.keepDelay = true, min(30*time.Second, e.store.Config.InboxAckWait)
		if cp != nil && cp.Status != schemas.JobBlocked && !cp.Status.Terminal() {
			evs = append(evs, blockJob(cp, missing.Error()))
			changed, cause = true, p.base.cp.Cause
			p.tally.definitionBlocked++
		}
		if e.quiet.allow("definition/"+p.job, now) {
			e.log.Warn("job blocked: its definition cannot be loaded; its messages are kept until the definition is stored again", "job", p.job, "err", missing)
		}
		return false
	}
	// A redelivered inbox message means its first handler died or stalled
	// past the ack wait; a redelivered step message, the same of a worker.
	// Either makes this transition a recovery: one resume per plan.
	recovered, workerRecovered := "", false
	// A cancel in the batch is applied first: what came with it (a start,
	// results) then finds the job ended and dispatches nothing.
	slices.SortStableFunc(p.items, func(a, b *inboxItem) int {
		ca, cb := a.signal != nil && a.signal.Type == schemas.SignalCancel, b.signal != nil && b.signal.Type == schemas.SignalCancel
		switch {
		case ca && !cb:
			return -1
		case cb && !ca:
			return 1
		}
		return 0
	})
items:
	for _, it := range p.items {
		if it.done {
			continue
		}
		// A redelivered message that is applied (or is the cause of the
		// current checkpoint) is a recovery; one that turns out stale
		// recovered nothing for the job.
		redelivered := func() {
			// A message handed back by an engine process that then stopped
			// cleanly (it wrote the checkpoint and recorded its stop) was
			// not left behind by a crash.
			handedBack := e.cfg.SoleEngine && p.base != nil && p.base.cp.Writer != e.incarnation && e.cleanStops[p.base.cp.Writer]
			if it.delivered > 1 && recovered == "" && !handedBack {
				recovered = "an inbox message was delivered again: an engine died or stalled before finishing it"
			}
		}
		// The message that produced the checkpoint, seen again: its first
		// handler died (or stalled) after writing, maybe before publishing.
		// The delivery count cannot tell, since a server that crashed too
		// may have forgotten the first delivery; the dedup id can.
		// A client-created job's pending checkpoint names its start request
		// as its cause, before any engine handled it.
		pendingStart := it.start != nil && p.base != nil && (p.base.cp.Status == schemas.JobPending ||
			(p.base.cp.Status == schemas.JobBlocked && p.base.cp.BlockedFrom == schemas.JobPending))
		isCause := p.base != nil && it.msgID == p.base.cp.Cause && !pendingStart
		if isCause && p.conflicted {
			it.handBack = true
			continue
		}
		if isCause {
			if changed {
				p.tally.stale++ // a copy of a message already applied
				continue
			}
			if !p.fresh {
				return true
			}
			republish = true
			continue
		}
		switch {
		case it.start != nil:
			if cp == nil {
				if !needDef(it.start.DefinitionHash) {
					return false // no checkpoint to block: the start stays in the inbox, or a passing fault
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
				redelivered()
				continue
			}
			if cp.Status == schemas.JobPending || (cp.Status == schemas.JobBlocked && cp.BlockedFrom == schemas.JobPending) {
				// Created by its client: start it.
				if !needDef(cp.DefinitionHash) {
					if p.err != nil {
						return false
					}
					break items
				}
				evs = append(evs, startJob(p.def, cp, now)...)
				changed, cause = true, it.msgID
				p.tally.started++
				redelivered()
				continue
			}
			if !p.fresh {
				return true
			}
			// A late duplicate of a start already handled.
		case it.result != nil:
			e.fp.InjectStep(ctx, failpoint.EngineAfterResultReceived, it.result.Step)
			if cp == nil {
				if !changed && !p.leader {
					p.wantLeader = true
					return true
				}
				p.tally.stale++
				e.log.Warn("dropping result for unknown job", "job", it.job, "step", it.result.Step, "attempt", it.result.Attempt)
				continue
			}
			if !resultMayApply(cp, it.result) {
				if !changed && !p.leader {
					// The cache, or a replica behind the leader, may be behind:
					// read again (from the leader) before dropping it.
					p.wantLeader = p.fresh
					return true
				}
				p.tally.stale++
				e.log.Debug("dropping stale result", "job", it.job, "step", it.result.Step, "attempt", it.result.Attempt)
				continue
			}
			if !needDef(cp.DefinitionHash) {
				if p.err != nil {
					return false
				}
				break items
			}
			if err := checkConsistent(p.def, cp); err != nil {
				p.err = err
				return false
			}
			out, resEvs := applyResult(p.def, cp, it.result, now)
			if out == outcomeStale {
				p.tally.stale++
				continue
			}
			redelivered()
			if it.result.Redelivered {
				recovered = "the step message was delivered again: a worker died or stalled past its lease"
				workerRecovered = true
			}
			p.tally.applied++
			for _, ev := range resEvs {
				if ev.typ == schemas.EventStepBlocked && ev.data.EffectKey != "" {
					p.tally.blocked++
					// The ledger must say the outcome is unknown, for a person
					// to decide (a record already ambiguous is left as it is).
					p.markAmbiguous = append(p.markAmbiguous, ev.data.EffectKey)
				}
			}
			evs = append(evs, resEvs...)
			changed, cause = true, it.msgID
		case it.signal != nil:
			if cp == nil {
				p.tally.stale++
				continue
			}
			if it.signal.Type == schemas.SignalFlow {
				// A wake-up for a dispatch waiting on a flow limit: the
				// admission after this decision tries it again. Decided
				// on a checkpoint read now, not the cache: another engine
				// may have moved the job on (a slot handed over, then a
				// rate wait), and a wake-up that admits nothing writes
				// nothing, so no compare-and-swap would tell that the
				// cache was behind and the wake-up would be lost.
				if !changed && !p.fresh {
					return true
				}
				if !flowSignalApplies(cp, it.signal) {
					if it.signal.Key != "" && !cp.Status.Terminal() && dispatchByID(cp, it.signal.ID) == nil && it.delivered < flowRedeliveries {
						// A slot handed over while the dispatch's waiting
						// record was being written (maybe by another engine):
						// it comes again once that is stored.
						if !changed && !p.leader {
							p.wantLeader = p.fresh
							return true
						}
						it.later = flowRetryDelay
						continue
					}
					if it.signal.Key != "" {
						if d := dispatchByID(cp, it.signal.ID); d == nil || d.Slot != it.signal.Key {
							// A slot handed to a dispatch that got another, or
							// that is gone: pass it on once settled.
							p.flowDrop = append(p.flowDrop, [2]string{it.signal.Key, it.signal.ID})
						}
					}
					p.tally.stale++
					continue
				}
				if !needDef(cp.DefinitionHash) {
					if p.err != nil {
						return false
					}
					break items
				}
				if d := dispatchByID(cp, it.signal.ID); it.signal.Key != "" && d != nil && d.Slot != "" && d.Slot != it.signal.Key {
					p.flowDrop = append(p.flowDrop, [2]string{it.signal.Key, it.signal.ID}) // it holds one already
				}
				applyFlowSignal(cp, it.signal)
				changed, cause = true, it.msgID
				continue
			}
			if !signalMayApply(cp, it.signal) {
				if !changed && !p.leader {
					p.wantLeader = p.fresh
					return true
				}
				p.tally.stale++
				e.log.Info("ignoring signal the job is not waiting for", "job", it.job, "type", it.signal.Type, "key", it.signal.Key)
				continue
			}
			cancel := it.signal.Type == schemas.SignalCancel
			if it.signal.Type == schemas.SignalMigrate {
				// Applied under the definition it moves to; the one it
				// leaves may be gone (a job blocked on it).
				old, _ := e.compiledFor(cp.DefinitionHash)
				if err := e.definition(ctx, p, it.signal.Definition); err != nil {
					var missing *definitionMissing
					if !errors.As(err, &missing) {
						p.err = err
						return false
					}
					p.tally.stale++
					e.log.Warn("dropping a migration to a definition that cannot be loaded", "job", it.job, "err", err)
					continue
				}
				var migEvs []event
				// A migration made from sequence Seq applies to the
				// checkpoint at Seq: not to one this decision has changed
				// already (another migration in the same batch, say).
				if it.signal.Seq == 0 || !changed {
					migEvs = migrateJob(old, p.def, cp, it.signal, now)
				}
				if migEvs == nil {
					p.tally.stale++
					e.log.Warn("dropping a migration the job no longer allows", "job", it.job, "status", cp.Status)
					continue
				}
				redelivered()
				p.tally.controls++
				evs = append(evs, migEvs...)
				changed, cause = true, it.msgID
				continue
			}
			if (cancel || it.signal.Type == schemas.SignalJobDeadline) && cp.Status == schemas.JobBlocked {
				// A job blocked on its definition is cancelled (or stopped at
				// its deadline) without it.
				p.def = nil
			} else if !needDef(cp.DefinitionHash) {
				if p.err != nil {
					return false
				}
				break items
			}
			_, sigEvs := applySignal(p.def, cp, it.signal, now)
			redelivered()
			if it.signal.Type == schemas.SignalJobDeadline && cp.Status == schemas.JobFailed {
				p.stopped = true
			}
			switch it.signal.Type {
			case schemas.SignalCancel:
				p.tally.cancelled++
			case schemas.SignalEffectResolved:
				p.tally.unblocked++
			default:
				p.tally.controls++
			}
			evs = append(evs, sigEvs...)
			changed, cause = true, it.msgID
		}
	}
	if changed && cp != nil && p.def != nil && len(cp.Signals) > 0 && cp.Current != nil && cp.Current.Wait != "" {
		// A wait step just reached takes a signal that came before it.
		evs = append(evs, takeKept(p.def, cp, now)...)
	}
	if recovered == "" && republish && !changed {
		recovered = "the inbox message that produced the last checkpoint came again: an engine died or stalled before finishing it"
	}
	if recovered == "" && e.cfg.SoleEngine && changed && p.base != nil && p.base.cp.Writer != "" && p.base.cp.Writer != e.incarnation && !e.cleanStops[p.base.cp.Writer] && !p.base.cp.Status.Terminal() {
		recovered = "a new engine process took the job over from its checkpoint"
	}
	// One crash can leave several of a job's messages to be delivered
	// again; the engine that picks them up counts one resume for them all.
	// A finished job is never written again: nothing was left to recover.
	if recovered != "" && cp != nil && (p.base == nil || !p.base.cp.Status.Terminal()) && (workerRecovered || cp.ResumedBy != e.incarnation) {
		cp.ResumeCount++
		if !workerRecovered {
			cp.ResumedBy = e.incarnation
		}
		p.tally.resumes++
		evs = append([]event{{typ: schemas.EventJobResumed, data: schemas.HistoryData{Job: cp.JobID, Reason: recovered}}}, evs...)
		if !changed {
			changed, cause = true, p.base.cp.Cause
		}
	}
	if republish {
		p.tally.republished++
		p.republish = !changed
		// The recorded dispatch is published again under its id; the
		// worker's fencing and the ledger make a second copy harmless.
		p.sends = unheld(newDispatches(nil, p.base.cp))
		p.dispatch = len(p.sends) > 0
	}
	if !changed {
		return false
	}
	if p.base != nil {
		cp.Seq = p.base.cp.Seq + 1
		if d := stateDelta(p.base.cp, cp); d != nil && len(evs) > 0 {
			evs[0].data.State = d
		}
	}
	cp.UpdatedAt = now
	cp.Cause = cause
	cp.Writer = e.incarnation
	var base *schemas.Checkpoint
	if p.base != nil {
		base = p.base.cp
	}
	e.setOutbox(base, cp, evs, now)
	p.next = cp
	p.republish = false
	switch {
	case republish || p.base == nil:
		p.sends = newDispatches(nil, cp)
	case cp.Fan != nil && p.base.cp.Fan != nil && (p.fresh && p.base.cp.Writer != e.incarnation || redeliveredIn(p)):
		// A fan's checkpoint written by another process, which may have
		// died before publishing its dispatches, or a message of the job
		// delivered again (a publication of this process failed and its
		// messages were handed back): a fan's other results can come
		// before the message that caused the checkpoint, so that message
		// cannot tell. Every dispatch in flight is published again (the dedup ids
		// make copies within the window harmless, fencing and the ledger
		// past it).
		p.sends = newDispatches(nil, cp)
	default:
		p.sends = newDispatches(p.base.cp, cp)
	}
	p.sends = heldOrReleased(base, cp, p.sends)
	p.dispatch = len(p.sends) > 0
	switch cp.Status {
	case schemas.JobCompleted:
		p.tally.completed++
	case schemas.JobFailed:
		p.tally.failed++
	}
	return false
}

// resultMayApply reports whether res matches cp's current dispatch (step
// and attempt), the only result that may be applied (DESIGN.md invariant
// 3). A job blocked on its definition keeps its current dispatch.
func resultMayApply(cp *schemas.Checkpoint, res *schemas.StepResult) bool {
	status := cp.Status
	if status == schemas.JobBlocked {
		status = cp.BlockedFrom
	}
	if status == schemas.JobWaitingApproval {
		// A gate's decision is applied as its result (applyControl); no
		// worker answers a gate.
		return cp.Current != nil && cp.Current.Gate != "" && cp.Current.Step == res.Step && cp.Current.Attempt == res.Attempt && res.Item == 0
	}
	if cp.Fan != nil {
		// A fan's other dispatches finish while one of its effects waits
		// for a person.
		return (status == schemas.JobRunning || status == schemas.JobNeedsReconciliation) && cp.DispatchOf(res.Step, res.Item, res.Attempt) != nil
	}
	cur := cp.Current
	return status == schemas.JobRunning && cur != nil && cur.Step == res.Step && cur.Attempt == res.Attempt && res.Item == 0
}

// signalMayApply reports whether sig is a decision the job waits for.
func signalMayApply(cp *schemas.Checkpoint, sig *schemas.Signal) bool {
	status := cp.Status
	if status == schemas.JobBlocked {
		status = cp.BlockedFrom
	}
	switch sig.Type {
	case schemas.SignalCancel:
		return !cp.Status.Terminal()
	case schemas.SignalEffectResolved:
	default:
		return controlMayApply(cp, sig)
	}
	if sig.Type != schemas.SignalEffectResolved || status != schemas.JobNeedsReconciliation || cp.Blocked == nil {
		return false
	}
	if cp.Fan != nil {
		return slices.ContainsFunc(cp.Fan.Blocked, func(b schemas.Blocked) bool { return b.EffectKey == sig.Key })
	}
	return cp.Blocked.EffectKey == sig.Key
}

// checkConsistent refuses a checkpoint that decodes but cannot have been
// written by an engine: a current dispatch of a step the definition does
// not have, or without the step's record. Such a job is quarantined: it is
// never resumed from, and never silently replaced.
func checkConsistent(c *compiled, cp *schemas.Checkpoint) error {
	if cur := cp.Current; cur != nil {
		if c.def.StepIndex(cur.Step) < 0 {
			return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: its current dispatch is of step %q, which definition %s does not have", cp.JobID, cur.Step, short(cp.DefinitionHash))
		}
		rec := cp.Steps[cur.Step]
		if rec == nil {
			return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: its current dispatch of step %q has no step record", cp.JobID, cur.Step)
		}
		if cur.Attempt > rec.Attempts {
			return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: current attempt %d of step %q is beyond the %d recorded", cp.JobID, cur.Attempt, cur.Step, rec.Attempts)
		}
	}
	if f := cp.Fan; f != nil {
		fs := c.def.Step(f.Step)
		if fs == nil || !(isFan(fs) || isAgent(fs)) || (f.Agent != nil) != isAgent(fs) {
			return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: its fan is of step %q, which definition %s does not have as a parallel, for_each or agent step", cp.JobID, f.Step, short(cp.DefinitionHash))
		}
		for _, d := range f.Running {
			switch {
			case f.Agent != nil && (d.Step != f.Step || (d.Item > 0 && f.Agent.CallByItem(d.Item) == nil) || cp.Steps[d.Step] == nil):
				return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: its agent step %q runs a dispatch (%s, item %d) it has no call or record for", cp.JobID, f.Step, d.Step, d.Item)
			case f.Agent != nil: // a turn or tool call of the agent, checked above
			case d.Item > 0 && (d.Step != f.Step || d.Item > f.Total):
				return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: its fan runs item %d of step %q, beyond the %d items of %q", cp.JobID, d.Item, d.Step, f.Total, f.Step)
			case d.Item == 0 && (!slices.Contains(fs.Branches, d.Step) || cp.Steps[d.Step] == nil):
				return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: its fan runs %q, which is not a branch of %q with a step record", cp.JobID, d.Step, f.Step)
			}
		}
	}
	if cp.Status == schemas.JobNeedsReconciliation && cp.Blocked == nil {
		return schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s needs reconciliation but names no effect", cp.JobID)
	}
	return nil
}

func short(hash string) string {
	if len(hash) > 12 {
		return hash[:12]
	}
	return hash
}

// blockJob blocks cp: the engine cannot go on (reason says why); it keeps
// everything else and goes back to its status once unblocked.
func blockJob(cp *schemas.Checkpoint, reason string) event {
	cp.BlockedFrom, cp.BlockedReason = cp.Status, reason
	cp.Status = schemas.JobBlocked
	return event{typ: schemas.EventJobBlocked, data: schemas.HistoryData{Job: cp.JobID, Status: string(cp.Status), Reason: reason}}
}

// unblockJob undoes blockJob.
func unblockJob(cp *schemas.Checkpoint) event {
	reason := cp.BlockedReason
	cp.Status, cp.BlockedFrom, cp.BlockedReason = cp.BlockedFrom, "", ""
	return event{typ: schemas.EventJobUnblocked, data: schemas.HistoryData{Job: cp.JobID, Status: string(cp.Status),
		Reason: "resolved: " + reason}}
}

// redeliveredIn reports whether a message of p was delivered before.
func redeliveredIn(p *plan) bool {
	for _, it := range p.items {
		if it.delivered > 1 {
			return true
		}
	}
	return false
}
