package providers_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/steps/providers"
)

// pieces collects what OnText receives, one slice per Complete call.
// OnText runs on the goroutine that called Complete, so the tests, which
// call Complete from one goroutine, need no lock.
type pieces struct {
	calls [][]string
}

// onText returns the callback for the next call.
func (p *pieces) onText() func(string) {
	p.calls = append(p.calls, nil)
	i := len(p.calls) - 1
	return func(text string) { p.calls[i] = append(p.calls[i], text) }
}

// all returns every piece received, in order.
func (p *pieces) all() []string {
	var out []string
	for _, c := range p.calls {
		out = append(out, c...)
	}
	return out
}

// streaming wraps p so that every request asks for streaming, the pieces
// going to got.
func streaming(p providers.Provider, got *pieces) providers.Provider {
	return providerFunc(func(ctx context.Context, req providers.Request) (providers.Reply, error) {
		req.OnText = got.onText()
		return p.Complete(ctx, req)
	})
}

// streamSetup starts two servers, each with a handler from newHandler,
// one for the unstreamed calls and one for the streamed ones, so that
// both get the same script and generated ids.
func streamSetup(t *testing.T, l live, newHandler func() fakemodel.Handler) (plain, streamed bundle) {
	t.Helper()
	return setup(t, l, newHandler()), setup(t, l, newHandler())
}

// assertStreamedRequest checks the server saw one streamed request whose
// body is the unstreamed one's plus the streaming fields.
func assertStreamedRequest(t *testing.T, provider string, plain, streamed *fakemodel.Server) {
	t.Helper()
	p, s := plain.Requests(), streamed.Requests()
	if len(p) != 1 || len(s) != 1 {
		t.Fatalf("servers saw %d and %d requests, want 1 each", len(p), len(s))
	}
	if p[0].Stream || !s[0].Stream {
		t.Errorf("stream = %v unstreamed and %v streamed, want false and true", p[0].Stream, s[0].Stream)
	}
	if wantUsage := provider == providers.OpenAI; s[0].StreamUsage != wantUsage {
		t.Errorf("stream_options.include_usage = %v, want %v", s[0].StreamUsage, wantUsage)
	}
	var pb, sb map[string]any
	if err := json.Unmarshal(p[0].Body, &pb); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(s[0].Body, &sb); err != nil {
		t.Fatal(err)
	}
	delete(sb, "stream")
	delete(sb, "stream_options")
	if !reflect.DeepEqual(pb, sb) {
		t.Errorf("streamed body, without stream fields,\n %s\nwant the unstreamed\n %s", s[0].Body, p[0].Body)
	}
}

func TestStreamComplete(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		req        providers.Request
		resp       fakemodel.Response
		stopReason map[string]string // scripted per provider; nil leaves the default
		wantPieces int               // OnText calls
	}{
		{
			name:       "text in words",
			req:        providers.Request{Model: "model-a", System: "Answer briefly.", Prompt: "Is this good?", Step: "classify", Attempt: 1},
			resp:       fakemodel.Response{Text: "The answer is positive.", InputTokens: 17, OutputTokens: 4},
			wantPieces: 4,
		},
		{
			name:       "one word",
			req:        providers.Request{Model: "model-a", Prompt: "Is this good?"},
			resp:       fakemodel.Response{Text: "positive"},
			wantPieces: 1,
		},
		{
			name: "text and a tool call, cache usage",
			req:  providers.Request{Model: "model-t", System: agentSystem, Prompt: "Weather in Paris?", Tools: weatherTools, MaxTokens: 300},
			resp: fakemodel.Response{Text: "Let me look that up.", ToolCalls: []fakemodel.ToolCall{
				{ID: "call_1", Name: "get_weather", Input: json.RawMessage(`{"city": "Paris", "units": ["C", "F"]}`)},
			}, InputTokens: 60, OutputTokens: 12, CacheReadTokens: 400, CacheWriteTokens: 90},
			wantPieces: 5,
		},
		{
			name: "parallel tool calls without text",
			req:  providers.Request{Model: "model-t", Prompt: "Weather in São Paulo and Rome, and the time?", Tools: weatherTools},
			resp: fakemodel.Response{ToolCalls: []fakemodel.ToolCall{
				{ID: "call_sp", Name: "get_weather", Input: json.RawMessage(`{"city":"São Paulo — Brasil"}`)},
				{ID: "call_rome", Name: "get_weather", Input: json.RawMessage(`{"city":"Rome"}`)},
				{Name: "get_time"}, // generated id, no input
			}, InputTokens: 120, OutputTokens: 30, CacheWriteTokens: 400},
		},
		{
			name:       "stopped at max tokens",
			req:        providers.Request{Model: "model-a", Prompt: "Write an essay.", MaxTokens: 3},
			resp:       fakemodel.Response{Text: "Once upon a", OutputTokens: 3},
			stopReason: map[string]string{providers.Anthropic: "max_tokens", providers.OpenAI: "length"},
			wantPieces: 3,
		},
	}
	for _, l := range lives {
		for _, tt := range tests {
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				resp := tt.resp
				resp.StopReason = tt.stopReason[l.name]
				plain, streamed := streamSetup(t, l, func() fakemodel.Handler {
					return func(context.Context, fakemodel.Request) fakemodel.Response { return resp }
				})

				want, err := plain.p.Complete(t.Context(), tt.req)
				if err != nil {
					t.Fatalf("unstreamed Complete: %v", err)
				}
				var got pieces
				reply, err := streaming(streamed.p, &got).Complete(t.Context(), tt.req)
				if err != nil {
					t.Fatalf("streamed Complete: %v", err)
				}

				if !reflect.DeepEqual(reply, want) {
					t.Errorf("streamed reply\n %+v\nwant the unstreamed\n %+v", reply, want)
				}
				if len(got.all()) != tt.wantPieces {
					t.Errorf("OnText got %d pieces %q, want %d", len(got.all()), got.all(), tt.wantPieces)
				}
				if joined := strings.Join(got.all(), ""); joined != reply.Text {
					t.Errorf("pieces joined = %q, want Reply.Text %q", joined, reply.Text)
				}
				if tt.stopReason != nil && reply.StopReason != tt.stopReason[l.name] {
					t.Errorf("StopReason = %q, want %q", reply.StopReason, tt.stopReason[l.name])
				}
				assertStreamedRequest(t, l.name, plain.srv, streamed.srv)
			})
		}
	}
}

func TestStreamToolConversation(t *testing.T) {
	t.Parallel()
	for _, l := range lives {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			plain, streamed := streamSetup(t, l, func() fakemodel.Handler { return fakemodel.Queue(scriptedTurns...) })
			want := runConversation(t, plain.p)
			var got pieces
			replies := runConversation(t, streaming(streamed.p, &got))

			if !reflect.DeepEqual(replies, want) {
				t.Errorf("streamed replies\n %+v\nwant the unstreamed\n %+v", replies, want)
			}
			if len(got.calls) != 3 {
				t.Fatalf("OnText set for %d calls, want 3", len(got.calls))
			}
			for i, reply := range replies {
				if joined := strings.Join(got.calls[i], ""); joined != reply.Text {
					t.Errorf("turn %d: pieces joined = %q, want Reply.Text %q", i+1, joined, reply.Text)
				}
			}
			if len(got.calls[0]) != 0 || len(got.calls[1]) < 2 || len(got.calls[2]) < 2 {
				t.Errorf("pieces per turn %q, want none for the calls-only turn and several for the others", got.calls)
			}
			for i, seen := range streamed.srv.Requests() {
				if !seen.Stream {
					t.Errorf("turn %d was not streamed", i+1)
				}
				assertToolsDeclared(t, l.name, i+1, seen)
			}
		})
	}
}

func TestStreamErrors(t *testing.T) {
	t.Parallel()
	leakyMessage := "invalid key " + testKey
	tests := []struct {
		name           string
		resp           fakemodel.Response
		wantStatus     int
		wantRetryable  bool
		wantRetryAfter time.Duration
		otherMessage   bool // the streamed error says it differently
	}{
		{name: "429 rate limited", resp: fakemodel.Response{Status: 429, Text: "slow down", Header: http.Header{"Retry-After": {"7"}}}, wantStatus: 429, wantRetryable: true, wantRetryAfter: 7 * time.Second},
		{name: "429 retry-after-ms", resp: fakemodel.Response{Status: 429, Text: "slow down", Header: http.Header{"Retry-After-Ms": {"1500"}}}, wantStatus: 429, wantRetryable: true, wantRetryAfter: 1500 * time.Millisecond},
		{name: "500 server error", resp: fakemodel.Response{Status: 500, Text: "boom"}, wantStatus: 500, wantRetryable: true},
		{name: "529 overloaded", resp: fakemodel.Response{Status: 529, Text: "Overloaded"}, wantStatus: 529, wantRetryable: true},
		{name: "401 unauthorized echoing the key", resp: fakemodel.Response{Status: 401, Text: leakyMessage}, wantStatus: 401},
		{name: "400 bad request", resp: fakemodel.Response{Status: 400, Text: "max_tokens: too large"}, wantStatus: 400},
		{name: "502 html from a proxy", resp: fakemodel.Response{Status: 502, RawBody: []byte("<html>bad gateway</html>"), Header: http.Header{"Content-Type": {"text/html"}}}, wantStatus: 502, wantRetryable: true},
		{name: "401 plain text from a proxy", resp: fakemodel.Response{Status: 401, RawBody: []byte(leakyMessage)}, wantStatus: 401},
		{name: "200 empty reply", resp: fakemodel.Response{Text: ""}, wantRetryable: true},
		{name: "200 not json", resp: fakemodel.Response{RawBody: []byte("{not json"), Header: http.Header{"Content-Type": {"application/json"}}}, wantRetryable: true, otherMessage: true},
	}
	for _, l := range lives {
		for _, tt := range tests {
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				plain, streamed := streamSetup(t, l, func() fakemodel.Handler { return fakemodel.Queue(tt.resp) })
				req := providers.Request{Model: "m", Prompt: "hello", Step: "s"}

				_, err := plain.p.Complete(t.Context(), req)
				want := assertProviderError(t, err, l.name, tt.wantRetryable)
				var got pieces
				_, err = streaming(streamed.p, &got).Complete(t.Context(), req)
				perr := assertProviderError(t, err, l.name, tt.wantRetryable)

				if perr.StatusCode != tt.wantStatus || want.StatusCode != tt.wantStatus {
					t.Errorf("StatusCode = %d streamed, %d unstreamed, want %d", perr.StatusCode, want.StatusCode, tt.wantStatus)
				}
				if perr.RetryAfter != tt.wantRetryAfter || want.RetryAfter != tt.wantRetryAfter {
					t.Errorf("RetryAfter = %v streamed, %v unstreamed, want %v", perr.RetryAfter, want.RetryAfter, tt.wantRetryAfter)
				}
				if !tt.otherMessage && perr.Message != want.Message {
					t.Errorf("Message = %q, want the unstreamed %q", perr.Message, want.Message)
				}
				if len(got.all()) != 0 {
					t.Errorf("OnText got %q for a failed call with no text", got.all())
				}
				if seen := streamed.srv.Requests(); len(seen) != 1 || !seen[0].Stream {
					t.Errorf("streamed server saw %+v, want one streamed request (no SDK retries)", seen)
				}
			})
		}
	}
}

// Scripted streams that break off or carry an error event, as RawBody.
const (
	anthropicStreamStart = "event: message_start\n" +
		`data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":1}}}` + "\n\n" +
		"event: content_block_start\n" + `data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}` + "\n\n" +
		"event: content_block_delta\n" + `data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello "}}` + "\n\n" +
		"event: content_block_delta\n" + `data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"wor"}}` + "\n\n"
	openAIStreamStart = `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}` + "\n\n" +
		`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hello "},"finish_reason":null}]}` + "\n\n" +
		`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"wor"},"finish_reason":null}]}` + "\n\n"
)

func TestStreamBroken(t *testing.T) {
	t.Parallel()
	anthropicError := func(errType, msg string) string {
		return anthropicStreamStart + "event: error\n" + `data: {"type":"error","error":{"type":"` + errType + `","message":"` + msg + `"}}` + "\n\n"
	}
	openAIError := func(errType, msg string) string {
		return openAIStreamStart + `data: {"error":{"message":"` + msg + `","type":"` + errType + `","param":null,"code":null}}` + "\n\n"
	}
	tests := []struct {
		name          string
		l             live
		body          string
		wantStatus    int
		wantRetryable bool
		wantInMessage string
	}{
		{name: "ends before message_stop", l: lives[0], body: anthropicStreamStart, wantRetryable: true, wantInMessage: "message_stop"},
		{name: "overloaded event", l: lives[0], body: anthropicError("overloaded_error", "Overloaded"), wantStatus: 529, wantRetryable: true, wantInMessage: "error event in the stream: 529: overloaded_error: Overloaded"},
		{name: "api_error event", l: lives[0], body: anthropicError("api_error", "Internal"), wantStatus: 500, wantRetryable: true, wantInMessage: "api_error"},
		{name: "invalid request event", l: lives[0], body: anthropicError("invalid_request_error", "bad"), wantStatus: 400, wantInMessage: "invalid_request_error: bad"},
		{name: "unknown error type event echoing the key", l: lives[0], body: anthropicError("novel_error", "key "+testKey), wantRetryable: true, wantInMessage: "novel_error: key [redacted]"},
		{name: "event out of order", l: lives[0], body: anthropicStreamStart + "event: content_block_delta\n" + `data: {"type":"content_block_delta","index":3,"delta":{"type":"text_delta","text":"x"}}` + "\n\n", wantRetryable: true, wantInMessage: "broken stream"},
		{name: "ends before finish_reason", l: lives[1], body: openAIStreamStart, wantRetryable: true, wantInMessage: "finish_reason"},
		{name: "ends before finish_reason with [DONE]", l: lives[1], body: openAIStreamStart + "data: [DONE]\n\n", wantRetryable: true, wantInMessage: "finish_reason"},
		{name: "server_error event", l: lives[1], body: openAIError("server_error", "The server had an error"), wantStatus: 500, wantRetryable: true, wantInMessage: "error event in the stream: 500 Internal Server Error: server_error: The server had an error"},
		{name: "invalid request event echoing the key", l: lives[1], body: openAIError("invalid_request_error", "key "+testKey), wantStatus: 400, wantInMessage: "key [redacted]"},
		{name: "unknown error type event", l: lives[1], body: openAIError("", "something"), wantRetryable: true, wantInMessage: "error event in the stream: something"},
		{name: "chunk of another completion", l: lives[1], body: openAIStreamStart + `data: {"id":"c2","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}` + "\n\n", wantRetryable: true, wantInMessage: "broken stream"},
	}
	for _, tt := range tests {
		t.Run(tt.l.name+"/"+tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, tt.l, fakemodel.Queue(fakemodel.Response{RawBody: []byte(tt.body), Header: http.Header{"Content-Type": {"text/event-stream"}}}))
			var got pieces
			_, err := streaming(b.p, &got).Complete(t.Context(), providers.Request{Model: "m", Prompt: "hello", Step: "s"})
			perr := assertProviderError(t, err, tt.l.name, tt.wantRetryable)
			if perr.StatusCode != tt.wantStatus {
				t.Errorf("StatusCode = %d, want %d", perr.StatusCode, tt.wantStatus)
			}
			if !strings.Contains(perr.Message, tt.wantInMessage) {
				t.Errorf("Message = %q, want it to contain %q", perr.Message, tt.wantInMessage)
			}
			// The pieces of a call that then fails are not taken back.
			if want := []string{"Hello ", "wor"}; !reflect.DeepEqual(got.all(), want) {
				t.Errorf("OnText got %q, want %q", got.all(), want)
			}
		})
	}
}

func TestStreamContext(t *testing.T) {
	t.Parallel()
	for _, l := range lives {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, l, fakemodel.Hang())
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			var got pieces
			_, err := streaming(b.p, &got).Complete(ctx, providers.Request{Model: "m", Prompt: "hello"})
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("error = %v, want errors.Is context.DeadlineExceeded", err)
			}
			assertProviderError(t, err, l.name, true)
			if seen := b.srv.Requests(); len(seen) != 1 || !seen[0].Stream {
				t.Errorf("server saw %+v, want one streamed request", seen)
			}
		})
	}
}

func TestStreamInvalidCalls(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		cfg     func(baseURL string) providers.Config
		req     providers.Request
		wantMsg string
	}{
		{name: "no key for the public API", cfg: func(string) providers.Config { return providers.Config{} }, req: providers.Request{Model: "m", Prompt: "p"}, wantMsg: "APIKey"},
		{name: "no model", cfg: okConfig, req: providers.Request{Prompt: "p", Step: "classify"}, wantMsg: `step "classify" has no model`},
		{name: "empty prompt", cfg: okConfig, req: providers.Request{Model: "m"}, wantMsg: "empty prompt"},
		{name: "prompt and messages", cfg: okConfig, req: providers.Request{Model: "m", Prompt: "p", Messages: []providers.Message{{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock("hi")}}}}, wantMsg: "both a prompt and messages"},
		{name: "negative max tokens", cfg: okConfig, req: providers.Request{Model: "m", Prompt: "p", MaxTokens: -1}, wantMsg: "negative"},
		{name: "dangling tool call", cfg: okConfig, req: providers.Request{Model: "m", Tools: weatherTools, Messages: []providers.Message{
			{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock("hi")}},
			{Role: providers.RoleAssistant, Content: []providers.Block{{Type: providers.BlockToolUse, ToolUseID: "c1", Name: "get_weather"}}},
		}}, wantMsg: "never answered"},
	}
	for _, l := range lives {
		for _, tt := range tests {
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				srv := l.startServer(t, fakemodel.Reply("unreachable"))
				cfg := tt.cfg(srv.URL())
				cfg.HTTPClient = srv.Client()
				var got pieces
				_, err := streaming(l.newProvider(cfg), &got).Complete(t.Context(), tt.req)
				perr := assertProviderError(t, err, l.name, false)
				if !strings.Contains(perr.Message, tt.wantMsg) {
					t.Errorf("Message = %q, want it to contain %q", perr.Message, tt.wantMsg)
				}
				if n := len(srv.Requests()); n != 0 {
					t.Errorf("server saw %d requests, want none", n)
				}
			})
		}
	}
}

// A max tokens the SDK refuses to wait for without streaming is sent
// when the call streams.
func TestAnthropicStreamLongReply(t *testing.T) {
	t.Parallel()
	b := setup(t, lives[0], fakemodel.Reply("a long story"))
	req := providers.Request{Model: "m", Prompt: "p", MaxTokens: 200_000}
	if _, err := b.p.Complete(t.Context(), req); err == nil || !strings.Contains(err.Error(), "Request.OnText") {
		t.Errorf("unstreamed error = %v, want one pointing at Request.OnText", err)
	}
	var got pieces
	reply, err := streaming(b.p, &got).Complete(t.Context(), req)
	if err != nil {
		t.Fatalf("streamed Complete: %v", err)
	}
	if reply.Text != "a long story" || strings.Join(got.all(), "") != reply.Text {
		t.Errorf("reply %q pieces %q", reply.Text, got.all())
	}
	if seen := b.srv.Requests(); len(seen) != 1 || seen[0].MaxTokens != 200_000 {
		t.Errorf("server saw %+v, want the one streamed request with max tokens 200000", seen)
	}
}

func TestReplayStream(t *testing.T) {
	t.Parallel()
	calls := []providers.ToolCall{{ID: "toolu_1", Name: "get_weather", Input: json.RawMessage(`{"city":"Paris"}`)}}
	c := &providers.Cassette{Version: providers.CassetteVersion, Interactions: []providers.Interaction{
		{Step: "words", Replies: []providers.Reply{{Text: "Paris is  sunny today. ", Model: "m", StopReason: "end_turn", Usage: providers.Usage{InputTokens: 3, OutputTokens: 5, CacheReadTokens: 7}}}},
		{Step: "one", Replies: []providers.Reply{{Text: "positive"}}},
		{Step: "tools", Replies: []providers.Reply{{Text: "Checking.", ToolCalls: calls, StopReason: "tool_use"}}},
		{Step: "calls-only", Replies: []providers.Reply{{ToolCalls: calls, StopReason: "tool_use"}}},
		{Step: "empty", Replies: []providers.Reply{{StopReason: "end_turn"}}},
	}}
	tests := []struct {
		step       string
		wantPieces []string
		wantErr    bool
		wantIs     error // what the error matches, when not nil
	}{
		{step: "words", wantPieces: []string{"Paris ", "is ", " ", "sunny ", "today. "}},
		{step: "one", wantPieces: []string{"positive"}},
		{step: "tools", wantPieces: []string{"Checking."}},
		{step: "calls-only"},
		{step: "empty", wantErr: true},
		{step: "missing", wantErr: true, wantIs: providers.ErrNoRecording},
	}
	for _, tt := range tests {
		t.Run(tt.step, func(t *testing.T) {
			t.Parallel()
			p := providers.NewReplay(c)
			req := providers.Request{Step: tt.step, Prompt: "p", Attempt: 1}
			want, wantErr := p.Complete(t.Context(), req)
			var got pieces
			reply, err := streaming(p, &got).Complete(t.Context(), req)

			if tt.wantErr {
				var perr, wantPerr *providers.Error
				if !errors.As(err, &perr) || !errors.As(wantErr, &wantPerr) || *perr != *wantPerr {
					t.Errorf("streamed error = %#v, want the unstreamed %#v", err, wantErr)
				}
				if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
					t.Errorf("error = %v, want errors.Is %v", err, tt.wantIs)
				}
			} else {
				if err != nil || wantErr != nil {
					t.Fatalf("Complete: streamed %v, unstreamed %v", err, wantErr)
				}
				if !reflect.DeepEqual(reply, want) {
					t.Errorf("streamed reply %+v, want the unstreamed %+v", reply, want)
				}
				if joined := strings.Join(got.all(), ""); joined != reply.Text {
					t.Errorf("pieces joined = %q, want Reply.Text %q", joined, reply.Text)
				}
			}
			if !reflect.DeepEqual(got.all(), tt.wantPieces) {
				t.Errorf("OnText got %q, want %q", got.all(), tt.wantPieces)
			}
		})
	}
}

func TestRecorderStream(t *testing.T) {
	t.Parallel()
	plainSrv := fakemodel.NewAnthropic(t, fakemodel.Queue(scriptedTurns...))
	streamSrv := fakemodel.NewAnthropic(t, fakemodel.Queue(scriptedTurns...))
	dir := t.TempDir()
	plainPath, streamPath := filepath.Join(dir, "plain.json"), filepath.Join(dir, "streamed.json")

	plainLive := providers.NewAnthropic(providers.Config{APIKey: testKey, BaseURL: plainSrv.URL(), HTTPClient: plainSrv.Client()})
	streamLive := providers.NewAnthropic(providers.Config{APIKey: testKey, BaseURL: streamSrv.URL(), HTTPClient: streamSrv.Client()})
	want := runConversation(t, providers.NewRecorder(plainLive, plainPath))
	var got pieces
	recorded := runConversation(t, streaming(providers.NewRecorder(streamLive, streamPath), &got))

	if !reflect.DeepEqual(recorded, want) {
		t.Errorf("streamed through the recorder\n %+v\nwant\n %+v", recorded, want)
	}
	if joined, text := strings.Join(got.all(), ""), recorded[1].Text+recorded[2].Text; joined != text || len(got.all()) < 2 {
		t.Errorf("OnText through the recorder got %q, want the replies' text %q in pieces", got.all(), text)
	}
	for i, seen := range streamSrv.Requests() {
		if !seen.Stream {
			t.Errorf("turn %d did not stream through the recorder", i+1)
		}
	}

	plainData, err := os.ReadFile(plainPath)
	if err != nil {
		t.Fatal(err)
	}
	streamData, err := os.ReadFile(streamPath)
	if err != nil {
		t.Fatal(err)
	}
	if string(streamData) != string(plainData) {
		t.Errorf("cassette recorded from a stream\n%s\nwant the one recorded without\n%s", streamData, plainData)
	}
	c, err := providers.ParseCassette(streamData)
	if err != nil {
		t.Fatalf("ParseCassette: %v", err)
	}
	var replayed pieces
	if again := runConversation(t, streaming(providers.NewReplay(c), &replayed)); !reflect.DeepEqual(jsonOf(t, again), jsonOf(t, recorded)) {
		t.Errorf("replayed %s, want the recorded %s", jsonOf(t, again), jsonOf(t, recorded))
	}
	if !reflect.DeepEqual(strings.Join(replayed.all(), ""), strings.Join(got.all(), "")) {
		t.Errorf("replayed pieces %q, want the same text as streamed %q", replayed.all(), got.all())
	}
}

// OnText is not part of the prompt hash, so streaming does not change
// which recording answers.
func TestPromptHashIgnoresOnText(t *testing.T) {
	t.Parallel()
	for _, req := range []providers.Request{
		{System: "s", Prompt: "p"},
		{System: agentSystem, Tools: weatherTools, Messages: []providers.Message{{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock("hi")}}}},
	} {
		streamed := req
		streamed.OnText = func(string) {}
		if providers.PromptHash(streamed) != providers.PromptHash(req) {
			t.Errorf("PromptHash changes with OnText for %+v", req)
		}
	}
}
