package schemas

import (
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strings"
)

// KindAgent is a tool-use loop: the engine dispatches each model turn to
// a worker of the step's pool and each tool call the model makes as a
// dispatch of its own (Tool), until the model answers without a tool call
// or a limit (AgentLimits) is reached.
const KindAgent = "agent"

// Agent stop reasons, in the step's output and history.
const (
	StopEndTurn      = "end_turn"       // the model answered without a tool call
	StopMaxTurns     = "max_turns"      // limits.max_turns model turns were made
	StopMaxToolCalls = "max_tool_calls" // the next turn's calls would pass limits.max_tool_calls
	StopMaxTokens    = "max_tokens"     // the tokens used reached limits.max_tokens
	StopMaxCost      = "max_cost"       // the cost reached limits.max_cost
)

// What an agent step does when a limit stops it.
const (
	OnLimitFail     = "fail"     // the step fails with CodeLimitReached (default)
	OnLimitComplete = "complete" // the step completes; its output's stop_reason names the limit
)

// Tool is a tool an agent step offers its model. Name, Description and
// InputSchema are what the model sees; the rest says how a call is
// performed: like a step of Kind (http, mcp, a kind registered in the
// worker) with With as its settings, Effect its class and Pool its worker
// pool (the agent step's pool when empty), or, for KindWorkflow, as a
// child job of the workflow With names, whose input is the call's
// arguments and whose final state is the result. The call's arguments are
// checked against InputSchema before anything is dispatched, and templates
// in With see them as .args (and .item).
type Tool struct {
	Name         string          `json:"name"` // [a-zA-Z0-9_-]{1,64}, unique within the step
	Description  string          `json:"description,omitempty"`
	InputSchema  json.RawMessage `json:"input_schema,omitempty"`  // a JSON Schema object; absent: no arguments
	OutputSchema json.RawMessage `json:"output_schema,omitempty"` // checked by the worker before the result reaches the model
	Kind         string          `json:"kind"`
	With         json.RawMessage `json:"with,omitempty"`
	Effect       EffectClass     `json:"effect,omitempty"`
	Pool         string          `json:"pool,omitempty"`
	Retry        *RetryPolicy    `json:"retry,omitempty"`
	Timeout      Duration        `json:"timeout,omitempty"`
	// RequiresApproval parks each call of the tool at an approval gate
	// (gate "<step>.<tool>", id "<step>.<tool>/<tool_use id>") bound to
	// the call's arguments; the turn's other calls go on meanwhile. A
	// rejected or expired call is answered with an error the model reads.
	RequiresApproval *ApprovalSettings `json:"requires_approval,omitempty"`
}

// AgentLimits bound one run of an agent step; 0 means no limit, except
// MaxTurns (DefaultMaxTurns).
type AgentLimits struct {
	MaxTurns     int     `json:"max_turns,omitempty"`      // model turns
	MaxToolCalls int     `json:"max_tool_calls,omitempty"` // tool calls, invalid ones included
	MaxTokens    int64   `json:"max_tokens,omitempty"`     // input, output and cache tokens over every turn
	MaxCost      float64 `json:"max_cost,omitempty"`       // in the currency of Prices (USD by convention)
}

// DefaultMaxTurns bounds an agent step whose limits do not.
const DefaultMaxTurns = 50

// Price is what a model's tokens cost, per million tokens.
type Price struct {
	Input      float64 `json:"input"`
	Output     float64 `json:"output"`
	CacheRead  float64 `json:"cache_read,omitempty"`
	CacheWrite float64 `json:"cache_write,omitempty"`
}

// TokenUsage counts a model's tokens, as providers report them
// (providers.Usage).
type TokenUsage struct {
	Input      int64 `json:"input_tokens"`
	Output     int64 `json:"output_tokens"`
	CacheRead  int64 `json:"cache_read_tokens,omitempty"`
	CacheWrite int64 `json:"cache_write_tokens,omitempty"`
}

// Total is every token u counts.
func (u TokenUsage) Total() int64 { return u.Input + u.Output + u.CacheRead + u.CacheWrite }

// Add returns u plus v.
func (u TokenUsage) Add(v TokenUsage) TokenUsage {
	return TokenUsage{u.Input + v.Input, u.Output + v.Output, u.CacheRead + v.CacheRead, u.CacheWrite + v.CacheWrite}
}

// Cost is what u costs at p.
func (p Price) Cost(u TokenUsage) float64 {
	return (float64(u.Input)*p.Input + float64(u.Output)*p.Output + float64(u.CacheRead)*p.CacheRead + float64(u.CacheWrite)*p.CacheWrite) / 1e6
}

// PriceOf returns the price of model in prices: its own entry, else the
// longest entry the model name starts with ("claude-sonnet-4" prices
// "claude-sonnet-4-20250514"); false when none.
func PriceOf(prices map[string]Price, model string) (Price, bool) {
	if p, ok := prices[model]; ok {
		return p, true
	}
	best := ""
	for k := range prices {
		if strings.HasPrefix(model, k) && len(k) > len(best) {
			best = k
		}
	}
	if best == "" {
		return Price{}, false
	}
	return prices[best], true
}

// AgentMessage is one message of an agent's transcript, in the JSON shape
// of the Anthropic Messages API (and of providers.Message): a role ("user"
// or "assistant") and content blocks.
type AgentMessage struct {
	Role    string       `json:"role"`
	Content []AgentBlock `json:"content"`
}

// AgentBlock is one content block: "text" (Text), "tool_use" (ToolUseID,
// Name, Input) or "tool_result" (ToolUseID, Content, IsError).
type AgentBlock struct {
	Type      string          `json:"type"`
	Text      string          `json:"text,omitempty"`
	ToolUseID string          `json:"tool_use_id,omitempty"`
	Name      string          `json:"name,omitempty"`
	Input     json.RawMessage `json:"input,omitempty"`
	Content   string          `json:"content,omitempty"`
	IsError   bool            `json:"is_error,omitempty"`
}

// AgentTurn is a model turn's output, as a worker returns it for an agent
// step's turn dispatch.
type AgentTurn struct {
	// Prompt is the first user message, rendered from the step's prompt
	// template; on the first turn only.
	Prompt *AgentMessage `json:"prompt,omitempty"`
	// Message is the model's reply: text and tool_use blocks.
	Message    AgentMessage `json:"message"`
	Model      string       `json:"model,omitempty"`
	StopReason string       `json:"stop_reason,omitempty"`
	Usage      TokenUsage   `json:"usage"`
	// PromptVersion is "sha256:<hex>" of the system prompt and the tool
	// definitions the turn was made with.
	PromptVersion string `json:"prompt_version,omitempty"`
	// Priced says the worker priced the turn from its price file (the step
	// has no prices): Cost is what the turn cost, in its currency.
	Priced bool    `json:"priced,omitempty"`
	Cost   float64 `json:"cost,omitempty"`
}

// TranscriptPart is a run of transcript messages stored as one value (a
// JSON array of AgentMessage) in the value store, under the job's
// message prefix: its digest ("sha256:<hex>"), size in bytes and number
// of messages.
type TranscriptPart struct {
	Digest   string `json:"digest"`
	Bytes    int    `json:"bytes"`
	Messages int    `json:"messages"`
	// Step names the agent step of a kept transcript (Checkpoint.Transcripts).
	Step string `json:"step,omitempty"`
}

// Ref returns the part's value reference.
func (p TranscriptPart) Ref() ValueRef { return ValueRef{Digest: p.Digest, Bytes: p.Bytes} }

// AgentRun is an agent step in flight, in its fan (Fan.Agent): what the
// loop has done, durably, so that a crash resumes at the next unfinished
// turn or tool call.
type AgentRun struct {
	// Turn counts the model turns whose reply is in the transcript.
	Turn int `json:"turn"`
	// Transcript is the conversation so far, oldest part first; the
	// checkpoint holds only references.
	Transcript []TranscriptPart `json:"transcript,omitempty"`
	// Usage is the tokens used, by model; Cost what they cost at the
	// step's prices (0 without prices).
	Usage map[string]TokenUsage `json:"usage,omitempty"`
	Cost  float64               `json:"cost,omitempty"`
	// ToolCalls counts the calls the model made, InvalidCalls those
	// refused before dispatch (unknown tool, arguments against the
	// schema), ToolErrors those that failed.
	ToolCalls    int `json:"tool_calls,omitempty"`
	InvalidCalls int `json:"invalid_calls,omitempty"`
	ToolErrors   int `json:"tool_errors,omitempty"`
	// OutputRetries counts final answers sent back to the model because
	// they did not match the step's output_schema.
	OutputRetries int `json:"output_retries,omitempty"`
	// Calls are the tool calls of the turn in flight, in the order the
	// model made them; empty between turns.
	Calls []AgentCall `json:"calls,omitempty"`
	// Text is the last reply's text; Model its model.
	Text          string `json:"text,omitempty"`
	Model         string `json:"model,omitempty"`
	PromptVersion string `json:"prompt_version,omitempty"`
}

// AgentCall is one tool call of the turn in flight.
type AgentCall struct {
	ID    string          `json:"id"`   // the model's tool_use id
	Name  string          `json:"name"` // the tool
	Input json.RawMessage `json:"input,omitempty"`
	// Item is the call's dispatch (Dispatch.Item), counted over the run;
	// 0 for a call refused before dispatch.
	Item int `json:"item,omitempty"`
	// Done: Content is the tool_result's content, IsError says the call
	// failed or was refused.
	Done    bool   `json:"done,omitempty"`
	Content string `json:"content,omitempty"`
	IsError bool   `json:"is_error,omitempty"`
	// ContentRef holds a long Content (a JSON string) in the value store.
	ContentRef *TranscriptPart `json:"content_ref,omitempty"`
	// Gate is the id of the approval the call waits for before it is
	// dispatched; empty once decided (or for a tool without approval).
	Gate string `json:"gate,omitempty"`
}

// Clone copies a deeply enough that changing the copy leaves a as it was.
func (a *AgentRun) Clone() *AgentRun {
	c := *a
	c.Transcript = append([]TranscriptPart(nil), a.Transcript...)
	c.Calls = append([]AgentCall(nil), a.Calls...)
	if a.Usage != nil {
		c.Usage = make(map[string]TokenUsage, len(a.Usage))
		for k, v := range a.Usage {
			c.Usage[k] = v
		}
	}
	return &c
}

// TotalUsage sums a's usage over its models.
func (a *AgentRun) TotalUsage() TokenUsage {
	var t TokenUsage
	for _, u := range a.Usage {
		t = t.Add(u)
	}
	return t
}

// CallByItem returns the call dispatched as item, or nil.
func (a *AgentRun) CallByItem(item int) *AgentCall {
	for i := range a.Calls {
		if a.Calls[i].Item == item {
			return &a.Calls[i]
		}
	}
	return nil
}

// AgentOutput is an agent step's output (saved under save_as).
type AgentOutput struct {
	Text          string                `json:"text"`
	Answer        json.RawMessage       `json:"answer,omitempty"` // the final text as JSON, when the step has an output_schema
	StopReason    string                `json:"stop_reason"`
	Turns         int                   `json:"turns"`
	ToolCalls     int                   `json:"tool_calls"`
	InvalidCalls  int                   `json:"invalid_calls,omitempty"`
	ToolErrors    int                   `json:"tool_errors,omitempty"`
	Usage         map[string]TokenUsage `json:"usage"`
	Cost          float64               `json:"cost,omitempty"`
	Model         string                `json:"model,omitempty"`
	PromptVersion string                `json:"prompt_version,omitempty"`
	// Transcript names the whole conversation in the value store (a JSON
	// array of AgentMessage), kept as long as the job.
	Transcript *TranscriptPart `json:"transcript,omitempty"`
}

// OutputShapeOf returns the shape of step s's output as conditions and
// the state see it: its output_schema's, or for an agent step the
// AgentOutput, whose answer output_schema describes.
func OutputShapeOf(s *Step) *Shape {
	out := ShapeOf(s.OutputSchema)
	if s.Kind != KindAgent {
		return out
	}
	str, integer, num := &Shape{Type: "string"}, &Shape{Type: "integer"}, &Shape{Type: "number"}
	props := map[string]*Shape{"text": str, "stop_reason": str, "turns": integer, "tool_calls": integer,
		"invalid_calls": integer, "tool_errors": integer, "usage": {Type: "object"}, "cost": num, "model": str,
		"prompt_version": str, "transcript": {Type: "object"}}
	req := map[string]bool{"text": true, "stop_reason": true, "turns": true, "tool_calls": true, "usage": true}
	if out != nil {
		props["answer"] = out
		req["answer"] = true
	}
	return &Shape{Type: "object", Properties: props, Required: req}
}

var toolName = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,64}$`)

// ToolOf returns s's tool named name, or nil.
func (s *Step) ToolOf(name string) *Tool {
	for i := range s.Tools {
		if s.Tools[i].Name == name {
			return &s.Tools[i]
		}
	}
	return nil
}

// ToolStep is the step a worker runs for a call of tool t of agent step
// s: t's kind, settings, schemas and effect under s's id.
func ToolStep(s *Step, t *Tool) *Step {
	return &Step{ID: s.ID, Kind: t.Kind, Pool: t.Pool, Effect: t.Effect, With: t.With,
		InputSchema: t.InputSchema, OutputSchema: t.OutputSchema, Retry: t.Retry, Timeout: t.Timeout}
}

// ToolPoolOf returns the pool calls of t go to: t's, else s's.
func (d *Definition) ToolPoolOf(s *Step, t *Tool) string {
	if t.Pool != "" {
		return t.Pool
	}
	return d.PoolOf(s)
}

// ToolEffectOf returns t's effect class, defaulting as for a step of its
// kind.
func (d *Definition) ToolEffectOf(s *Step, t *Tool) EffectClass { return d.EffectOf(ToolStep(s, t)) }

// MaxTurnsOf returns s's turn limit with the default filled in.
func (s *Step) MaxTurnsOf() int {
	if s.Limits != nil && s.Limits.MaxTurns > 0 {
		return s.Limits.MaxTurns
	}
	return DefaultMaxTurns
}

// ToolCallKey is the ledger key of tool call id of an agent step's run:
// "<job>/<step>[/run-N]/turn-<turn>/<id>", id replaced by "call-<n>" (n
// from 1 within the turn) when it is not a plain name.
func ToolCallKey(base, step string, run, turn int, id string, n int) string {
	if !plainKeyPart.MatchString(id) {
		id = "call-" + itoa(n)
	}
	return IdempotencyKey(base, step, run) + "/turn-" + itoa(turn) + "/" + id
}

var plainKeyPart = regexp.MustCompile(`^[A-Za-z0-9_=-]{1,96}$`)

// The dedup ids of an agent step's messages: a model turn is an attempt
// of the step (StepMsgID, "<prefix>/<step>/<attempt>"), a tool call an
// item of its run (ItemMsgID, "<prefix>/<step>/r<run>.<item>/<attempt>",
// items counted over the run).

// checkAgents reports what is wrong with the agent steps of d, and agent
// settings on steps that are not agents.
func checkAgents(d *Definition) []Problem {
	var ps []Problem
	add := func(path, format string, args ...any) {
		ps = append(ps, Problem{Path: path, Message: fmt.Sprintf(format, args...)})
	}
	for i, s := range d.Steps {
		base := fmt.Sprintf("/steps/%d", i)
		if s.Kind != KindAgent {
			for what, set := range map[string]bool{"tools": len(s.Tools) > 0, "limits": s.Limits != nil, "prices": len(s.Prices) > 0, "on_limit": s.OnLimit != ""} {
				if set {
					add(base+"/"+what, "only a step of kind agent has %s (this one is %s)", what, s.Kind)
				}
			}
			continue
		}
		if s.ForEach != nil {
			add(base+"/for_each", "an agent step cannot be a for_each step; map over a step that is not an agent, or put the agent in a child workflow")
		}
		if s.SaveAs == "" {
			add(base, "an agent step needs save_as: its output (text, answer, stop_reason, usage…) is saved under that name")
		}
		if s.IdempotencyKey != "" {
			add(base+"/idempotency_key", "an agent step has no idempotency_key: each tool call's key is <job>/<step>/turn-N/<tool_use id>")
		}
		switch s.OnLimit {
		case "", OnLimitFail, OnLimitComplete:
		default:
			add(base+"/on_limit", "on_limit is %q; want fail or complete", s.OnLimit)
		}
		if l := s.Limits; l != nil {
			if l.MaxTurns < 0 || l.MaxToolCalls < 0 || l.MaxTokens < 0 || l.MaxCost < 0 {
				add(base+"/limits", "limits cannot be negative")
			}
			if l.MaxCost > 0 && len(s.Prices) == 0 {
				ps = append(ps, Problem{Path: base + "/limits/max_cost", Warning: true, Message: "max_cost without prices: the workers' price file (--prices) must price every model the step uses; a turn no one can price fails the step"})
			}
		}
		keys := make([]string, 0, len(s.Prices))
		for k := range s.Prices {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			p := s.Prices[k]
			if p.Input < 0 || p.Output < 0 || p.CacheRead < 0 || p.CacheWrite < 0 {
				add(base+"/prices/"+k, "prices cannot be negative")
			}
		}
		seen := map[string]int{}
		for j, t := range s.Tools {
			tp := fmt.Sprintf("%s/tools/%d", base, j)
			if !toolName.MatchString(t.Name) {
				add(tp+"/name", "tool name %q: want 1 to 64 of a-z, A-Z, 0-9, _ and - (what the model APIs accept)", t.Name)
			}
			if k, dup := seen[t.Name]; dup {
				add(tp+"/name", "tool %q is also tools[%d]", t.Name, k)
			}
			seen[t.Name] = j
			switch t.Kind {
			case "":
				add(tp+"/kind", "a tool needs a kind: http, or a kind your workers register")
			case KindAgent, KindParallel:
				add(tp+"/kind", "a tool cannot be of kind %s", t.Kind)
			case KindWorkflow:
				// A child job whose input is the call's arguments.
				if cs, err := ChildOf(ToolStep(&s, &t)); err != nil {
					add(tp+"/with", "%s", strings.Replace(err.Error(), "a workflow step needs", "a workflow tool needs", 1))
				} else {
					if cs.Input != "" {
						add(tp+"/with/input", "a workflow tool's child takes the call's arguments as its input; remove with.input")
					}
					if cs.Workflow == d.Name {
						add(tp+"/with/workflow", "a workflow tool cannot start its own workflow %q: each child's agent could start another, without end", d.Name)
					}
				}
			}
			switch t.Effect {
			case "", EffectPure, EffectIdempotent, EffectLookup, EffectUnsafe:
			default:
				add(tp+"/effect", "effect %q: want pure, idempotent, lookup or unsafe", t.Effect)
			}
			if len(t.InputSchema) > 0 {
				if _, err := CompileSchema(fmt.Sprintf("steps[%d].tools[%d].input_schema", i, j), t.InputSchema); err != nil {
					add(tp+"/input_schema", "%v", err)
				} else if sh := ShapeOf(t.InputSchema); sh != nil && sh.Type != "" && sh.Type != "object" {
					add(tp+"/input_schema", "a tool's input_schema must describe an object (the APIs send arguments as one); this one is %s", sh.Type)
				}
			}
			if len(t.OutputSchema) > 0 {
				if _, err := CompileSchema(fmt.Sprintf("steps[%d].tools[%d].output_schema", i, j), t.OutputSchema); err != nil {
					add(tp+"/output_schema", "%v", err)
				}
			}
		}
	}
	return ps
}
