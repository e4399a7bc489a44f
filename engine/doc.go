// Package engine is Waymark's orchestrator: it applies inbox messages (job
// starts, step results, signals) to job checkpoints, decides from each
// job's pinned definition which step is eligible next, and dispatches it
// to a worker pool. It holds no state between messages that correctness
// depends on: any number of engines share one inbox consumer, and a
// compare-and-swap on the checkpoint's KV revision stops two of them from
// advancing one job. Clients start and watch jobs with package
// engine/client; package engine/api serves them over HTTP.
//
// One transition, from an inbox message to the acknowledgement:
//
//	inbox message (start | result | signal) ──► lane (by job id)
//	  │  load checkpoint N (cache, else KV; when N's events were not
//	  │  published by this engine, the history stream's last message
//	  │  tells whether they are stored)
//	  ▼
//	decide: the transition function (apply.go) over the pinned definition
//	  │  → checkpoint N+1 with its own events only (the outbox) and, when
//	  │    a step becomes eligible, its dispatch recorded (intent before
//	  │    action)
//	  ▼
//	make sure N's events are stored (publish them again, same ids, if
//	  │  unknown), then write N+1 with Nats-Expected-Last-Subject-Sequence
//	  │  = N's revision; a conflict reloads and decides again
//	  ▼
//	publish N+1's events (waymark.history.<job>, id <job>/i<rev>/<seq>)
//	  │  and its dispatch (waymark.work.<pool>.<job>, id <job>/i<rev>/<step>/<attempt>)
//	  ▼
//	after acknowledgements: a finished job's index entry moves to ended;
//	  │  an effect whose step failed for good with its outcome unknown is
//	  │  marked ambiguous in the ledger
//	  ▼
//	acknowledge the inbox message (or hand it back on any error: every
//	step above can be done again)
//
// An engine that dies anywhere leaves the inbox message unacknowledged; the
// engine that gets it again sees that it caused the current checkpoint and
// publishes what that checkpoint recorded, under the same ids, when the
// streams say it is missing.
//
// Beside the inbox, a reconciler (reconcile.go) passes over the jobs the
// job index lists as active, never over finished ones, and repairs what a
// lost message or a crash left: attempts whose step message is neither
// queued nor answered, dead letters, pending jobs never started, lost
// resolution signals, jobs blocked on a definition that is back, index
// entries of jobs whose creation or end was cut short. A sweep
// (sweep.go) removes finished jobs past their retention. Requeue
// (requeue.go) dispatches running jobs again when the queues were lost.
package engine
