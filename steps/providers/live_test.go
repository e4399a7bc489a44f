package providers_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/steps/providers"
)

// testKey looks like a real key so that a leak would be obvious.
const testKey = "sk-test-4f1c9a7e0b2d-SECRET"

// live is one live provider and the fake server that speaks its wire format.
type live struct {
	name        string
	startServer func(testing.TB, fakemodel.Handler) *fakemodel.Server
	newProvider func(providers.Config) providers.Provider
	stopReason  string // what the fake sends by default
}

var lives = []live{
	{name: providers.Anthropic, startServer: fakemodel.NewAnthropic, newProvider: providers.NewAnthropic, stopReason: "end_turn"},
	{name: providers.OpenAI, startServer: fakemodel.NewOpenAI, newProvider: providers.NewOpenAI, stopReason: "stop"},
}

type bundle struct {
	srv *fakemodel.Server
	p   providers.Provider
}

func setup(t *testing.T, l live, h fakemodel.Handler) bundle {
	t.Helper()
	srv := l.startServer(t, h)
	p := l.newProvider(providers.Config{APIKey: testKey, BaseURL: srv.URL(), HTTPClient: srv.Client()})
	return bundle{srv: srv, p: p}
}

func TestLiveComplete(t *testing.T) {
	t.Parallel()
	temp := 0.25
	tests := []struct {
		name          string
		req           providers.Request
		wantMaxTokens int64
	}{
		{
			name:          "system and default max tokens",
			req:           providers.Request{Model: "model-a", System: "Answer in one word.", Prompt: "Is this good? I love it.", Step: "classify", Attempt: 1},
			wantMaxTokens: 1024,
		},
		{
			name:          "no system, explicit max tokens, temperature",
			req:           providers.Request{Model: "model-b", Prompt: "Say hi.", MaxTokens: 64, Temperature: &temp},
			wantMaxTokens: 64,
		},
	}
	for _, l := range lives {
		for _, tt := range tests {
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, l, func(context.Context, fakemodel.Request) fakemodel.Response {
					return fakemodel.Response{Text: "positive", InputTokens: 17, OutputTokens: 2}
				})

				got, err := b.p.Complete(t.Context(), tt.req)
				if err != nil {
					t.Fatalf("Complete: %v", err)
				}
				want := providers.Reply{Text: "positive", Model: tt.req.Model, StopReason: l.stopReason, Usage: providers.Usage{InputTokens: 17, OutputTokens: 2}}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("reply = %+v, want %+v", got, want)
				}

				reqs := b.srv.Requests()
				if len(reqs) != 1 {
					t.Fatalf("server saw %d requests, want 1 (no SDK retries)", len(reqs))
				}
				seen := reqs[0]
				if seen.Model != tt.req.Model || seen.System != tt.req.System || seen.Prompt != tt.req.Prompt {
					t.Errorf("server saw model %q system %q prompt %q, want %q %q %q",
						seen.Model, seen.System, seen.Prompt, tt.req.Model, tt.req.System, tt.req.Prompt)
				}
				if seen.MaxTokens != tt.wantMaxTokens {
					t.Errorf("server saw max tokens %d, want %d", seen.MaxTokens, tt.wantMaxTokens)
				}
				if seen.APIKey() != testKey {
					t.Errorf("server saw key %q (x-api-key %q, authorization %q), want the configured key",
						seen.APIKey(), seen.Header.Get("X-Api-Key"), seen.Header.Get("Authorization"))
				}
				assertWireDetails(t, l.name, tt.req, seen)
			})
		}
	}
}

// assertWireDetails checks what differs between the two APIs.
func assertWireDetails(t *testing.T, provider string, req providers.Request, seen fakemodel.Request) {
	t.Helper()
	var body map[string]json.RawMessage
	if err := json.Unmarshal(seen.Body, &body); err != nil {
		t.Fatalf("request body: %v", err)
	}
	_, hasSystem := body["system"]
	switch provider {
	case providers.Anthropic:
		if seen.Header.Get("Anthropic-Version") == "" {
			t.Error("no anthropic-version header")
		}
		if hasSystem != (req.System != "") {
			t.Errorf("system field present = %v, want %v", hasSystem, req.System != "")
		}
		// API version 2026-10-21 rejects sampling parameters.
		if seen.Temperature != nil {
			t.Errorf("temperature sent to Anthropic: %v", *seen.Temperature)
		}
	case providers.OpenAI:
		var msgs []struct{ Role string }
		if err := json.Unmarshal(body["messages"], &msgs); err != nil {
			t.Fatalf("messages: %v", err)
		}
		wantMsgs := 1
		if req.System != "" {
			wantMsgs = 2
			if msgs[0].Role != "system" {
				t.Errorf("first message role %q, want system", msgs[0].Role)
			}
		}
		if len(msgs) != wantMsgs || msgs[len(msgs)-1].Role != "user" {
			t.Errorf("messages %+v, want %d ending with user", msgs, wantMsgs)
		}
		// A compatible server (any base URL but api.openai.com) gets max_tokens.
		if _, ok := body["max_tokens"]; !ok {
			t.Errorf("no max_tokens in %s", seen.Body)
		}
		if (seen.Temperature == nil) != (req.Temperature == nil) || (req.Temperature != nil && *seen.Temperature != *req.Temperature) {
			t.Errorf("temperature sent %v, want %v", seen.Temperature, req.Temperature)
		}
	}
}

func TestLiveErrors(t *testing.T) {
	t.Parallel()
	leakyMessage := "invalid key " + testKey
	tests := []struct {
		name           string
		resp           fakemodel.Response
		wantStatus     int
		wantRetryable  bool
		wantRetryAfter time.Duration
		wantInMessage  string
	}{
		{name: "429 rate limited", resp: fakemodel.Response{Status: 429, Text: "slow down", Header: http.Header{"Retry-After": {"7"}}}, wantStatus: 429, wantRetryable: true, wantRetryAfter: 7 * time.Second, wantInMessage: "slow down"},
		{name: "500 server error", resp: fakemodel.Response{Status: 500, Text: "boom"}, wantStatus: 500, wantRetryable: true, wantInMessage: "boom"},
		{name: "503 unavailable", resp: fakemodel.Response{Status: 503, Text: "later"}, wantStatus: 503, wantRetryable: true},
		{name: "529 overloaded", resp: fakemodel.Response{Status: 529, Text: "Overloaded"}, wantStatus: 529, wantRetryable: true, wantInMessage: "Overloaded"},
		{name: "408 timeout", resp: fakemodel.Response{Status: 408, Text: "too slow"}, wantStatus: 408, wantRetryable: true},
		{name: "409 conflict", resp: fakemodel.Response{Status: 409, Text: "conflict"}, wantStatus: 409, wantRetryable: true},
		{name: "401 unauthorized echoing the key", resp: fakemodel.Response{Status: 401, Text: leakyMessage}, wantStatus: 401, wantInMessage: "[redacted]"},
		{name: "400 bad request", resp: fakemodel.Response{Status: 400, Text: "max_tokens: too large"}, wantStatus: 400, wantInMessage: "max_tokens: too large"},
		{name: "403 forbidden", resp: fakemodel.Response{Status: 403, Text: "no"}, wantStatus: 403},
		{name: "404 unknown model", resp: fakemodel.Response{Status: 404, Text: "model: nope"}, wantStatus: 404, wantInMessage: "model: nope"},
		{name: "422 unprocessable", resp: fakemodel.Response{Status: 422, Text: "bad"}, wantStatus: 422},
		{name: "502 html from a proxy", resp: fakemodel.Response{Status: 502, RawBody: []byte("<html>bad gateway</html>"), Header: http.Header{"Content-Type": {"text/html"}}}, wantStatus: 502, wantRetryable: true},
		{name: "401 plain text from a proxy", resp: fakemodel.Response{Status: 401, RawBody: []byte(leakyMessage)}, wantStatus: 401},
		{name: "200 empty reply", resp: fakemodel.Response{Text: ""}, wantRetryable: true, wantInMessage: "empty reply"},
		{name: "200 not json", resp: fakemodel.Response{RawBody: []byte("{not json"), Header: http.Header{"Content-Type": {"application/json"}}}, wantRetryable: true},
	}
	for _, l := range lives {
		for _, tt := range tests {
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, l, fakemodel.Queue(tt.resp))

				_, err := b.p.Complete(t.Context(), providers.Request{Model: "m", Prompt: "hello", Step: "s"})
				perr := assertProviderError(t, err, l.name, tt.wantRetryable)
				if perr.StatusCode != tt.wantStatus {
					t.Errorf("StatusCode = %d, want %d", perr.StatusCode, tt.wantStatus)
				}
				if perr.RetryAfter != tt.wantRetryAfter {
					t.Errorf("RetryAfter = %v, want %v", perr.RetryAfter, tt.wantRetryAfter)
				}
				if !strings.Contains(perr.Message, tt.wantInMessage) {
					t.Errorf("Message = %q, want it to contain %q", perr.Message, tt.wantInMessage)
				}
				if n := len(b.srv.Requests()); n != 1 {
					t.Errorf("server saw %d requests, want 1: the engine owns retries", n)
				}
			})
		}
	}
}

// assertProviderError checks err is a *providers.Error from provider with
// the given retryability and no key in sight, and returns it.
func assertProviderError(t *testing.T, err error, provider string, wantRetryable bool) *providers.Error {
	t.Helper()
	var perr *providers.Error
	if !errors.As(err, &perr) {
		t.Fatalf("error %v (%T) is not a *providers.Error", err, err)
	}
	if perr.Provider != provider {
		t.Errorf("Provider = %q, want %q", perr.Provider, provider)
	}
	if perr.Retryable != wantRetryable {
		t.Errorf("Retryable = %v, want %v (error: %v)", perr.Retryable, wantRetryable, err)
	}
	if strings.Contains(err.Error(), testKey) || strings.Contains(perr.Message, testKey) {
		t.Errorf("error text leaks the API key: %v", err)
	}
	if perr.Message == "" {
		t.Error("empty Message")
	}
	return perr
}

func TestLiveContext(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		ctx     func(t *testing.T) context.Context
		wantErr error
		wantHit bool // whether the request reached the server
	}{
		{
			name: "deadline while waiting for the reply",
			ctx: func(t *testing.T) context.Context {
				ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
				t.Cleanup(cancel)
				return ctx
			},
			wantErr: context.DeadlineExceeded,
			wantHit: true,
		},
		{
			name: "deadline already passed",
			ctx: func(t *testing.T) context.Context {
				ctx, cancel := context.WithDeadline(t.Context(), time.Unix(0, 0))
				t.Cleanup(cancel)
				return ctx
			},
			wantErr: context.DeadlineExceeded,
		},
		{
			name: "cancelled",
			ctx: func(t *testing.T) context.Context {
				ctx, cancel := context.WithCancel(t.Context())
				cancel()
				return ctx
			},
			wantErr: context.Canceled,
		},
	}
	for _, l := range lives {
		for _, tt := range tests {
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, l, fakemodel.Hang())

				_, err := b.p.Complete(tt.ctx(t), providers.Request{Model: "m", Prompt: "hello"})
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("error = %v, want errors.Is %v", err, tt.wantErr)
				}
				assertProviderError(t, err, l.name, true)
				if hit := len(b.srv.Requests()) > 0; tt.wantHit && !hit {
					t.Error("request never reached the server")
				}
			})
		}
	}
}

// failingTransport fails every request as a dropped connection would.
type failingTransport struct{}

func (failingTransport) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, errors.New("read tcp 127.0.0.1:1: connection reset by peer")
}

func TestLiveNetworkErrorRetryable(t *testing.T) {
	t.Parallel()
	for _, l := range lives {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			p := l.newProvider(providers.Config{APIKey: testKey, BaseURL: "http://127.0.0.1:1/v1", HTTPClient: &http.Client{Transport: failingTransport{}}})
			_, err := p.Complete(t.Context(), providers.Request{Model: "m", Prompt: "hello"})
			perr := assertProviderError(t, err, l.name, true)
			if perr.StatusCode != 0 || !strings.Contains(perr.Message, "connection reset") {
				t.Errorf("got %+v, want status 0 and the transport's message", perr)
			}
		})
	}
}

func TestLiveInvalidCalls(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		cfg     func(baseURL string) providers.Config
		req     providers.Request
		only    string // run for this provider only; empty means both
		wantMsg string
	}{
		{name: "no key for the public API", cfg: func(string) providers.Config { return providers.Config{} }, req: providers.Request{Model: "m", Prompt: "p"}, wantMsg: "APIKey"},
		{name: "base URL without scheme", cfg: func(string) providers.Config { return providers.Config{APIKey: testKey, BaseURL: "localhost:11434"} }, req: providers.Request{Model: "m", Prompt: "p"}, wantMsg: "BaseURL"},
		{name: "base URL unparsable", cfg: func(string) providers.Config { return providers.Config{APIKey: testKey, BaseURL: "http://[::1"} }, req: providers.Request{Model: "m", Prompt: "p"}, wantMsg: "BaseURL"},
		{name: "no model", cfg: okConfig, req: providers.Request{Prompt: "p", Step: "classify"}, wantMsg: `step "classify" has no model`},
		{name: "empty prompt", cfg: okConfig, req: providers.Request{Model: "m"}, wantMsg: "empty prompt"},
		{name: "negative max tokens", cfg: okConfig, req: providers.Request{Model: "m", Prompt: "p", MaxTokens: -1}, wantMsg: "negative"},
		{name: "max tokens needing streaming", cfg: okConfig, req: providers.Request{Model: "m", Prompt: "p", MaxTokens: 200_000}, only: providers.Anthropic, wantMsg: "streaming"},
	}
	for _, l := range lives {
		for _, tt := range tests {
			if tt.only != "" && tt.only != l.name {
				continue
			}
			t.Run(l.name+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				srv := l.startServer(t, fakemodel.Reply("unreachable"))
				cfg := tt.cfg(srv.URL())
				cfg.HTTPClient = srv.Client()
				_, err := l.newProvider(cfg).Complete(t.Context(), tt.req)
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

func okConfig(baseURL string) providers.Config {
	return providers.Config{APIKey: testKey, BaseURL: baseURL}
}

func TestOpenAICompatibleWithoutKey(t *testing.T) {
	t.Parallel()
	srv := fakemodel.NewOpenAI(t, fakemodel.Reply("hi"))
	p := providers.NewOpenAI(providers.Config{BaseURL: srv.URL(), HTTPClient: srv.Client()})

	got, err := p.Complete(t.Context(), providers.Request{Model: "llama3.2", Prompt: "hello"})
	if err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if got.Text != "hi" {
		t.Errorf("Text = %q, want hi", got.Text)
	}
	if auth := srv.Requests()[0].Header.Get("Authorization"); auth != "" {
		t.Errorf("Authorization = %q, want none for a server configured without a key", auth)
	}
}

func TestLiveDefaultHTTPClient(t *testing.T) {
	t.Parallel()
	for _, l := range lives {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			srv := l.startServer(t, fakemodel.Reply("ok"))
			p := l.newProvider(providers.Config{APIKey: testKey, BaseURL: srv.URL()})
			if _, err := p.Complete(t.Context(), providers.Request{Model: "m", Prompt: "p"}); err != nil {
				t.Fatalf("Complete: %v", err)
			}
		})
	}
}

func TestLiveConcurrent(t *testing.T) {
	t.Parallel()
	for _, l := range lives {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, l, func(_ context.Context, req fakemodel.Request) fakemodel.Response {
				return fakemodel.Response{Text: "echo " + req.Prompt}
			})
			const n = 8
			errs := make(chan error, n)
			for i := range n {
				go func() {
					prompt := strings.Repeat("x", i+1)
					got, err := b.p.Complete(t.Context(), providers.Request{Model: "m", Prompt: prompt})
					if err == nil && got.Text != "echo "+prompt {
						err = errors.New("wrong reply " + got.Text)
					}
					errs <- err
				}()
			}
			for range n {
				if err := <-errs; err != nil {
					t.Error(err)
				}
			}
		})
	}
}
