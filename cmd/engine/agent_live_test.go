package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
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
	"github.com/waymark-dev/waymark/kv"
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

// TestAgentCrashAtTurn17 is the closing measurement of the agent loop: a
// 20-turn agent job (one tool call per turn) killed at its 17th turn, then
// run again. No model call and no tool call that had finished is made
// again; the test logs the tokens the resume saved against a restart from
// the beginning.
func TestAgentCrashAtTurn17(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, failpoint string
		again           int // model calls of turn 17 made again
	}{
		// Turn 17's reply is published, its message not acknowledged.
		{"after turn 17's reply", "worker.after_result_publish=crash/agent@33", 0},
		// Turn 17's message came, the model not yet asked.
		{"before turn 17's call", "worker.after_receive=crash/agent@33", 0},
		// Killed (SIGKILL from the test) while turn 17's streamed call is
		// open: that turn, and only it, is asked again.
		{"while turn 17 streams", "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			modelCalls, toolCalls := map[int]int{}, map[string]int{}
			streaming := make(chan struct{})
			var hung atomic.Bool
			tools := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				toolCalls[r.URL.Query().Get("city")]++
				mu.Unlock()
				_, _ = w.Write([]byte(`{"celsius": 20}`))
			}))
			t.Cleanup(tools.Close)
			srv := fakemodel.NewAnthropic(t, func(ctx context.Context, req fakemodel.Request) fakemodel.Response {
				turn := 1
				for _, m := range req.Messages {
					if m.Role == "assistant" {
						turn++
					}
				}
				mu.Lock()
				modelCalls[turn]++
				mu.Unlock()
				if tc.failpoint == "" && turn == 17 && hung.CompareAndSwap(false, true) {
					if !req.Stream {
						t.Errorf("turn 17 was not asked to stream")
					}
					close(streaming)
					<-ctx.Done() // until the killed worker's connection goes
					return fakemodel.Response{Status: http.StatusServiceUnavailable, Text: "gone"}
				}
				resp := fakemodel.Response{InputTokens: int64(1000 * turn), OutputTokens: 50}
				if turn < 20 {
					resp.ToolCalls = []fakemodel.ToolCall{{ID: fmt.Sprintf("call_%d", turn), Name: "weather", Input: json.RawMessage(fmt.Sprintf(`{"city":"c%d"}`, turn))}}
				} else {
					resp.Text = "done"
				}
				return resp
			})
			dir := t.TempDir()
			wf := filepath.Join(dir, "agent.yaml")
			y := strings.Replace(agentLiveWorkflow("anthropic", srv.URL(), tools.URL), "max_turns: 6", "max_turns: 25", 1)
			in := filepath.Join(dir, "input.json")
			if err := os.WriteFile(wf, []byte(y), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(in, []byte(`{}`), 0o644); err != nil {
				t.Fatal(err)
			}
			bin := testsupport.Binary(t, "engine")
			env := []string{"WAYMARK_MODEL_MODE=live", "WAYMARK_SECRET_MODEL_KEY=" + modelCanary, "WAYMARK_SECRET_TOOL_KEY=" + toolCanary}
			args := []string{"run", wf, "--input", in, "--job-id", "long-1", "--data-dir", filepath.Join(dir, "data"), "--sync", "always", "--output", "json"}
			if tc.failpoint == "" {
				first := spawn(t, env, bin, args...)
				select {
				case <-streaming:
				case <-time.After(60 * time.Second):
					t.Fatal("turn 17 never came")
				}
				_ = first.cmd.Process.Kill()
				<-first.done
			} else {
				first := spawn(t, append(env, "WAYMARK_FAILPOINTS="+tc.failpoint), bin, args...)
				first.waitKilled(t, 60*time.Second)
			}
			mu.Lock()
			before := len(modelCalls)
			firstRun := maps.Clone(modelCalls)
			mu.Unlock()
			second := spawn(t, env, bin, args...)
			select {
			case <-second.done:
			case <-time.After(60 * time.Second):
				t.Fatal("second run did not finish")
			}
			if second.err != nil {
				t.Fatalf("second run: %v\n%s", second.err, lastLines(second.errOut.String(), 30))
			}
			if os.Getenv("DEBUG_AGENT") != "" {
				t.Logf("second run log:\n%s", second.errOut.String())
			}
			v := decodeView(t, second.out.String())
			var st struct {
				Out schemas.AgentOutput `json:"out"`
			}
			_ = json.Unmarshal(v.State, &st)
			if v.Status != schemas.JobCompleted || st.Out.Turns != 20 || st.Out.ToolCalls != 19 || v.ResumeCount < 1 { // a takeover and a redelivery may count apart
				t.Fatalf("status %s resume_count %d output %+v", v.Status, v.ResumeCount, st.Out)
			}
			mu.Lock()
			defer mu.Unlock()
			again := 0
			for turn := 1; turn <= 20; turn++ {
				want := 1
				if turn == 17 {
					want += tc.again
				}
				if modelCalls[turn] != want {
					t.Errorf("turn %d: %d model calls, want %d", turn, modelCalls[turn], want)
				}
				again += modelCalls[turn] - 1
			}
			for city, n := range toolCalls {
				if n != 1 {
					t.Errorf("tool call %s made %d times", city, n)
				}
			}
			if len(toolCalls) != 19 {
				t.Errorf("%d tool calls, want 19", len(toolCalls))
			}
			// What a restart from turn 1 would have asked again: every turn
			// the first run asked, less those the resume asked again.
			var saved int64
			for turn := range firstRun {
				if modelCalls[turn] == 1 {
					saved += int64(1000*turn) + 50
				}
			}
			t.Logf("crash %s: turns asked before the crash %d; model calls made again %d; tool calls made again 0; tokens a restart from turn 1 would have spent again: %d",
				tc.name, before, again, saved)
		})
	}
}

// TestAgentRateLimitSharedByTwoWorkers: two worker processes serve two
// agent jobs; the provider answers the first job's first call 429 with
// Retry-After 2s, which its worker records in JetStream (waymark_limits);
// the second job, started once the limit is recorded, makes no call before
// the 2s are over, whichever worker takes it. No attempt is used up (the
// step allows one) and both jobs complete.
func TestAgentRateLimitSharedByTwoWorkers(t *testing.T) {
	t.Parallel()
	tools := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(`{"celsius": 20}`))
	}))
	t.Cleanup(tools.Close)
	var mu sync.Mutex
	var limited time.Time // when the 429 was answered
	var early []time.Duration
	calls := 0
	srv := fakemodel.NewAnthropic(t, func(ctx context.Context, req fakemodel.Request) fakemodel.Response {
		mu.Lock()
		defer mu.Unlock()
		calls++
		if limited.IsZero() {
			limited = time.Now()
			return fakemodel.Response{Status: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"2"}}, Text: "slow down"}
		}
		if d := time.Since(limited); d < 1900*time.Millisecond {
			early = append(early, d)
		}
		for _, m := range req.Messages {
			if m.Role == "assistant" {
				return fakemodel.Response{Text: "done", InputTokens: 10, OutputTokens: 2}
			}
		}
		return fakemodel.Response{InputTokens: 10, OutputTokens: 2, ToolCalls: []fakemodel.ToolCall{{ID: "c1", Name: "weather", Input: json.RawMessage(`{"city":"Oslo"}`)}}}
	})
	dir := t.TempDir()
	wf := filepath.Join(dir, "agent.yaml")
	y := strings.Replace(agentLiveWorkflow("anthropic", srv.URL(), tools.URL), "retry: {max_attempts: 2, backoff: {initial: 10ms}}", "retry: {max_attempts: 1}", 1)
	if err := os.WriteFile(wf, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	nsrv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	nats := "--nats-url=" + nsrv.URL()
	bin := testsupport.Binary(t, "engine")
	env := []string{"WAYMARK_MODEL_MODE=live", "WAYMARK_SECRET_MODEL_KEY=" + modelCanary, "WAYMARK_SECRET_TOOL_KEY=" + toolCanary}
	spawn(t, env, bin, "serve", nats, "--http=", "--workers=0")
	for range 2 {
		spawn(t, env, testsupport.Binary(t, "worker"), nats, "--concurrency", "1")
	}
	store := nsrv.Store(t, kv.Config{})
	sum := sha256.Sum256([]byte(srv.URL() + "\x00" + modelCanary))
	limit := "anthropic." + hex.EncodeToString(sum[:8]) // steps.limitedProvider's name
	for i, id := range []string{"rl-1", "rl-2"} {
		p := spawn(t, nil, bin, "start", wf, nats, "--job-id", id)
		<-p.done
		if p.err != nil {
			t.Fatalf("start %s: %v\n%s", id, p.err, p.errOut.String())
		}
		if i == 0 {
			testsupport.Eventually(t, 30*time.Second, func() bool {
				until, err := store.Limits.Until(context.Background(), limit)
				return err == nil && until.After(time.Now())
			}, "the 429's Retry-After was never recorded under %s", limit)
		}
	}
	for _, id := range []string{"rl-1", "rl-2"} {
		var out string
		testsupport.Eventually(t, 60*time.Second, func() bool {
			p := spawn(t, nil, bin, "status", id, nats, "--output", "json")
			<-p.done
			out = p.out.String()
			return strings.Contains(out, `"status": "completed"`) || strings.Contains(out, `"status": "failed"`)
		}, "job %s did not end", id)
		v := decodeView(t, out)
		if v.Status != schemas.JobCompleted {
			t.Fatalf("job %s: %s %+v", id, v.Status, v.Error)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(early) > 0 {
		t.Errorf("%d calls reached the provider %v after its 429 asked every caller to wait 2s", len(early), early)
	}
	if calls != 5 {
		t.Errorf("provider calls %d, want 5 (the 429, then two turns for each job)", calls)
	}
}
