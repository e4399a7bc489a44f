// Package notify tells the world outside Waymark what its jobs do: it
// reads the history stream (every transition of every job, as CloudEvents)
// and republishes the lifecycle events among them as single CloudEvents,
// on NATS subjects (Relay) and to HTTP endpoints (Sink, webhooks signed
// with the Standard Webhooks scheme). Engines run it; it never changes a
// job.
//
//	WAYMARK_HISTORY (waymark.history.<job>, waymark.history.<job>.effects:
//	  │  CloudEvents JSON batches, event id <job>/<seq>/<n>)
//	  ├─► durable consumer waymark-events-out (shared by every engine)
//	  │     └─► Relay: one NATS message per lifecycle event, binary mode
//	  │         (ce- headers), on waymark.events.<type>.<job>,
//	  │         Nats-Msg-Id = the event id; then the history message is acked
//	  └─► durable consumer waymark-sink-<name>, one per webhook sink
//	        └─► Sink: POST in structured mode (application/cloudevents+json),
//	            webhook-id = the event id, webhook-timestamp,
//	            webhook-signature v1,<base64 HMAC-SHA256>; 2xx acks,
//	            408/429/5xx/network errors retry with exponential backoff
//	            (NakWithDelay), other 4xx and give-ups end the message
//	            (TermWithReason: JetStream's MSG_TERMINATED advisory is
//	            the dead-letter record)
//
// Delivery is at least once: a history message is acknowledged only after
// its events went out, so an engine that dies between the two makes
// another engine (or itself, restarted) send them again, with the same
// CloudEvent id. Receivers deduplicate on the id (webhook-id, ce-id,
// Nats-Msg-Id). Each consumer is created on first use with
// DeliverNewPolicy: events stored before it existed are not sent.
// Events of one job keep their order on one engine; across engines, and
// for a sink that retries, they may arrive out of order.
package notify
