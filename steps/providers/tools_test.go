package providers_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/steps/providers"
)

var weatherTools = []providers.Tool{
	{Name: "get_weather", Description: "Current weather in a city.", InputSchema: json.RawMessage(`{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}`)},
	{Name: "get_time", Description: "Local time in a city.", InputSchema: json.RawMessage(`{"type":"object","properties":{"city":{"type":"string"}}}`)},
}

const agentSystem = "You answer questions about cities, using tools."

// scriptedTurns are the server's replies in the three-turn conversation:
// two parallel calls, then text with one more call, then the answer.
var scriptedTurns = []fakemodel.Response{
	{ToolCalls: []fakemodel.ToolCall{
		{ID: "call_paris", Name: "get_weather", Input: json.RawMessage(`{"city":"Paris"}`)},
		{ID: "call_rome", Name: "get_weather", Input: json.RawMessage(`{"city":"Rome"}`)},
	}, InputTokens: 120, OutputTokens: 30, CacheWriteTokens: 400},
	{Text: "Now the time in Rome.", ToolCalls: []fakemodel.ToolCall{
		{ID: "call_time", Name: "get_time", Input: json.RawMessage(`{"city":"Rome"}`)},
	}, InputTokens: 60, OutputTokens: 12, CacheReadTokens: 400},
	{Text: "Paris 18C, Rome 21C; Rome's clock is down.", InputTokens: 70, OutputTokens: 11, CacheReadTokens: 400, CacheWriteTokens: 90},
}

// toolResults answers each turn's calls; turn 3's call fails.
var toolResults = [][]providers.Block{
	{providers.ToolResultBlock("call_paris", "18C, cloudy", false), providers.ToolResultBlock("call_rome", "21C, sunny", false)},
	{providers.ToolResultBlock("call_time", "clock service unavailable", true)},
}

// runConversation drives the three turns through p and returns the replies.
func runConversation(t *testing.T, p providers.Provider) []providers.Reply {
	t.Helper()
	msgs := []providers.Message{{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock("Weather in Paris and Rome, and the time in Rome?")}}}
	var replies []providers.Reply
	for turn := 1; turn <= 3; turn++ {
		req := providers.Request{Model: "model-t", System: agentSystem, Messages: msgs, Tools: weatherTools, Step: "agent", Attempt: 1, Turn: turn}
		reply, err := p.Complete(t.Context(), req)
		if err != nil {
			t.Fatalf("turn %d: %v", turn, err)
		}
		replies = append(replies, reply)
		if turn < 3 {
			msgs = append(msgs, reply.Message(), providers.Message{Role: providers.RoleUser, Content: toolResults[turn-1]})
		}
	}
	return replies
}

func TestToolConversation(t *testing.T) {
	t.Parallel()
	for _, l := range lives {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, l, fakemodel.Queue(scriptedTurns...))
			got := runConversation(t, b.p)

			stop := map[string][2]string{providers.Anthropic: {"tool_use", "end_turn"}, providers.OpenAI: {"tool_calls", "stop"}}[l.name]
			want := []providers.Reply{
				{ToolCalls: []providers.ToolCall{
					{ID: "call_paris", Name: "get_weather", Input: json.RawMessage(`{"city":"Paris"}`)},
					{ID: "call_rome", Name: "get_weather", Input: json.RawMessage(`{"city":"Rome"}`)},
				}, Model: "model-t", StopReason: stop[0], Usage: providers.Usage{InputTokens: 120, OutputTokens: 30, CacheWriteTokens: 400}},
				{Text: "Now the time in Rome.", ToolCalls: []providers.ToolCall{
					{ID: "call_time", Name: "get_time", Input: json.RawMessage(`{"city":"Rome"}`)},
				}, Model: "model-t", StopReason: stop[0], Usage: providers.Usage{InputTokens: 60, OutputTokens: 12, CacheReadTokens: 400}},
				{Text: "Paris 18C, Rome 21C; Rome's clock is down.", Model: "model-t", StopReason: stop[1], Usage: providers.Usage{InputTokens: 70, OutputTokens: 11, CacheReadTokens: 400, CacheWriteTokens: 90}},
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("replies:\n got %+v\nwant %+v", got, want)
			}

			reqs := b.srv.Requests()
			if len(reqs) != 3 {
				t.Fatalf("server saw %d requests, want 3", len(reqs))
			}
			wantMsgs := map[string][]string{
				providers.Anthropic: {
					`user: text "Weather in Paris and Rome, and the time in Rome?"`,
					`assistant: tool_use call_paris get_weather {"city":"Paris"} | tool_use call_rome get_weather {"city":"Rome"}`,
					`user: tool_result call_paris "18C, cloudy" | tool_result call_rome "21C, sunny"`,
					`assistant: text "Now the time in Rome." | tool_use call_time get_time {"city":"Rome"}`,
					`user: tool_result call_time "clock service unavailable" error`,
				},
				providers.OpenAI: {
					`system: text "` + agentSystem + `"`,
					`user: text "Weather in Paris and Rome, and the time in Rome?"`,
					`assistant: tool_use call_paris get_weather {"city":"Paris"} | tool_use call_rome get_weather {"city":"Rome"}`,
					`tool: tool_result call_paris "18C, cloudy"`,
					`tool: tool_result call_rome "21C, sunny"`,
					`assistant: text "Now the time in Rome." | tool_use call_time get_time {"city":"Rome"}`,
					`tool: tool_result call_time "Error: clock service unavailable"`,
				},
			}[l.name]
			// Turn n sends the conversation up to its n-th user turn.
			wantLens := map[string][]int{providers.Anthropic: {1, 3, 5}, providers.OpenAI: {2, 5, 7}}[l.name]
			for i, seen := range reqs {
				if gotMsgs, want := summarise(seen.Messages), wantMsgs[:wantLens[i]]; !reflect.DeepEqual(gotMsgs, want) {
					t.Errorf("turn %d: server saw messages\n  %s\nwant\n  %s", i+1, strings.Join(gotMsgs, "\n  "), strings.Join(want, "\n  "))
				}
				if seen.System != agentSystem {
					t.Errorf("turn %d: system %q", i+1, seen.System)
				}
				assertToolsDeclared(t, l.name, i+1, seen)
			}
		})
	}
}

// summarise renders messages one line each, for comparing conversations.
func summarise(msgs []fakemodel.Message) []string {
	var out []string
	for _, m := range msgs {
		var blocks []string
		for _, b := range m.Blocks {
			switch b.Type {
			case "text":
				blocks = append(blocks, fmt.Sprintf("text %q", b.Text))
			case "tool_use":
				var compact bytes.Buffer
				_ = json.Compact(&compact, b.Input)
				blocks = append(blocks, fmt.Sprintf("tool_use %s %s %s", b.ID, b.Name, compact.String()))
			case "tool_result":
				s := fmt.Sprintf("tool_result %s %q", b.ToolUseID, b.Content)
				if b.IsError {
					s += " error"
				}
				blocks = append(blocks, s)
			default:
				blocks = append(blocks, b.Type)
			}
		}
		out = append(out, m.Role+": "+strings.Join(blocks, " | "))
	}
	return out
}

// assertToolsDeclared checks the request declared both tools with their
// schemas and, for Anthropic, marked the cache prefix.
func assertToolsDeclared(t *testing.T, provider string, turn int, seen fakemodel.Request) {
	t.Helper()
	if len(seen.Tools) != len(weatherTools) {
		t.Fatalf("turn %d: %d tools declared, want %d", turn, len(seen.Tools), len(weatherTools))
	}
	for i, tool := range seen.Tools {
		want := weatherTools[i]
		if tool.Name != want.Name || tool.Description != want.Description || !jsonEqual(t, tool.InputSchema, want.InputSchema) {
			t.Errorf("turn %d: tool %d = %s %q %s, want %s %q %s", turn, i, tool.Name, tool.Description, tool.InputSchema, want.Name, want.Description, want.InputSchema)
		}
	}
	var wantSystemCache, wantLastToolCache string
	if provider == providers.Anthropic {
		wantSystemCache, wantLastToolCache = "ephemeral", "ephemeral"
	}
	if seen.SystemCacheControl != wantSystemCache {
		t.Errorf("turn %d: system cache_control %q, want %q", turn, seen.SystemCacheControl, wantSystemCache)
	}
	if got := seen.Tools[0].CacheControl; got != "" {
		t.Errorf("turn %d: first tool cache_control %q, want none (the breakpoint goes on the last)", turn, got)
	}
	if got := seen.Tools[len(seen.Tools)-1].CacheControl; got != wantLastToolCache {
		t.Errorf("turn %d: last tool cache_control %q, want %q", turn, got, wantLastToolCache)
	}
	// The conversation so far is the next turn's prefix: its last block is
	// a cache breakpoint, and no other message block is.
	marks := 0
	for i, m := range seen.Messages {
		for j, b := range m.Blocks {
			if b.CacheControl == "" {
				continue
			}
			marks++
			if i != len(seen.Messages)-1 || j != len(m.Blocks)-1 {
				t.Errorf("turn %d: message %d block %d has cache_control; only the last block of the last message should", turn, i, j)
			}
		}
	}
	if want := map[bool]int{true: 1, false: 0}[provider == providers.Anthropic && len(seen.Messages) > 1]; marks != want {
		t.Errorf("turn %d: %d message blocks with cache_control, want %d", turn, marks, want)
	}
}

func jsonEqual(t *testing.T, a, b json.RawMessage) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Errorf("%s: %v", a, err)
		return false
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Errorf("%s: %v", b, err)
		return false
	}
	return reflect.DeepEqual(x, y)
}

func TestOpenAIMalformedToolArguments(t *testing.T) {
	t.Parallel()
	const malformed = `{"city": "Par`
	b := setup(t, lives[1], fakemodel.Queue(
		fakemodel.Response{ToolCalls: []fakemodel.ToolCall{
			{ID: "call_bad", Name: "get_weather", Arguments: malformed},
			{ID: "call_empty", Name: "get_time", Arguments: " "},
		}},
		fakemodel.Response{Text: "Sorry, retrying with valid arguments."},
	))
	msgs := []providers.Message{{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock("Weather in Paris?")}}}
	reply, err := b.p.Complete(t.Context(), providers.Request{Model: "m", Messages: msgs, Tools: weatherTools, Step: "agent", Turn: 1})
	if err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if len(reply.ToolCalls) != 2 {
		t.Fatalf("tool calls %+v, want 2", reply.ToolCalls)
	}
	var asGiven string
	if err := json.Unmarshal(reply.ToolCalls[0].Input, &asGiven); err != nil || asGiven != malformed {
		t.Errorf("malformed arguments: Input %s, want the JSON string %q (err %v)", reply.ToolCalls[0].Input, malformed, err)
	}
	if got := string(reply.ToolCalls[1].Input); got != "{}" {
		t.Errorf("blank arguments: Input %s, want {}", got)
	}

	// The caller answers with error results; the calls go back as the
	// model sent them.
	msgs = append(msgs, reply.Message(), providers.Message{Role: providers.RoleUser, Content: []providers.Block{
		providers.ToolResultBlock("call_bad", "arguments are not valid JSON", true),
		providers.ToolResultBlock("call_empty", "", true),
	}})
	if _, err := b.p.Complete(t.Context(), providers.Request{Model: "m", Messages: msgs, Tools: weatherTools, Step: "agent", Turn: 2}); err != nil {
		t.Fatalf("turn 2: %v", err)
	}
	var body struct {
		Messages []struct {
			Role      string `json:"role"`
			ToolCalls []struct {
				Function struct{ Arguments string } `json:"function"`
			} `json:"tool_calls"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(b.srv.Requests()[1].Body, &body); err != nil {
		t.Fatal(err)
	}
	if got := body.Messages[1].ToolCalls[0].Function.Arguments; got != malformed {
		t.Errorf("arguments sent back %q, want %q as the model gave them", got, malformed)
	}
}

func TestToolConversationReplay(t *testing.T) {
	t.Parallel()
	srv := fakemodel.NewAnthropic(t, fakemodel.Queue(scriptedTurns...))
	live := providers.NewAnthropic(providers.Config{APIKey: testKey, BaseURL: srv.URL(), HTTPClient: srv.Client()})
	path := filepath.Join(t.TempDir(), "agent.json")
	recorded := runConversation(t, providers.NewRecorder(live, path))

	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	c, err := providers.ParseCassette(data)
	if err != nil {
		t.Fatalf("ParseCassette: %v\n%s", err, data)
	}
	if len(c.Interactions) != 3 {
		t.Fatalf("%d interactions, want one per turn:\n%s", len(c.Interactions), data)
	}
	for i, in := range c.Interactions {
		if in.Step != "agent" || in.Turn != i+1 || in.PromptSHA256 == "" {
			t.Errorf("interaction %d: step %q turn %d hash %q, want agent, turn %d, a hash", i, in.Step, in.Turn, in.PromptSHA256, i+1)
		}
	}
	if !bytes.Contains(data, []byte(`"tool_calls"`)) || !bytes.Contains(data, []byte(`"cache_read_input_tokens": 400`)) {
		t.Errorf("cassette lacks tool calls or cache usage:\n%s", data)
	}

	replayed := runConversation(t, providers.NewReplay(c))
	if !reflect.DeepEqual(jsonOf(t, replayed), jsonOf(t, recorded)) {
		t.Errorf("replayed\n %s\nwant the recorded\n %s", jsonOf(t, replayed), jsonOf(t, recorded))
	}
	if n := len(srv.Requests()); n != 3 {
		t.Errorf("server saw %d requests, want 3 (replay stays offline)", n)
	}
}

// jsonOf encodes v; tool inputs are compared as JSON, as the recorder
// re-indents them.
func jsonOf(t *testing.T, v any) string {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func TestReplayConversationMiss(t *testing.T) {
	t.Parallel()
	msgs := []providers.Message{{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock("hi")}}}
	turn1 := providers.Request{System: "s", Messages: msgs, Tools: weatherTools, Step: "agent", Turn: 1}
	p := providers.NewReplay(&providers.Cassette{Version: providers.CassetteVersion, Interactions: []providers.Interaction{
		{Step: "agent", Turn: 1, PromptSHA256: providers.PromptHash(turn1), Replies: []providers.Reply{{Text: "hello"}}},
	}})
	if reply, err := p.Complete(t.Context(), turn1); err != nil || reply.Text != "hello" {
		t.Fatalf("recorded turn: %+v, %v", reply, err)
	}

	edited := turn1
	edited.Messages = []providers.Message{{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock("hi there")}}}
	turn2 := turn1
	turn2.Turn = 2
	for _, tt := range []struct {
		name string
		req  providers.Request
		why  string
	}{
		{name: "conversation changed", req: edited, why: "changed since recording"},
		{name: "turn not recorded", req: turn2, why: "none for this turn"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := p.Complete(t.Context(), tt.req)
			if !errors.Is(err, providers.ErrNoRecording) {
				t.Fatalf("error %v, want ErrNoRecording", err)
			}
			perr := assertProviderError(t, err, providers.Replay, false)
			hash := providers.PromptHash(tt.req)
			entry := fmt.Sprintf(`{"step": "agent", "turn": %d, "prompt_sha256": %q, "replies": [{"text": "...", "tool_calls": [...]}]}`, tt.req.Turn, hash)
			for _, s := range []string{fmt.Sprintf(`step "agent" turn %d`, tt.req.Turn), hash, tt.why, entry} {
				if !strings.Contains(perr.Message, s) {
					t.Errorf("Message = %q\nwant it to contain %q", perr.Message, s)
				}
			}
		})
	}
}

func TestPromptHashConversation(t *testing.T) {
	t.Parallel()
	req := providers.Request{
		System: "sys <b>",
		Messages: []providers.Message{
			{Role: "user", Content: []providers.Block{providers.TextBlock("hi")}},
			{Role: "assistant", Content: []providers.Block{{Type: "tool_use", ToolUseID: "c1", Name: "f", Input: json.RawMessage(`{ "b": 1.50, "a": [true] }`)}}},
			{Role: "user", Content: []providers.Block{providers.ToolResultBlock("c1", "ok", true)}},
		},
		Tools: []providers.Tool{{Name: "f", InputSchema: json.RawMessage(`{"type": "object"}`)}},
		Model: "ignored", Step: "ignored", Turn: 2,
	}
	// The documented rule, written out by hand.
	canonical := `{"system":"sys \u003cb\u003e","messages":[` +
		`{"role":"user","content":[{"type":"text","text":"hi"}]},` +
		`{"role":"assistant","content":[{"type":"tool_use","tool_use_id":"c1","name":"f","input":{"a":[true],"b":1.50}}]},` +
		`{"role":"user","content":[{"type":"tool_result","tool_use_id":"c1","content":"ok","is_error":true}]}],` +
		`"tools":[{"name":"f","input_schema":{"type":"object"}}]}`
	if got, want := providers.PromptHash(req), sha256Hex(canonical); got != want {
		t.Errorf("PromptHash = %s, want sha256 of %s = %s", got, canonical, want)
	}

	noTools := req
	noTools.Tools = nil
	if providers.PromptHash(noTools) == providers.PromptHash(req) {
		t.Error("tools do not change the hash")
	}
	result := req
	result.Messages = append([]providers.Message(nil), req.Messages...)
	result.Messages[2] = providers.Message{Role: "user", Content: []providers.Block{providers.ToolResultBlock("c1", "ok!", true)}}
	if providers.PromptHash(result) == providers.PromptHash(req) {
		t.Error("a tool result does not change the hash")
	}
}

func TestConversationRequestChecks(t *testing.T) {
	t.Parallel()
	user := func(blocks ...providers.Block) providers.Message {
		return providers.Message{Role: providers.RoleUser, Content: blocks}
	}
	use := func(id string) providers.Block {
		return providers.Block{Type: providers.BlockToolUse, ToolUseID: id, Name: "get_weather", Input: json.RawMessage(`{}`)}
	}
	assistant := func(blocks ...providers.Block) providers.Message {
		return providers.Message{Role: providers.RoleAssistant, Content: blocks}
	}
	hi := user(providers.TextBlock("hi"))
	tests := []struct {
		name    string
		req     providers.Request
		wantMsg string
	}{
		{name: "prompt and messages", req: providers.Request{Prompt: "p", Messages: []providers.Message{hi}}, wantMsg: "both a prompt and messages"},
		{name: "neither", req: providers.Request{Tools: weatherTools}, wantMsg: "empty prompt and no messages"},
		{name: "bad role", req: providers.Request{Messages: []providers.Message{{Role: "system", Content: []providers.Block{providers.TextBlock("x")}}}}, wantMsg: `messages[0]: role "system"`},
		{name: "empty text", req: providers.Request{Messages: []providers.Message{user(providers.TextBlock(""))}}, wantMsg: "empty text block"},
		{name: "dangling tool call", req: providers.Request{Tools: weatherTools, Messages: []providers.Message{hi, assistant(use("a"), use("b")), user(providers.ToolResultBlock("a", "1", false))}}, wantMsg: `tool_use "b" of messages[1] has no tool_result`},
		{name: "unanswered at the end", req: providers.Request{Tools: weatherTools, Messages: []providers.Message{hi, assistant(use("a"))}}, wantMsg: `tool_use "a" is never answered`},
		{name: "result for an unknown call", req: providers.Request{Tools: weatherTools, Messages: []providers.Message{hi, assistant(use("a")), user(providers.ToolResultBlock("zzz", "1", false))}}, wantMsg: `tool_result for "zzz" answers no tool_use`},
		{name: "tool_use from the user", req: providers.Request{Tools: weatherTools, Messages: []providers.Message{user(use("a"))}}, wantMsg: "tool_use block in a user message"},
		{name: "duplicate tool", req: providers.Request{Tools: []providers.Tool{{Name: "f"}, {Name: "f"}}, Prompt: "p"}, wantMsg: `tool "f" is declared twice`},
		{name: "schema not an object", req: providers.Request{Tools: []providers.Tool{{Name: "f", InputSchema: json.RawMessage(`[1]`)}}, Prompt: "p"}, wantMsg: "input schema is not a JSON object"},
	}
	for _, l := range lives {
		for _, tt := range tests {
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, l, fakemodel.Reply("unreachable"))
				req := tt.req
				req.Model, req.Step = "m", "agent"
				_, err := b.p.Complete(t.Context(), req)
				perr := assertProviderError(t, err, l.name, false)
				if !strings.Contains(perr.Message, tt.wantMsg) || !strings.Contains(perr.Message, `step "agent"`) {
					t.Errorf("Message = %q, want it to name the step and contain %q", perr.Message, tt.wantMsg)
				}
				if n := len(b.srv.Requests()); n != 0 {
					t.Errorf("server saw %d requests, want none", n)
				}
			})
		}
	}
}
