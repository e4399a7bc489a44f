package schemas

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Step messages and results travel in binary mode, as CloudEvents' NATS
// binding does: the small attributes in message headers, the payload (the
// job's state, the step's output) as the body, untouched. A worker whose
// step does not read the state never parses it, and no one re-encodes it.
//
// The header map is a NATS header (nats.Header is a map[string][]string
// whose keys are case-sensitive).

// Header names.
const (
	HeaderJob            = "Waymark-Job"
	HeaderStep           = "Waymark-Step"
	HeaderAttempt        = "Waymark-Attempt"
	HeaderRunAttempt     = "Waymark-Run-Attempt"
	HeaderDefinition     = "Waymark-Definition"
	HeaderNotBefore      = "Waymark-Not-Before" // RFC 3339 with nanoseconds
	HeaderIdempotencyKey = "Waymark-Idempotency-Key"
	HeaderVars           = "Waymark-Vars" // JSON object of strings
	HeaderOutcome        = "Waymark-Outcome"
	HeaderDurationMs     = "Waymark-Duration-Ms"
	HeaderRedelivered    = "Waymark-Redelivered"
	HeaderWorker         = "Waymark-Worker"
	HeaderEffectKey      = "Waymark-Effect-Key"
	HeaderEffectState    = "Waymark-Effect-State"
	// HeaderItem is a map item's number, from 1; HeaderItemName its name
	// (its key, or "item-<index>"); HeaderItemBytes the length of the item
	// value, which comes first in the body, the state after it.
	HeaderItem      = "Waymark-Item"
	HeaderItemName  = "Waymark-Item-Name"
	HeaderItemBytes = "Waymark-Item-Bytes"
	// HeaderValueOwner names the owner of the values the state refers to.
	HeaderValueOwner = "Waymark-Value-Owner"
	// HeaderStreamEnd marks the last message of an agent turn's text on
	// the job's stream subject (no data): the turn's call has returned.
	HeaderStreamEnd = "Waymark-Stream-End"
	// HeaderScope and HeaderScopeOf carry StepMessage.Scope and ScopeOf.
	HeaderScope   = "Waymark-Approval-Scope"
	HeaderScopeOf = "Waymark-Approval"
	// HeaderTool names the agent tool a tool call runs; HeaderTurn is an
	// agent turn's number and HeaderTranscript its transcript parts, as
	// "<digest>:<bytes>:<messages>" joined by commas.
	HeaderTool       = "Waymark-Tool"
	HeaderTurn       = "Waymark-Agent-Turn"
	HeaderTranscript = "Waymark-Transcript"
)

// Outcomes of a result.
const (
	OutcomeOK    = "ok"    // the body is the step's output
	OutcomeError = "error" // the body is the *Error as JSON
)

// EncodeStepMessage writes m's attributes into h and returns the body.
func EncodeStepMessage(m *StepMessage, h map[string][]string) ([]byte, error) {
	set := func(k, v string) { h[k] = []string{v} }
	set(HeaderJob, m.Job)
	set(HeaderStep, m.Step)
	set(HeaderAttempt, strconv.Itoa(m.Attempt))
	set(HeaderRunAttempt, strconv.Itoa(m.RunAttempt))
	set(HeaderDefinition, m.DefinitionHash)
	set(HeaderIdempotencyKey, m.IdempotencyKey)
	if m.NotBefore != nil {
		set(HeaderNotBefore, m.NotBefore.UTC().Format(time.RFC3339Nano))
	}
	if len(m.Vars) > 0 {
		w := jsonw{}
		w.strMap(m.Vars)
		set(HeaderVars, string(w.b))
	}
	if m.EffectKey != "" {
		set(HeaderEffectKey, m.EffectKey)
	}
	if m.ValueOwner != "" {
		set(HeaderValueOwner, m.ValueOwner)
	}
	if m.Tool != "" {
		set(HeaderTool, m.Tool)
	}
	if m.Scope != "" {
		set(HeaderScope, m.Scope)
		set(HeaderScopeOf, m.ScopeOf)
	}
	if m.Turn > 0 {
		set(HeaderTurn, strconv.Itoa(m.Turn))
		var parts []byte
		for i, p := range m.Transcript {
			if i > 0 {
				parts = append(parts, ',')
			}
			parts = append(parts, p.Digest...)
			parts = append(parts, ':')
			parts = strconv.AppendInt(parts, int64(p.Bytes), 10)
			parts = append(parts, ':')
			parts = strconv.AppendInt(parts, int64(p.Messages), 10)
		}
		if len(parts) > 0 {
			set(HeaderTranscript, string(parts))
		}
	}
	state := m.State
	if len(state) == 0 {
		state = []byte("{}")
	}
	if m.Item == 0 {
		return state, nil
	}
	set(HeaderItem, strconv.Itoa(m.Item))
	set(HeaderItemName, m.ItemName)
	set(HeaderItemBytes, strconv.Itoa(len(m.ItemValue)))
	body := make([]byte, 0, len(m.ItemValue)+len(state))
	return append(append(body, m.ItemValue...), state...), nil
}

// DecodeStepMessage reads a step message from its headers and body. The
// returned State aliases body. Errors name the missing or bad attribute.
func DecodeStepMessage(h map[string][]string, body []byte) (*StepMessage, error) {
	get := func(k string) string {
		if v := h[k]; len(v) > 0 {
			return v[0]
		}
		return ""
	}
	m := &StepMessage{Job: get(HeaderJob), Step: get(HeaderStep), DefinitionHash: get(HeaderDefinition),
		IdempotencyKey: get(HeaderIdempotencyKey), EffectKey: get(HeaderEffectKey), ValueOwner: get(HeaderValueOwner), State: body}
	var err error
	if m.Attempt, err = positive(get(HeaderAttempt)); err != nil {
		return nil, fmt.Errorf("step message: %s: %w", HeaderAttempt, err)
	}
	if m.RunAttempt, err = positive(get(HeaderRunAttempt)); err != nil {
		return nil, fmt.Errorf("step message: %s: %w", HeaderRunAttempt, err)
	}
	switch {
	case m.Job == "":
		return nil, fmt.Errorf("step message: no %s header", HeaderJob)
	case m.Step == "":
		return nil, fmt.Errorf("step message: no %s header", HeaderStep)
	case m.DefinitionHash == "":
		return nil, fmt.Errorf("step message: no %s header", HeaderDefinition)
	}
	if s := get(HeaderNotBefore); s != "" {
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			return nil, fmt.Errorf("step message: %s: %w", HeaderNotBefore, err)
		}
		m.NotBefore = &t
	}
	if s := get(HeaderVars); s != "" {
		if err := json.Unmarshal([]byte(s), &m.Vars); err != nil {
			return nil, fmt.Errorf("step message: %s: %w", HeaderVars, err)
		}
	}
	m.Tool = get(HeaderTool)
	m.Scope, m.ScopeOf = get(HeaderScope), get(HeaderScopeOf)
	if s := get(HeaderTurn); s != "" {
		if m.Turn, err = positive(s); err != nil {
			return nil, fmt.Errorf("step message: %s: %w", HeaderTurn, err)
		}
		if m.Transcript, err = decodeTranscript(get(HeaderTranscript)); err != nil {
			return nil, fmt.Errorf("step message: %s: %w", HeaderTranscript, err)
		}
	}
	if s := get(HeaderItem); s != "" {
		if m.Item, err = positive(s); err != nil {
			return nil, fmt.Errorf("step message: %s: %w", HeaderItem, err)
		}
		n, err := strconv.Atoi(get(HeaderItemBytes))
		if err != nil || n < 1 || n > len(body) {
			return nil, fmt.Errorf("step message: %s is %q for a body of %d bytes", HeaderItemBytes, get(HeaderItemBytes), len(body))
		}
		m.ItemName, m.ItemValue, m.State = get(HeaderItemName), body[:n:n], body[n:]
	}
	return m, nil
}

// EncodeStepResult writes r's attributes into h and returns the body: the
// output, or the error as JSON.
func EncodeStepResult(r *StepResult, h map[string][]string) ([]byte, error) {
	set := func(k, v string) { h[k] = []string{v} }
	set(HeaderJob, r.Job)
	set(HeaderStep, r.Step)
	set(HeaderAttempt, strconv.Itoa(r.Attempt))
	set(HeaderDurationMs, strconv.FormatInt(r.DurationMs, 10))
	if r.Item != 0 {
		set(HeaderItem, strconv.Itoa(r.Item))
	}
	if r.Redelivered {
		set(HeaderRedelivered, "true")
	}
	if r.Worker != "" {
		set(HeaderWorker, r.Worker)
	}
	if r.EffectKey != "" {
		set(HeaderEffectKey, r.EffectKey)
	}
	if r.EffectState != "" {
		set(HeaderEffectState, string(r.EffectState))
	}
	if r.Error != nil {
		set(HeaderOutcome, OutcomeError)
		w := jsonw{}
		w.error(r.Error)
		return w.b, nil
	}
	set(HeaderOutcome, OutcomeOK)
	if len(r.Output) == 0 {
		return []byte("null"), nil
	}
	return r.Output, nil
}

// DecodeStepResult reads a step result from its headers and body. The
// returned Output aliases body.
func DecodeStepResult(h map[string][]string, body []byte) (*StepResult, error) {
	get := func(k string) string {
		if v := h[k]; len(v) > 0 {
			return v[0]
		}
		return ""
	}
	r := &StepResult{Job: get(HeaderJob), Step: get(HeaderStep), Worker: get(HeaderWorker), Redelivered: get(HeaderRedelivered) == "true",
		EffectKey: get(HeaderEffectKey), EffectState: EffectState(get(HeaderEffectState))}
	var err error
	if r.Attempt, err = positive(get(HeaderAttempt)); err != nil {
		return nil, fmt.Errorf("step result: %s: %w", HeaderAttempt, err)
	}
	if s := get(HeaderDurationMs); s != "" {
		if r.DurationMs, err = strconv.ParseInt(s, 10, 64); err != nil {
			return nil, fmt.Errorf("step result: %s: %w", HeaderDurationMs, err)
		}
	}
	if s := get(HeaderItem); s != "" {
		if r.Item, err = positive(s); err != nil {
			return nil, fmt.Errorf("step result: %s: %w", HeaderItem, err)
		}
	}
	if r.Job == "" || r.Step == "" {
		return nil, fmt.Errorf("step result: no %s or %s header", HeaderJob, HeaderStep)
	}
	switch get(HeaderOutcome) {
	case OutcomeOK:
		r.Output = body
	case OutcomeError:
		r.Error = &Error{}
		if err := json.Unmarshal(body, r.Error); err != nil || r.Error.Code == "" {
			return nil, fmt.Errorf("step result: error body is not an error object: %v", err)
		}
	default:
		return nil, fmt.Errorf("step result: %s is %q, want %q or %q", HeaderOutcome, get(HeaderOutcome), OutcomeOK, OutcomeError)
	}
	return r, nil
}

func positive(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0, fmt.Errorf("%q is not a number", s)
	}
	if n < 1 {
		return 0, fmt.Errorf("%d is below 1", n)
	}
	return n, nil
}

// decodeTranscript reads HeaderTranscript.
func decodeTranscript(s string) ([]TranscriptPart, error) {
	if s == "" {
		return nil, nil
	}
	var parts []TranscriptPart
	for _, p := range strings.Split(s, ",") {
		f := strings.Split(p, ":")
		if len(f) != 4 || f[0] != "sha256" {
			return nil, fmt.Errorf("part %q: want sha256:<hex>:<bytes>:<messages>", p)
		}
		n, err1 := strconv.Atoi(f[2])
		k, err2 := strconv.Atoi(f[3])
		r := ValueRef{Digest: f[0] + ":" + f[1], Bytes: n}
		if err1 != nil || err2 != nil || k < 1 || !r.Valid() {
			return nil, fmt.Errorf("part %q: want sha256:<hex>:<bytes>:<messages>", p)
		}
		parts = append(parts, TranscriptPart{Digest: r.Digest, Bytes: r.Bytes, Messages: k})
	}
	return parts, nil
}
