package engine

import (
	"sync/atomic"
	"time"
)

// Stats are an engine's counters since it started. Every field counts
// events (no units) unless its name says otherwise.
type Stats struct {
	JobsStarted      uint64 `json:"jobs_started"`
	JobsCompleted    uint64 `json:"jobs_completed"`
	JobsFailed       uint64 `json:"jobs_failed"`
	JobsRejected     uint64 `json:"jobs_rejected"`    // start requests whose input failed its schema
	Transitions      uint64 `json:"transitions"`      // checkpoint writes
	StepsDispatched  uint64 `json:"steps_dispatched"` // step messages published
	ResultsApplied   uint64 `json:"results_applied"`
	StaleDropped     uint64 `json:"stale_results_dropped"` // results for an attempt no longer current (DESIGN.md invariant 3)
	CASConflicts     uint64 `json:"cas_conflicts"`         // checkpoint writes that lost to another writer
	Resumes          uint64 `json:"resumes"`               // recoveries: a redelivered trigger or step
	InboxRedelivered uint64 `json:"inbox_redeliveries"`
	Republished      uint64 `json:"republished"`   // dispatches published again after a handler died
	AttemptsLost     uint64 `json:"attempts_lost"` // attempts the reconciler declared lost
	ReconcileErrors  uint64 `json:"reconcile_errors"`
	HandleErrors     uint64 `json:"handle_errors"`    // inbox messages left for redelivery after an error
	JobsBlocked      uint64 `json:"jobs_blocked"`     // jobs that stopped on an ambiguous effect
	EffectsResolved  uint64 `json:"effects_resolved"` // blocked jobs a resolution set going again
	JobsCancelled    uint64 `json:"jobs_cancelled"`   // by a person (engine cancel)
	DeadLetters      uint64 `json:"dead_letters"`     // step messages that reached the work consumer's max deliveries
	Requeued         uint64 `json:"requeued"`         // jobs dispatched again because the queues were lost
	EffectsSwept     uint64 `json:"effects_swept"`    // effect records removed with their job after its retention
	JobsSwept        uint64 `json:"jobs_swept"`       // finished jobs removed after their retention
	ChildrenStarted  uint64 `json:"children_started"` // child jobs started by workflow steps
	CronStarted      uint64 `json:"cron_started"`     // jobs started by cron schedules
	// HistoryRepublished counts transitions whose events this engine
	// published again before writing the next checkpoint, because it could
	// not tell they were stored (another engine, or a restart, wrote them).
	HistoryRepublished uint64 `json:"history_republished"`
	// DefinitionBlocked counts jobs blocked because their pinned definition
	// could not be loaded; DefinitionUnblocked, those that went on.
	DefinitionBlocked   uint64 `json:"definition_blocked"`
	DefinitionUnblocked uint64 `json:"definition_unblocked"`
	// MarkedAmbiguous counts effects the engine marked ambiguous because
	// their step failed for good while the call may have happened.
	MarkedAmbiguous uint64 `json:"marked_ambiguous"`
	Panics          uint64 `json:"panics"`         // panics contained while handling one job's messages
	Quarantined     uint64 `json:"quarantined"`    // times a job's messages were held back: its checkpoint cannot be trusted
	IndexRepaired   uint64 `json:"index_repaired"` // index entries the reconciler fixed (a crash between two writes)
	// StorageFull counts transitions that could not be written because
	// JetStream's storage is full; their messages are kept and tried
	// again.
	StorageFull uint64 `json:"storage_full"`
	// FlowWaits counts dispatches recorded waiting for a flow limit
	// (concurrency or rate, schemas.FlowWait); FlowHandedOver, concurrency
	// slots handed from a finished dispatch to a waiting one; FlowLeaked,
	// slots the reconciler released because their holder's checkpoint no
	// longer named them (a crash between a write and its release).
	FlowWaits      uint64 `json:"flow_waits"`
	FlowHandedOver uint64 `json:"flow_handed_over"`
	FlowLeaked     uint64 `json:"flow_leaked"`
	// ActiveJobs is the number of jobs in the index that may still change,
	// at the last reconcile pass; StepsWaitingForWorkers, of those, the
	// ones whose step message waits in its pool's queue past its deadline.
	ActiveJobs             int64 `json:"active_jobs"`
	StepsWaitingForWorkers int64 `json:"steps_waiting_for_workers"`
	// OldestRunningAgeMs is the age of the oldest running job's checkpoint
	// (time since its last write) at the last reconcile pass, in ms.
	OldestRunningAgeMs int64 `json:"oldest_running_age_ms"`
	// FirstProgressMs is the time from Run to the first applied transition,
	// in milliseconds; 0 until then.
	FirstProgressMs int64 `json:"first_progress_ms"`
}

type counters struct {
	jobsStarted, jobsCompleted, jobsFailed, jobsRejected atomic.Uint64
	transitions, dispatched, applied, stale, conflicts   atomic.Uint64
	resumes, inboxRedelivered, republished, lost         atomic.Uint64
	reconcileErrors, handleErrors, blocked, unblocked    atomic.Uint64
	deadLetters, swept, requeued                         atomic.Uint64
	jobsSwept, historyRepublished, definitionBlocked     atomic.Uint64
	childrenStarted, jobsCancelled, cronStarted          atomic.Uint64
	definitionUnblocked, markedAmbiguous, panics         atomic.Uint64
	quarantined, indexRepaired, storageFull              atomic.Uint64
	flowWaits, flowHandedOver, flowLeaked                atomic.Uint64
	activeJobs, waitingForWorkers                        atomic.Int64
	oldestRunning                                        atomic.Int64 // ms
	started                                              atomic.Int64 // unix ns
	firstProgress                                        atomic.Int64 // ns after started
}

func (c *counters) progress(now time.Time) {
	if c.firstProgress.Load() != 0 {
		return
	}
	if s := c.started.Load(); s != 0 {
		c.firstProgress.CompareAndSwap(0, max(now.UnixNano()-s, 1))
	}
}

// Stats returns a snapshot of the engine's counters. Safe for concurrent use.
func (e *Engine) Stats() Stats {
	c := &e.ctr
	return Stats{
		JobsStarted:            c.jobsStarted.Load(),
		JobsCompleted:          c.jobsCompleted.Load(),
		JobsFailed:             c.jobsFailed.Load(),
		JobsRejected:           c.jobsRejected.Load(),
		Transitions:            c.transitions.Load(),
		StepsDispatched:        c.dispatched.Load(),
		ResultsApplied:         c.applied.Load(),
		StaleDropped:           c.stale.Load(),
		CASConflicts:           c.conflicts.Load(),
		Resumes:                c.resumes.Load(),
		InboxRedelivered:       c.inboxRedelivered.Load(),
		Republished:            c.republished.Load(),
		AttemptsLost:           c.lost.Load(),
		ReconcileErrors:        c.reconcileErrors.Load(),
		HandleErrors:           c.handleErrors.Load(),
		JobsBlocked:            c.blocked.Load(),
		EffectsResolved:        c.unblocked.Load(),
		JobsCancelled:          c.jobsCancelled.Load(),
		DeadLetters:            c.deadLetters.Load(),
		EffectsSwept:           c.swept.Load(),
		Requeued:               c.requeued.Load(),
		JobsSwept:              c.jobsSwept.Load(),
		ChildrenStarted:        c.childrenStarted.Load(),
		CronStarted:            c.cronStarted.Load(),
		HistoryRepublished:     c.historyRepublished.Load(),
		DefinitionBlocked:      c.definitionBlocked.Load(),
		DefinitionUnblocked:    c.definitionUnblocked.Load(),
		MarkedAmbiguous:        c.markedAmbiguous.Load(),
		Panics:                 c.panics.Load(),
		Quarantined:            c.quarantined.Load(),
		IndexRepaired:          c.indexRepaired.Load(),
		StorageFull:            c.storageFull.Load(),
		FlowWaits:              c.flowWaits.Load(),
		FlowHandedOver:         c.flowHandedOver.Load(),
		FlowLeaked:             c.flowLeaked.Load(),
		ActiveJobs:             c.activeJobs.Load(),
		StepsWaitingForWorkers: c.waitingForWorkers.Load(),
		OldestRunningAgeMs:     c.oldestRunning.Load(),
		FirstProgressMs:        c.firstProgress.Load() / int64(time.Millisecond),
	}
}
