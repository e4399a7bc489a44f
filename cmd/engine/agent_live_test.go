package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/internal/testsupport/fakemodel"
	"github.com/waymark-dev/waymark/schemas"
)

const (
	modelCanary = "sk-canary-model-0d7f3a"
	toolCanary  = "tool-canary-9b41c2"
)

// agentLiveWorkflow is an agent calling a provider at modelURL through its
// SDK, with a lookup tool at toolURL that sends a secret.
func agentLiveWorkflow(provider, modelURL, toolURL string) string {
	return fmt.Sprintf(`
name: live-agent
version: 1
steps:
  - id: agent
    kind: agent
    save_as: out
    retry: {max_attempts: 2, backoff: {initial: 10ms}}
    with:
      provider: %s
      model: test-model
      base_url: %q
      api_key_secret: MODEL_KEY
      system: "Answer with the weather."
      prompt: "Weather in Paris and Rome?"
    limits: {max_turns: 6}
    tools:
      - name: weather
        description: Current weather of a city.
        input_schema: {type: object, required: [city], properties: {city: {type: string}}}
        kind: http
        effect: pure
        retry: {max_attempts: 1}
        with:
          method: GET
          url: '%s/weather?city={{urlquery .args.city}}'
          headers: {Authorization: 'Bearer {{secret "TOOL_KEY"}}'}
`, provider, modelURL, toolURL)
}

// TestAgentThroughTheProviderSDKs runs an agent job with engine run
// against in-process servers that speak the Anthropic and OpenAI wire
// formats, through the official SDKs: two tool calls in one turn (one with
// arguments against the tool's schema, answered with an error and never
// run), a 429 with Retry-After (the turn waits, without using one of its
// two attempts), a 500 (retried), a tool whose error body quotes its
// secret. Asserted: turns, tool calls, provider calls and token totals;
// every tool_use got one tool_result; no secret reached the model, the
// job's record or the log.
func TestAgentThroughTheProviderSDKs(t *testing.T) {
	t.Parallel()
	for _, provider := range []string{"anthropic", "openai"} {
		t.Run(provider, func(t *testing.T) {
			t.Parallel()
			var toolCalls atomic.Int64
			tools := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				toolCalls.Add(1)
				city := r.URL.Query().Get("city")
				if city == "Oslo" {
					// An error body that quotes the credential it was sent.
					http.Error(w, "upstream refused "+r.Header.Get("Authorization"), http.StatusForbidden)
					return
				}
				_ = json.NewEncoder(w).Encode(map[string]any{"city": city, "celsius": 21})
			}))
			t.Cleanup(tools.Close)
			var mu sync.Mutex
			turns := map[int]int{} // requests by turn
			handler := func(ctx context.Context, req fakemodel.Request) fakemodel.Response {
				turn := 1
				for _, m := range req.Messages {
					if m.Role == "assistant" {
						turn++
					}
				}
				mu.Lock()
				turns[turn]++
				n := turns[turn]
				mu.Unlock()
				switch {
				case turn == 1:
					return fakemodel.Response{Text: "Looking both up.", InputTokens: 100, OutputTokens: 20, CacheWriteTokens: 50, ToolCalls: []fakemodel.ToolCall{
						{ID: "call_paris", Name: "weather", Input: json.RawMessage(`{"city":"Paris"}`)},
						{ID: "call_bad", Name: "weather", Input: json.RawMessage(`{"city":5}`)},
					}}
				case turn == 2 && n == 1:
					return fakemodel.Response{Status: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"1"}}, Text: "slow down"}
				case turn == 2:
					return fakemodel.Response{InputTokens: 200, OutputTokens: 10, CacheReadTokens: 50, ToolCalls: []fakemodel.ToolCall{
						{ID: "call_rome", Name: "weather", Input: json.RawMessage(`{"city":"Rome"}`)},
						{ID: "call_oslo", Name: "weather", Input: json.RawMessage(`{"city":"Oslo"}`)},
					}}
				case turn == 3 && n == 1:
					return fakemodel.Response{Status: http.StatusInternalServerError, Text: "overloaded; your key " + req.APIKey() + " is fine"}
				}
				return fakemodel.Response{Text: "Paris 21C, Rome 21C.", InputTokens: 300, OutputTokens: 8, CacheReadTokens: 50}
			}
			var srv *fakemodel.Server
			if provider == "anthropic" {
				srv = fakemodel.NewAnthropic(t, handler)
			} else {
				srv = fakemodel.NewOpenAI(t, handler)
			}
			dir := t.TempDir()
			wf := filepath.Join(dir, "agent.yaml")
			if err := os.WriteFile(wf, []byte(agentLiveWorkflow(provider, srv.URL(), tools.URL)), 0o644); err != nil {
				t.Fatal(err)
			}
			in := filepath.Join(dir, "input.json")
			if err := os.WriteFile(in, []byte(`{}`), 0o644); err != nil {
				t.Fatal(err)
			}
			bin := testsupport.Binary(t, "engine")
			p := spawn(t, []string{"WAYMARK_MODEL_MODE=live", "WAYMARK_SECRET_MODEL_KEY=" + modelCanary, "WAYMARK_SECRET_TOOL_KEY=" + toolCanary},
				bin, "run", wf, "--input", in, "--job-id", "live-1", "--data-dir", filepath.Join(dir, "data"), "--output", "json")
			select {
			case <-p.done:
			case <-time.After(60 * time.Second):
				t.Fatal("engine run did not finish")
			}
			if p.err != nil {
				t.Fatalf("engine run: %v\n%s", p.err, lastLines(p.errOut.String(), 30))
			}
			v := decodeView(t, p.out.String())
			var st struct {
				Out schemas.AgentOutput `json:"out"`
			}
			if err := json.Unmarshal(v.State, &st); err != nil {
				t.Fatal(err)
			}
			out := st.Out
			if v.Status != schemas.JobCompleted || out.Turns != 3 || out.ToolCalls != 4 || out.InvalidCalls != 1 || out.ToolErrors != 1 || out.Text != "Paris 21C, Rome 21C." {
				t.Fatalf("status %s output %+v", v.Status, out)
			}
			u := out.Usage["test-model"]
			wantIn, wantCacheRead := int64(600), int64(100)
			if u.Input != wantIn || u.Output != 38 || u.CacheRead != wantCacheRead {
				t.Errorf("usage %+v, want %d in, 38 out, %d cache read", u, wantIn, wantCacheRead)
			}
			reqs := srv.Requests()
			if len(reqs) != 5 {
				t.Errorf("provider calls %d, want 5 (3 turns, a 429 and a 500)", len(reqs))
			}
			if n := toolCalls.Load(); n != 3 {
				t.Errorf("tool server calls %d, want 3 (Paris, Rome, Oslo; the malformed call never runs)", n)
			}
			// Turn 2 answered both calls of turn 1, the bad one as an error.
			var results []fakemodel.Block
			for _, m := range reqs[1].Messages {
				for _, b := range m.Blocks {
					if b.Type == "tool_result" {
						results = append(results, b)
					}
				}
			}
			if len(results) != 2 || results[0].ToolUseID != "call_paris" || !strings.Contains(results[0].Content, `"celsius":21`) ||
				results[1].ToolUseID != "call_bad" || !strings.Contains(results[1].Content, "input_schema") {
				t.Errorf("tool results sent at turn 2: %+v", results)
			}
			for i, r := range reqs {
				if strings.Contains(string(r.Body), toolCanary) {
					t.Errorf("request %d to the model holds the tool's secret:\n%s", i, r.Body)
				}
			}
			// The 500's body quoted the model key, the tool's 403 the tool's:
			// both were redacted before anything recorded them.
			for what, text := range map[string]string{"job record": p.out.String(), "log": p.errOut.String()} {
				for _, secret := range []string{modelCanary, toolCanary} {
					if strings.Contains(text, secret) {
						t.Errorf("the %s holds a secret (%s)", what, secret[:12])
					}
				}
			}
			if !strings.Contains(p.errOut.String(), "your key [redacted] is fine") {
				t.Errorf("the log does not show the provider's error redacted:\n%s", lastLines(p.errOut.String(), 20))
			}
		})
	}
}
