package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"sort"
	"strings"
	"sync"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps/providers"
)

// Kind performs the steps of one kind. Prepare runs once per definition
// and step on each worker (and when a workflow is loaded, to fail fast on
// bad settings); the Runner it returns runs every attempt of that step.
type Kind interface {
	Prepare(p *Prep) (Runner, error)
}

// Runner runs one attempt of a step. It returns the step's output: any
// value that encodes as JSON (a json.RawMessage is used as is). Errors are
// retryable unless wrapped with NonRetryable; see also Retryable.
type Runner interface {
	Run(ctx context.Context, c *Call) (any, error)
}

// Prep is what a Kind sees when it prepares a step.
type Prep struct {
	Definition *schemas.Definition
	Step       *schemas.Step
	Index      int // position of Step in Definition.Steps
	Env        *Env
	// Path is the JSON Pointer of Step's settings' parent in the
	// definition ("/steps/<Index>", or "/steps/<Index>/tools/<j>" for an
	// agent's tool); empty means "/steps/<Index>".
	Path string
	// Tool is the agent tool Step stands for (schemas.ToolStep), or "".
	Tool string
}

// pathOf returns p's JSON Pointer (Prep.Path).
func (p *Prep) pathOf() string {
	if p.Path != "" {
		return p.Path
	}
	return fmt.Sprintf("/steps/%d", p.Index)
}

// Decode decodes the step's with settings into v, rejecting unknown
// fields. Errors name the step.
func (p *Prep) Decode(v any) error {
	if len(p.Step.With) == 0 {
		return nil
	}
	dec := json.NewDecoder(strings.NewReader(string(p.Step.With)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("steps[%d] (%s).with: %w", p.Index, p.Step.ID, err)
	}
	return nil
}

// Call is one attempt of one step.
type Call struct {
	Job        string
	Step       *schemas.Step
	Definition *schemas.Definition
	Attempt    int // over the job's lifetime
	RunAttempt int // within the step's current run, from 1
	// State is the job's state at dispatch, as JSON. It has passed the
	// step's input_schema.
	State json.RawMessage
	Vars  map[string]string
	// IdempotencyKey names the logical action: the same on every attempt
	// of this run of this step, different for anything else. Send it to
	// providers that honour Idempotency-Key.
	IdempotencyKey string
	// Item is the map item this attempt runs, from 1 (0: not a map
	// item); ItemValue is the item as JSON and ItemName its name (its
	// for_each key, or "item-<index>"). State is then the job's state
	// without the list.
	Item      int
	ItemName  string
	ItemValue json.RawMessage
	// Tool is the agent tool this attempt runs (ItemValue holds the
	// call's arguments, ItemName the model's tool_use id); Turn is the
	// model turn of an agent step's turn attempt, from 1, and Transcript
	// the conversation before it.
	Tool       string
	Turn       int
	Transcript []providers.Message
	// Scope is the condition an approval covering this step allowed
	// (ScopeOf its id): a kind that sends a request checks it against the
	// rendered request before sending (the http kind does), and sends
	// nothing when the request is outside it (CodeApprovalScope).
	Scope, ScopeOf string
	// Session is the deployment's session store (the store kind's).
	Session *kv.SessionStore
	// Stream, when set, receives the text of an agent turn as the model
	// makes it (the worker publishes it on kv.Names.StreamSubject).
	Stream func(text string)
	// Log, when set, receives the step's log; see Logger.
	Log *slog.Logger
	Env *Env

	stateDoc map[string]any
	lazy     *lazyLog // the worker's logger for this attempt, built on first use

	scrubMu sync.Mutex
	scrub   *scrubber // what this attempt must hide; see scrub.go
}

// Logger returns the logger for this attempt: Log when set, else the
// worker's logger with the job, step and attempt attached, else
// slog.Default().
func (c *Call) Logger() *slog.Logger {
	switch {
	case c.Log != nil:
		return c.Log
	case c.lazy != nil:
		return c.lazy.get()
	}
	return slog.Default()
}

// StateMap returns State decoded into plain JSON types (numbers as
// float64), decoding once.
func (c *Call) StateMap() (map[string]any, error) {
	if c.stateDoc != nil {
		return c.stateDoc, nil
	}
	if err := json.Unmarshal(c.State, &c.stateDoc); err != nil {
		return nil, fmt.Errorf("decode state of job %s: %w", c.Job, err)
	}
	if c.stateDoc == nil {
		c.stateDoc = map[string]any{}
	}
	return c.stateDoc, nil
}

// TemplateData is what step templates see: .state, .vars, .job, .step,
// .attempt and .idempotency_key; for a map item .item, .index (from 0)
// and .item_name; for an agent's tool call .args (also .item), the call's
// arguments, and .tool_call_id.
func (c *Call) TemplateData() (map[string]any, error) {
	doc, err := c.StateMap()
	if err != nil {
		return nil, err
	}
	data := map[string]any{
		"state":           doc,
		"vars":            c.Vars,
		"job":             c.Job,
		"step":            c.Step.ID,
		"attempt":         c.RunAttempt,
		"idempotency_key": c.IdempotencyKey,
	}
	if c.Item > 0 {
		var item any
		if err := json.Unmarshal(c.ItemValue, &item); err != nil {
			return nil, fmt.Errorf("decode item %d of job %s: %w", c.Item-1, c.Job, err)
		}
		if c.Tool != "" {
			// A tool call: its arguments, and the model's id for the call.
			data["args"], data["item"], data["tool_call_id"] = item, item, c.ItemName
		} else {
			data["item"], data["index"], data["item_name"] = item, c.Item-1, c.ItemName
		}
	}
	return data, nil
}

// Func adapts a function to a Kind whose steps need no preparation.
type Func func(ctx context.Context, c *Call) (any, error)

// Prepare returns f itself.
func (f Func) Prepare(*Prep) (Runner, error) { return f, nil }

// Run calls f.
func (f Func) Run(ctx context.Context, c *Call) (any, error) { return f(ctx, c) }

// Registry maps kind names to Kinds. Safe for concurrent use.
type Registry struct {
	mu    sync.RWMutex
	kinds map[string]Kind
}

var kindNameRE = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,63}$`)

// NewRegistry returns an empty Registry.
func NewRegistry() *Registry { return &Registry{kinds: map[string]Kind{}} }

// Builtins returns a Registry holding the built-in kinds: model, http,
// noop, agent, mcp and store.
func Builtins() *Registry {
	r := NewRegistry()
	_ = r.Register(schemas.KindNoop, noopKind{})
	_ = r.Register(schemas.KindHTTP, httpKind{})
	_ = r.Register(schemas.KindModel, modelKind{})
	_ = r.Register(schemas.KindAgent, agentKind{})
	_ = r.Register(KindMCP, mcpKind{})
	_ = r.Register(KindStore, storeKind{})
	return r
}

// Register adds kind under name. Errors: a malformed name, a name the
// engine performs itself (parallel, workflow, approval, sleep, wait), or a
// name already registered.
func (r *Registry) Register(name string, kind Kind) error {
	if !kindNameRE.MatchString(name) {
		return fmt.Errorf("register step kind %q: want lower-case letters, digits, '_', '.', '-', starting with a letter", name)
	}
	if schemas.EngineKind(name) {
		return fmt.Errorf("register step kind %q: the engine performs steps of this kind itself; pick another name", name)
	}
	if kind == nil {
		return fmt.Errorf("register step kind %q: nil Kind", name)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.kinds[name]; dup {
		return fmt.Errorf("register step kind %q: already registered", name)
	}
	r.kinds[name] = kind
	return nil
}

// Lookup returns the kind registered under name.
func (r *Registry) Lookup(name string) (Kind, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	k, ok := r.kinds[name]
	return k, ok
}

// Names returns the registered kind names, sorted.
func (r *Registry) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, 0, len(r.kinds))
	for n := range r.kinds {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Check returns a schemas.CheckFunc that reports steps whose kind is not
// registered here (unless allowed lists it: kinds only remote workers
// know), steps whose settings their kind rejects when prepared with env,
// and template fields that the state schema rules out (warnings for those
// it leaves open; see checkTemplates). Use it where the workers that will
// run the steps are this process's, with env (engine run); CheckAnyWorker
// where they are not.
func (r *Registry) Check(env *Env, allowed ...string) schemas.CheckFunc {
	return r.check(allowed, func(k Kind, p *Prep) []schemas.Problem {
		p.Env = env
		if _, err := k.Prepare(p); err != nil {
			return []schemas.Problem{{Path: p.pathOf() + "/with", Message: err.Error()}}
		}
		return nil
	})
}

// CheckAnyWorker is Check for steps that workers elsewhere will run, with
// settings this process cannot know (engine validate, engine start, the
// HTTP API): a model step may be answered live (the worker has the API
// key, or the step a base_url) or from its cassette (--model-mode replay,
// or no key), so a step is refused only when neither could run it. When
// one of them could not, the step gets a warning that says which and why
// (a live-only step without a cassette cannot run on a worker in replay
// mode). env gives what is known (services); its model mode and keys are
// ignored.
func (r *Registry) CheckAnyWorker(env *Env, allowed ...string) schemas.CheckFunc {
	base := Env{}
	if env != nil {
		base = *env
	}
	live, replay := base, base
	live.ModelMode = ModelLive
	live.Getenv = func(name string) string {
		if name == RecordCassetteEnv {
			return ""
		}
		return "(a key the worker has)" // any provider key: assume the worker was given it
	}
	replay.ModelMode = ModelReplay
	// Workers elsewhere may have MCP servers this process was not told of.
	live.MCPServers, replay.MCPServers = nil, nil
	return r.check(allowed, func(k Kind, p *Prep) []schemas.Problem {
		ptr := p.pathOf() + "/with"
		lp, rp := *p, *p
		lp.Env, rp.Env = &live, &replay
		_, liveErr := k.Prepare(&lp)
		_, replayErr := k.Prepare(&rp)
		switch {
		case liveErr == nil && replayErr == nil:
			return nil
		case liveErr != nil && replayErr != nil && liveErr.Error() == replayErr.Error():
			return []schemas.Problem{{Path: ptr, Message: liveErr.Error()}}
		case liveErr != nil && replayErr != nil:
			return []schemas.Problem{{Path: ptr, Message: fmt.Sprintf("no worker can run this step: calling the provider, %v; replaying, %v", liveErr, replayErr)}}
		case replayErr != nil:
			return []schemas.Problem{{Path: ptr, Warning: true, Message: fmt.Sprintf(
				"workers that replay (--model-mode replay, or auto without the provider's API key) cannot run this step: %v", replayErr)}}
		}
		return []schemas.Problem{{Path: ptr, Warning: true, Message: fmt.Sprintf(
			"workers that call the provider (--model-mode live, or auto with the API key) cannot run this step: %v", liveErr)}}
	})
}

// check runs prepare on every step of a registered kind, and the template
// checks on every step.
func (r *Registry) check(allowed []string, prepare func(Kind, *Prep) []schemas.Problem) schemas.CheckFunc {
	return func(def *schemas.Definition) []schemas.Problem {
		var ps []schemas.Problem
		state := schemas.StateShape(def)
		for i := range def.Steps {
			s := &def.Steps[i]
			// idempotency_key templates are checked by the loader itself
			// (schemas.ParseEffectKey): the engine renders them, and they may
			// not read secrets.
			k, ok := r.Lookup(s.Kind)
			switch {
			case schemas.EngineKind(s.Kind):
				continue // performed by the engine, checked by the loader
			case ok:
				ps = append(ps, prepare(k, &Prep{Definition: def, Step: s, Index: i})...)
				for j := range s.Tools {
					t := &s.Tools[j]
					path := fmt.Sprintf("/steps/%d/tools/%d", i, j)
					if t.Kind == schemas.KindWorkflow {
						continue // a child job: the engine's, checked by the loader
					}
					if tk, ok := r.Lookup(t.Kind); ok {
						ps = append(ps, prepare(tk, &Prep{Definition: def, Step: schemas.ToolStep(s, t), Index: i, Path: path, Tool: t.Name})...)
					} else if !contains(allowed, t.Kind) {
						var kinds []string
						for _, n := range r.Names() {
							if n != schemas.KindAgent {
								kinds = append(kinds, n)
							}
						}
						ps = append(ps, schemas.Problem{Path: path + "/kind",
							Message: fmt.Sprintf("unknown tool kind %q (known: %s); if workers of your own binary register it, allow it with --allow-kind %s",
								t.Kind, strings.Join(kinds, ", "), t.Kind)})
					}
				}
			case !contains(allowed, s.Kind):
				ps = append(ps, schemas.Problem{Path: fmt.Sprintf("/steps/%d/kind", i),
					Message: fmt.Sprintf("unknown step kind %q (known: %s); if workers of your own binary register it, allow it with --allow-kind %s",
						s.Kind, strings.Join(r.Names(), ", "), s.Kind)})
				continue
			}
			ps = append(ps, checkTemplates(def, i, state)...)
		}
		return ps
	}
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// stepError carries how a step failed.
type stepError struct {
	err          error
	retryable    bool
	code         schemas.Code
	notPerformed bool // the provider refused: no effect took place
}

func (e *stepError) Error() string { return e.err.Error() }
func (e *stepError) Unwrap() error { return e.err }

// NonRetryable marks err as permanent: the step fails without using its
// remaining attempts (Temporal's non-retryable application error).
func NonRetryable(err error) error {
	if err == nil {
		return nil
	}
	return &stepError{err: err, retryable: false}
}

// Retryable marks err as worth another attempt under the step's retry
// policy. Plain errors already are; use it to override a non-retryable
// cause.
func Retryable(err error) error {
	if err == nil {
		return nil
	}
	return &stepError{err: err, retryable: true}
}

// toError turns a Runner's error into the *schemas.Error a result carries.
func toError(err error) *schemas.Error {
	var se *stepError
	if errors.As(err, &se) {
		e := schemas.AsError(se.err)
		c := *e
		if c.Code == "" {
			c.Code = schemas.CodeStepFailed
		}
		c.Retryable = se.retryable
		return &c
	}
	var we *schemas.Error
	if errors.As(err, &we) {
		c := *we
		return &c
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return &schemas.Error{Code: schemas.CodeTimeout, Message: err.Error(), Retryable: true}
	}
	return &schemas.Error{Code: schemas.CodeStepFailed, Message: err.Error(), Retryable: true}
}

// noopKind returns with.output (default {}) without looking at state. For
// tests, benchmarks and placeholders.
type noopKind struct{}

type noopWith struct {
	Output json.RawMessage `json:"output,omitempty"`
}

func (noopKind) Prepare(p *Prep) (Runner, error) {
	var w noopWith
	if err := p.Decode(&w); err != nil {
		return nil, err
	}
	out := w.Output
	if len(out) == 0 {
		out = json.RawMessage("{}")
	}
	return Func(func(context.Context, *Call) (any, error) { return out, nil }), nil
}
