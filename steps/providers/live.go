package providers

import (
	"errors"
	"net/url"
)

// defaultMaxTokens is the reply cap when Request.MaxTokens is 0.
const defaultMaxTokens = 1024

// checkConfig reports a Config a live provider cannot work with. It runs
// once, in the constructor; Complete returns what it found.
func checkConfig(provider string, cfg Config) *Error {
	if cfg.BaseURL == "" {
		if cfg.APIKey == "" {
			return nonRetryable(provider, nil, "Config.APIKey is empty: the public API needs a key")
		}
		return nil
	}
	u, err := url.Parse(cfg.BaseURL)
	if err != nil {
		// url.Error quotes the URL, which may hold a password: keep its reason only.
		var urlErr *url.Error
		if errors.As(err, &urlErr) {
			err = urlErr.Err
		}
		return nonRetryable(provider, nil, "Config.BaseURL is not a URL: %v", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nonRetryable(provider, nil, "Config.BaseURL %q: want an http or https URL with a host", u.Redacted())
	}
	return nil
}

// checkRequest reports a Request no live provider can send, and returns
// its reply cap with the default applied.
func checkRequest(provider string, req Request) (maxTokens int64, err error) {
	switch {
	case req.Model == "":
		return 0, nonRetryable(provider, nil, "request for step %q has no model", req.Step)
	case req.Prompt == "":
		return 0, nonRetryable(provider, nil, "request for step %q has an empty prompt", req.Step)
	case req.MaxTokens < 0:
		return 0, nonRetryable(provider, nil, "request for step %q: max tokens %d is negative", req.Step, req.MaxTokens)
	case req.MaxTokens == 0:
		return defaultMaxTokens, nil
	}
	return int64(req.MaxTokens), nil
}
