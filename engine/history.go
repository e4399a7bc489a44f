package engine

import (
	"strconv"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// historyBatches encodes a checkpoint's pending events as one history
// message, a CloudEvents batch, with dedup id "<job>/<first seq>-<last seq>":
// publishing the same events again after a crash is dropped by the
// stream, and a batch that overlaps an earlier one is told apart by its
// readers, which skip event ids they have seen.
func historyBatches(job string, evs []schemas.Event) (ids []string, bodies [][]byte) {
	if len(evs) == 0 {
		return nil, nil
	}
	body := make([]byte, 0, 256*len(evs))
	body = append(body, '[')
	var seq uint64
	start := 0
	for i := 0; i <= len(evs); i++ {
		if i < len(evs) && (i == start || evs[i].Data.Seq == seq) {
			seq = evs[i].Data.Seq
			continue
		}
		// evs[start:i] share one sequence: append them without the array's
		// brackets.
		part := schemas.AppendHistoryBatch(nil, schemas.HistorySourceEngine, job, seq, evs[start:i])
		if len(body) > 1 {
			body = append(body, ',')
		}
		body = append(body, part[1:len(part)-1]...)
		if i < len(evs) {
			start, seq = i, evs[i].Data.Seq
		}
	}
	body = append(body, ']')
	id := job + "/" + strconv.FormatUint(evs[0].Data.Seq, 10) + "-" + strconv.FormatUint(evs[len(evs)-1].Data.Seq, 10)
	return []string{id}, [][]byte{body}
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
			case schemas.EventStepCompleted, schemas.EventStepFailed, schemas.EventStepUnblocked:
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
