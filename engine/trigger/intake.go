package trigger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/cloudevents/sdk-go/v2/types"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Defaults of Config.
const (
	// DefaultRefresh is how long the table of live triggers is reused
	// before the definitions bucket is read again.
	DefaultRefresh = time.Second
	// DefaultTimeout bounds the handling of one event (HTTP or NATS).
	DefaultTimeout = 30 * time.Second
	// MaxEventBytes caps one request (an event, or a batch of them).
	MaxEventBytes = 1 << 20
	// MaxBatch caps the events of one batch-mode request.
	MaxBatch = 100
	// DefaultNATSConcurrency is Config.NATSConcurrency's default.
	DefaultNATSConcurrency = 16
)

// Config configures an Intake.
type Config struct {
	// Store is the deployment's JetStream layout. Required.
	Store *kv.Store
	// Client starts the jobs; nil: client.New(Store).
	Client *client.Client
	// Logger; nil: slog.Default().
	Logger *slog.Logger
	// Refresh is how long the table of live triggers (those of each
	// workflow's latest stored definition) is reused; before an event no
	// rule of the table takes is refused, the table is read again if the
	// definitions bucket changed since, so a workflow stored just now is
	// never missed. 0: DefaultRefresh; negative: read it for every event.
	Refresh time.Duration
	// Timeout bounds the handling of one event over HTTP or NATS. 0:
	// DefaultTimeout.
	Timeout time.Duration
	// NATSConcurrency is how many NATS requests one Subscribe handles at
	// once (one queue subscription each). 0: DefaultNATSConcurrency.
	NATSConcurrency int
	// Failpoints injects faults (failpoint.TriggerAfterStart) for crash
	// tests; nil: none.
	Failpoints *failpoint.Set
}

// Intake turns CloudEvents into jobs: it matches an event against the
// live trigger rules, maps it to each matching rule's job input, checks
// that input against the workflow's input schema, starts the jobs (ids
// from schemas.TriggerJobID) and records the event's (source, id) in the
// events bucket. Safe for concurrent use.
//
// The order makes a delivery that comes again safe at every point: a
// recorded event answers its record and starts nothing; a crash after
// a start and before the record leaves a job whose id the next delivery
// derives again, and Start attaches to it.
type Intake struct {
	store   *kv.Store
	client  *client.Client
	log     *slog.Logger
	refresh time.Duration
	timeout time.Duration
	now     func() time.Time

	natsConcurrency int
	fp              *failpoint.Set

	mu     sync.Mutex
	tab    *table
	loaded time.Time

	accepted, duplicate, unmatched, invalid, refused atomic.Uint64
	loads                                            atomic.Uint64 // tables read
}

// New returns an Intake. Errors: a Config without Store, or a negative
// Timeout or NATSConcurrency.
func New(cfg Config) (*Intake, error) {
	if cfg.Store == nil {
		return nil, errors.New("trigger intake: config: Store is required")
	}
	if cfg.Timeout < 0 || cfg.NATSConcurrency < 0 {
		return nil, fmt.Errorf("trigger intake: config: timeout %v, NATS concurrency %d: want 0 (the default) or more", cfg.Timeout, cfg.NATSConcurrency)
	}
	if cfg.Client == nil {
		cfg.Client = client.New(cfg.Store)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Refresh == 0 {
		cfg.Refresh = DefaultRefresh
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.NATSConcurrency <= 0 {
		cfg.NATSConcurrency = DefaultNATSConcurrency
	}
	return &Intake{store: cfg.Store, client: cfg.Client, log: cfg.Logger, refresh: cfg.Refresh, timeout: cfg.Timeout,
		natsConcurrency: cfg.NATSConcurrency, fp: cfg.Failpoints, now: time.Now}, nil
}

// Stats are an Intake's counters since it was made.
type Stats struct {
	Accepted  uint64 // events that started jobs
	Duplicate uint64 // events delivered again: answered their jobs, started nothing
	Unmatched uint64 // valid events no live trigger took (no_trigger)
	Invalid   uint64 // requests that were not valid CloudEvents (400, 415)
	Refused   uint64 // events whose mapped input was refused (the input schema, a failing expression)
}

// Stats returns the counters. Safe for concurrent use; never blocks.
func (in *Intake) Stats() Stats {
	return Stats{Accepted: in.accepted.Load(), Duplicate: in.duplicate.Load(), Unmatched: in.unmatched.Load(),
		Invalid: in.invalid.Load(), Refused: in.refused.Load()}
}

// EventRef names an event: its dedup key.
type EventRef struct {
	Source string `json:"source"`
	ID     string `json:"id"`
}

// Answer is what an accepted event is answered (HTTP 202, or the NATS
// reply): the event and the jobs it started.
type Answer struct {
	Event EventRef    `json:"event"`
	Jobs  []JobAnswer `json:"jobs"`
}

// JobAnswer is one job of an Answer. Duplicate is true when the job was
// not started by this delivery: the event had been received before.
type JobAnswer struct {
	Trigger   string `json:"trigger"`
	Workflow  string `json:"workflow"`
	JobID     string `json:"job_id"`
	Duplicate bool   `json:"duplicate"`
}

// Rule is a live trigger rule, as listed by Triggers and in a
// no_trigger answer.
type Rule struct {
	Workflow string `json:"workflow"`
	Version  int    `json:"version"`
	Name     string `json:"name"`
	Type     string `json:"type"`
	Source   string `json:"source,omitempty"`
	Subject  string `json:"subject,omitempty"`
	Filter   string `json:"filter,omitempty"`
}

// Refusal is the error Accept returns for an event it does not take. Its
// Code is schemas.CodeEventInvalid (Attribute names the attribute at
// fault), schemas.CodeUnsupportedMedia, schemas.CodeNoTrigger (Triggers
// lists the live rules), schemas.CodeInputInvalid (Problems hold the JSON
// pointers the input schema refused) or schemas.CodeTooLarge. It matches
// the sentinel of its code with errors.Is.
type Refusal struct {
	Code      schemas.Code      `json:"code"`
	Message   string            `json:"message"`
	Attribute string            `json:"attribute,omitempty"`
	Trigger   string            `json:"trigger,omitempty"`
	Problems  []schemas.Problem `json:"problems,omitempty"`
	Triggers  []Rule            `json:"triggers,omitempty"`
}

// Error returns "code: message".
func (r *Refusal) Error() string { return string(r.Code) + ": " + r.Message }

// Is matches the schemas sentinel of r's code.
func (r *Refusal) Is(target error) bool {
	t, ok := target.(*schemas.Error)
	return ok && t != nil && t.Code == r.Code
}

// Accept takes one CloudEvent (already decoded by a binding; it is
// validated here). It returns once every job the event starts is durably
// recorded and the event's dedup record is written. Errors: a *Refusal
// (nothing recorded; nothing started, but for one case: an event two
// rules take whose second input Start refuses for its size, after the
// first job started), or a storage error wrapped with the event's source
// and id (the event may have started some of its jobs: deliver it again,
// which attaches to them).
func (in *Intake) Accept(ctx context.Context, ev *event.Event) (*Answer, error) {
	if err := ev.Validate(); err != nil {
		in.invalid.Add(1)
		return nil, invalidEvent(err)
	}
	if r := checkText(ev); r != nil {
		in.invalid.Add(1)
		return nil, r
	}
	ref := EventRef{Source: ev.Source(), ID: ev.ID()}
	rec, err := in.store.Events.Get(ctx, ref.Source, ref.ID)
	switch {
	case err == nil:
		in.duplicate.Add(1)
		return recorded(rec), nil
	case !errors.Is(err, schemas.ErrNotFound):
		return nil, fmt.Errorf("event %q from %q: %w", ref.ID, ref.Source, err)
	}
	env, err := eventEnv(ev)
	if err != nil {
		in.invalid.Add(1)
		return nil, err
	}
	before := in.loads.Load()
	tab, err := in.table(ctx, false)
	if err != nil {
		return nil, fmt.Errorf("event %q from %q: %w", ref.ID, ref.Source, err)
	}
	hits, err := tab.match(ev, env)
	if err == nil && len(hits) == 0 && in.loads.Load() == before {
		// The table may predate a workflow stored just now: read it again
		// before saying no, unless this call just did or the definitions
		// bucket has not changed since (one status request: a flood of
		// unmatched events does not list the bucket each time).
		if tab, err = in.reloadIfChanged(ctx, tab); err == nil {
			hits, err = tab.match(ev, env)
		}
	}
	if err != nil {
		in.refused.Add(1)
		return nil, err
	}
	if len(hits) == 0 {
		in.unmatched.Add(1)
		return nil, tab.noTrigger(ev)
	}
	// Every input is mapped and checked before any job starts: a refusal
	// starts nothing.
	inputs := make([]json.RawMessage, len(hits))
	for i, h := range hits {
		if inputs[i], err = h.input(env); err != nil {
			in.refused.Add(1)
			return nil, err
		}
	}
	answer := &Answer{Event: ref, Jobs: make([]JobAnswer, 0, len(hits))}
	rec = &schemas.EventRecord{Source: ref.Source, ID: ref.ID, Type: ev.Type(), ReceivedAt: in.now().UTC()}
	fresh := false
	for i, h := range hits {
		id := schemas.TriggerJobID(h.def.Name, h.trig.Name, ref.Source, ref.ID)
		res, err := in.client.Start(ctx, h.def, inputs[i], client.StartOptions{JobID: id})
		switch {
		case err == nil:
		case res.Attached && errors.Is(err, schemas.ErrConflict):
			// This event's job exists with another definition or input
			// (the workflow was stored again since a delivery that did not
			// get to record the event): it is the event's job all the same.
		case errors.Is(err, schemas.ErrInputInvalid), errors.Is(err, schemas.ErrTooLarge):
			in.refused.Add(1)
			return nil, refusal(h, err)
		case res.JobID != "" && !res.Attached:
			// Stored, its start request not published: an engine starts
			// it within its reconcile interval. The job exists; go on.
			in.log.Warn("trigger: job stored, start request not published", "job", id, "err", err)
		default:
			return nil, fmt.Errorf("event %q from %q: trigger %s of %s: %w", ref.ID, ref.Source, h.trig.Name, h.def.Name, err)
		}
		fresh = fresh || !res.Attached
		answer.Jobs = append(answer.Jobs, JobAnswer{Trigger: h.trig.Name, Workflow: h.def.Name, JobID: id, Duplicate: res.Attached})
		rec.Jobs = append(rec.Jobs, schemas.EventJob{Trigger: h.trig.Name, Workflow: h.def.Name, JobID: id})
	}
	in.fp.Inject(ctx, failpoint.TriggerAfterStart)
	got, created, err := in.store.Events.Create(ctx, rec)
	if err != nil {
		return nil, fmt.Errorf("event %q from %q: jobs started, not recorded (deliver it again: it attaches to them): %w", ref.ID, ref.Source, err)
	}
	if !created && !fresh {
		// A concurrent delivery of the same event recorded it first (and
		// started its jobs: this one attached to them).
		in.duplicate.Add(1)
		return recorded(got), nil
	}
	// This delivery started a job (a concurrent one may have recorded the
	// event first, with the same derived ids): the answer says which.
	if fresh {
		in.accepted.Add(1)
	} else {
		in.duplicate.Add(1)
	}
	return answer, nil
}

// recorded answers a delivery of an event already recorded.
func recorded(rec *schemas.EventRecord) *Answer {
	a := &Answer{Event: EventRef{Source: rec.Source, ID: rec.ID}, Jobs: make([]JobAnswer, 0, len(rec.Jobs))}
	for _, j := range rec.Jobs {
		a.Jobs = append(a.Jobs, JobAnswer{Trigger: j.Trigger, Workflow: j.Workflow, JobID: j.JobID, Duplicate: true})
	}
	return a
}

// refusal turns a refused input into a Refusal naming the trigger and the
// JSON pointers the schema refused.
func refusal(h *rule, err error) *Refusal {
	se := schemas.AsError(err)
	msg := fmt.Sprintf("trigger %s of workflow %s: %s", h.trig.Name, h.def.Name, se.Message)
	if rest, ok := strings.CutPrefix(se.Message, "trigger "+h.trig.Name+": "); ok {
		msg = fmt.Sprintf("trigger %s of workflow %s: %s", h.trig.Name, h.def.Name, rest)
	}
	r := &Refusal{Code: se.Code, Trigger: h.trig.Name, Message: msg}
	var sche *schemas.SchemaError
	if errors.As(err, &sche) {
		for _, p := range sche.Problems {
			path := p.Path
			if path == "" {
				path = "/"
			}
			r.Problems = append(r.Problems, schemas.Problem{Path: path, Message: p.Message})
		}
	}
	return r
}

// Triggers lists the live trigger rules (those of each workflow's latest
// stored definition), by workflow and name. It reads the definitions
// bucket. Errors: the bucket's, wrapped.
func (in *Intake) Triggers(ctx context.Context) ([]Rule, error) {
	tab, err := in.table(ctx, true)
	if err != nil {
		return nil, err
	}
	return tab.list(), nil
}

// table returns the live rules: the cached table while it is younger than
// the refresh interval (unless force), else a new one read from the
// definitions bucket.
func (in *Intake) table(ctx context.Context, force bool) (*table, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	now := in.now()
	if !force && in.tab != nil && in.refresh > 0 && now.Sub(in.loaded) < in.refresh {
		return in.tab, nil
	}
	rev, err := in.store.Definitions.LastRevision(ctx)
	if err != nil {
		return nil, err
	}
	tab, err := loadTable(ctx, in.store, in.log, in.tab)
	if err != nil {
		return nil, err
	}
	tab.rev = rev // read first: anything stored during the listing changes it
	in.tab, in.loaded = tab, now
	in.loads.Add(1)
	return tab, nil
}

// reloadIfChanged returns tab, or a table read again when the definitions
// bucket changed since tab was read.
func (in *Intake) reloadIfChanged(ctx context.Context, tab *table) (*table, error) {
	rev, err := in.store.Definitions.LastRevision(ctx)
	if err != nil {
		return nil, err
	}
	if rev == tab.rev {
		return tab, nil
	}
	return in.table(ctx, true)
}

// rule is one live trigger: the definition it belongs to, compiled.
type rule struct {
	def                *schemas.Definition
	trig               *schemas.CompiledTrigger
	inputSchema, state *schemas.Validator
}

// input maps and checks the event's job input for r.
func (r *rule) input(env schemas.TriggerEnv) (json.RawMessage, error) {
	env.Vars = r.def.Vars
	raw, err := r.trig.Map(env)
	if err != nil {
		return nil, refusal(r, err)
	}
	// What Start refuses of the text, refused here, before any job of the
	// event starts.
	if err := schemas.CheckStartText(raw, nil); err != nil {
		return nil, refusal(r, err)
	}
	checked, err := schemas.CheckJobInput(raw, r.inputSchema, r.state)
	if err != nil {
		return nil, refusal(r, err)
	}
	return checked, nil
}

// table is the live rules at one moment.
type table struct {
	rules []*rule
	rev   uint64 // the definitions bucket's last revision when it was read
}

// loadTable reads every workflow's latest definition and compiles its
// triggers; prev's compiled rules of unchanged definitions are kept.
func loadTable(ctx context.Context, store *kv.Store, log *slog.Logger, prev *table) (*table, error) {
	names, err := store.Definitions.Workflows(ctx)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	known := map[string][]*rule{}
	if prev != nil {
		for _, r := range prev.rules {
			known[r.def.Hash] = append(known[r.def.Hash], r)
		}
	}
	t := &table{}
	for _, name := range names {
		def, err := store.Definitions.Latest(ctx, name)
		if err != nil {
			if errors.Is(err, schemas.ErrNotFound) || errors.Is(err, schemas.ErrDefinitionInvalid) {
				log.Warn("triggers: skipping a workflow whose latest definition cannot be read", "workflow", name, "err", err)
				continue
			}
			return nil, fmt.Errorf("load triggers of %s: %w", name, err)
		}
		if len(def.Triggers) == 0 {
			continue
		}
		if rs, ok := known[def.Hash]; ok {
			t.rules = append(t.rules, rs...)
			continue
		}
		in, err := schemas.CompileSchema("input_schema", def.InputSchema)
		if err != nil {
			log.Warn("triggers: skipping a workflow whose input schema does not compile", "workflow", name, "err", err)
			continue
		}
		st, err := schemas.CompileSchema("state_schema", def.StateSchema)
		if err != nil {
			log.Warn("triggers: skipping a workflow whose state schema does not compile", "workflow", name, "err", err)
			continue
		}
		for _, tr := range def.Triggers {
			c, err := schemas.CompileTrigger(tr)
			if err != nil {
				log.Warn("triggers: skipping a trigger that does not compile", "workflow", name, "trigger", tr.Name, "err", err)
				continue
			}
			t.rules = append(t.rules, &rule{def: def, trig: c, inputSchema: in, state: st})
		}
	}
	return t, nil
}

// match returns the rules that take ev, in table order. A filter that
// fails on the event refuses it (a *Refusal, input_invalid).
func (t *table) match(ev *event.Event, env schemas.TriggerEnv) ([]*rule, error) {
	var hits []*rule
	for _, r := range t.rules {
		if !r.trig.Matches(ev.Type(), ev.Source(), ev.Subject()) {
			continue
		}
		env.Vars = r.def.Vars
		ok, err := r.trig.Accepts(env)
		if err != nil {
			return nil, refusal(r, err)
		}
		if ok {
			hits = append(hits, r)
		}
	}
	return hits, nil
}

// list describes t's rules.
func (t *table) list() []Rule {
	out := make([]Rule, 0, len(t.rules))
	for _, r := range t.rules {
		out = append(out, Rule{Workflow: r.def.Name, Version: r.def.Version, Name: r.trig.Name, Type: r.trig.Type,
			Source: r.trig.Source, Subject: r.trig.Subject, Filter: r.trig.Filter})
	}
	return out
}

// noTrigger is the refusal of an event no rule takes.
func (t *table) noTrigger(ev *event.Event) *Refusal {
	rules := t.list()
	what := fmt.Sprintf("type %q, source %q", ev.Type(), ev.Source())
	if ev.Subject() != "" {
		what += fmt.Sprintf(", subject %q", ev.Subject())
	}
	msg := fmt.Sprintf("no trigger takes the event (%s): ", what)
	if len(rules) == 0 {
		msg += "no stored workflow declares triggers"
	} else {
		names := make([]string, 0, len(rules))
		for _, r := range rules {
			m := "type " + r.Type
			if r.Source != "" {
				m += ", source " + r.Source
			}
			if r.Subject != "" {
				m += ", subject " + r.Subject
			}
			if r.Filter != "" {
				m += ", a filter"
			}
			names = append(names, r.Workflow+"/"+r.Name+" ("+m+")")
		}
		msg += "the live triggers are " + strings.Join(names, ", ")
	}
	return &Refusal{Code: schemas.CodeNoTrigger, Message: msg, Triggers: rules}
}

// eventEnv is what ev's trigger expressions see (schemas.TriggerEnv).
// Data whose content type is JSON is decoded; data without a content type
// is decoded when it is JSON; other data is its text. Errors: a *Refusal
// for data said to be JSON that does not decode.
func eventEnv(ev *event.Event) (schemas.TriggerEnv, error) {
	m := map[string]any{
		"specversion": ev.SpecVersion(),
		"type":        ev.Type(),
		"source":      ev.Source(),
		"id":          ev.ID(),
	}
	if s := ev.Subject(); s != "" {
		m["subject"] = s
	}
	if t := ev.Time(); !t.IsZero() {
		m["time"] = t.UTC().Format(time.RFC3339Nano)
	}
	if s := ev.DataContentType(); s != "" {
		m["datacontenttype"] = s
	}
	if s := ev.DataSchema(); s != "" {
		m["dataschema"] = s
	}
	if data := ev.Data(); len(data) > 0 {
		ct := ev.DataContentType()
		var v any
		switch {
		case ct == "" && json.Unmarshal(data, &v) == nil:
			m["data"] = v // no content type: JSON when it parses, else text
		case ct == "":
			m["data"] = string(data)
		case isJSON(ct):
			if err := json.Unmarshal(data, &v); err != nil {
				return schemas.TriggerEnv{}, &Refusal{Code: schemas.CodeEventInvalid, Attribute: "data",
					Message: fmt.Sprintf("data: the content type is %s but the data is not JSON: %v", orNone(ct), err)}
			}
			m["data"] = v
		default:
			m["data"] = string(data)
		}
	}
	ext := map[string]any{}
	for k, v := range ev.Extensions() {
		switch v := v.(type) {
		case string, bool, int32:
			ext[k] = v
		default:
			s, err := types.Format(v)
			if err != nil {
				s = fmt.Sprint(v)
			}
			ext[k] = s
		}
	}
	m["extensions"] = ext
	return schemas.TriggerEnv{Event: m}, nil
}

func orNone(ct string) string {
	if ct == "" {
		return "unset"
	}
	return ct
}

// isJSON reports whether data of content type ct is JSON:
// application/json, text/json or a +json suffix (parameters ignored).
func isJSON(ct string) bool {
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = strings.ToLower(strings.TrimSpace(ct))
	return ct == "application/json" || ct == "text/json" || strings.HasSuffix(ct, "+json")
}

// MaxAttributeBytes caps the id, source, type and subject of an event
// (bytes): they are echoed in answers and kept in its dedup record.
const MaxAttributeBytes = 1024

// checkText refuses an event whose attributes or data are not Unicode
// text (invalid UTF-8, or in JSON data a \u escape of a lone surrogate),
// as POST /v1/jobs refuses such input, rather than letting decoding swap
// them for U+FFFD: a job would start with other text than was sent, and
// an id echoed back would not be the one recorded. Attributes over
// MaxAttributeBytes are refused too.
func checkText(ev *event.Event) *Refusal {
	for _, a := range []struct{ name, value string }{{"id", ev.ID()}, {"source", ev.Source()}, {"type", ev.Type()}, {"subject", ev.Subject()}} {
		if !utf8.ValidString(a.value) {
			return &Refusal{Code: schemas.CodeEventInvalid, Attribute: a.name, Message: fmt.Sprintf("not a valid CloudEvent: %s: not UTF-8 text", a.name)}
		}
		if len(a.value) > MaxAttributeBytes {
			return &Refusal{Code: schemas.CodeEventInvalid, Attribute: a.name,
				Message: fmt.Sprintf("not a valid CloudEvent: %s: %d bytes, at most %d", a.name, len(a.value), MaxAttributeBytes)}
		}
	}
	for k, v := range ev.Extensions() {
		if s, ok := v.(string); ok && !utf8.ValidString(s) {
			return &Refusal{Code: schemas.CodeEventInvalid, Attribute: k, Message: fmt.Sprintf("not a valid CloudEvent: extension %s: not UTF-8 text", k)}
		}
	}
	data := ev.Data()
	if len(data) == 0 {
		return nil
	}
	if !utf8.Valid(data) {
		return &Refusal{Code: schemas.CodeEventInvalid, Attribute: "data", Message: "data: not UTF-8 text (binary data cannot become a job's input)"}
	}
	if ct := ev.DataContentType(); isJSON(ct) || ct == "" {
		if err := schemas.CheckJSONText(data); err != nil && json.Valid(data) {
			msg := err.Error()
			var te *schemas.TextError
			if errors.As(err, &te) {
				msg = te.Error()
			}
			return &Refusal{Code: schemas.CodeEventInvalid, Attribute: "data", Message: "data: " + msg}
		}
	}
	return nil
}

// invalidEvent turns sdk-go's complaint about an event into a Refusal
// naming the attribute at fault.
func invalidEvent(err error) *Refusal {
	var ve event.ValidationError
	if errors.As(err, &ve) {
		attrs := make([]string, 0, len(ve))
		for k := range ve {
			attrs = append(attrs, k)
		}
		sort.Strings(attrs)
		parts := make([]string, 0, len(attrs))
		for _, a := range attrs {
			parts = append(parts, a+": "+describe(a, ve[a]))
		}
		return &Refusal{Code: schemas.CodeEventInvalid, Attribute: strings.Join(attrs, ","),
			Message: "not a valid CloudEvent: " + strings.Join(parts, "; ")}
	}
	msg := err.Error()
	attr := ""
	switch {
	case strings.Contains(msg, "time.Time"), strings.Contains(msg, "for time"):
		attr = "time"
	case strings.Contains(msg, "specversion"):
		attr = "specversion"
	default:
		for _, a := range []string{"id", "source", "type", "subject", "dataschema", "datacontenttype"} {
			if strings.Contains(msg, "for "+a+":") || strings.Contains(msg, `"`+a+`"`) {
				attr = a
				break
			}
		}
	}
	prefix := "not a valid CloudEvent: "
	if attr != "" {
		prefix += attr + ": "
	}
	return &Refusal{Code: schemas.CodeEventInvalid, Attribute: attr, Message: prefix + msg}
}

// describe words one of sdk-go's validation complaints.
func describe(attr string, err error) string {
	msg := err.Error()
	switch {
	case strings.Contains(msg, "REQUIRED"), strings.Contains(msg, "MUST be a non-empty"), strings.HasPrefix(msg, "no "):
		return "missing (required)"
	case attr == "specversion" && strings.Contains(msg, "unknown value"):
		return msg + " (this intake reads 1.0 and 0.3)"
	}
	return msg
}
