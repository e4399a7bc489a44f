package steps

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"text/template"

	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps/providers"
)

// modelKind renders a prompt over state that passed the step's input
// schema, asks a model, and parses its reply as JSON. The worker then
// validates that JSON against the step's output schema.
type modelKind struct{}

type modelWith struct {
	Provider    string   `json:"provider"`
	Model       string   `json:"model,omitempty"`
	BaseURL     string   `json:"base_url,omitempty"`
	APIKeyEnv   string   `json:"api_key_env,omitempty"`
	System      string   `json:"system,omitempty"`
	Prompt      string   `json:"prompt"`
	MaxTokens   int      `json:"max_tokens,omitempty"`
	Temperature *float64 `json:"temperature,omitempty"`
	Cassette    string   `json:"cassette,omitempty"`
}

type modelRunner struct {
	w        modelWith
	system   *template.Template
	prompt   *template.Template
	provider providers.Provider
	source   string // "live anthropic", "replay", ... for logs
}

// defaultKeyEnv is where each provider's API key is read from unless the
// step names another variable.
var defaultKeyEnv = map[string]string{
	providers.Anthropic: "ANTHROPIC_API_KEY",
	providers.OpenAI:    "OPENAI_API_KEY",
}

func (modelKind) Prepare(p *Prep) (Runner, error) {
	var w modelWith
	if err := p.Decode(&w); err != nil {
		return nil, err
	}
	if w.Prompt == "" {
		return nil, fmt.Errorf("with.prompt is required")
	}
	r := &modelRunner{w: w}
	var err error
	if w.System != "" {
		if r.system, err = parseTemplate(p.Step.ID+".system", w.System, p.Env); err != nil {
			return nil, err
		}
	}
	if r.prompt, err = parseTemplate(p.Step.ID+".prompt", w.Prompt, p.Env); err != nil {
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
	env := p.Env
	mode := env.modelMode()
	if w.Provider == providers.Replay || mode == ModelReplay {
		if replay == nil {
			return nil, fmt.Errorf("provider %s needs a cassette (with.cassette naming an asset)", map[bool]string{true: "replay", false: "replay mode"}[w.Provider == providers.Replay])
		}
		r.provider, r.source = replay, "replay"
		return r, nil
	}
	keyEnv := w.APIKeyEnv
	if keyEnv == "" {
		keyEnv = defaultKeyEnv[w.Provider]
	}
	key := env.getenv(keyEnv)
	baseURL := w.BaseURL
	if u := env.providerURL(w.Provider); u != "" {
		baseURL = u
	}
	live := key != "" || (w.Provider == providers.OpenAI && baseURL != "")
	if !live {
		if mode == ModelLive {
			return nil, fmt.Errorf("provider %s: %s is not set", w.Provider, keyEnv)
		}
		if replay == nil {
			return nil, fmt.Errorf("provider %s: %s is not set and the step has no cassette to replay", w.Provider, keyEnv)
		}
		r.provider, r.source = replay, "replay"
		return r, nil
	}
	if w.Model == "" {
		return nil, fmt.Errorf("with.model is required for provider %s", w.Provider)
	}
	if key == "" {
		key = "unused" // local OpenAI-compatible servers ignore it
	}
	cfg := providers.Config{APIKey: key, BaseURL: baseURL, HTTPClient: env.HTTPClient}
	switch w.Provider {
	case providers.Anthropic:
		r.provider = providers.NewAnthropic(cfg)
	case providers.OpenAI:
		r.provider = providers.NewOpenAI(cfg)
	default:
		return nil, fmt.Errorf("unknown provider %q (want anthropic, openai or replay)", w.Provider)
	}
	r.source = "live " + w.Provider
	if path := env.getenv(RecordCassetteEnv); path != "" {
		r.provider = providers.NewRecorder(r.provider, path)
		r.source += " (recording to " + path + ")"
	}
	return r, nil
}

func (r *modelRunner) Run(ctx context.Context, c *Call) (any, error) {
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
	reply, err := r.provider.Complete(ctx, req)
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
	var pe *providers.Error
	if errors.As(err, &pe) {
		return &schemas.Error{Code: schemas.CodeProvider, Retryable: pe.Retryable, Message: source + ": " + err.Error()}
	}
	return &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: source + ": " + err.Error()}
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
