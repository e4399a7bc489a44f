package engine

import (
	"strconv"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// historyMessage is one message of the history stream: the events of one
// checkpoint sequence as a CloudEvents batch.
type historyMessage struct {
	id   string // Nats-Msg-Id: "<msg prefix>/<seq>" (Checkpoint.MsgPrefix)
	seq  uint64
	body []byte
}

// historyMessages encodes events as history messages, one per checkpoint
// sequence, in order. Publishing one again (after a crash, or by another
// engine that could not tell it was stored) carries the same id and the
// same events.
func historyMessages(job, prefix string, evs []schemas.Event) []historyMessage {
	var out []historyMessage
	for start := 0; start < len(evs); {
		seq := evs[start].Data.Seq
		end := start + 1
		for end < len(evs) && evs[end].Data.Seq == seq {
			end++
		}
		out = append(out, historyMessage{
			id:   prefix + "/" + strconv.FormatUint(seq, 10),
			seq:  seq,
			body: schemas.AppendHistoryBatch(nil, schemas.HistorySourceEngine, job, seq, evs[start:end]),
		})
		start = end
	}
	return out
}

// stamp turns the events of one transition into checkpoint events,
// folding each dispatch into the event before it when that event caused it
// (a completion, a failure to retry or to route to on_error, an unblock):
// "a completed; next: b, attempt 1" is one event, not two.
func stamp(evs []event, seq uint64, now time.Time) []schemas.Event {
	out := make([]schemas.Event, 0, len(evs))
	for _, ev := range evs {
		ev.data.Seq = seq
		if n := len(out); ev.typ == schemas.EventStepDispatched && n > 0 {
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
