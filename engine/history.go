package engine

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// HistorySource is the CloudEvents "source" of every history event.
const HistorySource = "/waymark/engine"

// HistoryContentType is the content type of a history message: a
// CloudEvents JSON batch (one JSON array of events, CloudEvents 1.0 JSON
// event format, section 4).
const HistoryContentType = "application/cloudevents-batch+json"

// HistoryEvent is one CloudEvent of a job's history, as the history stream
// holds it (CloudEvents 1.0, JSON format) and as Client.History returns it.
type HistoryEvent struct {
	SpecVersion     string              `json:"specversion"`
	ID              string              `json:"id"` // <job>/<seq>/<n>
	Source          string              `json:"source"`
	Type            string              `json:"type"`
	Subject         string              `json:"subject"` // the job id
	Time            time.Time           `json:"time"`
	DataContentType string              `json:"datacontenttype"`
	Data            schemas.HistoryData `json:"data"`
}

// historyBatches encodes events as history messages: one CloudEvents
// batch per checkpoint sequence, with that sequence's dedup id, so a batch
// published again after a crash is dropped by the stream.
func historyBatches(job string, evs []schemas.Event) (ids []string, bodies [][]byte, err error) {
	for start := 0; start < len(evs); {
		seq := evs[start].Data.Seq
		end := start
		for end < len(evs) && evs[end].Data.Seq == seq {
			end++
		}
		batch := make([]HistoryEvent, 0, end-start)
		for i, ev := range evs[start:end] {
			batch = append(batch, HistoryEvent{
				SpecVersion: "1.0", ID: job + "/" + strconv.FormatUint(seq, 10) + "/" + strconv.Itoa(i),
				Source: HistorySource, Type: ev.Type, Subject: job, Time: ev.Time,
				DataContentType: "application/json", Data: ev.Data,
			})
		}
		b, err := json.Marshal(batch)
		if err != nil {
			return nil, nil, fmt.Errorf("encode history of job %s seq %d: %w", job, seq, err)
		}
		ids = append(ids, job+"/"+strconv.FormatUint(seq, 10))
		bodies = append(bodies, b)
		start = end
	}
	return ids, bodies, nil
}

// DecodeHistory decodes one history message: a CloudEvents batch.
func DecodeHistory(b []byte) ([]HistoryEvent, error) {
	var evs []HistoryEvent
	if err := json.Unmarshal(b, &evs); err != nil {
		return nil, fmt.Errorf("decode history message: %w", err)
	}
	return evs, nil
}

// stamp turns the events of one transition into checkpoint events.
func stamp(evs []event, seq uint64, now time.Time) []schemas.Event {
	out := make([]schemas.Event, len(evs))
	for i, ev := range evs {
		ev.data.Seq = seq
		out[i] = schemas.Event{Type: ev.typ, Time: now, Data: ev.data}
	}
	return out
}
