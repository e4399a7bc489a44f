package schemas

import (
	"encoding/json"
	"time"
)

// EffectState is where a side effect stands in the effect ledger. The
// states and the rule that a missing response is never taken as "did not
// happen" follow DESIGN.md invariant 4.
//
//	            create-only              CAS                  CAS
//	(none) ──────────────► prepared ──────────► dispatched ──────────► confirmed
//	                          ▲                    │    │
//	                          │ refused by the     │    └──(unsafe, outcome unknown)──► ambiguous
//	                          │ provider (no effect)│                                      │
//	                          └────────────────────┘          a person or a lookup ──────► reconciled
type EffectState string

// Effect states.
const (
	// EffectPrepared: written create-only before any external call. The
	// call has not been made: any attempt may make it.
	EffectPrepared EffectState = "prepared"
	// EffectDispatched: the call is being made, or was made and its outcome
	// was never recorded. Only the idempotency key (retry), a lookup or a
	// person can say what happened.
	EffectDispatched EffectState = "dispatched"
	// EffectConfirmed: the call returned; the record holds its result.
	EffectConfirmed EffectState = "confirmed"
	// EffectAmbiguous: an unsafe effect whose outcome is unknown. The job
	// waits in JobNeedsReconciliation until a person decides.
	EffectAmbiguous EffectState = "ambiguous"
	// EffectReconciled: settled from outside: it happened (with a result)
	// or it did not (and may be performed).
	EffectReconciled EffectState = "reconciled"
)

// EffectRecord is one logical side effect in the ledger, keyed by its
// idempotency key. Every transition is a compare-and-swap on the KV
// revision and is also appended to the job's history.
type EffectRecord struct {
	Key   string      `json:"key"`
	Job   string      `json:"job"`
	Step  string      `json:"step"`
	Class EffectClass `json:"class"`
	State EffectState `json:"state"`

	// Attempt and Delivery identify the attempt that last wrote the record
	// (the delivery count of its step message breaks ties): a worker whose
	// (attempt, delivery) is below the record's has been overtaken and
	// must not call out (fencing).
	Attempt  int    `json:"attempt"`
	Delivery uint64 `json:"delivery"`
	Worker   string `json:"worker,omitempty"`
	// AttemptOf is the job whose attempt Attempt and Delivery count, when
	// it is not Job (a shared key): attempts of different jobs are not
	// compared.
	AttemptOf string `json:"attempt_of,omitempty"`
	// JobIndexRev names the creation of Job that wrote the record: its
	// checkpoint's IndexRev. A record of Job's own key written by an
	// earlier job with the same id (left behind when that job's checkpoint
	// was removed by hand) is then not taken for this job's effect.
	// 0 in records written before it was kept.
	JobIndexRev uint64 `json:"job_index_rev,omitempty"`

	ExternalID   string          `json:"external_id,omitempty"`
	ResultDigest string          `json:"result_digest,omitempty"`
	Result       json.RawMessage `json:"result,omitempty"`
	LastError    *Error          `json:"last_error,omitempty"`
	Reason       string          `json:"reason,omitempty"` // why ambiguous

	// SharedBy lists the other jobs that use this record: a step-level
	// idempotency_key makes a key shared by jobs (a second job for the
	// same order). A resolution tells every one of them; a retention sweep
	// keeps the record while any of them is kept.
	SharedBy []string `json:"shared_by,omitempty"`

	// Happened is set when reconciled: whether the effect took place.
	Happened     *bool     `json:"happened,omitempty"`
	ReconciledBy string    `json:"reconciled_by,omitempty"`
	Note         string    `json:"note,omitempty"`
	Calls        int       `json:"calls"` // external calls made for this key (lookups excluded)
	PreparedAt   time.Time `json:"prepared_at"`
	DispatchedAt time.Time `json:"dispatched_at,omitzero"`
	SettledAt    time.Time `json:"settled_at,omitzero"` // confirmed, ambiguous or reconciled
	UpdatedAt    time.Time `json:"updated_at"`
}

// Settled reports whether the record holds a final answer: confirmed, or
// reconciled as having happened.
func (r *EffectRecord) Settled() bool {
	return r.State == EffectConfirmed || (r.State == EffectReconciled && r.Happened != nil && *r.Happened)
}

// EffectResolution is what a person says about an ambiguous effect.
type EffectResolution struct {
	Happened   bool            `json:"happened"`
	ExternalID string          `json:"external_id,omitempty"`
	Result     json.RawMessage `json:"result,omitempty"` // the effect's result when it happened; becomes the step's output
	By         string          `json:"by"`
	Note       string          `json:"note,omitempty"`
}

// Signal asks the engine to act on a job from outside: published to the
// inbox as waymark.inbox.signal.<job>.
type Signal struct {
	Job    string `json:"job"`
	Type   string `json:"type"` // SignalEffectResolved or SignalCancel
	Key    string `json:"key,omitempty"`
	By     string `json:"by,omitempty"`
	Reason string `json:"reason,omitempty"` // why, for SignalCancel and the control signals
	// Gate and Digest name the approval an approve or reject decides
	// (Digest may be empty: the gate's current one).
	Gate   string `json:"gate,omitempty"`
	Digest string `json:"digest,omitempty"`
	// From is the step a retry goes on from (empty: the failed step), and
	// IndexRev the revision of the job's active index entry the client
	// wrote back before sending it.
	From     string `json:"from,omitempty"`
	IndexRev uint64 `json:"index_rev,omitempty"`
	// At is when a timer signal was due.
	At time.Time `json:"at,omitzero"`
	// Name, ID and Data are a SignalUser's: its name, the sender's id for
	// it (a repeat with the same id is one signal) and its data.
	Name string          `json:"name,omitempty"`
	ID   string          `json:"id,omitempty"`
	Data json.RawMessage `json:"data,omitempty"`
	// Seq, State and Runs are a rewind's: the sequence gone back to, the
	// state then and the steps' ended runs then (client.Snapshot).
	Seq   uint64          `json:"seq,omitempty"`
	State json.RawMessage `json:"state,omitempty"`
	Runs  map[string]int  `json:"runs,omitempty"`
	// Definition is a migration's new definition hash.
	Definition string `json:"definition,omitempty"`
}

// Signal types.
const (
	// SignalEffectResolved: an ambiguous effect was reconciled; a job
	// waiting on it can go on.
	SignalEffectResolved = "effect_resolved"
	// SignalCancel: a person cancels the job (By, Reason): nothing more is
	// dispatched, results still to come are dropped, child jobs in flight
	// are cancelled too.
	SignalCancel = "cancel"
	// SignalPause holds the job: running steps finish, nothing new is
	// dispatched. SignalResume lifts it.
	SignalPause  = "pause"
	SignalResume = "resume"
	// SignalRetry reopens a failed job at its failed step (or From): the
	// steps it reaches again reuse their runs' idempotency keys, so
	// effects already confirmed answer from the ledger.
	SignalRetry = "retry"
	// SignalApprove and SignalReject decide the open gate Gate (Digest:
	// the action seen). SignalApprovalExpired is the gate's timer (Key: the
	// approval's id), due at its expiry.
	SignalApprove         = "approve"
	SignalReject          = "reject"
	SignalApprovalExpired = "approval_expired"
	// SignalUser is a named signal for the job's wait steps (engine
	// signal); SignalWaitTimeout is a wait step's timer (Key: the wait's
	// dispatch message id).
	SignalUser        = "signal"
	SignalWaitTimeout = "wait_timeout"
	// SignalRewind sets the job back to sequence Seq (State, Runs) and
	// goes on from step From.
	SignalRewind = "rewind"
	// SignalMigrate moves the job to definition Definition with state
	// State (migrated and checked by the client).
	SignalMigrate = "migrate"
	// SignalJobDeadline is the timer of the job's deadline.
	SignalJobDeadline = "job_deadline"
	// SignalFlow wakes a job with a dispatch waiting for a flow limit: a
	// slot was handed to it (Key: the slot's flow bucket key), its rate
	// window ended, or the reconciler retries it. The engine tries to admit
	// the waiting dispatches again.
	SignalFlow = "flow"
)
