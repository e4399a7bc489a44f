package fakemodel

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Request is one request a server received, decoded from its JSON body.
type Request struct {
	Model       string   // the request's model
	System      string   // system prompt text (OpenAI: system and developer messages), blocks joined by "\n"
	Prompt      string   // user turn text, blocks and turns joined by "\n"
	MaxTokens   int64    // max_tokens, or OpenAI's max_completion_tokens when set; 0 when absent
	Temperature *float64 // nil when absent
	Header      http.Header
	Body        []byte // the raw JSON body

	// Messages are the request's messages in order, decoded into one
	// shape for both wire formats (OpenAI's system and developer messages
	// included, as role "system" or "developer" with one text block).
	Messages []Message
	// Tools are the declared tools, in order.
	Tools []Tool
	// SystemCacheControl is the cache_control type of the last system
	// block that has one ("ephemeral"), or ""; Anthropic only.
	SystemCacheControl string

	// Stream is the request's "stream": true: a 2xx answer to it is
	// server-sent events (see the package doc) instead of one JSON body.
	Stream bool
	// StreamUsage is OpenAI's stream_options.include_usage: the stream
	// ends with a chunk that carries the usage and no choices. Always
	// false for Anthropic, whose stream always carries the usage.
	StreamUsage bool
}

// Message is one message of a request.
type Message struct {
	// Role is "user" or "assistant"; in OpenAI requests also "system",
	// "developer" and "tool".
	Role   string
	Blocks []Block
}

// Block is one content block of a Message. Anthropic's blocks are decoded
// as sent (a string content is one text block). In OpenAI requests a
// message's text is one text block per content part, each of an
// assistant message's tool_calls is a tool_use block (Input the
// arguments when they are valid JSON, else the arguments as a JSON
// string), and a tool message is one tool_result block (ToolUseID its
// tool_call_id, Content its text).
type Block struct {
	Type string // "text", "tool_use", "tool_result", or another type as sent
	Text string // text blocks

	ID    string          // tool_use: the call's id
	Name  string          // tool_use: the tool
	Input json.RawMessage // tool_use: the input

	ToolUseID string // tool_result: the call it answers
	Content   string // tool_result: its text blocks joined by "\n"
	IsError   bool   // tool_result: is_error (Anthropic)

	CacheControl string // the block's cache_control type, or ""; Anthropic only
}

// Tool is one declared tool: an Anthropic tool or an OpenAI function tool.
type Tool struct {
	Name         string
	Description  string
	InputSchema  json.RawMessage // Anthropic input_schema, OpenAI function parameters; nil when absent
	CacheControl string          // the tool's cache_control type, or ""; Anthropic only
}

// ToolCall is one tool call a scripted reply makes.
type ToolCall struct {
	// ID is the call's id; empty gives "toolu_fake_<reply>_<index>"
	// (Anthropic) or "call_fake_<reply>_<index>" (OpenAI).
	ID   string
	Name string
	// Input is the call's input, a JSON object; nil sends {}. OpenAI's
	// wire carries it as the arguments string.
	Input json.RawMessage
	// Arguments, when not empty, is OpenAI's arguments string as sent,
	// instead of Input, so a test can send arguments that are not JSON.
	// Anthropic ignores it.
	Arguments string
}

// APIKey returns the credential the request carried: the x-api-key
// header, else the token of an "Authorization: Bearer" header, else "".
func (r Request) APIKey() string {
	if k := r.Header.Get("X-Api-Key"); k != "" {
		return k
	}
	if token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
		return token
	}
	return ""
}

// Response is what a server answers to one request.
type Response struct {
	// Status is the HTTP status; 0 means 200.
	Status int
	// Text is the reply text when Status is 2xx (empty gives a reply with
	// no text), else the error message. A streamed reply sends it in
	// pieces split after each space (one piece when it has none), so
	// that joining the deltas gives Text.
	Text string
	// ToolCalls are the reply's tool calls, in order: tool_use blocks
	// after the text block (Anthropic) or the message's tool_calls
	// (OpenAI).
	ToolCalls []ToolCall
	// StopReason is the reply's stop_reason (Anthropic) or finish_reason
	// (OpenAI); empty means "tool_use" or "tool_calls" when ToolCalls is
	// set, else "end_turn" or "stop".
	StopReason string
	// ErrorType is the error's type for a non-2xx Status; empty picks the
	// provider's type for the status (for example rate_limit_error for 429).
	ErrorType string
	// InputTokens and OutputTokens are the reported usage; 0 counts the
	// words of the prompt and of Text.
	InputTokens, OutputTokens int64
	// CacheReadTokens and CacheWriteTokens are the reported prompt-cache
	// usage: Anthropic's cache_read_input_tokens and
	// cache_creation_input_tokens (sent always, 0 when not set), OpenAI's
	// prompt_tokens_details cached_tokens and cache_write_tokens (the
	// object is sent only when one is set).
	CacheReadTokens, CacheWriteTokens int64
	// Header holds extra response headers, such as Retry-After.
	Header http.Header
	// RawBody, when not nil, is sent as the body instead of the wire
	// format's JSON, with Status, as a misbehaving proxy might. Its
	// Content-Type is text/plain unless Header sets one.
	RawBody []byte
}

// Handler produces the response to one request. ctx is done when the
// client gives up on the request or the server shuts down. Handlers are
// called concurrently.
type Handler func(ctx context.Context, req Request) Response

// Reply returns a Handler that answers every request with text.
func Reply(text string) Handler {
	return func(context.Context, Request) Response { return Response{Text: text} }
}

// Queue returns a Handler that answers requests with responses in order.
// Once they are used up it answers 500 with a message saying so, which
// fails the test's assertions rather than hanging it.
func Queue(responses ...Response) Handler {
	var (
		mu   sync.Mutex
		next int
	)
	return func(context.Context, Request) Response {
		mu.Lock()
		defer mu.Unlock()
		if next >= len(responses) {
			return Response{Status: http.StatusInternalServerError, Text: fmt.Sprintf("fakemodel: queue exhausted after %d responses", len(responses))}
		}
		r := responses[next]
		next++
		return r
	}
}

// Hang returns a Handler that never answers: it returns only when the
// client gives up or the server shuts down. Use it to test deadlines.
func Hang() Handler {
	return func(ctx context.Context, _ Request) Response {
		<-ctx.Done()
		return Response{Status: http.StatusServiceUnavailable, Text: "fakemodel: request abandoned"}
	}
}

// Server is a running fake model server. Its methods are safe for
// concurrent use.
type Server struct {
	srv     *httptest.Server
	baseURL string
	handler Handler
	wire    wire
	closing context.Context

	mu       sync.Mutex
	requests []Request
	ids      atomic.Int64
}

// wire is one provider's wire format.
type wire struct {
	name   string
	path   string
	decode func(body []byte) (Request, error)
	reply  func(w http.ResponseWriter, id int64, req Request, resp Response)
	// stream answers a 2xx to a request with Stream set, as
	// text/event-stream.
	stream func(w http.ResponseWriter, id int64, req Request, resp Response)
	fail   func(w http.ResponseWriter, status int, errType, msg string)
	// check returns the 400 message for a request the real API refuses
	// before any model runs (a tool call without its result), or "".
	check func(req Request) string
}

// NewAnthropic starts a server speaking the Anthropic Messages API at
// POST /v1/messages. URL() is the base URL for providers.Config.BaseURL.
//
// As the real API does, it answers 400 invalid_request_error, without
// calling h, to a request in which a tool_use block is not answered by a
// tool_result in the next message, a tool_result answers no tool_use of
// the message before it, or tool blocks appear without tools declared.
// Such a request is still recorded.
func NewAnthropic(t testing.TB, h Handler) *Server {
	t.Helper()
	return start(t, h, anthropicWire, "")
}

// NewOpenAI starts a server speaking the OpenAI Chat Completions API at
// POST /v1/chat/completions. URL() ends in /v1, as the base URL of an
// OpenAI-compatible server does.
//
// As the real API does, it answers 400 invalid_request_error, without
// calling h, to a request in which an assistant message's tool_calls are
// not each answered by a tool message right after it, or a tool message
// answers no call of the assistant message before it. Such a request is
// still recorded.
func NewOpenAI(t testing.TB, h Handler) *Server {
	t.Helper()
	return start(t, h, openAIWire, "/v1")
}

func start(t testing.TB, h Handler, w wire, basePath string) *Server {
	t.Helper()
	if h == nil {
		t.Fatalf("fakemodel: New%s: nil Handler", w.name)
	}
	closing, stop := context.WithCancel(context.Background())
	s := &Server{handler: h, wire: w, closing: closing}
	s.srv = httptest.NewServer(http.HandlerFunc(s.serveHTTP))
	s.baseURL = s.srv.URL + basePath
	t.Cleanup(func() {
		// Release handlers still waiting on a client first: Close waits
		// for every outstanding request.
		stop()
		s.srv.Close()
	})
	return s
}

// URL returns the base URL to configure a provider with.
func (s *Server) URL() string { return s.baseURL }

// Client returns an HTTP client for the server whose idle connections
// are closed when the server shuts down.
func (s *Server) Client() *http.Client { return s.srv.Client() }

// Requests returns a copy of the requests received so far, in arrival
// order. A request is recorded before its Handler runs.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Request, len(s.requests))
	copy(out, s.requests)
	return out
}

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != s.wire.path {
		s.wire.fail(w, http.StatusNotFound, "", fmt.Sprintf("fakemodel: no route for %s %s", r.Method, r.URL.Path))
		return
	}
	if r.Method != http.MethodPost {
		s.wire.fail(w, http.StatusMethodNotAllowed, "", fmt.Sprintf("fakemodel: %s wants POST, got %s", r.URL.Path, r.Method))
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		s.wire.fail(w, http.StatusBadRequest, "", "fakemodel: read body: "+err.Error())
		return
	}
	req, err := s.wire.decode(body)
	if err != nil {
		s.wire.fail(w, http.StatusBadRequest, "", "fakemodel: decode body: "+err.Error())
		return
	}
	req.Header = r.Header.Clone()
	req.Body = body
	s.mu.Lock()
	s.requests = append(s.requests, req)
	s.mu.Unlock()
	if msg := s.wire.check(req); msg != "" {
		s.wire.fail(w, http.StatusBadRequest, "", msg)
		return
	}

	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(s.closing, cancel)()

	resp := s.handler(ctx, req)
	for k, vs := range resp.Header {
		for _, v := range vs {
			w.Header().Add(k, v)
		}
	}
	status := resp.Status
	if status == 0 {
		status = http.StatusOK
	}
	if resp.RawBody != nil {
		if w.Header().Get("Content-Type") == "" {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		}
		w.WriteHeader(status)
		_, _ = w.Write(resp.RawBody)
		return
	}
	if status >= 300 {
		// Also for a streaming request: the APIs answer an error before
		// the stream starts as JSON, with its status.
		s.wire.fail(w, status, resp.ErrorType, resp.Text)
		return
	}
	if req.Stream {
		s.wire.stream(w, s.ids.Add(1), req, resp)
		return
	}
	s.wire.reply(w, s.ids.Add(1), req, resp)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	// The client may be gone; there is no one to tell.
	_ = json.NewEncoder(w).Encode(v)
}

// text returns the text of a JSON content value: a string, or an array of
// blocks whose text blocks are joined by "\n".
func text(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var blocks []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &blocks); err != nil {
		return "", fmt.Errorf("content is neither a string nor an array of blocks: %w", err)
	}
	var parts []string
	for _, b := range blocks {
		if b.Type == "text" {
			parts = append(parts, b.Text)
		}
	}
	return strings.Join(parts, "\n"), nil
}

func joinNonEmpty(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "\n" + b
}

func usage(resp Response, req Request) (in, out int64) {
	in, out = resp.InputTokens, resp.OutputTokens
	if in == 0 {
		in = int64(len(strings.Fields(req.System + " " + req.Prompt)))
	}
	if out == 0 {
		out = int64(len(strings.Fields(resp.Text)) + 5*len(resp.ToolCalls))
	}
	return in, out
}
