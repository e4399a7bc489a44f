package engine

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	cloudevent "github.com/cloudevents/sdk-go/v2/event"

	"github.com/waymark-dev/waymark/schemas"
)

// HistorySource is the CloudEvents "source" of every history event.
const HistorySource = "/waymark/engine"

// encodeEvents turns a transition's events into CloudEvents JSON (the
// CloudEvents 1.0 JSON event format). Event ids are "<job>/<seq>/<n>":
// unique per event, and the same when a crashed writer's events are
// published again, so the history stream's dedup drops the copy.
func encodeEvents(cp *schemas.Checkpoint, evs []event, now time.Time) ([]json.RawMessage, error) {
	out := make([]json.RawMessage, 0, len(evs))
	for i, ev := range evs {
		ev.data.Seq = cp.Seq
		ce := cloudevent.New()
		ce.SetID(cp.JobID + "/" + strconv.FormatUint(cp.Seq, 10) + "/" + strconv.Itoa(i))
		ce.SetSource(HistorySource)
		ce.SetType(ev.typ)
		ce.SetSubject(cp.JobID)
		ce.SetTime(now)
		if err := ce.SetData(cloudevent.ApplicationJSON, ev.data); err != nil {
			return nil, fmt.Errorf("encode %s event of job %s: %w", ev.typ, cp.JobID, err)
		}
		b, err := json.Marshal(ce)
		if err != nil {
			return nil, fmt.Errorf("encode %s event of job %s: %w", ev.typ, cp.JobID, err)
		}
		out = append(out, b)
	}
	return out, nil
}

// HistoryEvent is a decoded history event, as Client.History returns it.
type HistoryEvent struct {
	ID   string              `json:"id"`
	Type string              `json:"type"`
	Time time.Time           `json:"time"`
	Data schemas.HistoryData `json:"data"`
}

// DecodeHistoryEvent decodes one CloudEvents JSON history event.
func DecodeHistoryEvent(b []byte) (HistoryEvent, error) {
	var ce cloudevent.Event
	if err := json.Unmarshal(b, &ce); err != nil {
		return HistoryEvent{}, fmt.Errorf("decode history event: %w", err)
	}
	h := HistoryEvent{ID: ce.ID(), Type: ce.Type(), Time: ce.Time()}
	if err := ce.DataAs(&h.Data); err != nil {
		return HistoryEvent{}, fmt.Errorf("decode history event %s data: %w", ce.ID(), err)
	}
	return h, nil
}
