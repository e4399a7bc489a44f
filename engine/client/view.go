package client

import (
	"encoding/json"
	"slices"
	"sort"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// JobView is a job's record as people and API clients see it: the
// checkpoint with its steps listed in definition order.
type JobView struct {
	ID             string            `json:"id"`
	Workflow       string            `json:"workflow"`
	Version        int               `json:"version"`
	DefinitionHash string            `json:"definition_hash"`
	Status         schemas.JobStatus `json:"status"`
	ResumeCount    int               `json:"resume_count"`
	Seq            uint64            `json:"seq"`
	Steps          []StepView        `json:"steps"`
	Current        *schemas.Dispatch `json:"current,omitempty"`
	// Fan is the parallel or map step running, when one is.
	Fan           *FanView          `json:"fan,omitempty"`
	Blocked       *schemas.Blocked  `json:"blocked,omitempty"`        // the effect a job needing reconciliation waits on
	BlockedReason string            `json:"blocked_reason,omitempty"` // why a blocked job cannot go on
	State         json.RawMessage   `json:"state"`
	Vars          map[string]string `json:"vars,omitempty"`
	Error         *schemas.Error    `json:"error,omitempty"`
	Parent        string            `json:"parent,omitempty"`
	// ParentJob is the job whose workflow step started this one as a child
	// job (its step in ParentStep); Children are the child jobs this job's
	// workflow steps started, oldest run first.
	// Transcripts are the transcripts of the job's agent step runs that
	// ended (the running one is under Fan.Agent), in the value store under
	// the job's message prefix: engine transcript JOB prints them.
	Transcripts []schemas.TranscriptPart `json:"transcripts,omitempty"`
	ParentJob   string                   `json:"parent_job,omitempty"`
	ParentStep  string                   `json:"parent_step,omitempty"`
	Children    []string                 `json:"children,omitempty"`
	// WaitingChild is a child job this job waits for that has stopped for
	// a person (needs_reconciliation, blocked, quarantined): the job goes on
	// only once it ends. Filled by Client.Job and Wait.
	WaitingChild *ChildWait `json:"waiting_child,omitempty"`
	// Approvals are the job's approval gates, open and decided, oldest
	// first: gate, digest, status, expires_at and the decision.
	Approvals []*schemas.Approval `json:"approvals,omitempty"`
	// Paused is set while the job is paused (engine pause).
	Paused *schemas.Pause `json:"paused,omitempty"`
	// Waiting lists the dispatches recorded but not sent because a flow
	// limit of their step (concurrency, rate) has no room, with what each
	// waits for.
	Waiting []WaitingDispatch `json:"waiting,omitempty"`
	// Signals are the named signals the job received: kept for a wait
	// step, and the last taken (or refused).
	Signals []*schemas.ReceivedSignal `json:"signals,omitempty"`
	// Fork says where a fork comes from (engine fork): parent, seq, step.
	Fork *schemas.ForkOrigin `json:"fork,omitempty"`
	// Retries counts the times the job was retried after it failed.
	Retries     int        `json:"retries,omitempty"`
	CreatedAt   time.Time  `json:"created_at"`
	UpdatedAt   time.Time  `json:"updated_at"`
	CompletedAt *time.Time `json:"completed_at,omitempty"`
}

// WaitingDispatch is a dispatch waiting for a flow limit.
type WaitingDispatch struct {
	Step    string            `json:"step"`
	Item    int               `json:"item,omitempty"`
	Attempt int               `json:"attempt"`
	Reason  string            `json:"reason"` // one line: the limit, its key, how full it was
	Flow    *schemas.FlowWait `json:"flow"`
}

// ChildWait is a stopped child job a parent waits for.
type ChildWait struct {
	Job     string            `json:"job"`
	Status  schemas.JobStatus `json:"status"`
	Blocked *schemas.Blocked  `json:"blocked,omitempty"` // the effect it waits on
}

// FanView is a parallel or map step in flight: its branches or items
// counted by where they stand, and the dispatches in flight.
type FanView struct {
	Step      string              `json:"step"`
	Kind      string              `json:"kind"` // "parallel", "map" or "agent"
	Total     int                 `json:"total"`
	Pending   int                 `json:"pending"` // map items not dispatched yet
	Running   int                 `json:"running"` // in flight, retry delays included
	Retrying  int                 `json:"retrying"`
	Completed int                 `json:"completed"`
	Failed    int                 `json:"failed"`
	Cancelled int                 `json:"cancelled,omitempty"`
	Blocked   int                 `json:"blocked,omitempty"` // waiting for a person (its effect's outcome is unknown)
	Chunks    int                 `json:"output_chunks,omitempty"`
	InFlight  []*schemas.Dispatch `json:"in_flight,omitempty"`
	// Agent is an agent step's loop so far: turns, tool calls, usage,
	// the calls of the turn in flight and the transcript's parts. For an
	// agent, Total and Completed count the turn in flight's tool calls.
	Agent *schemas.AgentRun `json:"agent,omitempty"`
}

func newFanView(cp *schemas.Checkpoint) *FanView {
	f := cp.Fan
	kind := "map"
	if f.Next == 0 && f.Total > 0 && len(f.Running) > 0 && f.Running[0].Item == 0 {
		kind = "parallel"
	}
	if f.Agent != nil {
		kind = "agent"
	}
	total, completed := f.Total, f.Done.Len()
	if a := f.Agent; a != nil {
		// An agent's counts are of its turn in flight's tool calls.
		total, completed = len(a.Calls), 0
		for _, c := range a.Calls {
			if c.Done {
				completed++
			}
		}
	}
	v := &FanView{Step: f.Step, Kind: kind, Total: total, Running: len(f.Running), Completed: completed,
		Failed: len(f.Failed), Cancelled: f.Cancelled.Len(), Chunks: len(f.Chunks), InFlight: f.Running, Agent: f.Agent}
	for _, d := range f.Running {
		if d.NotBefore != nil {
			v.Retrying++
		}
	}
	v.Blocked = len(f.Blocked)
	if kind == "map" {
		v.Pending = f.Total - f.Next
	}
	return v
}

// StepView is one step of a job.
type StepView struct {
	ID           string             `json:"id"`
	Kind         string             `json:"kind,omitempty"`
	Status       schemas.StepStatus `json:"status"`
	Attempts     int                `json:"attempts"` // dispatches over the job's lifetime
	Runs         int                `json:"runs,omitempty"`
	DurationMs   int64              `json:"duration_ms,omitempty"` // last attempt
	ResultDigest string             `json:"result_digest,omitempty"`
	LastError    *schemas.Error     `json:"last_error,omitempty"`
}

// JobSummary is a job in a list.
type JobSummary struct {
	ID          string            `json:"id"`
	Workflow    string            `json:"workflow,omitempty"`
	Version     int               `json:"version,omitempty"`
	Status      schemas.JobStatus `json:"status"`
	ResumeCount int               `json:"resume_count"`
	CurrentStep string            `json:"current_step,omitempty"`
	// Waiting says what the job's first dispatch waiting for a flow limit
	// waits for (FlowWait.Reason); empty when none waits.
	Waiting   string         `json:"waiting,omitempty"`
	Error     *schemas.Error `json:"error,omitempty"`
	CreatedAt time.Time      `json:"created_at"`
	UpdatedAt time.Time      `json:"updated_at"`
}

// NewJobView builds the record of cp. def may be nil (steps then appear in
// name order, without kinds).
// NewJobView builds the view of cp under its definition def; with def
// nil (not loadable) the steps are those the checkpoint has, by id.
func NewJobView(cp *schemas.Checkpoint, def *schemas.Definition) *JobView {
	v := &JobView{
		ID: cp.JobID, Workflow: cp.Workflow, Version: cp.Version, DefinitionHash: cp.DefinitionHash,
		Status: cp.Status, ResumeCount: cp.ResumeCount, Seq: cp.Seq, Current: cp.Current, Blocked: cp.Blocked, BlockedReason: cp.BlockedReason,
		State: cp.State, Vars: cp.Vars, Error: cp.Error, Parent: cp.Parent,
		CreatedAt: cp.CreatedAt, UpdatedAt: cp.UpdatedAt, CompletedAt: cp.CompletedAt,
		Steps: []StepView{},
	}
	v.Transcripts = cp.Transcripts
	v.Approvals, v.Paused, v.Retries, v.Signals, v.Fork = cp.Approvals, cp.Paused, cp.Retries, cp.Signals, cp.Fork
	if cp.Fan != nil {
		v.Fan = newFanView(cp)
	}
	for _, d := range cp.Dispatches() {
		if d.Waiting != nil {
			v.Waiting = append(v.Waiting, WaitingDispatch{Step: d.Step, Item: d.Item, Attempt: d.Attempt, Reason: d.Waiting.Reason(), Flow: d.Waiting})
		}
	}
	if cp.Caller != nil {
		v.ParentJob, v.ParentStep = cp.Caller.Job, cp.Caller.Step
	}
	if def != nil {
		for i, s := range def.Steps {
			if s.Kind != schemas.KindWorkflow {
				continue
			}
			runs := 0
			if r := cp.Steps[s.ID]; r != nil {
				runs = r.Runs
			} else if cp.Completed.Has(i) {
				runs = 1
			}
			for run := 1; run <= runs; run++ {
				v.Children = append(v.Children, schemas.ChildJobID(cp.JobID, s.ID, run))
			}
		}
	}
	for _, d := range cp.Dispatches() { // an agent's tool calls that are child jobs, in flight
		if d.Child != "" && !slices.Contains(v.Children, d.Child) {
			v.Children = append(v.Children, d.Child)
		}
	}
	add := func(id, kind string, idx int) {
		sv := StepView{ID: id, Kind: kind, Status: schemas.StepPending}
		if idx >= 0 && cp.Completed.Has(idx) {
			sv.Status, sv.Attempts, sv.Runs = schemas.StepCompleted, 1, 1
		}
		if r := cp.Steps[id]; r != nil {
			sv.Status, sv.Attempts, sv.Runs, sv.DurationMs = r.Status, r.Attempts, r.Runs, r.DurationMs
			sv.ResultDigest, sv.LastError = r.ResultDigest, r.LastError
		}
		v.Steps = append(v.Steps, sv)
	}
	if def != nil {
		for i, s := range def.Steps {
			add(s.ID, s.Kind, i)
		}
		return v
	}
	ids := make([]string, 0, len(cp.Steps))
	for id := range cp.Steps {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		add(id, "", -1)
	}
	return v
}

func summarize(cp *schemas.Checkpoint) JobSummary {
	s := JobSummary{ID: cp.JobID, Workflow: cp.Workflow, Version: cp.Version, Status: cp.Status,
		ResumeCount: cp.ResumeCount, Error: cp.Error, CreatedAt: cp.CreatedAt, UpdatedAt: cp.UpdatedAt}
	switch {
	case cp.Current != nil:
		s.CurrentStep = cp.Current.Step
	case cp.Blocked != nil:
		s.CurrentStep = cp.Blocked.Step // the step whose effect waits for a decision
	}
	for _, d := range cp.Dispatches() {
		if d.Waiting != nil {
			s.Waiting = d.Step + ": " + d.Waiting.Reason()
			break
		}
	}
	return s
}
