// Package providers calls language models for the model step kind: the
// Anthropic Messages API and OpenAI-compatible chat completions (OpenAI,
// Ollama, vLLM, llama.cpp) through the official SDKs, and a replay
// provider that answers from a cassette of recorded replies, for offline
// runs and tests. API keys come from the caller (read from the
// environment by the worker) and are never stored.
package providers

import (
	"context"
	"encoding/json"
	"net/http"
)

// Provider names, as a model step's with.provider spells them.
const (
	Anthropic = "anthropic"
	OpenAI    = "openai"
	Replay    = "replay"
)

// Request is one model call: a system prompt and either one user turn
// (Prompt) or a conversation (Messages), optionally with tools the model
// may call.
//
// Exactly one of Prompt and Messages is set; a live provider fails a
// request with both, or with neither, with a non-retryable *Error before
// anything is sent. In a conversation every block must be valid for its
// type (see Block), and every tool_use block of an assistant message must
// be answered by a tool_result block with the same ToolUseID in the user
// message right after it, and only there, as both APIs require
// (https://docs.anthropic.com/en/docs/build-with-claude/tool-use,
// https://platform.openai.com/docs/guides/function-calling); a live
// provider fails a conversation that breaks these rules the same way,
// naming the message and block.
type Request struct {
	Model       string   // provider's model name; required for live providers
	System      string   // system prompt; may be empty
	Prompt      string   // the user turn of a single-prompt request; empty when Messages is set
	MaxTokens   int      // reply cap in tokens; 0 means 1024
	Temperature *float64 // nil leaves the provider's default

	// Messages is the conversation so far, oldest first, ending with the
	// user turn to answer; empty when Prompt is set. The caller appends
	// Reply.Message and then a user message of tool results to continue.
	Messages []Message
	// Tools are the tools the model may call, in the order declared; empty
	// means none. Names must be unique. Tools may accompany a Prompt too.
	Tools []Tool

	// Step, Attempt and Turn identify the call for replay: a cassette
	// answers by step id, by turn (1-based index of the model call within
	// one conversation; 0 for a single-prompt request) when the
	// interaction names one, and by attempt (1-based, within the step's
	// current run) when it recorded several replies.
	Step    string
	Attempt int
	Turn    int

	// OnText, when set, asks for the reply as it is made: the provider
	// streams it (Anthropic's and OpenAI's streaming APIs; the replay
	// provider in pieces of its recorded text) and calls OnText with each
	// piece of text, in order, from the goroutine that called Complete,
	// before Complete returns. The Reply is what it would be without. The
	// pieces of a call that then fails are not taken back.
	OnText func(text string)
}

// Message roles.
const (
	RoleUser      = "user"
	RoleAssistant = "assistant"
)

// Block types.
const (
	BlockText       = "text"
	BlockToolUse    = "tool_use"
	BlockToolResult = "tool_result"
)

// Message is one turn of a conversation, in the shape of the Anthropic
// Messages API's message param
// (https://docs.anthropic.com/en/api/messages): a role and its content
// blocks. The JSON form is the one PromptHash hashes and cassettes store.
type Message struct {
	Role    string  `json:"role"`    // RoleUser or RoleAssistant
	Content []Block `json:"content"` // at least one block
}

// Block is one content block of a Message. Which fields apply depends on
// Type:
//
//   - BlockText: Text, not empty. Either role.
//   - BlockToolUse: a tool call the model made, copied from
//     Reply.ToolCalls: ToolUseID (the call's id), Name and Input (a JSON
//     object; empty means {}). Assistant messages only.
//   - BlockToolResult: the answer to one tool call: ToolUseID names the
//     call, Content is the result as text (may be empty) and IsError says
//     the tool failed. User messages only, and only in the user message
//     right after the assistant message that made the call.
//
// Fields that do not apply to the type must be zero.
type Block struct {
	Type      string          `json:"type"`
	Text      string          `json:"text,omitempty"`
	ToolUseID string          `json:"tool_use_id,omitempty"`
	Name      string          `json:"name,omitempty"`
	Input     json.RawMessage `json:"input,omitempty"`
	Content   string          `json:"content,omitempty"`
	IsError   bool            `json:"is_error,omitempty"`
}

// TextBlock returns a BlockText block.
func TextBlock(text string) Block { return Block{Type: BlockText, Text: text} }

// ToolResultBlock returns a BlockToolResult block answering the tool call
// whose id is toolUseID.
func ToolResultBlock(toolUseID, content string, isError bool) Block {
	return Block{Type: BlockToolResult, ToolUseID: toolUseID, Content: content, IsError: isError}
}

// Tool is a tool the model may call: a client tool of the Messages API
// (name, description, input_schema) or a function tool of Chat
// Completions (name, description, parameters).
type Tool struct {
	// Name is how the model calls the tool; required, unique within a
	// request. The APIs allow [a-zA-Z0-9_-]{1,64}.
	Name string `json:"name"`
	// Description tells the model what the tool does and when to use it;
	// may be empty.
	Description string `json:"description,omitempty"`
	// InputSchema is the JSON Schema (an object) of the tool's input;
	// empty means a tool without parameters.
	InputSchema json.RawMessage `json:"input_schema,omitempty"`
}

// ToolCall is one tool call in a reply.
type ToolCall struct {
	// ID identifies the call; a BlockToolResult answers it by this id.
	ID string `json:"id"`
	// Name is the tool's name, one of Request.Tools.
	Name string `json:"name"`
	// Input is the call's arguments as JSON, normally an object. The
	// model is not bound by the tool's schema: validate Input before use.
	// From an OpenAI-compatible server whose arguments are not valid JSON,
	// Input is those arguments as a JSON string value (see NewOpenAI).
	Input json.RawMessage `json:"input"`
}

// Usage counts tokens as the provider reports them.
//
// InputTokens is Anthropic's input_tokens, which excludes the tokens read
// from or written to the prompt cache, or OpenAI's prompt_tokens, which
// includes the cached ones. CacheReadTokens is Anthropic's
// cache_read_input_tokens or OpenAI's
// prompt_tokens_details.cached_tokens; CacheWriteTokens is Anthropic's
// cache_creation_input_tokens (or prompt_tokens_details.cache_write_tokens
// where an OpenAI-compatible server reports it). Both are 0 when the
// provider reports no caching. See
// https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching and
// https://platform.openai.com/docs/guides/prompt-caching.
type Usage struct {
	InputTokens      int64 `json:"input_tokens"`
	OutputTokens     int64 `json:"output_tokens"`
	CacheReadTokens  int64 `json:"cache_read_input_tokens,omitempty"`
	CacheWriteTokens int64 `json:"cache_creation_input_tokens,omitempty"`
}

// Reply is the model's answer: the concatenated text of its reply and the
// tools it asked to call, in the order it gave them (several calls in one
// reply are parallel tool calls, each to be answered). A reply has text,
// tool calls or both; a live reply with neither is the retryable
// empty-reply *Error instead.
type Reply struct {
	Text       string     `json:"text"`
	ToolCalls  []ToolCall `json:"tool_calls,omitempty"`
	Model      string     `json:"model,omitempty"`
	StopReason string     `json:"stop_reason,omitempty"` // "tool_use" (Anthropic) or "tool_calls" (OpenAI) when the model waits for tool results
	Usage      Usage      `json:"usage"`
}

// Message returns the reply as the assistant message to append to a
// conversation: a text block when Text is not empty, then one tool_use
// block per tool call, in order.
func (r Reply) Message() Message {
	m := Message{Role: RoleAssistant}
	if r.Text != "" {
		m.Content = append(m.Content, TextBlock(r.Text))
	}
	for _, c := range r.ToolCalls {
		m.Content = append(m.Content, Block{Type: BlockToolUse, ToolUseID: c.ID, Name: c.Name, Input: c.Input})
	}
	return m
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
