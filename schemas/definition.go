package schemas

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

// Built-in step kinds. Workers may register more (see package steps).
const (
	KindModel = "model" // a model call whose JSON reply becomes the step's output
	KindHTTP  = "http"  // an HTTP call with an Idempotency-Key header
	KindNoop  = "noop"  // returns its input's "output" value, or {}; for tests and benchmarks
	// KindParallel runs the steps its Branches name at once and joins them
	// (Join); the engine performs it, no worker does.
	KindParallel = "parallel"
	// KindWorkflow starts another workflow as a child job and waits for
	// it (ChildSettings); the engine performs it, no worker does.
	KindWorkflow = "workflow"
)

// ChildSettings are the with settings of a workflow step.
type ChildSettings struct {
	// Workflow is the child's workflow name; its definition stored last
	// when the child starts is pinned into the child.
	Workflow string `json:"workflow"`
	// Input is the dotted state path of the child's input (an object);
	// empty: the whole state.
	Input string `json:"input,omitempty"`
}

// ChildOf decodes s's settings as a workflow step's; errors name the step.
func ChildOf(s *Step) (ChildSettings, error) {
	var c ChildSettings
	if len(s.With) == 0 {
		return c, fmt.Errorf("step %s: a workflow step needs with.workflow", s.ID)
	}
	dec := json.NewDecoder(bytes.NewReader(s.With))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return c, fmt.Errorf("step %s: with: %w", s.ID, err)
	}
	if c.Workflow == "" {
		return c, fmt.Errorf("step %s: a workflow step needs with.workflow", s.ID)
	}
	return c, nil
}

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
	// DefaultMapConcurrency is the most items of one for_each step in
	// flight at once when the step does not say.
	DefaultMapConcurrency = 10
	// DefaultMaxItems is the longest list a for_each step takes when it
	// does not say; a longer one fails the step before anything runs.
	DefaultMaxItems = 100000
	// MaxMapConcurrency bounds ForEach.Concurrency: every item in flight
	// has a dispatch record in the job's checkpoint.
	MaxMapConcurrency = 1000
)

// Definition is a validated workflow definition. Its Hash (hex SHA-256 of
// its canonical JSON, assets included) is stored once in the definitions
// bucket and pinned into every job started from it; a job never sees
// another version.
type Definition struct {
	Name        string          `json:"name"`
	Version     int             `json:"version"`
	Description string          `json:"description,omitempty"`
	InputSchema json.RawMessage `json:"input_schema,omitempty"`
	StateSchema json.RawMessage `json:"state_schema,omitempty"`
	Start       string          `json:"start,omitempty"`
	MaxSteps    int             `json:"max_steps,omitempty"` // dispatches per job; 0 means DefaultMaxSteps
	// Deadline bounds a job's life from its start: past it (a durable
	// timer) the job fails with code timeout, what it had in flight
	// stopped as a cancel stops it. 0: none.
	Deadline Duration                   `json:"deadline,omitempty"`
	Vars     map[string]string          `json:"vars,omitempty"`
	Assets   map[string]json.RawMessage `json:"assets,omitempty"` // file contents by asset name, embedded at load
	Defaults StepDefaults               `json:"defaults,omitzero"`
	// Pools declares worker pools' flow settings for this workflow's
	// steps: a rate limit and a priority (PoolSettings), by pool name.
	Pools map[string]PoolSettings `json:"pools,omitempty"`
	Steps []Step                  `json:"steps"`
	// Triggers are the CloudEvents rules that start jobs of this
	// workflow's latest stored definition (engine/trigger); none: jobs
	// start only when asked.
	Triggers []Trigger `json:"triggers,omitempty"`

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
	// Branches are the steps a parallel step (kind parallel) runs at once.
	// Each is a step of this definition reached from nowhere else, with a
	// save_as of its own and no next or on_error: the join decides.
	Branches []string `json:"branches,omitempty"`
	// Join says when a parallel step is done; nil means every branch.
	Join *Join `json:"join,omitempty"`
	// ForEach runs the step once per item of a list in state (a map).
	ForEach *ForEach `json:"for_each,omitempty"`
	// Tools, Limits, Prices and OnLimit are an agent step's (KindAgent):
	// the tools its model may call, the bounds of a run, the price per
	// million tokens by model name (or name prefix), and what reaching a
	// limit does (OnLimitFail, the default, or OnLimitComplete).
	Tools   []Tool           `json:"tools,omitempty"`
	Limits  *AgentLimits     `json:"limits,omitempty"`
	Prices  map[string]Price `json:"prices,omitempty"`
	OnLimit string           `json:"on_limit,omitempty"`
	// RequiresApproval opens an approval gate before each run of the step
	// (not before its retries): the job waits in JobWaitingApproval until
	// a person approves the rendered action; see ApprovalSettings.
	RequiresApproval *ApprovalSettings `json:"requires_approval,omitempty"`
	// ValidFor is how long the step's output stays good (a quote good for
	// 15 minutes): a later step about to be dispatched after it expired
	// waits while the step runs again, then goes. 0: for good.
	ValidFor Duration `json:"valid_for,omitempty"`
	// Concurrency limits how many dispatches of the step run at once (per
	// key); RateLimit how many start per period (per key); Priority orders
	// the dispatches waiting for one of the step's limits (its pool's
	// priority when nil). See flow.go.
	Concurrency *Concurrency `json:"concurrency,omitempty"`
	RateLimit   *RateLimit   `json:"rate_limit,omitempty"`
	Priority    *int         `json:"priority,omitempty"`
}

// Join modes of a parallel step.
const (
	JoinAll   = "all"   // every branch must complete
	JoinFirst = "first" // the first branch to complete decides
	JoinN     = "n"     // N branches must complete
)

// What a join does with the branches still running once it is decided.
const (
	OthersCancel = "cancel" // stop waiting: their results are dropped (default)
	OthersWait   = "wait"   // let them finish; their outputs are kept, their failures tolerated
)

// Join is the completion rule of a parallel step (the "all", "any" and
// "n of m" joins of workflow patterns; AWS Step Functions' Parallel state
// waits for all).
type Join struct {
	Mode   string `json:"mode,omitempty"`   // JoinAll (default), JoinFirst or JoinN
	N      int    `json:"n,omitempty"`      // for JoinN: branches that must complete, 1..len(Branches)
	Others string `json:"others,omitempty"` // OthersCancel (default) or OthersWait
}

// ModeOf returns j's mode, JoinAll when unset.
func (j *Join) ModeOf() string {
	if j == nil || j.Mode == "" {
		return JoinAll
	}
	return j.Mode
}

// Needed returns how many of n branches must complete under j.
func (j *Join) Needed(n int) int {
	switch j.ModeOf() {
	case JoinFirst:
		return 1
	case JoinN:
		return j.N
	}
	return n
}

// Waits reports whether branches still running once j is decided are
// waited for (OthersWait) rather than cancelled.
func (j *Join) Waits() bool { return j != nil && j.Others == OthersWait }

// Item failure policies of a for_each step.
const (
	ItemErrorFail    = "fail"    // the first item that fails for good fails the step (default)
	ItemErrorCollect = "collect" // failed items are listed and the step goes on
)

// ForEach makes a step a map: it runs once per item of the list at Items,
// at most Concurrency at a time, each item with its own attempts and
// idempotency key; the outputs are gathered in input order under the
// step's save_as.
type ForEach struct {
	// Items is the state path of the list, dotted ("docs", "batch.docs").
	Items string `json:"items"`
	// Key is a text/template over .item and .index naming an item, so that
	// its idempotency key does not change when the list is re-ordered;
	// absent, items are named by index. Two items of one list with the
	// same key fail the step before anything is dispatched.
	Key string `json:"key,omitempty"`
	// Concurrency is the most items in flight; 0 means DefaultMapConcurrency.
	Concurrency int `json:"concurrency,omitempty"`
	// OnItemError is ItemErrorFail (default) or ItemErrorCollect.
	OnItemError string `json:"on_item_error,omitempty"`
	// MaxItems is the longest list taken; 0 means DefaultMaxItems.
	MaxItems int `json:"max_items,omitempty"`
}

// ConcurrencyOf returns f's concurrency with the default filled in.
func (f *ForEach) ConcurrencyOf() int {
	if f.Concurrency > 0 {
		return f.Concurrency
	}
	return DefaultMapConcurrency
}

// MaxItemsOf returns f's item limit with the default filled in.
func (f *ForEach) MaxItemsOf() int {
	if f.MaxItems > 0 {
		return f.MaxItems
	}
	return DefaultMaxItems
}

// Collects reports whether failed items are collected, not fatal.
func (f *ForEach) Collects() bool { return f.OnItemError == ItemErrorCollect }

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
	case KindModel, KindNoop, KindParallel, KindWorkflow, KindAgent, KindApproval, KindSleep, KindWait:
		return EffectPure
	case KindHTTP:
		return EffectIdempotent
	case KindStore:
		// Reads change nothing; a write of the same value again is the
		// same write (the store kind answers it so).
		var w struct {
			Op string `json:"op"`
		}
		_ = json.Unmarshal(s.With, &w)
		if w.Op == "get" || w.Op == "list" {
			return EffectPure
		}
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

// ChildJobID is the id of the child job the run-th run of a parent job's
// workflow step starts: "<parent>-<step>-r<run>-<8 hex digits of a
// digest of the three>", the readable part cut to keep the id within 128
// characters.
func ChildJobID(parent, step string, run int) string {
	sum := sha256.Sum256([]byte(parent + "\x00" + step + "\x00" + strconv.Itoa(run)))
	tail := "-r" + strconv.Itoa(run) + "-" + hex.EncodeToString(sum[:4])
	head := parent + "-" + step
	if n := 128 - len(tail); len(head) > n {
		head = head[:n]
	}
	return head + tail
}
