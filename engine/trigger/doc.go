// Package trigger is Waymark's CloudEvents intake: it turns CloudEvents
// (https://github.com/cloudevents/spec, 1.0) into jobs, by the trigger
// rules of each workflow's latest stored definition (schemas.Trigger).
//
// Events arrive over HTTP (POST /v1/events on the engine's API: binary,
// structured and batch modes, read with sdk-go's HTTP binding) or over
// NATS (request/reply on <prefix>.trigger.>, binary mode with ce- headers,
// in a queue group shared by the engines). Each is handled so:
//
//	event ──validate──► known (source, id)? ──yes──► answer its recorded jobs (duplicate)
//	                           │ no
//	                           ▼
//	        match rules (type, source, subject, filter) ──none──► no_trigger
//	                           │
//	                           ▼
//	        map input, check the input schema ──refused──► input_invalid + pointers
//	                           │
//	                           ▼
//	        start each job, id = schemas.TriggerJobID(workflow, rule, source, id)
//	        (an id that exists attaches: a crash before the record is safe)
//	                           │
//	                           ▼
//	        record (source, id) → jobs in <prefix>_events (create-only, TTL) ──► 202
//
// Only then is the event answered: the jobs are durably stored and a
// later delivery of the same event, within the events bucket's retention,
// answers the same jobs and starts nothing.
package trigger
