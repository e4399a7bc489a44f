package schemas

import "strconv"

// History message attributes.
const (
	// HistorySourceEngine is the CloudEvents "source" of the events an
	// engine writes for a job's transitions.
	HistorySourceEngine = "/waymark/engine"
	// HistoryContentType is the content type of a history message: a
	// CloudEvents JSON batch (one JSON array of events; CloudEvents 1.0,
	// JSON event format, section 4).
	HistoryContentType = "application/cloudevents-batch+json"
)

// CheckpointHistory returns a checkpoint's pending events (its outbox) as
// history events, with the ids they have on the history stream:
// "<job>/<seq>/<n>", n counting from 0 within one sequence.
func CheckpointHistory(job string, evs []Event) []HistoryEvent {
	out := make([]HistoryEvent, 0, len(evs))
	var seq uint64
	n := 0
	for _, ev := range evs {
		if ev.Data.Seq != seq {
			seq, n = ev.Data.Seq, 0
		}
		out = append(out, HistoryEvent{SpecVersion: "1.0", ID: job + "/" + strconv.FormatUint(seq, 10) + "/" + strconv.Itoa(n),
			Source: HistorySourceEngine, Type: ev.Type, Subject: job, Time: ev.Time.UTC(), DataContentType: "application/json", Data: ev.Data})
		n++
	}
	return out
}
