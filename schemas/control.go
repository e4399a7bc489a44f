package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"text/template"
	"time"

	"github.com/expr-lang/expr"
)

// Step kinds the engine performs while a job waits: no worker runs them.
const (
	// KindApproval stops the job in JobWaitingApproval until a person
	// approves or rejects the action its settings describe
	// (ApprovalSettings); approved, its output is an ApprovalOutput.
	KindApproval = "approval"
	// KindSleep waits for a duration (SleepSettings) on a durable timer (a
	// JetStream message schedule): a timer due while every engine was down
	// fires once, after restart. Its output is {"slept_ms": N}.
	KindSleep = "sleep"
	// KindWait waits for a named signal (WaitSettings), sent with engine
	// signal; its output is a SignalOutput. A signal that comes before the
	// job waits for it is kept for the wait step.
	KindWait = "wait"
	// KindStore reads and writes the session store (see package steps and
	// kv.SessionStore); workers perform it.
	KindStore = "store"
)

// WaitSettings are the with settings of a wait step.
type WaitSettings struct {
	// Signal is the name waited for: 1 to 64 letters, digits, '_' and '-'.
	Signal string `json:"signal"`
	// Schema is a JSON Schema the signal's data must satisfy; a signal
	// whose data does not is refused (engine signal says why).
	Schema json.RawMessage `json:"schema,omitempty"`
	// When is an expr-lang condition over data (the signal's) and state: a
	// signal for which it is false is kept for a later wait, not taken.
	When string `json:"when,omitempty"`
	// Timeout fails the step with code timeout when no signal came in
	// time (a durable timer); 0 waits without end.
	Timeout Duration `json:"timeout,omitempty"`
}

// SignalOutput is a wait step's output: the signal it took.
type SignalOutput struct {
	Signal string          `json:"signal"`
	ID     string          `json:"id"`
	Data   json.RawMessage `json:"data"`
	By     string          `json:"by,omitempty"`
	At     time.Time       `json:"at"`
}

// ReceivedSignal is a signal a job has received: kept until a wait step
// takes it (Taken names the step), then for the record; the checkpoint
// keeps the last MaxKeptSignals.
type ReceivedSignal struct {
	ID    string          `json:"id"`
	Name  string          `json:"name"`
	Data  json.RawMessage `json:"data,omitempty"`
	By    string          `json:"by,omitempty"`
	At    time.Time       `json:"at"`
	Taken string          `json:"taken,omitempty"`
	// Refused says why the wait step it was for did not take it (its
	// data broke the step's schema, or its condition failed on it).
	Refused string `json:"refused,omitempty"`
	// Outcome is what became of it when it came: taken, kept, refused or
	// dropped (MaxKeptSignals were kept already); set on LastSignal.
	Outcome string `json:"outcome,omitempty"`
}

// MaxKeptSignals bounds the signals a checkpoint keeps: those not taken
// first, then the latest taken. A signal past the bound with none taken to
// drop is refused.
const MaxKeptSignals = 32

// signalName is the form of a signal's name.
var signalName = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// CheckSignalName reports whether name can name a signal.
func CheckSignalName(name string) error {
	if !signalName.MatchString(name) {
		return fmt.Errorf("signal name %q: want 1 to 64 letters, digits, '_' and '-'", name)
	}
	return nil
}

// WaitOf decodes the settings of wait step s; errors name the step.
func WaitOf(s *Step) (WaitSettings, error) {
	var w WaitSettings
	if len(s.With) == 0 {
		return w, fmt.Errorf("step %s: a wait step needs with.signal", s.ID)
	}
	dec := json.NewDecoder(bytes.NewReader(s.With))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&w); err != nil {
		return w, fmt.Errorf("step %s: with: %w", s.ID, err)
	}
	if err := CheckSignalName(w.Signal); err != nil {
		return w, fmt.Errorf("step %s: with.signal: %w", s.ID, err)
	}
	if w.Timeout < 0 || (w.Timeout > 0 && time.Duration(w.Timeout) < time.Second) {
		return w, fmt.Errorf("step %s: with.timeout %v: want at least 1s (the timer's resolution), or none", s.ID, time.Duration(w.Timeout))
	}
	return w, nil
}

// ApprovalSettings are the with settings of an approval step, and the
// value of requires_approval on a step that performs an effect.
type ApprovalSettings struct {
	// Action is what the approver is asked to allow: a text/template over
	// .state, .vars, .job and .step (the functions of idempotency_key),
	// rendered by the engine when the gate opens. Empty: "run step S".
	Action string `json:"action,omitempty"`
	// Data is the dotted state path of the value the approval binds to,
	// besides the action: its digest covers both. Empty: the whole state.
	Data string `json:"data,omitempty"`
	// Approvers are who may decide (the by of approve and reject); empty:
	// anyone who can reach the job.
	Approvers []string `json:"approvers,omitempty"`
	// ExpiresIn is how long the gate stays open (0: until decided). Past
	// it the gate expires: the step fails with CodeApprovalExpired and the
	// job follows the step's on_error, or fails.
	ExpiresIn Duration `json:"expires_in,omitempty"`
	// Scope bounds what the approval allows: the rendered request of each
	// of Steps (the guarded step itself for requires_approval) must meet
	// When when the effect runs, or it is not sent (CodeApprovalScope).
	Scope *ApprovalScope `json:"scope,omitempty"`
}

// ApprovalScope is an approval's scope: an expr-lang condition over
// .request (method, url, body: decoded when JSON) that the named
// steps' requests must meet when they run, checked by the worker.
type ApprovalScope struct {
	Steps []string `json:"steps,omitempty"`
	When  string   `json:"when"`
}

// SleepSettings are the with settings of a sleep step.
type SleepSettings struct {
	For Duration `json:"for"` // how long, from the step's dispatch; at least 1s
}

// ApprovalOf decodes the settings of approval step s (its with), or of a
// step's requires_approval; errors name the step.
func ApprovalOf(s *Step) (*ApprovalSettings, error) {
	if s.Kind != KindApproval {
		return s.RequiresApproval, nil
	}
	a := new(ApprovalSettings)
	if len(s.With) == 0 {
		return a, nil
	}
	dec := json.NewDecoder(bytes.NewReader(s.With))
	dec.DisallowUnknownFields()
	if err := dec.Decode(a); err != nil {
		return nil, fmt.Errorf("step %s: with: %w", s.ID, err)
	}
	return a, nil
}

// SleepOf decodes the settings of sleep step s; errors name the step.
func SleepOf(s *Step) (SleepSettings, error) {
	var z SleepSettings
	dec := json.NewDecoder(bytes.NewReader(s.With))
	dec.DisallowUnknownFields()
	if len(s.With) == 0 {
		return z, fmt.Errorf("step %s: a sleep step needs with.for (a duration such as 15m)", s.ID)
	}
	if err := dec.Decode(&z); err != nil {
		return z, fmt.Errorf("step %s: with: %w", s.ID, err)
	}
	if z.For == 0 {
		return z, fmt.Errorf("step %s: with.for is required: how long to sleep, such as 15m", s.ID)
	}
	if time.Duration(z.For) < time.Second {
		return z, fmt.Errorf("step %s: with.for is %v: a sleep lasts at least 1s (the timer's resolution)", s.ID, time.Duration(z.For))
	}
	return z, nil
}

// ParseApprovalAction parses an approval's action template; nil when empty.
func ParseApprovalAction(stepID, text string) (*template.Template, error) {
	if text == "" {
		return nil, nil
	}
	t, err := template.New(stepID + ".action").Option("missingkey=error").Funcs(effectKeyFuncs()).Parse(text)
	if err != nil && strings.Contains(err.Error(), `function "secret" not defined`) {
		return nil, fmt.Errorf("template %s.action: {{secret}} is not allowed here: an approval's action is stored and shown to people", stepID)
	}
	if err != nil {
		return nil, fmt.Errorf("action: %w", err)
	}
	return t, nil
}

// RenderTemplate renders t (an idempotency_key or approval action
// template) over .state (decoded from state), .vars, .job and .step. It
// returns the decode or execution error.
func RenderTemplate(t *template.Template, job, step string, state json.RawMessage, vars map[string]string) (string, error) {
	return RenderTemplateWith(t, job, step, state, vars, nil)
}

// RenderTemplateWith is RenderTemplate with more names (an agent tool
// call's .args, say) beside .state, .vars, .job and .step.
func RenderTemplateWith(t *template.Template, job, step string, state json.RawMessage, vars map[string]string, more map[string]any) (string, error) {
	var doc map[string]any
	if len(state) > 0 {
		if err := json.Unmarshal(state, &doc); err != nil {
			return "", fmt.Errorf("decode state: %w", err)
		}
	}
	if doc == nil {
		doc = map[string]any{}
	}
	data := map[string]any{"state": doc, "vars": vars, "job": job, "step": step}
	for k, v := range more {
		data[k] = v
	}
	var b strings.Builder
	if err := t.Execute(&b, data); err != nil {
		return "", err
	}
	return b.String(), nil
}

// checkControls reports what is wrong with the approval and sleep steps
// of d and with requires_approval settings.
func checkControls(d *Definition) []Problem {
	var ps []Problem
	add := func(path, format string, args ...any) {
		ps = append(ps, Problem{Path: path, Message: fmt.Sprintf(format, args...)})
	}
	if d.Deadline != 0 && (d.Deadline < 0 || time.Duration(d.Deadline) < time.Second) {
		add("/deadline", "deadline is %v: want at least 1s (the timer's resolution), or none", time.Duration(d.Deadline))
	}
	branch := map[string]string{}
	for _, s := range d.Steps {
		for _, b := range s.Branches {
			branch[b] = s.ID
		}
	}
	for i := range d.Steps {
		s := &d.Steps[i]
		for j, t := range s.Tools {
			if set := t.RequiresApproval; set != nil {
				at := fmt.Sprintf("/steps/%d/tools/%d/requires_approval", i, j)
				if _, err := ParseApprovalAction(s.ID+"."+t.Name, set.Action); err != nil {
					add(at+"/action", "%v", err)
				}
				if set.Data != "" {
					add(at+"/data", "a tool's approval binds to the call's arguments: data is for steps")
				}
				if set.ExpiresIn < 0 || (set.ExpiresIn > 0 && time.Duration(set.ExpiresIn) < time.Second) {
					add(at+"/expires_in", "expires_in is %v: want at least 1s (the timer's resolution), or none (open until decided)", time.Duration(set.ExpiresIn))
				}
			}
		}
	}
	for i := range d.Steps {
		s := &d.Steps[i]
		if s.ValidFor == 0 {
			continue
		}
		at := fmt.Sprintf("/steps/%d/valid_for", i)
		switch {
		case s.ValidFor < 0 || time.Duration(s.ValidFor) < time.Second:
			add(at, "valid_for is %v: want at least 1s, or none (good for ever)", time.Duration(s.ValidFor))
		case EngineKind(s.Kind) || s.Kind == KindAgent || s.ForEach != nil:
			add(at, "valid_for is for a step a worker runs once per run (not %s steps or maps)", s.Kind)
		case branch[s.ID] != "":
			add(at, "valid_for is not supported on a parallel branch (%s)", branch[s.ID])
		}
	}
	for i := range d.Steps {
		s := &d.Steps[i]
		base := fmt.Sprintf("/steps/%d", i)
		gate := s.Kind == KindApproval || s.RequiresApproval != nil
		what := "an approval step"
		switch {
		case s.Kind == KindSleep:
			what = "a sleep step"
			if _, err := SleepOf(s); err != nil {
				add(base+"/with", "%v", err)
			}
		case s.Kind == KindWait:
			what = "a wait step"
			if w, err := WaitOf(s); err != nil {
				add(base+"/with", "%v", err)
			} else if _, err := CompileSchema(base+"/with/schema", w.Schema); err != nil {
				add(base+"/with/schema", "%s", AsError(err).Message)
			}
		case s.Kind == KindApproval && s.RequiresApproval != nil:
			add(base+"/requires_approval", "an approval step is a gate already; requires_approval is for steps that do something")
		case s.RequiresApproval != nil:
			what = "a step with requires_approval"
			if EngineKind(s.Kind) || s.Kind == KindAgent {
				add(base+"/requires_approval", "requires_approval is for steps a worker runs, not %s steps", s.Kind)
			}
		}
		if !gate && s.Kind != KindSleep && s.Kind != KindWait {
			continue
		}
		if p := branch[s.ID]; p != "" {
			add(base, "%s cannot be a branch of parallel step %q (a branch's gate or timer is not supported yet); put it before or after the parallel step", what, p)
		}
		if s.ForEach != nil {
			add(base+"/for_each", "%s cannot be a map", what)
		}
		if (s.Kind == KindApproval || s.Kind == KindSleep || s.Kind == KindWait) && s.IdempotencyKey != "" {
			add(base+"/idempotency_key", "%s performs no effect: it has no idempotency key", what)
		}
		if !gate {
			continue
		}
		set, err := ApprovalOf(s)
		if err != nil {
			add(base+"/with", "%v", err)
			continue
		}
		at := base + "/with"
		if s.Kind != KindApproval {
			at = base + "/requires_approval"
		}
		if _, err := ParseApprovalAction(s.ID, set.Action); err != nil {
			add(at+"/action", "%v", err)
		}
		if set.ExpiresIn < 0 || (set.ExpiresIn > 0 && time.Duration(set.ExpiresIn) < time.Second) {
			add(at+"/expires_in", "expires_in is %v: want at least 1s (the timer's resolution), or none (open until decided)", time.Duration(set.ExpiresIn))
		}
		for j, a := range set.Approvers {
			if strings.TrimSpace(a) == "" {
				add(fmt.Sprintf("%s/approvers/%d", at, j), "an approver's name is empty")
			}
		}
	}
	return ps
}

// Migratable reports whether the job can move to another definition: it
// failed, waits for approval, is blocked on its definition, or is paused
// with nothing in flight (its next dispatch held); never in a parallel,
// map or agent step.
func (cp *Checkpoint) Migratable() bool {
	if cp.Fan != nil {
		return false
	}
	switch cp.Status {
	case JobFailed, JobWaitingApproval, JobBlocked:
		return true
	case JobRunning:
		return cp.Paused != nil && (cp.Current == nil || cp.Current.Held)
	}
	return false
}

// EngineKind reports whether steps of kind are performed by the engine
// (parallel, workflow, approval, sleep): no worker pool runs them.
func EngineKind(kind string) bool {
	switch kind {
	case KindParallel, KindWorkflow, KindApproval, KindSleep, KindWait:
		return true
	}
	return false
}

// ApprovalStatus is where an approval gate stands.
type ApprovalStatus string

// Approval statuses; all but ApprovalPending are final.
const (
	ApprovalPending  ApprovalStatus = "pending"
	ApprovalApproved ApprovalStatus = "approved"
	ApprovalRejected ApprovalStatus = "rejected"
	ApprovalExpired  ApprovalStatus = "expired"
)

// Approval is one gate of a job: the exact action proposed, who may
// decide, until when, and the decision once made. Gate is the step id;
// ID is "<gate>/<run>", unique within the job. Digest is the hex SHA-256
// of the canonical JSON {gate, action, data, with, effect_key}: an
// approve or reject naming another digest is refused, so a changed
// action needs a new approval (the seeds' "save exactly what was
// approved, its scope, and an expiry"). Data is a copy of the bound
// value when it is at most 2 KiB (a larger one is bound by the digest
// alone).
type Approval struct {
	ID          string          `json:"id"`
	Gate        string          `json:"gate"`
	Run         int             `json:"run"`
	Digest      string          `json:"digest"`
	Action      string          `json:"action"`
	Data        json.RawMessage `json:"data,omitempty"`
	Scope       *ApprovalScope  `json:"scope,omitempty"`
	Approvers   []string        `json:"approvers,omitempty"`
	Status      ApprovalStatus  `json:"status"`
	RequestedAt time.Time       `json:"requested_at"`
	ExpiresAt   *time.Time      `json:"expires_at,omitempty"`
	DecidedBy   string          `json:"decided_by,omitempty"`
	DecidedAt   *time.Time      `json:"decided_at,omitempty"`
	Reason      string          `json:"reason,omitempty"`
}

// ApprovalOutput is an approval step's output, and what the step a
// requires_approval gate guarded carries to its worker.
type ApprovalOutput struct {
	Approved  bool      `json:"approved"`
	By        string    `json:"by"`
	Reason    string    `json:"reason,omitempty"`
	Digest    string    `json:"digest"`
	DecidedAt time.Time `json:"decided_at"`
}

// ControlRecord names a control request an engine applied: the
// caller's id for it, its signal type, who sent it and when it applied.
type ControlRecord struct {
	ID   string    `json:"id"`
	Type string    `json:"type"`
	By   string    `json:"by"`
	At   time.Time `json:"at"`
}

// Refresh is a step run again because its output expired (valid_for)
// before Then, the step that was about to be dispatched, which follows it.
type Refresh struct {
	Step string `json:"step,omitempty"` // the step running again; empty between two
	Then string `json:"then"`
	// Done are the steps run again for Then already: each runs again
	// once, so outputs that expire faster than they are made end no loop.
	Done []string `json:"done,omitempty"`
}

// ScopeRequest is what an approval's scope condition sees as .request:
// the rendered request of the step it covers (its headers, which may hold
// secrets, are not shown).
type ScopeRequest struct {
	Method string `expr:"method"`
	URL    string `expr:"url"`
	Body   any    `expr:"body"` // decoded when JSON, else the text
}

// scopeEnv documents the names a scope condition sees.
type scopeEnv struct {
	Request ScopeRequest `expr:"request"`
}

// ScopeOptions are the expr-lang options of scope conditions.
func ScopeOptions() []expr.Option {
	return []expr.Option{expr.Env(scopeEnv{}), expr.AsBool(), expr.DisableBuiltin("now")}
}

// CheckScope reports whether req meets scope condition when: nil, or an
// error saying the request left the scope (or the condition failed).
func CheckScope(when string, req ScopeRequest) error {
	prog, err := expr.Compile(when, ScopeOptions()...)
	if err != nil {
		return fmt.Errorf("scope condition %q does not compile: %w", when, err)
	}
	out, err := expr.Run(prog, scopeEnv{Request: req})
	if err != nil {
		return fmt.Errorf("scope condition %q failed on the request: %w", when, err)
	}
	if ok, _ := out.(bool); !ok {
		return fmt.Errorf("the request is outside the scope %q", when)
	}
	return nil
}

// Pause records that a person paused a job: running steps finish,
// nothing new is dispatched (new dispatches are recorded Held) until
// resumed.
type Pause struct {
	By     string    `json:"by"`
	Reason string    `json:"reason,omitempty"`
	At     time.Time `json:"at"`
}

// PendingApproval returns cp's pending approval of gate, or nil.
func (cp *Checkpoint) PendingApproval(gate string) *Approval {
	for _, a := range cp.Approvals {
		if a.Gate == gate && a.Status == ApprovalPending {
			return a
		}
	}
	return nil
}

// ApprovalByID returns cp's approval with id, or nil.
func (cp *Checkpoint) ApprovalByID(id string) *Approval {
	for _, a := range cp.Approvals {
		if a.ID == id {
			return a
		}
	}
	return nil
}
