package fakemodel_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
)

func TestToolUseReplies(t *testing.T) {
	t.Parallel()
	calls := []fakemodel.ToolCall{
		{ID: "c1", Name: "get_weather", Input: json.RawMessage(`{"city":"Paris"}`)},
		{Name: "get_time", Arguments: `{"city": "Ro`},
	}
	resp := fakemodel.Response{ToolCalls: calls, InputTokens: 5, OutputTokens: 7, CacheReadTokens: 30, CacheWriteTokens: 4}
	tests := []struct {
		name     string
		start    func(testing.TB, fakemodel.Handler) *fakemodel.Server
		path     string
		body     string
		wantJSON string
	}{
		{
			name:  "anthropic",
			start: fakemodel.NewAnthropic,
			path:  "/v1/messages",
			body:  `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"get_weather","input_schema":{"type":"object"}}]}`,
			wantJSON: `{"content":[{"type":"tool_use","id":"c1","name":"get_weather","input":{"city":"Paris"}},{"type":"tool_use","id":"toolu_fake_0001_1","name":"get_time","input":{}}],` +
				`"stop_reason":"tool_use","usage":{"input_tokens":5,"output_tokens":7,"cache_read_input_tokens":30,"cache_creation_input_tokens":4}}`,
		},
		{
			name:  "openai",
			start: fakemodel.NewOpenAI,
			path:  "/chat/completions",
			body:  `{"model":"g","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"get_weather"}}]}`,
			wantJSON: `{"choices":[{"index":0,"finish_reason":"tool_calls","message":{"role":"assistant","content":null,"tool_calls":[` +
				`{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}},` +
				`{"id":"call_fake_0001_1","type":"function","function":{"name":"get_time","arguments":"{\"city\": \"Ro"}}]}}],` +
				`"usage":{"prompt_tokens":5,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":30,"cache_write_tokens":4}}}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := tt.start(t, fakemodel.Queue(resp))
			status, got := post(t, srv, tt.path, tt.body, nil)
			if status != 200 {
				t.Fatalf("status %d: %v", status, got)
			}
			var want map[string]any
			if err := json.Unmarshal([]byte(tt.wantJSON), &want); err != nil {
				t.Fatal(err)
			}
			assertSubset(t, "", want, got)
			if tools := srv.Requests()[0].Tools; len(tools) != 1 || tools[0].Name != "get_weather" {
				t.Errorf("recorded tools %+v", tools)
			}
		})
	}
}

func TestDanglingToolCalls(t *testing.T) {
	t.Parallel()
	const anthropicTools = `"tools":[{"name":"f","input_schema":{"type":"object"}}]`
	const openAITools = `"tools":[{"type":"function","function":{"name":"f"}}]`
	tests := []struct {
		name    string
		start   func(testing.TB, fakemodel.Handler) *fakemodel.Server
		path    string
		body    string
		wantMsg string // empty: accepted
	}{
		{
			name: "anthropic answered", start: fakemodel.NewAnthropic, path: "/v1/messages",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}},{"type":"tool_use","id":"b","name":"f","input":{}}]},` +
				`{"role":"user","content":[{"type":"tool_result","tool_use_id":"b","content":"2"},{"type":"tool_result","tool_use_id":"a","content":[{"type":"text","text":"1"}],"is_error":true}]}],` + anthropicTools + `}`,
		},
		{
			name: "anthropic result missing", start: fakemodel.NewAnthropic, path: "/v1/messages",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}},{"type":"tool_use","id":"b","name":"f","input":{}}]},` +
				`{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"1"}]}],` + anthropicTools + `}`,
			wantMsg: "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: b",
		},
		{
			name: "anthropic unknown result", start: fakemodel.NewAnthropic, path: "/v1/messages",
			body:    `{"model":"m","messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"zz","content":"1"}]}],` + anthropicTools + `}`,
			wantMsg: "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: zz",
		},
		{
			name: "anthropic tool blocks without tools", start: fakemodel.NewAnthropic, path: "/v1/messages",
			body:    `{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a"}]}]}`,
			wantMsg: "must define tools",
		},
		{
			name: "openai answered", start: fakemodel.NewOpenAI, path: "/chat/completions",
			body: `{"model":"g","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},` +
				`{"role":"tool","tool_call_id":"a","content":"1"},{"role":"user","content":"thanks"}],` + openAITools + `}`,
		},
		{
			name: "openai result missing", start: fakemodel.NewOpenAI, path: "/chat/completions",
			body: `{"model":"g","messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}},{"id":"b","type":"function","function":{"name":"f","arguments":"{}"}}]},` +
				`{"role":"tool","tool_call_id":"a","content":"1"},{"role":"user","content":"go on"}],` + openAITools + `}`,
			wantMsg: "The following tool_call_ids did not have response messages: b",
		},
		{
			name: "openai stray tool message", start: fakemodel.NewOpenAI, path: "/chat/completions",
			body:    `{"model":"g","messages":[{"role":"user","content":"hi"},{"role":"tool","tool_call_id":"zz","content":"1"}],` + openAITools + `}`,
			wantMsg: "messages with role 'tool' must be a response to a preceding message with 'tool_calls'",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := tt.start(t, fakemodel.Reply("done"))
			status, got := post(t, srv, tt.path, tt.body, nil)
			if tt.wantMsg == "" {
				if status != 200 {
					t.Fatalf("status %d: %v", status, got)
				}
				return
			}
			msg, _ := got["error"].(map[string]any)["message"].(string)
			if status != 400 || !strings.Contains(msg, tt.wantMsg) {
				t.Errorf("status %d message %q, want 400 containing %q", status, msg, tt.wantMsg)
			}
			if n := len(srv.Requests()); n != 1 {
				t.Errorf("%d requests recorded, want the refused one", n)
			}
		})
	}
}

func TestDecodeConversation(t *testing.T) {
	t.Parallel()
	srv := fakemodel.NewAnthropic(t, fakemodel.Reply("ok"))
	body := `{"model":"m","system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"hi"},` +
		`{"role":"assistant","content":[{"type":"text","text":"calling"},{"type":"tool_use","id":"a","name":"f","input":{"x":1}}]},` +
		`{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"res","is_error":true},{"type":"text","text":"more"}]}],` +
		`"tools":[{"name":"f","description":"d","input_schema":{"type":"object"},"cache_control":{"type":"ephemeral"}}]}`
	if status, got := post(t, srv, "/v1/messages", body, nil); status != 200 {
		t.Fatalf("status %d: %v", status, got)
	}
	req := srv.Requests()[0]
	if req.System != "sys" || req.SystemCacheControl != "ephemeral" || req.Prompt != "hi\nmore" {
		t.Errorf("system %q cache %q prompt %q", req.System, req.SystemCacheControl, req.Prompt)
	}
	if len(req.Messages) != 3 || len(req.Messages[1].Blocks) != 2 {
		t.Fatalf("messages %+v", req.Messages)
	}
	use, result := req.Messages[1].Blocks[1], req.Messages[2].Blocks[0]
	if use.Type != "tool_use" || use.ID != "a" || use.Name != "f" || string(use.Input) != `{"x":1}` {
		t.Errorf("tool_use %+v", use)
	}
	if result.Type != "tool_result" || result.ToolUseID != "a" || result.Content != "res" || !result.IsError {
		t.Errorf("tool_result %+v", result)
	}
	if len(req.Tools) != 1 || req.Tools[0].Description != "d" || req.Tools[0].CacheControl != "ephemeral" {
		t.Errorf("tools %+v", req.Tools)
	}
}
