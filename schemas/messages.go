package schemas

import (
	"encoding/json"
	"time"
)

// StartRequest asks the engine to create a job. It is published to the
// inbox with dedup id StartMsgID(JobID); the engine creates the checkpoint
// create-only, so a second start of the same id attaches instead.
type StartRequest struct {
	JobID          string            `json:"job_id"`
	DefinitionHash string            `json:"definition_hash"` // the definition must already be stored
	Input          json.RawMessage   `json:"input"`
	Vars           map[string]string `json:"vars,omitempty"`
	Parent         string            `json:"parent,omitempty"`
	// Caller is the step that started this job as a child job.
	Caller *Caller `json:"caller,omitempty"`
	// Fork, for a fork of another job (engine fork): Input is the state
	// the fork starts with (checked against the state schema, not the
	// input schema) and the job starts at Fork.From.
	Fork        *ForkOrigin `json:"fork,omitempty"`
	RequestedAt time.Time   `json:"requested_at"`
}

// ForkOrigin is where a fork comes from: its parent job, the parent's
// sequence it was taken at, the step it starts at, and the parent's ended
// runs per step then (the fork's run counts start there). A run of a step
// that the parent had reached at that sequence (ParentRuns: its ended runs
// and the one in flight then) takes the parent's idempotency key
// (KeyBase), so that an effect the parent confirmed answers from the
// ledger and is never made twice, even for the step the parent was at;
// every later run takes the fork's own keys.
type ForkOrigin struct {
	Parent     string         `json:"parent"`
	Seq        uint64         `json:"seq"`
	From       string         `json:"from"`
	Runs       map[string]int `json:"runs,omitempty"`
	ParentRuns map[string]int `json:"parent_runs,omitempty"`
	KeyBase    string         `json:"key_base"`
	// Approvals are the parent's approvals decided by then: they carry on
	// in the fork (a scope keeps bounding what the fork's steps send).
	Approvals []*Approval `json:"approvals,omitempty"`
}

// Caller names the dispatch of a parent job's workflow step that started
// a child job: the child's end is sent to the parent's inbox as the
// result of that dispatch (Nats-Msg-Id MsgID + "/result").
type Caller struct {
	Job     string `json:"job"`
	Step    string `json:"step"`
	Attempt int    `json:"attempt"`
	MsgID   string `json:"msg_id"`
	// Depth is how deep the child is: 1 for a job's child, 2 for its
	// grandchild; at most MaxChildDepth.
	Depth int `json:"depth,omitempty"`
	// Item is the parent's tool call (Dispatch.Item) when the child runs an
	// agent's tool of kind workflow; 0 otherwise.
	Item int `json:"item,omitempty"`
}

// MaxChildDepth bounds the nesting of child jobs: a workflow that starts
// itself through others fails its step at this depth instead of starting
// jobs without end.
const MaxChildDepth = 8

// StepMessage is one attempt of one step, sent to a worker pool on the work
// stream with Nats-Msg-Id = StepMsgID(Job, Step, Attempt).
type StepMessage struct {
	Job            string            `json:"job"`
	Step           string            `json:"step"`
	Attempt        int               `json:"attempt"`     // over the job's lifetime
	RunAttempt     int               `json:"run_attempt"` // within the current run, from 1
	DefinitionHash string            `json:"definition_hash"`
	State          json.RawMessage   `json:"state"` // the job's state when the attempt was dispatched
	Vars           map[string]string `json:"vars,omitempty"`
	NotBefore      *time.Time        `json:"not_before,omitempty"` // hold until then (retry backoff)
	IdempotencyKey string            `json:"idempotency_key"`      // derived from job and step; the same on every attempt
	// EffectKey is the ledger key of the step's effect, computed by the
	// engine (the idempotency key, or the key the step's idempotency_key
	// template names); empty for pure steps and older engines.
	EffectKey string `json:"effect_key,omitempty"`
	// Item is the map item this attempt runs, from 1 (0: not a map item);
	// ItemValue is the item and ItemName its name (its key, or
	// "item-<index>"). State is then the job's state without the list.
	Item      int             `json:"item,omitempty"`
	ItemName  string          `json:"item_name,omitempty"`
	ItemValue json.RawMessage `json:"item_value,omitempty"`
	// ValueOwner is the owner under which the values State refers to
	// (ValueRef) are stored: the job's message prefix; empty when State
	// holds no reference.
	ValueOwner string `json:"value_owner,omitempty"`
	// Tool is the agent tool a tool call runs (ItemValue holds its
	// arguments, ItemName the model's tool_use id); Turn is the model turn
	// an agent step's turn dispatch makes, from 1, and Transcript the
	// conversation so far, by reference (values owned by ValueOwner).
	Tool       string           `json:"tool,omitempty"`
	Turn       int              `json:"turn,omitempty"`
	Transcript []TranscriptPart `json:"transcript,omitempty"`
	// Scope is the condition (expr-lang, over .request) an approval that
	// covers this step allowed, and ScopeOf that approval's id: the
	// worker checks the rendered request against it before the effect.
	Scope   string `json:"scope,omitempty"`
	ScopeOf string `json:"scope_of,omitempty"`
}

// StepResult is a worker's answer for one attempt, sent to the engine's
// inbox with Nats-Msg-Id = ResultMsgID(Job, Step, Attempt). Exactly one of
// Output and Error is set.
type StepResult struct {
	Job         string          `json:"job"`
	Step        string          `json:"step"`
	Attempt     int             `json:"attempt"`
	Output      json.RawMessage `json:"output,omitempty"`
	Error       *Error          `json:"error,omitempty"`
	DurationMs  int64           `json:"duration_ms"`
	Redelivered bool            `json:"redelivered,omitempty"` // the step message had been delivered before: a worker died or stalled
	Worker      string          `json:"worker,omitempty"`
	EffectKey   string          `json:"effect_key,omitempty"` // the ledger key, for steps that are not pure
	// EffectState is the ledger state of the effect when the attempt ended
	// in an error: whether the call may have happened (dispatched,
	// ambiguous) or certainly did not (prepared). Empty for pure steps.
	EffectState EffectState `json:"effect_state,omitempty"`
	// Item is the map item the attempt ran, from 1; 0 when none.
	Item int `json:"item,omitempty"`
}

// History event types (CloudEvents "type" attribute). Every transition of a
// job appends one or more of these to the history stream (DESIGN.md
// invariant 8).
const (
	EventJobStarted        = "dev.waymark.job.started"
	EventJobResumed        = "dev.waymark.job.resumed"
	EventJobBlocked        = "dev.waymark.job.blocked"   // the engine cannot go on (its definition cannot be loaded); Reason says why
	EventJobUnblocked      = "dev.waymark.job.unblocked" // the cause of a job.blocked is gone
	EventJobCompleted      = "dev.waymark.job.completed"
	EventJobFailed         = "dev.waymark.job.failed"
	EventJobCancelled      = "dev.waymark.job.cancelled"      // By and Reason say who and why; Reason lists what was in flight"
	EventJobPaused         = "dev.waymark.job.paused"         // By and Reason say who and why
	EventJobUnpaused       = "dev.waymark.job.unpaused"       // engine resume: held dispatches go out
	EventJobRetried        = "dev.waymark.job.retried"        // a failed job reopened (engine retry); Step is where it goes on
	EventJobMigrated       = "dev.waymark.job.migrated"       // engine migrate: Reason names the definitions, the state change is the transition's delta
	EventJobRewound        = "dev.waymark.job.rewound"        // engine rewind: ToSeq the sequence gone back to, Step where it goes on, Runs the steps' ended runs then
	EventApprovalRequested = "dev.waymark.approval.requested" // Approval holds the gate
	EventApprovalDecided   = "dev.waymark.approval.decided"   // Approval holds the decision: approved, rejected or expired
	EventSignalReceived    = "dev.waymark.signal.received"    // Signal holds it; Step the wait step that took it, if one did
	EventStepDispatched    = "dev.waymark.step.dispatched"
	EventStepCompleted     = "dev.waymark.step.completed"
	EventStepFailed        = "dev.waymark.step.failed"  // one attempt failed; Retrying tells whether another follows
	EventStepBlocked       = "dev.waymark.step.blocked" // an unsafe effect is ambiguous; the job needs reconciliation
	EventStepUnblocked     = "dev.waymark.step.unblocked"
	EventStepCancelled     = "dev.waymark.step.cancelled" // a parallel branch the join no longer waits for
	// EventStepWaiting: a dispatch found a flow limit of its step full and
	// waits, recorded and not published (Flow says which limit);
	// EventStepAdmitted: a flow-limited dispatch was admitted and sent
	// (Flow: the limit, the slot or window it took).
	EventStepWaiting  = "dev.waymark.step.waiting"
	EventStepAdmitted = "dev.waymark.step.admitted"
	// EventAgentTurn: an agent step's model turn is in its transcript;
	// Turn, Model, Usage and PromptVersion say which and what it cost.
	EventAgentTurn = "dev.waymark.agent.turn"

	// Effect ledger transitions, published by workers and by whoever
	// resolves an effect. Data.Effect holds the record.
	EventEffectPrepared   = "dev.waymark.effect.prepared"
	EventEffectDispatched = "dev.waymark.effect.dispatched"
	EventEffectConfirmed  = "dev.waymark.effect.confirmed"
	EventEffectAmbiguous  = "dev.waymark.effect.ambiguous"
	EventEffectReconciled = "dev.waymark.effect.reconciled"
	EventEffectReplayed   = "dev.waymark.effect.replayed" // a settled effect answered an attempt without a call
)

// HistoryData is the data of a history event.
type HistoryData struct {
	Job          string    `json:"job,omitempty"` // left out in a checkpoint's outbox, which is the job's own
	Seq          uint64    `json:"seq"`           // checkpoint sequence the event was written with
	Step         string    `json:"step,omitempty"`
	Attempt      int       `json:"attempt,omitempty"`
	Item         int       `json:"item,omitempty"` // the map item, from 1
	Status       string    `json:"status,omitempty"`
	DurationMs   int64     `json:"duration_ms,omitempty"`
	Error        *Error    `json:"error,omitempty"`
	ResultDigest string    `json:"result_digest,omitempty"`
	Retrying     bool      `json:"retrying,omitempty"`
	NotBefore    time.Time `json:"not_before,omitzero"`
	Reason       string    `json:"reason,omitempty"`
	Next         string    `json:"next,omitempty"`         // the step dispatched by this transition
	NextAttempt  int       `json:"next_attempt,omitempty"` // its attempt number
	// Input is the job's input, on job.started only.
	Input json.RawMessage `json:"input,omitempty"`
	// EffectKey and EffectState describe effect events.
	EffectKey   string `json:"effect_key,omitempty"`
	EffectState string `json:"effect_state,omitempty"`
	ExternalID  string `json:"external_id,omitempty"`
	By          string `json:"by,omitempty"`
	// Turn, Tool, Model, Usage and PromptVersion describe an agent step's
	// model turns (agent.turn) and tool calls (Tool on an item's events).
	Turn          int         `json:"turn,omitempty"`
	Tool          string      `json:"tool,omitempty"`
	Call          string      `json:"call,omitempty"` // the model's tool_use id of a tool call
	Model         string      `json:"model,omitempty"`
	Usage         *TokenUsage `json:"usage,omitempty"`
	PromptVersion string      `json:"prompt_version,omitempty"`
	// Approval is the gate of approval events.
	Approval *Approval `json:"approval,omitempty"`
	// Signal is the signal of signal events.
	Signal *ReceivedSignal `json:"signal,omitempty"`
	// State is the transition's state delta (StateDelta), on its first
	// event: engine inspect --at, rewind and fork rebuild the state at a
	// sequence from the job's input and these.
	State json.RawMessage `json:"state,omitempty"`
	// ToSeq and Runs are a rewind's (job.rewound): the sequence gone back
	// to and the steps' ended runs then.
	ToSeq uint64         `json:"to_seq,omitempty"`
	Runs  map[string]int `json:"runs,omitempty"`
	// Flow is the limit of step.waiting and step.admitted events: for a
	// rate limit admitted, Since and Until bound the window counted in.
	Flow *FlowWait `json:"flow,omitempty"`
}
