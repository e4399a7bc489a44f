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
	"unicode/utf8"

	"github.com/waymark-dev/waymark/schemas"
)

// MaxHTTPResponseBytes caps the body an http step reads.
const MaxHTTPResponseBytes = 1 << 20

// httpKind calls a URL with a JSON body built from state (body.go) and an
// Idempotency-Key header (IETF draft-ietf-httpapi-idempotency-key-header)
// carrying the call's idempotency key; the JSON response is the output.
// The url, headers and body may read secrets ({{secret "NAME"}}); the
// rendered request is sent and never stored, and the call's error and
// output are scrubbed of the secrets and of credential header values.
type httpKind struct{}

type httpWith struct {
	Method  string            `json:"method,omitempty"`
	URL     string            `json:"url"`
	Headers map[string]string `json:"headers,omitempty"`
	Body    json.RawMessage   `json:"body,omitempty"`
	Lookup  *httpLookup       `json:"lookup,omitempty"`
	// Response is how the body becomes the output: ResponseAuto (default),
	// ResponseJSON or ResponseText.
	Response string `json:"response,omitempty"`
}

// Response modes of an http step.
const (
	ResponseAuto = "auto" // JSON when the body is JSON, else text (TextOutput)
	ResponseJSON = "json" // JSON, or the step fails
	ResponseText = "text" // always text
)

// saysJSON reports whether a Content-Type names JSON (application/json,
// or a +json type such as application/problem+json).
func saysJSON(ctype string) bool {
	mt, _, _ := strings.Cut(strings.ToLower(ctype), ";")
	mt = strings.TrimSpace(mt)
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

// TextOutput is the output of an http step whose response is text (HTML,
// plain text, XML): the body as a string, with its content type and
// length in bytes.
type TextOutput struct {
	ContentType string `json:"content_type"`
	Text        string `json:"text"`
	Bytes       int    `json:"bytes"`
}

// httpLookup asks the provider whether the action with the call's
// idempotency key happened: 200 yes (the body is the result), 404 no.
type httpLookup struct {
	Method string `json:"method,omitempty"`
	URL    string `json:"url"`
}

type httpRunner struct {
	method       string
	url          *stepTemplate
	body         body
	headers      map[string]*stepTemplate
	credential   map[string]bool // headers whose values are scrubbed from errors
	lookupMethod string
	lookupURL    *stepTemplate
	env          *Env
	response     string
}

// credentialHeaderNames are headers that carry credentials by their name;
// headers whose names hold one of credentialHeaderParts are taken as such
// too (X-Auth-Token, PRIVATE-TOKEN, X-Vault-Token, X-Client-Secret ...).
var (
	credentialHeaderNames = map[string]bool{"authorization": true, "proxy-authorization": true, "cookie": true, "set-cookie": true,
		"x-api-key": true, "api-key": true, "x-goog-api-key": true, "anthropic-api-key": true, "openai-api-key": true}
	credentialHeaderParts = []string{"auth", "token", "secret", "password", "passwd", "apikey", "api-key", "api_key", "session", "cookie"}
)

// isCredentialHeader reports whether a header's value is a credential by
// its name.
func isCredentialHeader(name string) bool {
	n := strings.ToLower(name)
	if credentialHeaderNames[n] {
		return true
	}
	for _, p := range credentialHeaderParts {
		if strings.Contains(n, p) {
			return true
		}
	}
	return false
}

func (httpKind) Prepare(p *Prep) (Runner, error) {
	var w httpWith
	if err := p.Decode(&w); err != nil {
		return nil, err
	}
	r := &httpRunner{method: w.Method, env: p.Env, headers: map[string]*stepTemplate{}, credential: map[string]bool{}, response: w.Response}
	switch r.response {
	case "":
		r.response = ResponseAuto
	case ResponseAuto, ResponseJSON, ResponseText:
	default:
		return nil, fmt.Errorf("steps[%d] (%s).with.response %q: want auto, json or text", p.Index, p.Step.ID, w.Response)
	}
	var err error
	if r.body, err = compileBody(p.Step.ID, w.Body, p.Env); err != nil {
		return nil, err
	}
	if r.method == "" {
		r.method = http.MethodPost
		if r.body == nil {
			r.method = http.MethodGet
		}
	}
	if r.url, err = parseURLTemplate(p.Step.ID+".url", w.URL, p.Env); err != nil {
		return nil, err
	}
	for k, v := range w.Headers {
		if strings.EqualFold(k, "Idempotency-Key") {
			return nil, fmt.Errorf("header Idempotency-Key is set by Waymark from the job and step; remove it")
		}
		if r.headers[k], err = parseSecretTemplate(p.Step.ID+".headers."+k, v, p.Env); err != nil {
			return nil, err
		}
		r.credential[k] = isCredentialHeader(k) || len(r.headers[k].secrets) > 0
	}
	if w.Lookup != nil {
		r.lookupMethod = w.Lookup.Method
		if r.lookupMethod == "" {
			r.lookupMethod = http.MethodGet
		}
		if r.lookupURL, err = parseURLTemplate(p.Step.ID+".lookup.url", w.Lookup.URL, p.Env); err != nil {
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
// that it did not; anything else is an error. The answer and the error are
// scrubbed as Run's are.
func (r *httpRunner) Lookup(ctx context.Context, c *Call) (bool, any, error) {
	found, out, err := r.lookup(ctx, c)
	out, err = c.scrubResult(out, err)
	return found, out, err
}

func (r *httpRunner) lookup(ctx context.Context, c *Call) (bool, any, error) {
	if r.lookupURL == nil {
		return false, nil, fmt.Errorf("no with.lookup")
	}
	data, err := c.TemplateData()
	if err != nil {
		return false, nil, err
	}
	url, err := r.lookupURL.execute(c, r.env, data)
	if err == nil {
		err = checkDotSegments(url)
	}
	if err != nil {
		return false, nil, err
	}
	// The step's headers go on the lookup too: it asks the same provider,
	// with the same credentials.
	status, raw, _, err := r.do(ctx, c, r.lookupMethod, url, nil, data)
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
	return false, nil, fmt.Errorf("lookup %s %s: status %d: %s", r.lookupMethod, redactURL(url), status, r.excerpt(c, raw, 200))
}

// Run sends the request. Errors before it is sent are not performed (the
// effect did not happen); the error and the output are scrubbed of what
// the call resolved.
func (r *httpRunner) Run(ctx context.Context, c *Call) (any, error) {
	return c.scrubResult(r.run(ctx, c))
}

func (r *httpRunner) run(ctx context.Context, c *Call) (any, error) {
	notSent := func(err error) error { return NotPerformed(NonRetryable(err)) }
	data, err := c.TemplateData()
	if err != nil {
		return nil, notSent(err)
	}
	url, err := r.url.execute(c, r.env, data)
	if err != nil {
		return nil, notSent(err)
	}
	if err := checkDotSegments(url); err != nil {
		return nil, notSent(&schemas.Error{Code: schemas.CodeInputInvalid, Message: err.Error()})
	}
	var body io.Reader
	var rendered []byte
	if r.body != nil {
		b, err := r.body.render(c, r.env, data)
		if err != nil {
			return nil, notSent(err)
		}
		body, rendered = bytes.NewReader(b), b
	}
	if c.Scope != "" {
		// An approval bounds this request: checked as it would be sent.
		req := schemas.ScopeRequest{Method: r.method, URL: url}
		if rendered != nil && json.Unmarshal(rendered, &req.Body) != nil {
			req.Body = string(rendered)
		}
		if err := schemas.CheckScope(c.Scope, req); err != nil {
			return nil, notSent(&schemas.Error{Code: schemas.CodeApprovalScope, Message: fmt.Sprintf("approval %s: %v: not sent", c.ScopeOf, err)})
		}
	}
	status, raw, ctype, err := r.do(ctx, c, r.method, url, body, data)
	if err != nil {
		return nil, err
	}
	if status < 200 || status > 299 {
		e := &schemas.Error{Code: schemas.CodeProvider, Retryable: retryableStatus(status),
			Message: fmt.Sprintf("%s %s: status %d: %s", r.method, redactURL(url), status, r.excerpt(c, raw, 300))}
		if status >= 400 && status < 500 && status != http.StatusConflict {
			// The provider answered and refused: nothing happened. (409 is
			// another request with the same key still in progress.)
			return nil, NotPerformed(e)
		}
		return nil, e
	}
	if r.response != ResponseText {
		if len(bytes.TrimSpace(raw)) == 0 {
			return json.RawMessage("{}"), nil
		}
		if json.Valid(raw) {
			return json.RawMessage(raw), nil
		}
		if r.response == ResponseJSON || saysJSON(ctype) {
			return nil, NonRetryable(schemas.Errorf(schemas.CodeOutputInvalid, "%s %s: response is not JSON: %s", r.method, redactURL(url), r.excerpt(c, raw, 200)))
		}
	}
	if !utf8.Valid(raw) {
		return nil, NonRetryable(schemas.Errorf(schemas.CodeOutputInvalid, "%s %s: the %d-byte response (%s) is neither JSON nor UTF-8 text", r.method, redactURL(url), len(raw), ctype))
	}
	return TextOutput{ContentType: ctype, Text: string(raw), Bytes: len(raw)}, nil
}

// excerpt returns the first n bytes of a response body for an error
// message, scrubbed first: cut before scrubbing, a credential could be
// left in part. A JSON body is scrubbed inside its decoded strings, so an
// escaped copy (\u0041..., \/) is found too.
func (r *httpRunner) excerpt(c *Call, raw []byte, n int) string {
	raw = bytes.TrimSpace(raw)
	s := c.scrubber()
	var clean string
	if json.Valid(raw) {
		clean = string(s.json(raw, true))
	} else {
		clean = s.text(string(raw))
	}
	if len(clean) <= n {
		return clean
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(clean[cut]) {
		cut--
	}
	return clean[:cut] + "…"
}

// do sends one request with the call's Idempotency-Key and returns the
// status and body. A transport error leaves the outcome unknown; an error
// before the request is sent is marked not performed.
func (r *httpRunner) do(ctx context.Context, c *Call, method, url string, body io.Reader, data map[string]any) (int, []byte, string, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		return 0, nil, "", NotPerformed(NonRetryable(fmt.Errorf("build request %s %s: %w", method, redactURL(url), withoutURL(err))))
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
	if r.response == ResponseJSON {
		req.Header.Set("Accept", "application/json")
	} else {
		req.Header.Set("Accept", "application/json, text/*;q=0.9, */*;q=0.1")
	}
	if data != nil {
		for k, t := range r.headers {
			v, err := t.execute(c, r.env, data)
			if err != nil {
				return 0, nil, "", NotPerformed(NonRetryable(err))
			}
			if r.credential[k] {
				c.scrubber().addCredential(v)
			}
			req.Header.Set(k, v)
		}
	}
	resp, err := r.env.httpClient().Do(req)
	if err != nil {
		// The request may have reached the server and been acted on; the
		// idempotency key makes asking again safe.
		return 0, nil, "", &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: fmt.Sprintf("%s %s: %v", method, redactURL(url), withoutURL(err))}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, MaxHTTPResponseBytes+1))
	if err != nil {
		return 0, nil, "", &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: fmt.Sprintf("%s %s: read response: %v", method, redactURL(url), err)}
	}
	if len(raw) > MaxHTTPResponseBytes {
		return 0, nil, "", NonRetryable(schemas.Errorf(schemas.CodeTooLarge, "%s %s: response over %d bytes", method, redactURL(url), MaxHTTPResponseBytes))
	}
	return resp.StatusCode, raw, resp.Header.Get("Content-Type"), nil
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
