package providers

import (
	"context"
	"errors"
	"fmt"
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
// the official Go SDK, without retries.
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
// With Request.OnText set, the call streams ("stream": true,
// https://docs.anthropic.com/en/docs/build-with-claude/streaming): each
// text_delta is passed to OnText as it arrives, the events are built into
// the message with the SDK's accumulator (anthropic.Message.Accumulate),
// and the Reply is the one the same reply gives without streaming, tool
// inputs, stop reason and cache usage included. Without OnText, a
// MaxTokens the SDK expects to take over 10 minutes for the model is
// refused before sending, as the SDK refuses such non-streaming calls; a
// streamed call has no such cap. Errors are classified as without
// streaming (see Error for the ones a begun stream adds).
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
	if req.OnText == nil {
		// The SDK refuses, before sending, a non-streaming call it expects
		// to outlast 10 minutes; say so as a configuration error, not a
		// network one. A streamed call has no such limit.
		if _, err := anthropic.CalculateNonStreamingTimeout(int(maxTokens), req.Model, nil); err != nil {
			return Reply{}, nonRetryable(Anthropic, err, "step %q: max tokens %d for model %q needs streaming (set Request.OnText): %v", req.Step, maxTokens, req.Model, err)
		}
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
	if req.OnText != nil {
		return p.stream(ctx, params, req.OnText)
	}
	var res *http.Response
	msg, err := p.client.Messages.New(ctx, params, option.WithResponseInto(&res))
	if err != nil {
		return Reply{}, p.classify(ctx, err, res)
	}
	return anthropicReply(msg)
}

// stream makes the call with the streaming API
// (https://docs.anthropic.com/en/docs/build-with-claude/streaming),
// passing each text_delta to onText as it arrives and building the
// message with the SDK's accumulator, so the Reply is the one New's
// message gives. A stream that ends before message_stop, or whose events
// do not accumulate, is a retryable *Error; an error event in the stream
// is classified by its error type (see classify).
func (p *anthropicProvider) stream(ctx context.Context, params anthropic.MessageNewParams, onText func(string)) (Reply, error) {
	var res *http.Response
	stream := p.client.Messages.NewStreaming(ctx, params, option.WithResponseInto(&res))
	defer func() { _ = stream.Close() }() // nothing is lost with the connection once read

	var msg anthropic.Message
	stopped := false
	for stream.Next() {
		event := stream.Current()
		if err := msg.Accumulate(event); err != nil {
			return Reply{}, brokenStream(Anthropic, p.apiKey, fmt.Errorf("accumulate %s event: %w", event.Type, err))
		}
		switch event.Type {
		case "content_block_delta":
			if event.Delta.Type == "text_delta" && event.Delta.Text != "" {
				onText(event.Delta.Text)
			}
		case "message_stop":
			stopped = true
		}
	}
	if err := stream.Err(); err != nil {
		return Reply{}, p.classify(ctx, err, res)
	}
	if !stopped {
		return Reply{}, brokenStream(Anthropic, p.apiKey, errors.New("the stream ended before message_stop"))
	}
	return anthropicReply(&msg)
}

// anthropicReply maps a complete message to a Reply: its text blocks
// concatenated, its tool_use blocks in order, its usage with the cache
// counts. A message with neither text nor tool calls is the empty-reply
// *Error.
func anthropicReply(msg *anthropic.Message) (Reply, error) {
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

// classify maps a failed call to an *Error: the caller's context first,
// then an error response by its status, then an error event in a stream
// that had begun with 200 by the status the API documents for its error
// type, then anything else as a transport failure.
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
		if apiErr.StatusCode < 400 {
			return streamedError(Anthropic, p.apiKey, anthropicErrorStatus(string(apiErr.Type())), string(apiErr.Type()), apiErr.Message)
		}
		return statusError(Anthropic, p.apiKey, apiErr.StatusCode, header, string(apiErr.Type()), apiErr.Message)
	}
	if res != nil && res.StatusCode >= 400 {
		return statusError(Anthropic, p.apiKey, res.StatusCode, res.Header, "", "")
	}
	return transportError(ctx, Anthropic, p.apiKey, err)
}

// anthropicErrorStatus returns the HTTP status the Messages API
// documents for an error type (https://docs.anthropic.com/en/api/errors),
// or 0 for a type it does not list.
func anthropicErrorStatus(errType string) int {
	switch errType {
	case "invalid_request_error":
		return http.StatusBadRequest
	case "authentication_error":
		return http.StatusUnauthorized
	case "billing_error":
		return http.StatusPaymentRequired
	case "permission_error":
		return http.StatusForbidden
	case "not_found_error":
		return http.StatusNotFound
	case "request_too_large":
		return http.StatusRequestEntityTooLarge
	case "rate_limit_error":
		return http.StatusTooManyRequests
	case "api_error":
		return http.StatusInternalServerError
	case "timeout_error":
		return http.StatusGatewayTimeout
	case "overloaded_error":
		return 529
	}
	return 0
}
