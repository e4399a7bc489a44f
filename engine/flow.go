package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
	"text/template"
	"time"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Flow control (schemas/flow.go) in the engine:
//
//	decide ─► admitFlow ─► write checkpoint ─► publish ─► releaseFlow
//	            │ new or waiting dispatches of limited steps:
//	            │   concurrency: take a slot (KV Create) or wait (a waiter record)
//	            │   rate: count in the window (CAS) or wait until it ends (a durable timer)
//	            ▼
//	       Dispatch.Slot / Dispatch.Waiting recorded in the checkpoint
//
// Admission runs after the transition is decided and before it is written,
// so a dispatch is recorded either admitted (its slot named) or waiting,
// never published over a limit. A slot is released once a checkpoint
// without the dispatch that held it is written (its result applied, the job
// ended): it is handed to the first waiter of its limit, whose job is
// signalled (SignalFlow) to take it. A crash between any two of these
// leaves a slot whose holder's checkpoint does not name it, or a waiter
// nobody wakes: the reconciler frees the one (after FlowGrace) and retries
// the other. Workflows that declare no limit skip all of it: no KV round
// trip.

// FlowGrace is how old a concurrency slot taken for a checkpoint not yet
// written must be before the reconciler frees it: an engine takes a slot
// before it writes the checkpoint that records it. A slot whose holder's
// checkpoint was written at or past the slot's sequence without naming it
// is freed at once.
const FlowGrace = 30 * time.Second

// stepFlow is what a step's flow settings compile to.
type stepFlow struct {
	prio  int
	conc  *flowLimit
	rates []*flowLimit // the step's own, then its pool's
}

// flowLimit is one limit: its id in the flow bucket, N, the window of a
// rate limit, its key template.
type flowLimit struct {
	id     string
	n      int
	period time.Duration
	key    *template.Template
}

// compileFlow returns, by step index, the flow settings of def's steps
// (nil for a definition without any).
func compileFlow(def *schemas.Definition) ([]*stepFlow, error) {
	if !def.HasFlow() {
		return nil, nil
	}
	out := make([]*stepFlow, len(def.Steps))
	for i := range def.Steps {
		s := &def.Steps[i]
		sf := &stepFlow{prio: def.PriorityOf(s)}
		if c := s.Concurrency; c != nil {
			t, err := schemas.ParseFlowKey(s.ID, "concurrency.key", c.Key)
			if err != nil {
				return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d]: %v", i, err)
			}
			id := schemas.FlowLimitID(def.Name, s.ID)
			if c.Group != "" {
				id = schemas.FlowLimitID("group", c.Group)
			}
			sf.conc = &flowLimit{id: id, n: c.Limit, key: t}
		}
		if r := s.RateLimit; r != nil {
			t, err := schemas.ParseFlowKey(s.ID, "rate_limit.key", r.Key)
			if err != nil {
				return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d]: %v", i, err)
			}
			// The period is part of a window's identity: two versions
			// with other periods count in windows of their own (one
			// window of either length would be reset by the other).
			sf.rates = append(sf.rates, &flowLimit{id: schemas.FlowLimitID(def.Name, s.ID, "rate", time.Duration(r.Period).String()), n: r.Limit, period: time.Duration(r.Period), key: t})
		}
		pool := def.PoolOf(s)
		if p, ok := def.Pools[pool]; ok && p.RateLimit != nil {
			sf.rates = append(sf.rates, &flowLimit{id: schemas.FlowLimitID("pool", pool, time.Duration(p.RateLimit.Period).String()), n: p.RateLimit.Limit, period: time.Duration(p.RateLimit.Period)})
		}
		if sf.conc != nil || len(sf.rates) > 0 {
			out[i] = sf
		}
	}
	return out, nil
}

// flowOf returns the flow settings of d's step under c, nil when none
// applies: no limit, or a dispatch no worker runs.
func (c *compiled) flowOf(d *schemas.Dispatch) *stepFlow {
	if c == nil || c.flow == nil || d.Gate != "" || d.Due != nil || d.Wait != "" || d.Child != "" {
		return nil
	}
	i := c.def.StepIndex(d.Step)
	if i < 0 {
		return nil
	}
	return c.flow[i]
}

// admitFlow admits the new and waiting dispatches of the plans about to
// be written whose steps have flow limits: each takes its slot and counts
// in its windows, or is recorded waiting and left out of the plan's sends.
// Plans of workflows without limits are passed over without I/O.
func (e *Engine) admitFlow(ctx context.Context, ps []*plan) {
	var todo []*plan
	for _, p := range ps {
		if p.next != nil && p.err == nil && p.def != nil && p.def.flow != nil {
			todo = append(todo, p)
		}
	}
	if len(todo) == 0 || e.store.Flow == nil {
		return
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, p := range todo {
		wg.Add(1)
		sem <- struct{}{}
		go func(p *plan) {
			defer func() { <-sem; wg.Done() }()
			if err := e.admitPlan(ctx, p); err != nil {
				p.err = err
			}
		}(p)
	}
	wg.Wait()
}

// admitPlan is admitFlow for one plan.
func (e *Engine) admitPlan(ctx context.Context, p *plan) error {
	cp := p.next
	if cp.Status.Terminal() {
		return nil
	}
	if cp.Paused != nil {
		// Nothing is admitted while a person holds the job; a slot handed
		// to one of its waiting dispatches goes on to the next waiter.
		for _, d := range cp.Dispatches() {
			if w := d.Waiting; w != nil && w.Offer != "" {
				p.flowDrop = append(p.flowDrop, [2]string{w.Offer, d.MsgID})
				c := *w
				c.Offer = ""
				d.Waiting = &c
			}
		}
		if onlyFlowSignals(p) {
			p.next, p.sends, p.dispatch = nil, nil, false
		}
		return nil
	}
	now := e.cfg.Now().UTC()
	if p.flowSlots == nil {
		p.flowSlots = map[string]string{}
	}
	had := map[string]*schemas.Dispatch{}
	if p.base != nil {
		for _, d := range p.base.cp.Dispatches() {
			had[d.MsgID] = d
		}
	}
	// Slots of the base that the next checkpoint's dispatches do not keep:
	// a later attempt (or the next item) of the same limit and key takes
	// one over instead of queueing behind it.
	kept := map[string]bool{}
	for _, d := range cp.Dispatches() {
		if d.Slot != "" {
			kept[d.Slot] = true
		}
	}
	var free []string
	if p.base != nil {
		for _, d := range p.base.cp.Dispatches() {
			if d.Slot != "" && !kept[d.Slot] {
				free = append(free, d.Slot)
			}
		}
	}
	sending := map[*schemas.Dispatch]bool{}
	for _, d := range p.sends {
		sending[d] = true
	}
	var evs []event
	admitted, changed := 0, false
	for _, d := range cp.Dispatches() {
		sf := p.def.flowOf(d)
		if sf == nil || d.Held {
			continue
		}
		if b := had[d.MsgID]; b != nil && b.Waiting == nil && !b.Held {
			continue // admitted before
		}
		wasWaiting := d.Waiting != nil
		ok, ev, err := e.admitOne(ctx, p, cp, d, sf, &free, now)
		if err != nil {
			return err
		}
		if ev.typ != "" {
			evs = append(evs, ev)
			changed = true
		}
		if !ok {
			delete(sending, d)
			if cp.Status == schemas.JobFailed {
				break // its key could not be rendered
			}
			continue
		}
		admitted++
		if wasWaiting {
			d.DispatchedAt = now
			sending[d] = true
			p.sends = append(p.sends, d)
		}
	}
	if cp.Status == schemas.JobFailed {
		p.sends = nil
	} else {
		out := p.sends[:0]
		for _, d := range p.sends {
			if sending[d] {
				out = append(out, d)
			}
		}
		p.sends = out
	}
	p.dispatch = len(p.sends) > 0
	if admitted == 0 && !changed && onlyFlowSignals(p) {
		// A wake-up that admitted nothing: nothing to write.
		p.next, p.sends, p.dispatch = nil, nil, false
		return nil
	}
	if len(evs) > 0 {
		cp.Events = stampTo(cp.Events, evs, cp.Seq, now)
		cp.Flush = flushDue(cp, e.cfg.HistoryBatch)
	}
	return nil
}

// onlyFlowSignals reports whether every message of p is a flow wake-up.
func onlyFlowSignals(p *plan) bool {
	for _, it := range p.items {
		if it.signal == nil || it.signal.Type != schemas.SignalFlow {
			return false
		}
	}
	return true
}

// admitOne admits d under sf's limits, or records it waiting. The event
// is step.admitted, step.waiting (when it begins to wait, or waits for
// another limit), job.failed (its key cannot be rendered), or none.
func (e *Engine) admitOne(ctx context.Context, p *plan, cp *schemas.Checkpoint, d *schemas.Dispatch, sf *stepFlow, free *[]string, now time.Time) (bool, event, error) {
	var info *schemas.FlowWait
	if c := sf.conc; c != nil && d.Slot == "" {
		key, err := renderKey(c, cp)
		if err != nil {
			return false, failJob(cp, &schemas.Error{Code: schemas.CodeInputInvalid, Job: cp.JobID, Step: d.Step, Message: err.Error()}, now), nil
		}
		kd := schemas.FlowKeyDigest(key)
		slot, inUse, err := e.takeSlot(ctx, p, cp, d, c, key, kd, sf.prio, free, now)
		if err != nil {
			return false, event{}, err
		}
		if slot == "" {
			w := &schemas.FlowWait{Kind: schemas.FlowConcurrency, Limit: c.id, Key: key, Max: c.n, InUse: inUse, Priority: sf.prio, Since: now}
			if old := d.Waiting; old != nil && old.Kind == w.Kind && old.Limit == w.Limit {
				w.Since, w.Ticket = old.Since, old.Ticket
			}
			if w.Ticket == "" {
				w.Ticket = kv.WaiterKey(c.id, kd, sf.prio, w.Since, msgDigest(d.MsgID))
			}
			if err := e.store.Flow.Wait(ctx, c.id, kd, w.Ticket, kv.FlowHolder{Job: cp.JobID, Step: d.Step, MsgID: d.MsgID, Key: key, At: w.Since, Prio: sf.prio, Max: c.n}); err != nil {
				return false, event{}, err
			}
			// A slot freed between the Creates and the waiter's record
			// was released to nobody: try once more now that it is seen.
			if again, _, err := e.store.Flow.Acquire(ctx, c.id, kd, c.n, slotStart(d.MsgID, c.n), holderOf(cp, d, key, now)); err != nil {
				return false, event{}, err
			} else if again != "" {
				slot = again
				p.flowSlots[d.MsgID] = slot
				if err := e.store.Flow.Unwait(ctx, w.Ticket); err != nil {
					return false, event{}, err
				}
			} else if e.store.Flow.Waiting(ctx, w.Ticket) {
				return e.wait(d, w)
			} else if handed, err := e.store.Flow.HeldBy(ctx, c.id, kd, c.n, cp.JobID, d.MsgID); err != nil {
				return false, event{}, err
			} else if handed != "" {
				// Handed a slot between the record and now.
				slot = handed
				p.flowSlots[d.MsgID] = slot
			} else {
				return e.wait(d, w)
			}
		} else if d.Waiting != nil && d.Waiting.Ticket != "" {
			if err := e.store.Flow.Unwait(ctx, d.Waiting.Ticket); err != nil {
				return false, event{}, err
			}
		}
		d.Slot = slot
		info = &schemas.FlowWait{Kind: schemas.FlowConcurrency, Limit: c.id, Key: key, Max: c.n, InUse: inUse + 1, Priority: sf.prio, Since: now, Offer: slot}
	}
	for _, r := range sf.rates {
		key := ""
		if r.key != nil {
			k, err := renderKey(r, cp)
			if err != nil {
				return false, failJob(cp, &schemas.Error{Code: schemas.CodeInputInvalid, Job: cp.JobID, Step: d.Step, Message: err.Error()}, now), nil
			}
			key = k
		}
		ok, win, err := e.store.Flow.Count(ctx, r.id, schemas.FlowKeyDigest(key), r.n, r.period, now, d.MsgID)
		if err != nil {
			return false, event{}, err
		}
		until := win.Start.Add(r.period)
		if !ok {
			w := &schemas.FlowWait{Kind: schemas.FlowRate, Limit: r.id, Key: key, Max: r.n, InUse: win.Count, Priority: sf.prio, Since: now, Until: &until}
			if old := d.Waiting; old != nil && old.Kind == w.Kind && old.Limit == w.Limit {
				w.Since = old.Since
			}
			if err := e.scheduleFlowTimer(ctx, cp, d, until); err != nil {
				return false, event{}, err
			}
			return e.wait(d, w)
		}
		start := win.Start
		info = &schemas.FlowWait{Kind: schemas.FlowRate, Limit: r.id, Key: key, Max: r.n, InUse: win.Count, Priority: sf.prio, Since: start, Until: &until, Offer: d.Slot}
	}
	d.Waiting = nil
	return true, event{typ: schemas.EventStepAdmitted, data: schemas.HistoryData{Job: cp.JobID, Step: d.Step, Attempt: d.Attempt, Item: d.Item, Flow: info}}, nil
}

// wait records w on d; the event is step.waiting unless d waited for the
// same limit already.
func (e *Engine) wait(d *schemas.Dispatch, w *schemas.FlowWait) (bool, event, error) {
	old := d.Waiting
	d.Waiting = w
	if old != nil && old.Kind == w.Kind && old.Limit == w.Limit && old.Key == w.Key {
		return false, event{}, nil
	}
	e.ctr.flowWaits.Add(1)
	return false, event{typ: schemas.EventStepWaiting, data: schemas.HistoryData{Step: d.Step, Attempt: d.Attempt, Item: d.Item, Reason: w.Reason(), Flow: w}}, nil
}

// takeSlot finds d a slot of limit c and key kd: one taken for it in an
// earlier round of this batch, one handed over to it (its waiting
// record's offer, or any slot of the limit naming it), one the base
// checkpoint held and the next does not keep, or a free one. "" with the
// count in use when every slot is taken.
func (e *Engine) takeSlot(ctx context.Context, p *plan, cp *schemas.Checkpoint, d *schemas.Dispatch, c *flowLimit, key, kd string, prio int, free *[]string, now time.Time) (string, int, error) {
	if s := p.flowSlots[d.MsgID]; s != "" {
		// Taken in an earlier round of this batch, for another sequence.
		ok, err := e.store.Flow.Refresh(ctx, s, cp.JobID, d.MsgID, cp.Seq)
		if err != nil {
			return "", 0, err
		}
		if ok {
			return s, 0, nil
		}
		delete(p.flowSlots, d.MsgID)
	}
	if w := d.Waiting; w != nil && w.Offer != "" {
		s, err := e.store.Flow.Slot(ctx, w.Offer)
		switch {
		case err == nil && s.Holder.Job == cp.JobID && s.Holder.MsgID == d.MsgID:
			p.flowSlots[d.MsgID] = w.Offer
			return w.Offer, 0, nil
		case err != nil && !errors.Is(err, schemas.ErrNotFound):
			return "", 0, err
		}
	}
	prefix := kv.SlotKey(c.id, kd, 0)
	prefix = prefix[:len(prefix)-1]
	for i, s := range *free {
		if len(s) > len(prefix) && s[:len(prefix)] == prefix && kv.SlotIndex(s) < c.n {
			*free = append((*free)[:i:i], (*free)[i+1:]...)
			p.flowSlots[d.MsgID] = s
			return s, 0, nil
		}
	}
	slot, taken, err := e.store.Flow.Acquire(ctx, c.id, kd, c.n, slotStart(d.MsgID, c.n), holderOf(cp, d, key, now))
	if err != nil {
		return "", 0, err
	}
	if slot != "" {
		p.flowSlots[d.MsgID] = slot
	}
	return slot, taken, nil
}

func holderOf(cp *schemas.Checkpoint, d *schemas.Dispatch, key string, now time.Time) kv.FlowHolder {
	return kv.FlowHolder{Job: cp.JobID, Step: d.Step, MsgID: d.MsgID, Key: key, At: now, Seq: cp.Seq}
}

// slotStart spreads holders over the slots: the first one tried.
func slotStart(msgID string, n int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(msgID))
	return int(h.Sum32() % uint32(n))
}

func msgDigest(msgID string) string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(msgID))
	return strconv.FormatUint(h.Sum64(), 16)
}

func renderKey(l *flowLimit, cp *schemas.Checkpoint) (string, error) {
	if l.key == nil {
		return "", nil
	}
	return schemas.RenderFlowKey(l.key, cp.JobID, cp.State, cp.Vars)
}

// scheduleFlowTimer sets d's wake-up at until, when its rate window ends.
func (e *Engine) scheduleFlowTimer(ctx context.Context, cp *schemas.Checkpoint, d *schemas.Dispatch, until time.Time) error {
	sig, err := json.Marshal(schemas.Signal{Job: cp.JobID, Type: schemas.SignalFlow, ID: d.MsgID, By: "the rate window's end", At: until})
	if err != nil {
		return err
	}
	name := timerName("flow", d.Step+"-"+strconv.Itoa(d.Item))
	// The id names when it was set: a wake-up that finds the window still
	// full (the timer fired as the window turned) writes nothing and sets
	// the timer again for the same end, which must not be dropped as a
	// duplicate of the one that just fired. A timer set twice (a decision
	// made again) costs one more wake-up, which admits or waits again.
	return e.store.ScheduleTimer(ctx, cp.JobID, name, until, kv.InboxSignal, nil, sig,
		d.MsgID+"/flow/w"+strconv.FormatInt(until.Unix(), 10)+"/"+strconv.FormatInt(e.cfg.Now().UnixNano(), 36))
}

// A flow wake-up for a dispatch its job's checkpoint does not have yet is
// given back flowRetryDelay later, up to flowRedeliveries deliveries; then
// dropped (the reconciler offers the slot again).
const (
	flowRetryDelay   = 250 * time.Millisecond
	flowRedeliveries = 20
)

// dispatchByID returns cp's dispatch in flight whose message id is id, or nil.
func dispatchByID(cp *schemas.Checkpoint, id string) *schemas.Dispatch {
	for _, d := range cp.Dispatches() {
		if d.MsgID == id {
			return d
		}
	}
	return nil
}

// flowSignalApplies reports whether a flow wake-up finds a dispatch of cp
// waiting (any, for a signal without a target).
func flowSignalApplies(cp *schemas.Checkpoint, sig *schemas.Signal) bool {
	if cp.Status.Terminal() {
		return false
	}
	for _, d := range cp.Dispatches() {
		if d.Waiting != nil && (sig.ID == "" || sig.ID == d.MsgID) {
			return true
		}
	}
	return false
}

// applyFlowSignal notes on the waiting dispatch a slot handed to it; the
// admission after the decision takes it.
func applyFlowSignal(cp *schemas.Checkpoint, sig *schemas.Signal) {
	if sig.Key == "" {
		return
	}
	for _, d := range cp.Dispatches() {
		if d.Waiting != nil && d.MsgID == sig.ID {
			w := *d.Waiting // the base's record is shared: copy it
			w.Offer = sig.Key
			d.Waiting = &w
		}
	}
}

// releaseFlow frees, once a plan's checkpoint is written, the slots its
// base held that the written checkpoint no longer names (and those taken
// in this batch that it does not), handing each to the first waiter of its
// limit, and removes the waiting records of dispatches that are gone. A
// failure is logged: the reconciler frees what is left.
func (e *Engine) releaseFlow(ctx context.Context, ps []*plan) {
	if e.store.Flow == nil || e.skipFlowRelease {
		return
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, p := range ps {
		if p.err != nil || (len(p.flowDrop) == 0 && len(p.flowSlots) == 0 && !heldFlow(p)) {
			continue // nothing of flow control: no goroutine, no I/O
		}
		wg.Add(1)
		sem <- struct{}{}
		go func(p *plan) {
			defer func() { <-sem; wg.Done() }()
			e.releasePlan(ctx, p)
		}(p)
	}
	wg.Wait()
}

// heldFlow reports whether p's base had a dispatch holding a slot or
// waiting.
func heldFlow(p *plan) bool {
	if p.base == nil {
		return false
	}
	for _, d := range p.base.cp.Dispatches() {
		if d.Slot != "" || d.Waiting != nil {
			return true
		}
	}
	return false
}

// releasePlan is releaseFlow for one plan.
func (e *Engine) releasePlan(ctx context.Context, p *plan) {
	for _, dr := range p.flowDrop {
		if err := e.releaseHandedSlot(ctx, dr[0], p.job, dr[1]); err != nil {
			e.log.Warn("could not pass on a flow slot handed to a dispatch that no longer waits; the reconciler frees it", "job", p.job, "slot", dr[0], "err", err)
		}
	}
	if p.next == nil || p.rev == 0 {
		return
	}
	var had []string
	var waited []*schemas.FlowWait
	if p.base != nil {
		for _, d := range p.base.cp.Dispatches() {
			if d.Slot != "" {
				had = append(had, d.Slot)
			}
			if d.Waiting != nil && d.Waiting.Ticket != "" {
				waited = append(waited, d.Waiting)
			}
		}
	}
	for _, s := range p.flowSlots {
		had = append(had, s)
	}
	kept, waiting := map[string]bool{}, map[string]bool{}
	if !p.next.Status.Terminal() {
		for _, d := range p.next.Dispatches() {
			if d.Slot != "" {
				kept[d.Slot] = true
			}
			if d.Waiting != nil {
				waiting[d.Waiting.Ticket] = true
			}
		}
	}
	for _, s := range had {
		if kept[s] {
			continue
		}
		kept[s] = true // once
		if err := e.releaseSlot(ctx, s, p.job); err != nil {
			e.log.Warn("could not release a flow slot; the reconciler frees it", "job", p.job, "slot", s, "err", err)
		}
	}
	for _, w := range waited {
		if !waiting[w.Ticket] {
			if err := e.store.Flow.Unwait(ctx, w.Ticket); err != nil {
				e.log.Warn("could not remove a flow waiter; the reconciler removes it", "job", p.job, "waiter", w.Ticket, "err", err)
			}
		}
	}
	clear(p.flowSlots)
}

// releaseSlot releases slot if job holds it and wakes the waiter it goes to.
func (e *Engine) releaseSlot(ctx context.Context, slot, job string) error {
	r, err := e.store.Flow.Release(ctx, slot, job)
	if err != nil {
		return err
	}
	return e.passedOn(ctx, slot, r)
}

// passedOn wakes the waiter a released slot went to (or, freed, the
// waiter that may take it).
func (e *Engine) passedOn(ctx context.Context, slot string, r kv.FlowRelease) error {
	if r.To == nil {
		return nil
	}
	if !r.Handed {
		return e.wakeFlow(ctx, r.To.Job, r.To.MsgID, "", "a slot of its concurrency limit was freed")
	}
	e.ctr.flowHandedOver.Add(1)
	return e.wakeFlow(ctx, r.To.Job, r.To.MsgID, slot, "a slot of its concurrency limit was handed to it")
}

// releaseHandedSlot releases slot if job's dispatch msgID holds it (it
// was handed to it, and it no longer waits).
func (e *Engine) releaseHandedSlot(ctx context.Context, slot, job, msgID string) error {
	s, err := e.store.Flow.Slot(ctx, slot)
	if errors.Is(err, schemas.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if s.Holder.Job != job || s.Holder.MsgID != msgID {
		return nil
	}
	r, err := e.store.Flow.ReleaseSlot(ctx, s)
	if err != nil {
		return err
	}
	return e.passedOn(ctx, slot, r)
}

// wakeFlow sends job a flow signal for its waiting dispatch msgID (slot:
// the slot handed to it, or "").
func (e *Engine) wakeFlow(ctx context.Context, job, msgID, slot, by string) error {
	now := e.cfg.Now().UTC()
	return e.store.SendSignal(ctx, schemas.Signal{Job: job, Type: schemas.SignalFlow, ID: msgID, Key: slot, By: by, At: now},
		msgID+"/flow/"+slot+"/"+strconv.FormatInt(now.UnixNano(), 36))
}

// reconcileFlow is the reconciler's pass over the flow bucket: a slot
// older than FlowGrace whose holder's checkpoint neither names it nor has
// a dispatch waiting for its limit (a crash between the write and the
// release, a job swept) is released; a slot handed to a dispatch that
// still waits (its wake-up lost) is offered again; a waiter whose dispatch
// no longer waits is removed. Its cost follows the slots and waiters in
// use.
func (e *Engine) reconcileFlow(ctx context.Context) error {
	if e.store.Flow == nil {
		return nil
	}
	now := e.cfg.Now()
	var slots []kv.FlowSlot
	if err := e.store.Flow.Slots(ctx, func(s kv.FlowSlot) bool {
		slots = append(slots, s)
		return true
	}); err != nil {
		return fmt.Errorf("reconcile flow slots: %w", err)
	}
	var first error
	note := func(err error) {
		if err != nil && first == nil {
			first = err
		}
	}
	for _, s := range slots {
		held, waiting, seq, err := e.holds(ctx, s.Holder.Job, s.Key, s.Holder.MsgID)
		if err != nil {
			note(err)
			continue
		}
		switch {
		case held:
		case !waiting && seq < s.Holder.Seq && now.Sub(s.Created) < e.flowGrace:
			// Taken for a checkpoint not written yet (or never: then the
			// job's next transition, or the grace, tells).
		case waiting:
			note(e.wakeFlow(ctx, s.Holder.Job, s.Holder.MsgID, s.Key, "the reconciler: a slot handed to it"))
		default:
			r, err := e.store.Flow.ReleaseSlot(ctx, s)
			if err != nil {
				note(err)
				continue
			}
			e.ctr.flowLeaked.Add(1)
			e.log.Info("released a flow slot its holder's checkpoint no longer names", "slot", s.Key, "job", s.Holder.Job, "step", s.Holder.Step)
			note(e.passedOn(ctx, s.Key, r))
		}
	}
	var stale []string
	note(e.store.Flow.Waiters(ctx, func(key string, h kv.FlowHolder) bool {
		if now.Sub(h.At) < FlowGrace {
			return true
		}
		_, waiting, _, err := e.holds(ctx, h.Job, "", h.MsgID)
		if err == nil && !waiting {
			stale = append(stale, key)
		}
		return true
	}))
	for _, k := range stale {
		note(e.store.Flow.Unwait(ctx, k))
	}
	return first
}

// holds reports whether job's checkpoint has a dispatch holding slot,
// whether it has dispatch msgID waiting, and the checkpoint's sequence
// (the largest for a job that is gone or ended: nothing of it can hold a
// slot any more).
func (e *Engine) holds(ctx context.Context, job, slot, msgID string) (held, waiting bool, seq uint64, err error) {
	ent, err := e.store.Checkpoints.Get(ctx, job)
	if errors.Is(err, schemas.ErrNotFound) {
		return false, false, ^uint64(0), nil
	}
	if err != nil {
		return false, false, 0, fmt.Errorf("reconcile flow: job %s: %w", job, err)
	}
	cp := ent.Checkpoint
	if cp.Status.Terminal() {
		return false, false, ^uint64(0), nil
	}
	seq = cp.Seq
	for _, d := range cp.Dispatches() {
		if slot != "" && d.Slot == slot {
			held = true
		}
		if d.Waiting != nil && d.MsgID == msgID {
			waiting = true
		}
	}
	return held, waiting, seq, nil
}

// nudgeWaiting is the reconciler's retry of cp's waiting dispatches: a
// wake-up for each that waited a reconcile interval and is out of line
// (its waiter record is gone: handed a slot whose wake-up was lost, or
// never recorded), or whose rate window ended past timerGrace.
func (e *Engine) nudgeWaiting(ctx context.Context, cp *schemas.Checkpoint, now time.Time) error {
	for _, d := range cp.Dispatches() {
		w := d.Waiting
		if w == nil {
			continue
		}
		due := w.Since.Add(e.cfg.ReconcileInterval)
		if w.Until != nil {
			due = w.Until.Add(timerGrace)
		}
		if now.Before(due) {
			continue
		}
		if w.Kind == schemas.FlowConcurrency && w.Ticket != "" && w.Offer == "" && e.store.Flow.Waiting(ctx, w.Ticket) {
			continue // still in line: a release will hand it a slot
		}
		if err := e.wakeFlow(ctx, cp.JobID, d.MsgID, "", "the reconciler: it waited long"); err != nil {
			return err
		}
	}
	return nil
}

// waitingFlow reports whether a dispatch of cp waits for a flow limit.
func waitingFlow(cp *schemas.Checkpoint) bool {
	for _, d := range cp.Dispatches() {
		if d.Waiting != nil {
			return true
		}
	}
	return false
}
