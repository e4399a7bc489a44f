package providers

import (
	"context"
	"errors"
	"net/http"
	"net/url"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
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
// official Go SDK, without streaming and without retries. With BaseURL
// set it serves OpenAI-compatible servers too: Ollama
// (http://localhost:11434/v1), vLLM and llama.cpp (http://host:8000/v1).
//
// The request is a system message when System is not empty, then one
// user message; the reply's text is the first choice's message content.
// The reply cap goes out as max_completion_tokens to api.openai.com and as
// max_tokens elsewhere. Temperature is sent when not nil.
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
	params.Messages = append(params.Messages, openai.UserMessage(req.Prompt))
	if p.public {
		params.MaxCompletionTokens = openai.Int(maxTokens)
	} else {
		params.MaxTokens = openai.Int(maxTokens)
	}
	if req.Temperature != nil {
		params.Temperature = openai.Float(*req.Temperature)
	}
	var res *http.Response
	completion, err := p.completions.New(ctx, params, option.WithResponseInto(&res))
	if err != nil {
		return Reply{}, p.classify(ctx, err, res)
	}

	if len(completion.Choices) == 0 {
		return Reply{}, emptyReply(OpenAI, "", "")
	}
	choice := completion.Choices[0]
	if choice.Message.Content == "" {
		return Reply{}, emptyReply(OpenAI, choice.FinishReason, choice.Message.Refusal)
	}
	return Reply{
		Text:       choice.Message.Content,
		Model:      completion.Model,
		StopReason: choice.FinishReason,
		Usage:      Usage{InputTokens: completion.Usage.PromptTokens, OutputTokens: completion.Usage.CompletionTokens},
	}, nil
}

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
		errType := apiErr.Type
		switch {
		case errType == "":
			errType = apiErr.Code
		case apiErr.Code != "":
			errType += " (" + apiErr.Code + ")"
		}
		return statusError(OpenAI, p.apiKey, apiErr.StatusCode, header, errType, apiErr.Message)
	}
	// A compatible server's error body may not be OpenAI's JSON; the SDK
	// then fails to decode it, but the status still tells the story.
	if res != nil && res.StatusCode >= 400 {
		return statusError(OpenAI, p.apiKey, res.StatusCode, res.Header, "", "")
	}
	return transportError(ctx, OpenAI, p.apiKey, err)
}
