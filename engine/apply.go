package engine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/expr-lang/expr"

	"github.com/waymark-dev/waymark/schemas"
)

// This file holds the transition function: given a checkpoint and one
// inbox message, the next checkpoint and the history events it writes. It
// does no I/O; engine.go loads, writes and publishes around it.

// event is a history event before encoding.
type event struct {
	typ  string
	data schemas.HistoryData
}

// step outcome of applying one message to a checkpoint.
type outcome int

const (
	outcomeApplied  outcome = iota // the checkpoint changed
	outcomeStale                   // the message does not match the current dispatch: dropped
	outcomeAttached                // a start for a job that exists: nothing to do
)

// pendingJob builds the first checkpoint of a job from a start request:
// status pending, the input as the state, nothing dispatched. Input and
// state are checked against the definition's schemas; a failure is
// schemas.ErrInputInvalid and nothing is stored.
func pendingJob(c *compiled, req *schemas.StartRequest, msgID string, now time.Time) (*schemas.Checkpoint, error) {
	inputSchema := c.input
	if req.Fork != nil {
		inputSchema = nil // a fork's input is the state it starts with
	}
	input, err := schemas.CheckJobInput(req.Input, inputSchema, c.state)
	if err != nil {
		e := schemas.AsError(err)
		return nil, (&schemas.Error{Code: e.Code, Message: e.Message, Job: req.JobID}).WithCause(e.Unwrap())
	}
	return schemas.NewPendingCheckpoint(c.def, req, input, msgID, now), nil
}

// startJob starts a pending job: it dispatches the first step.
func startJob(c *compiled, cp *schemas.Checkpoint, now time.Time) []event {
	cp.Status = schemas.JobRunning
	// Large members of the input are kept by reference from here on, in
	// the job.started event too.
	state, err := c.env.keepLarge(cp, cp.State)
	if err != nil {
		evs := []event{{typ: schemas.EventJobStarted, data: schemas.HistoryData{Job: cp.JobID, Status: string(cp.Status)}}}
		return append(evs, failJob(cp, err.At(cp.JobID, "", 0), now))
	}
	cp.State = state
	started := event{typ: schemas.EventJobStarted, data: schemas.HistoryData{Job: cp.JobID, Status: string(cp.Status)}}
	if d := c.def.Deadline; d > 0 {
		at := now.Add(time.Duration(d)).UTC()
		cp.DeadlineAt = &at
	}
	from := c.def.StartStep()
	if f := cp.Fork; f != nil && c.def.Step(f.From) != nil {
		// A fork starts where its parent was, with the parent's runs.
		from = f.From
		for _, a := range f.Approvals {
			ca := *a
			cp.Approvals = append(cp.Approvals, &ca)
		}
		for step, n := range f.Runs {
			if c.def.Step(step) != nil && n > 0 {
				rec := stepRecord(c, cp, step)
				rec.Runs, rec.Status = n, schemas.StepCompleted
			}
		}
		started.data.Reason = fmt.Sprintf("forked from job %s at seq %d", f.Parent, f.Seq)
	}
	next := enter(c, cp, from, now)
	// The input as the job holds it once started: a map starting at once
	// keeps its list by reference, in the event too.
	started.data.Input = cp.State
	return append([]event{started}, next...)
}

// enter begins a new run of step: its first dispatch, or for a parallel or
// for_each step its fan.
func enter(c *compiled, cp *schemas.Checkpoint, step string, now time.Time) []event {
	if s := c.def.Step(step); s != nil && isFan(s) {
		return startFan(c, cp, s, now)
	} else if s != nil && isAgent(s) {
		return startAgent(c, cp, s, now)
	}
	return []event{dispatch(c, cp, step, true, time.Time{}, now)}
}

// newJob builds a job's first checkpoint and starts it at once: for a start
// request whose client did not create the job first.
func newJob(c *compiled, req *schemas.StartRequest, msgID string, now time.Time) (*schemas.Checkpoint, []event, error) {
	cp, err := pendingJob(c, req, msgID, now)
	if err != nil {
		return nil, nil, err
	}
	return cp, startJob(c, cp, now), nil
}

// dispatch records the next attempt of step in cp.Current (intent before
// action, DESIGN.md invariant 2). newRun starts a new run of the step (its
// retry budget restarts); notBefore delays the attempt. A step that is not
// pure gets its effect's ledger key; a key template that cannot be
// rendered fails the job (nothing was called).
func dispatch(c *compiled, cp *schemas.Checkpoint, step string, newRun bool, notBefore, now time.Time) event {
	rec := stepRecord(c, cp, step) // entered again: the record Completed stood for comes back
	idx := c.def.StepIndex(step)
	s := c.def.Step(step)
	if cp.Fan == nil && (s.Kind == schemas.KindApproval || (s.RequiresApproval != nil && newRun)) {
		// A gate opens first: a person approves the run before it starts.
		if newRun {
			rec.Runs++
			rec.RunAttempt = 0
		}
		attempt := 0
		if s.Kind == schemas.KindApproval {
			rec.Attempts++
			rec.RunAttempt++
			attempt = rec.Attempts
		}
		return openGate(c, cp, s, rec, attempt, now)
	}
	runs := rec.Runs
	if newRun {
		runs++
	}
	var key string
	if c.def.EffectOf(s) != schemas.EffectPure {
		k, err := schemas.EffectKey(c.def, s, cp.JobID, cp.KeyBaseFor(step, runs), runs, c.keys[idx], cp.State, cp.Vars)
		if err != nil {
			return failJob(cp, &schemas.Error{Code: schemas.CodeInputInvalid, Job: cp.JobID, Step: step, Message: err.Error()}, now)
		}
		key = k
		if c.keys[idx] != nil && !slices.Contains(cp.EffectKeys, key) {
			cp.EffectKeys = append(cp.EffectKeys, key)
		}
	}
	if newRun {
		rec.Runs++
		rec.RunAttempt = 0
	}
	rec.Attempts++
	rec.RunAttempt++
	rec.Status = schemas.StepDispatched
	d := &schemas.Dispatch{
		Step:         step,
		Attempt:      rec.Attempts,
		RunAttempt:   rec.RunAttempt,
		MsgID:        schemas.StepMsgID(cp.MsgPrefix(), step, rec.Attempts),
		Pool:         c.def.PoolOf(s),
		DispatchedAt: now,
		EffectKey:    key,
	}
	if !notBefore.IsZero() && notBefore.After(now) {
		nb := notBefore
		d.NotBefore = &nb
		rec.Status = schemas.StepRetrying
	}
	if s.Kind == schemas.KindWorkflow {
		d.Child, d.NotBefore, rec.Status = schemas.ChildJobID(cp.JobID, step, rec.Runs), nil, schemas.StepDispatched
	}
	if s.Kind == schemas.KindSleep {
		if err := sleepDispatch(s, d, now); err != nil {
			return failJob(cp, err.At(cp.JobID, step, d.Attempt), now)
		}
		rec.Status, notBefore = schemas.StepDispatched, *d.Due
	}
	if w := c.waits[idx]; w != nil {
		d.Wait, d.Pool, d.NotBefore, rec.Status = w.Signal, "", nil, schemas.StepWaiting
		if w.Timeout > 0 {
			due := now.Add(time.Duration(w.Timeout))
			d.Due = &due
		}
		notBefore = time.Time{}
	}
	if cp.Fan != nil {
		cp.Fan.Running = append(cp.Fan.Running, d) // a parallel step's branch
	} else {
		cp.Current = d
	}
	return event{typ: schemas.EventStepDispatched, data: schemas.HistoryData{
		Job: cp.JobID, Step: step, Attempt: d.Attempt, Status: string(rec.Status), NotBefore: notBefore, EffectKey: key,
	}}
}

// redispatchLost gives cp's current dispatch, whose message was lost with
// the queues, a new attempt number and message id. The step's retry
// budget is untouched (its run attempt stays): the loss was not the
// step's failure. A late result of the old attempt is stale.
func redispatchLost(cp *schemas.Checkpoint, now time.Time) event {
	return redispatch(cp, now, "its message was lost with the queues (a server restart with memory queues): dispatched again")
}

// redispatch gives cp's current dispatch a new attempt number and message
// id without using up a retry, for reason.
func redispatch(cp *schemas.Checkpoint, now time.Time, reason string) event {
	d, ev := redispatchOf(cp, cp.Current, now, reason)
	cp.Current = d
	return ev
}

// redispatchOf returns a new attempt of d (a dispatch of cp, of a step
// with a record), with its message id, and its event; the caller puts it
// where d was.
func redispatchOf(cp *schemas.Checkpoint, d *schemas.Dispatch, now time.Time, reason string) (*schemas.Dispatch, event) {
	cur := *d
	rec := cp.Steps[cur.Step]
	if rec == nil { // cannot happen: a dispatched step always has a record
		rec = &schemas.StepRecord{Status: schemas.StepDispatched, Runs: 1, RunAttempt: cur.RunAttempt, Attempts: cur.Attempt}
		cp.Steps[cur.Step] = rec
	}
	rec.Attempts++
	cur.Attempt = rec.Attempts
	cur.MsgID = schemas.StepMsgID(cp.MsgPrefix(), cur.Step, rec.Attempts)
	cur.DispatchedAt = now
	return &cur, event{typ: schemas.EventStepDispatched, data: schemas.HistoryData{
		Job: cp.JobID, Step: cur.Step, Attempt: cur.Attempt, Status: string(rec.Status), Reason: reason,
	}}
}

// dispatchOrStop dispatches step (a new run of a parallel or for_each step
// starts its fan), unless the job has used up its step budget (max_steps):
// a loop that never ends fails the job instead. Map items do not count:
// for_each.max_items bounds them.
func dispatchOrStop(c *compiled, cp *schemas.Checkpoint, step string, newRun bool, notBefore, now time.Time) []event {
	used := cp.Completed.Len()
	for _, r := range cp.Steps {
		used += r.Attempts
	}
	if limit := c.def.MaxStepsOf(); used >= limit {
		return []event{failJob(cp, &schemas.Error{Code: schemas.CodeStepFailed, Job: cp.JobID, Step: step,
			Message: fmt.Sprintf("the job dispatched %d step attempts, its limit (max_steps %d): a loop that does not end?", used, limit)}, now)}
	}
	if p := expiredOutput(c, cp, step, now); newRun && p != "" {
		// An output this step may read has expired: its step runs again
		// first.
		var done []string
		if r := cp.Refresh; r != nil && r.Then == step {
			done = r.Done
		}
		cp.Refresh = &schemas.Refresh{Step: p, Then: step, Done: done}
		ev := dispatch(c, cp, p, true, time.Time{}, now)
		ev.data.Reason = fmt.Sprintf("the output of %s expired at %s (valid_for): run again before %s", p, cp.ValidUntil[p].Format(time.RFC3339), step)
		return []event{ev}
	}
	if r := cp.Refresh; r != nil && r.Step == "" {
		cp.Refresh = nil // the outputs it reads are fresh (or were made again once)
	}
	if s := c.def.Step(step); newRun && s != nil && isFan(s) {
		return startFan(c, cp, s, now)
	} else if newRun && s != nil && isAgent(s) {
		return startAgent(c, cp, s, now)
	}
	return []event{dispatch(c, cp, step, newRun, notBefore, now)}
}

// expiredOutput returns the step whose output (valid_for) expired before
// now and that is not step itself, the earliest to expire; "" when none.
func expiredOutput(c *compiled, cp *schemas.Checkpoint, step string, now time.Time) string {
	if len(cp.ValidUntil) == 0 || (cp.Refresh != nil && cp.Refresh.Step != "") {
		return ""
	}
	var done []string
	if r := cp.Refresh; r != nil && r.Then == step {
		done = r.Done
	}
	best := ""
	for p, until := range cp.ValidUntil {
		if p == step || !now.After(until) || c.def.Step(p) == nil || slices.Contains(done, p) {
			continue
		}
		if best == "" || until.Before(cp.ValidUntil[best]) {
			best = p
		}
	}
	return best
}

// waitUntil is when the next attempt of step s follows one answered
// CodeWaiting by e: after the provider's Retry-After when it gave one, else
// the retry policy's first delay.
func waitUntil(c *compiled, s *schemas.Step, e *schemas.Error, now time.Time) time.Time {
	if e.RetryAfterMs > 0 {
		return now.Add(time.Duration(e.RetryAfterMs) * time.Millisecond)
	}
	return now.Add(c.def.RetryOf(s).Delay(2))
}

// applyResult applies a step result to cp (a private copy) and returns the
// events written. A result that does not match cp.Current exactly (step and
// attempt) is stale (DESIGN.md invariant 3): cp is left unchanged.
func applyResult(c *compiled, cp *schemas.Checkpoint, res *schemas.StepResult, now time.Time) (outcome, []event) {
	if !resultMayApply(cp, res) {
		return outcomeStale, nil
	}
	idx := c.def.StepIndex(res.Step)
	if idx < 0 {
		return outcomeStale, nil
	}
	if cp.Fan != nil {
		return outcomeApplied, applyFanResult(c, cp, res, now)
	}
	step := &c.def.Steps[idx]
	rec := cp.Steps[res.Step]
	rec.DurationMs = res.DurationMs
	var evs []event
	if res.Error != nil && res.Error.Code == schemas.CodeDefinitionMissing {
		// The worker could not load the definition this engine has now: not
		// the step's failure, so no retry is used up.
		return outcomeApplied, []event{redispatch(cp, now, "the worker could not load the definition ("+res.Error.Message+"): dispatched again")}
	}
	if res.Error != nil && res.Error.Code == schemas.CodeWaiting {
		// The step waits on something outside it (another job's call under
		// the same idempotency key): try again later, without using up an
		// attempt. max_steps still bounds how long.
		ev := redispatch(cp, now, res.Error.Message+": dispatched again later")
		nb := waitUntil(c, step, res.Error, now)
		cp.Current.NotBefore = &nb
		cp.Steps[res.Step].Status = schemas.StepRetrying
		ev.data.NotBefore, ev.data.Status = nb, string(schemas.StepRetrying)
		return outcomeApplied, []event{ev}
	}

	stepErr := res.Error
	var newState json.RawMessage
	var stateDoc, outDoc any
	if stepErr == nil {
		var err *schemas.Error
		newState, stateDoc, outDoc, err = mergeResult(c, cp, idx, res.Output)
		if err != nil {
			stepErr = err
		}
	}
	if stepErr != nil {
		if stepErr.Code == schemas.CodeAmbiguous {
			return outcomeApplied, append(evs, blockStep(c, cp, step, rec, res, stepErr.At(cp.JobID, res.Step, res.Attempt)))
		}
		return outcomeApplied, append(evs, failAttempt(c, cp, step, rec, res, stepErr.At(cp.JobID, res.Step, res.Attempt), now)...)
	}

	cp.State = newState
	rec.Status = schemas.StepCompleted
	rec.LastError = nil
	rec.ResultDigest = digest(res.Output)
	cp.Current = nil
	if step.ValidFor > 0 {
		if cp.ValidUntil == nil {
			cp.ValidUntil = map[string]time.Time{}
		}
		cp.ValidUntil[step.ID] = now.Add(time.Duration(step.ValidFor)).UTC()
	}
	evs = append(evs, event{typ: schemas.EventStepCompleted, data: schemas.HistoryData{
		Job: cp.JobID, Step: res.Step, Attempt: res.Attempt, Status: string(rec.Status),
		DurationMs: res.DurationMs, ResultDigest: rec.ResultDigest,
	}})
	return outcomeApplied, append(evs, follow(c, cp, idx, rec, stateDoc, outDoc, now, &evs[len(evs)-1])...)
}

// follow takes the first transition of step idx whose condition holds, now
// that the step completed with rec; completed is its step.completed event,
// which gets the step dispatched next.
func follow(c *compiled, cp *schemas.Checkpoint, idx int, rec *schemas.StepRecord, stateDoc, outDoc any, now time.Time, completed *event) []event {
	id := c.def.Steps[idx].ID
	attempt := completed.data.Attempt
	if rec.Attempts == 1 && rec.Runs == 1 {
		// Nothing to remember but "done": keep the checkpoint from growing
		// with the steps a job has done.
		delete(cp.Steps, id)
		cp.Completed = cp.Completed.With(idx)
	}
	if r := cp.Refresh; r != nil && r.Step == id {
		// Run again because its output had expired: what was about to
		// run goes now (unless another output it reads expired meanwhile).
		cp.Refresh = &schemas.Refresh{Then: r.Then, Done: append(slices.Clone(r.Done), id)}
		completed.data.Next = r.Then
		return dispatchOrStop(c, cp, r.Then, true, time.Time{}, now)
	}
	env := conditionEnv{State: stateDoc, Output: outDoc, Vars: cp.Vars, Step: id, Attempt: rec.RunAttempt}
	for j, t := range c.next[idx] {
		if t.prog != nil {
			ok, err := expr.Run(t.prog, env)
			if err != nil {
				e := schemas.Errorf(schemas.CodeDefinitionInvalid, "steps[%d].next[%d].when %q: %v", idx, j, t.When, err).At(cp.JobID, id, attempt)
				return []event{failJob(cp, e, now)}
			}
			if b, _ := ok.(bool); !b {
				continue
			}
		}
		switch {
		case t.Fail != "":
			e := &schemas.Error{Code: schemas.CodeStepFailed, Message: t.Fail, Job: cp.JobID, Step: id, Attempt: attempt}
			return []event{failJob(cp, e, now)}
		case t.End:
			return []event{completeJob(cp, now)}
		default:
			completed.data.Next = t.To
			return dispatchOrStop(c, cp, t.To, true, time.Time{}, now)
		}
	}
	return []event{completeJob(cp, now)}
}

// mergeResult validates a step's output and merges it into state: under
// step.SaveAs when set, else key by key at the top level. It returns the
// new state, and its decoded form and the output's when a condition or
// the state schema needs them.
func mergeResult(c *compiled, cp *schemas.Checkpoint, idx int, output json.RawMessage) (json.RawMessage, any, any, *schemas.Error) {
	state := cp.State
	step := &c.def.Steps[idx]
	output = bytes.TrimSpace(output)
	if len(output) == 0 {
		output = json.RawMessage("null")
	}
	if schemas.HasRefs(output) {
		// References the job owns (a child job's large members, stored
		// under this job's name) are taken; any other is refused.
		refs, _ := schemas.FindRefs(output)
		for _, r := range refs {
			if !c.env.owns(cp, r) {
				return nil, nil, nil, schemas.Errorf(schemas.CodeOutputInvalid, "output holds a %s reference to a value job %s does not have", schemas.ValueRefMember, cp.JobID)
			}
		}
	}
	var outDoc any
	if c.output[idx] != nil || c.needsDoc[idx] {
		var err error
		if outDoc, err = decodePlain(output); err != nil {
			return nil, nil, nil, schemas.Errorf(schemas.CodeOutputInvalid, "output is not JSON: %v", err)
		}
		if err := c.output[idx].Validate(outDoc); err != nil {
			return nil, nil, nil, &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true,
				Message: fmt.Sprintf("output does not match steps[%d].output_schema: %v", idx, err)}
		}
	} else if !json.Valid(output) {
		return nil, nil, nil, schemas.Errorf(schemas.CodeOutputInvalid, "output is not valid JSON")
	}
	newState := state
	switch {
	case step.SaveAs != "":
		key, _ := json.Marshal(step.SaveAs)
		ns, err := setMembers(state, []member{{key: key, value: output}})
		if err != nil {
			return nil, nil, nil, schemas.Errorf(schemas.CodeOutputInvalid, "state is not a JSON object")
		}
		newState = ns
	case string(output) == "null" || string(output) == "{}":
		// nothing to merge
	default:
		set, err := members(output)
		if err != nil {
			return nil, nil, nil, &schemas.Error{Code: schemas.CodeOutputInvalid,
				Message: "output must be a JSON object to merge into state (or set save_as)"}
		}
		if len(set) > 0 {
			ns, err := setMembers(state, set)
			if err != nil {
				return nil, nil, nil, schemas.Errorf(schemas.CodeOutputInvalid, "state is not a JSON object")
			}
			newState = ns
		}
	}
	newState, serr := c.env.keepLarge(cp, newState)
	if serr != nil {
		return nil, nil, nil, serr
	}
	var stateDoc any
	if c.needsDoc[idx] {
		var err error
		if stateDoc, err = decodePlain(c.env.resolve(cp, newState)); err != nil {
			return nil, nil, nil, schemas.Errorf(schemas.CodeOutputInvalid, "decode state: %v", err)
		}
		if err := c.state.Validate(stateDoc); err != nil {
			return nil, nil, nil, &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true,
				Message: fmt.Sprintf("output would make state invalid against state_schema: %v", err)}
		}
	}
	return newState, stateDoc, outDoc, nil
}

// failAttempt records a failed attempt: another attempt after the retry
// delay when the error is retryable and the budget allows, else the step
// fails for good and the job follows on_error or fails. A step that fails
// for good while its effect may have happened (the ledger says the call
// was dispatched and its outcome never recorded) does neither: the job
// stops in needs_reconciliation, for a person to say what happened.
func failAttempt(c *compiled, cp *schemas.Checkpoint, step *schemas.Step, rec *schemas.StepRecord, res *schemas.StepResult, e *schemas.Error, now time.Time) []event {
	policy := c.def.RetryOf(step)
	retry := e.Retryable && rec.RunAttempt < policy.MaxAttempts
	rec.LastError = e
	ev := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{
		Job: cp.JobID, Step: step.ID, Attempt: cp.Current.Attempt, Error: e, Retrying: retry, DurationMs: rec.DurationMs,
		EffectKey: res.EffectKey, EffectState: string(res.EffectState),
	}}
	if retry {
		next := now.Add(policy.Delay(rec.RunAttempt + 1))
		ev.data.NotBefore = next
		return append([]event{ev}, dispatchOrStop(c, cp, step.ID, false, next, now)...)
	}
	if outcomeUnknown(c, step, res) {
		ev.data.Reason = "the step failed for good while its effect may have happened"
		return []event{ev, blockStep(c, cp, step, rec, res, e)}
	}
	rec.Status = schemas.StepFailed
	cp.Current = nil
	if r := cp.Refresh; r != nil && r.Step == step.ID {
		cp.Refresh = nil // it failed running again: what waited on it does not go
	}
	if step.OnError != "" {
		ev.data.Next = step.OnError
		return append([]event{ev}, dispatchOrStop(c, cp, step.OnError, true, time.Time{}, now)...)
	}
	return []event{ev, failJob(cp, e, now)}
}

// outcomeUnknown reports whether a failed attempt of step may have left
// its effect done: the step is not pure and the ledger state it reported
// says the call was dispatched (or its outcome is already ambiguous).
func outcomeUnknown(c *compiled, step *schemas.Step, res *schemas.StepResult) bool {
	if c.def.EffectOf(step) == schemas.EffectPure {
		return false
	}
	switch res.EffectState {
	case schemas.EffectDispatched, schemas.EffectAmbiguous:
		return true
	}
	return false
}

// blockStep parks the job: the step's effect may have happened, and only a
// person (engine effects resolve) or a late answer can say whether.
func blockStep(c *compiled, cp *schemas.Checkpoint, step *schemas.Step, rec *schemas.StepRecord, res *schemas.StepResult, e *schemas.Error) event {
	b, ev := blockedOf(c, cp, cp.Current, step, rec, res, e)
	cp.Current = nil
	cp.Status = schemas.JobNeedsReconciliation
	cp.Blocked = b
	ev.data.Status = string(cp.Status)
	return ev
}

// blockedOf marks step's record blocked (its effect, the one of res or of
// d, may have happened) and returns what the job waits on, and its event.
func blockedOf(c *compiled, cp *schemas.Checkpoint, d *schemas.Dispatch, step *schemas.Step, rec *schemas.StepRecord, res *schemas.StepResult, e *schemas.Error) (*schemas.Blocked, event) {
	key := res.EffectKey
	if key == "" && d != nil {
		key = d.EffectKey
	}
	rec.Status = schemas.StepBlocked
	rec.LastError = e
	b := &schemas.Blocked{Step: step.ID, Item: res.Item, EffectKey: key, Class: c.def.EffectOf(step), Reason: e.Message, LastError: e}
	if res.Item != 0 && d != nil {
		b.Attempt = d.Attempt
	}
	return b, event{typ: schemas.EventStepBlocked, data: schemas.HistoryData{
		Job: cp.JobID, Step: step.ID, Attempt: res.Attempt, Item: res.Item, Status: string(schemas.JobNeedsReconciliation), Error: e, EffectKey: key,
	}}
}

// applySignal applies a person's decision. An effect resolved for the
// effect the job is blocked on unblocks it: the step gets a new attempt,
// which finds the settled record in the ledger. Anything else is stale.
func applySignal(c *compiled, cp *schemas.Checkpoint, sig *schemas.Signal, now time.Time) (outcome, []event) {
	if !signalMayApply(cp, sig) {
		return outcomeStale, nil
	}
	if sig.Type != schemas.SignalCancel && sig.Type != schemas.SignalEffectResolved {
		return applyControl(c, cp, sig, now)
	}
	if sig.Type == schemas.SignalCancel {
		if c != nil && cp.Fan != nil && cp.Fan.Agent != nil {
			keepTranscript(c, cp) // what the agent did stays readable
		}
		return outcomeApplied, []event{cancelJob(cp, sig, now)}
	}
	if cp.Fan != nil {
		b, ok := resolveInFan(cp, sig.Key)
		if !ok {
			return outcomeStale, nil
		}
		evs := []event{{typ: schemas.EventStepUnblocked, data: schemas.HistoryData{Job: cp.JobID, Step: b.Step, Item: b.Item, EffectKey: sig.Key, By: sig.By}}}
		return outcomeApplied, append(evs, resumeFan(c, cp, b, now)...)
	}
	b := cp.Blocked
	cp.Status = schemas.JobRunning
	cp.Blocked = nil
	evs := []event{{typ: schemas.EventStepUnblocked, data: schemas.HistoryData{Job: cp.JobID, Step: b.Step, Item: b.Item, EffectKey: sig.Key, By: sig.By}}}
	return outcomeApplied, append(evs, dispatchOrStop(c, cp, b.Step, false, time.Time{}, now)...)
}

// cancelJob ends cp as cancelled by sig's person: what was in flight is
// named in the event (its results, when they come, are stale; an effect
// in flight is in the ledger as whatever it became), and child jobs in
// flight are cancelled after the write (afterWrite).
func cancelJob(cp *schemas.Checkpoint, sig *schemas.Signal, now time.Time) event {
	inFlight := inFlightOf(cp)
	by := sig.By
	if by == "" {
		by = "someone"
	}
	msg := "by " + by
	if sig.Reason != "" {
		msg += ": " + sig.Reason
	}
	reason := msg
	if len(inFlight) > 0 {
		reason += "; in flight: " + strings.Join(inFlight, ", ")
	}
	cp.Status = schemas.JobCancelled
	cp.Error = &schemas.Error{Code: schemas.CodeCancelled, Job: cp.JobID, Message: msg}
	closeGates(cp, now, "the job was cancelled")
	cp.Current, cp.Fan, cp.Blocked = nil, nil, nil
	cp.BlockedFrom, cp.BlockedReason = "", ""
	t := now
	cp.CompletedAt = &t
	return event{typ: schemas.EventJobCancelled, data: schemas.HistoryData{Job: cp.JobID, Status: string(cp.Status), By: by, Reason: reason, Error: cp.Error}}
}

// inFlightOf names what cp has in flight, for the record of a job stopped
// (cancelled, past its deadline): steps, items and tool calls with their
// effect keys or child jobs, and the effect a blocked job waits on.
func inFlightOf(cp *schemas.Checkpoint) []string {
	var inFlight []string
	for _, d := range cp.Dispatches() {
		what := d.Step
		if a := agentOf(cp); d.Item > 0 && a != nil && a.CallByItem(d.Item) != nil {
			call := a.CallByItem(d.Item)
			what += "." + call.Name + " call " + call.ID
		} else if d.Item > 0 {
			what += fmt.Sprintf("#%d", d.Item)
		}
		switch {
		case d.Child != "":
			what += " (child job " + d.Child + ")"
		case d.EffectKey != "":
			what += " (effect " + d.EffectKey + ")"
		}
		inFlight = append(inFlight, what)
	}
	if b := cp.Blocked; b != nil && !slices.ContainsFunc(cp.Dispatches(), func(d *schemas.Dispatch) bool { return d.EffectKey == b.EffectKey }) {
		inFlight = append(inFlight, b.Step+" (effect "+b.EffectKey+", its outcome unknown)")
	}
	return inFlight
}

// agentOf returns cp's running agent loop, or nil.
func agentOf(cp *schemas.Checkpoint) *schemas.AgentRun {
	if cp.Fan == nil {
		return nil
	}
	return cp.Fan.Agent
}

func failJob(cp *schemas.Checkpoint, e *schemas.Error, now time.Time) event {
	cp.Status = schemas.JobFailed
	cp.Error = e
	cp.Current, cp.Fan = nil, nil
	closeGates(cp, now, "the job failed")
	t := now
	cp.CompletedAt = &t
	return event{typ: schemas.EventJobFailed, data: schemas.HistoryData{Job: cp.JobID, Status: string(cp.Status), Error: e}}
}

func completeJob(cp *schemas.Checkpoint, now time.Time) event {
	cp.Paused = nil // nothing is held any more
	cp.Status = schemas.JobCompleted
	cp.Current, cp.Fan = nil, nil
	t := now
	cp.CompletedAt = &t
	return event{typ: schemas.EventJobCompleted, data: schemas.HistoryData{Job: cp.JobID, Status: string(cp.Status), ResultDigest: digest(cp.State)}}
}

// digest is schemas.Digest.
func digest(b []byte) string { return schemas.Digest(b) }

// cloneCheckpoint copies cp deeply enough that applying a transition to
// the copy leaves cp (as cached) untouched. The copy has no events: the
// next checkpoint's outbox is built by setOutbox.
func cloneCheckpoint(cp *schemas.Checkpoint) *schemas.Checkpoint {
	c := *cp
	c.Steps = make(map[string]*schemas.StepRecord, len(cp.Steps))
	for k, v := range cp.Steps {
		r := *v
		c.Steps[k] = &r
	}
	if cp.Current != nil {
		d := *cp.Current
		c.Current = &d
	}
	if cp.Fan != nil {
		c.Fan = cp.Fan.Clone()
	}
	c.Events, c.Unsaved = nil, nil
	return &c
}
