package steps

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// secret is a credential in a query string; no error message may show it.
const secret = "s3cret-token"

const httpWorkflow = `
name: tickets
version: 1
steps:
  - id: file
    kind: http
    with:
      url: '{{service "tickets"}}/tickets?token=` + secret + `'
      headers:
        X-Job: "{{.job}}"
        X-Attempt: "{{.attempt}}"
      body: '{"title": {{json .state.title}}, "severity": {{json .state.severity}}, "n": {{.state.n}}}'
  - id: get
    kind: http
    with:
      url: '{{service "tickets"}}/tickets/{{.state.id}}'
  - id: put
    kind: http
    with:
      method: PUT
      url: '{{service "tickets"}}/tickets/{{.state.id}}'
      body: '{"closed": true}'
  - id: unquoted
    kind: http
    with:
      url: '{{service "tickets"}}/tickets'
      body: '{"title": {{.state.title}}}'
  - id: billing
    kind: http
    with:
      url: '{{service "billing"}}/charge'
      body: '{}'
  - id: search
    kind: http
    with:
      url: '{{service "tickets"}}/search/{{.state.title}}?q={{.state.title}}&n={{.state.n}}{{if .state.path}}&p={{raw .state.path}}{{end}}'
  - id: typo
    kind: http
    with:
      url: '{{service "tickets"}}/tickets/{{.state.ticket}}'
  - id: raw
    kind: http
    with:
      url: 'http://127.0.0.1:1/{{raw .state.path}}?token=` + secret + `'
      body: '{}'
`

const httpState = `{"title": "Crash \"on\" <launch> & more", "severity": "high", "n": 3, "id": "T-9"}`

// seenRequest is what the test server received.
type seenRequest struct {
	Method, Path, RawQuery string
	RemoteAddr             string // the client's end of the connection
	Header                 http.Header
	Body                   []byte
}

// httpBundle is a ticket service that answers with respond (n counts
// requests from 1) and an Env that names it "tickets".
type httpBundle struct {
	srv *httptest.Server
	env *Env
	def *schemas.Definition

	mu   sync.Mutex
	reqs []seenRequest
}

func setupHTTP(t *testing.T, respond func(n int, w http.ResponseWriter, r *http.Request)) *httpBundle {
	t.Helper()
	b := &httpBundle{def: parseDef(t, httpWorkflow)}
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		b.mu.Lock()
		b.reqs = append(b.reqs, seenRequest{Method: r.Method, Path: r.URL.Path, RawQuery: r.URL.RawQuery, RemoteAddr: r.RemoteAddr, Header: r.Header.Clone(), Body: body})
		n := len(b.reqs)
		b.mu.Unlock()
		respond(n, w, r)
	}))
	t.Cleanup(b.srv.Close)
	b.env = &Env{Services: map[string]string{"tickets": b.srv.URL + "/", "audit": "http://audit.test"}, HTTPClient: b.srv.Client()}
	return b
}

func (b *httpBundle) requests() []seenRequest {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]seenRequest(nil), b.reqs...)
}

func (b *httpBundle) run(t *testing.T, ctx context.Context, step, state string) (any, error) {
	t.Helper()
	return mustPrepare(t, b.def, step, b.env).Run(ctx, newCall(b.def, step, state))
}

func replyJSON(status int, body string) func(int, http.ResponseWriter, *http.Request) {
	return func(_ int, w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}
}

func TestHTTPSendsRenderedBody(t *testing.T) {
	t.Parallel()
	b := setupHTTP(t, replyJSON(http.StatusOK, `{"id": "T-1", "created": true}`))
	out, err := b.run(t, t.Context(), "file", httpState)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if got, _ := json.Marshal(out); string(got) != `{"id":"T-1","created":true}` {
		t.Errorf("output = %s, want the response body", got)
	}
	reqs := b.requests()
	if len(reqs) != 1 {
		t.Fatalf("server got %d requests, want 1", len(reqs))
	}
	r := reqs[0]
	if r.Method != http.MethodPost || r.Path != "/tickets" || r.RawQuery != "token="+secret {
		t.Errorf("request = %s %s?%s, want POST /tickets?token=...", r.Method, r.Path, r.RawQuery)
	}
	for h, want := range map[string]string{
		"Content-Type":    "application/json",
		"Accept":          "application/json, text/*;q=0.9, */*;q=0.1",
		"Idempotency-Key": "job-1/file/run-1",
		"X-Job":           "job-1",
		"X-Attempt":       "1",
	} {
		if got := r.Header.Get(h); got != want {
			t.Errorf("header %s = %q, want %q", h, got, want)
		}
	}
	var body map[string]any
	if err := json.Unmarshal(r.Body, &body); err != nil {
		t.Fatalf("body %q is not JSON: %v", r.Body, err)
	}
	want := map[string]any{"title": `Crash "on" <launch> & more`, "severity": "high", "n": 3.0}
	if !reflect.DeepEqual(body, want) {
		t.Errorf("body = %v, want %v", body, want)
	}
}

func TestHTTPMethods(t *testing.T) {
	t.Parallel()
	tests := []struct {
		step, wantMethod, wantContentType, wantBody string
	}{
		{step: "get", wantMethod: http.MethodGet},
		{step: "put", wantMethod: http.MethodPut, wantContentType: "application/json", wantBody: `{"closed": true}`},
	}
	for _, tt := range tests {
		t.Run(tt.step, func(t *testing.T) {
			t.Parallel()
			b := setupHTTP(t, replyJSON(http.StatusOK, `{"id": "T-9"}`))
			if _, err := b.run(t, t.Context(), tt.step, httpState); err != nil {
				t.Fatalf("Run: %v", err)
			}
			r := b.requests()[0]
			if r.Method != tt.wantMethod || r.Path != "/tickets/T-9" || r.Header.Get("Content-Type") != tt.wantContentType || string(r.Body) != tt.wantBody {
				t.Errorf("request = %s %s, Content-Type %q, body %q; want %s, %q, %q",
					r.Method, r.Path, r.Header.Get("Content-Type"), r.Body, tt.wantMethod, tt.wantContentType, tt.wantBody)
			}
			if r.Header.Get("Idempotency-Key") != "job-1/"+tt.step+"/run-1" {
				t.Errorf("Idempotency-Key = %q", r.Header.Get("Idempotency-Key"))
			}
		})
	}
}

func TestHTTPIdempotencyKeyOnEveryAttempt(t *testing.T) {
	t.Parallel()
	b := setupHTTP(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if n < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		replyJSON(http.StatusCreated, `{"id": "T-1"}`)(n, w, r)
	})
	r := mustPrepare(t, b.def, "file", b.env)
	const key = "job-7/file/run-1"
	for attempt := 1; attempt <= 3; attempt++ {
		c := newCall(b.def, "file", httpState)
		c.Attempt, c.RunAttempt, c.IdempotencyKey = attempt+4, attempt, key
		_, err := r.Run(t.Context(), c)
		if attempt < 3 {
			wantStepError(t, err, schemas.CodeProvider, true, "status 503")
			continue
		}
		if err != nil {
			t.Fatalf("attempt 3: %v", err)
		}
	}
	reqs := b.requests()
	if len(reqs) != 3 {
		t.Fatalf("server got %d requests, want 3", len(reqs))
	}
	for i, req := range reqs {
		if got := req.Header.Values("Idempotency-Key"); len(got) != 1 || got[0] != key {
			t.Errorf("attempt %d: Idempotency-Key = %q, want exactly %q", i+1, got, key)
		}
		if got, want := req.Header.Get("X-Attempt"), string(rune('1'+i)); got != want {
			t.Errorf("attempt %d: X-Attempt = %q, want %q", i+1, got, want)
		}
	}
}

func TestHTTPStatus(t *testing.T) {
	t.Parallel()
	big := `{"pad": "` + strings.Repeat("x", MaxHTTPResponseBytes) + `"}`
	tests := []struct {
		name          string
		status        int
		body          string
		want          string
		wantCode      schemas.Code
		wantRetryable bool
		wantMessage   []string
	}{
		{name: "200 JSON", status: 200, body: `{"id": "T-1"}`, want: `{"id":"T-1"}`},
		{name: "200 JSON array", status: 200, body: `[1, 2]`, want: `[1,2]`},
		{name: "201 empty body", status: 201, body: ``, want: `{}`},
		{name: "202 blank body", status: 202, body: " \n", want: `{}`},
		{name: "204 no content", status: 204, want: `{}`},
		{name: "200 not JSON", status: 200, body: `<html>ok</html>`,
			wantCode: schemas.CodeOutputInvalid, wantMessage: []string{"response is not JSON", "<html>ok</html>"}},
		{name: "200 over the size limit", status: 200, body: big,
			wantCode: schemas.CodeTooLarge, wantMessage: []string{"response over 1048576 bytes"}},
		{name: "400", status: 400, body: `{"error": "title too long"}`,
			wantCode: schemas.CodeProvider, wantMessage: []string{"status 400", "title too long"}},
		{name: "401", status: 401, wantCode: schemas.CodeProvider, wantMessage: []string{"status 401"}},
		{name: "404", status: 404, wantCode: schemas.CodeProvider, wantMessage: []string{"status 404"}},
		{name: "408", status: 408, wantCode: schemas.CodeProvider, wantRetryable: true},
		{name: "409 same key in progress", status: 409, wantCode: schemas.CodeProvider, wantRetryable: true, wantMessage: []string{"status 409"}},
		{name: "425", status: 425, wantCode: schemas.CodeProvider, wantRetryable: true},
		{name: "429", status: 429, body: "slow down", wantCode: schemas.CodeProvider, wantRetryable: true, wantMessage: []string{"status 429: slow down"}},
		{name: "500", status: 500, wantCode: schemas.CodeProvider, wantRetryable: true, wantMessage: []string{"status 500"}},
		{name: "503", status: 503, wantCode: schemas.CodeProvider, wantRetryable: true, wantMessage: []string{"status 503"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setupHTTP(t, replyJSON(tt.status, tt.body))
			out, err := b.run(t, t.Context(), "file", httpState)
			if tt.wantCode == "" {
				if err != nil {
					t.Fatalf("Run: %v", err)
				}
				if got, _ := json.Marshal(out); string(got) != tt.want {
					t.Errorf("output = %s, want %s", got, tt.want)
				}
				return
			}
			e := wantStepError(t, err, tt.wantCode, tt.wantRetryable, append(tt.wantMessage, "POST http://", "/tickets?…")...)
			if strings.Contains(e.Message, secret) {
				t.Errorf("message %q shows the query string", e.Message)
			}
			if len(e.Message) > 1000 {
				t.Errorf("message is %d bytes; a response body must be quoted only in part", len(e.Message))
			}
		})
	}
}

func TestHTTPRunErrors(t *testing.T) {
	t.Parallel()
	hang := func(_ int, _ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }
	tests := []struct {
		name          string
		step          string
		state         string // default httpState
		respond       func(int, http.ResponseWriter, *http.Request)
		down          bool // the service is not listening
		timeout       time.Duration
		wantCode      schemas.Code
		wantRetryable bool
		wantMessage   []string
		wantRequests  int
	}{
		{name: "unknown service", step: "billing", wantCode: schemas.CodeStepFailed,
			wantMessage: []string{`no service named "billing"`, "known: audit, tickets"}},
		{name: "a string where a body value belongs", step: "unquoted", wantCode: schemas.CodeStepFailed,
			wantMessage: []string{"{{.state.title}} at unquoted.body:1:12 stands where a JSON value belongs", "must print a number, true, false or null"}},
		{name: "missing key in the URL", step: "typo", wantCode: schemas.CodeStepFailed,
			wantMessage: []string{`map has no entry for key "ticket"`}},
		{name: "URL that does not parse", step: "raw", state: `{"path": "%zz"}`, wantCode: schemas.CodeStepFailed,
			wantMessage: []string{"build request POST http://127.0.0.1:1/%zz?…", `invalid URL escape "%zz"`}},
		{name: "connection refused", step: "file", down: true, wantCode: schemas.CodeProvider, wantRetryable: true,
			wantMessage: []string{"POST http://", "/tickets?…", "connection refused"}},
		{name: "context deadline", step: "file", respond: hang, timeout: 100 * time.Millisecond, wantCode: schemas.CodeProvider, wantRetryable: true,
			wantMessage: []string{"POST http://", "/tickets?…", "context deadline exceeded"}, wantRequests: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			respond := tt.respond
			if respond == nil {
				respond = replyJSON(200, `{}`)
			}
			b := setupHTTP(t, respond)
			if tt.down {
				b.srv.Close()
			}
			ctx := t.Context()
			if tt.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.timeout)
				defer cancel()
			}
			state := tt.state
			if state == "" {
				state = httpState
			}
			_, err := b.run(t, ctx, tt.step, state)
			e := wantStepError(t, err, tt.wantCode, tt.wantRetryable, tt.wantMessage...)
			if strings.Contains(e.Message, secret) {
				t.Errorf("message %q shows the query string", e.Message)
			}
			if n := len(b.requests()); n != tt.wantRequests {
				t.Errorf("server got %d requests, want %d", n, tt.wantRequests)
			}
		})
	}
}

func TestHTTPPrepare(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, with, wantErr string
	}{
		{name: "Idempotency-Key header", with: `{"url": "http://x", "headers": {"Idempotency-Key": "k"}}`, wantErr: "header Idempotency-Key is set by Waymark"},
		{name: "idempotency-key in lower case", with: `{"url": "http://x", "headers": {"idempotency-key": "{{.job}}"}}`, wantErr: "header Idempotency-Key is set by Waymark"},
		{name: "broken URL template", with: `{"url": "{{service"}`, wantErr: "template s.url"},
		{name: "broken body template", with: `{"url": "http://x", "body": "{{.state"}`, wantErr: "template s.body"},
		{name: "broken header template", with: `{"url": "http://x", "headers": {"X-A": "{{"}}`, wantErr: "template s.headers.X-A"},
		{name: "unknown setting", with: `{"url": "http://x", "timeout": "1s"}`, wantErr: `unknown field "timeout"`},
		{name: "fine", with: `{"url": "http://x", "headers": {"X-Idem": "{{.idempotency_key}}"}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			def := &schemas.Definition{Name: "p", Version: 1, Steps: []schemas.Step{{ID: "s", Kind: schemas.KindHTTP, With: json.RawMessage(tt.with)}}}
			_, err := prepareStep(t, def, "s", nil)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Prepare: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Prepare = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

// TestHTTPNotResentAfterCommit: a server that reads a request (and may have
// acted on it) and then drops a reused keep-alive connection must see the
// request once. net/http would otherwise resend it by itself, because it
// carries an Idempotency-Key; Waymark owns retries, and decides with the
// effect ledger whether to ask again.
func TestHTTPNotResentAfterCommit(t *testing.T) {
	t.Parallel()
	b := setupHTTP(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if n != 2 {
			replyJSON(http.StatusOK, `{"id": "T-1"}`)(n, w, r)
			return
		}
		// Committed: the body has been read. Now the connection dies
		// before any response byte.
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Errorf("hijack: %v", err)
			return
		}
		_ = conn.Close()
	})
	r := mustPrepare(t, b.def, "file", b.env)

	// The first call leaves an idle keep-alive connection in the client.
	if _, err := r.Run(t.Context(), newCall(b.def, "file", httpState)); err != nil {
		t.Fatalf("first call: %v", err)
	}
	// The second reuses it, and the server drops it after reading.
	_, err := r.Run(t.Context(), newCall(b.def, "file", httpState))
	reqs := b.requests()
	if len(reqs) != 2 {
		t.Fatalf("server got %d requests, want 2: the transport resent the dropped POST on its own", len(reqs))
	}
	if reqs[0].RemoteAddr != reqs[1].RemoteAddr {
		t.Fatalf("the second request came on a new connection (%s, then %s); the test needs a reused one", reqs[0].RemoteAddr, reqs[1].RemoteAddr)
	}
	wantStepError(t, err, schemas.CodeProvider, true, "POST http://")
	for i, req := range reqs {
		if req.Method != http.MethodPost || req.Header.Get("Idempotency-Key") == "" {
			t.Errorf("request %d = %s with Idempotency-Key %q", i+1, req.Method, req.Header.Get("Idempotency-Key"))
		}
	}
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"http://h/p":              "http://h/p",
		"http://h/p?token=x":      "http://h/p?…",
		"http://h/p#frag":         "http://h/p?…",
		"https://h/a/b?x=1#y=2":   "https://h/a/b?…",
		"https://user:secret@h/p": "https://h/p",
	} {
		if got := redactURL(in); got != want {
			t.Errorf("redactURL(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestHTTPURLValuesAreEscaped: values printed into a URL template are one
// path segment or one query value whatever they hold; raw opts out.
func TestHTTPURLValuesAreEscaped(t *testing.T) {
	t.Parallel()
	b := setupHTTP(t, replyJSON(200, `{}`))
	title := "a&admin=true&d=0#frag/../x y?z=é"
	state, _ := json.Marshal(map[string]any{"title": title, "n": 3, "path": "x&y"})
	if _, err := b.run(t, context.Background(), "search", string(state)); err != nil {
		t.Fatal(err)
	}
	reqs := b.requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want 1", len(reqs))
	}
	r := reqs[0]
	if r.Path != "/search/"+title {
		t.Errorf("path = %q, want one segment holding the title", r.Path)
	}
	q, err := url.ParseQuery(r.RawQuery)
	if err != nil {
		t.Fatal(err)
	}
	want := url.Values{"q": {title}, "n": {"3"}, "p": {"x"}, "y": {""}}
	if !reflect.DeepEqual(q, want) {
		t.Errorf("query = %v (raw %q), want %v: the title one value, raw's value as it is", q, r.RawQuery, want)
	}
}

// TestHTTPURLDotSegmentsRefused: a value "." or ".." printed as a path
// segment would send the request elsewhere on a server that resolves dot
// segments; such a URL is refused before anything is sent.
func TestHTTPURLDotSegmentsRefused(t *testing.T) {
	t.Parallel()
	b := setupHTTP(t, replyJSON(200, `{}`))
	for _, title := range []string{"..", "."} {
		state, _ := json.Marshal(map[string]any{"title": title, "n": 3, "path": "x"})
		_, err := b.run(t, context.Background(), "search", string(state))
		if err == nil || !strings.Contains(err.Error(), "dot segment") || schemas.AsError(err).Code != schemas.CodeInputInvalid {
			t.Errorf("title %q: err = %v, want input_invalid naming the dot segment", title, err)
		}
	}
	if n := len(b.requests()); n != 0 {
		t.Errorf("%d requests sent, want none", n)
	}
	if err := checkDotSegments("http://h/a/%2E%2e/b"); err == nil {
		t.Errorf("an encoded .. segment passed")
	}
	if err := checkDotSegments("http://h/a/..x/b.c?q=.."); err != nil {
		t.Errorf("dots inside segments or in the query refused: %v", err)
	}
}

// TestHTTPTextResponses: a text or HTML response becomes {"content_type",
// "text", "bytes"} (response auto, the default, and text); response json
// refuses it; a body that is neither JSON nor UTF-8 fails the step; a body
// that says it is JSON and is not fails it too.
func TestHTTPTextResponses(t *testing.T) {
	t.Parallel()
	reply := func(ctype, body string) func(int, http.ResponseWriter, *http.Request) {
		return func(_ int, w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", ctype)
			_, _ = io.WriteString(w, body)
		}
	}
	for _, tc := range []struct {
		name, response, ctype, body, want, wantErr string
	}{
		{"html, auto", "", "text/html; charset=utf-8", "<p>hello</p>", `{"content_type":"text/html; charset=utf-8","text":"\u003cp\u003ehello\u003c/p\u003e","bytes":12}`, ""},
		{"json, text", "text", "application/json", `{"a": 1}`, `{"content_type":"application/json","text":"{\"a\": 1}","bytes":8}`, ""},
		{"html, json", "json", "text/html", "<p>hello</p>", "", "response is not JSON"},
		{"binary", "", "application/octet-stream", "\xff\xfe\x00", "", "neither JSON nor UTF-8 text"},
		{"says json", "", "application/problem+json", "oops", "", "response is not JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setupHTTP(t, reply(tc.ctype, tc.body))
			wf := "name: txt\nversion: 1\nsteps:\n  - id: get\n    kind: http\n    with: {method: GET, url: '{{service \"tickets\"}}/page'"
			if tc.response != "" {
				wf += ", response: " + tc.response
			}
			wf += "}\n"
			def := parseDef(t, wf)
			out, err := mustPrepare(t, def, "get", b.env).Run(t.Context(), newCall(def, "get", `{}`))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got, _ := json.Marshal(out); string(got) != tc.want {
				t.Errorf("output %s, want %s", got, tc.want)
			}
			if h := b.requests()[0].Header.Get("Accept"); tc.response == "" && !strings.Contains(h, "text/*") {
				t.Errorf("Accept %q; auto should take text too", h)
			}
		})
	}
}
