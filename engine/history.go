package engine

import (
	"strconv"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// HistorySource is the CloudEvents "source" of every history event.
const HistorySource = "/waymark/engine"

// HistoryContentType is the content type of a history message: a
// CloudEvents JSON batch (one JSON array of events).
const HistoryContentType = "application/cloudevents-batch+json"

// HistoryEvent is one CloudEvent of a job's history; see
// schemas.HistoryEvent.
type HistoryEvent = schemas.HistoryEvent

// historyBatches encodes events as history messages: one CloudEvents
// batch per checkpoint sequence, with that sequence's dedup id, so a batch
// published again after a crash is dropped by the stream.
func historyBatches(job string, evs []schemas.Event) (ids []string, bodies [][]byte) {
	for start := 0; start < len(evs); {
		seq := evs[start].Data.Seq
		end := start
		for end < len(evs) && evs[end].Data.Seq == seq {
			end++
		}
		ids = append(ids, job+"/"+strconv.FormatUint(seq, 10))
		bodies = append(bodies, schemas.AppendHistoryBatch(make([]byte, 0, 256*(end-start)), HistorySource, job, seq, evs[start:end]))
		start = end
	}
	return ids, bodies
}

// DecodeHistory decodes one history message: a CloudEvents batch.
func DecodeHistory(b []byte) ([]HistoryEvent, error) { return schemas.DecodeHistory(b) }

// stamp turns the events of one transition into checkpoint events.
func stamp(evs []event, seq uint64, now time.Time) []schemas.Event {
	out := make([]schemas.Event, len(evs))
	for i, ev := range evs {
		ev.data.Seq = seq
		out[i] = schemas.Event{Type: ev.typ, Time: now, Data: ev.data}
	}
	return out
}
