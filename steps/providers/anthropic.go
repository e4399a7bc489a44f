package providers

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
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
// The request is one user turn, with System as the system prompt when it
// is not empty; the reply's text is the concatenation of its text blocks.
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
		Messages:  []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(req.Prompt))},
	}
	if req.System != "" {
		params.System = []anthropic.TextBlockParam{{Text: req.System}}
	}
	var res *http.Response
	msg, err := p.client.Messages.New(ctx, params, option.WithResponseInto(&res))
	if err != nil {
		return Reply{}, p.classify(ctx, err, res)
	}

	var text strings.Builder
	for _, block := range msg.Content {
		if block.Type == "text" {
			text.WriteString(block.Text)
		}
	}
	if text.Len() == 0 {
		return Reply{}, emptyReply(Anthropic, string(msg.StopReason), "")
	}
	return Reply{
		Text:       text.String(),
		Model:      msg.Model,
		StopReason: string(msg.StopReason),
		Usage:      Usage{InputTokens: msg.Usage.InputTokens, OutputTokens: msg.Usage.OutputTokens},
	}, nil
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
