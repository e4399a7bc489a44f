package engine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// This file holds the transitions of agent steps: a tool-use loop run as
// a fan (cp.Fan with Agent set). Each model turn is a dispatch of the step
// (item 0, an attempt of its own, message id StepMsgID); each tool call
// the model makes is an item of the run (message id ItemMsgID, ledger key
// schemas.ToolCallKey), dispatched once its arguments pass the tool's
// input schema. The transcript lives in the value store, a part per
// transition, so that a checkpoint carries references, never the
// conversation. Like apply.go it does no I/O but reading values.

const (
	// maxTranscriptParts is the most parts a running agent's transcript
	// has; one more and they are merged into one value.
	maxTranscriptParts = 16
	// inlineResultBytes is the longest tool result kept in the checkpoint
	// until its turn ends; a longer one waits in the value store.
	inlineResultBytes = 2 << 10
)

// isAgent reports whether s is an agent step.
func isAgent(s *schemas.Step) bool { return s.Kind == schemas.KindAgent }

// startAgent begins a run of agent step s: its fan and the first turn.
func startAgent(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, now time.Time) []event {
	rec := stepRecord(c, cp, s.ID)
	rec.Runs++
	rec.RunAttempt = 0
	cp.Fan = &schemas.Fan{Step: s.ID, Run: rec.Runs, Agent: &schemas.AgentRun{}}
	return []event{dispatchTurn(c, cp, s, 1, time.Time{}, now)}
}

// dispatchTurn records the agent's next model turn (its runAttempt-th
// attempt) in the fan.
func dispatchTurn(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, runAttempt int, notBefore, now time.Time) event {
	rec := stepRecord(c, cp, s.ID)
	rec.Attempts++
	rec.RunAttempt = runAttempt
	rec.Status = schemas.StepDispatched
	d := &schemas.Dispatch{
		Step: s.ID, Attempt: rec.Attempts, RunAttempt: runAttempt,
		MsgID:        schemas.StepMsgID(cp.MsgPrefix(), s.ID, rec.Attempts),
		Pool:         c.def.PoolOf(s),
		DispatchedAt: now,
	}
	if !notBefore.IsZero() && notBefore.After(now) {
		nb := notBefore
		d.NotBefore = &nb
		rec.Status = schemas.StepRetrying
	}
	cp.Fan.Running = append(cp.Fan.Running, d)
	turn := cp.Fan.Agent.Turn + 1
	return event{typ: schemas.EventStepDispatched, data: schemas.HistoryData{
		Job: cp.JobID, Step: s.ID, Attempt: d.Attempt, Status: string(rec.Status), NotBefore: notBefore, Turn: turn,
		Reason: fmt.Sprintf("model turn %d", turn),
	}}
}

// dispatchTool records attempt (runAttempt within its retries) of tool
// call call in the fan.
func dispatchTool(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, call *schemas.AgentCall, key string, attempt, runAttempt int, notBefore, now time.Time) event {
	f := cp.Fan
	t := s.ToolOf(call.Name)
	d := &schemas.Dispatch{
		Step: s.ID, Item: call.Item, Attempt: attempt, RunAttempt: runAttempt,
		MsgID:        schemas.ItemMsgID(cp.MsgPrefix(), s.ID, f.Run, call.Item, attempt),
		Pool:         c.def.ToolPoolOf(s, t),
		DispatchedAt: now,
		EffectKey:    key,
	}
	status := schemas.StepDispatched
	if !notBefore.IsZero() && notBefore.After(now) {
		nb := notBefore
		d.NotBefore = &nb
		status = schemas.StepRetrying
	}
	if t.Kind == schemas.KindWorkflow {
		// A child job: started, not sent to a worker; its end is the result.
		d.Child, d.NotBefore, status = schemas.ChildJobID(cp.JobID, s.ID+"-"+childPart(call.ID, call.Item), f.Run), nil, schemas.StepDispatched
	}
	f.Running = append(f.Running, d)
	return event{typ: schemas.EventStepDispatched, data: schemas.HistoryData{
		Job: cp.JobID, Step: s.ID, Attempt: attempt, Item: call.Item, Status: string(status), NotBefore: notBefore, EffectKey: key,
		Turn: f.Agent.Turn, Tool: call.Name, Call: call.ID,
	}}
}

// toolKey returns the ledger key of call (the n-th of its turn, from 1),
// or "" for a pure tool.
func toolKey(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, t *schemas.Tool, call *schemas.AgentCall, n int) string {
	if c.def.ToolEffectOf(s, t) == schemas.EffectPure {
		return ""
	}
	return schemas.ToolCallKey(cp.KeyBaseFor(s.ID, cp.Fan.Run), s.ID, cp.Fan.Run, cp.Fan.Agent.Turn, call.ID, n)
}

// applyAgentResult applies the result of one of the agent's dispatches.
func applyAgentResult(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, res *schemas.StepResult, now time.Time) []event {
	if res.Item != 0 {
		return applyToolResult(c, cp, s, res, now)
	}
	return applyTurnResult(c, cp, s, res, now)
}

func applyTurnResult(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, res *schemas.StepResult, now time.Time) []event {
	f, a := cp.Fan, cp.Fan.Agent
	d := f.RunningOf(s.ID, 0)
	rec := stepRecord(c, cp, s.ID)
	rec.DurationMs = res.DurationMs
	f.Remove(s.ID, 0)
	e := res.Error
	if e != nil && (e.Code == schemas.CodeDefinitionMissing || e.Code == schemas.CodeWaiting) {
		// A rate limit or a worker without the definition: not the turn's
		// failure, so no attempt is used up.
		nb := time.Time{}
		if e.Code == schemas.CodeWaiting {
			nb = waitUntil(c, s, e, now)
		}
		ev := dispatchTurn(c, cp, s, d.RunAttempt, nb, now)
		ev.data.Reason = e.Message + ": dispatched again"
		return []event{ev}
	}
	var turn schemas.AgentTurn
	if e == nil {
		e = decodeTurn(res.Output, &turn)
	}
	if e != nil {
		e = e.At(cp.JobID, s.ID, res.Attempt)
		policy := c.def.RetryOf(s)
		ev := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{Job: cp.JobID, Step: s.ID, Attempt: res.Attempt, Error: e,
			DurationMs: res.DurationMs, Turn: a.Turn + 1}}
		if e.Retryable && d.RunAttempt < policy.MaxAttempts {
			next := now.Add(policy.Delay(d.RunAttempt + 1))
			ev.data.Retrying, ev.data.NotBefore = true, next
			return []event{ev, dispatchTurn(c, cp, s, d.RunAttempt+1, next, now)}
		}
		fail := &schemas.Error{Code: e.Code, Job: cp.JobID, Step: s.ID, Attempt: res.Attempt,
			Message: fmt.Sprintf("model turn %d failed: %s", a.Turn+1, e.Message)}
		keepTranscript(c, cp) // what the model did so far stays readable
		return append([]event{ev}, failFanStep(c, cp, s, fail, now)...)
	}
	a.Turn++
	model := turn.Model
	if model == "" {
		model = "unknown"
	}
	if a.Usage == nil {
		a.Usage = map[string]schemas.TokenUsage{}
	}
	a.Usage[model] = a.Usage[model].Add(turn.Usage)
	p, priced := schemas.PriceOf(s.Prices, model)
	switch {
	case priced:
		a.Cost += p.Cost(turn.Usage)
	case len(s.Prices) == 0 && turn.Priced:
		a.Cost += turn.Cost // from the worker's price file
	}
	if !priced && !(len(s.Prices) == 0 && turn.Priced) && s.Limits != nil && s.Limits.MaxCost > 0 {
		where := fmt.Sprintf("steps[%d].prices", c.def.StepIndex(s.ID))
		if len(s.Prices) == 0 {
			where = "the worker's price file (--prices)"
		}
		e := schemas.Errorf(schemas.CodeLimitReached, "model %q has no price in %s, so max_cost cannot be kept", model, where).At(cp.JobID, s.ID, res.Attempt)
		keepTranscript(c, cp)
		return failFanStep(c, cp, s, e, now)
	}
	a.Model, a.PromptVersion, a.Text = model, turn.PromptVersion, textOf(turn.Message)
	msgs := []schemas.AgentMessage{}
	if len(a.Transcript) == 0 && turn.Prompt != nil {
		msgs = append(msgs, *turn.Prompt)
	}
	msgs = append(msgs, turn.Message)
	appendTranscript(c, cp, msgs)
	usage := turn.Usage
	var calls []schemas.AgentBlock
	for _, b := range turn.Message.Content {
		if b.Type == "tool_use" {
			calls = append(calls, b)
		}
	}
	evs := []event{{typ: schemas.EventAgentTurn, data: schemas.HistoryData{
		Job: cp.JobID, Step: s.ID, Attempt: res.Attempt, DurationMs: res.DurationMs, Turn: a.Turn, Model: model, Usage: &usage,
		PromptVersion: turn.PromptVersion, ResultDigest: digest(res.Output),
		Reason: fmt.Sprintf("%d tool calls; stop reason %s", len(calls), turn.StopReason),
	}}}
	if len(calls) == 0 {
		return append(evs, finalAnswer(c, cp, s, now)...)
	}
	if stop := limitReached(s, a, len(calls)); stop != "" {
		why := ""
		if stop == schemas.StopMaxToolCalls {
			why = fmt.Sprintf("turn %d asked for %d tool calls, past max_tool_calls %d (%d made before)", a.Turn, len(calls), s.Limits.MaxToolCalls, a.ToolCalls)
		}
		return append(evs, stopAgent(c, cp, s, stop, why, now)...)
	}
	return append(evs, startCalls(c, cp, s, calls, now)...)
}

// decodeTurn reads a worker's turn output into t; a malformed one is a
// retryable output error.
func decodeTurn(out json.RawMessage, t *schemas.AgentTurn) *schemas.Error {
	if err := json.Unmarshal(out, t); err != nil {
		return &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true, Message: fmt.Sprintf("agent turn output does not decode: %v", err)}
	}
	if t.Message.Role != "assistant" || len(t.Message.Content) == 0 {
		return &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true, Message: "agent turn output has no assistant message"}
	}
	if t.Prompt != nil && (t.Prompt.Role != "user" || len(t.Prompt.Content) == 0) {
		return &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true, Message: "agent turn output's prompt is not a user message"}
	}
	ids := map[string]bool{}
	for i, b := range t.Message.Content {
		switch b.Type {
		case "text":
		case "tool_use":
			if b.ToolUseID == "" || b.Name == "" || ids[b.ToolUseID] {
				return &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true,
					Message: fmt.Sprintf("agent turn output: block %d is a tool call without a name or with a missing or repeated id", i)}
			}
			ids[b.ToolUseID] = true
		default:
			return &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true, Message: fmt.Sprintf("agent turn output: block %d has type %q", i, b.Type)}
		}
	}
	return nil
}

// textOf joins the text blocks of m.
func textOf(m schemas.AgentMessage) string {
	var parts []string
	for _, b := range m.Content {
		if b.Type == "text" && b.Text != "" {
			parts = append(parts, b.Text)
		}
	}
	return strings.Join(parts, "\n")
}

// limitReached returns the stop reason of the limit a turn that asks for
// calls more tool calls runs into, or "".
func limitReached(s *schemas.Step, a *schemas.AgentRun, calls int) string {
	l := s.Limits
	if l == nil {
		l = &schemas.AgentLimits{}
	}
	switch {
	case a.Turn >= s.MaxTurnsOf():
		return schemas.StopMaxTurns
	case l.MaxToolCalls > 0 && a.ToolCalls+calls > l.MaxToolCalls:
		return schemas.StopMaxToolCalls
	case l.MaxTokens > 0 && a.TotalUsage().Total() >= l.MaxTokens:
		return schemas.StopMaxTokens
	case l.MaxCost > 0 && a.Cost >= l.MaxCost:
		return schemas.StopMaxCost
	}
	return ""
}

// startCalls records the turn's tool calls and dispatches those whose
// tool exists and whose arguments pass its input schema; the others are
// answered at once with an error the model reads.
func startCalls(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, calls []schemas.AgentBlock, now time.Time) []event {
	f, a := cp.Fan, cp.Fan.Agent
	var evs []event
	idx := c.def.StepIndex(s.ID)
	for n, b := range calls {
		a.ToolCalls++
		call := schemas.AgentCall{ID: b.ToolUseID, Name: b.Name, Input: slices.Clip(bytes.TrimSpace(b.Input))}
		if len(call.Input) == 0 {
			call.Input = json.RawMessage("{}")
		}
		t := s.ToolOf(b.Name)
		if why := c.checkArgs(idx, s, t, call.Name, call.Input); why != "" {
			a.InvalidCalls++
			call.Done, call.IsError, call.Content = true, true, why
			a.Calls = append(a.Calls, call)
			evs = append(evs, event{typ: schemas.EventStepFailed, data: schemas.HistoryData{Job: cp.JobID, Step: s.ID, Turn: a.Turn, Tool: call.Name, Call: call.ID,
				Error: schemas.Errorf(schemas.CodeInputInvalid, "%s", why).At(cp.JobID, s.ID, 0), Reason: "refused before dispatch"}})
			continue
		}
		f.Next++
		f.Total = f.Next
		call.Item = f.Next
		if t.RequiresApproval != nil {
			ev, fail := openCallGate(c, cp, s, t, &call, now)
			if fail != nil {
				return append(evs, failFanStep(c, cp, s, fail, now)...)
			}
			a.Calls = append(a.Calls, call)
			evs = append(evs, ev)
			continue
		}
		a.Calls = append(a.Calls, call)
		key := toolKey(c, cp, s, t, &call, n+1)
		evs = append(evs, dispatchTool(c, cp, s, &call, key, 1, 1, time.Time{}, now))
	}
	evs = append(evs, maybeFinishTurn(c, cp, s, now)...)
	waitForCallGates(cp)
	return evs
}

// checkArgs returns why a call of tool name with input cannot be
// dispatched (no such tool, arguments that break its input schema), or "".
func (c *compiled) checkArgs(idx int, s *schemas.Step, t *schemas.Tool, name string, input json.RawMessage) string {
	if t == nil {
		names := make([]string, len(s.Tools))
		for i, t := range s.Tools {
			names[i] = t.Name
		}
		return fmt.Sprintf("there is no tool %q; the tools are: %s", name, strings.Join(names, ", "))
	}
	doc, err := decodePlain(input)
	if _, isObject := doc.(map[string]any); err != nil || !isObject {
		return fmt.Sprintf("the arguments of tool %s must be a JSON object; got %s", name, excerpt(string(input), 200))
	}
	if v := c.tools[idx][name]; v != nil {
		if err := v.Validate(doc); err != nil {
			return fmt.Sprintf("the arguments of tool %s do not match its input_schema: %v", name, err)
		}
	}
	return ""
}

func excerpt(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

func applyToolResult(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, res *schemas.StepResult, now time.Time) []event {
	f, a := cp.Fan, cp.Fan.Agent
	d := f.RunningOf(s.ID, res.Item)
	call := a.CallByItem(res.Item)
	if call == nil || d == nil {
		return nil // checkConsistent refuses such a checkpoint
	}
	t := s.ToolOf(call.Name)
	ts := schemas.ToolStep(s, t)
	if d.Child != "" && res.DurationMs == 0 {
		res.DurationMs = now.Sub(d.DispatchedAt).Milliseconds() // the child job's run
	}
	f.Remove(s.ID, res.Item)
	e := res.Error
	if e != nil && (e.Code == schemas.CodeDefinitionMissing || e.Code == schemas.CodeWaiting) {
		nb := time.Time{}
		if e.Code == schemas.CodeWaiting {
			nb = waitUntil(c, ts, e, now)
		}
		ev := dispatchTool(c, cp, s, call, d.EffectKey, d.Attempt+1, d.RunAttempt, nb, now)
		ev.data.Reason = e.Message + ": dispatched again"
		return []event{ev}
	}
	output := bytes.TrimSpace(res.Output)
	if e == nil && !json.Valid(output) {
		e = schemas.Errorf(schemas.CodeOutputInvalid, "output of tool %s is not valid JSON", call.Name)
	}
	if e == nil {
		call.Done = true
		setContent(cp, call, toolContent(output))
		evs := []event{{typ: schemas.EventStepCompleted, data: schemas.HistoryData{
			Job: cp.JobID, Step: s.ID, Attempt: res.Attempt, Item: res.Item, Status: string(schemas.StepCompleted),
			DurationMs: res.DurationMs, ResultDigest: digest(output), Turn: a.Turn, Tool: call.Name, Call: call.ID, EffectKey: res.EffectKey,
		}}}
		evs = append(evs, maybeFinishTurn(c, cp, s, now)...)
		waitForCallGates(cp)
		return evs
	}
	e = e.At(cp.JobID, s.ID, res.Attempt)
	policy := c.def.RetryOf(ts)
	retry := e.Retryable && d.RunAttempt < policy.MaxAttempts
	ev := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{
		Job: cp.JobID, Step: s.ID, Attempt: res.Attempt, Item: res.Item, Error: e, Retrying: retry, DurationMs: res.DurationMs,
		EffectKey: res.EffectKey, EffectState: string(res.EffectState), Turn: a.Turn, Tool: call.Name, Call: call.ID,
	}}
	switch {
	case retry:
		next := now.Add(policy.Delay(d.RunAttempt + 1))
		ev.data.NotBefore = next
		return []event{ev, dispatchTool(c, cp, s, call, d.EffectKey, d.Attempt+1, d.RunAttempt+1, next, now)}
	case e.Code == schemas.CodeAmbiguous || outcomeUnknown(c, ts, res):
		// The call may have happened: a person says whether (engine
		// effects resolve); the turn's other calls finish meanwhile.
		ev.data.Reason = "the tool call failed for good while its effect may have happened"
		b, bev := blockedOf(c, cp, d, ts, stepRecord(c, cp, s.ID), res, e)
		b.Reason = fmt.Sprintf("tool %s, call %s with arguments %s: %s", call.Name, call.ID, excerpt(string(call.Input), 300), e.Message)
		bev.data.Tool, bev.data.Turn, bev.data.Call = call.Name, a.Turn, call.ID
		blockInFan(cp, b)
		return []event{ev, bev}
	}
	a.ToolErrors++
	call.Done, call.IsError = true, true
	setContent(cp, call, fmt.Sprintf("tool %s failed: %s", call.Name, e.Message))
	evs := append([]event{ev}, maybeFinishTurn(c, cp, s, now)...)
	waitForCallGates(cp)
	return evs
}

// toolContent is a tool's output as the model reads it: a JSON string as
// its text, anything else as compact JSON.
func toolContent(out json.RawMessage) string {
	if len(out) > 0 && out[0] == '"' {
		var s string
		if json.Unmarshal(out, &s) == nil {
			return s
		}
	}
	var b bytes.Buffer
	if json.Compact(&b, out) != nil {
		return string(out)
	}
	return b.String()
}

// setContent sets call's result; one past inlineResultBytes waits in the
// value store, call.Content holding its reference.
func setContent(cp *schemas.Checkpoint, call *schemas.AgentCall, content string) {
	if len(content) <= inlineResultBytes {
		call.Content = content
		return
	}
	v, _ := json.Marshal(content)
	cp.Unsaved = append(cp.Unsaved, v)
	call.Content = ""
	ref := schemas.NewValueRef(v)
	call.ContentRef = &schemas.TranscriptPart{Digest: ref.Digest, Bytes: ref.Bytes, Messages: 1}
}

// maybeFinishTurn ends the turn once every call has its result: one user
// message of tool results, in the order of the calls, joins the
// transcript, and the next turn is dispatched.
func maybeFinishTurn(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, now time.Time) []event {
	f, a := cp.Fan, cp.Fan.Agent
	if len(f.Running) > 0 || len(f.Blocked) > 0 || cp.Status != schemas.JobRunning {
		return nil
	}
	msg := schemas.AgentMessage{Role: "user"}
	for _, call := range a.Calls {
		if !call.Done {
			return nil
		}
		content := call.Content
		if call.ContentRef != nil {
			data, err := c.env.chunk(cp, schemas.FanChunk{Digest: call.ContentRef.Digest, Bytes: call.ContentRef.Bytes})
			if err != nil {
				panic(fanFault{err})
			}
			_ = json.Unmarshal(data, &content)
		}
		msg.Content = append(msg.Content, schemas.AgentBlock{Type: "tool_result", ToolUseID: call.ID, Content: content, IsError: call.IsError})
	}
	a.Calls = nil
	appendTranscript(c, cp, []schemas.AgentMessage{msg})
	return []event{dispatchTurn(c, cp, s, 1, time.Time{}, now)}
}

// finalAnswer completes the agent step on a reply without tool calls:
// the reply's text, under an output_schema its JSON value (an answer that
// breaks the schema goes back to the model with the schema's complaint,
// for another turn).
func finalAnswer(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, now time.Time) []event {
	a := cp.Fan.Agent
	idx := c.def.StepIndex(s.ID)
	var answer json.RawMessage
	if v := c.output[idx]; v != nil {
		ans, why := parseAnswer(a.Text)
		if why == "" {
			doc, _ := decodePlain(ans)
			if err := v.Validate(doc); err != nil {
				why = fmt.Sprintf("it does not match the required JSON Schema: %v", err)
			}
		}
		if why != "" {
			if a.Turn >= s.MaxTurnsOf() {
				return stopAgent(c, cp, s, schemas.StopMaxTurns, "the last answer could not be used: "+why, now)
			}
			a.OutputRetries++
			appendTranscript(c, cp, []schemas.AgentMessage{{Role: "user", Content: []schemas.AgentBlock{{Type: "text",
				Text: "Your final answer cannot be used: " + why + ". Reply again with only the JSON value."}}}})
			ev := dispatchTurn(c, cp, s, 1, time.Time{}, now)
			ev.data.Reason = fmt.Sprintf("model turn %d: the final answer broke output_schema (%s)", a.Turn+1, why)
			return []event{ev}
		}
		answer = ans
	}
	return completeAgent(c, cp, s, schemas.StopEndTurn, answer, now)
}

// parseAnswer reads a final reply as JSON: the whole text, or the body of
// its one ``` fenced block (prose around it is allowed); why says what is
// wrong, else "".
func parseAnswer(text string) (json.RawMessage, string) {
	t := strings.TrimSpace(text)
	if !json.Valid([]byte(t)) {
		open := strings.Index(t, "```")
		if open < 0 {
			return nil, "it is not a JSON value (nor holds one in a ```json block)"
		}
		rest := t[open+3:]
		if nl := strings.IndexByte(rest, '\n'); nl >= 0 {
			rest = rest[nl+1:] // the info string ("json")
		}
		end := strings.Index(rest, "```")
		if end < 0 {
			return nil, "its code fence is not closed"
		}
		if strings.Contains(rest[end+3:], "```") {
			return nil, "it has more than one code block; answer with one"
		}
		t = strings.TrimSpace(rest[:end])
	}
	if !json.Valid([]byte(t)) {
		return nil, "its code block is not a JSON value"
	}
	var b bytes.Buffer
	_ = json.Compact(&b, []byte(t))
	return b.Bytes(), ""
}

// stopAgent ends the run at a limit: under on_limit complete the step
// completes with the stop reason in its output, else it fails with
// CodeLimitReached and follows on_error.
func stopAgent(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, stop, why string, now time.Time) []event {
	if s.OnLimit == schemas.OnLimitComplete {
		return completeAgent(c, cp, s, stop, nil, now)
	}
	a := cp.Fan.Agent
	u := a.TotalUsage()
	if why != "" {
		why = "; " + why
	}
	e := schemas.Errorf(schemas.CodeLimitReached, "the agent stopped after %s and %s (%d tokens, cost %.4f): %s reached%s",
		countOf(a.Turn, "turn"), countOf(a.ToolCalls, "tool call"), u.Total(), a.Cost, stop, why).At(cp.JobID, s.ID, stepRecord(c, cp, s.ID).Attempts)
	keepTranscript(c, cp)
	return failFanStep(c, cp, s, e, now)
}

// completeAgent saves the agent's output and follows the step's
// transitions.
func completeAgent(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, stop string, answer json.RawMessage, now time.Time) []event {
	a := cp.Fan.Agent
	out := schemas.AgentOutput{Text: a.Text, Answer: answer, StopReason: stop, Turns: a.Turn, ToolCalls: a.ToolCalls,
		InvalidCalls: a.InvalidCalls, ToolErrors: a.ToolErrors, Usage: a.Usage, Cost: a.Cost, Model: a.Model, PromptVersion: a.PromptVersion,
		Transcript: keepTranscript(c, cp)}
	if out.Usage == nil {
		out.Usage = map[string]schemas.TokenUsage{}
	}
	data, _ := json.Marshal(out)
	rec := stepRecord(c, cp, s.ID)
	return completeFan(c, cp, s, rec, data, fmt.Sprintf("agent: %s after %d turns, %d tool calls", stop, a.Turn, a.ToolCalls), now)
}

// keepTranscript merges the running agent's transcript into one value,
// which the job keeps (cp.Transcripts) as long as it is kept, and returns
// it.
func keepTranscript(c *compiled, cp *schemas.Checkpoint) *schemas.TranscriptPart {
	a := cp.Fan.Agent
	if len(a.Transcript) == 0 {
		return nil
	}
	if len(a.Transcript) > 1 {
		mergeTranscript(c, cp)
	}
	p := a.Transcript[0]
	kept := p
	kept.Step = cp.Fan.Step
	if !slices.Contains(cp.Transcripts, kept) {
		cp.Transcripts = append(cp.Transcripts, kept)
	}
	return &p
}

// appendTranscript adds msgs to the running agent's transcript as a new
// part (staged in cp.Unsaved); past maxTranscriptParts every part is
// merged into one.
func appendTranscript(c *compiled, cp *schemas.Checkpoint, msgs []schemas.AgentMessage) {
	a := cp.Fan.Agent
	data, _ := json.Marshal(msgs)
	a.Transcript = append(a.Transcript, stagePart(cp, data, len(msgs)))
	if len(a.Transcript) > maxTranscriptParts {
		mergeTranscript(c, cp)
	}
}

// mergeTranscript replaces the running agent's transcript parts by one.
func mergeTranscript(c *compiled, cp *schemas.Checkpoint) {
	a := cp.Fan.Agent
	all := []byte{'['}
	n := 0
	for _, p := range a.Transcript {
		data, err := c.env.chunk(cp, schemas.FanChunk{Digest: p.Digest, Bytes: p.Bytes})
		if err != nil {
			panic(fanFault{err}) // a passing fault: the messages are handed back
		}
		var msgs []json.RawMessage
		if err := json.Unmarshal(data, &msgs); err != nil {
			panic(fanFault{fmt.Errorf("transcript part %s does not decode: %w", p.Digest, err)})
		}
		for _, m := range msgs {
			if n > 0 {
				all = append(all, ',')
			}
			all = append(all, m...)
			n++
		}
	}
	all = append(all, ']')
	a.Transcript = []schemas.TranscriptPart{stagePart(cp, all, n)}
}

func stagePart(cp *schemas.Checkpoint, data []byte, msgs int) schemas.TranscriptPart {
	cp.Unsaved = append(cp.Unsaved, data)
	r := schemas.NewValueRef(data)
	return schemas.TranscriptPart{Digest: r.Digest, Bytes: r.Bytes, Messages: msgs}
}

// resumeAgent goes on with an agent whose blocked tool call was resolved:
// the call is dispatched again under a fresh retry budget, and its ledger
// record says what happened.
func resumeAgent(c *compiled, cp *schemas.Checkpoint, b *schemas.Blocked, now time.Time) []event {
	s := c.def.Step(cp.Fan.Step)
	call := cp.Fan.Agent.CallByItem(b.Item)
	if call == nil {
		return nil
	}
	if rec := cp.Steps[s.ID]; rec != nil {
		rec.Status, rec.LastError = schemas.StepDispatched, nil
	}
	return []event{dispatchTool(c, cp, s, call, b.EffectKey, b.Attempt+1, 1, time.Time{}, now)}
}

// agentTurnMessage fills the step message of a turn: its number and the
// transcript so far, which the worker reads from the value store.
func agentTurnMessage(cp *schemas.Checkpoint, sm *schemas.StepMessage) {
	a := cp.Fan.Agent
	sm.Turn = a.Turn + 1
	sm.Transcript = a.Transcript
	sm.ValueOwner = cp.MsgPrefix()
}

// toolCallMessage fills the step message of a tool call: the tool, the
// call's id and its arguments, and the state.
func toolCallMessage(cp *schemas.Checkpoint, d *schemas.Dispatch, sm *schemas.StepMessage) error {
	a := cp.Fan.Agent
	call := a.CallByItem(d.Item)
	if call == nil {
		return fmt.Errorf("job %s: dispatch %s is of tool call %d, which the agent does not have", cp.JobID, d.MsgID, d.Item)
	}
	sm.Item, sm.ItemName, sm.ItemValue, sm.Tool = d.Item, call.ID, call.Input, call.Name
	if d.EffectKey != "" {
		sm.IdempotencyKey = d.EffectKey
	}
	return nil
}

// childPart names a tool call in the id of the child job it starts: its
// tool_use id when that is a plain name, else "call-<item>".
func childPart(id string, item int) string {
	if plainName.MatchString(id) {
		return id
	}
	return "call-" + strconv.Itoa(item)
}

// countOf returns "1 turn", "2 turns".
func countOf(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	if strings.HasSuffix(what, "ch") || strings.HasSuffix(what, "s") {
		return strconv.Itoa(n) + " " + what + "es"
	}
	return strconv.Itoa(n) + " " + what + "s"
}
