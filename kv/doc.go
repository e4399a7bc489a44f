// Package kv holds Waymark's typed stores over JetStream: job checkpoints
// (compare-and-swap on the KV revision), workflow definitions (by content
// hash), and the layout of every stream, bucket and consumer the engine and
// workers share. It is the only package that speaks JetStream KV.
//
// Names, with the default prefix:
//
//	bucket   waymark_checkpoints   key <job>            one checkpoint per job
//	bucket   waymark_effects       key <idempotency key> effect record (the ledger)
//	bucket   waymark_definitions   key <sha256 hex>     canonical definition JSON
//	                               key name.<workflow>  hash of the latest stored version
//	bucket   waymark_events        key e.<sha256 hex>   a CloudEvent's dedup record (TTL: EventRetention)
//	stream   WAYMARK_WORK          waymark.work.<pool>  step messages (work queue)
//	stream   WAYMARK_INBOX         waymark.inbox.<kind>.<job>  starts and results (work queue)
//	stream   WAYMARK_HISTORY       waymark.history.<job>       CloudEvents, one per transition
//	stream   WAYMARK_QUEUE_EPOCH   waymark.queue_epoch         marker: were the queues lost?
//	consumer waymark-engine        on WAYMARK_INBOX, shared by every engine
//	consumer waymark-work-<pool>   on WAYMARK_WORK, shared by a pool's workers
package kv
