package providers_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/steps/providers"
)

func TestPromptHash(t *testing.T) {
	t.Parallel()
	// printf 'sys\n\nhello' | sha256sum
	const want = "16a048ed81492e65b6cb59459cfe8fbeb369e0b54c25ba8e9b5d1c487bcbe75d"
	if got := providers.PromptHash(providers.Request{System: "sys", Prompt: "hello", Model: "ignored", Step: "ignored"}); got != want {
		t.Errorf("PromptHash = %q, want %q", got, want)
	}
}

func TestReplay(t *testing.T) {
	t.Parallel()
	p1 := providers.Request{System: "S", Prompt: "P1"}
	cassette := &providers.Cassette{Version: 1, Interactions: []providers.Interaction{
		{Step: "classify", PromptSHA256: providers.PromptHash(p1), Replies: []providers.Reply{{Text: "c1-a"}, {Text: "c1-b"}}},
		{Step: "classify", Replies: []providers.Reply{{Text: "c-any"}}},
		{Step: "summarise", Model: "m", Replies: []providers.Reply{{Text: "s1", Model: "m-1", StopReason: "end_turn", Usage: providers.Usage{InputTokens: 3, OutputTokens: 1}}}},
		{Step: "flaky", Replies: []providers.Reply{{Text: "", StopReason: "max_tokens"}, {Text: "ok"}}},
		{Step: "pinned", PromptSHA256: providers.PromptHash(p1), Replies: []providers.Reply{{Text: "pinned"}}},
	}}
	tests := []struct {
		name          string
		req           providers.Request
		cancel        bool
		want          providers.Reply
		wantErr       error // matched with errors.Is
		wantRetryable bool
		wantInMessage []string
	}{
		{name: "by step", req: providers.Request{Step: "summarise", Prompt: "anything", Attempt: 1}, want: providers.Reply{Text: "s1", Model: "m-1", StopReason: "end_turn", Usage: providers.Usage{InputTokens: 3, OutputTokens: 1}}},
		{name: "by prompt hash", req: providers.Request{Step: "classify", System: "S", Prompt: "P1", Attempt: 1}, want: providers.Reply{Text: "c1-a"}},
		{name: "other prompt falls through to the unhashed interaction", req: providers.Request{Step: "classify", System: "S", Prompt: "P2", Attempt: 1}, want: providers.Reply{Text: "c-any"}},
		{name: "attempt 2", req: providers.Request{Step: "classify", System: "S", Prompt: "P1", Attempt: 2}, want: providers.Reply{Text: "c1-b"}},
		{name: "attempt past the end gets the last reply", req: providers.Request{Step: "classify", System: "S", Prompt: "P1", Attempt: 9}, want: providers.Reply{Text: "c1-b"}},
		{name: "attempt 0 counts as 1", req: providers.Request{Step: "classify", System: "S", Prompt: "P1"}, want: providers.Reply{Text: "c1-a"}},
		{name: "negative attempt counts as 1", req: providers.Request{Step: "classify", System: "S", Prompt: "P1", Attempt: -3}, want: providers.Reply{Text: "c1-a"}},
		{name: "recorded empty reply is a retryable error", req: providers.Request{Step: "flaky", Attempt: 1}, wantRetryable: true, wantInMessage: []string{"empty reply", "max_tokens"}},
		{name: "retry after empty reply", req: providers.Request{Step: "flaky", Attempt: 2}, want: providers.Reply{Text: "ok"}},
		{
			name:          "no interaction for the step",
			req:           providers.Request{Step: "translate", Prompt: "hola", Attempt: 1},
			wantErr:       providers.ErrNoRecording,
			wantInMessage: []string{`step "translate"`, providers.PromptHash(providers.Request{Prompt: "hola"}), "NewRecorder", "no interaction for this step"},
		},
		{
			name:          "prompt changed since recording",
			req:           providers.Request{Step: "pinned", System: "S", Prompt: "P1 edited", Attempt: 1},
			wantErr:       providers.ErrNoRecording,
			wantInMessage: []string{`step "pinned"`, providers.PromptHash(providers.Request{System: "S", Prompt: "P1 edited"}), "changed since recording"},
		},
		{name: "cancelled context", req: providers.Request{Step: "summarise", Attempt: 1}, cancel: true, wantErr: context.Canceled, wantRetryable: true},
	}
	p := providers.NewReplay(cassette)
	// Changes after NewReplay must not be seen.
	cassette.Interactions[2].Replies[0].Text = "mutated"
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			if tt.cancel {
				cancel()
			}
			got, err := p.Complete(ctx, tt.req)
			if tt.wantErr == nil && !tt.wantRetryable {
				if err != nil {
					t.Fatalf("Complete: %v", err)
				}
				if !reflect.DeepEqual(got, tt.want) {
					t.Errorf("reply = %+v, want %+v", got, tt.want)
				}
				return
			}
			if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("error = %v, want errors.Is %v", err, tt.wantErr)
			}
			perr := assertProviderError(t, err, providers.Replay, tt.wantRetryable)
			for _, s := range tt.wantInMessage {
				if !strings.Contains(perr.Message, s) {
					t.Errorf("Message = %q, want it to contain %q", perr.Message, s)
				}
			}
		})
	}
}

func TestReplayNilCassette(t *testing.T) {
	t.Parallel()
	_, err := providers.NewReplay(nil).Complete(t.Context(), providers.Request{Step: "a"})
	if !errors.Is(err, providers.ErrNoRecording) {
		t.Fatalf("error = %v, want ErrNoRecording", err)
	}
}

func TestParseCassette(t *testing.T) {
	t.Parallel()
	hash := strings.Repeat("ab", 32)
	tests := []struct {
		name    string
		data    string
		wantErr string // substring; empty means valid
	}{
		{name: "valid", data: `{"version": 1, "interactions": [{"step": "a", "prompt_sha256": "` + hash + `", "model": "m", "replies": [{"text": "x", "model": "m", "stop_reason": "end_turn", "usage": {"input_tokens": 1, "output_tokens": 2}}]}]}`},
		{name: "valid without interactions", data: `{"version": 1, "interactions": []}`},
		{name: "uppercase hash", data: `{"version": 1, "interactions": [{"step": "a", "prompt_sha256": "` + strings.ToUpper(hash) + `", "replies": [{"text": "x"}]}]}`},
		{name: "version missing", data: `{"interactions": []}`, wantErr: "version 0, want 1"},
		{name: "version 2", data: `{"version": 2, "interactions": []}`, wantErr: "version 2, want 1"},
		{name: "no step", data: `{"version": 1, "interactions": [{"step": "a", "replies": [{"text": "x"}]}, {"replies": [{"text": "y"}]}]}`, wantErr: "interaction 1: no step"},
		{name: "no replies", data: `{"version": 1, "interactions": [{"step": "a", "replies": []}]}`, wantErr: `interaction 0 (step "a"): no replies`},
		{name: "replies missing", data: `{"version": 1, "interactions": [{"step": "a"}]}`, wantErr: `interaction 0 (step "a"): no replies`},
		{name: "short hash", data: `{"version": 1, "interactions": [{"step": "a", "prompt_sha256": "abc", "replies": [{"text": "x"}]}]}`, wantErr: `interaction 0 (step "a"): prompt_sha256 "abc" is not 64 hex digits`},
		{name: "hash not hex", data: `{"version": 1, "interactions": [{"step": "a", "prompt_sha256": "` + strings.Repeat("zz", 32) + `", "replies": [{"text": "x"}]}]}`, wantErr: "not 64 hex digits"},
		{name: "unknown field", data: `{"version": 1, "interactions": [{"step": "a", "prompt_sha": "x", "replies": [{"text": "x"}]}]}`, wantErr: `unknown field "prompt_sha"`},
		{name: "trailing data", data: `{"version": 1, "interactions": []} {}`, wantErr: "trailing data"},
		{name: "not json", data: `version: 1`, wantErr: "decode"},
		{name: "null", data: `null`, wantErr: "version 0"},
		{name: "empty", data: ``, wantErr: "decode"},
		{name: "wrong type", data: `{"version": "1"}`, wantErr: "decode"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c, err := providers.ParseCassette([]byte(tt.data))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ParseCassette: %v", err)
				}
				for _, in := range c.Interactions {
					if in.PromptSHA256 != strings.ToLower(in.PromptSHA256) {
						t.Errorf("hash %q not lowercased", in.PromptSHA256)
					}
				}
				return
			}
			if !errors.Is(err, providers.ErrInvalidCassette) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error = %v, want ErrInvalidCassette containing %q", err, tt.wantErr)
			}
		})
	}
}

func FuzzParseCassette(f *testing.F) {
	f.Add([]byte(`{"version": 1, "interactions": [{"step": "a", "replies": [{"text": "x"}]}]}`))
	f.Add([]byte(`{"version": 1, "interactions": [{"step": "a", "prompt_sha256": "` + strings.Repeat("0f", 32) + `", "replies": [{"text": ""}, {"text": "y", "usage": {"input_tokens": -1}}]}]}`))
	f.Add([]byte(`{"version": 1}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := providers.ParseCassette(data)
		if err != nil {
			if !errors.Is(err, providers.ErrInvalidCassette) {
				t.Fatalf("error %v does not wrap ErrInvalidCassette", err)
			}
			return
		}
		// What parses must survive a round trip and answer without panicking.
		out, err := json.Marshal(c)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		if _, err := providers.ParseCassette(out); err != nil {
			t.Fatalf("re-parse of %s: %v", out, err)
		}
		p := providers.NewReplay(c)
		for _, in := range c.Interactions {
			_, _ = p.Complete(t.Context(), providers.Request{Step: in.Step, Attempt: 2})
		}
	})
}

func ExampleNewReplay() {
	c, err := providers.ParseCassette([]byte(`{
	  "version": 1,
	  "interactions": [
	    {"step": "classify", "replies": [{"text": ""}, {"text": "positive"}]}
	  ]
	}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	p := providers.NewReplay(c)
	for attempt := 1; attempt <= 2; attempt++ {
		reply, err := p.Complete(context.Background(), providers.Request{Step: "classify", Prompt: "I love it", Attempt: attempt})
		var perr *providers.Error
		if errors.As(err, &perr) {
			fmt.Printf("attempt %d: retryable=%v: %v\n", attempt, perr.Retryable, err)
			continue
		}
		fmt.Printf("attempt %d: %s\n", attempt, reply.Text)
	}
	// Output:
	// attempt 1: retryable=true: replay: empty reply: no text content (stop reason "")
	// attempt 2: positive
}

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}
