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

	"github.com/waymark-dev/waymark/schemas"
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
// .attempt and .idempotency_key.
func (c *Call) TemplateData() (map[string]any, error) {
	doc, err := c.StateMap()
	if err != nil {
		return nil, err
	}
	return map[string]any{
		"state":           doc,
		"vars":            c.Vars,
		"job":             c.Job,
		"step":            c.Step.ID,
		"attempt":         c.RunAttempt,
		"idempotency_key": c.IdempotencyKey,
	}, nil
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

// Builtins returns a Registry holding the built-in kinds: model, http and
// noop.
func Builtins() *Registry {
	r := NewRegistry()
	_ = r.Register(schemas.KindNoop, noopKind{})
	_ = r.Register(schemas.KindHTTP, httpKind{})
	_ = r.Register(schemas.KindModel, modelKind{})
	return r
}

// Register adds kind under name. Errors: a malformed name, or a name
// already registered.
func (r *Registry) Register(name string, kind Kind) error {
	if !kindNameRE.MatchString(name) {
		return fmt.Errorf("register step kind %q: want lower-case letters, digits, '_', '.', '-', starting with a letter", name)
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
// know), steps whose settings their kind rejects, and idempotency_key
// templates that do not parse or read a secret.
func (r *Registry) Check(env *Env, allowed ...string) schemas.CheckFunc {
	return func(def *schemas.Definition) []schemas.Problem {
		var ps []schemas.Problem
		for i := range def.Steps {
			s := &def.Steps[i]
			// idempotency_key templates are checked by the loader itself
			// (schemas.ParseEffectKey): the engine renders them, and they may
			// not read secrets.
			k, ok := r.Lookup(s.Kind)
			if !ok {
				if contains(allowed, s.Kind) {
					continue
				}
				ps = append(ps, schemas.Problem{Path: fmt.Sprintf("/steps/%d/kind", i),
					Message: fmt.Sprintf("unknown step kind %q; known: %s", s.Kind, strings.Join(r.Names(), ", "))})
				continue
			}
			if _, err := k.Prepare(&Prep{Definition: def, Step: s, Index: i, Env: env}); err != nil {
				ps = append(ps, schemas.Problem{Path: fmt.Sprintf("/steps/%d/with", i), Message: err.Error()})
			}
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
