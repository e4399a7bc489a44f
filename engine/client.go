package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Client starts and inspects jobs. It validates before it stores anything:
// a start whose input fails the workflow's input schema leaves no trace.
// Safe for concurrent use.
type Client struct {
	store    *kv.Store
	compiled *compiledCache
	now      func() time.Time
	stored   sync.Map // definition hashes this client has stored
}

// NewClient returns a Client over an opened store.
func NewClient(store *kv.Store) *Client {
	return &Client{store: store, compiled: newCompiledCache(64), now: time.Now}
}

var jobIDRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$`)

// ValidateJobID reports whether id can name a job: 1 to 128 letters,
// digits, '-' and '_', starting with a letter or digit (it is a KV key and
// a subject token).
func ValidateJobID(id string) error {
	if !jobIDRE.MatchString(id) {
		return schemas.Errorf(schemas.CodeInputInvalid, "job id %q: want 1-128 letters, digits, '-' or '_', starting with a letter or digit", id)
	}
	return nil
}

// NewJobID returns a fresh job id: the workflow name and a unique suffix.
func NewJobID(workflow string) string {
	return workflow + "-" + strings.ToLower(nuid.Next())
}

// StartOptions adjusts Start.
type StartOptions struct {
	// JobID names the job; empty picks a fresh id. Starting an id that
	// exists attaches to that job instead of creating another.
	JobID string
	// Vars override the definition's vars for this job (pinned at start).
	Vars map[string]string
}

// StartResult says what Start did.
type StartResult struct {
	JobID          string `json:"job_id"`
	DefinitionHash string `json:"definition_hash"`
	// Attached is true when the job already existed; nothing was published.
	Attached bool `json:"attached"`
	// Mismatch, when attached, says how the existing job differs from what
	// was asked (another definition or input); Start then also returns
	// schemas.ErrConflict. Empty when it matches.
	Mismatch string `json:"mismatch,omitempty"`
}

// Start validates input against def's input schema (and state schema),
// stores def, and asks the engines to start the job. It does not wait for
// the job. Errors: schemas.ErrInputInvalid or schemas.ErrTooLarge (nothing
// stored); schemas.ErrConflict when the id names a job with another
// definition or input (nothing changes); a connection error wrapped with
// the job id.
func (c *Client) Start(ctx context.Context, def *schemas.Definition, input json.RawMessage, opts StartOptions) (StartResult, error) {
	id := opts.JobID
	if id == "" {
		id = NewJobID(def.Name)
	}
	if err := ValidateJobID(id); err != nil {
		return StartResult{}, err
	}
	res := StartResult{JobID: id, DefinitionHash: def.Hash}
	cd, err := c.compiled.get(def)
	if err != nil {
		return StartResult{}, err
	}
	for k := range opts.Vars {
		if _, declared := def.Vars[k]; !declared {
			names := make([]string, 0, len(def.Vars))
			for n := range def.Vars {
				names = append(names, n)
			}
			sort.Strings(names)
			declared := "it declares none"
			if len(names) > 0 {
				declared = "it declares: " + strings.Join(names, ", ")
			}
			return StartResult{}, schemas.Errorf(schemas.CodeInputInvalid, "var %q is not declared by workflow %s (%s)", k, def.Name, declared)
		}
	}
	if len(bytes.TrimSpace(input)) == 0 {
		input = json.RawMessage("{}")
	}
	if err := schemas.CheckStartText(input, opts.Vars); err != nil {
		return StartResult{}, fmt.Errorf("start job %s: %w", id, err)
	}
	req := &schemas.StartRequest{JobID: id, DefinitionHash: def.Hash, Input: input, Vars: opts.Vars, RequestedAt: c.now().UTC()}
	cp, err := pendingJob(cd, req, schemas.StartMsgID(id), c.now().UTC())
	if err != nil {
		return StartResult{}, err
	}
	// Refuse here what the engine could not store or publish once it starts the job.
	if err := schemas.CheckStartSize(def, req, cp, schemas.SizeLimits{MaxValueBytes: int(c.store.Config.MaxValueBytes), MaxMessageBytes: int(c.store.Config.MaxMessageBytes)}); err != nil {
		return StartResult{}, fmt.Errorf("start job %s: %w", id, err)
	}
	if _, done := c.stored.Load(def.Hash); !done {
		if err := c.store.Definitions.Put(ctx, def); err != nil {
			return StartResult{}, fmt.Errorf("start job %s: %w", id, err)
		}
		c.stored.Store(def.Hash, true)
	}
	// The job exists once its pending checkpoint is stored (create-only:
	// an id that exists is attached to). The start request that follows
	// only wakes an engine; if it is lost, engines start pending jobs by
	// themselves.
	if _, err := c.store.Checkpoints.Create(ctx, cp); errors.Is(err, schemas.ErrConflict) {
		return c.attach(ctx, id, def, input)
	} else if err != nil {
		return StartResult{}, fmt.Errorf("start job %s: %w", id, err)
	}
	data, err := json.Marshal(req)
	if err != nil {
		return StartResult{}, fmt.Errorf("start job %s: %w", id, err)
	}
	m := nats.NewMsg(c.store.Names.InboxSubject(kv.InboxStart, id))
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, schemas.StartMsgID(id))
	if _, err := c.store.JS.PublishMsg(ctx, m); err != nil {
		// The job is stored and will be started by the reconciler.
		return res, fmt.Errorf("start job %s: stored, but the start request was not published (an engine starts it within its reconcile interval): %w", id, err)
	}
	return res, nil
}

// attach describes an existing job for Start: it matches what was asked,
// or differs (another definition or input: schemas.ErrConflict).
func (c *Client) attach(ctx context.Context, id string, def *schemas.Definition, input json.RawMessage) (StartResult, error) {
	res := StartResult{JobID: id, DefinitionHash: def.Hash, Attached: true}
	ent, err := c.store.Checkpoints.Get(ctx, id)
	if err != nil {
		return StartResult{}, fmt.Errorf("start job %s: it exists but cannot be read: %w", id, err)
	}
	res.DefinitionHash = ent.Checkpoint.DefinitionHash
	switch {
	case ent.Checkpoint.DefinitionHash != def.Hash:
		res.Mismatch = fmt.Sprintf("job %s exists and runs definition %s (%s v%d), not %s: a job keeps the definition it started with; pick another job id to start anew",
			id, short(ent.Checkpoint.DefinitionHash), ent.Checkpoint.Workflow, ent.Checkpoint.Version, short(def.Hash))
	case len(input) > 0 && ent.Checkpoint.InputDigest != "" && !sameInput(ent.Checkpoint.InputDigest, input):
		res.Mismatch = fmt.Sprintf("job %s exists and was started with other input: pick another job id to start anew", id)
	}
	if res.Mismatch != "" {
		return res, schemas.Errorf(schemas.CodeConflict, "%s", res.Mismatch)
	}
	return res, nil
}

// CheckInput validates input against def as Start would, storing nothing.
// Errors: schemas.ErrInputInvalid naming the violations.
func CheckInput(def *schemas.Definition, input json.RawMessage) error {
	c, err := compile(def)
	if err != nil {
		return err
	}
	_, err = checkInput(c, input)
	return err
}

// Job returns job id's record. Errors: schemas.ErrNotFound,
// schemas.ErrQuarantined.
func (c *Client) Job(ctx context.Context, id string) (*JobView, error) {
	ent, err := c.store.Checkpoints.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	def, err := c.store.Definitions.Get(ctx, ent.Checkpoint.DefinitionHash)
	if err != nil {
		def = nil // the record is still worth showing
	}
	return NewJobView(ent.Checkpoint, def), nil
}

// ListFilter narrows List. Zero fields match everything.
type ListFilter struct {
	Status   schemas.JobStatus
	Workflow string
	Limit    int // most recently updated first; 0 means 100
}

// List returns job summaries, most recently updated first. It reads every
// checkpoint: meant for people and tests, not for hot paths.
func (c *Client) List(ctx context.Context, f ListFilter) ([]JobSummary, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	var out []JobSummary
	err := c.store.Checkpoints.List(ctx, func(job string, ent kv.Entry, err error) bool {
		if err != nil {
			out = append(out, JobSummary{ID: job, Status: schemas.JobQuarantined, Error: schemas.AsError(err)})
			return true
		}
		cp := ent.Checkpoint
		if (f.Status != "" && cp.Status != f.Status) || (f.Workflow != "" && cp.Workflow != f.Workflow) {
			return true
		}
		out = append(out, summarize(cp))
		return true
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UpdatedAt.After(out[j].UpdatedAt) })
	if len(out) > f.Limit {
		out = out[:f.Limit]
	}
	return out, nil
}

// History returns job id's history events in the order they happened:
// those in the history stream and those its checkpoint still holds (see
// Config.HistoryBatch).
func (c *Client) History(ctx context.Context, id string) ([]HistoryEvent, error) {
	var out []HistoryEvent
	seen := map[string]bool{}
	err := c.follow(ctx, id, func(h HistoryEvent, pending uint64) bool {
		seen[h.ID] = true
		out = append(out, h)
		return pending > 0
	}, true)
	if err != nil {
		return nil, err
	}
	ent, err := c.store.Checkpoints.Get(ctx, id)
	if err != nil {
		if errors.Is(err, schemas.ErrNotFound) {
			return out, nil
		}
		return nil, err
	}
	for _, h := range checkpointHistory(id, ent.Checkpoint.Events) {
		if !seen[h.ID] {
			out = append(out, h)
		}
	}
	// Transitions reach the stream in batches, ledger events one by one:
	// order them by when they happened.
	sort.SliceStable(out, func(i, j int) bool { return out[i].Time.Before(out[j].Time) })
	return out, nil
}

// Wait follows job id until it stops (completed, failed, or waiting for a
// person: needs_reconciliation, quarantined), calling onEvent (if not nil)
// with each history event once, and returns the final record. Transitions
// come from the checkpoint as it is written, ledger events from the history
// stream. Errors: ctx's error when it ends first.
func (c *Client) Wait(ctx context.Context, id string, onEvent func(HistoryEvent)) (*JobView, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	seen := map[string]bool{}
	emit := func(h HistoryEvent) {
		mu.Lock()
		defer mu.Unlock()
		if seen[h.ID] {
			return
		}
		seen[h.ID] = true
		if onEvent != nil {
			onEvent(h)
		}
	}
	followDone := make(chan error, 1)
	go func() {
		followDone <- c.follow(ctx, id, func(h HistoryEvent, _ uint64) bool {
			emit(h)
			return true
		}, false)
	}()
	var final *schemas.Checkpoint
	err := c.store.Checkpoints.Watch(ctx, id, func(ent kv.Entry, err error) bool {
		if err != nil {
			return true
		}
		for _, h := range checkpointHistory(id, ent.Checkpoint.Events) {
			emit(h)
		}
		if ent.Checkpoint.Status.Stopped() {
			final = ent.Checkpoint
			return false
		}
		return true
	})
	if final == nil {
		if err == nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("wait for job %s: %w", id, err)
	}
	// Read what the history stream holds by now, to the end: the ledger
	// events of the last steps precede the final checkpoint.
	cancel()
	<-followDone
	_ = c.follow(context.WithoutCancel(ctx), id, func(h HistoryEvent, pending uint64) bool {
		emit(h)
		return pending > 0
	}, true)
	def, _ := c.store.Definitions.Get(context.WithoutCancel(ctx), final.DefinitionHash)
	return NewJobView(final, def), nil
}

// follow delivers job's history events in order, each once even if it was
// published again after a crash, until fn returns false, ctx ends, or
// (stopAtEnd) the stream has no more.
func (c *Client) follow(ctx context.Context, id string, fn func(HistoryEvent, uint64) bool, stopAtEnd bool) error {
	cons, err := c.store.JS.OrderedConsumer(ctx, c.store.Names.HistoryStream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{c.store.Names.HistorySubject(id)},
	})
	if err != nil {
		return fmt.Errorf("follow history of %s: %w", id, err)
	}
	if stopAtEnd {
		info, err := cons.Info(ctx)
		if err != nil {
			return fmt.Errorf("follow history of %s: %w", id, err)
		}
		if info.NumPending == 0 {
			return nil
		}
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("follow history of %s: %w", id, err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	seen := map[string]bool{}
	for {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return nil
			}
			return fmt.Errorf("follow history of %s: %w", id, err)
		}
		evs, err := DecodeHistory(m.Data())
		if err != nil {
			continue
		}
		var pending uint64
		if md, err := m.Metadata(); err == nil {
			pending = md.NumPending
		}
		for i, h := range evs {
			if seen[h.ID] {
				continue
			}
			seen[h.ID] = true
			left := pending
			if i < len(evs)-1 {
				left++ // more events in this message
			}
			if !fn(h, left) {
				return nil
			}
		}
		if stopAtEnd && pending == 0 {
			return nil
		}
	}
}

// sameInput compares an input with the digest of the one a job was
// started with, ignoring white space (key order still counts, which only
// costs a warning).
func sameInput(digestOf string, input json.RawMessage) bool {
	return inputDigest(input) == digestOf
}

func short(hash string) string {
	if len(hash) > 12 {
		return hash[:12]
	}
	return hash
}

// EffectFilter narrows Effects. Zero fields match everything.
type EffectFilter struct {
	Job   string
	State schemas.EffectState
	Limit int // most recently updated first; 0 means 1000
}

// Effects lists effect ledger records, most recently updated first.
func (c *Client) Effects(ctx context.Context, f EffectFilter) ([]*schemas.EffectRecord, error) {
	if f.Limit <= 0 {
		f.Limit = 1000
	}
	var out []*schemas.EffectRecord
	err := c.store.Effects.List(ctx, func(e kv.EffectEntry) bool {
		r := e.Record
		if (f.Job == "" || r.Job == f.Job) && (f.State == "" || r.State == f.State) {
			out = append(out, r)
		}
		return true
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UpdatedAt.After(out[j].UpdatedAt) })
	if len(out) > f.Limit {
		out = out[:f.Limit]
	}
	return out, nil
}

// Effect returns the ledger record under key. Errors: schemas.ErrNotFound.
func (c *Client) Effect(ctx context.Context, key string) (*schemas.EffectRecord, error) {
	e, err := c.store.Effects.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	return e.Record, nil
}

// ErrNotAmbiguous is returned by ResolveEffect for an effect that is not
// waiting for a decision.
var ErrNotAmbiguous = errors.New("effect is not ambiguous")

// ResolveEffect settles an ambiguous effect with a person's decision: the
// record becomes reconciled (happened, with its result and external id, or
// did not happen), who and when are recorded, the decision is appended to
// the job's history, and the job waiting on it resumes: its step gets a new
// attempt that returns the recorded result (happened) or performs the
// action (did not happen). The write is a compare-and-swap: two people
// resolving at once cannot both win. Errors: schemas.ErrNotFound;
// ErrNotAmbiguous; schemas.ErrInputInvalid for a result that is not JSON
// or details given with "did not happen"; schemas.ErrConflict when someone
// else resolved it meanwhile, or resolved it the other way already. The
// same decision given again is not an error: it is announced again.
func (c *Client) ResolveEffect(ctx context.Context, key string, r schemas.EffectResolution) (*schemas.EffectRecord, error) {
	if r.By == "" {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "resolve effect %s: say who decides (by)", key)
	}
	if !r.Happened && (r.ExternalID != "" || len(r.Result) > 0) {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "resolve effect %s: an effect that did not happen has no external id or result", key)
	}
	if len(r.Result) > 0 && !json.Valid(r.Result) {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "resolve effect %s: the result is not valid JSON", key)
	}
	if err := schemas.CheckResolutionText(r); err != nil {
		return nil, fmt.Errorf("resolve effect %s: %w", key, err)
	}
	ent, err := c.store.Effects.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	rec := *ent.Record
	now := c.now().UTC()
	if rec.State == schemas.EffectReconciled {
		if rec.Happened != nil && *rec.Happened != r.Happened {
			return nil, fmt.Errorf("resolve effect %s: %s already decided it %s: %w", key, rec.ReconciledBy,
				map[bool]string{true: "happened", false: "did not happen"}[*rec.Happened], schemas.ErrConflict)
		}
		// Decided already, the same way: tell the job again (dedup ids make
		// it harmless), which also finishes a resolution whose signal was lost.
		return &rec, c.announceResolution(ctx, &rec, ent.Revision, now)
	}
	if rec.State != schemas.EffectAmbiguous {
		return nil, fmt.Errorf("resolve effect %s: it is %s: %w", key, rec.State, ErrNotAmbiguous)
	}
	happened := r.Happened
	rec.State, rec.Happened, rec.ReconciledBy, rec.Note = schemas.EffectReconciled, &happened, r.By, r.Note
	rec.SettledAt, rec.UpdatedAt = now, now
	if happened {
		rec.ExternalID = r.ExternalID
		rec.Result = r.Result
		if len(rec.Result) == 0 {
			rec.Result = json.RawMessage("{}")
		}
		rec.ResultDigest = digest(rec.Result)
	}
	rev, err := c.store.Effects.Update(ctx, &rec, ent.Revision)
	if err != nil {
		return nil, fmt.Errorf("resolve effect %s: %w", key, err)
	}
	return &rec, c.announceResolution(ctx, &rec, rev, now)
}

// announceResolution appends a resolution to the job's history and tells
// the job.
func (c *Client) announceResolution(ctx context.Context, rec *schemas.EffectRecord, rev uint64, now time.Time) error {
	key := rec.Key
	ev := nats.NewMsg(c.store.Names.HistorySubject(rec.Job))
	ev.Data = schemas.AppendEffectEvent(nil, "/waymark/client", schemas.EventEffectReconciled, rec, rev, now)
	ev.Header.Set(jetstream.MsgIDHeader, rec.Job+"/effect/"+strconv.FormatUint(rev, 10)+"/reconciled")
	ev.Header.Set("Content-Type", HistoryContentType)
	if _, err := c.store.JS.PublishMsg(ctx, ev); err != nil {
		return fmt.Errorf("resolve effect %s: recorded; appending it to history failed, run the command again: %w", key, err)
	}
	sig, _ := json.Marshal(schemas.Signal{Job: rec.Job, Type: schemas.SignalEffectResolved, Key: key, By: rec.ReconciledBy})
	m := nats.NewMsg(c.store.Names.InboxSubject(kv.InboxSignal, rec.Job))
	m.Data = sig
	m.Header.Set(jetstream.MsgIDHeader, rec.Job+"/resolve/"+strconv.FormatUint(rev, 10))
	if _, err := c.store.JS.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("resolve effect %s: recorded, but the job was not told; run the command again: %w", key, err)
	}
	return nil
}
