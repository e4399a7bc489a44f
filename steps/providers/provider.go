// Package providers calls language models for the model step kind: the
// Anthropic Messages API and OpenAI-compatible chat completions (OpenAI,
// Ollama, vLLM, llama.cpp) through the official SDKs, and a replay
// provider that answers from a cassette of recorded replies, for offline
// runs and tests. API keys come from the caller (read from the
// environment by the worker) and are never stored.
package providers

import (
	"context"
	"net/http"
)

// Provider names, as a model step's with.provider spells them.
const (
	Anthropic = "anthropic"
	OpenAI    = "openai"
	Replay    = "replay"
)

// Request is one model call: a system prompt and one user turn.
type Request struct {
	Model       string   // provider's model name; required for live providers
	System      string   // system prompt; may be empty
	Prompt      string   // the user turn; required
	MaxTokens   int      // reply cap in tokens; 0 means 1024
	Temperature *float64 // nil leaves the provider's default

	// Step and Attempt identify the call for replay: a cassette answers by
	// step id, and by attempt (1-based, within the step's current run)
	// when it recorded several replies.
	Step    string
	Attempt int
}

// Usage counts tokens.
type Usage struct {
	InputTokens  int64 `json:"input_tokens"`
	OutputTokens int64 `json:"output_tokens"`
}

// Reply is the model's answer: the concatenated text of its reply.
type Reply struct {
	Text       string `json:"text"`
	Model      string `json:"model,omitempty"`
	StopReason string `json:"stop_reason,omitempty"`
	Usage      Usage  `json:"usage"`
}

// Provider performs model calls. Implementations are safe for concurrent
// use and do not retry: the engine owns retries.
type Provider interface {
	Complete(ctx context.Context, req Request) (Reply, error)
}

// Config configures a live provider.
type Config struct {
	APIKey     string       // required by Anthropic and OpenAI; local servers accept any
	BaseURL    string       // empty means the provider's public API
	HTTPClient *http.Client // nil means the SDK's default
}
