// Package demo holds five small HTTP services that stand in for real
// providers, so that Waymark can show, and its crash tests can prove, that a
// resumed job never performs a side effect twice. Each service is an
// http.Handler that keeps its state in files under its own directory,
// written and fsynced before it answers, so a restart of the process that
// hosts it (even a SIGKILL right after a response) loses nothing.
//
// The four cover the effect classes of a workflow step (DESIGN.md,
// invariant 4):
//
//	name      class       endpoint                        data file
//	tickets   idempotent  POST /v1/tickets/batch          tickets.jsonl (one ticket a line)
//	payments  idempotent  POST /v1/charges                charges.jsonl
//	records   lookup      PUT, GET /v1/records/{key}      records.jsonl
//	mail      unsafe      POST /v1/send                   outbox.jsonl
//	vendors   pure        GET /v1/vendors?category=C      (a fixed catalog)
//
// The idempotent services follow the IETF httpapi draft "The
// Idempotency-Key HTTP Header Field" and Stripe's behaviour. A request
// moves through these states:
//
//	request ─► count call ─► fail-next armed? ─────────────────────► 503
//	              │
//	              ▼
//	   Idempotency-Key and body valid? ─── no ─────────────────────► 400
//	              │ SHA-256 of the canonical body
//	              ▼
//	   key stored? ── same fingerprint ─► 200, Idempotent-Replayed: true,
//	              │                       the stored body byte for byte
//	              │── other fingerprint ───────────────────────────► 422
//	   key in flight? ─────────────────────────────────────────────► 409
//	              ▼
//	   claim key ─► BeforeCommit hook ─► append + fsync (the effect)
//	              ─► Delay ─► drop armed? ─► close the TCP connection, no answer
//	                                     └─► 201
//
// Only a committed effect is stored for replay: a request that failed
// validation or whose write failed leaves its key free for a retry. Keys
// never expire (a job may resume days later; DESIGN.md invariant 5).
//
// records answers the other question a caller can ask after a lost
// response: "did my write with this key happen?" (GET, 404 or 200). mail has
// no idempotency at all: every call sends, which is what makes an unsafe
// effect dangerous to retry.
//
// Every service counts, per key, the calls it received and the effects it
// performed, and serves both at GET /v1/_stats; tests assert effects[key] <=
// 1 for every logical action. Faults for crash tests come from Options
// (Delay, DropAfterCommit, FailNext, BeforeCommit) and, at run time, from
// Service.FailNext, Service.DropNext and POST /v1/_faults.
//
// Errors are JSON: {"error": {"code": "...", "message": "..."}} with a Code*
// constant as code.
package demo
