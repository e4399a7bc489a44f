package providers

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	anthropicparam "github.com/anthropics/anthropic-sdk-go/v2/packages/param"
)

type anthropicProvider struct {
	client anthropic.Client
	apiKey string
	bad    *Error // from checkConfig; every call returns it
}

// NewAnthropic returns a Provider that calls the Anthropic Messages API
// (POST /v1/messages, https://docs.anthropic.com/en/api/messages) through
// the official Go SDK, without streaming and without retries.
//
// The request is one user turn (Prompt) or the conversation (Messages,
// as text, tool_use and tool_result blocks), with System as the system
// prompt when it is not empty and Tools as client tools (name,
// description, input_schema sent as given; no schema means an object
// without properties). A conversation, or a request with tools, marks its
// stable prefix for prompt caching
// (https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching):
// cache_control {"type": "ephemeral"} (5 minutes) on the system block, on
// the last tool definition and, in a conversation of more than one message,
// on the last block of its last message, so that the next turn reads the
// turns before it from the cache; a single prompt without tools is sent
// without, as a one-off call gains nothing from a cache write. The reply's
// text is the concatenation of its text blocks, its tool_use blocks are
// Reply.ToolCalls in order, and the usage carries
// cache_read_input_tokens and cache_creation_input_tokens. A reply with
// neither text nor tool calls is the retryable empty-reply *Error.
// Request.Temperature is not sent: API version 2026-10-21, which this SDK
// speaks, rejects every sampling parameter with 400.
//
// cfg is the only source of settings: the SDK's ANTHROPIC_* environment
// variables are not read. BaseURL is the API root, without /v1 (the SDK
// appends v1/messages); empty means https://api.anthropic.com and then
// requires APIKey, which this SDK sends as "Authorization: Bearer". A bad
// BaseURL or a missing key makes every call fail with a non-retryable
// *Error. Failures are returned as *Error, classified as its doc says.
// Safe for concurrent use.
func NewAnthropic(cfg Config) Provider {
	p := &anthropicProvider{apiKey: cfg.APIKey, bad: checkConfig(Anthropic, cfg)}
	if p.bad != nil {
		return p
	}
	opts := []option.RequestOption{option.WithoutEnvironmentDefaults(), option.WithMaxRetries(0)}
	if cfg.APIKey != "" {
		opts = append(opts, option.WithAPIKey(cfg.APIKey))
	}
	if cfg.BaseURL != "" {
		opts = append(opts, option.WithBaseURL(cfg.BaseURL))
	}
	if cfg.HTTPClient != nil {
		opts = append(opts, option.WithHTTPClient(cfg.HTTPClient))
	}
	p.client = anthropic.NewClient(opts...)
	return p
}

func (p *anthropicProvider) Complete(ctx context.Context, req Request) (Reply, error) {
	if p.bad != nil {
		return Reply{}, p.bad
	}
	maxTokens, err := checkRequest(Anthropic, req)
	if err != nil {
		return Reply{}, err
	}
	// The SDK refuses, before sending, a non-streaming call it expects to
	// outlast 10 minutes; say so as a configuration error, not a network one.
	if _, err := anthropic.CalculateNonStreamingTimeout(int(maxTokens), req.Model, nil); err != nil {
		return Reply{}, nonRetryable(Anthropic, err, "step %q: max tokens %d for model %q needs streaming, which this provider does not do: %v", req.Step, maxTokens, req.Model, err)
	}

	params := anthropic.MessageNewParams{
		Model:     req.Model,
		MaxTokens: maxTokens,
		Messages:  anthropicMessages(req),
		Tools:     anthropicTools(req.Tools),
	}
	if req.System != "" {
		params.System = []anthropic.TextBlockParam{{Text: req.System}}
		if conversational(req) {
			params.System[0].CacheControl = anthropic.NewCacheControlEphemeralParam()
		}
	}
	var res *http.Response
	msg, err := p.client.Messages.New(ctx, params, option.WithResponseInto(&res))
	if err != nil {
		return Reply{}, p.classify(ctx, err, res)
	}

	var text strings.Builder
	var calls []ToolCall
	for _, block := range msg.Content {
		switch block.Type {
		case "text":
			text.WriteString(block.Text)
		case "tool_use":
			calls = append(calls, ToolCall{ID: block.ID, Name: block.Name, Input: toolInput(slices.Clone(block.Input))})
		}
	}
	if text.Len() == 0 && len(calls) == 0 {
		return Reply{}, emptyReply(Anthropic, string(msg.StopReason), "")
	}
	return Reply{
		Text:       text.String(),
		ToolCalls:  calls,
		Model:      msg.Model,
		StopReason: string(msg.StopReason),
		Usage: Usage{
			InputTokens:      msg.Usage.InputTokens,
			OutputTokens:     msg.Usage.OutputTokens,
			CacheReadTokens:  msg.Usage.CacheReadInputTokens,
			CacheWriteTokens: msg.Usage.CacheCreationInputTokens,
		},
	}, nil
}

// conversational reports whether req is a conversation or declares
// tools: the calls an agent loop repeats with a growing conversation over
// the same system prompt and tools, which is what prompt caching pays for.
func conversational(req Request) bool {
	return len(req.Messages) > 0 || len(req.Tools) > 0
}

// anthropicMessages maps req's prompt or conversation to message params.
// checkRequest has validated the blocks.
func anthropicMessages(req Request) []anthropic.MessageParam {
	if len(req.Messages) == 0 {
		return []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(req.Prompt))}
	}
	out := make([]anthropic.MessageParam, 0, len(req.Messages))
	for _, m := range req.Messages {
		blocks := make([]anthropic.ContentBlockParamUnion, 0, len(m.Content))
		for _, b := range m.Content {
			switch b.Type {
			case BlockText:
				blocks = append(blocks, anthropic.NewTextBlock(b.Text))
			case BlockToolUse:
				blocks = append(blocks, anthropic.ContentBlockParamUnion{OfToolUse: &anthropic.ToolUseBlockParam{
					ID: b.ToolUseID, Name: b.Name, Input: toolInput(b.Input),
				}})
			case BlockToolResult:
				result := &anthropic.ToolResultBlockParam{ToolUseID: b.ToolUseID}
				if b.Content != "" {
					// The API refuses empty text blocks; an empty result has no content.
					result.Content = []anthropic.ToolResultBlockParamContentUnion{{OfText: &anthropic.TextBlockParam{Text: b.Content}}}
				}
				if b.IsError {
					result.IsError = anthropic.Bool(true)
				}
				blocks = append(blocks, anthropic.ContentBlockParamUnion{OfToolResult: result})
			}
		}
		if len(out) == len(req.Messages)-1 && len(req.Messages) > 1 && len(blocks) > 0 {
			// The conversation so far is the next turn's prefix: cache it.
			last := &blocks[len(blocks)-1]
			switch {
			case last.OfText != nil:
				last.OfText.CacheControl = anthropic.NewCacheControlEphemeralParam()
			case last.OfToolResult != nil:
				last.OfToolResult.CacheControl = anthropic.NewCacheControlEphemeralParam()
			}
		}
		if m.Role == RoleAssistant {
			out = append(out, anthropic.NewAssistantMessage(blocks...))
		} else {
			out = append(out, anthropic.NewUserMessage(blocks...))
		}
	}
	return out
}

// anthropicTools maps tools to client tool params, with a cache
// breakpoint on the last one so the tool definitions are cached.
func anthropicTools(tools []Tool) []anthropic.ToolUnionParam {
	if len(tools) == 0 {
		return nil
	}
	out := make([]anthropic.ToolUnionParam, len(tools))
	for i, tool := range tools {
		param := &anthropic.ToolParam{Name: tool.Name}
		if len(tool.InputSchema) > 0 {
			// Sent as given: the SDK's schema struct would drop keywords
			// it does not model.
			param.InputSchema = anthropicparam.Override[anthropic.ToolInputSchemaParam](tool.InputSchema)
		} else {
			param.InputSchema = anthropic.ToolInputSchemaParam{Properties: map[string]any{}}
		}
		if tool.Description != "" {
			param.Description = anthropic.String(tool.Description)
		}
		if i == len(tools)-1 {
			param.CacheControl = anthropic.NewCacheControlEphemeralParam()
		}
		out[i] = anthropic.ToolUnionParam{OfTool: param}
	}
	return out
}

func (p *anthropicProvider) classify(ctx context.Context, err error, res *http.Response) *Error {
	if ctx.Err() != nil {
		return transportError(ctx, Anthropic, p.apiKey, err)
	}
	var apiErr *anthropic.Error
	if errors.As(err, &apiErr) {
		var header http.Header
		if apiErr.Response != nil {
			header = apiErr.Response.Header
		}
		return statusError(Anthropic, p.apiKey, apiErr.StatusCode, header, string(apiErr.Type()), apiErr.Message)
	}
	if res != nil && res.StatusCode >= 400 {
		return statusError(Anthropic, p.apiKey, res.StatusCode, res.Header, "", "")
	}
	return transportError(ctx, Anthropic, p.apiKey, err)
}
