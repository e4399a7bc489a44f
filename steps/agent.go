package steps

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"

	"github.com/goccy/go-yaml"

	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps/providers"
)

// agentKind makes one model turn of an agent step: the conversation so
// far (Call.Transcript; on the first turn, the rendered prompt) and the
// step's tools go to the provider, and the reply comes back as a
// schemas.AgentTurn. The engine runs the loop: it records the turn,
// dispatches the tool calls, and sends the next turn. Its settings are a
// model step's (provider, model, system, prompt, max_tokens, cassette…).
type agentKind struct{}

type agentRunner struct {
	m     *modelRunner
	tools []providers.Tool
}

// Prepare prepares the step's provider as modelKind does and the tools
// the model is offered.
func (agentKind) Prepare(p *Prep) (Runner, error) {
	r, err := modelKind{}.Prepare(p)
	if err != nil {
		return nil, err
	}
	ar := &agentRunner{m: r.(*modelRunner)}
	for _, t := range p.Step.Tools {
		ar.tools = append(ar.tools, providers.Tool{Name: t.Name, Description: t.Description, InputSchema: t.InputSchema})
	}
	return ar, nil
}

// Run makes the turn; its error and output are scrubbed of the call's
// secrets.
func (r *agentRunner) Run(ctx context.Context, c *Call) (any, error) {
	return c.scrubResult(r.run(ctx, c))
}

func (r *agentRunner) run(ctx context.Context, c *Call) (any, error) {
	if c.Turn < 1 {
		return nil, NonRetryable(fmt.Errorf("step %s is an agent step and this attempt names no turn (an engine older than the worker?)", c.Step.ID))
	}
	data, err := c.TemplateData()
	if err != nil {
		return nil, NonRetryable(err)
	}
	w := r.m.w
	req := providers.Request{Model: w.Model, MaxTokens: w.MaxTokens, Temperature: w.Temperature, Tools: r.tools,
		Step: c.Step.ID, Attempt: c.RunAttempt, Turn: c.Turn}
	if r.m.system != nil {
		if req.System, err = render(r.m.system, data); err != nil {
			return nil, NonRetryable(err)
		}
	}
	var out schemas.AgentTurn
	req.Messages = c.Transcript
	if len(req.Messages) == 0 {
		// The first turn: the prompt, rendered from the state (which passed
		// the step's input_schema), is the conversation's first message.
		text, err := render(r.m.prompt, data)
		if err != nil {
			return nil, NonRetryable(err)
		}
		first := providers.Message{Role: providers.RoleUser, Content: []providers.Block{providers.TextBlock(text)}}
		req.Messages = []providers.Message{first}
		pm := agentMessage(first)
		out.Prompt = &pm
	}
	if c.Stream != nil {
		req.OnText = c.scrubbedStream()
	}
	provider, err := r.m.provider(c)
	if err != nil {
		return nil, err
	}
	reply, err := provider.Complete(ctx, req)
	if err != nil {
		return nil, providerError(r.m.source, err)
	}
	out.Message = agentMessage(reply.Message())
	out.Model = reply.Model
	if out.Model == "" {
		out.Model = w.Model
	}
	out.StopReason = reply.StopReason
	out.Usage = schemas.TokenUsage{Input: reply.Usage.InputTokens, Output: reply.Usage.OutputTokens,
		CacheRead: reply.Usage.CacheReadTokens, CacheWrite: reply.Usage.CacheWriteTokens}
	out.PromptVersion = PromptVersion(req.System, r.tools)
	if len(c.Step.Prices) == 0 && r.m.env != nil {
		if p, ok := schemas.PriceOf(r.m.env.Prices, out.Model); ok {
			out.Priced, out.Cost = true, p.Cost(out.Usage)
		}
	}
	c.Logger().Debug("agent turn", "job", c.Job, "step", c.Step.ID, "turn", c.Turn, "source", r.m.source,
		"tool_calls", len(reply.ToolCalls), "input_tokens", reply.Usage.InputTokens, "output_tokens", reply.Usage.OutputTokens)
	return out, nil
}

// PromptVersion names the stable prefix of an agent's prompts: "sha256:"
// and the hex SHA-256 of the system prompt and the tool definitions (as
// JSON), so that a changed prompt or tool shows in the turns it made.
func PromptVersion(system string, tools []providers.Tool) string {
	b, _ := json.Marshal(struct {
		System string           `json:"system"`
		Tools  []providers.Tool `json:"tools"`
	}{system, tools})
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// agentMessage converts a provider message to the transcript's form
// (the same JSON).
func agentMessage(m providers.Message) schemas.AgentMessage {
	out := schemas.AgentMessage{Role: m.Role, Content: make([]schemas.AgentBlock, len(m.Content))}
	for i, b := range m.Content {
		out.Content[i] = schemas.AgentBlock{Type: b.Type, Text: b.Text, ToolUseID: b.ToolUseID, Name: b.Name, Input: b.Input, Content: b.Content, IsError: b.IsError}
	}
	return out
}

// scrubbedStream returns c.Stream with each piece scrubbed of the call's
// secrets first (a secret split across two pieces is not seen: the
// model does not know the keys, so its text rarely holds one).
func (c *Call) scrubbedStream() func(string) {
	s := c.scrubber()
	return func(text string) { c.Stream(s.outputText(text)) }
}

// LoadPrices reads a price file: a YAML (or JSON) object of model name
// (or name prefix) to {input, output, cache_read, cache_write}, each in
// the file's currency per million tokens. Errors name the file and what
// is wrong; unknown fields and negative prices are refused.
func LoadPrices(path string) (map[string]schemas.Price, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var raw map[string]map[string]any
	if err := yaml.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("price file %s: %w", path, err)
	}
	out := make(map[string]schemas.Price, len(raw))
	for model, fields := range raw {
		var p schemas.Price
		for k, v := range fields {
			n, ok := v.(float64)
			if i, isInt := v.(uint64); isInt {
				n, ok = float64(i), true
			} else if i, isInt := v.(int64); isInt {
				n, ok = float64(i), true
			}
			if !ok || n < 0 {
				return nil, fmt.Errorf("price file %s: %s.%s is %v; want a number of 0 or more", path, model, k, v)
			}
			switch k {
			case "input":
				p.Input = n
			case "output":
				p.Output = n
			case "cache_read":
				p.CacheRead = n
			case "cache_write":
				p.CacheWrite = n
			default:
				return nil, fmt.Errorf("price file %s: %s has unknown field %q (want input, output, cache_read, cache_write)", path, model, k)
			}
		}
		out[model] = p
	}
	return out, nil
}
