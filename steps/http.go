package steps

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"text/template"

	"github.com/waymark-dev/waymark/schemas"
)

// MaxHTTPResponseBytes caps the body an http step reads.
const MaxHTTPResponseBytes = 1 << 20

// httpKind calls a URL with a JSON body rendered from state and an
// Idempotency-Key header (IETF draft-ietf-httpapi-idempotency-key-header)
// carrying the call's idempotency key; the JSON response is the output.
type httpKind struct{}

type httpWith struct {
	Method  string            `json:"method,omitempty"`
	URL     string            `json:"url"`
	Headers map[string]string `json:"headers,omitempty"`
	Body    string            `json:"body,omitempty"`
}

type httpRunner struct {
	method  string
	url     *template.Template
	body    *template.Template
	headers map[string]*template.Template
	env     *Env
}

func (httpKind) Prepare(p *Prep) (Runner, error) {
	var w httpWith
	if err := p.Decode(&w); err != nil {
		return nil, err
	}
	r := &httpRunner{method: w.Method, env: p.Env, headers: map[string]*template.Template{}}
	if r.method == "" {
		r.method = http.MethodPost
		if w.Body == "" {
			r.method = http.MethodGet
		}
	}
	var err error
	if r.url, err = parseTemplate(p.Step.ID+".url", w.URL, p.Env); err != nil {
		return nil, err
	}
	if w.Body != "" {
		if r.body, err = parseTemplate(p.Step.ID+".body", w.Body, p.Env); err != nil {
			return nil, err
		}
	}
	for k, v := range w.Headers {
		if strings.EqualFold(k, "Idempotency-Key") {
			return nil, fmt.Errorf("header Idempotency-Key is set by Waymark from the job and step; remove it")
		}
		if r.headers[k], err = parseTemplate(p.Step.ID+".headers."+k, v, p.Env); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func (r *httpRunner) Run(ctx context.Context, c *Call) (any, error) {
	data, err := c.TemplateData()
	if err != nil {
		return nil, NonRetryable(err)
	}
	url, err := render(r.url, data)
	if err != nil {
		return nil, NonRetryable(err)
	}
	var body io.Reader
	if r.body != nil {
		b, err := render(r.body, data)
		if err != nil {
			return nil, NonRetryable(err)
		}
		if !json.Valid([]byte(b)) {
			return nil, NonRetryable(fmt.Errorf("rendered body is not JSON: %.200s", b))
		}
		body = strings.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, r.method, url, body)
	if err != nil {
		return nil, NonRetryable(fmt.Errorf("build request %s %s: %w", r.method, redactURL(url), withoutURL(err)))
	}
	if body != nil {
		// Make the request non-replayable: net/http's Transport resends a
		// request carrying an Idempotency-Key by itself when a reused
		// keep-alive connection closes before the response, though the
		// server may have acted on it. Waymark owns retries (a new attempt,
		// recorded, with the same key), so the transport must not. A 307 or
		// 308 redirect is then returned as it is rather than followed.
		req.GetBody = nil
	}
	req.Header.Set("Idempotency-Key", c.IdempotencyKey)
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, t := range r.headers {
		v, err := render(t, data)
		if err != nil {
			return nil, NonRetryable(err)
		}
		req.Header.Set(k, v)
	}
	resp, err := r.env.httpClient().Do(req)
	if err != nil {
		// The request may have reached the server and been acted on; the
		// idempotency key makes asking again safe.
		return nil, &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: fmt.Sprintf("%s %s: %v", r.method, redactURL(url), withoutURL(err))}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, MaxHTTPResponseBytes+1))
	if err != nil {
		return nil, &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: fmt.Sprintf("%s %s: read response: %v", r.method, redactURL(url), err)}
	}
	if len(raw) > MaxHTTPResponseBytes {
		return nil, NonRetryable(schemas.Errorf(schemas.CodeTooLarge, "%s %s: response over %d bytes", r.method, redactURL(url), MaxHTTPResponseBytes))
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, &schemas.Error{Code: schemas.CodeProvider, Retryable: retryableStatus(resp.StatusCode),
			Message: fmt.Sprintf("%s %s: status %d: %.300s", r.method, redactURL(url), resp.StatusCode, bytes.TrimSpace(raw))}
	}
	if len(bytes.TrimSpace(raw)) == 0 {
		return json.RawMessage("{}"), nil
	}
	if !json.Valid(raw) {
		return nil, NonRetryable(schemas.Errorf(schemas.CodeOutputInvalid, "%s %s: response is not JSON: %.200s", r.method, redactURL(url), raw))
	}
	return json.RawMessage(raw), nil
}

// retryableStatus: timeouts, conflicts (a request with the same key still
// in progress), too early, rate limits and server errors are worth another
// attempt; other client errors are not.
func retryableStatus(code int) bool {
	switch code {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return true
	}
	return code >= 500
}

// withoutURL returns the cause of a *url.Error, whose message quotes the
// whole URL, query string included; other errors are returned as they are.
func withoutURL(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// redactURL drops the query string, which may carry credentials.
func redactURL(u string) string {
	if p, err := url.Parse(u); err == nil && p.User != nil {
		p.User = nil
		u = p.String()
	}
	if i := strings.IndexAny(u, "?#"); i >= 0 {
		return u[:i] + "?…"
	}
	return u
}
