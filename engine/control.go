package engine

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/expr-lang/expr"

	"github.com/waymark-dev/waymark/schemas"
)

// A gate is an approval waiting for a person: cp.Current is a dispatch
// with Gate set (the approval's id), of the approval step or of the step
// whose requires_approval opened it; no message is published for it and
// the job is JobWaitingApproval. A decision is applied as that
// dispatch's result, so an approval step's output, its transitions and
// its on_error work as any step's.

// gateMsgID is the dedup id of a gate's dispatch (never published; it
// tells dispatches apart).
func gateMsgID(cp *schemas.Checkpoint, step string, run int) string {
	return cp.MsgPrefix() + "/" + step + "/gate-" + strconv.Itoa(run)
}

// openGate opens the approval gate of run rec.Runs of step s (rec counts
// the run already): the action is rendered and bound by its digest, the
// job waits in JobWaitingApproval. attempt is the gate dispatch's attempt
// (an approval step's own; 0 before a requires_approval step's run).
func openGate(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, rec *schemas.StepRecord, attempt int, now time.Time) event {
	idx := c.def.StepIndex(s.ID)
	set, err := schemas.ApprovalOf(s)
	if err != nil || set == nil {
		if err == nil {
			err = fmt.Errorf("step %s has no approval settings", s.ID)
		}
		return failJob(cp, &schemas.Error{Code: schemas.CodeDefinitionInvalid, Job: cp.JobID, Step: s.ID, Message: err.Error()}, now)
	}
	gate, fail := c.renderGate(cp, s, idx, rec.Runs, set)
	if fail != nil {
		return failJob(cp, fail, now)
	}
	gate.RequestedAt = now
	if set.ExpiresIn > 0 {
		t := now.Add(time.Duration(set.ExpiresIn))
		gate.ExpiresAt = &t
	}
	cp.Approvals = append(cp.Approvals, gate)
	rec.Status = schemas.StepWaiting
	cp.Status = schemas.JobWaitingApproval
	cp.Current = &schemas.Dispatch{Step: s.ID, Attempt: attempt, RunAttempt: rec.RunAttempt, MsgID: gateMsgID(cp, s.ID, rec.Runs),
		DispatchedAt: now, Gate: gate.ID}
	shown := *gate
	return event{typ: schemas.EventApprovalRequested, data: schemas.HistoryData{Job: cp.JobID, Step: s.ID, Status: string(gate.Status), Approval: &shown}}
}

// renderGate builds the approval of run run of step s: the action
// rendered from its template (or "run step S" and its effect key), the
// bound data, and the digest of both with the step's settings.
func (c *compiled) renderGate(cp *schemas.Checkpoint, s *schemas.Step, idx, run int, set *schemas.ApprovalSettings) (*schemas.Approval, *schemas.Error) {
	var key string
	if s.Kind != schemas.KindApproval && c.def.EffectOf(s) != schemas.EffectPure {
		k, err := schemas.EffectKey(c.def, s, cp.JobID, cp.KeyBaseFor(s.ID, run), run, c.keys[idx], cp.State, cp.Vars)
		if err != nil {
			return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Job: cp.JobID, Step: s.ID, Message: err.Error()}
		}
		key = k
	}
	action := "run step " + s.ID
	if key != "" {
		action += " (effect " + key + ")"
	}
	if t := c.actions[idx]; t != nil {
		text, err := schemas.RenderTemplate(t, cp.JobID, s.ID, cp.State, cp.Vars)
		if err != nil {
			return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Job: cp.JobID, Step: s.ID, Message: "approval action: " + err.Error()}
		}
		action = text
	}
	action = printable(action)
	data := json.RawMessage(cp.State)
	if set.Data != "" {
		v, _, err := cutPath(cp.State, strings.Split(set.Data, "."))
		if err != nil {
			return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Job: cp.JobID, Step: s.ID, Message: fmt.Sprintf("approval data: state.%s: %v", set.Data, err)}
		}
		data = v
	}
	var with json.RawMessage
	if s.Kind != schemas.KindApproval {
		with = s.With
	}
	var scope *schemas.ApprovalScope
	if set.Scope != nil {
		sc := *set.Scope
		if len(sc.Steps) == 0 {
			sc.Steps = []string{s.ID} // requires_approval: the step itself
		}
		scope = &sc
	}
	bound, _ := schemas.Marshal(struct {
		Gate      string                 `json:"gate"`
		Action    string                 `json:"action"`
		Data      json.RawMessage        `json:"data,omitempty"`
		With      json.RawMessage        `json:"with,omitempty"`
		EffectKey string                 `json:"effect_key,omitempty"`
		Scope     *schemas.ApprovalScope `json:"scope,omitempty"`
	}{s.ID, action, data, with, key, scope})
	sum := sha256.Sum256(bound)
	if len(data) > maxGateData {
		data = nil // bound by the digest, not copied into every checkpoint
	}
	return &schemas.Approval{
		ID: uniqueApprovalID(cp, s.ID+"/"+strconv.Itoa(run)), Gate: s.ID, Run: run, Digest: hex.EncodeToString(sum[:]), Action: action, Data: data,
		Scope: scope, Approvers: set.Approvers, Status: schemas.ApprovalPending,
	}, nil
}

// printable is s with its control characters (a terminal's escape
// sequences, carriage returns) written as \u escapes: an approval's action
// is shown to people, and text from state must not change what they see.
func printable(s string) string {
	if !strings.ContainsFunc(s, unicode.IsControl) {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if unicode.IsControl(r) {
			fmt.Fprintf(&b, "\\u%04x", r)
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

// closeGates expires cp's open gates, which nothing can decide any more:
// the job ended, or left the timeline they were in (why says which).
func closeGates(cp *schemas.Checkpoint, now time.Time, why string) {
	for _, a := range cp.Approvals {
		if a.Status == schemas.ApprovalPending {
			t := now
			a.Status, a.DecidedAt, a.Reason = schemas.ApprovalExpired, &t, "discarded: "+why
		}
	}
	if cp.Status.Terminal() {
		cp.Paused = nil // nothing is held any more
	}
}

// uniqueApprovalID is id, or, when cp has an approval of that id already
// (a gate reached again after a retry or a rewind, whose run number comes
// back), id with ".<n>" added.
func uniqueApprovalID(cp *schemas.Checkpoint, id string) string {
	if cp.ApprovalByID(id) == nil {
		return id
	}
	for n := 2; ; n++ {
		if c := id + "." + strconv.Itoa(n); cp.ApprovalByID(c) == nil {
			return c
		}
	}
}

// maxGateData is the largest bound value an approval keeps a copy of
// (bytes); a larger one is bound by the digest alone.
const maxGateData = 2 << 10

// sleepDispatch makes d, the dispatch of sleep step s, wait for its timer.
func sleepDispatch(s *schemas.Step, d *schemas.Dispatch, now time.Time) *schemas.Error {
	set, err := schemas.SleepOf(s)
	if err != nil {
		return &schemas.Error{Code: schemas.CodeDefinitionInvalid, Step: s.ID, Message: err.Error()}
	}
	if d.Due == nil {
		due := now.Add(time.Duration(set.For))
		d.Due = &due
	}
	d.Pool, d.NotBefore = "", nil
	return nil
}

// controlMayApply reports whether sig, a control or approval signal, can
// change cp; see applyControl.
func controlMayApply(cp *schemas.Checkpoint, sig *schemas.Signal) bool {
	switch sig.Type {
	case schemas.SignalPause:
		return !cp.Status.Terminal() && cp.Paused == nil
	case schemas.SignalResume:
		return !cp.Status.Terminal() && cp.Paused != nil
	case schemas.SignalRetry:
		// The failure its sender saw (Seq), not a later one: two retries
		// of one failure reopen the job once.
		return cp.Status == schemas.JobFailed && (sig.Seq == 0 || sig.Seq == cp.Seq)
	case schemas.SignalApprove, schemas.SignalReject:
		a := cp.ApprovalByID(sig.Key)
		if a == nil {
			a = cp.PendingApproval(sig.Gate)
		}
		return a != nil && a.Status == schemas.ApprovalPending && gateOpen(cp, a.ID) && (sig.Digest == "" || sig.Digest == a.Digest)
	case schemas.SignalApprovalExpired:
		a := cp.ApprovalByID(sig.Key)
		return a != nil && a.Status == schemas.ApprovalPending && gateOpen(cp, a.ID)
	case schemas.SignalUser:
		return !cp.Status.Terminal() && !slices.ContainsFunc(cp.Signals, func(r *schemas.ReceivedSignal) bool { return r.ID == sig.ID })
	case schemas.SignalWaitTimeout:
		return cp.Status == schemas.JobRunning && cp.Current != nil && cp.Current.Wait != "" && cp.Current.MsgID == sig.Key
	case schemas.SignalRewind:
		return cp.Status == schemas.JobFailed || cp.Status == schemas.JobCompleted || cp.Status == schemas.JobWaitingApproval ||
			(cp.Paused != nil && !cp.Status.Terminal())
	case schemas.SignalMigrate:
		return cp.Migratable()
	case schemas.SignalJobDeadline:
		return !cp.Status.Terminal() && cp.DeadlineAt != nil
	}
	return false
}

// applyControl applies a control signal (pause, resume, retry) or an
// approval decision (approve, reject, the gate's expiry) to cp.
func applyControl(c *compiled, cp *schemas.Checkpoint, sig *schemas.Signal, now time.Time) (outcome, []event) {
	if !controlMayApply(cp, sig) {
		return outcomeStale, nil
	}
	switch sig.Type {
	case schemas.SignalPause, schemas.SignalResume, schemas.SignalRetry, schemas.SignalRewind:
		cp.LastControl = &schemas.ControlRecord{ID: sig.ID, Type: sig.Type, By: sig.By, At: now}
	}
	switch sig.Type {
	case schemas.SignalPause:
		cp.Paused = &schemas.Pause{By: sig.By, Reason: sig.Reason, At: now}
		running := len(cp.Dispatches())
		reason := sig.Reason
		if running > 0 {
			reason = strings.TrimPrefix(reason+"; ", "; ") + countOf(running, "dispatch") + " in flight may finish"
		}
		return outcomeApplied, []event{{typ: schemas.EventJobPaused, data: schemas.HistoryData{Job: cp.JobID, By: sig.By, Reason: reason}}}
	case schemas.SignalResume:
		cp.Paused = nil
		released := 0
		for _, d := range cp.Dispatches() {
			if d.Held {
				d.Held, d.DispatchedAt = false, now
				released++
			}
		}
		return outcomeApplied, []event{{typ: schemas.EventJobUnpaused, data: schemas.HistoryData{Job: cp.JobID, By: sig.By, Reason: strings.TrimPrefix(sig.Reason+"; ", "; ") + countOf(released, "held dispatch") + " sent"}}}
	case schemas.SignalRetry:
		return outcomeApplied, retryJob(c, cp, sig, now)
	case schemas.SignalRewind:
		return outcomeApplied, rewindJob(c, cp, sig, now)
	case schemas.SignalJobDeadline:
		if now.Before(*cp.DeadlineAt) {
			return outcomeStale, nil // early by the engine's clock: the reconciler sends it again
		}
		return outcomeApplied, []event{deadlineJob(c, cp, now)}
	case schemas.SignalUser:
		return outcomeApplied, receiveSignal(c, cp, sig, now)
	case schemas.SignalWaitTimeout:
		cur := cp.Current
		w := c.waits[c.def.StepIndex(cur.Step)]
		_, evs := applyResult(c, cp, &schemas.StepResult{Job: cp.JobID, Step: cur.Step, Attempt: cur.Attempt, Error: &schemas.Error{
			Code: schemas.CodeTimeout, Message: fmt.Sprintf("no signal %s came within %v", cur.Wait, time.Duration(w.Timeout))}}, now)
		return outcomeApplied, evs
	}
	// A decision on an open gate.
	a := cp.ApprovalByID(sig.Key)
	if a == nil {
		a = cp.PendingApproval(sig.Gate)
	}
	decided := now
	switch {
	case sig.Type == schemas.SignalApprovalExpired, a.ExpiresAt != nil && !now.Before(*a.ExpiresAt):
		// Past the expiry by the engine's clock: a late decision is refused
		// and the gate expires now.
		a.Status, a.DecidedBy = schemas.ApprovalExpired, ""
		a.Reason = "expired at " + a.ExpiresAt.UTC().Format(time.RFC3339)
		if sig.Type != schemas.SignalApprovalExpired {
			a.Reason += "; " + map[string]string{schemas.SignalApprove: "an approval", schemas.SignalReject: "a rejection"}[sig.Type] + " by " + sig.By + " came after"
		}
	case sig.Type == schemas.SignalApprove:
		a.Status, a.DecidedBy, a.Reason = schemas.ApprovalApproved, sig.By, sig.Reason
	default:
		a.Status, a.DecidedBy, a.Reason = schemas.ApprovalRejected, sig.By, sig.Reason
	}
	a.DecidedAt = &decided
	shown := *a
	evs := []event{{typ: schemas.EventApprovalDecided, data: schemas.HistoryData{Job: cp.JobID, Step: a.Gate, Status: string(a.Status), By: a.DecidedBy, Reason: a.Reason, Approval: &shown}}}
	if call := gatedCall(cp, a.ID); call != nil {
		return outcomeApplied, append(evs, decideCallGate(c, cp, a, call, now)...)
	}
	s := c.def.Step(a.Gate)
	cur := cp.Current
	res := &schemas.StepResult{Job: cp.JobID, Step: cur.Step, Attempt: cur.Attempt}
	switch a.Status {
	case schemas.ApprovalApproved:
		out, _ := schemas.Marshal(schemas.ApprovalOutput{Approved: true, By: a.DecidedBy, Reason: a.Reason, Digest: a.Digest, DecidedAt: decided})
		res.Output = out
	case schemas.ApprovalRejected:
		msg := "rejected by " + a.DecidedBy
		if a.Reason != "" {
			msg += ": " + a.Reason
		}
		res.Error = &schemas.Error{Code: schemas.CodeApprovalRejected, Message: "approval " + a.ID + " " + msg}
	default:
		res.Error = &schemas.Error{Code: schemas.CodeApprovalExpired, Message: "approval " + a.ID + " " + a.Reason}
	}
	cp.Status = schemas.JobRunning
	if s.Kind != schemas.KindApproval && a.Status == schemas.ApprovalApproved {
		cp.Current = nil
		if p := expiredOutput(c, cp, s.ID, now); p != "" {
			// An output the step reads expired while it waited: its step
			// runs again, and the guarded step then opens a new gate, for
			// what it will send now.
			cp.Refresh = &schemas.Refresh{Step: p, Then: s.ID}
			ev := dispatch(c, cp, p, true, time.Time{}, now)
			ev.data.Reason = fmt.Sprintf("the output of %s expired at %s (valid_for) while %s waited for approval: run again, and %s asks again", p, cp.ValidUntil[p].Format(time.RFC3339), s.ID, s.ID)
			return outcomeApplied, append(evs, ev)
		}
		// The guarded step's run begins: its first attempt.
		return outcomeApplied, append(evs, dispatch(c, cp, s.ID, false, time.Time{}, now))
	}
	if s.Kind != schemas.KindApproval {
		// No attempt ran: the step fails for good without one.
		rec := cp.Steps[s.ID]
		rec.Status, rec.LastError = schemas.StepFailed, res.Error.At(cp.JobID, s.ID, 0)
		cp.Current = nil
		fail := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{Job: cp.JobID, Step: s.ID, Error: rec.LastError}}
		if s.OnError != "" {
			fail.data.Next = s.OnError
			return outcomeApplied, append(append(evs, fail), dispatchOrStop(c, cp, s.OnError, true, time.Time{}, now)...)
		}
		return outcomeApplied, append(evs, fail, failJob(cp, rec.LastError, now))
	}
	_, resEvs := applyResult(c, cp, res, now)
	return outcomeApplied, append(evs, resEvs...)
}

// receiveSignal records sig, a named signal, in cp: the wait step the job
// is at takes it when it matches (its name, schema and condition), else it
// is kept for a later wait step. A signal whose data breaks the schema of
// the wait step that would take it is refused (recorded, not kept).
func receiveSignal(c *compiled, cp *schemas.Checkpoint, sig *schemas.Signal, now time.Time) []event {
	rs := &schemas.ReceivedSignal{ID: sig.ID, Name: sig.Name, Data: sig.Data, By: sig.By, At: now}
	evs := receive(c, cp, rs, now)
	last := *rs
	last.Data = nil // its sender knows it; the kept copy has it
	switch {
	case rs.Taken != "":
		last.Outcome = "taken"
	case rs.Refused != "":
		last.Outcome = "refused"
	case slices.Contains(cp.Signals, rs):
		last.Outcome = "kept"
	default:
		last.Outcome = "dropped"
	}
	cp.LastSignal = &last
	return evs
}

func receive(c *compiled, cp *schemas.Checkpoint, rs *schemas.ReceivedSignal, now time.Time) []event {
	sig := rs
	ev := event{typ: schemas.EventSignalReceived, data: schemas.HistoryData{Job: cp.JobID, By: sig.By}}
	if w := waitingFor(c, cp); w != nil && w.Signal == rs.Name {
		ok, why := w.accepts(cp, rs)
		if why != "" {
			rs.Refused = "wait step " + cp.Current.Step + ": " + why
			keepSignal(cp, rs)
			ev.data.Reason, ev.data.Step = "refused: "+why, cp.Current.Step
			shown := *rs
			ev.data.Signal = &shown
			return []event{ev}
		}
		if ok {
			return append([]event{ev}, takeSignal(c, cp, rs, &ev, now)...)
		}
	}
	kept := 0
	for _, r := range cp.Signals {
		if r.Taken == "" && r.Refused == "" {
			kept++
		}
	}
	if kept >= schemas.MaxKeptSignals {
		ev.data.Reason = fmt.Sprintf("dropped: %d signals wait for a step to take them already", kept)
		shown := *rs
		ev.data.Signal = &shown
		return []event{ev}
	}
	keepSignal(cp, rs)
	ev.data.Reason = "kept for a wait step"
	shown := *rs
	ev.data.Signal = &shown
	return []event{ev}
}

// waitingFor returns the wait step cp's current dispatch is, or nil.
func waitingFor(c *compiled, cp *schemas.Checkpoint) *waitStep {
	if cp.Current == nil || cp.Current.Wait == "" || cp.Status != schemas.JobRunning {
		return nil
	}
	if i := c.def.StepIndex(cp.Current.Step); i >= 0 {
		return c.waits[i]
	}
	return nil
}

// accepts reports whether w takes rs: its data against the schema (why
// says how it breaks it) and the condition.
func (w *waitStep) accepts(cp *schemas.Checkpoint, rs *schemas.ReceivedSignal) (bool, string) {
	data := rs.Data
	if len(data) == 0 {
		data = json.RawMessage("null")
	}
	var doc any
	if err := json.Unmarshal(data, &doc); err != nil {
		return false, "its data is not JSON"
	}
	if w.schema != nil {
		if err := w.schema.Validate(doc); err != nil {
			return false, "its data does not satisfy the wait step's schema: " + schemas.AsError(err).Message
		}
	}
	if w.when == nil {
		return true, ""
	}
	var state any
	_ = json.Unmarshal(cp.State, &state)
	out, err := expr.Run(w.when, waitEnv{Data: doc, State: state, Vars: cp.Vars})
	if err != nil {
		return false, "the wait step's condition failed on it: " + err.Error()
	}
	b, _ := out.(bool)
	return b, ""
}

// takeSignal completes the wait step at cp.Current with rs (recorded as
// taken) and returns the events of what follows; ev is rs's
// signal.received event, which gets the step.
func takeSignal(c *compiled, cp *schemas.Checkpoint, rs *schemas.ReceivedSignal, ev *event, now time.Time) []event {
	cur := cp.Current
	rs.Taken = cur.Step
	if !slices.Contains(cp.Signals, rs) {
		keepSignal(cp, rs)
	}
	ev.data.Step, ev.data.Reason = cur.Step, "taken by wait step "+cur.Step
	shown := *rs
	ev.data.Signal = &shown
	data := rs.Data
	if len(data) == 0 {
		data = json.RawMessage("null")
	}
	out, _ := schemas.Marshal(schemas.SignalOutput{Signal: rs.Name, ID: rs.ID, Data: data, By: rs.By, At: rs.At})
	_, evs := applyResult(c, cp, &schemas.StepResult{Job: cp.JobID, Step: cur.Step, Attempt: cur.Attempt, Output: out}, now)
	return evs
}

// keepSignal adds rs to cp's signals, dropping the oldest taken ones past
// MaxKeptSignals.
func keepSignal(cp *schemas.Checkpoint, rs *schemas.ReceivedSignal) {
	cp.Signals = append(cp.Signals, rs)
	for len(cp.Signals) > schemas.MaxKeptSignals {
		i := slices.IndexFunc(cp.Signals, func(r *schemas.ReceivedSignal) bool { return r.Taken != "" || r.Refused != "" })
		if i < 0 {
			break
		}
		cp.Signals = slices.Delete(cp.Signals, i, i+1)
	}
}

// takeKept lets the wait step cp has just reached take a signal it was
// kept: the oldest that matches; again for the wait step after it.
func takeKept(c *compiled, cp *schemas.Checkpoint, now time.Time) []event {
	var evs []event
	for range schemas.MaxKeptSignals {
		w := waitingFor(c, cp)
		if w == nil {
			return evs
		}
		var take *schemas.ReceivedSignal
		for _, r := range cp.Signals {
			if r.Taken == "" && r.Refused == "" && r.Name == w.Signal {
				if ok, _ := w.accepts(cp, r); ok {
					take = r
					break
				}
			}
		}
		if take == nil {
			return evs
		}
		ev := event{typ: schemas.EventSignalReceived, data: schemas.HistoryData{Job: cp.JobID, By: take.By}}
		more := takeSignal(c, cp, take, &ev, now)
		evs = append(append(evs, ev), more...)
	}
	return evs
}

// gateOpen reports whether approval id's gate waits in cp: the current
// dispatch, or an agent's tool call.
func gateOpen(cp *schemas.Checkpoint, id string) bool {
	return (cp.Current != nil && cp.Current.Gate == id) || gatedCall(cp, id) != nil
}

// gatedCall returns the agent tool call of cp that waits for approval id,
// or nil.
func gatedCall(cp *schemas.Checkpoint, id string) *schemas.AgentCall {
	a := agentOf(cp)
	if a == nil {
		return nil
	}
	for i := range a.Calls {
		if a.Calls[i].Gate == id {
			return &a.Calls[i]
		}
	}
	return nil
}

// openCallGate parks call, of tool t of agent step s, at an approval gate
// bound to its arguments; it is dispatched once approved.
func openCallGate(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, t *schemas.Tool, call *schemas.AgentCall, now time.Time) (event, *schemas.Error) {
	set := t.RequiresApproval
	gate := s.ID + "." + t.Name
	action := fmt.Sprintf("call tool %s of step %s with arguments %s", t.Name, s.ID, excerpt(string(call.Input), 1000))
	if tmpl := c.toolActions[c.def.StepIndex(s.ID)][t.Name]; tmpl != nil {
		var args any
		_ = json.Unmarshal(call.Input, &args)
		text, err := schemas.RenderTemplateWith(tmpl, cp.JobID, s.ID, cp.State, cp.Vars, map[string]any{"args": args})
		if err != nil {
			return event{}, &schemas.Error{Code: schemas.CodeInputInvalid, Job: cp.JobID, Step: s.ID, Message: fmt.Sprintf("approval action of tool %s: %v", t.Name, err)}
		}
		action = text
	}
	action = printable(action)
	bound, _ := schemas.Marshal(struct {
		Gate   string          `json:"gate"`
		Action string          `json:"action"`
		Args   json.RawMessage `json:"args"`
	}{gate, action, call.Input})
	sum := sha256.Sum256(bound)
	ap := &schemas.Approval{ID: uniqueApprovalID(cp, gate+"/"+call.ID), Gate: gate, Run: cp.Fan.Run, Digest: hex.EncodeToString(sum[:]), Action: action,
		Approvers: set.Approvers, Status: schemas.ApprovalPending, RequestedAt: now}
	if len(call.Input) <= maxGateData {
		ap.Data = call.Input
	}
	if set.ExpiresIn > 0 {
		at := now.Add(time.Duration(set.ExpiresIn))
		ap.ExpiresAt = &at
	}
	cp.Approvals = append(cp.Approvals, ap)
	call.Gate = ap.ID
	shown := *ap
	return event{typ: schemas.EventApprovalRequested, data: schemas.HistoryData{Job: cp.JobID, Step: s.ID, Tool: t.Name, Call: call.ID,
		Turn: cp.Fan.Agent.Turn, Status: string(ap.Status), Approval: &shown}}, nil
}

// waitForCallGates makes a running agent job whose only open business is
// tool calls waiting for approval JobWaitingApproval (and one whose
// gates were all decided running again).
func waitForCallGates(cp *schemas.Checkpoint) {
	a := agentOf(cp)
	if a == nil || (cp.Status != schemas.JobRunning && cp.Status != schemas.JobWaitingApproval) {
		return
	}
	gated := slices.ContainsFunc(a.Calls, func(c schemas.AgentCall) bool { return c.Gate != "" })
	switch {
	case gated && len(cp.Fan.Running) == 0 && len(cp.Fan.Blocked) == 0:
		cp.Status = schemas.JobWaitingApproval
	case cp.Status == schemas.JobWaitingApproval && (!gated || len(cp.Fan.Running) > 0):
		cp.Status = schemas.JobRunning
	}
}

// decideCallGate applies a's decision to the tool call waiting on it:
// approved, the call is dispatched; rejected or expired, it is answered
// with an error the model reads.
func decideCallGate(c *compiled, cp *schemas.Checkpoint, a *schemas.Approval, call *schemas.AgentCall, now time.Time) []event {
	s := c.def.Step(cp.Fan.Step)
	call.Gate = ""
	cp.Status = schemas.JobRunning
	var evs []event
	if a.Status == schemas.ApprovalApproved {
		t := s.ToolOf(call.Name)
		n := slices.IndexFunc(cp.Fan.Agent.Calls, func(x schemas.AgentCall) bool { return x.ID == call.ID }) + 1
		key := toolKey(c, cp, s, t, call, n)
		evs = append(evs, dispatchTool(c, cp, s, call, key, 1, 1, time.Time{}, now))
	} else {
		why := string(a.Status)
		if a.DecidedBy != "" {
			why += " by " + a.DecidedBy
		}
		if a.Reason != "" {
			why += ": " + a.Reason
		}
		cp.Fan.Agent.ToolErrors++
		call.Done, call.IsError = true, true
		setContent(cp, call, fmt.Sprintf("the call of tool %s was not approved (%s); it was not made", call.Name, why))
		evs = append(evs, maybeFinishTurn(c, cp, s, now)...)
	}
	waitForCallGates(cp)
	return evs
}

// expandRecords gives every step in cp's compact set of completed steps
// its record back, so that a reopened job's run counts can be set.
func expandRecords(c *compiled, cp *schemas.Checkpoint) {
	if cp.Steps == nil {
		cp.Steps = map[string]*schemas.StepRecord{}
	}
	for i := range c.def.Steps {
		if cp.Completed.Has(i) {
			stepRecord(c, cp, c.def.Steps[i].ID)
		}
	}
}

// retryJob reopens failed job cp at sig.From, or at the step that failed:
// every step's run count goes back by one, so that the next run of a step
// the job had reached is its last run again, under the same idempotency
// key (the ledger answers an effect already confirmed with its recorded
// result, and one refused or never made is performed); the step it goes
// on from gets a fresh retry budget. Attempt numbers go on, so message
// ids stay unique.
func retryJob(c *compiled, cp *schemas.Checkpoint, sig *schemas.Signal, now time.Time) []event {
	from := sig.From
	if from == "" && cp.Error != nil {
		from = cp.Error.Step
	}
	if from == "" || c.def.Step(from) == nil {
		return nil
	}
	expandRecords(c, cp)
	for _, rec := range cp.Steps {
		rec.Runs, rec.RunAttempt = max(0, rec.Runs-1), 0
		if rec.Status != schemas.StepCompleted {
			rec.Status, rec.LastError = schemas.StepPending, nil
		}
	}
	prev := cp.Error
	cp.Status, cp.Error, cp.CompletedAt = schemas.JobRunning, nil, nil
	cp.Current, cp.Fan, cp.Blocked = nil, nil, nil
	cp.Retries++
	resetDeadline(c, cp, now)
	if sig.IndexRev != 0 {
		cp.ActiveRev = sig.IndexRev // its creation, and so its message ids and ledger records, stay
	}
	why := "after " + string(prev.Code)
	if prev.Message != "" {
		why += ": " + excerpt(prev.Message, 200)
	}
	if sig.Reason != "" {
		why = sig.Reason + " (" + why + ")"
	}
	evs := []event{{typ: schemas.EventJobRetried, data: schemas.HistoryData{Job: cp.JobID, Step: from, By: sig.By, Reason: why, Status: string(schemas.JobRunning)}}}
	return append(evs, dispatchOrStop(c, cp, from, true, time.Time{}, now)...)
}

// unheld returns the dispatches of ds that are not held (nor waiting for
// a flow limit).
func unheld(ds []*schemas.Dispatch) []*schemas.Dispatch {
	return slices.DeleteFunc(ds, func(d *schemas.Dispatch) bool { return d.Held || d.Waiting != nil })
}

// resetDeadline gives a job reopened (retry, rewind) a deadline of its
// own, counted from now: the one it had may be what it failed of.
func resetDeadline(c *compiled, cp *schemas.Checkpoint, now time.Time) {
	if d := c.def.Deadline; d > 0 {
		at := now.Add(time.Duration(d)).UTC()
		cp.DeadlineAt = &at
	}
}

// deadlineJob fails cp, whose deadline passed: what it had in flight is
// stopped as a cancel stops it (its results dropped, its queued messages
// removed and its child jobs cancelled after the write: afterCancel), and
// named in the error.
func deadlineJob(c *compiled, cp *schemas.Checkpoint, now time.Time) event {
	if c != nil && cp.Fan != nil && cp.Fan.Agent != nil {
		keepTranscript(c, cp)
	}
	msg := fmt.Sprintf("the job's deadline passed at %s", cp.DeadlineAt.UTC().Format(time.RFC3339))
	if c != nil {
		msg = fmt.Sprintf("the job's deadline (%v from its start) passed at %s", time.Duration(c.def.Deadline), cp.DeadlineAt.UTC().Format(time.RFC3339))
	}
	if inFlight := inFlightOf(cp); len(inFlight) > 0 {
		msg += "; in flight: " + strings.Join(inFlight, ", ")
	}
	cp.Blocked, cp.BlockedFrom, cp.BlockedReason = nil, "", ""
	return failJob(cp, &schemas.Error{Code: schemas.CodeTimeout, Job: cp.JobID, Message: msg}, now)
}

// rewindJob sets cp back to sequence sig.Seq: its state then, each step's
// runs then (so that running a step again reuses the idempotency key of
// the run it had then: an effect confirmed since answers from the
// ledger), and goes on from step sig.From. Open gates of the timeline left
// behind expire; what was in flight is dropped (its results are stale).
func rewindJob(c *compiled, cp *schemas.Checkpoint, sig *schemas.Signal, now time.Time) []event {
	if c.def.Step(sig.From) == nil || len(sig.State) == 0 {
		return nil
	}
	expandRecords(c, cp)
	for id, rec := range cp.Steps {
		rec.Runs, rec.RunAttempt, rec.LastError = sig.Runs[id], 0, nil
		rec.Status = schemas.StepPending
		if rec.Runs > 0 {
			rec.Status = schemas.StepCompleted
		}
	}
	closeGates(cp, now, fmt.Sprintf("the job was rewound to seq %d", sig.Seq))
	cp.State = sig.State
	cp.Status, cp.Error, cp.CompletedAt = schemas.JobRunning, nil, nil
	cp.Current, cp.Fan, cp.Blocked = nil, nil, nil
	resetDeadline(c, cp, now)
	if sig.IndexRev != 0 {
		cp.ActiveRev = sig.IndexRev // its creation, and so its message ids and ledger records, stay
	}
	runs := maps.Clone(sig.Runs)
	evs := []event{{typ: schemas.EventJobRewound, data: schemas.HistoryData{Job: cp.JobID, Step: sig.From, By: sig.By, Reason: sig.Reason,
		Status: string(schemas.JobRunning), ToSeq: sig.Seq, Runs: runs}}}
	return append(evs, dispatchOrStop(c, cp, sig.From, true, time.Time{}, now)...)
}

// parked reports whether cp waits for a person or a timer with nothing
// else in flight: at an approval gate, a sleep, a wait for a signal, or
// paused with its next dispatch held. Such a job is not kept in the
// engine's cache: thousands of them cost the engine no memory.
func parked(cp *schemas.Checkpoint) bool {
	if cp.Status == schemas.JobWaitingApproval {
		return true
	}
	if cp.Status != schemas.JobRunning || cp.Fan != nil || cp.Current == nil {
		return false
	}
	d := cp.Current
	return d.Held || d.Wait != "" || (d.Due != nil && d.Pool == "")
}

// migrateJob moves cp to definition c with state sig.State: step records
// of steps c does not have are dropped, the compact set of completed steps
// is mapped by step id (by old, the definition left, when it can be read;
// dropped when it cannot), and a job blocked on its definition goes back
// to what it was doing, its dispatch sent again under the new definition.
// Nil when cp cannot move (its step is not in c, its state breaks c's
// schema).
func migrateJob(old, c *compiled, cp *schemas.Checkpoint, sig *schemas.Signal, now time.Time) []event {
	if !cp.Migratable() || c.def.Name != cp.Workflow || (sig.Seq != 0 && sig.Seq != cp.Seq) {
		// The state its patch was made from is no longer the job's (another
		// migration, say, came first).
		return nil
	}
	if cur := cp.Current; cur != nil && c.def.Step(cur.Step) == nil {
		return nil
	}
	if c.state != nil {
		var doc any
		if json.Unmarshal(sig.State, &doc) != nil || c.state.Validate(doc) != nil {
			return nil
		}
	}
	note := ""
	var done schemas.StepSet
	if old != nil {
		for i, s := range old.def.Steps {
			if cp.Completed.Has(i) {
				if j := c.def.StepIndex(s.ID); j >= 0 {
					done = done.With(j)
				}
			}
		}
	} else if cp.Completed.Len() > 0 {
		note = "; the definition left could not be read: the steps it had done once are not listed"
	}
	cp.Completed = done
	for id := range cp.Steps {
		if c.def.Step(id) == nil {
			delete(cp.Steps, id)
		}
	}
	from := cp.DefinitionHash
	cp.DefinitionHash, cp.Version, cp.State = c.def.Hash, c.def.Version, sig.State
	cp.LastControl = &schemas.ControlRecord{ID: sig.ID, Type: sig.Type, By: sig.By, At: now}
	evs := []event{{typ: schemas.EventJobMigrated, data: schemas.HistoryData{Job: cp.JobID, By: sig.By, Status: string(cp.Status),
		Reason: fmt.Sprintf("from definition %s to %s (%s v%d)%s%s", short(from), short(c.def.Hash), c.def.Name, c.def.Version, reasonNote(sig.Reason), note)}}}
	if cp.Status == schemas.JobBlocked {
		cp.Status, cp.BlockedReason, cp.BlockedFrom = cp.BlockedFrom, "", ""
		if cp.Current != nil && cp.Current.Gate == "" && cp.Current.Wait == "" && !cp.Current.Held {
			evs = append(evs, redispatch(cp, now, "the job moved to definition "+short(c.def.Hash)+": dispatched again"))
		}
		if cp.Status == schemas.JobPending {
			evs = append(evs, startJob(c, cp, now)...)
		}
	}
	if cur := cp.Current; cur != nil && cur.Gate != "" && cp.Status == schemas.JobWaitingApproval {
		// The gate opens again under the new definition: its action, data
		// and digest are the new ones, and an approval of the old is void.
		closeGates(cp, now, "the job moved to definition "+short(c.def.Hash))
		cp.Current, cp.Status = nil, schemas.JobRunning
		evs = append(evs, dispatchOrStop(c, cp, cur.Step, true, time.Time{}, now)...)
	}
	return evs
}

func reasonNote(reason string) string {
	if reason == "" {
		return ""
	}
	return ": " + reason
}

// heldOrReleased marks the new dispatches of next Held while it is paused,
// and returns what to publish: the new dispatches that are not held, and
// those engine resume released.
func heldOrReleased(base, next *schemas.Checkpoint, sends []*schemas.Dispatch) []*schemas.Dispatch {
	if next.Paused != nil {
		out := sends[:0:0]
		for _, d := range sends {
			if d.Gate != "" {
				out = append(out, d) // a gate sends nothing but its expiry timer
				continue
			}
			d.Held = true
		}
		return out
	}
	if base == nil || base.Paused == nil {
		return sends
	}
	held := map[string]bool{}
	for _, d := range base.Dispatches() {
		if d.Held {
			held[d.MsgID] = true
		}
	}
	for _, d := range next.Dispatches() {
		if held[d.MsgID] && !d.Held && !slices.Contains(sends, d) {
			sends = append(sends, d)
		}
	}
	return sends
}

// stateDelta is the state change from base to next for next's history
// (schemas.DiffState); long members are staged in next.Unsaved and
// referenced. Nil when the state did not change (or cannot be read).
func stateDelta(base, next *schemas.Checkpoint) json.RawMessage {
	d, err := schemas.DiffState(base.State, next.State, func(v []byte) schemas.ValueRef {
		next.Unsaved = append(next.Unsaved, slices.Clone(v))
		return schemas.NewValueRef(v)
	})
	if err != nil {
		return nil
	}
	return d
}
