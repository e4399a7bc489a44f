package schemas

import (
	"encoding/json"
	"strconv"
	"time"
)

// CheckpointSchema is the version of the Checkpoint encoding written today.
// A checkpoint with another version is a migration, never read blindly.
const CheckpointSchema = 1

// JobStatus is where a job stands.
type JobStatus string

// Job statuses. Completed, Failed and Cancelled are terminal.
const (
	JobPending     JobStatus = "pending"     // created by a client; no engine has started it yet
	JobRunning     JobStatus = "running"     // a step is dispatched or waiting for its retry delay
	JobCompleted   JobStatus = "completed"   // no transition remained; State is final
	JobFailed      JobStatus = "failed"      // a step failed for good or a transition failed the job; see Error
	JobCancelled   JobStatus = "cancelled"   // a person cancelled it (engine cancel); Error says who and why
	JobQuarantined JobStatus = "quarantined" // the checkpoint could not be trusted; needs a person
	// JobNeedsReconciliation: an unsafe effect's outcome is unknown; a
	// person must resolve it (engine effects resolve) before the job goes on.
	JobNeedsReconciliation JobStatus = "needs_reconciliation"
	// JobBlocked: the engine cannot go on until something outside the job
	// is fixed (its pinned definition cannot be loaded, say); BlockedReason
	// says what. It goes on by itself once that is fixed.
	JobBlocked JobStatus = "blocked"
	// JobWaitingApproval: an approval gate is open (Approvals) and nothing
	// else runs; the job goes on when a person decides or the gate expires.
	JobWaitingApproval JobStatus = "waiting_approval"
)

// Terminal reports whether no further transition can happen.
func (s JobStatus) Terminal() bool { return s == JobCompleted || s == JobFailed || s == JobCancelled }

// Stopped reports whether the job is terminal or waits for a person
// (needs_reconciliation, quarantined, blocked, waiting_approval).
func (s JobStatus) Stopped() bool {
	return s.Terminal() || s == JobNeedsReconciliation || s == JobQuarantined || s == JobBlocked || s == JobWaitingApproval
}

// StepStatus is where one step of a job stands.
type StepStatus string

// Step statuses.
const (
	StepPending    StepStatus = "pending"    // not reached yet
	StepDispatched StepStatus = "dispatched" // a message for the current attempt is (being) published
	StepRetrying   StepStatus = "retrying"   // the last attempt failed; the next waits for its delay
	StepCompleted  StepStatus = "completed"  // its output is in State
	StepFailed     StepStatus = "failed"     // its attempts are exhausted or it failed for good
	StepBlocked    StepStatus = "blocked"    // its effect is ambiguous; the job waits for reconciliation
	StepCancelled  StepStatus = "cancelled"  // a parallel branch the join no longer waited for
	StepWaiting    StepStatus = "waiting"    // an approval gate of the step is open, or it waits for a signal
)

// Checkpoint is a job's execution state: one JetStream KV entry per job,
// rewritten after every transition with a compare-and-swap on the revision
// that was read (DESIGN.md invariant 1). It grows with State, not with the
// number of steps run: history goes to the history stream, and steps done
// without incident are kept as ranges of indexes (Completed).
type Checkpoint struct {
	Schema         int    `json:"schema"` // CheckpointSchema
	JobID          string `json:"id"`
	Workflow       string `json:"workflow"`
	Version        int    `json:"version"`
	DefinitionHash string `json:"definition_hash"`
	Seq            uint64 `json:"seq"` // +1 per write; 1 at creation
	// IndexRev is the revision of the job's active entry in the job index
	// (kv.Jobs), written before the first checkpoint; 0 when unknown.
	IndexRev uint64 `json:"index_rev,omitempty"`
	// ActiveRev is the revision of the active entry a reopened job (engine
	// retry, rewind) got; IndexRev still names its creation, in message ids
	// and ledger records. 0 for a job never reopened.
	ActiveRev uint64 `json:"active_rev,omitempty"`
	// Reused: the job id was used before by a job whose records were
	// swept; its derived idempotency keys carry this creation (KeyBase), so
	// that a provider that remembers the old job's keys does not answer
	// this job's calls with that job's results.
	Reused      bool              `json:"reused,omitempty"`
	Status      JobStatus         `json:"status"`
	InputDigest string            `json:"input_digest,omitempty"` // the input itself is in the job.started event
	State       json.RawMessage   `json:"state"`
	Vars        map[string]string `json:"vars,omitempty"` // pinned at start

	// Steps holds one record per step that has been reached, by step id,
	// except the steps in Completed.
	Steps map[string]*StepRecord `json:"steps,omitempty"`

	// Completed holds the steps that completed at their first attempt of
	// their only run, by index in the pinned definition: their record
	// would say no more than that (durations and result digests are in the
	// history), so a job's checkpoint does not grow with the steps it has
	// done. A step entered again (a loop) gets its record back.
	Completed StepSet `json:"completed,omitempty"`

	// Current is the dispatch in flight, recorded before its message is
	// published (DESIGN.md invariant 2); nil when none, and while Fan runs.
	Current *Dispatch `json:"current,omitempty"`

	// Fan is the parallel or map step running, with its dispatches in
	// flight; nil when none.
	Fan *Fan `json:"fan,omitempty"`

	// Blocked is the step whose effect awaits reconciliation, with the
	// effect's key; set while the job needs reconciliation.
	Blocked *Blocked `json:"blocked,omitempty"`

	// BlockedReason says why the job is JobBlocked, and BlockedFrom is the
	// status it goes back to once the cause is gone.
	BlockedReason string    `json:"blocked_reason,omitempty"`
	BlockedFrom   JobStatus `json:"blocked_from,omitempty"`

	// EffectKeys holds the ledger keys of effects whose key the step's
	// idempotency_key template named (shared keys): the job's own keys are
	// derived from its id, these are not. Retention sweeps read them.
	EffectKeys []string `json:"effect_keys,omitempty"`

	// Transcripts are the transcripts of the job's finished agent step
	// runs, in the value store: kept as long as the job, deleted with it.
	Transcripts []TranscriptPart `json:"transcripts,omitempty"`

	// Approvals are the job's approval gates, open and decided, in the
	// order they opened.
	Approvals []*Approval `json:"approvals,omitempty"`
	// Paused is set while a person holds the job (engine pause): results
	// of running steps apply, new dispatches are recorded Held.
	Paused *Pause `json:"paused,omitempty"`
	// Retries counts the times a failed job was retried (engine retry).
	Retries int `json:"retries,omitempty"`
	// Signals are the named signals the job received: those no wait step
	// took yet, and the last ones taken (MaxKeptSignals in all).
	Signals []*ReceivedSignal `json:"signals,omitempty"`
	// LastControl is the last pause, resume, retry or rewind applied:
	// callers tell theirs from one that came first by its id.
	LastControl *ControlRecord `json:"last_control,omitempty"`
	// LastSignal is the last named signal received and its outcome
	// (dropped ones included): its sender learns from it what became of it.
	LastSignal *ReceivedSignal `json:"last_signal,omitempty"`
	// ValidUntil holds, by step, when the output of a step with valid_for
	// expires; Refresh is the step run again because its output expired,
	// and the step dispatched once it completes.
	ValidUntil map[string]time.Time `json:"valid_until,omitempty"`
	Refresh    *Refresh             `json:"refresh,omitempty"`
	// DeadlineAt is when the job's deadline (Definition.Deadline) passes.
	DeadlineAt *time.Time `json:"deadline_at,omitempty"`

	// Cause is the dedup id of the inbox message that produced this Seq. A
	// redelivery of that same message means its first handler may have died
	// before publishing Outbox and Current, so they are published again.
	Cause string `json:"cause,omitempty"`

	// Flushed is the sequence up to which the job's history events were
	// known to be stored in the history stream when this checkpoint was
	// written; Events holds those of the later sequences, up to Seq: a
	// transactional outbox. The writer of a checkpoint whose outbox is due
	// (it holds HistoryBatch transitions, or the job stopped) publishes it
	// as one history message after the write; whoever writes the next
	// checkpoint first makes sure that message is stored (its own
	// acknowledgement, or the history stream's last message), so a
	// checkpoint carries at most a batch of transitions, however many
	// engines took turns and whatever their caches held.
	Flushed uint64 `json:"flushed,omitempty"`
	// Flush says that the writer of this checkpoint publishes Events, as
	// one history message, after writing it; the next writer carries them
	// over otherwise.
	Flush  bool    `json:"flush,omitempty"`
	Events []Event `json:"events,omitempty"`

	ResumeCount int `json:"resume_count"`
	// ResumedBy names the engine incarnation that recorded the last resume
	// caused by redelivered inbox messages.
	ResumedBy string `json:"resumed_by,omitempty"`
	// Writer names the engine incarnation (one process's life) that wrote
	// this checkpoint.
	Writer string `json:"writer,omitempty"`
	Error  *Error `json:"error,omitempty"`

	// Unsaved holds values (map output chunks, state members kept by
	// reference) that the transition that made this checkpoint refers to
	// and that must be stored in the value store before it is written;
	// not part of the encoding.
	Unsaved [][]byte `json:"-"`

	Parent string `json:"parent,omitempty"` // forked from this job
	// Fork says where a fork (engine fork) comes from; nil for a job that
	// is not one.
	Fork *ForkOrigin `json:"fork,omitempty"`
	// Caller is the parent job's step that started this job as a child.
	Caller      *Caller    `json:"caller,omitempty"`
	CreatedAt   time.Time  `json:"created_at"`
	UpdatedAt   time.Time  `json:"updated_at"`
	CompletedAt *time.Time `json:"completed_at,omitempty"`
}

// Event is one history event: something that happened in a transition.
// On the history stream it is a CloudEvent whose id is
// "<job>/<seq>/<n>" and whose data is Data.
type Event struct {
	Type string      `json:"type"` // one of the Event* constants
	Time time.Time   `json:"time"`
	Data HistoryData `json:"data"`
}

// StepRecord is the summary of one step in a job.
type StepRecord struct {
	Status       StepStatus `json:"status"`
	Attempts     int        `json:"attempts"`                // dispatches over the job's lifetime
	Runs         int        `json:"runs"`                    // times the step was entered (loops enter again)
	RunAttempt   int        `json:"run_attempt,omitempty"`   // attempts in the current run
	ResultDigest string     `json:"result_digest,omitempty"` // hex SHA-256 of the last output
	LastError    *Error     `json:"last_error,omitempty"`
	DurationMs   int64      `json:"duration_ms,omitempty"` // wall time of the last attempt
	CompletedSeq uint64     `json:"completed_seq,omitempty"`
}

// Blocked names the step and the effect a job needing reconciliation
// waits on: the effect may have happened and is not recorded as happened
// or not.
type Blocked struct {
	Step      string      `json:"step"`
	EffectKey string      `json:"effect_key"`
	Class     EffectClass `json:"class,omitempty"`
	Reason    string      `json:"reason,omitempty"`
	// LastError is the error of the attempt that left the outcome unknown.
	LastError *Error `json:"last_error,omitempty"`
	// Item is the map item whose effect it is, from 1, and Attempt the
	// item's attempt that left it unknown; 0 when none.
	Item    int `json:"item,omitempty"`
	Attempt int `json:"attempt,omitempty"`
}

// Dispatch is an attempt of a step that has been recorded for publication.
// MsgID is the step message's Nats-Msg-Id, "<job>/<step>/<attempt>"; the
// attempt number is counted over the job's lifetime, so every dispatch of
// a step has its own id even when loops enter the step again.
type Dispatch struct {
	Step         string     `json:"step"`
	Attempt      int        `json:"attempt"`
	RunAttempt   int        `json:"run_attempt"`
	MsgID        string     `json:"msg_id"`
	Pool         string     `json:"pool"`
	DispatchedAt time.Time  `json:"dispatched_at"`
	NotBefore    *time.Time `json:"not_before,omitempty"` // retry delay: workers hold the message until then
	// EffectKey is the ledger key of the attempt's effect (steps that are
	// not pure): the same on every attempt of one logical action.
	EffectKey string `json:"effect_key,omitempty"`
	// Item is the map item this dispatch runs, counted from 1 (the item at
	// index Item-1 of the list); 0 for a dispatch that is not a map item.
	Item int `json:"item,omitempty"`
	// Child is the id of the child job a workflow step's dispatch starts
	// and waits for; no step message is published for it.
	Child string `json:"child,omitempty"`
	// Due is when a sleep step's timer fires: no step message is
	// published for it, a JetStream message schedule answers for it.
	Due *time.Time `json:"due,omitempty"`
	// Held: recorded while the job was paused, not published; engine
	// resume publishes it.
	Held bool `json:"held,omitempty"`
	// Gate is the id of the approval a gate dispatch waits for (see
	// Approval); no message is published for it.
	Gate string `json:"gate,omitempty"`
	// Wait is the signal name a wait step's dispatch waits for (no message
	// is published; Due, when set, is its timeout).
	Wait string `json:"wait,omitempty"`
	// Slot is the flow bucket key of the concurrency slot the dispatch
	// holds (its step declares concurrency), released once its result is
	// applied or the job ends; empty when none.
	Slot string `json:"slot,omitempty"`
	// Waiting: a flow limit of its step (concurrency, rate) had no room;
	// recorded, not published, until the limit admits it.
	Waiting *FlowWait `json:"waiting,omitempty"`
}

// StepMsgID returns the dedup id of a step message: "<prefix>/<step>/<attempt>",
// prefix being the checkpoint's MsgPrefix.
func StepMsgID(prefix, step string, attempt int) string {
	return prefix + "/" + step + "/" + itoa(attempt)
}

// ResultMsgID returns the dedup id of a step result: its step message's id
// and "/result".
func ResultMsgID(prefix, step string, attempt int) string {
	return StepMsgID(prefix, step, attempt) + "/result"
}

// MsgPrefix starts the dedup ids of the job's step messages and history
// messages: the job id, and for a job created with an index entry its
// revision ("<job>/i<rev>"), which names this creation of the job, so that
// an id used again after its job was swept is not taken, within the
// streams' duplicate windows, for a copy of the old job's messages.
func (cp *Checkpoint) MsgPrefix() string {
	if cp.IndexRev == 0 {
		return cp.JobID
	}
	return cp.JobID + "/i" + strconv.FormatUint(cp.IndexRev, 10)
}

// KeyBaseFor is the base of the derived idempotency key of run run of
// step: a fork's parent's for a run the parent had reached when the fork
// was taken (ForkOrigin), else KeyBase.
func (cp *Checkpoint) KeyBaseFor(step string, run int) string {
	if f := cp.Fork; f != nil && run > 0 && run <= f.ParentRuns[step] {
		return f.KeyBase
	}
	return cp.KeyBase()
}

// KeyBase starts the job's derived idempotency keys (IdempotencyKey): the
// job id, or for a job whose id was used before (Reused) MsgPrefix,
// "<job>/i<rev>".
func (cp *Checkpoint) KeyBase() string {
	if cp.Reused {
		return cp.MsgPrefix()
	}
	return cp.JobID
}

// ActiveEntryRev is the revision of the job's active index entry: its
// ActiveRev once reopened, else IndexRev.
func (cp *Checkpoint) ActiveEntryRev() uint64 {
	if cp.ActiveRev != 0 {
		return cp.ActiveRev
	}
	return cp.IndexRev
}

// StartMsgID returns the dedup id of a job start request.
func StartMsgID(job string) string { return job + "/start" }

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b [20]byte
	i := len(b)
	neg := n < 0
	if neg {
		n = -n
	}
	for n > 0 {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
	}
	if neg {
		i--
		b[i] = '-'
	}
	return string(b[i:])
}
