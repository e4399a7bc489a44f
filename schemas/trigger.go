package schemas

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/expr-lang/expr"
	"github.com/expr-lang/expr/vm"
)

// Error codes of CloudEvents intake (engine/trigger). They extend the
// taxonomy in errors.go and are answered as the HTTP API's error codes.
const (
	// CodeEventInvalid: the request is not a valid CloudEvent (a
	// required attribute missing, a bad time, an unknown spec version);
	// the message names the attribute. HTTP 400.
	CodeEventInvalid Code = "event_invalid"
	// CodeUnsupportedMedia: the request's content type is neither a
	// CloudEvents format this intake reads (structured JSON, batch JSON)
	// nor a binary-mode request (ce- headers). HTTP 415.
	CodeUnsupportedMedia Code = "unsupported_media_type"
	// CodeNoTrigger: a valid CloudEvent that no live trigger rule takes
	// (no type, source or subject match, or every matching rule's filter
	// said false). Nothing was started or recorded. HTTP 422.
	CodeNoTrigger Code = "no_trigger"
)

// Sentinels of the intake codes, for errors.Is.
var (
	ErrEventInvalid     = &Error{Code: CodeEventInvalid}
	ErrUnsupportedMedia = &Error{Code: CodeUnsupportedMedia}
	ErrNoTrigger        = &Error{Code: CodeNoTrigger}
)

// Trigger is one rule of a workflow's triggers: a CloudEvent (CloudEvents
// 1.0, https://github.com/cloudevents/spec) that matches it starts a job
// of the workflow's latest stored definition. Type, Source and Subject
// match exactly, or, ending in '*', as a prefix ("com.example.order.*");
// an empty Source or Subject matches anything. Filter, an expr-lang
// boolean over the event, narrows further. Input maps the event to the
// job input, which must then pass the workflow's input schema.
type Trigger struct {
	Name    string `json:"name"`
	Type    string `json:"type"`
	Source  string `json:"source,omitempty"`
	Subject string `json:"subject,omitempty"`
	Filter  string `json:"filter,omitempty"`
	// Input is a JSON string (one expression whose value, an object, is
	// the input) or an object of member name to expression; absent, the
	// input is the event's data (which must then be a JSON object).
	Input json.RawMessage `json:"input,omitempty"`
}

// Matches reports whether an event of type typ, source and subject (empty
// when the event has none) is one t's patterns take; the filter is not
// evaluated here.
func (t *Trigger) Matches(typ, source, subject string) bool {
	return MatchPattern(t.Type, typ) &&
		(t.Source == "" || MatchPattern(t.Source, source)) &&
		(t.Subject == "" || MatchPattern(t.Subject, subject))
}

// MatchPattern reports whether value matches pattern: equal, or, for a
// pattern ending in '*', starting with what precedes the '*'.
func MatchPattern(pattern, value string) bool {
	if p, ok := strings.CutSuffix(pattern, "*"); ok {
		return strings.HasPrefix(value, p)
	}
	return pattern == value
}

// TriggerInput returns t's input mapping: whole, a single expression for
// the whole input, or fields, one expression per input member. Both empty
// means the event's data. Errors: t.Input is neither form.
func (t *Trigger) TriggerInput() (whole string, fields map[string]string, err error) {
	if len(bytes.TrimSpace(t.Input)) == 0 {
		return "", nil, nil
	}
	if err := json.Unmarshal(t.Input, &whole); err == nil {
		return whole, nil, nil
	}
	if err := json.Unmarshal(t.Input, &fields); err != nil {
		return "", nil, fmt.Errorf("trigger %s: input: want an expression or an object of member name to expression", t.Name)
	}
	return "", fields, nil
}

// TriggerEnv documents the names a trigger's filter and input expressions
// see. Event holds the CloudEvent's attributes as plain JSON values:
// "specversion", "type", "source", "id", "subject", "time" (RFC 3339 text),
// "datacontenttype", "dataschema", "data" (decoded JSON when the data is
// JSON, else its text) and "extensions" (by name); absent optional
// attributes are absent keys.
type TriggerEnv struct {
	Event map[string]any    `expr:"event"`
	Vars  map[string]string `expr:"vars"`
}

// TriggerFilterOptions are the expr-lang options of a trigger's filter:
// a boolean over TriggerEnv, now() disabled (the same event must match
// the same way when delivered again).
func TriggerFilterOptions() []expr.Option {
	return []expr.Option{expr.Env(TriggerEnv{}), expr.AsBool(), expr.DisableBuiltin("now")}
}

// TriggerInputOptions are the expr-lang options of a trigger's input
// expressions: any value over TriggerEnv, now() disabled.
func TriggerInputOptions() []expr.Option {
	return []expr.Option{expr.Env(TriggerEnv{}), expr.DisableBuiltin("now")}
}

// CompiledTrigger is a Trigger with its expressions compiled
// (CompileTrigger). Safe for concurrent use.
type CompiledTrigger struct {
	Trigger
	filter *vm.Program
	whole  *vm.Program
	fields map[string]*vm.Program
}

// CompileTrigger compiles t's filter and input expressions. Errors:
// ErrDefinitionInvalid naming the trigger and the expression.
func CompileTrigger(t Trigger) (*CompiledTrigger, error) {
	c := &CompiledTrigger{Trigger: t}
	var err error
	if t.Filter != "" {
		if c.filter, err = expr.Compile(t.Filter, TriggerFilterOptions()...); err != nil {
			return nil, Errorf(CodeDefinitionInvalid, "trigger %s: filter does not compile: %v", t.Name, err)
		}
	}
	whole, fields, err := t.TriggerInput()
	if err != nil {
		return nil, Errorf(CodeDefinitionInvalid, "%v", err)
	}
	if whole != "" {
		if c.whole, err = expr.Compile(whole, TriggerInputOptions()...); err != nil {
			return nil, Errorf(CodeDefinitionInvalid, "trigger %s: input does not compile: %v", t.Name, err)
		}
	}
	if len(fields) > 0 {
		c.fields = make(map[string]*vm.Program, len(fields))
		for k, src := range fields {
			if c.fields[k], err = expr.Compile(src, TriggerInputOptions()...); err != nil {
				return nil, Errorf(CodeDefinitionInvalid, "trigger %s: input.%s does not compile: %v", t.Name, k, err)
			}
		}
	}
	return c, nil
}

// Accepts evaluates the trigger's filter over env: true when it has none.
// Errors: the expression failed on this event (ErrInputInvalid naming the
// trigger).
func (c *CompiledTrigger) Accepts(env TriggerEnv) (bool, error) {
	if c.filter == nil {
		return true, nil
	}
	out, err := expr.Run(c.filter, env)
	if err != nil {
		return false, Errorf(CodeInputInvalid, "trigger %s: filter failed on the event: %v", c.Name, err)
	}
	ok, _ := out.(bool)
	return ok, nil
}

// Map maps the event in env to a job input (compact JSON). Errors:
// ErrInputInvalid when an expression fails on the event, or the input is
// not a JSON object.
func (c *CompiledTrigger) Map(env TriggerEnv) (json.RawMessage, error) {
	var v any
	switch {
	case c.whole != nil:
		out, err := expr.Run(c.whole, env)
		if err != nil {
			return nil, Errorf(CodeInputInvalid, "trigger %s: input failed on the event: %v", c.Name, err)
		}
		v = out
	case c.fields != nil:
		names := make([]string, 0, len(c.fields))
		for k := range c.fields {
			names = append(names, k)
		}
		sort.Strings(names)
		m := make(map[string]any, len(names))
		for _, k := range names {
			out, err := expr.Run(c.fields[k], env)
			if err != nil {
				return nil, Errorf(CodeInputInvalid, "trigger %s: input.%s failed on the event: %v", c.Name, k, err)
			}
			m[k] = out
		}
		v = m
	default:
		v = env.Event["data"]
	}
	if v == nil {
		v = map[string]any{}
	}
	if _, ok := v.(map[string]any); !ok {
		return nil, Errorf(CodeInputInvalid, "trigger %s: the job input must be a JSON object; the mapping gave %s (map the event's data to an object with input:)", c.Name, jsonKind(v))
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, Errorf(CodeInputInvalid, "trigger %s: input is not JSON: %v", c.Name, err)
	}
	return b, nil
}

// TriggerJobID is the id of the job trigger rule trigger of workflow
// starts for the event (source, id): "<workflow>-<trigger>-<16 hex digits
// of a SHA-256 of the four>", the readable part cut to keep the id within
// 128 characters. The same event always names the same job, so a
// delivery that comes again after a crash between the start and the
// dedup record attaches to the job the first one started.
func TriggerJobID(workflow, trigger, source, id string) string {
	sum := sha256.Sum256([]byte(workflow + "\x00" + trigger + "\x00" + source + "\x00" + id))
	tail := "-" + hex.EncodeToString(sum[:8])
	head := workflow + "-" + trigger
	if n := 128 - len(tail); len(head) > n {
		head = head[:n]
	}
	return head + tail
}

// EventRecord is what the events bucket keeps of a CloudEvent that started
// jobs, under EventKey(Source, ID): the dedup record that makes a later
// delivery of the same event answer the same jobs and start nothing.
type EventRecord struct {
	Source     string     `json:"source"`
	ID         string     `json:"id"`
	Type       string     `json:"type"`
	ReceivedAt time.Time  `json:"received_at"`
	Jobs       []EventJob `json:"jobs"`
}

// EventJob is one job an event started: by which trigger of which
// workflow.
type EventJob struct {
	Trigger  string `json:"trigger"`
	Workflow string `json:"workflow"`
	JobID    string `json:"job_id"`
}

// EventKey is the events bucket key of the event (source, id): "e." and
// the hex SHA-256 of both (KV keys cannot hold every character a source
// or id may).
func EventKey(source, id string) string {
	sum := sha256.Sum256([]byte(source + "\x00" + id))
	return "e." + hex.EncodeToString(sum[:])
}

// checkTriggers finds what the schema cannot in d's triggers: duplicate
// names, a '*' anywhere but at the end of a pattern, and expressions that
// do not compile.
func checkTriggers(d *Definition) []Problem {
	var ps []Problem
	seen := map[string]int{}
	for i, t := range d.Triggers {
		base := fmt.Sprintf("/triggers/%d", i)
		if j, dup := seen[t.Name]; dup {
			ps = append(ps, Problem{Path: base + "/name", Message: fmt.Sprintf("duplicate trigger name %q (first at triggers[%d])", t.Name, j)})
		} else {
			seen[t.Name] = i
		}
		for _, p := range []struct{ field, pattern string }{{"type", t.Type}, {"source", t.Source}, {"subject", t.Subject}} {
			if strings.Contains(strings.TrimSuffix(p.pattern, "*"), "*") {
				ps = append(ps, Problem{Path: base + "/" + p.field, Message: fmt.Sprintf("%s %q: '*' may only end a pattern (a prefix match)", p.field, p.pattern)})
			}
		}
		if t.Filter != "" {
			if _, err := expr.Compile(t.Filter, TriggerFilterOptions()...); err != nil {
				ps = append(ps, Problem{Path: base + "/filter", Message: fmt.Sprintf("filter does not compile (it sees event.type, event.source, event.subject, event.id, event.time, event.data, event.extensions and vars): %v", err)})
			}
		}
		whole, fields, err := t.TriggerInput()
		if err != nil {
			ps = append(ps, Problem{Path: base + "/input", Message: err.Error()})
			continue
		}
		if whole != "" {
			if _, err := expr.Compile(whole, TriggerInputOptions()...); err != nil {
				ps = append(ps, Problem{Path: base + "/input", Message: fmt.Sprintf("input does not compile: %v", err)})
			}
		}
		names := make([]string, 0, len(fields))
		for k := range fields {
			names = append(names, k)
		}
		sort.Strings(names)
		for _, k := range names {
			if _, err := expr.Compile(fields[k], TriggerInputOptions()...); err != nil {
				ps = append(ps, Problem{Path: base + "/input/" + escapePointer(k), Message: fmt.Sprintf("input.%s does not compile: %v", k, err)})
			}
		}
	}
	return ps
}
