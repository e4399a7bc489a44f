package fakemodel_test

import (
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
)

// sseEvent is one server-sent event: its name ("" when it has none) and data.
type sseEvent struct {
	name, data string
}

// postStream sends body and returns the status, the Content-Type and
// the events of the answer.
func postStream(t *testing.T, srv *fakemodel.Server, path, body string) (int, string, []sseEvent) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL()+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	res, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	data, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	var events []sseEvent
	for _, block := range strings.Split(string(data), "\n\n") {
		if strings.TrimSpace(block) == "" {
			continue
		}
		var ev sseEvent
		for _, line := range strings.Split(block, "\n") {
			name, value, _ := strings.Cut(line, ": ")
			switch name {
			case "event":
				ev.name = value
			case "data":
				ev.data = value
			default:
				t.Errorf("unexpected line %q in %q", line, data)
			}
		}
		events = append(events, ev)
	}
	return res.StatusCode, res.Header.Get("Content-Type"), events
}

// decode unmarshals an event's data into a generic value.
func decode(t *testing.T, ev sseEvent) map[string]any {
	t.Helper()
	var out map[string]any
	if err := json.Unmarshal([]byte(ev.data), &out); err != nil {
		t.Fatalf("event %q data %q: %v", ev.name, ev.data, err)
	}
	return out
}

// streamedResponse is the script of the streaming tests: text of several
// words, then two parallel tool calls, one without an id or input.
var streamedResponse = fakemodel.Response{
	Text: "Checking the weather now.",
	ToolCalls: []fakemodel.ToolCall{
		{ID: "c1", Name: "get_weather", Input: json.RawMessage(`{"city": "Paris"}`)},
		{Name: "get_time"},
	},
	InputTokens: 5, OutputTokens: 7, CacheReadTokens: 30, CacheWriteTokens: 4,
}

func TestStreamAnthropic(t *testing.T) {
	t.Parallel()
	srv := fakemodel.NewAnthropic(t, fakemodel.Queue(streamedResponse))
	status, contentType, events := postStream(t, srv, "/v1/messages",
		`{"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"get_weather","input_schema":{"type":"object"}},{"name":"get_time","input_schema":{"type":"object"}}]}`)
	if status != 200 || !strings.HasPrefix(contentType, "text/event-stream") {
		t.Fatalf("status %d content type %q, want 200 text/event-stream", status, contentType)
	}
	if reqs := srv.Requests(); len(reqs) != 1 || !reqs[0].Stream || reqs[0].StreamUsage {
		t.Errorf("recorded %+v, want one request with Stream and without StreamUsage", reqs)
	}

	var names []string
	var text []string
	inputs := map[float64]string{}
	for _, ev := range events {
		names = append(names, ev.name)
		got := decode(t, ev)
		if got["type"] != ev.name {
			t.Errorf("event %q has type %v", ev.name, got["type"])
		}
		if ev.name != "content_block_delta" {
			continue
		}
		delta := got["delta"].(map[string]any)
		switch delta["type"] {
		case "text_delta":
			text = append(text, delta["text"].(string))
		case "input_json_delta":
			inputs[got["index"].(float64)] += delta["partial_json"].(string)
		}
	}
	wantNames := []string{"message_start", "ping",
		"content_block_start", "content_block_delta", "content_block_delta", "content_block_delta", "content_block_delta", "content_block_stop",
		"content_block_start", "content_block_delta", "content_block_delta", "content_block_delta", "content_block_stop",
		"content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
		"message_delta", "message_stop"}
	if !reflect.DeepEqual(names, wantNames) {
		t.Errorf("events\n %v\nwant\n %v", names, wantNames)
	}
	if want := []string{"Checking ", "the ", "weather ", "now."}; !reflect.DeepEqual(text, want) {
		t.Errorf("text deltas %q, want %q", text, want)
	}
	if want := map[float64]string{1: `{"city":"Paris"}`, 2: `{}`}; !reflect.DeepEqual(inputs, want) {
		t.Errorf("tool inputs by block %v, want %v", inputs, want)
	}

	for i, wantJSON := range map[int]string{
		0:  `{"message":{"type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"usage":{"input_tokens":5,"output_tokens":1,"cache_read_input_tokens":30,"cache_creation_input_tokens":4}}}`,
		2:  `{"index":0,"content_block":{"type":"text","text":""}}`,
		8:  `{"index":1,"content_block":{"type":"tool_use","id":"c1","name":"get_weather","input":{}}}`,
		13: `{"index":2,"content_block":{"type":"tool_use","id":"toolu_fake_0001_1","name":"get_time","input":{}}}`,
		17: `{"delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"input_tokens":5,"output_tokens":7,"cache_read_input_tokens":30,"cache_creation_input_tokens":4}}`,
	} {
		if i >= len(events) {
			continue // the event list was reported above
		}
		var want map[string]any
		if err := json.Unmarshal([]byte(wantJSON), &want); err != nil {
			t.Fatal(err)
		}
		assertSubset(t, events[i].name, want, decode(t, events[i]))
	}
}

func TestStreamOpenAI(t *testing.T) {
	t.Parallel()
	for _, includeUsage := range []bool{true, false} {
		name := map[bool]string{true: "include_usage", false: "no usage"}[includeUsage]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			srv := fakemodel.NewOpenAI(t, fakemodel.Queue(streamedResponse))
			body := `{"model":"g","stream":true,"messages":[{"role":"user","content":"hi"}]}`
			if includeUsage {
				body = `{"model":"g","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`
			}
			status, contentType, events := postStream(t, srv, "/chat/completions", body)
			if status != 200 || !strings.HasPrefix(contentType, "text/event-stream") {
				t.Fatalf("status %d content type %q, want 200 text/event-stream", status, contentType)
			}
			if reqs := srv.Requests(); len(reqs) != 1 || !reqs[0].Stream || reqs[0].StreamUsage != includeUsage {
				t.Errorf("recorded %+v, want Stream and StreamUsage %v", reqs, includeUsage)
			}
			if len(events) < 2 || events[len(events)-1].data != "[DONE]" {
				t.Fatalf("events %v, want them to end with [DONE]", events)
			}
			events = events[:len(events)-1]

			var (
				roles, finishes []string
				content         []string
				usages          []map[string]any
				calls           = map[float64]map[string]string{}
				argPieces       = map[float64]int{}
			)
			for _, ev := range events {
				if ev.name != "" {
					t.Errorf("event name %q, want none", ev.name)
				}
				chunk := decode(t, ev)
				if chunk["object"] != "chat.completion.chunk" || chunk["id"] != "chatcmpl-fake-0001" || chunk["model"] != "g" {
					t.Errorf("chunk %v", chunk)
				}
				u, hasUsage := chunk["usage"]
				if hasUsage != includeUsage {
					t.Errorf("chunk %s: usage present %v, want %v", ev.data, hasUsage, includeUsage)
				}
				if u != nil {
					usages = append(usages, u.(map[string]any))
				}
				choices := chunk["choices"].([]any)
				if len(choices) == 0 {
					if u == nil {
						t.Errorf("chunk without choices or usage: %s", ev.data)
					}
					continue
				}
				if u != nil {
					t.Errorf("usage in a chunk with choices: %s", ev.data)
				}
				choice := choices[0].(map[string]any)
				if f, ok := choice["finish_reason"].(string); ok {
					finishes = append(finishes, f)
				}
				delta := choice["delta"].(map[string]any)
				if r, ok := delta["role"].(string); ok {
					roles = append(roles, r)
				}
				if c, ok := delta["content"].(string); ok && c != "" {
					content = append(content, c)
				}
				tcs, _ := delta["tool_calls"].([]any)
				for _, raw := range tcs {
					tc := raw.(map[string]any)
					i := tc["index"].(float64)
					if calls[i] == nil {
						calls[i] = map[string]string{}
					}
					if id, ok := tc["id"].(string); ok {
						calls[i]["id"] += id
					}
					fn := tc["function"].(map[string]any)
					if n, ok := fn["name"].(string); ok {
						calls[i]["name"] += n
					}
					if a := fn["arguments"].(string); a != "" {
						calls[i]["arguments"] += a
						argPieces[i]++
					}
				}
			}
			if !reflect.DeepEqual(roles, []string{"assistant"}) || !reflect.DeepEqual(finishes, []string{"tool_calls"}) {
				t.Errorf("roles %q finish reasons %q, want one assistant role and one tool_calls", roles, finishes)
			}
			if want := []string{"Checking ", "the ", "weather ", "now."}; !reflect.DeepEqual(content, want) {
				t.Errorf("content deltas %q, want %q", content, want)
			}
			wantCalls := map[float64]map[string]string{
				0: {"id": "c1", "name": "get_weather", "arguments": `{"city": "Paris"}`},
				1: {"id": "call_fake_0001_1", "name": "get_time", "arguments": `{}`},
			}
			if !reflect.DeepEqual(calls, wantCalls) {
				t.Errorf("tool calls %v, want %v", calls, wantCalls)
			}
			if argPieces[0] < 2 {
				t.Errorf("arguments of call 0 came in %d pieces, want several", argPieces[0])
			}
			if last := events[len(events)-1]; includeUsage {
				if len(usages) != 1 || len(decode(t, last)["choices"].([]any)) != 0 {
					t.Fatalf("usages %v, last chunk %s: want one usage chunk, the last, without choices", usages, last.data)
				}
				var want map[string]any
				if err := json.Unmarshal([]byte(`{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":30,"cache_write_tokens":4}}`), &want); err != nil {
					t.Fatal(err)
				}
				assertSubset(t, "usage", want, usages[0])
			}
		})
	}
}

func TestStreamErrorIsJSON(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		start func(testing.TB, fakemodel.Handler) *fakemodel.Server
		path  string
		body  string
	}{
		{name: "anthropic", start: fakemodel.NewAnthropic, path: "/v1/messages", body: `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`},
		{name: "openai", start: fakemodel.NewOpenAI, path: "/chat/completions", body: `{"model":"g","stream":true,"messages":[{"role":"user","content":"hi"}]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := tt.start(t, fakemodel.Queue(fakemodel.Response{Status: 429, Text: "slow down", Header: http.Header{"Retry-After": {"3"}}}))
			status, got := post(t, srv, tt.path, tt.body, nil)
			if status != 429 {
				t.Errorf("status %d, want 429", status)
			}
			if msg, _ := got["error"].(map[string]any)["message"].(string); msg != "slow down" {
				t.Errorf("answer %v, want the JSON error", got)
			}
			if reqs := srv.Requests(); len(reqs) != 1 || !reqs[0].Stream {
				t.Errorf("recorded %+v, want one streaming request", reqs)
			}
		})
	}
}
