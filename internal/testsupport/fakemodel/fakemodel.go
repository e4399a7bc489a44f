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
	// no text), else the error message.
	Text string
	// StopReason is the reply's stop_reason (Anthropic) or finish_reason
	// (OpenAI); empty means "end_turn" or "stop".
	StopReason string
	// ErrorType is the error's type for a non-2xx Status; empty picks the
	// provider's type for the status (for example rate_limit_error for 429).
	ErrorType string
	// InputTokens and OutputTokens are the reported usage; 0 counts the
	// words of the prompt and of Text.
	InputTokens, OutputTokens int64
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
	fail   func(w http.ResponseWriter, status int, errType, msg string)
}

// NewAnthropic starts a server speaking the Anthropic Messages API at
// POST /v1/messages. URL() is the base URL for providers.Config.BaseURL.
func NewAnthropic(t testing.TB, h Handler) *Server {
	t.Helper()
	return start(t, h, anthropicWire, "")
}

// NewOpenAI starts a server speaking the OpenAI Chat Completions API at
// POST /v1/chat/completions. URL() ends in /v1, as the base URL of an
// OpenAI-compatible server does.
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
		s.wire.fail(w, status, resp.ErrorType, resp.Text)
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
		out = int64(len(strings.Fields(resp.Text)))
	}
	return in, out
}
