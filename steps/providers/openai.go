package providers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/packages/ssestream"
	"github.com/openai/openai-go/v3/shared"
)

// openAIPublicURL is the base URL of OpenAI's own API.
const openAIPublicURL = "https://api.openai.com/v1/"

type openAIProvider struct {
	completions openai.ChatCompletionService
	apiKey      string
	// public is set for api.openai.com, which wants max_completion_tokens;
	// compatible servers are sent max_tokens, which they all read.
	public bool
	bad    *Error // from checkConfig; every call returns it
}

// NewOpenAI returns a Provider that calls the OpenAI Chat Completions API
// (POST {BaseURL}/chat/completions,
// https://platform.openai.com/docs/api-reference/chat) through the
// official Go SDK, without retries. With BaseURL
// set it serves OpenAI-compatible servers too: Ollama
// (http://localhost:11434/v1), vLLM and llama.cpp (http://host:8000/v1).
//
// The request is a system message when System is not empty, then one
// user message (Prompt) or the conversation (Messages): a user message's
// text blocks become a user message and its tool_result blocks tool-role
// messages (tool_call_id, content), placed before the text, as the tool
// messages must follow the assistant message with the calls; a
// tool_result with IsError has its content prefixed with "Error: ", as
// chat completions have no error flag. An assistant message's tool_use
// blocks become its tool_calls (type function, arguments the Input's
// JSON text). Tools are function tools whose parameters are the input
// schema (https://platform.openai.com/docs/guides/function-calling).
//
// The reply's text is the first choice's message content and its
// tool_calls are Reply.ToolCalls in order, the arguments string parsed as
// JSON. Arguments that are not valid JSON (models do produce them) are
// returned as a JSON string value holding the arguments as given, not as
// an error, so the caller can answer the call with an error result and
// let the model try again; sent back in a later assistant message, such a
// string is sent as the arguments it holds. Empty arguments are {}. Usage
// carries prompt_tokens_details.cached_tokens as CacheReadTokens. A reply
// with neither text nor tool calls is the retryable empty-reply *Error.
// The reply cap goes out as max_completion_tokens to api.openai.com and as
// max_tokens elsewhere. Temperature is sent when not nil.
//
// With Request.OnText set, the call streams ("stream": true, with
// stream_options {"include_usage": true}): each content delta of the
// first choice is passed to OnText as it arrives, the chunks are built
// into the completion with the SDK's ChatCompletionAccumulator, and the
// Reply is the one the same reply gives without streaming, tool calls
// with their whole arguments, finish reason and cached tokens included.
// A compatible server that ignores include_usage gives a streamed Reply
// a zero Usage. Errors are classified as without streaming (see Error
// for the ones a begun stream adds).
//
// cfg is the only source of settings: the SDK's OPENAI_* environment
// variables are not read. An empty BaseURL means https://api.openai.com/v1
// and then requires APIKey; local servers take an empty key, and then no
// Authorization header is sent. A bad BaseURL or a missing key makes every
// call fail with a non-retryable *Error. Failures are returned as *Error,
// classified as its doc says. Safe for concurrent use.
func NewOpenAI(cfg Config) Provider {
	p := &openAIProvider{apiKey: cfg.APIKey, bad: checkConfig(OpenAI, cfg)}
	if p.bad != nil {
		return p
	}
	base := cfg.BaseURL
	if base == "" {
		base = openAIPublicURL
	}
	if u, err := url.Parse(base); err == nil && u.Hostname() == "api.openai.com" {
		p.public = true
	}
	opts := []option.RequestOption{option.WithBaseURL(base), option.WithMaxRetries(0)}
	if cfg.APIKey != "" {
		opts = append(opts, option.WithAPIKey(cfg.APIKey))
	}
	if cfg.HTTPClient != nil {
		opts = append(opts, option.WithHTTPClient(cfg.HTTPClient))
	}
	// The service constructor, unlike openai.NewClient, reads nothing from
	// the environment, so a stray OPENAI_API_KEY never reaches a local server.
	p.completions = openai.NewChatCompletionService(opts...)
	return p
}

func (p *openAIProvider) Complete(ctx context.Context, req Request) (Reply, error) {
	if p.bad != nil {
		return Reply{}, p.bad
	}
	maxTokens, err := checkRequest(OpenAI, req)
	if err != nil {
		return Reply{}, err
	}

	params := openai.ChatCompletionNewParams{Model: req.Model}
	if req.System != "" {
		params.Messages = append(params.Messages, openai.SystemMessage(req.System))
	}
	if len(req.Messages) == 0 {
		params.Messages = append(params.Messages, openai.UserMessage(req.Prompt))
	} else {
		params.Messages = append(params.Messages, openAIMessages(req.Messages)...)
	}
	if params.Tools, err = openAITools(req.Tools); err != nil {
		return Reply{}, nonRetryable(OpenAI, err, "request for step %q: %v", req.Step, err)
	}
	if p.public {
		params.MaxCompletionTokens = openai.Int(maxTokens)
	} else {
		params.MaxTokens = openai.Int(maxTokens)
	}
	if req.Temperature != nil {
		params.Temperature = openai.Float(*req.Temperature)
	}
	if req.OnText != nil {
		return p.stream(ctx, params, req.OnText)
	}
	var res *http.Response
	completion, err := p.completions.New(ctx, params, option.WithResponseInto(&res))
	if err != nil {
		return Reply{}, p.classify(ctx, err, res)
	}
	return openAIReply(completion, completion.Usage)
}

// stream makes the call with streaming
// (https://platform.openai.com/docs/api-reference/chat-streaming), with
// stream_options.include_usage so the last chunk carries the usage,
// passing each content delta to onText as it arrives and building the
// completion with the SDK's ChatCompletionAccumulator, so the Reply is
// the one the same reply gives without streaming.
//
// The usage is the last one a chunk reports, not the accumulator's sum:
// OpenAI reports it once, in the final chunk, and compatible servers
// that report running totals in every chunk (vLLM's continuous usage
// stats) are read right too; the accumulator also drops
// prompt_tokens_details.cache_write_tokens. A stream that ends before a
// finish_reason, or a chunk the accumulator refuses, is a retryable
// *Error; an error event in the stream is classified as classify says.
func (p *openAIProvider) stream(ctx context.Context, params openai.ChatCompletionNewParams, onText func(string)) (Reply, error) {
	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	var res *http.Response
	stream := p.completions.NewStreaming(ctx, params, option.WithResponseInto(&res))
	defer func() { _ = stream.Close() }() // nothing is lost with the connection once read

	var acc openai.ChatCompletionAccumulator
	var usage openai.CompletionUsage
	for n := 0; stream.Next(); n++ {
		chunk := stream.Current()
		if !acc.AddChunk(chunk) {
			return Reply{}, brokenStream(OpenAI, p.apiKey, fmt.Errorf("chunk %d (id %q) does not continue the completion", n, chunk.ID))
		}
		if chunk.JSON.Usage.Valid() {
			usage = chunk.Usage
		}
		for _, choice := range chunk.Choices {
			if choice.Index == 0 && choice.Delta.Content != "" {
				onText(choice.Delta.Content)
			}
		}
	}
	if err := stream.Err(); err != nil {
		return Reply{}, p.classify(ctx, err, res)
	}
	if len(acc.Choices) == 0 || acc.Choices[0].FinishReason == "" {
		return Reply{}, brokenStream(OpenAI, p.apiKey, errors.New("the stream ended before the first choice's finish_reason"))
	}
	return openAIReply(&acc.ChatCompletion, usage)
}

// openAIReply maps a completion's first choice and usage to a Reply. A
// completion without choices, or whose first choice has neither content
// nor tool calls, is the empty-reply *Error.
func openAIReply(completion *openai.ChatCompletion, usage openai.CompletionUsage) (Reply, error) {
	if len(completion.Choices) == 0 {
		return Reply{}, emptyReply(OpenAI, "", "")
	}
	choice := completion.Choices[0]
	calls := openAIToolCalls(choice.Message.ToolCalls)
	if choice.Message.Content == "" && len(calls) == 0 {
		return Reply{}, emptyReply(OpenAI, choice.FinishReason, choice.Message.Refusal)
	}
	details := usage.PromptTokensDetails
	return Reply{
		Text:       choice.Message.Content,
		ToolCalls:  calls,
		Model:      completion.Model,
		StopReason: choice.FinishReason,
		Usage: Usage{
			InputTokens:      usage.PromptTokens,
			OutputTokens:     usage.CompletionTokens,
			CacheReadTokens:  details.CachedTokens,
			CacheWriteTokens: details.CacheWriteTokens,
		},
	}, nil
}

// toolErrorPrefix starts the content of a tool message answering a
// tool_result with IsError: chat completions have no error flag.
const toolErrorPrefix = "Error: "

// openAIMessages maps a conversation to chat messages. checkRequest has
// validated the blocks.
func openAIMessages(msgs []Message) []openai.ChatCompletionMessageParamUnion {
	var out []openai.ChatCompletionMessageParamUnion
	for _, m := range msgs {
		var texts []string
		var calls []openai.ChatCompletionMessageToolCallUnionParam
		for _, b := range m.Content {
			switch b.Type {
			case BlockText:
				texts = append(texts, b.Text)
			case BlockToolUse:
				calls = append(calls, openai.ChatCompletionMessageToolCallUnionParam{OfFunction: &openai.ChatCompletionMessageFunctionToolCallParam{
					ID:       b.ToolUseID,
					Function: openai.ChatCompletionMessageFunctionToolCallFunctionParam{Name: b.Name, Arguments: openAIArguments(b.Input)},
				}})
			case BlockToolResult:
				// Tool messages must come right after the assistant
				// message with the calls, so they precede the user's text.
				content := b.Content
				if b.IsError {
					content = toolErrorPrefix + content
				}
				out = append(out, openai.ToolMessage(content, b.ToolUseID))
			}
		}
		switch {
		case m.Role == RoleAssistant:
			msg := openai.ChatCompletionAssistantMessageParam{ToolCalls: calls}
			switch len(texts) {
			case 0:
			case 1:
				msg.Content.OfString = openai.String(texts[0])
			default:
				for _, t := range texts {
					msg.Content.OfArrayOfContentParts = append(msg.Content.OfArrayOfContentParts,
						openai.ChatCompletionAssistantMessageParamContentArrayOfContentPartUnion{OfText: &openai.ChatCompletionContentPartTextParam{Text: t}})
				}
			}
			out = append(out, openai.ChatCompletionMessageParamUnion{OfAssistant: &msg})
		case len(texts) == 1:
			out = append(out, openai.UserMessage(texts[0]))
		case len(texts) > 1:
			parts := make([]openai.ChatCompletionContentPartUnionParam, len(texts))
			for i, t := range texts {
				parts[i] = openai.TextContentPart(t)
			}
			out = append(out, openai.UserMessage(parts))
		}
	}
	return out
}

// openAIArguments returns a tool call's input as the arguments string the
// model sent: a JSON string value (malformed arguments kept by
// openAIToolCalls) gives back its contents, anything else is the JSON
// itself.
func openAIArguments(input json.RawMessage) string {
	input = toolInput(input)
	var s string
	if json.Unmarshal(input, &s) == nil {
		return s
	}
	return string(input)
}

// openAITools maps tools to function tools; the input schema is sent as
// the function's parameters.
func openAITools(tools []Tool) ([]openai.ChatCompletionToolUnionParam, error) {
	if len(tools) == 0 {
		return nil, nil
	}
	out := make([]openai.ChatCompletionToolUnionParam, len(tools))
	for i, tool := range tools {
		fn := shared.FunctionDefinitionParam{Name: tool.Name}
		if tool.Description != "" {
			fn.Description = openai.String(tool.Description)
		}
		if len(tool.InputSchema) > 0 {
			dec := json.NewDecoder(bytes.NewReader(tool.InputSchema))
			dec.UseNumber() // keep the schema's numbers as written
			if err := dec.Decode(&fn.Parameters); err != nil {
				return nil, fmt.Errorf("tools[%d] (%q): input schema: %w", i, tool.Name, err)
			}
		}
		out[i] = openai.ChatCompletionFunctionTool(fn)
	}
	return out, nil
}

// openAIToolCalls maps a reply's tool calls to ToolCalls. Arguments that
// are not valid JSON are kept as a JSON string value, empty arguments are
// {}, and a call without an id (some compatible servers send none) is
// given "call_<index>" so its result can name it.
func openAIToolCalls(in []openai.ChatCompletionMessageToolCallUnion) []ToolCall {
	if len(in) == 0 {
		return nil
	}
	out := make([]ToolCall, len(in))
	for i, tc := range in {
		call := ToolCall{ID: tc.ID, Name: tc.Function.Name}
		args := tc.Function.Arguments
		if tc.Type == "custom" {
			call.Name, args = tc.Custom.Name, tc.Custom.Input
		}
		switch {
		case strings.TrimSpace(args) == "":
			call.Input = json.RawMessage("{}")
		case json.Valid([]byte(args)):
			call.Input = json.RawMessage(args)
		default:
			quoted, _ := json.Marshal(args) // a string always marshals
			call.Input = quoted
		}
		if call.ID == "" {
			call.ID = fmt.Sprintf("call_%d", i)
		}
		out[i] = call
	}
	return out
}

// classify maps a failed call to an *Error: the caller's context first,
// then an error response by its status, then an error event in a stream
// that had begun with 200 by its error type (see Error), then anything
// else as a transport failure.
func (p *openAIProvider) classify(ctx context.Context, err error, res *http.Response) *Error {
	if ctx.Err() != nil {
		return transportError(ctx, OpenAI, p.apiKey, err)
	}
	var apiErr *openai.Error
	if errors.As(err, &apiErr) {
		var header http.Header
		if apiErr.Response != nil {
			header = apiErr.Response.Header
		}
		return statusError(OpenAI, p.apiKey, apiErr.StatusCode, header, openAIErrorType(apiErr.Type, apiErr.Code), apiErr.Message)
	}
	var streamErr *ssestream.StreamError
	if errors.As(err, &streamErr) {
		var event struct {
			Error struct {
				Message string `json:"message"`
				Type    string `json:"type"`
				Code    any    `json:"code"` // a string, a number or null, by server
			} `json:"error"`
		}
		if json.Unmarshal(streamErr.Event.Data, &event) != nil {
			return streamedError(OpenAI, p.apiKey, 0, "", streamErr.Message)
		}
		code, _ := event.Error.Code.(string)
		return streamedError(OpenAI, p.apiKey, openAIErrorStatus(event.Error.Type), openAIErrorType(event.Error.Type, code), event.Error.Message)
	}
	// A compatible server's error body may not be OpenAI's JSON; the SDK
	// then fails to decode it, but the status still tells the story.
	if res != nil && res.StatusCode >= 400 {
		return statusError(OpenAI, p.apiKey, res.StatusCode, res.Header, "", "")
	}
	return transportError(ctx, OpenAI, p.apiKey, err)
}

// openAIErrorType renders an error's type and code as "type (code)",
// or whichever of them is set.
func openAIErrorType(errType, code string) string {
	switch {
	case errType == "":
		return code
	case code != "":
		return errType + " (" + code + ")"
	}
	return errType
}

// openAIErrorStatus returns the HTTP status OpenAI answers an error type
// with, for the types an error event in a stream carries, or 0.
func openAIErrorStatus(errType string) int {
	switch errType {
	case "invalid_request_error":
		return http.StatusBadRequest
	case "rate_limit_error":
		return http.StatusTooManyRequests
	case "server_error":
		return http.StatusInternalServerError
	}
	return 0
}
