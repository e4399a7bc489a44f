package fakemodel_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// post sends body to url and decodes the JSON answer.
func post(t *testing.T, srv *fakemodel.Server, path, body string, header map[string]string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL()+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
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
	var out map[string]any
	if err := json.Unmarshal(data, &out); err != nil {
		t.Fatalf("response %s: %v", data, err)
	}
	return res.StatusCode, out
}

func TestWire(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		start      func(testing.TB, fakemodel.Handler) *fakemodel.Server
		path       string
		body       string
		header     map[string]string
		resp       fakemodel.Response
		wantStatus int
		wantJSON   string // a subset of the answer, as JSON
		wantReq    fakemodel.Request
	}{
		{
			name:       "anthropic reply",
			start:      fakemodel.NewAnthropic,
			path:       "/v1/messages",
			body:       `{"model":"m","max_tokens":5,"system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":"hi"}]}`,
			header:     map[string]string{"x-api-key": "k1"},
			resp:       fakemodel.Response{Text: "yo", InputTokens: 3, OutputTokens: 1},
			wantStatus: 200,
			wantJSON:   `{"type":"message","role":"assistant","content":[{"type":"text","text":"yo"}],"model":"m","stop_reason":"end_turn","usage":{"input_tokens":3,"output_tokens":1}}`,
			wantReq:    fakemodel.Request{Model: "m", System: "sys", Prompt: "hi", MaxTokens: 5},
		},
		{
			name:       "anthropic error",
			start:      fakemodel.NewAnthropic,
			path:       "/v1/messages",
			body:       `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`,
			resp:       fakemodel.Response{Status: 529, Text: "Overloaded"},
			wantStatus: 529,
			wantJSON:   `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`,
			wantReq:    fakemodel.Request{Model: "m", Prompt: "hi", MaxTokens: 5},
		},
		{
			name:       "openai reply",
			start:      fakemodel.NewOpenAI,
			path:       "/chat/completions",
			body:       `{"model":"g","max_completion_tokens":9,"temperature":0.5,"messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"}]}`,
			header:     map[string]string{"Authorization": "Bearer k2"},
			resp:       fakemodel.Response{Text: "yo", InputTokens: 3, OutputTokens: 1},
			wantStatus: 200,
			wantJSON:   `{"object":"chat.completion","model":"g","choices":[{"index":0,"message":{"role":"assistant","content":"yo"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`,
			wantReq:    fakemodel.Request{Model: "g", System: "sys", Prompt: "hi", MaxTokens: 9},
		},
		{
			name:       "openai error",
			start:      fakemodel.NewOpenAI,
			path:       "/chat/completions",
			body:       `{"model":"g","messages":[{"role":"user","content":"hi"}]}`,
			resp:       fakemodel.Response{Status: 401, Text: "bad key"},
			wantStatus: 401,
			wantJSON:   `{"error":{"message":"bad key","type":"invalid_request_error","code":"invalid_api_key"}}`,
			wantReq:    fakemodel.Request{Model: "g", Prompt: "hi"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := tt.start(t, fakemodel.Queue(tt.resp))
			status, got := post(t, srv, tt.path, tt.body, tt.header)
			if status != tt.wantStatus {
				t.Errorf("status = %d, want %d", status, tt.wantStatus)
			}
			var want map[string]any
			if err := json.Unmarshal([]byte(tt.wantJSON), &want); err != nil {
				t.Fatal(err)
			}
			assertSubset(t, "", want, got)

			reqs := srv.Requests()
			if len(reqs) != 1 {
				t.Fatalf("%d requests recorded, want 1", len(reqs))
			}
			seen := reqs[0]
			if seen.Model != tt.wantReq.Model || seen.System != tt.wantReq.System || seen.Prompt != tt.wantReq.Prompt || seen.MaxTokens != tt.wantReq.MaxTokens {
				t.Errorf("recorded %+v, want %+v", seen, tt.wantReq)
			}
			for k, v := range tt.header {
				if strings.TrimPrefix(v, "Bearer ") != seen.APIKey() {
					t.Errorf("APIKey() = %q, want it from %s: %s", seen.APIKey(), k, v)
				}
			}
		})
	}
}

// assertSubset checks every field of want is in got with the same value.
func assertSubset(t *testing.T, path string, want, got any) {
	t.Helper()
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok {
			t.Errorf("%s: got %v, want an object", path, got)
			return
		}
		for k, v := range w {
			assertSubset(t, path+"."+k, v, g[k])
		}
	case []any:
		g, ok := got.([]any)
		if !ok || len(g) != len(w) {
			t.Errorf("%s: got %v, want %d elements", path, got, len(w))
			return
		}
		for i := range w {
			assertSubset(t, path, w[i], g[i])
		}
	default:
		if !reflect.DeepEqual(want, got) {
			t.Errorf("%s = %v, want %v", path, got, want)
		}
	}
}

func TestQueueExhaustedAndUnknownRoute(t *testing.T) {
	t.Parallel()
	srv := fakemodel.NewAnthropic(t, fakemodel.Queue())
	status, got := post(t, srv, "/v1/messages", `{"model":"m","messages":[]}`, nil)
	if status != 500 || !strings.Contains(got["error"].(map[string]any)["message"].(string), "queue exhausted") {
		t.Errorf("exhausted queue: %d %v", status, got)
	}
	status, _ = post(t, srv, "/v1/complete", `{}`, nil)
	if status != 404 {
		t.Errorf("unknown route: status %d, want 404", status)
	}
}

func TestHangReleasedOnCleanup(t *testing.T) {
	t.Parallel()
	// The server's cleanup must release a handler whose client never gives
	// up, or Close would wait forever.
	arrived, released, clientDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	t.Run("server", func(t *testing.T) {
		hang := fakemodel.Hang()
		srv := fakemodel.NewOpenAI(t, func(ctx context.Context, req fakemodel.Request) fakemodel.Response {
			close(arrived)
			defer close(released)
			return hang(ctx, req)
		})
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL()+"/chat/completions", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		client := srv.Client()
		go func() {
			defer close(clientDone)
			if res, err := client.Do(req); err == nil {
				_ = res.Body.Close()
			}
		}()
		<-arrived
	})
	<-released
	<-clientDone
}
