package schemas

import (
	"encoding/json"
	"fmt"
	"time"
)

// Built-in step kinds. Workers may register more (see package steps).
const (
	KindModel = "model" // a model call whose JSON reply becomes the step's output
	KindHTTP  = "http"  // an HTTP call with an Idempotency-Key header
	KindNoop  = "noop"  // returns its input's "output" value, or {}; for tests and benchmarks
)

// EffectClass says what running a step again does to the outside world.
// The classes and the ledger behind them follow DESIGN.md invariant 4.
type EffectClass string

// Effect classes.
const (
	EffectPure       EffectClass = "pure"       // no outside effect: safe to run again
	EffectIdempotent EffectClass = "idempotent" // a retry with the same idempotency key is safe
	EffectLookup     EffectClass = "lookup"     // the provider can be asked by key whether it happened
	EffectUnsafe     EffectClass = "unsafe"     // neither: an unknown outcome needs a person
)

// Defaults applied where a definition is silent.
const (
	DefaultPool            = "default"
	DefaultMaxAttempts     = 3
	DefaultTimeout         = 5 * time.Minute
	DefaultBackoffInitial  = time.Second
	DefaultBackoffMax      = time.Minute
	DefaultBackoffMultiple = 2.0
	DefaultMaxSteps        = 10000
)

// Definition is a validated workflow definition. Its Hash (hex SHA-256 of
// its canonical JSON, assets included) is stored once in the definitions
// bucket and pinned into every job started from it; a job never sees
// another version.
type Definition struct {
	Name        string                     `json:"name"`
	Version     int                        `json:"version"`
	Description string                     `json:"description,omitempty"`
	InputSchema json.RawMessage            `json:"input_schema,omitempty"`
	StateSchema json.RawMessage            `json:"state_schema,omitempty"`
	Start       string                     `json:"start,omitempty"`
	MaxSteps    int                        `json:"max_steps,omitempty"` // dispatches per job; 0 means DefaultMaxSteps
	Vars        map[string]string          `json:"vars,omitempty"`
	Assets      map[string]json.RawMessage `json:"assets,omitempty"` // file contents by asset name, embedded at load
	Defaults    StepDefaults               `json:"defaults,omitzero"`
	Steps       []Step                     `json:"steps"`

	// Hash is the hex SHA-256 of the canonical JSON of every field above. It
	// is not part of the encoded form.
	Hash string `json:"-"`

	index     map[string]int
	canonical []byte
	warnings  []LocatedProblem
}

// StepDefaults holds settings every step inherits.
type StepDefaults struct {
	Retry   *RetryPolicy `json:"retry,omitempty"`
	Timeout Duration     `json:"timeout,omitempty"`
	Pool    string       `json:"pool,omitempty"`
}

// Step is one node of a workflow: a unit of work a worker performs once per
// attempt.
type Step struct {
	ID           string          `json:"id"`
	Kind         string          `json:"kind"`
	Description  string          `json:"description,omitempty"`
	Pool         string          `json:"pool,omitempty"`
	Effect       EffectClass     `json:"effect,omitempty"`
	InputSchema  json.RawMessage `json:"input_schema,omitempty"`
	OutputSchema json.RawMessage `json:"output_schema,omitempty"`
	SaveAs       string          `json:"save_as,omitempty"`
	Retry        *RetryPolicy    `json:"retry,omitempty"`
	Timeout      Duration        `json:"timeout,omitempty"`
	With         json.RawMessage `json:"with,omitempty"` // the kind's settings, decoded by the worker
	// IdempotencyKey, a text/template over state, names the logical action
	// when it is not "this step of this job" (an order id, say).
	IdempotencyKey string       `json:"idempotency_key,omitempty"`
	Next           []Transition `json:"next,omitempty"`
	OnError        string       `json:"on_error,omitempty"`
}

// Transition is one candidate move after a step completes. Transitions are
// tried in order; the first whose When holds (an absent When always holds)
// decides. Exactly one of To, Fail and End is set.
type Transition struct {
	To   string `json:"to,omitempty"`
	When string `json:"when,omitempty"` // expr-lang expression (github.com/expr-lang/expr)
	Fail string `json:"fail,omitempty"` // fail the job with this reason
	End  bool   `json:"end,omitempty"`  // complete the job
}

// RetryPolicy bounds the attempts of one run of a step. Delays grow from
// Initial by Multiplier per failed attempt, capped at Max (Temporal's retry
// policy, in fewer knobs).
type RetryPolicy struct {
	MaxAttempts int      `json:"max_attempts,omitempty"` // attempts per run, the first included; 0 means DefaultMaxAttempts
	Backoff     *Backoff `json:"backoff,omitempty"`
}

// Backoff is an exponential delay schedule.
type Backoff struct {
	Initial    Duration `json:"initial,omitempty"`    // delay before the second attempt; 0 means DefaultBackoffInitial
	Max        Duration `json:"max,omitempty"`        // cap on any delay; 0 means DefaultBackoffMax
	Multiplier float64  `json:"multiplier,omitempty"` // growth per attempt; 0 means DefaultBackoffMultiple
}

// Duration is a time.Duration that encodes as a Go duration string ("30s").
type Duration time.Duration

// MarshalJSON encodes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON accepts a duration string ("1m30s") or a number of
// nanoseconds.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		var n int64
		if err2 := json.Unmarshal(b, &n); err2 != nil {
			return fmt.Errorf("duration: want a string like \"30s\": %w", err)
		}
		*d = Duration(n)
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("duration %q: %w", s, err)
	}
	*d = Duration(v)
	return nil
}

// Step returns the step with the given id, or nil.
func (d *Definition) Step(id string) *Step {
	i := d.StepIndex(id)
	if i < 0 {
		return nil
	}
	return &d.Steps[i]
}

// StepIndex returns the position of step id in Steps, or -1.
func (d *Definition) StepIndex(id string) int {
	if d.index == nil { // built by hand, not decoded: scan
		for i := range d.Steps {
			if d.Steps[i].ID == id {
				return i
			}
		}
		return -1
	}
	i, ok := d.index[id]
	if !ok {
		return -1
	}
	return i
}

func (d *Definition) buildIndex() {
	d.index = make(map[string]int, len(d.Steps))
	for i := range d.Steps {
		d.index[d.Steps[i].ID] = i
	}
}

// MaxStepsOf returns the most step attempts one job may dispatch.
func (d *Definition) MaxStepsOf() int {
	if d.MaxSteps > 0 {
		return d.MaxSteps
	}
	return DefaultMaxSteps
}

// StartStep returns the id of the first step: Start, or the first listed.
func (d *Definition) StartStep() string {
	if d.Start != "" {
		return d.Start
	}
	return d.Steps[0].ID
}

// PoolOf returns the worker pool step s is sent to.
func (d *Definition) PoolOf(s *Step) string {
	switch {
	case s.Pool != "":
		return s.Pool
	case d.Defaults.Pool != "":
		return d.Defaults.Pool
	}
	return DefaultPool
}

// TimeoutOf returns step s's timeout.
func (d *Definition) TimeoutOf(s *Step) time.Duration {
	switch {
	case s.Timeout > 0:
		return time.Duration(s.Timeout)
	case d.Defaults.Timeout > 0:
		return time.Duration(d.Defaults.Timeout)
	}
	return DefaultTimeout
}

// EffectOf returns step s's effect class: its own, else pure for model and
// noop steps and idempotent for http steps (which always send an
// Idempotency-Key), else unsafe.
func (d *Definition) EffectOf(s *Step) EffectClass {
	if s.Effect != "" {
		return s.Effect
	}
	switch s.Kind {
	case KindModel, KindNoop:
		return EffectPure
	case KindHTTP:
		return EffectIdempotent
	}
	return EffectUnsafe
}

// RetryOf returns step s's retry policy with every default filled in.
func (d *Definition) RetryOf(s *Step) RetryPolicy {
	p := RetryPolicy{}
	for _, src := range []*RetryPolicy{d.Defaults.Retry, s.Retry} {
		if src == nil {
			continue
		}
		if src.MaxAttempts > 0 {
			p.MaxAttempts = src.MaxAttempts
		}
		if src.Backoff != nil {
			if p.Backoff == nil {
				p.Backoff = &Backoff{}
			}
			if src.Backoff.Initial > 0 {
				p.Backoff.Initial = src.Backoff.Initial
			}
			if src.Backoff.Max > 0 {
				p.Backoff.Max = src.Backoff.Max
			}
			if src.Backoff.Multiplier > 0 {
				p.Backoff.Multiplier = src.Backoff.Multiplier
			}
		}
	}
	if p.MaxAttempts == 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	if p.Backoff == nil {
		p.Backoff = &Backoff{}
	}
	if p.Backoff.Initial == 0 {
		p.Backoff.Initial = Duration(DefaultBackoffInitial)
	}
	if p.Backoff.Max == 0 {
		p.Backoff.Max = Duration(DefaultBackoffMax)
	}
	if p.Backoff.Multiplier == 0 {
		p.Backoff.Multiplier = DefaultBackoffMultiple
	}
	return p
}

// Delay returns the wait before attempt number next (2 for the first
// retry) under p: Initial * Multiplier^(next-2), capped at Max.
func (p RetryPolicy) Delay(next int) time.Duration {
	if next <= 1 || p.Backoff == nil {
		return 0
	}
	d := float64(p.Backoff.Initial)
	for i := 2; i < next; i++ {
		d *= p.Backoff.Multiplier
		if d >= float64(p.Backoff.Max) {
			return time.Duration(p.Backoff.Max)
		}
	}
	return min(time.Duration(d), time.Duration(p.Backoff.Max))
}
