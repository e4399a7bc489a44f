package engine

import (
	"strconv"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// historyMessage is one message of the history stream: a checkpoint's
// outbox (the events of one or more sequences) as a CloudEvents batch.
type historyMessage struct {
	id   string // Nats-Msg-Id: "<msg prefix>/<last seq>" (Checkpoint.MsgPrefix)
	seq  uint64 // the last sequence it holds
	body []byte
}

// outboxMessage encodes the events of cp's outbox (evs, in sequence
// order) as one history message. Publishing it again (after a crash, or
// by another engine that could not tell it was stored) carries the same
// id and the same events, as the checkpoint records both.
func outboxMessage(cp *schemas.Checkpoint, evs []schemas.Event) historyMessage {
	job := cp.JobID
	body := make([]byte, 0, 256*len(evs))
	body = append(body, '[')
	for start := 0; start < len(evs); {
		seq := evs[start].Data.Seq
		end := start + 1
		for end < len(evs) && evs[end].Data.Seq == seq {
			end++
		}
		part := schemas.AppendHistoryBatch(nil, schemas.HistorySourceEngine, job, seq, evs[start:end])
		if len(body) > 1 {
			body = append(body, ',')
		}
		body = append(body, part[1:len(part)-1]...)
		start = end
	}
	body = append(body, ']')
	last := evs[len(evs)-1].Data.Seq
	return historyMessage{id: cp.MsgPrefix() + "/" + strconv.FormatUint(last, 10), seq: last, body: body}
}

// transitions counts the checkpoint sequences events belong to.
func transitions(evs []schemas.Event) int {
	n := 0
	var last uint64
	for _, ev := range evs {
		if ev.Data.Seq != last {
			n++
			last = ev.Data.Seq
		}
	}
	return n
}

// outboxBulkBytes is how many bytes of bulky event data (a job's input,
// error messages) an outbox carries before it is published whatever the
// batch: every later checkpoint would carry them again until then.
const outboxBulkBytes = 512

// flushDue reports whether cp's outbox is published when cp is written:
// it holds batch transitions or outboxBulkBytes of bulky data, or the job
// stopped (completed, failed, or waits for a person), so that history
// readers see how it stopped.
// outboxMaxEvents bounds the events an outbox holds: a fan's transitions
// write many (one per dispatch and result), and a checkpoint should not
// grow with them.
const outboxMaxEvents = 32

func flushDue(cp *schemas.Checkpoint, batch int) bool {
	return len(cp.Events) > 0 && (cp.Status.Stopped() || transitions(cp.Events) >= batch || bulk(cp.Events) >= outboxBulkBytes || len(cp.Events) >= outboxMaxEvents)
}

// bulk sums the sizes of the parts of evs that can be large: inputs,
// error messages and reasons, in bytes.
func bulk(evs []schemas.Event) int {
	n := 0
	for i := range evs {
		d := &evs[i].Data
		n += len(d.Input) + len(d.Reason) + len(d.State)
		if d.Error != nil {
			n += len(d.Error.Message)
		}
	}
	return n
}

// carry returns base's events that next must carry in its outbox: none
// when base's outbox was published (base.Flush: the caller makes sure it
// is stored before writing next), else all of them.
func carry(base *schemas.Checkpoint, extra int) (flushed uint64, evs []schemas.Event) {
	if base.Flush || len(base.Events) == 0 {
		return base.Seq, make([]schemas.Event, 0, extra)
	}
	evs = make([]schemas.Event, len(base.Events), len(base.Events)+extra)
	copy(evs, base.Events)
	return base.Flushed, evs
}

// stamp turns the events of one transition into checkpoint events,
// folding each dispatch into the event before it when that event caused it
// (a completion, a failure to retry or to route to on_error, an unblock):
// "a completed; next: b, attempt 1" is one event, not two.
func stamp(evs []event, seq uint64, now time.Time) []schemas.Event {
	return stampTo(make([]schemas.Event, 0, len(evs)), evs, seq, now)
}

// stampTo is stamp appending to out.
func stampTo(out []schemas.Event, evs []event, seq uint64, now time.Time) []schemas.Event {
	base := len(out)
	for _, ev := range evs {
		if ev.typ == "" {
			continue // nothing to tell (a map item's first dispatch)
		}
		ev.data.Seq = seq
		// A map item's dispatch is not folded (the event has no room for its
		// item), nor a second dispatch (a fan's branches).
		if n := len(out); ev.typ == schemas.EventStepDispatched && n > base && ev.data.Item == 0 && out[n-1].Data.Item == 0 && out[n-1].Data.NextAttempt == 0 {
			switch prev := &out[n-1]; prev.Type {
			case schemas.EventStepCompleted, schemas.EventStepFailed, schemas.EventStepUnblocked, schemas.EventJobUnblocked:
				prev.Data.Next, prev.Data.NextAttempt = ev.data.Step, ev.data.Attempt
				if !ev.data.NotBefore.IsZero() {
					prev.Data.NotBefore = ev.data.NotBefore
				}
				continue
			}
		}
		out = append(out, schemas.Event{Type: ev.typ, Time: now, Data: ev.data})
	}
	return out
}

// setOutbox gives next (the checkpoint after base, nil for a new job) its
// outbox: base's events it must carry, then evs stamped with next's
// sequence; and decides whether it is published after the write.
func (e *Engine) setOutbox(base, next *schemas.Checkpoint, evs []event, now time.Time) {
	next.Flushed, next.Events = 0, make([]schemas.Event, 0, len(evs))
	if base != nil {
		next.Flushed, next.Events = carry(base, len(evs))
	}
	next.Events = stampTo(next.Events, evs, next.Seq, now)
	next.Flush = flushDue(next, e.cfg.HistoryBatch)
}
