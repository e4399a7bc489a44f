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
	Lookup  *httpLookup       `json:"lookup,omitempty"`
}

// httpLookup asks the provider whether the action with the call's
// idempotency key happened: 200 yes (the body is the result), 404 no.
type httpLookup struct {
	Method string `json:"method,omitempty"`
	URL    string `json:"url"`
}

type httpRunner struct {
	method       string
	url          *template.Template
	body         *template.Template
	headers      map[string]*template.Template
	lookupMethod string
	lookupURL    *template.Template
	env          *Env
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
	if w.Lookup != nil {
		r.lookupMethod = w.Lookup.Method
		if r.lookupMethod == "" {
			r.lookupMethod = http.MethodGet
		}
		if r.lookupURL, err = parseTemplate(p.Step.ID+".lookup.url", w.Lookup.URL, p.Env); err != nil {
			return nil, err
		}
	}
	if p.Definition.EffectOf(p.Step) == schemas.EffectLookup && r.lookupURL == nil {
		return nil, fmt.Errorf("effect lookup needs with.lookup: the URL that tells whether the action with this idempotency key happened")
	}
	return r, nil
}

// Lookup asks the provider, with the lookup request, whether the call's
// action happened: 200 (with a JSON body, the result) means it did, 404
// that it did not; anything else is an error.
func (r *httpRunner) Lookup(ctx context.Context, c *Call) (bool, any, error) {
	if r.lookupURL == nil {
		return false, nil, fmt.Errorf("no with.lookup")
	}
	data, err := c.TemplateData()
	if err != nil {
		return false, nil, err
	}
	url, err := render(r.lookupURL, data)
	if err != nil {
		return false, nil, err
	}
	status, raw, err := r.do(ctx, c, r.lookupMethod, url, nil, nil)
	if err != nil {
		return false, nil, err
	}
	switch {
	case status == http.StatusNotFound:
		return false, nil, nil
	case status >= 200 && status <= 299:
		if len(bytes.TrimSpace(raw)) == 0 {
			return true, json.RawMessage("{}"), nil
		}
		if !json.Valid(raw) {
			return false, nil, fmt.Errorf("lookup %s: response is not JSON", redactURL(url))
		}
		return true, json.RawMessage(raw), nil
	}
	return false, nil, fmt.Errorf("lookup %s %s: status %d: %.200s", r.lookupMethod, redactURL(url), status, bytes.TrimSpace(raw))
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
	status, raw, err := r.do(ctx, c, r.method, url, body, data)
	if err != nil {
		return nil, err
	}
	if status < 200 || status > 299 {
		e := &schemas.Error{Code: schemas.CodeProvider, Retryable: retryableStatus(status),
			Message: fmt.Sprintf("%s %s: status %d: %.300s", r.method, redactURL(url), status, bytes.TrimSpace(raw))}
		if status >= 400 && status < 500 && status != http.StatusConflict {
			// The provider answered and refused: nothing happened. (409 is
			// another request with the same key still in progress.)
			return nil, NotPerformed(e)
		}
		return nil, e
	}
	if len(bytes.TrimSpace(raw)) == 0 {
		return json.RawMessage("{}"), nil
	}
	if !json.Valid(raw) {
		return nil, NonRetryable(schemas.Errorf(schemas.CodeOutputInvalid, "%s %s: response is not JSON: %.200s", r.method, redactURL(url), raw))
	}
	return json.RawMessage(raw), nil
}

// do sends one request with the call's Idempotency-Key and returns the
// status and body. A transport error leaves the outcome unknown.
func (r *httpRunner) do(ctx context.Context, c *Call, method, url string, body io.Reader, data map[string]any) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		return 0, nil, NonRetryable(fmt.Errorf("build request %s %s: %w", method, redactURL(url), withoutURL(err)))
	}
	if body != nil {
		// Make the request non-replayable: net/http's Transport resends a
		// request carrying an Idempotency-Key by itself when a reused
		// keep-alive connection closes before the response, though the
		// server may have acted on it. Waymark owns retries (a new attempt,
		// recorded, with the same key), so the transport must not. A 307 or
		// 308 redirect is then returned as it is rather than followed.
		req.GetBody = nil
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Idempotency-Key", c.IdempotencyKey)
	req.Header.Set("Accept", "application/json")
	if data != nil {
		for k, t := range r.headers {
			v, err := render(t, data)
			if err != nil {
				return 0, nil, NonRetryable(err)
			}
			req.Header.Set(k, v)
		}
	}
	resp, err := r.env.httpClient().Do(req)
	if err != nil {
		// The request may have reached the server and been acted on; the
		// idempotency key makes asking again safe.
		return 0, nil, &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: fmt.Sprintf("%s %s: %v", method, redactURL(url), withoutURL(err))}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, MaxHTTPResponseBytes+1))
	if err != nil {
		return 0, nil, &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: fmt.Sprintf("%s %s: read response: %v", method, redactURL(url), err)}
	}
	if len(raw) > MaxHTTPResponseBytes {
		return 0, nil, NonRetryable(schemas.Errorf(schemas.CodeTooLarge, "%s %s: response over %d bytes", method, redactURL(url), MaxHTTPResponseBytes))
	}
	return resp.StatusCode, raw, nil
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
