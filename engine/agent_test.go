package engine

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/waymark-dev/waymark/engine/client"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

const agentFlow = `
name: agentflow
version: 1
steps:
  - id: agent
    kind: agent
    save_as: agent
    with: {provider: replay, prompt: "find a vendor"}
    limits: {max_turns: 5}
    prices: {m1: {input: 3, output: 15}}
    tools:
      - {name: search, kind: noop, effect: pure}
      - name: buy
        kind: noop
        effect: idempotent
        input_schema: {type: object, required: [sku], properties: {sku: {type: string}}}
    next: [{to: after}]
  - {id: after, kind: noop, save_as: after}
`

// turnOut is a worker's turn output: text and tool calls (id, name,
// input), with usage.
func turnOut(t *testing.T, prompt bool, text string, calls ...[3]string) json.RawMessage {
	t.Helper()
	out := schemas.AgentTurn{Model: "m1", StopReason: "end_turn", Usage: schemas.TokenUsage{Input: 100, Output: 10}}
	if prompt {
		out.Prompt = &schemas.AgentMessage{Role: "user", Content: []schemas.AgentBlock{{Type: "text", Text: "find a vendor"}}}
	}
	out.Message.Role = "assistant"
	if text != "" {
		out.Message.Content = append(out.Message.Content, schemas.AgentBlock{Type: "text", Text: text})
	}
	for _, c := range calls {
		out.Message.Content = append(out.Message.Content, schemas.AgentBlock{Type: "tool_use", ToolUseID: c[0], Name: c[1], Input: json.RawMessage(c[2])})
		out.StopReason = "tool_use"
	}
	b, err := json.Marshal(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// transcriptOf reads the transcript a turn message carries.
func (b *bundle) transcriptOf(sm *schemas.StepMessage) []schemas.AgentMessage {
	b.t.Helper()
	var all []schemas.AgentMessage
	for _, p := range sm.Transcript {
		data, err := b.store.Values.Get(context.Background(), sm.ValueOwner, p.Ref())
		if err != nil {
			b.t.Fatalf("transcript part %s: %v", p.Digest, err)
		}
		var msgs []schemas.AgentMessage
		if err := json.Unmarshal(data, &msgs); err != nil || len(msgs) != p.Messages {
			b.t.Fatalf("transcript part %s: %d messages, want %d (%v)", p.Digest, len(msgs), p.Messages, err)
		}
		all = append(all, msgs...)
	}
	return all
}

// TestAgentLoopDispatchesToolCallsAndKeepsTheTranscript: each model turn
// and each valid tool call is a dispatch of its own; a call of an unknown
// tool or with arguments against the tool's schema is answered with an
// error the model reads, without a dispatch; the tool results of a turn
// join the transcript in the order of the calls; the ledger key of an
// idempotent tool's call names its turn and tool_use id; the output
// counts turns, calls and tokens, and names the whole transcript.
func TestAgentLoopDispatchesToolCallsAndKeepsTheTranscript(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(agentFlow)
	id := b.start(def, `{}`, "agent-1")

	t1 := next(t, ch)
	if t1.sm.Step != "agent" || t1.sm.Turn != 1 || len(t1.sm.Transcript) != 0 || t1.sm.Item != 0 {
		t.Fatalf("first message: step %s turn %d, %d transcript parts, item %d", t1.sm.Step, t1.sm.Turn, len(t1.sm.Transcript), t1.sm.Item)
	}
	t1.reply(turnOut(t, true, "looking", [3]string{"c1", "search", `{"q":"pumps"}`}, [3]string{"c2", "buy", `{"sku":5}`}, [3]string{"c3", "steal", `{}`}), nil)

	call := next(t, ch)
	if call.sm.Tool != "search" || call.sm.ItemName != "c1" || string(call.sm.ItemValue) != `{"q":"pumps"}` || call.sm.EffectKey != "" {
		t.Fatalf("tool call: tool %q id %q args %s key %q", call.sm.Tool, call.sm.ItemName, call.sm.ItemValue, call.sm.EffectKey)
	}
	call.reply(json.RawMessage(`{"vendors":["acme"]}`), nil)

	t2 := next(t, ch)
	if t2.sm.Turn != 2 {
		t.Fatalf("after the tools came turn %d (tool %q)", t2.sm.Turn, t2.sm.Tool)
	}
	msgs := b.transcriptOf(t2.sm)
	if len(msgs) != 3 || msgs[0].Role != "user" || msgs[1].Role != "assistant" || msgs[2].Role != "user" {
		t.Fatalf("transcript before turn 2: %+v", msgs)
	}
	res := msgs[2].Content
	if len(res) != 3 || res[0].ToolUseID != "c1" || res[0].Content != `{"vendors":["acme"]}` || res[0].IsError ||
		res[1].ToolUseID != "c2" || !res[1].IsError || !strings.Contains(res[1].Content, "input_schema") ||
		res[2].ToolUseID != "c3" || !res[2].IsError || !strings.Contains(res[2].Content, `no tool "steal"`) {
		t.Fatalf("tool results: %+v", res)
	}
	t2.reply(turnOut(t, false, "", [3]string{"c4", "buy", `{"sku":"A1"}`}), nil)

	buy := next(t, ch)
	if want := id + "/agent/turn-2/c4"; buy.sm.Tool != "buy" || buy.sm.EffectKey != want {
		t.Fatalf("buy call: tool %q key %q, want key %q", buy.sm.Tool, buy.sm.EffectKey, want)
	}
	buy.reply(json.RawMessage(`{"order":7}`), nil)

	t3 := next(t, ch)
	if t3.sm.Turn != 3 || len(b.transcriptOf(t3.sm)) != 5 {
		t.Fatalf("turn %d with %d messages", t3.sm.Turn, len(b.transcriptOf(t3.sm)))
	}
	t3.reply(turnOut(t, false, "bought from acme"), nil)

	after := next(t, ch)
	if after.sm.Step != "after" {
		t.Fatalf("after the agent came %s", after.sm.Step)
	}
	after.reply(json.RawMessage(`{}`), nil)
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	var st struct {
		Agent schemas.AgentOutput `json:"agent"`
	}
	if err := json.Unmarshal(v.State, &st); err != nil {
		t.Fatal(err)
	}
	out := st.Agent
	if out.Text != "bought from acme" || out.StopReason != schemas.StopEndTurn || out.Turns != 3 || out.ToolCalls != 4 || out.InvalidCalls != 2 {
		t.Fatalf("output %+v", out)
	}
	if u := out.Usage["m1"]; u.Input != 300 || u.Output != 30 {
		t.Errorf("usage %+v, want 300 in, 30 out", u)
	}
	if want := 3 * (100*3.0 + 10*15.0) / 1e6; out.Cost < want*0.999 || out.Cost > want*1.001 {
		t.Errorf("cost %v, want %v", out.Cost, want)
	}
	if out.Transcript == nil || out.Transcript.Messages != 6 {
		t.Fatalf("transcript %+v, want 6 messages", out.Transcript)
	}
	data, err := b.store.Values.Get(context.Background(), id, out.Transcript.Ref())
	if err != nil || !strings.Contains(string(data), "bought from acme") {
		t.Fatalf("transcript value: %v %.200s", err, data)
	}
}

// TestAgentLimitsStopTheLoop: max_turns reached with tool calls pending
// fails the step with limit_reached (on_limit fail, the default), and
// under on_limit complete saves the output with the stop reason;
// max_tool_calls stops a turn whose calls would pass it, before any runs.
func TestAgentLimitsStopTheLoop(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, limits, onLimit, stop string
		turns                       int
	}{
		{"turns-fail", "{max_turns: 2}", "", schemas.StopMaxTurns, 2},
		{"turns-complete", "{max_turns: 2}", "complete", schemas.StopMaxTurns, 2},
		{"calls", "{max_tool_calls: 2}", "complete", schemas.StopMaxToolCalls, 2},
		{"tokens", "{max_tokens: 150}", "complete", schemas.StopMaxTokens, 2},
		{"cost", "{max_cost: 0.0008}", "complete", schemas.StopMaxCost, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, setupOptions{})
			ch := b.manualWorker()
			y := strings.Replace(agentFlow, "limits: {max_turns: 5}", "limits: "+tc.limits, 1)
			if tc.onLimit != "" {
				y = strings.Replace(y, "save_as: agent\n", "save_as: agent\n    on_limit: "+tc.onLimit+"\n", 1)
			}
			def := b.define(y)
			id := b.start(def, `{}`, "agent-"+tc.name)
			for turn := 1; ; turn++ {
				h := next(t, ch)
				if h.sm.Turn != turn {
					t.Fatalf("turn %d: got a message of turn %d, tool %q", turn, h.sm.Turn, h.sm.Tool)
				}
				h.reply(turnOut(t, turn == 1, "", [3]string{"a" + string(rune('0'+turn)), "search", `{}`}, [3]string{"b" + string(rune('0'+turn)), "search", `{}`}), nil)
				if turn == tc.turns {
					break
				}
				for range 2 {
					c := next(t, ch)
					c.reply(json.RawMessage(`"ok"`), nil)
				}
			}
			if tc.onLimit != "" {
				if h := next(t, ch); h.sm.Step != "after" {
					t.Fatalf("after the agent stopped came %s turn %d", h.sm.Step, h.sm.Turn)
				} else {
					h.reply(json.RawMessage(`{}`), nil)
				}
			}
			v := b.wait(id)
			if tc.onLimit == "" {
				if v.Status != schemas.JobFailed || v.Error == nil || v.Error.Code != schemas.CodeLimitReached || !strings.Contains(v.Error.Message, tc.stop) {
					t.Fatalf("status %s, error %+v; want failed with %s", v.Status, v.Error, tc.stop)
				}
				// What the model did stays readable after the failure.
				if len(v.Transcripts) != 1 || v.Transcripts[0].Messages != 2*tc.turns {
					t.Fatalf("transcripts %+v, want one of %d messages", v.Transcripts, 2*tc.turns)
				}
				if _, err := b.store.Values.Get(context.Background(), id, v.Transcripts[0].Ref()); err != nil {
					t.Fatalf("the failed agent's transcript: %v", err)
				}
				return
			}
			if v.Status != schemas.JobCompleted {
				t.Fatalf("status %s, error %+v", v.Status, v.Error)
			}
			var st struct {
				Agent schemas.AgentOutput `json:"agent"`
			}
			_ = json.Unmarshal(v.State, &st)
			if st.Agent.StopReason != tc.stop || st.Agent.Turns != tc.turns {
				t.Fatalf("output %+v, want stop %s after %d turns", st.Agent, tc.stop, tc.turns)
			}
		})
	}
}

// TestAgentAnswerThatBreaksItsSchemaGoesBackToTheModel: under an
// output_schema the final text must be JSON of that schema; one that is
// not is answered with the schema's complaint, and the next answer is
// saved as answer.
func TestAgentAnswerThatBreaksItsSchemaGoesBackToTheModel(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	y := strings.Replace(agentFlow, "save_as: agent\n", "save_as: agent\n    output_schema: {type: object, required: [vendor], properties: {vendor: {type: string}}}\n", 1)
	def := b.define(y)
	id := b.start(def, `{}`, "agent-schema")
	next(t, ch).reply(turnOut(t, true, "acme, I think"), nil)
	h := next(t, ch)
	msgs := b.transcriptOf(h.sm)
	if h.sm.Turn != 2 || len(msgs) != 3 || !strings.Contains(msgs[2].Content[0].Text, "not a JSON value") {
		t.Fatalf("turn %d, transcript %+v", h.sm.Turn, msgs)
	}
	h.reply(turnOut(t, false, "{\"vendor\": 3}"), nil)
	h = next(t, ch)
	if msgs := b.transcriptOf(h.sm); len(msgs) != 5 || !strings.Contains(msgs[4].Content[0].Text, "JSON Schema") {
		t.Fatalf("turn %d, transcript %+v", h.sm.Turn, msgs)
	}
	h.reply(turnOut(t, false, "```json\n{\"vendor\": \"acme\"}\n```"), nil)
	next(t, ch).reply(json.RawMessage(`{}`), nil)
	v := b.wait(id)
	if v.Status != schemas.JobCompleted || !strings.Contains(string(v.State), `"answer":{"vendor":"acme"}`) {
		t.Fatalf("status %s, state %s", v.Status, v.State)
	}
}

// TestAgentTurnWaitingForARateLimitUsesNoAttempt: a turn answered
// CodeWaiting (the provider's Retry-After) is dispatched again after that
// delay with the same run attempt; the tools already done are not run
// again.
func TestAgentTurnWaitingForARateLimitUsesNoAttempt(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(agentFlow)
	id := b.start(def, `{}`, "agent-429")
	next(t, ch).reply(turnOut(t, true, "", [3]string{"c1", "search", `{}`}), nil)
	next(t, ch).reply(json.RawMessage(`"found"`), nil)
	for range 3 {
		h := next(t, ch)
		if h.sm.Turn != 2 || h.sm.RunAttempt != 1 {
			t.Fatalf("turn %d run attempt %d, want turn 2 attempt 1", h.sm.Turn, h.sm.RunAttempt)
		}
		h.reply(nil, &schemas.Error{Code: schemas.CodeWaiting, Retryable: true, RetryAfterMs: 1, Message: "rate limited"})
	}
	h := next(t, ch)
	if h.sm.Turn != 2 || h.sm.Tool != "" {
		t.Fatalf("after the waits: turn %d tool %q", h.sm.Turn, h.sm.Tool)
	}
	h.reply(turnOut(t, false, "done"), nil)
	next(t, ch).reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
}

// TestAgentToolCallWithUnknownOutcomeWaitsForAPerson: an unsafe tool's
// call fails for good while its effect may have happened; the job stops in
// needs_reconciliation naming the call and its arguments; the turn's other
// call finishes meanwhile and no turn is dispatched; the resolution sends
// that call again under the same key, and the loop goes on.
func TestAgentToolCallWithUnknownOutcomeWaitsForAPerson(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	y := strings.Replace(agentFlow, "      - {name: search, kind: noop, effect: pure}", "      - {name: search, kind: noop, effect: pure}\n      - {name: mail, kind: noop, effect: unsafe}", 1)
	def := b.define(y)
	id := b.start(def, `{}`, "agent-unsafe")
	next(t, ch).reply(turnOut(t, true, "", [3]string{"m1", "mail", `{"to":"ops@example.com"}`}, [3]string{"s1", "search", `{}`}), nil)
	var mail, search held
	for range 2 {
		h := next(t, ch)
		if h.sm.Tool == "mail" {
			mail = h
		} else {
			search = h
		}
	}
	key := mail.sm.EffectKey
	if want := id + "/agent/turn-1/m1"; key != want {
		t.Fatalf("mail key %q, want %q", key, want)
	}
	mail.send(&schemas.StepResult{Job: id, Step: "agent", Attempt: mail.sm.Attempt, Item: mail.sm.Item, EffectKey: key,
		EffectState: schemas.EffectDispatched, Error: &schemas.Error{Code: schemas.CodeTimeout, Message: "no answer from the mail server"}})
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, _ := b.client.Job(context.Background(), id)
		return v != nil && v.Status == schemas.JobNeedsReconciliation
	}, "the job did not stop for reconciliation")
	v, _ := b.client.Job(context.Background(), id)
	if v.Blocked == nil || v.Blocked.EffectKey != key || !strings.Contains(v.Blocked.Reason, `tool mail, call m1 with arguments {"to":"ops@example.com"}`) {
		t.Fatalf("blocked %+v", v.Blocked)
	}
	search.reply(json.RawMessage(`"found"`), nil) // in flight: still applied
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, _ := b.client.Job(context.Background(), id)
		return v.Fan != nil && v.Fan.Agent != nil && v.Fan.Agent.Calls[1].Done
	}, "the call in flight was not applied")
	select {
	case h := <-ch:
		t.Fatalf("turn %d tool %q was dispatched while the job waits for a person", h.sm.Turn, h.sm.Tool)
	case <-time.After(200 * time.Millisecond):
	}
	sig := nats.NewMsg(b.store.Names.InboxSubject(kv.InboxSignal, id))
	sig.Data, _ = json.Marshal(schemas.Signal{Job: id, Type: schemas.SignalEffectResolved, Key: key, By: "test"})
	if _, err := b.store.JS.PublishMsg(context.Background(), sig); err != nil {
		t.Fatal(err)
	}
	again := next(t, ch)
	if again.sm.Tool != "mail" || again.sm.Attempt != mail.sm.Attempt+1 || again.sm.EffectKey != key {
		t.Fatalf("after the resolution came tool %q attempt %d key %s", again.sm.Tool, again.sm.Attempt, again.sm.EffectKey)
	}
	again.reply(json.RawMessage(`{"sent": true}`), nil)
	t2 := next(t, ch)
	if msgs := b.transcriptOf(t2.sm); t2.sm.Turn != 2 || len(msgs) != 3 || len(msgs[2].Content) != 2 || msgs[2].Content[0].ToolUseID != "m1" {
		t.Fatalf("turn %d transcript %+v", t2.sm.Turn, msgs)
	}
	t2.reply(turnOut(t, false, "done"), nil)
	next(t, ch).reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
}

func TestParseAnswer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ text, want, why string }{
		{text: `{"a": 1}`, want: `{"a":1}`},
		{text: "```json\n{\"a\": 1}\n```", want: `{"a":1}`},
		{text: "Here it is:\n\n```json\n{\"a\": 1}\n```\nDone.", want: `{"a":1}`},
		{text: "acme, I think", why: "not a JSON value"},
		{text: "```json\n{\"a\": 1}", why: "not closed"},
		{text: "```json\n{}\n```\nor\n```json\n[]\n```", why: "more than one code block"},
		{text: "```\nnot json\n```", why: "code block is not a JSON value"},
	} {
		got, why := parseAnswer(tc.text)
		if string(got) != tc.want || (tc.why == "") != (why == "") || !strings.Contains(why, tc.why) {
			t.Errorf("parseAnswer(%q) = %s, %q; want %s, %q", tc.text, got, why, tc.want, tc.why)
		}
	}
}

// TestAgentToolThatIsAChildJob: a tool of kind workflow starts a child job
// whose input is the call's arguments (checked by the child's input
// schema); the child's final state is the tool's result, which the model
// reads at the next turn.
func TestAgentToolThatIsAChildJob(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	b.storeDef(kidWorkflow)
	y := strings.Replace(agentFlow, "      - {name: search, kind: noop, effect: pure}",
		"      - {name: search, kind: noop, effect: pure}\n      - {name: count, kind: workflow, input_schema: {type: object}, with: {workflow: kid}}", 1)
	def := b.define(y)
	id := b.start(def, `{}`, "agent-kid")
	next(t, ch).reply(turnOut(t, true, "", [3]string{"k1", "count", `{"n": 4}`}), nil)
	child := schemas.ChildJobID(id, "agent-k1", 1)
	for _, step := range []string{"k1", "k2"} {
		h := next(t, ch)
		if h.sm.Job != child || h.sm.Step != step {
			t.Fatalf("got job %s step %s, want the child %s's step %s", h.sm.Job, h.sm.Step, child, step)
		}
		h.reply(json.RawMessage(`{"ok": true}`), nil)
	}
	t2 := next(t, ch)
	msgs := b.transcriptOf(t2.sm)
	if t2.sm.Turn != 2 || len(msgs) != 3 || msgs[2].Content[0].ToolUseID != "k1" || msgs[2].Content[0].IsError ||
		!strings.Contains(msgs[2].Content[0].Content, `"n":4`) || !strings.Contains(msgs[2].Content[0].Content, `"k2"`) {
		t.Fatalf("turn %d, transcript %+v", t2.sm.Turn, msgs)
	}
	t2.reply(turnOut(t, false, "4 counted"), nil)
	next(t, ch).reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
	cv, err := b.client.Job(context.Background(), child)
	if err != nil || cv.ParentJob != id || cv.ParentStep != "agent" {
		t.Fatalf("child %+v: %v", cv, err)
	}
}

// TestAgentToolCallWaitsForApproval: a call of a tool that requires
// approval waits at its gate, bound to its arguments, while the turn's
// other calls run; the job waits for approval once nothing else runs;
// approved, the call is dispatched; a rejected call is answered with an
// error the model reads and is never dispatched.
func TestAgentToolCallWaitsForApproval(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(`
name: agentgate
version: 1
steps:
  - id: agent
    kind: agent
    save_as: agent
    with: {provider: replay, prompt: "buy"}
    limits: {max_turns: 5}
    tools:
      - {name: search, kind: noop, effect: pure}
      - name: buy
        kind: noop
        effect: idempotent
        input_schema: {type: object, required: [sku], properties: {sku: {type: string}}}
        requires_approval: {approvers: [alice], action: 'buy {{.args.sku}}'}
`)
	id := b.start(def, `{}`, "agent-gate")
	next(t, ch).reply(turnOut(t, true, "", [3]string{"c1", "search", `{}`}, [3]string{"c2", "buy", `{"sku":"A1"}`}), nil)
	search := next(t, ch)
	if search.sm.Tool != "search" {
		t.Fatalf("dispatched %s", search.sm.Tool)
	}
	c := ctx30(t)
	v, _ := b.client.Job(c, id)
	if v.Status != schemas.JobRunning || len(v.Approvals) != 1 || v.Approvals[0].ID != "agent.buy/c2" || v.Approvals[0].Action != "buy A1" || string(v.Approvals[0].Data) != `{"sku":"A1"}` {
		t.Fatalf("while search runs: status %s approvals %+v", v.Status, v.Approvals)
	}
	search.reply(json.RawMessage(`{"found": 1}`), nil)
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, _ = b.client.Job(c, id)
		return v.Status == schemas.JobWaitingApproval
	}, "the job never waited for the call's approval: %s", v.Status)
	if _, err := b.client.Approve(c, id, "agent.buy", client.ControlRequest{By: "alice"}); err != nil {
		t.Fatal(err)
	}
	buy := next(t, ch)
	if buy.sm.Tool != "buy" || string(buy.sm.ItemValue) != `{"sku":"A1"}` || !strings.HasSuffix(buy.sm.EffectKey, "/turn-1/c2") {
		t.Fatalf("approved call: tool %s args %s key %s", buy.sm.Tool, buy.sm.ItemValue, buy.sm.EffectKey)
	}
	buy.reply(json.RawMessage(`{"order": "o1"}`), nil)
	t2 := next(t, ch)
	t2.reply(turnOut(t, false, "", [3]string{"c3", "buy", `{"sku":"B2"}`}), nil)
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, _ = b.client.Job(c, id)
		return v.Status == schemas.JobWaitingApproval
	}, "the second call never waited: %s", v.Status)
	if _, err := b.client.Reject(c, id, "agent.buy/c3", client.ControlRequest{By: "alice", Reason: "not that one"}); err != nil {
		t.Fatal(err)
	}
	t3 := next(t, ch)
	if t3.sm.Turn != 3 {
		t.Fatalf("after the rejection came %s turn %d", t3.sm.Tool, t3.sm.Turn)
	}
	msgs := b.transcriptOf(t3.sm)
	last := msgs[len(msgs)-1].Content
	if len(last) != 1 || last[0].ToolUseID != "c3" || !last[0].IsError || !strings.Contains(last[0].Content, "not approved (rejected by alice: not that one); it was not made") {
		t.Fatalf("the model reads: %+v", last)
	}
	t3.reply(turnOut(t, false, "done"), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s %+v", v.Status, v.Error)
	}
}
