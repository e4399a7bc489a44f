package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
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
	store      *kv.Store
	validators *lru.Cache[string, *validators]
	now        func() time.Time
	stored     sync.Map // definition hashes this client has stored
}

// validators are a definition's input and state schemas, compiled.
type validators struct {
	input, state *schemas.Validator
}

// New returns a Client over an opened store.
func New(store *kv.Store) *Client {
	cache, _ := lru.New[string, *validators](64)
	return &Client{store: store, validators: cache, now: time.Now}
}

// Store is the JetStream layout the client works on.
func (c *Client) Store() *kv.Store { return c.store }

// compile returns def's compiled schemas, from the cache when it can.
func (c *Client) compile(def *schemas.Definition) (*validators, error) {
	if v, ok := c.validators.Get(def.Hash); ok {
		return v, nil
	}
	v, err := compileValidators(def)
	if err != nil {
		return nil, err
	}
	c.validators.Add(def.Hash, v)
	return v, nil
}

func compileValidators(def *schemas.Definition) (*validators, error) {
	var v validators
	var err error
	if v.input, err = schemas.CompileSchema("input_schema", def.InputSchema); err != nil {
		return nil, fmt.Errorf("compile definition %s@%d: %w", def.Name, def.Version, err)
	}
	if v.state, err = schemas.CompileSchema("state_schema", def.StateSchema); err != nil {
		return nil, fmt.Errorf("compile definition %s@%d: %w", def.Name, def.Version, err)
	}
	return &v, nil
}

var jobIDRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$`)

// workflowNameRE is the rule of a workflow's name (workflow.schema.json).
var workflowNameRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_-]{0,63}$`)

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
	// Caller, set by an engine, is the parent job's workflow step that
	// starts this job as a child.
	Caller *schemas.Caller
	// Fork, set by Fork, makes the job a fork: the input is the state it
	// starts with (checked against the state schema only).
	Fork *schemas.ForkOrigin
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
	v, err := c.compile(def)
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
	// Refusals of bad input name the job only when the caller named it: a
	// generated id names nothing that exists.
	refuse := func(err error) error {
		named := *schemas.AsError(err) // a copy: its cause stays
		named.Job = ""
		if opts.JobID != "" {
			named.Job = id
		}
		return &named
	}
	if err := schemas.CheckStartText(input, opts.Vars); err != nil {
		return StartResult{}, refuse(err)
	}
	req := &schemas.StartRequest{JobID: id, DefinitionHash: def.Hash, Input: input, Vars: opts.Vars, Caller: opts.Caller, Fork: opts.Fork, RequestedAt: c.now().UTC()}
	inputSchema := v.input
	if opts.Fork != nil {
		req.Parent, inputSchema = opts.Fork.Parent, nil
	}
	checked, err := schemas.CheckJobInput(input, inputSchema, v.state)
	if err != nil {
		return StartResult{}, refuse(err)
	}
	cp := schemas.NewPendingCheckpoint(def, req, checked, schemas.StartMsgID(id), c.now().UTC())
	// Input members over the value threshold go to the value store once
	// the job's index revision (which names their owner) is known; the
	// checkpoint and the start request hold their references.
	var large [][]byte
	if th := c.store.Config.ValueThreshold; c.store.Values != nil && th > 0 && len(checked) > th {
		ext, err := schemas.ExternalizeMembers(checked, th, func(v []byte) (schemas.ValueRef, error) {
			large = append(large, v)
			return schemas.NewValueRef(v), nil
		})
		if err != nil {
			return StartResult{}, refuse(schemas.Errorf(schemas.CodeTooLarge, "input: %v", err))
		}
		if n := int64(len(checked)); n > c.store.Config.MaxJobStateBytes {
			return StartResult{}, refuse(schemas.Errorf(schemas.CodeTooLarge, "input is %d bytes; a job's state may be at most %d (WAYMARK_MAX_JOB_STATE)", n, c.store.Config.MaxJobStateBytes))
		}
		cp.State, req.Input = ext, ext
	}
	// Refuse here what the engine could not store or publish once it starts the job.
	if err := schemas.CheckStartSize(def, req, cp, schemas.SizeLimits{MaxValueBytes: int(c.store.Config.MaxValueBytes), MaxMessageBytes: int(c.store.Config.MaxMessageBytes)}); err != nil {
		return StartResult{}, refuse(err)
	}
	if _, done := c.stored.Load(def.Hash); !done {
		if err := c.store.Definitions.Put(ctx, def); err != nil {
			return StartResult{}, fmt.Errorf("start job %s%s: %w", id, storageFullNote(err), err)
		}
		c.stored.Store(def.Hash, true)
	}
	// The job exists once its pending checkpoint is stored (create-only:
	// an id that exists is attached to). Its index entry comes first, so
	// that no job the engines must watch is ever missing from the index;
	// a crash between the two leaves an entry that the reconciler removes.
	// The start request that follows only wakes an engine; if it is lost,
	// engines start pending jobs by themselves.
	key := kv.ActiveKey(def.Name, id)
	rev, err := c.store.Jobs.CreateActive(ctx, cp)
	created := err == nil
	if errors.Is(err, schemas.ErrConflict) {
		// The job exists, or its creation was cut short: the checkpoint
		// decides which.
		got, gerr := c.store.Jobs.Get(ctx, key)
		if gerr != nil && !errors.Is(gerr, schemas.ErrNotFound) {
			return StartResult{}, fmt.Errorf("start job %s: %w", id, gerr)
		}
		rev, err = got.Revision, nil
	}
	if err != nil {
		return StartResult{}, fmt.Errorf("start job %s%s: %w", id, storageFullNote(err), err)
	}
	cp.IndexRev = rev
	if cp.Reused, err = c.store.Jobs.WasSwept(ctx, id); err != nil {
		return StartResult{}, fmt.Errorf("start job %s: %w", id, err)
	}
	for _, v := range large {
		if _, err := c.store.Values.Put(ctx, cp.MsgPrefix(), v); err != nil {
			return StartResult{}, fmt.Errorf("start job %s: store a large input value%s: %w", id, storageFullNote(err), err)
		}
	}
	// The start request's dedup id names this creation of the job, so that
	// an id used again after its job was swept is not taken for a copy.
	startID := schemas.StartMsgID(id) + "/" + strconv.FormatUint(rev, 10)
	cp.Cause = startID
	if _, err := c.store.Checkpoints.Create(ctx, cp); errors.Is(err, schemas.ErrConflict) {
		if created {
			// The id is taken by a job this start did not create: take back
			// the entry it wrote, unless that job is indexed by it (a
			// concurrent start of the same job stored it first). If this
			// fails, the reconciler removes the entry (it names another
			// workflow, or an ended job).
			if ent, gerr := c.store.Checkpoints.Get(ctx, id); gerr == nil && ent.Checkpoint.IndexRev != rev {
				_ = c.store.Jobs.Remove(ctx, key, rev)
			}
		}
		return c.attach(ctx, id, def, input)
	} else if err != nil {
		return StartResult{}, fmt.Errorf("start job %s%s: %w", id, storageFullNote(err), err)
	}
	if rev == 0 {
		// Another start of this id created the index entry and is still on
		// its way, or a reconciler removed a stale one: make sure the job
		// is indexed.
		if _, err := c.store.Jobs.CreateActive(ctx, cp); err != nil && !errors.Is(err, schemas.ErrConflict) {
			return StartResult{}, fmt.Errorf("start job %s: stored, but not indexed (engines will not watch it until it is): %w", id, err)
		}
	}
	data, err := schemas.Marshal(req)
	if err != nil {
		return StartResult{}, fmt.Errorf("start job %s: %w", id, err)
	}
	m := nats.NewMsg(c.store.Names.InboxSubject(kv.InboxStart, id))
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, startID)
	if _, err := c.store.JS.PublishMsg(ctx, m); err != nil {
		// The job is stored and will be started by the reconciler.
		return res, fmt.Errorf("start job %s: stored, but the start request was not published%s (an engine starts it within its reconcile interval): %w", id, storageFullNote(err), err)
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
	v, err := compileValidators(def)
	if err != nil {
		return err
	}
	_, err = schemas.CheckJobInput(input, v.input, v.state)
	return err
}

// Job returns job id's record. Errors: schemas.ErrInputInvalid for an id
// no job can have (ValidateJobID), schemas.ErrNotFound,
// schemas.ErrQuarantined.
func (c *Client) Job(ctx context.Context, id string) (*JobView, error) {
	if err := ValidateJobID(id); err != nil {
		return nil, err
	}
	ent, err := c.store.Checkpoints.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	def, err := c.store.Definitions.Get(ctx, ent.Checkpoint.DefinitionHash)
	if err != nil {
		def = nil // the record is still worth showing
	}
	return c.view(ctx, ent.Checkpoint, def), nil
}

// view builds cp's JobView, its state with the values it keeps by
// reference read back.
func (c *Client) view(ctx context.Context, cp *schemas.Checkpoint, def *schemas.Definition) *JobView {
	v := NewJobView(cp, def)
	if def != nil {
		for i := range v.Steps {
			if s := def.Step(v.Steps[i].ID); s != nil && s.ForEach != nil && v.Fan != nil && v.Fan.Step == s.ID {
				v.Fan.Kind = "map"
			} else if s != nil && s.Kind == schemas.KindParallel && v.Fan != nil && v.Fan.Step == s.ID {
				v.Fan.Kind, v.Fan.Pending = "parallel", 0
			}
		}
	}
	// A child this job waits for that waits for a person.
	var waiting []string
	for _, d := range cp.Dispatches() {
		if d.Child != "" {
			waiting = append(waiting, d.Child)
		}
	}
	for _, child := range waiting {
		if ent, err := c.store.Checkpoints.Get(ctx, child); err == nil {
			if st := ent.Checkpoint.Status; st.Stopped() && !st.Terminal() {
				v.WaitingChild = &ChildWait{Job: child, Status: st, Blocked: ent.Checkpoint.Blocked}
				break
			}
		}
	}
	// The state as the job's steps see it: values kept by reference are
	// read back (a value that cannot be read leaves its reference).
	if schemas.HasRefs(v.State) && c.store.Values != nil {
		if full, err := c.store.Values.Resolve(ctx, cp.MsgPrefix(), v.State); err == nil {
			v.State = full
		}
	}
	return v
}

// ListFilter narrows List. Zero fields match everything.
type ListFilter struct {
	Status   schemas.JobStatus
	Workflow string
	// Limit caps the page; 0 means 100.
	Limit int
	// After continues a listing: the Cursor of the previous page.
	After string
}

// JobPage is one page of a listing. Cursor, when not empty, is what
// ListFilter.After takes to get the next page.
type JobPage struct {
	Jobs   []JobSummary `json:"jobs"`
	Cursor string       `json:"cursor,omitempty"`
}

// List returns one page of job summaries, newest first: jobs still running
// (or waiting) in the order they were created, finished ones in the order
// they finished, interleaved by that order. It reads the job index, never
// every checkpoint: filters on a finished status or a workflow are done
// by the server, and only the checkpoints of the jobs listed that may
// still change are read (for their current status). A job that changes
// between two pages (it finished) moves to the top of the listing and is
// not listed again further down. Errors: schemas.ErrInputInvalid for a bad
// cursor.
func (c *Client) List(ctx context.Context, f ListFilter) (JobPage, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	before, snapshot, err := parseCursor(f.After)
	if err != nil {
		return JobPage{}, err
	}
	if f.Workflow != "" && !workflowNameRE.MatchString(f.Workflow) {
		return JobPage{}, schemas.Errorf(schemas.CodeInputInvalid, "workflow %q is not a workflow name (1 to 64 letters, digits, '-' and '_', starting with a letter)", f.Workflow)
	}
	filter := kv.IndexFilter{Workflow: f.Workflow}
	activeStatus := false
	switch f.Status {
	case "":
	case schemas.JobCompleted, schemas.JobFailed, schemas.JobCancelled:
		filter.Status = f.Status
	default:
		filter.Active, activeStatus = true, true
	}
	page := JobPage{Jobs: []JobSummary{}}
	for len(page.Jobs) < f.Limit {
		want := f.Limit - len(page.Jobs)
		entries, snap, err := c.store.Jobs.Page(ctx, filter, before, snapshot, want)
		if errors.Is(err, kv.ErrCursor) {
			return JobPage{}, schemas.Errorf(schemas.CodeInputInvalid, "cursor %q is not one this deployment's listings gave (it lies beyond the job index)", f.After)
		}
		if err != nil {
			return JobPage{}, err
		}
		snapshot = snap
		for _, e := range entries {
			before = e.Pos
			s, ok, err := c.summary(ctx, e)
			if err != nil {
				return JobPage{}, err
			}
			if !ok || (activeStatus && s.Status != f.Status) {
				continue
			}
			page.Jobs = append(page.Jobs, s)
		}
		if len(entries) < want {
			return page, nil // the start of the index: no more pages
		}
	}
	page.Cursor = strconv.FormatUint(before, 10) + "." + strconv.FormatUint(snapshot, 10)
	return page, nil
}

// parseCursor reads a listing cursor, "<position>.<snapshot>" (see
// kv.Jobs.Page), or a bare position from an older version (listed as of
// now). Errors: schemas.ErrInputInvalid.
func parseCursor(s string) (before, snapshot uint64, err error) {
	if s == "" {
		return 0, 0, nil
	}
	pos, snap, hasSnap := strings.Cut(s, ".")
	before, err = strconv.ParseUint(pos, 10, 64)
	if err == nil && hasSnap {
		snapshot, err = strconv.ParseUint(snap, 10, 64)
		if err == nil && snapshot == 0 {
			err = errors.New("zero snapshot")
		}
	}
	if err != nil || before == 0 {
		return 0, 0, schemas.Errorf(schemas.CodeInputInvalid, "cursor %q is not one this listing gave (want the cursor of a previous page)", s)
	}
	return before, snapshot, nil
}

// summary describes one index entry: from the entry for a finished job,
// from its checkpoint for one that may still change. ok is false for an
// entry whose checkpoint does not exist (a creation cut short).
func (c *Client) summary(ctx context.Context, e kv.IndexEntry) (JobSummary, bool, error) {
	if e.Ended() {
		return JobSummary{ID: e.Job, Workflow: e.Workflow, Version: e.Version, Status: e.Status, ResumeCount: e.ResumeCount,
			Error: e.Error, CreatedAt: e.CreatedAt, UpdatedAt: derefTime(e.EndedAt)}, true, nil
	}
	ent, err := c.store.Checkpoints.Get(ctx, e.Job)
	switch {
	case errors.Is(err, schemas.ErrNotFound):
		return JobSummary{}, false, nil
	case errors.Is(err, schemas.ErrQuarantined):
		return JobSummary{ID: e.Job, Workflow: e.Workflow, Version: e.Version, Status: schemas.JobQuarantined, Error: schemas.AsError(err),
			CreatedAt: e.CreatedAt, UpdatedAt: e.CreatedAt}, true, nil
	case err != nil:
		return JobSummary{}, false, err
	}
	return summarize(ent.Checkpoint), true, nil
}

func derefTime(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return *t
}

// History returns job id's history events in the order they happened:
// those in the history stream and those its checkpoint still holds (see
// Config.HistoryBatch). For a quarantined job it returns the stream's
// events, or schemas.ErrQuarantined when the stream holds none. An id no
// job can have is schemas.ErrInputInvalid.
func (c *Client) History(ctx context.Context, id string) ([]schemas.HistoryEvent, error) {
	if err := ValidateJobID(id); err != nil {
		return nil, err
	}
	var out []schemas.HistoryEvent
	seen := map[string]bool{}
	err := c.follow(ctx, id, func(h schemas.HistoryEvent, pending uint64) bool {
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
		if errors.Is(err, schemas.ErrQuarantined) && len(out) > 0 {
			// What the stream holds is what a person fixing it needs; the
			// checkpoint's outbox cannot be read.
			return out, nil
		}
		return nil, err
	}
	for _, h := range schemas.CheckpointHistory(id, ent.Checkpoint.Events) {
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
func (c *Client) Wait(ctx context.Context, id string, onEvent func(schemas.HistoryEvent)) (*JobView, error) {
	if ent, err := c.store.Checkpoints.Get(ctx, id); err == nil && ent.Checkpoint.Status.Stopped() {
		// Stopped already: its whole history, in order, rather than the last
		// outbox first and the stream after it.
		if onEvent != nil {
			evs, err := c.History(ctx, id)
			if err != nil {
				return nil, fmt.Errorf("wait for job %s: %w", id, err)
			}
			for _, h := range evs {
				onEvent(h)
			}
		}
		def, _ := c.store.Definitions.Get(ctx, ent.Checkpoint.DefinitionHash)
		return c.view(ctx, ent.Checkpoint, def), nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	seen := map[string]bool{}
	emit := func(h schemas.HistoryEvent) {
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
		followDone <- c.follow(ctx, id, func(h schemas.HistoryEvent, _ uint64) bool {
			emit(h)
			return true
		}, false)
	}()
	var final *schemas.Checkpoint
	err := c.store.Checkpoints.Watch(ctx, id, func(ent kv.Entry, err error) bool {
		if err != nil {
			return true
		}
		for _, h := range schemas.CheckpointHistory(id, ent.Checkpoint.Events) {
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
	_ = c.follow(context.WithoutCancel(ctx), id, func(h schemas.HistoryEvent, pending uint64) bool {
		emit(h)
		return pending > 0
	}, true)
	def, _ := c.store.Definitions.Get(context.WithoutCancel(ctx), final.DefinitionHash)
	return c.view(ctx, final, def), nil
}

// follow delivers job's history events in order, each once even if it was
// published again after a crash, until fn returns false, ctx ends, or
// (stopAtEnd) the stream has no more.
func (c *Client) follow(ctx context.Context, id string, fn func(schemas.HistoryEvent, uint64) bool, stopAtEnd bool) error {
	cons, err := c.store.JS.OrderedConsumer(ctx, c.store.Names.HistoryStream, jetstream.OrderedConsumerConfig{
		FilterSubjects: c.store.Names.HistoryFilters(id),
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
		evs, err := schemas.DecodeHistory(m.Data())
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
	return schemas.InputDigest(input) == digestOf
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
// Errors: schemas.ErrInputInvalid for a Job no job can have.
func (c *Client) Effects(ctx context.Context, f EffectFilter) ([]*schemas.EffectRecord, error) {
	if f.Job != "" {
		if err := ValidateJobID(f.Job); err != nil {
			return nil, err
		}
	}
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
// waiting for a decision; it is schemas.ErrNotAmbiguous.
var ErrNotAmbiguous = schemas.ErrNotAmbiguous

// ErrNothingToResume is returned by ResolveEffect when no job waits on the
// effect: every job that used it has ended or is gone, so a decision would
// move nothing. Nothing is recorded.
var ErrNothingToResume = errors.New("no job waits on this effect")

// Resolution says what ResolveEffect did: the reconciled record (its
// fields, in JSON too) and the jobs it moves on.
type Resolution struct {
	*schemas.EffectRecord
	// Resumed lists the jobs told to go on: each was waiting on the effect
	// (needs_reconciliation), or is running and will find the decision
	// when its current attempt reports. Empty when the same decision is
	// given again after its jobs went on.
	Resumed []string `json:"resumed"`
}

// ResolveEffect settles an ambiguous effect with a person's decision: the
// record becomes reconciled (happened, with its result and external id, or
// did not happen), who and when are recorded, the decision is appended to
// the history of every job that uses the effect, and each of them that
// waits on it goes on: its step gets a new attempt that returns the
// recorded result (happened) or performs the action again under the same
// idempotency key (did not happen). A decision that would move no job (all
// that used the effect ended) is refused with ErrNothingToResume, and one
// for an effect that is not ambiguous with ErrNotAmbiguous, saying where
// it stands. The write is a compare-and-swap: two people resolving at once
// cannot both win. Errors also: schemas.ErrNotFound; schemas.ErrInputInvalid
// for a result that is not JSON or details given with "did not happen";
// schemas.ErrConflict when someone else resolved it meanwhile, or resolved
// it the other way already. The same decision given again is not an error:
// it is announced again.
func (c *Client) ResolveEffect(ctx context.Context, key string, r schemas.EffectResolution) (*Resolution, error) {
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
		if r.Happened && ((r.ExternalID != "" && r.ExternalID != rec.ExternalID) ||
			(len(r.Result) > 0 && schemas.Digest(r.Result) != rec.ResultDigest)) {
			return nil, fmt.Errorf("resolve effect %s: %s already decided it happened, with external id %q and result digest %s; another external id or result is not recorded: %w",
				key, rec.ReconciledBy, rec.ExternalID, rec.ResultDigest, schemas.ErrConflict)
		}
		// Decided already, the same way: tell the jobs again (dedup ids make
		// it harmless), which also finishes a resolution whose signal was lost.
		resumed, _, err := c.waiting(ctx, &rec)
		if err != nil {
			return nil, err
		}
		return &Resolution{EffectRecord: &rec, Resumed: resumed}, c.announceResolution(ctx, &rec, ent.Revision, now, resumed)
	}
	if rec.State != schemas.EffectAmbiguous {
		return nil, fmt.Errorf("resolve effect %s: it is %s, not ambiguous: %s: %w", key, rec.State, stateAdvice(rec.State), ErrNotAmbiguous)
	}
	resumed, why, err := c.waiting(ctx, &rec)
	if err != nil {
		return nil, err
	}
	if len(resumed) == 0 && !c.cancelledJob(ctx, rec.Job) {
		return nil, fmt.Errorf("resolve effect %s: %s; a decision would move nothing, so none is recorded: %w", key, why, ErrNothingToResume)
	}
	// A cancelled job's effect is decided for the record (what happened
	// to the mail?): nothing resumes.
	happened := r.Happened
	rec.State, rec.Happened, rec.ReconciledBy, rec.Note = schemas.EffectReconciled, &happened, r.By, r.Note
	rec.SettledAt, rec.UpdatedAt = now, now
	if happened {
		rec.ExternalID = r.ExternalID
		rec.Result = r.Result
		if len(rec.Result) == 0 {
			rec.Result = json.RawMessage("{}")
		}
		rec.ResultDigest = schemas.Digest(rec.Result)
	}
	rev, err := c.store.Effects.Update(ctx, &rec, ent.Revision)
	if err != nil {
		return nil, fmt.Errorf("resolve effect %s: %w", key, err)
	}
	return &Resolution{EffectRecord: &rec, Resumed: resumed}, c.announceResolution(ctx, &rec, rev, now, resumed)
}

func stateAdvice(s schemas.EffectState) string {
	switch s {
	case schemas.EffectPrepared:
		return "no call was made yet"
	case schemas.EffectDispatched:
		return "its step is still trying (same idempotency key); if the job stops in needs_reconciliation the effect becomes ambiguous and can be resolved"
	case schemas.EffectConfirmed:
		return "the provider's answer is recorded"
	}
	return "nothing to decide"
}

// cancelledJob reports whether job exists and was cancelled.
func (c *Client) cancelledJob(ctx context.Context, job string) bool {
	ent, err := c.store.Checkpoints.Get(ctx, job)
	return err == nil && ent.Checkpoint.Status == schemas.JobCancelled
}

// waiting lists the jobs using rec (its creator and the jobs sharing it)
// that a decision moves on: those waiting on it, and those running with
// it as their current effect. why says, when none does, where they stand.
func (c *Client) waiting(ctx context.Context, rec *schemas.EffectRecord) (jobs []string, why string, err error) {
	var states []string
	for _, job := range append([]string{rec.Job}, rec.SharedBy...) {
		ent, err := c.store.Checkpoints.Get(ctx, job)
		switch {
		case errors.Is(err, schemas.ErrNotFound):
			states = append(states, "job "+job+" no longer exists")
			continue
		case err != nil:
			return nil, "", fmt.Errorf("resolve effect %s: read job %s: %w", rec.Key, job, err)
		}
		cp := ent.Checkpoint
		status := cp.Status
		if status == schemas.JobBlocked {
			status = cp.BlockedFrom
		}
		switch {
		case status == schemas.JobNeedsReconciliation && cp.Blocked != nil && cp.Blocked.EffectKey == rec.Key:
			jobs = append(jobs, job)
		case status == schemas.JobRunning && cp.Current != nil && cp.Current.EffectKey == rec.Key:
			jobs = append(jobs, job)
		case status == schemas.JobNeedsReconciliation && cp.Fan != nil && slices.ContainsFunc(cp.Fan.Blocked, func(b schemas.Blocked) bool { return b.EffectKey == rec.Key }):
			jobs = append(jobs, job) // another item or branch of its fan
		case cp.Fan != nil && slices.ContainsFunc(cp.Fan.Running, func(d *schemas.Dispatch) bool { return d.EffectKey == rec.Key }):
			jobs = append(jobs, job) // an item or branch in flight
		default:
			desc := string(cp.Status)
			if cp.Error != nil {
				desc += " (" + cp.Error.Message + ")"
			}
			states = append(states, "job "+job+" is "+desc)
		}
	}
	return jobs, strings.Join(states, "; "), nil
}

// announceResolution appends a resolution to the history of each job and
// tells them.
func (c *Client) announceResolution(ctx context.Context, rec *schemas.EffectRecord, rev uint64, now time.Time, jobs []string) error {
	key := rec.Key
	for _, job := range jobs {
		r := *rec
		r.Job = job
		if err := c.store.AppendEffectEvent(ctx, job, "/waymark/client", schemas.EventEffectReconciled, &r, rev, now); err != nil {
			return fmt.Errorf("resolve effect %s: recorded; appending it to the history of job %s failed, run the command again: %w", key, job, err)
		}
		if err := c.store.SignalResolved(ctx, job, key, rev, rec.ReconciledBy); err != nil {
			return fmt.Errorf("resolve effect %s: recorded, but job %s was not told; run the command again: %w", key, job, err)
		}
	}
	return nil
}

// storageFullNote names the cause of err when JetStream's storage is full.
func storageFullNote(err error) string {
	if kv.IsStorageFull(err) {
		return " because JetStream's storage is full (free space or raise the limit: engine serve --max-store, or the server's max_file_store)"
	}
	return ""
}

// ErrCancelPending: a cancel was sent and no engine recorded it before the
// context ended; it waits in the job's inbox, for the next engine.
var ErrCancelPending = errors.New("the cancel waits in the job's inbox")

// CancelRequest says who cancels a job and why: by is required, both are
// at most 1,000 characters of text, without control characters.
type CancelRequest struct {
	By     string `json:"by"`
	Reason string `json:"reason,omitempty"`
}

// Cancel asks that job id be cancelled and waits (until ctx ends) for the
// engine to record it: nothing more of it is dispatched, results still to
// come are dropped, its child jobs in flight are cancelled too. It returns
// the job's record: cancelled, or the status it ended with first (a job
// that had completed or failed is not changed). Errors: schemas.ErrNotFound
// for an unknown job; CodeInputInvalid for a request without by.
func (c *Client) Cancel(ctx context.Context, id string, r CancelRequest) (*JobView, error) {
	if err := checkWho("cancel", id, ControlRequest{By: r.By, Reason: r.Reason}); err != nil {
		return nil, err
	}
	ent, err := c.store.Checkpoints.Get(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("cancel job %s: %w", id, err)
	}
	if !ent.Checkpoint.Status.Terminal() {
		if err := c.store.SignalCancel(ctx, id, r.By, r.Reason); err != nil {
			return nil, fmt.Errorf("cancel job %s: %w", id, err)
		}
		// Until it ends: a job waiting for a person is stopped, not ended.
		final, err := c.await(ctx, "cancel", id, func(cp *schemas.Checkpoint) bool { return cp.Status.Terminal() }, ErrCancelPending)
		if err != nil {
			return nil, err
		}
		ent.Checkpoint = final
	}
	def, _ := c.store.Definitions.Get(ctx, ent.Checkpoint.DefinitionHash)
	return c.view(ctx, ent.Checkpoint, def), nil
}
