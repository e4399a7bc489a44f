package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// settlement is a batch whose publications are in flight.
type settlement struct {
	plans    []*plan
	inflight map[*plan][]jetstream.PubAckFuture
}

// startPublish sends each written plan's history events and dispatch, all
// in flight at once, with dedup ids so that publishing again after a crash
// adds nothing.
func (e *Engine) startPublish(ctx context.Context, ps []*plan) *settlement {
	st := &settlement{plans: ps, inflight: map[*plan][]jetstream.PubAckFuture{}}
	for _, p := range ps {
		cp := p.written()
		if p.err != nil || cp == nil {
			continue
		}
		var fs []jetstream.PubAckFuture
		publish := cp.Flush
		if p.republish {
			p.entry = p.base
			publish = !p.base.knownPublished()
		}
		if publish {
			f, err := e.publishOutbox(cp)
			if err != nil {
				p.err = err
				continue
			}
			fs = append(fs, f)
		}
		if cur := cp.Current; p.dispatch && p.republish && cp.Fan == nil && cur != nil && cur.Child == "" && cur.Gate == "" && cur.Due == nil && cur.Wait == "" {
			// Publish the recorded dispatch again only when the stream says
			// its message is neither queued nor answered: past the duplicate
			// window, a copy would be a second message. A fan's are all
			// published again: their ids dedupe within the window, and past
			// it the worker's fencing and the ledger make a copy harmless.
			need, err := e.dispatchMissing(ctx, cp)
			if err != nil {
				p.err = err
				continue
			}
			p.dispatch = need
		}
		if p.dispatch {
			for _, d := range p.sends {
				if d.Held {
					continue
				}
				if d.Gate != "" {
					continue // its expiry timer is set below, with the other gates'
				}
				if d.Due != nil || d.Wait != "" {
					if err := e.scheduleTimer(ctx, cp, d); err != nil {
						p.err = err
						break
					}
					continue
				}
				if d.Child != "" {
					if e.dropChildStart != nil && e.dropChildStart(d.Child) {
						continue
					}
					if err := e.startChild(ctx, cp, d); err != nil {
						p.err = err
						break
					}
					continue
				}
				m, err := e.stepMessage(cp, d)
				if errors.Is(err, schemas.ErrTooLarge) && cp.Fan != nil {
					// A fan's item or branch whose message cannot be sent
					// fails on its own (a map under collect goes on), with the
					// sizes: it is answered in its place.
					res := &schemas.StepResult{Job: cp.JobID, Step: d.Step, Attempt: d.Attempt, Item: d.Item,
						Error: &schemas.Error{Code: schemas.CodeTooLarge, Message: schemas.AsError(err).Message + " (the item and the state without the list)"}}
					err = e.sendResult(ctx, res, d.MsgID)
					if err == nil {
						continue
					}
				}
				if err == nil {
					var f jetstream.PubAckFuture
					if f, err = e.store.PublishAsync(m); err == nil {
						fs = append(fs, f)
					}
				}
				if err != nil {
					p.err = fmt.Errorf("dispatch %s of job %s: %w", d.MsgID, cp.JobID, err)
					break
				}
			}
			if p.err != nil {
				continue
			}
		}
		if at := cp.DeadlineAt; at != nil && !cp.Status.Terminal() && (p.republish || p.base == nil || p.base.cp.DeadlineAt == nil || !p.base.cp.DeadlineAt.Equal(*at)) {
			sig, _ := json.Marshal(schemas.Signal{Job: cp.JobID, Type: schemas.SignalJobDeadline, By: "the job's deadline", At: *at})
			if err := e.store.ScheduleTimer(ctx, cp.JobID, "deadline", *at, kv.InboxSignal, nil, sig, cp.MsgPrefix()+"/deadline/"+strconv.FormatInt(at.Unix(), 10)); err != nil {
				p.err = err
				continue
			}
		}
		for _, a := range openedGates(p, cp) {
			if err := e.scheduleExpiry(ctx, cp, a); err != nil {
				p.err = err
				break
			}
		}
		if p.err != nil {
			continue
		}
		st.inflight[p] = fs
	}
	return st
}

// publishOutbox publishes cp's outbox (its Events, which are not empty)
// as one history message, with Nats-Msg-Id "<msg prefix>/<last seq>".
func (e *Engine) publishOutbox(cp *schemas.Checkpoint) (jetstream.PubAckFuture, error) {
	hm := outboxMessage(cp, cp.Events)
	m := nats.NewMsg(e.store.Names.HistorySubject(cp.JobID))
	m.Data = hm.body
	m.Header.Set(jetstream.MsgIDHeader, hm.id)
	m.Header.Set(kv.HeaderSeq, strconv.FormatUint(hm.seq, 10))
	m.Header.Set("Content-Type", schemas.HistoryContentType)
	f, err := e.store.JS.PublishMsgAsync(m)
	if err != nil {
		return nil, fmt.Errorf("publish history of job %s: %w", cp.JobID, err)
	}
	return f, nil
}

// waitAll waits for every acknowledgement; the first error wins.
func waitAll(ctx context.Context, fs []jetstream.PubAckFuture) error {
	var first error
	for _, f := range fs {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			if first == nil {
				first = err
			}
		case <-ctx.Done():
			if first == nil {
				first = fmt.Errorf("no acknowledgement: %w", ctx.Err())
			}
		}
	}
	return first
}

// finish waits for a settlement's acknowledgements, then does what must
// follow a stored transition (index a finished job, mark an effect
// ambiguous), then acknowledges or hands back the messages.
func (e *Engine) finish(ctx context.Context, st *settlement) {
	// Publications already sent are waited for even when the engine is
	// stopping: their acknowledgements are on the way, and a clean stop
	// should not leave its last batch for redelivery.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.PublishTimeout)
	defer cancel()
	var after []*plan
	for _, p := range st.plans {
		fs, sent := st.inflight[p]
		c := p.entry
		if !sent {
			if c != nil {
				c.doneFlushing()
			}
			continue
		}
		err := waitAll(wctx, fs)
		if err != nil && p.err == nil {
			p.err = fmt.Errorf("publish for job %s: %w", p.job, err)
		}
		if c != nil {
			if p.err == nil && c.cp.Flush {
				c.published.Store(c.cp.Seq)
			}
			c.doneFlushing()
		}
		if p.err != nil {
			continue
		}
		if p.dispatch {
			e.ctr.dispatched.Add(uint64(len(p.sends)))
		}
		if cp := p.written(); cp.Status.Terminal() || len(p.markAmbiguous) > 0 || reopened(p) {
			after = append(after, p)
		}
	}
	e.releaseFlow(wctx, st.plans)
	e.afterWrite(wctx, after)
	for _, p := range st.plans {
		e.injectSteps(ctx, failpoint.EngineAfterDispatch, p)
	}
	e.settle(st.plans)
}

// reopened reports whether p's transition reopened an ended job (a retry,
// a rewind).
func reopened(p *plan) bool {
	cp := p.written()
	return p.base != nil && p.base.cp.Status.Terminal() && cp != nil && cp != p.base.cp && !cp.Status.Terminal()
}

// afterWrite does, concurrently, what a plan's stored transition calls for
// once its events are stored: a finished job's index entry moves to
// ended; an effect whose outcome is unknown is marked ambiguous in the
// ledger. A failure fails the plan: its messages come back and the step is
// done again (each is idempotent).
func (e *Engine) afterWrite(ctx context.Context, ps []*plan) {
	if len(ps) == 0 {
		return
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, p := range ps {
		wg.Add(1)
		sem <- struct{}{}
		go func(p *plan) {
			defer func() { <-sem; wg.Done() }()
			cp := p.written()
			if cp.Status.Terminal() {
				if err := e.store.Jobs.End(ctx, cp, cp.ActiveEntryRev()); err != nil {
					p.err = fmt.Errorf("job %s finished: %w", p.job, err)
					return
				}
				if cp.Caller != nil {
					// A lost notice is sent again by the parent's reconciler.
					if err := e.notifyCaller(ctx, cp, cp.Caller); err != nil {
						e.log.Warn("could not tell a child job's parent that it ended", "job", cp.JobID, "parent", cp.Caller.Job, "err", err)
					}
				}
				if (cp.Status == schemas.JobCancelled || p.stopped) && p.base != nil {
					e.afterCancel(ctx, p.base.cp, cp)
				}
			}
			if reopened(p) {
				// Reopened: its end is listed no more (this engine wrote that
				// entry before, in an earlier batch's settlement).
				key := kv.EndedKey(p.base.cp.Status, cp.Workflow, cp.JobID)
				if ie, err := e.store.Jobs.Get(ctx, key); err == nil {
					if err := e.store.Jobs.Remove(ctx, key, ie.Revision); err != nil {
						p.err = fmt.Errorf("job %s retried: remove its entry %s: %w", p.job, key, err)
					}
				}
			}
			for _, key := range p.markAmbiguous {
				if err := e.markAmbiguous(ctx, cp, key); err != nil {
					p.err = err
				}
			}
		}(p)
	}
	wg.Wait()
}

// markAmbiguous records in the ledger that the effect under key, whose
// step failed for good while the call may have happened, has an unknown
// outcome, so that it is listed and a person can resolve it. A record that
// is settled meanwhile (a late answer confirmed it) tells the job at once
// instead; one already ambiguous or reconciled is left as it is.
func (e *Engine) markAmbiguous(ctx context.Context, cp *schemas.Checkpoint, key string) error {
	for try := 0; try < 8; try++ {
		ent, err := e.store.Effects.Get(ctx, key)
		if errors.Is(err, schemas.ErrNotFound) {
			return nil // no call was prepared: nothing can have happened
		}
		if err != nil {
			return fmt.Errorf("job %s: read effect %s: %w", cp.JobID, key, err)
		}
		rec := *ent.Record
		switch rec.State {
		case schemas.EffectAmbiguous:
			return e.addWaiter(ctx, cp, ent)
		case schemas.EffectConfirmed, schemas.EffectReconciled:
			return e.signalResolved(ctx, cp.JobID, key, ent.Revision, "the effect was settled after its step failed")
		}
		now := e.cfg.Now().UTC()
		reason := "the step failed for good"
		if cp.Blocked != nil && cp.Blocked.LastError != nil {
			reason += " (" + cp.Blocked.LastError.Message + ")"
		}
		rec.State, rec.SettledAt, rec.UpdatedAt = schemas.EffectAmbiguous, now, now
		rec.Reason = reason + " after the call was dispatched, and its outcome was never recorded"
		if rec.Job != cp.JobID && !containsString(rec.SharedBy, cp.JobID) {
			rec.SharedBy = append(rec.SharedBy, cp.JobID)
		}
		rev, err := e.store.Effects.Update(ctx, &rec, ent.Revision)
		if errors.Is(err, schemas.ErrConflict) {
			continue
		}
		if err != nil {
			return fmt.Errorf("job %s: mark effect %s ambiguous: %w", cp.JobID, key, err)
		}
		e.ctr.markedAmbiguous.Add(1)
		e.effectEvent(ctx, &rec, rev, schemas.EventEffectAmbiguous)
		return nil
	}
	return fmt.Errorf("job %s: mark effect %s ambiguous: it kept changing", cp.JobID, key)
}

// addWaiter records that cp's job waits on the ambiguous effect of
// another job (a shared idempotency key), so that one resolution tells
// them all.
func (e *Engine) addWaiter(ctx context.Context, cp *schemas.Checkpoint, ent kv.EffectEntry) error {
	for try := 0; try < 8; try++ {
		rec := *ent.Record
		if rec.Job == cp.JobID || containsString(rec.SharedBy, cp.JobID) {
			return nil
		}
		if rec.State != schemas.EffectAmbiguous {
			if rec.Settled() || rec.State == schemas.EffectReconciled {
				return e.signalResolved(ctx, cp.JobID, rec.Key, ent.Revision, "the shared effect was settled")
			}
			return nil
		}
		rec.SharedBy = append(append([]string(nil), rec.SharedBy...), cp.JobID)
		rec.UpdatedAt = e.cfg.Now().UTC()
		_, err := e.store.Effects.Update(ctx, &rec, ent.Revision)
		if err == nil {
			return nil
		}
		if !errors.Is(err, schemas.ErrConflict) {
			return fmt.Errorf("job %s: wait on effect %s: %w", cp.JobID, rec.Key, err)
		}
		if ent, err = e.store.Effects.Get(ctx, rec.Key); err != nil {
			return fmt.Errorf("job %s: wait on effect %s: %w", cp.JobID, rec.Key, err)
		}
	}
	return fmt.Errorf("job %s: wait on effect %s: it kept changing", cp.JobID, ent.Record.Key)
}

func containsString(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

// signalResolved tells job that the effect under key was settled: the
// signal engine effects resolve sends, here sent by the engine itself.
func (e *Engine) signalResolved(ctx context.Context, job, key string, rev uint64, by string) error {
	if err := e.store.SignalResolved(ctx, job, key, rev, by); err != nil {
		return fmt.Errorf("tell job %s that effect %s is settled: %w", job, key, err)
	}
	return nil
}

// effectEvent appends a ledger transition to the job's history.
func (e *Engine) effectEvent(ctx context.Context, rec *schemas.EffectRecord, rev uint64, typ string) {
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := e.store.AppendEffectEvent(pctx, rec.Job, schemas.HistorySourceEngine, typ, rec, rev, e.cfg.Now().UTC()); err != nil {
		e.log.Warn("effect event not recorded in history", "key", rec.Key, "type", typ, "err", err)
	}
}

// dispatchMissing reports whether cp's current dispatch has neither a
// message in the work stream nor a result in the inbox: the facts that say
// it was never published (or was lost), so publishing it is needed.
func (e *Engine) dispatchMissing(ctx context.Context, cp *schemas.Checkpoint) (bool, error) {
	f, err := e.dispatchFacts(ctx, cp)
	if err != nil {
		return false, err
	}
	return !f.queued && !f.answered, nil
}

// stepMessage builds the step message of d, one of cp's dispatches.
func (e *Engine) stepMessage(cp *schemas.Checkpoint, d *schemas.Dispatch) (*nats.Msg, error) {
	rec := cp.Steps[d.Step]
	runs := 1
	if rec != nil {
		runs = rec.Runs
	}
	sm := schemas.StepMessage{
		Job:            cp.JobID,
		Step:           d.Step,
		Attempt:        d.Attempt,
		RunAttempt:     d.RunAttempt,
		DefinitionHash: cp.DefinitionHash,
		State:          cp.State,
		Vars:           cp.Vars,
		NotBefore:      d.NotBefore,
		IdempotencyKey: schemas.IdempotencyKey(cp.KeyBaseFor(d.Step, runs), d.Step, runs),
		EffectKey:      d.EffectKey,
	}
	if d.Item > 0 {
		if err := e.itemMessage(cp, d, &sm); err != nil {
			return nil, err
		}
	} else if cp.Fan != nil && cp.Fan.Agent != nil && d.Step == cp.Fan.Step {
		agentTurnMessage(cp, &sm)
	}
	for i := len(cp.Approvals) - 1; i >= 0 && d.Item == 0; i-- {
		// The latest approval whose scope covers the step bounds its request.
		if a := cp.Approvals[i]; a.Status == schemas.ApprovalApproved && a.Scope != nil && slices.Contains(a.Scope.Steps, d.Step) {
			sm.Scope, sm.ScopeOf = a.Scope.When, a.ID
			break
		}
	}
	if schemas.HasRefs(sm.State) || sm.Turn > 0 {
		sm.ValueOwner = cp.MsgPrefix() // the worker reads the values
	}
	m := nats.NewMsg(e.store.Names.WorkSubject(d.Pool, cp.JobID))
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

// scheduleTimer sets the durable timer of d, a sleep or a wait: a wait
// with a timeout gets its wait_timeout signal, a sleep its result at its
// due time (kv.Store.ScheduleTimer). Setting it again
// (a transition published again) replaces the schedule.
func (e *Engine) scheduleTimer(ctx context.Context, cp *schemas.Checkpoint, d *schemas.Dispatch) error {
	if d.Wait != "" {
		if d.Due == nil {
			return nil // waits without end: nothing to set
		}
		sig, err := json.Marshal(schemas.Signal{Job: cp.JobID, Type: schemas.SignalWaitTimeout, Key: d.MsgID, By: "the wait's timeout", At: *d.Due})
		if err != nil {
			return err
		}
		return e.store.ScheduleTimer(ctx, cp.JobID, timerName("wait", d.Step), *d.Due, kv.InboxSignal, nil, sig, d.MsgID+"/timeout")
	}
	out, _ := json.Marshal(map[string]int64{"slept_ms": d.Due.Sub(d.DispatchedAt).Milliseconds()})
	res := &schemas.StepResult{Job: cp.JobID, Step: d.Step, Attempt: d.Attempt, Output: out}
	hdr := nats.Header{}
	data, err := schemas.EncodeStepResult(res, hdr)
	if err != nil {
		return err
	}
	return e.store.ScheduleTimer(ctx, cp.JobID, timerName("sleep", d.Step), *d.Due, kv.InboxResult, hdr, data, d.MsgID+"/result")
}

// openedGates are the pending approvals with an expiry that p's
// transition opened (every pending one when it publishes again).
func openedGates(p *plan, cp *schemas.Checkpoint) []*schemas.Approval {
	var had map[string]bool
	if !p.republish && p.base != nil && p.base.cp != cp {
		had = map[string]bool{}
		for _, a := range p.base.cp.Approvals {
			had[a.ID] = true
		}
	}
	var out []*schemas.Approval
	for _, a := range cp.Approvals {
		if a.Status == schemas.ApprovalPending && a.ExpiresAt != nil && !had[a.ID] {
			out = append(out, a)
		}
	}
	return out
}

// scheduleExpiry sets the timer of approval a's expiry: its
// approval_expired signal at a.ExpiresAt.
func (e *Engine) scheduleExpiry(ctx context.Context, cp *schemas.Checkpoint, a *schemas.Approval) error {
	sig, err := json.Marshal(schemas.Signal{Job: cp.JobID, Type: schemas.SignalApprovalExpired, Key: a.ID, By: "the gate's expiry", At: *a.ExpiresAt})
	if err != nil {
		return err
	}
	return e.store.ScheduleTimer(ctx, cp.JobID, timerName("approval", a.ID), *a.ExpiresAt, kv.InboxSignal, nil, sig, cp.MsgPrefix()+"/expire/"+a.ID)
}

// timerName is a timer's subject token: kind and step, the step id's
// dots (not allowed in a token) replaced.
func timerName(kind, step string) string {
	return kind + "-" + strings.NewReplacer(".", "_", "/", "_", "*", "_", ">", "_", " ", "_").Replace(step)
}

// afterCancel finishes the cancel of base, now written as cp: the step
// messages of its dispatches still queued (not yet taken, or held for a
// retry delay) are removed from the work stream, so that no worker starts
// them, and its child jobs in flight are cancelled, by the parent, for the
// parent's reason. Best effort: a message already taken runs and its
// result is dropped; a child left running is cancelled again by nobody, so
// a failure is logged.
func (e *Engine) afterCancel(ctx context.Context, base, cp *schemas.Checkpoint) {
	pools := map[string]bool{}
	for _, d := range base.Dispatches() {
		if d.Child != "" {
			reason := "its parent was cancelled"
			if cp.Error != nil {
				reason += " (" + cp.Error.Message + ")"
			}
			if err := e.store.SignalCancel(ctx, d.Child, "parent job "+cp.JobID, reason); err != nil {
				e.log.Warn("could not cancel a cancelled job's child", "job", cp.JobID, "child", d.Child, "err", err)
			}
			continue
		}
		pools[d.Pool] = true
	}
	for pool := range pools {
		if err := e.store.Queues.RemoveJobSteps(ctx, pool, cp.JobID); err != nil {
			e.log.Warn("could not remove a cancelled job's queued step messages; their results will be dropped", "job", cp.JobID, "pool", pool, "err", err)
		}
	}
}
