package schemas

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"text/template"
	"time"
)

// Flow control: how many dispatches of a step may run at once (per key),
// how many may start per period (per step and key, or per worker pool),
// and which waiting dispatch goes first. The engine enforces them when it
// records a dispatch, across engines, through the flow bucket (kv.Flow);
// a dispatch over a limit is recorded waiting (Dispatch.Waiting), not
// published, and goes out when a slot or a window frees. The ideas are
// Inngest's concurrency keys and throttles and Hatchet's priority queues.

// Bounds of the flow settings.
const (
	// MaxConcurrencyLimit bounds Concurrency.Limit: each slot is a key of
	// the flow bucket that acquiring may try.
	MaxConcurrencyLimit = 1000
	// MinRatePeriod is the shortest RateLimit.Period: a window ends on a
	// durable timer, whose resolution is the second.
	MinRatePeriod = time.Second
	// MaxPriority bounds priorities (0..MaxPriority; higher goes first).
	MaxPriority = 100
)

// Concurrency limits the dispatches of a step running at once: from the
// dispatch until its result is applied (or the job ends), at most Limit
// per value of Key across every job of the workflow.
type Concurrency struct {
	// Limit is the most running at once, 1..MaxConcurrencyLimit.
	Limit int `json:"limit"`
	// Key, a text/template over .state, .vars and .job (the functions of
	// idempotency_key), splits the limit: one limit per rendered value (per
	// customer, say). Empty: one limit for the step across all jobs.
	Key string `json:"key,omitempty"`
	// Group shares the limit between every step, of any workflow, that
	// names the same group (Inngest's account-scoped concurrency keys):
	// "payments" held by the charge steps of two workflows, whose
	// priorities then order their waiters. Empty: the limit is the step's
	// own (its workflow's name and step id). Each step admits against its
	// own Limit.
	Group string `json:"group,omitempty"`
}

// RateLimit limits how many dispatches start per period: fixed windows
// of Period aligned on the Unix epoch, at most Limit dispatches recorded
// in each, per value of Key.
type RateLimit struct {
	Limit  int      `json:"limit"`         // dispatches per window, 1 or more
	Period Duration `json:"period"`        // window length, MinRatePeriod or more
	Key    string   `json:"key,omitempty"` // as Concurrency.Key (steps only; a pool's limit has no key)
}

// PoolSettings are what a workflow declares of a worker pool (Definition.Pools):
// a rate limit over the dispatches of this workflow's steps sent to it, and
// the priority its steps' waiting dispatches have unless a step sets one.
type PoolSettings struct {
	RateLimit *RateLimit `json:"rate_limit,omitempty"`
	Priority  int        `json:"priority,omitempty"` // 0..MaxPriority; 0 when absent
}

// PriorityOf returns the priority of step s's waiting dispatches: its own,
// else its pool's (Definition.Pools), else 0. Among the dispatches waiting
// for one limit, a higher priority goes first, then the oldest.
func (d *Definition) PriorityOf(s *Step) int {
	if s.Priority != nil {
		return *s.Priority
	}
	if p, ok := d.Pools[d.PoolOf(s)]; ok {
		return p.Priority
	}
	return 0
}

// HasFlow reports whether the definition declares any flow limit: a
// workflow without one costs no flow-bucket round trip.
func (d *Definition) HasFlow() bool {
	for _, p := range d.Pools {
		if p.RateLimit != nil {
			return true
		}
	}
	for i := range d.Steps {
		if d.Steps[i].Concurrency != nil || d.Steps[i].RateLimit != nil {
			return true
		}
	}
	return false
}

// Flow wait kinds (FlowWait.Kind).
const (
	FlowConcurrency = "concurrency" // every slot of a concurrency limit is taken
	FlowRate        = "rate"        // the rate window is full
)

// FlowWait says what a waiting dispatch waits for: it is recorded, not
// published, until the limit admits it (a slot handed over by the
// dispatch that frees it, a window that ends, or the reconciler's retry).
type FlowWait struct {
	Kind  string `json:"kind"`  // FlowConcurrency or FlowRate
	Limit string `json:"limit"` // the limit's id in the flow bucket ("<workflow>.<step>" or "pool.<pool>", made key-safe)
	// Key is the rendered key of the limit (empty for one without); at
	// most 200 bytes.
	Key      string    `json:"key,omitempty"`
	Max      int       `json:"max"`                // the limit's N
	InUse    int       `json:"in_use"`             // slots taken, or dispatches in the window, when it was found full
	Priority int       `json:"priority,omitempty"` // its place among the waiters
	Since    time.Time `json:"since"`              // when it began to wait
	// Until is when the full rate window ends (FlowRate).
	Until *time.Time `json:"until,omitempty"`
	// Ticket is the flow bucket key of its waiter record (FlowConcurrency).
	Ticket string `json:"ticket,omitempty"`
	// Offer is a concurrency slot handed over to this dispatch (the flow
	// signal's key), taken at its next transition.
	Offer string `json:"offer,omitempty"`
}

// Reason is a one-line account of w for status and history.
func (w *FlowWait) Reason() string {
	key := ""
	if w.Key != "" {
		key = fmt.Sprintf(" for key %q", w.Key)
	}
	switch w.Kind {
	case FlowRate:
		until := ""
		if w.Until != nil {
			until = " until " + w.Until.UTC().Format(time.RFC3339)
		}
		return fmt.Sprintf("rate limit %s%s: %d of %d in its window%s", w.Limit, key, w.InUse, w.Max, until)
	}
	return fmt.Sprintf("concurrency limit %s%s: %d of %d running", w.Limit, key, w.InUse, w.Max)
}

// ParseFlowKey parses the key template of a concurrency or rate limit
// (field names it in errors): text/template with missingkey=error over
// .state, .vars and .job, with idempotency_key's functions. Empty text
// gives nil.
func ParseFlowKey(stepID, field, text string) (*template.Template, error) {
	if text == "" {
		return nil, nil
	}
	t, err := template.New(stepID + "." + field).Option("missingkey=error").Funcs(effectKeyFuncs()).Parse(text)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	return t, nil
}

// RenderFlowKey renders a limit's key template for a job: its state (JSON),
// vars and id. Errors: the template fails, or renders more than 200 bytes
// or nothing.
func RenderFlowKey(t *template.Template, job string, state json.RawMessage, vars map[string]string) (string, error) {
	var doc map[string]any
	if len(state) > 0 {
		if err := json.Unmarshal(state, &doc); err != nil {
			return "", fmt.Errorf("%s: decode state: %w", t.Name(), err)
		}
	}
	if doc == nil {
		doc = map[string]any{}
	}
	var b strings.Builder
	if err := t.Execute(&b, map[string]any{"state": doc, "vars": vars, "job": job}); err != nil {
		return "", fmt.Errorf("%s: %w", t.Name(), err)
	}
	switch {
	case b.Len() == 0:
		return "", fmt.Errorf("%s rendered empty", t.Name())
	case b.Len() > 200:
		return "", fmt.Errorf("%s rendered %d bytes; the limit is 200", t.Name(), b.Len())
	}
	return b.String(), nil
}

// FlowKeyDigest is the flow bucket's token for a rendered key: 16 hex
// digits of its SHA-256, "_" for no key.
func FlowKeyDigest(key string) string {
	if key == "" {
		return "_"
	}
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:8])
}

// FlowLimitID is the flow bucket's token for a limit: parts joined by
// "-", each cut to its key-safe letters ([A-Za-z0-9_]), with 8 hex digits
// of a digest of the parts so that two names that cut alike stay apart.
func FlowLimitID(parts ...string) string {
	var b strings.Builder
	for i, p := range parts {
		if i > 0 {
			b.WriteByte('-')
		}
		for _, r := range p {
			switch {
			case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '_':
				b.WriteRune(r)
			default:
				b.WriteByte('_')
			}
		}
	}
	sum := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	s := b.String()
	if len(s) > 80 {
		s = s[:80]
	}
	return s + "-" + hex.EncodeToString(sum[:4])
}

// engineKind reports the kinds the engine performs itself: no flow limit
// applies to them (nothing of theirs runs in a worker).
func engineKind(kind string) bool {
	switch kind {
	case KindParallel, KindWorkflow, KindApproval, KindSleep, KindWait, KindAgent:
		return true
	}
	return false
}

// checkFlow reports flow settings the schema cannot judge: key templates
// that do not parse, periods that do not parse or are too short, limits
// on steps that no worker runs.
func checkFlow(d *Definition) []Problem {
	var ps []Problem
	rate := func(ptr, step string, r *RateLimit, keyed bool) {
		if r == nil {
			return
		}
		if time.Duration(r.Period) < MinRatePeriod {
			ps = append(ps, Problem{Path: ptr + "/period", Message: fmt.Sprintf("period %v is shorter than %v: windows end on durable timers, whose resolution is the second", time.Duration(r.Period), MinRatePeriod)})
		}
		if !keyed && r.Key != "" {
			ps = append(ps, Problem{Path: ptr + "/key", Message: "a pool's rate limit has no key: it counts every dispatch of the workflow's steps to the pool"})
		}
		if _, err := ParseFlowKey(step, "rate_limit.key", r.Key); err != nil && keyed {
			ps = append(ps, Problem{Path: ptr + "/key", Message: err.Error()})
		}
	}
	for _, name := range sortedKeys(d.Pools) {
		p := d.Pools[name]
		rate("/pools/"+escapePointer(name)+"/rate_limit", "pool "+name, p.RateLimit, false)
	}
	for i := range d.Steps {
		s := &d.Steps[i]
		base := fmt.Sprintf("/steps/%d", i)
		if engineKind(s.Kind) {
			for field, set := range map[string]bool{"concurrency": s.Concurrency != nil, "rate_limit": s.RateLimit != nil} {
				if set {
					ps = append(ps, Problem{Path: base + "/" + field, Message: fmt.Sprintf("%s step: the engine performs it, not a worker: %s does not apply to it", s.Kind, field)})
				}
			}
			continue
		}
		if c := s.Concurrency; c != nil {
			if _, err := ParseFlowKey(s.ID, "concurrency.key", c.Key); err != nil {
				ps = append(ps, Problem{Path: base + "/concurrency/key", Message: err.Error()})
			}
		}
		rate(base+"/rate_limit", s.ID, s.RateLimit, true)
	}
	return ps
}
