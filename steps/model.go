package steps

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"text/template"
	"time"

	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps/providers"
)

// modelKind renders a prompt over state that passed the step's input
// schema, asks a model, and parses its reply as JSON. The worker then
// validates that JSON against the step's output schema.
type modelKind struct{}

type modelWith struct {
	Provider     string   `json:"provider"`
	Model        string   `json:"model,omitempty"`
	BaseURL      string   `json:"base_url,omitempty"`
	APIKeyEnv    string   `json:"api_key_env,omitempty"`
	APIKeySecret string   `json:"api_key_secret,omitempty"`
	System       string   `json:"system,omitempty"`
	Prompt       string   `json:"prompt"`
	MaxTokens    int      `json:"max_tokens,omitempty"`
	Temperature  *float64 `json:"temperature,omitempty"`
	Cassette     string   `json:"cassette,omitempty"`
}

type modelRunner struct {
	w      modelWith
	system *template.Template
	prompt *template.Template
	env    *Env
	source string // "live anthropic", "replay", ... for logs

	// Exactly one of replay and live is set.
	replay providers.Provider
	live   func(apiKey string) providers.Provider
	// The live provider's key, resolved at each call: from the secret
	// keySecret, else from the variable keyEnv, else none (a local server).
	keySecret, keyEnv string
	keyRequired       bool   // keyEnv was set when the step was prepared: its absence is an error
	record            string // cassette file to record live replies into
	baseURL           string // the live provider's, "" for its public API (names its rate limit)
}

// defaultKeyEnv is where each provider's API key is read from unless the
// step names another variable.
var defaultKeyEnv = map[string]string{
	providers.Anthropic: "ANTHROPIC_API_KEY",
	providers.OpenAI:    "OPENAI_API_KEY",
}

// Prepare decides where the step's replies come from. The API key is read
// when each call is made, never here; here only its presence is checked,
// for ModelAuto's choice. Where a key may come from (the README's table):
//
//   - api_key_secret NAME: the secret NAME (see Secrets), sent wherever the
//     step points;
//   - api_key_env VAR: VAR when the worker exposes it (WAYMARK_SECRET_* or
//     Secrets.Env), sent wherever the step points;
//   - the provider's own variable (ANTHROPIC_API_KEY, OPENAI_API_KEY),
//     named or by default: sent only to the provider's public API or to the
//     URL the worker sets (Env.ProviderURLs), never to a step's base_url,
//     which a workflow author chooses and could point at a server of theirs.
func (modelKind) Prepare(p *Prep) (Runner, error) {
	var w modelWith
	if err := p.Decode(&w); err != nil {
		return nil, err
	}
	if w.Prompt == "" {
		return nil, fmt.Errorf("with.prompt is required")
	}
	switch w.Provider {
	case providers.Anthropic, providers.OpenAI, providers.Replay:
	default:
		return nil, fmt.Errorf("unknown provider %q (want anthropic, openai or replay)", w.Provider)
	}
	if w.APIKeyEnv != "" && w.APIKeySecret != "" {
		return nil, fmt.Errorf("with.api_key_env and with.api_key_secret both name the key; keep one")
	}
	if w.APIKeySecret != "" {
		if err := CheckSecretName(w.APIKeySecret); err != nil {
			return nil, fmt.Errorf("with.api_key_secret: %w", err)
		}
	}
	env := p.Env
	r := &modelRunner{w: w, env: env}
	var err error
	if w.System != "" {
		if r.system, err = parseTemplate(p.Step.ID+".system", w.System, env); err != nil {
			return nil, err
		}
	}
	if r.prompt, err = parseTemplate(p.Step.ID+".prompt", w.Prompt, env); err != nil {
		return nil, err
	}
	var replay providers.Provider
	if w.Cassette != "" {
		raw, ok := p.Definition.Assets[w.Cassette]
		if !ok {
			return nil, fmt.Errorf("with.cassette names asset %q, which the definition's assets do not list", w.Cassette)
		}
		c, err := providers.ParseCassette(raw)
		if err != nil {
			return nil, fmt.Errorf("cassette %q: %w", w.Cassette, err)
		}
		replay = providers.NewReplay(c)
	}
	mode := env.modelMode()
	if w.Provider == providers.Replay || mode == ModelReplay {
		if replay == nil {
			return nil, fmt.Errorf("provider %s needs a cassette (with.cassette naming an asset)", map[bool]string{true: "replay", false: "replay mode"}[w.Provider == providers.Replay])
		}
		r.replay, r.source = replay, fmt.Sprintf("replay of cassette %q", w.Cassette)
		return r, nil
	}
	baseURL, stepURL := w.BaseURL, w.BaseURL != ""
	if u := env.providerURL(w.Provider); u != "" {
		baseURL, stepURL = u, false // the worker's choice, not the author's
	}
	own := defaultKeyEnv[w.Provider]
	var keyName string // for messages
	var haveKey bool
	switch {
	case w.APIKeySecret != "":
		r.keySecret, keyName = w.APIKeySecret, "secret "+w.APIKeySecret
		// A secret is the worker's business: when this one has none, the
		// call fails naming it, unless a cassette can answer in auto mode.
		haveKey = env.hasSecret(w.APIKeySecret) || replay == nil || mode == ModelLive
	case w.APIKeyEnv != "":
		v := w.APIKeyEnv
		if !env.exposesEnv(v) && (v != own || stepURL) {
			if v == own {
				return nil, fmt.Errorf("with.api_key_env %s: the provider's own key is sent only to its public API or to the URL the worker sets, not to a step's base_url; name a secret with api_key_secret, or have the worker expose %s with --secret-env %s", v, v, v)
			}
			return nil, fmt.Errorf("with.api_key_env %s: this worker does not expose %s to workflows; name a secret with api_key_secret (a file in --secrets-dir, or %s<NAME>), or start the worker with --secret-env %s", v, v, SecretEnvPrefix, v)
		}
		r.keyEnv, keyName = v, v
		haveKey = env.getenv(v) != ""
	case !stepURL:
		r.keyEnv, keyName = own, own
		haveKey = env.getenv(own) != ""
	default:
		// A step's own base_url is not sent the provider's own key.
		keyName = "no key for a step with its own base_url (name one with api_key_secret; " + own + " goes only to the provider's API)"
	}
	live := haveKey || (w.Provider == providers.OpenAI && baseURL != "")
	if !live {
		missing := keyName + " is not set"
		if r.keyEnv == "" && r.keySecret == "" {
			missing = keyName
		}
		if mode == ModelLive {
			return nil, fmt.Errorf("provider %s: %s", w.Provider, missing)
		}
		if replay == nil {
			return nil, fmt.Errorf("provider %s: %s and the step has no cassette to replay", w.Provider, missing)
		}
		r.replay, r.source = replay, fmt.Sprintf("replay of cassette %q", w.Cassette)
		return r, nil
	}
	if w.Model == "" {
		return nil, fmt.Errorf("with.model is required for provider %s", w.Provider)
	}
	r.keyRequired = r.keyEnv != "" && haveKey
	cfg := providers.Config{BaseURL: baseURL, HTTPClient: env.HTTPClient}
	r.baseURL = baseURL
	switch w.Provider {
	case providers.Anthropic:
		r.live = func(key string) providers.Provider { c := cfg; c.APIKey = key; return providers.NewAnthropic(c) }
	default:
		r.live = func(key string) providers.Provider { c := cfg; c.APIKey = key; return providers.NewOpenAI(c) }
	}
	r.source = "live " + w.Provider
	if path := env.getenv(RecordCassetteEnv); path != "" {
		r.record = path
		r.source += " (recording to " + path + ")"
	}
	return r, nil
}

// provider returns the provider for call c: the replay, or a live one with
// the key read now, remembered by c for scrubbing.
func (r *modelRunner) provider(c *Call) (providers.Provider, error) {
	if r.live == nil {
		return r.replay, nil
	}
	key := ""
	switch {
	case r.keySecret != "":
		v, err := c.secretFrom(r.env, r.keySecret)
		if err != nil {
			return nil, err
		}
		key = v
	case r.keyEnv != "":
		key = r.env.getenv(r.keyEnv)
		if key != "" {
			c.scrubber().addSecret(r.keyEnv, key)
		}
	}
	if key == "" {
		if r.keyRequired {
			return nil, NotPerformed(NonRetryable(fmt.Errorf("provider %s: %s is not set", r.w.Provider, r.keyEnv)))
		}
		key = "unused" // local OpenAI-compatible servers ignore it
	}
	var p providers.Provider = scrubbingProvider{live: r.live(key), s: c.scrubber()}
	if r.env != nil && r.env.RateLimits != nil {
		sum := sha256.Sum256([]byte(r.baseURL + "\x00" + key))
		p = limitedProvider{live: p, limits: r.env.RateLimits, name: r.w.Provider + "." + hex.EncodeToString(sum[:8])}
	}
	if r.record != "" {
		p = providers.NewRecorder(p, r.record)
	}
	return p, nil
}

// scrubbingProvider scrubs a live reply of the call's secrets before
// anything sees it: the recorder that writes cassettes, the parser, the
// error that quotes a reply that is not JSON.
type scrubbingProvider struct {
	live providers.Provider
	s    *scrubber
}

func (p scrubbingProvider) Complete(ctx context.Context, req providers.Request) (providers.Reply, error) {
	reply, err := p.live.Complete(ctx, req)
	reply.Text, reply.Model, reply.StopReason = p.s.outputText(reply.Text), p.s.outputText(reply.Model), p.s.outputText(reply.StopReason)
	for i := range reply.ToolCalls {
		tc := &reply.ToolCalls[i]
		tc.ID, tc.Name = p.s.outputText(tc.ID), p.s.outputText(tc.Name)
		if len(tc.Input) > 0 {
			tc.Input = json.RawMessage(p.s.json(tc.Input, false))
		}
	}
	return reply, err
}

// limitedProvider shares a provider's rate limit with every worker: before
// a call it reads the time the provider (for this key) asked everyone to
// wait until, and waits instead of calling; a 429 or 529 that says how long
// to wait (Retry-After) is recorded for all. Either way the attempt ends
// with CodeWaiting and RetryAfterMs: the engine dispatches it again then,
// without using up an attempt.
type limitedProvider struct {
	live   providers.Provider
	limits RateLimits
	name   string // "<provider>.<digest of base URL and key>"
}

// rateLimited is a call not made, or refused, because of the provider's
// rate limit: wait until Until.
type rateLimited struct {
	until time.Time
	why   string
}

func (e *rateLimited) Error() string { return e.why }

func (p limitedProvider) Complete(ctx context.Context, req providers.Request) (providers.Reply, error) {
	if until, err := p.limits.Until(ctx, p.name); err == nil && time.Now().Before(until) {
		return providers.Reply{}, &rateLimited{until: until, why: fmt.Sprintf("rate limited: the provider asked every worker to wait until %s", until.Format(time.RFC3339Nano))}
	}
	reply, err := p.live.Complete(ctx, req)
	var pe *providers.Error
	if errors.As(err, &pe) && (pe.StatusCode == 429 || pe.StatusCode == 529) && pe.RetryAfter > 0 {
		until := time.Now().Add(pe.RetryAfter)
		if herr := p.limits.Hold(ctx, p.name, until); herr != nil {
			return reply, err // unshared: the step retries as for any 429
		}
		return reply, &rateLimited{until: until, why: fmt.Sprintf("%s; every worker waits %v (Retry-After)", pe.Error(), pe.RetryAfter)}
	}
	return reply, err
}

// Run renders the prompt, asks the provider and parses the reply. The
// error and the output are scrubbed of the call's key.
func (r *modelRunner) Run(ctx context.Context, c *Call) (any, error) {
	return c.scrubResult(r.run(ctx, c))
}

func (r *modelRunner) run(ctx context.Context, c *Call) (any, error) {
	data, err := c.TemplateData()
	if err != nil {
		return nil, NonRetryable(err)
	}
	req := providers.Request{Model: r.w.Model, MaxTokens: r.w.MaxTokens, Temperature: r.w.Temperature, Step: c.Step.ID, Attempt: c.RunAttempt}
	if r.system != nil {
		if req.System, err = render(r.system, data); err != nil {
			return nil, NonRetryable(err)
		}
	}
	if req.Prompt, err = render(r.prompt, data); err != nil {
		return nil, NonRetryable(err)
	}
	provider, err := r.provider(c)
	if err != nil {
		return nil, err
	}
	reply, err := provider.Complete(ctx, req)
	if err != nil {
		return nil, providerError(r.source, err)
	}
	c.Logger().Debug("model reply", "job", c.Job, "step", c.Step.ID, "source", r.source,
		"input_tokens", reply.Usage.InputTokens, "output_tokens", reply.Usage.OutputTokens)
	out, perr := ParseReplyJSON(reply.Text)
	if perr != nil {
		return nil, &schemas.Error{Code: schemas.CodeReplyNotJSON, Retryable: true,
			Message: fmt.Sprintf("model reply is not JSON (%v); reply began: %q", perr, excerpt(reply.Text, 160))}
	}
	return out, nil
}

func providerError(source string, err error) error {
	var rl *rateLimited
	if errors.As(err, &rl) {
		ms := max(time.Until(rl.until).Milliseconds(), 1)
		return &schemas.Error{Code: schemas.CodeWaiting, Retryable: true, RetryAfterMs: ms, Message: source + ": " + rl.why}
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, source+":") { // "replay: replay: …" says nothing more
		msg = source + ": " + msg
	}
	var pe *providers.Error
	if errors.As(err, &pe) {
		return &schemas.Error{Code: schemas.CodeProvider, Retryable: pe.Retryable, Message: msg}
	}
	return &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: msg}
}

// ParseReplyJSON extracts the JSON value of a model reply: the whole text,
// or the body of a single ``` fenced block. Anything else is an error.
func ParseReplyJSON(text string) (json.RawMessage, error) {
	t := strings.TrimSpace(text)
	if strings.HasPrefix(t, "```") {
		t = strings.TrimPrefix(t, "```")
		if nl := strings.IndexByte(t, '\n'); nl >= 0 {
			t = t[nl+1:] // drop the info string ("json")
		}
		end := strings.LastIndex(t, "```")
		if end < 0 {
			return nil, fmt.Errorf("unterminated code fence")
		}
		t = strings.TrimSpace(t[:end])
	}
	if t == "" {
		return nil, fmt.Errorf("empty reply")
	}
	dec := json.NewDecoder(strings.NewReader(t))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, fmt.Errorf("text after the JSON value")
	}
	var b bytes.Buffer
	if err := json.Compact(&b, []byte(t)); err != nil {
		return nil, err
	}
	return json.RawMessage(b.Bytes()), nil
}

func excerpt(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
