package schemas_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding/format"
	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/waymark-dev/waymark/schemas"
)

// historySample is a history batch of two transitions whose data has no
// characters encoding/json escapes for HTML (<, >, &) and no raw values
// it would compact: for these, json.Marshal of the data is byte for byte
// what the hand encoder writes.
func historySample() []schemas.Event {
	at := time.Date(2026, 12, 1, 22, 30, 0, 123456000, time.FixedZone("CET", 3600)) // not UTC: the encoder writes UTC
	t2 := at.Add(1500 * time.Millisecond)
	return []schemas.Event{
		{Type: schemas.EventJobStarted, Time: at, Data: schemas.HistoryData{Job: "J1", Seq: 1, Status: "running", Input: json.RawMessage(`{"amount":40,"to":"ops"}`), Next: "charge", NextAttempt: 1}},
		{Type: schemas.EventStepCompleted, Time: t2, Data: schemas.HistoryData{Job: "J1", Seq: 2, Step: "charge", Attempt: 1, DurationMs: 12, ResultDigest: "sha256:ab", Next: "mail", NextAttempt: 1,
			State: json.RawMessage(`{"set":{"charged":true}}`)}},
		{Type: schemas.EventApprovalRequested, Time: t2, Data: schemas.HistoryData{Job: "J1", Seq: 2, Step: "mail", Approval: &schemas.Approval{ID: "mail/1", Gate: "mail", Run: 1, Digest: "dd",
			Action: "send mail to ops", Approvers: []string{"alice"}, Status: schemas.ApprovalPending, RequestedAt: t2.UTC()}}},
		{Type: schemas.EventStepFailed, Time: t2, Data: schemas.HistoryData{Job: "J1", Seq: 2, Step: "mail", Attempt: 2, Retrying: true, NotBefore: t2.Add(time.Second).UTC(),
			Error: &schemas.Error{Code: schemas.CodeTimeout, Message: "slow \"mail\" server\n", Job: "J1", Step: "mail", Attempt: 2, Retryable: true}}},
		{Type: schemas.EventJobCompleted, Time: t2, Data: schemas.HistoryData{Job: "J1", Seq: 2, Status: "completed", By: "é-ünïcode"}},
	}
}

// sdkEvent builds with sdk-go's event type the event the history stream
// holds for ev, given its id.
func sdkEvent(t *testing.T, id, source string, ev *schemas.Event) event.Event {
	t.Helper()
	e := event.New()
	e.SetID(id)
	e.SetSource(source)
	e.SetType(ev.Type)
	e.SetSubject(ev.Data.Job)
	e.SetTime(ev.Time)
	if err := e.SetData(event.ApplicationJSON, ev.Data); err != nil {
		t.Fatal(err)
	}
	if err := e.Validate(); err != nil {
		t.Fatal(err)
	}
	return e
}

func splitBatch(t *testing.T, b []byte) []json.RawMessage {
	t.Helper()
	var raws []json.RawMessage
	if err := json.Unmarshal(b, &raws); err != nil {
		t.Fatalf("history batch is not a JSON array: %v\n%s", err, b)
	}
	return raws
}

// TestHistoryEventsAreSDKGoBytes: each event of a history batch, as the
// engine's hand encoder writes it, is byte for byte what sdk-go's
// event.Event marshals for the same attributes and data.
func TestHistoryEventsAreSDKGoBytes(t *testing.T) {
	t.Parallel()
	evs := historySample()
	batch := schemas.AppendHistoryBatch(nil, schemas.HistorySourceEngine, "J1", 2, evs)
	raws := splitBatch(t, batch)
	ids := schemas.CheckpointHistory("J1", evs)
	if len(raws) != len(evs) {
		t.Fatalf("%d events in the batch, want %d", len(raws), len(evs))
	}
	for i := range evs {
		e := sdkEvent(t, ids[i].ID, schemas.HistorySourceEngine, &evs[i])
		want, err := json.Marshal(&e)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(raws[i], want) {
			t.Errorf("event %d (%s) differs from sdk-go's\nours:   %s\nsdk-go: %s", i, evs[i].Type, raws[i], want)
		}
	}

	// The ledger's events (written by workers) too.
	rec := &schemas.EffectRecord{Job: "J1", Step: "charge", Attempt: 1, Key: "pay/charge/k-1", State: schemas.EffectAmbiguous, Reason: "no answer"}
	now := time.Date(2026, 12, 1, 23, 0, 0, 5, time.FixedZone("X", -7200))
	raws = splitBatch(t, schemas.AppendEffectEvent(nil, "/waymark/worker/w1", schemas.EventEffectAmbiguous, rec, 9, now))
	ev := schemas.Event{Type: schemas.EventEffectAmbiguous, Time: now, Data: schemas.HistoryData{Job: rec.Job, Step: rec.Step, Attempt: rec.Attempt,
		EffectKey: rec.Key, EffectState: string(rec.State), Reason: rec.Reason}}
	e := sdkEvent(t, "J1/effect/9", "/waymark/worker/w1", &ev)
	want, _ := json.Marshal(&e)
	if len(raws) != 1 || !bytes.Equal(raws[0], want) {
		t.Errorf("effect event differs from sdk-go's\nours:   %s\nsdk-go: %s", raws, want)
	}
}

// TestHistoryEventsHTMLCharacters: where the data holds <, > or &,
// encoding/json (which sdk-go uses for data) escapes them as \u003c and so
// on and the hand encoder does not; both are the same JSON value, and the
// attributes (written by sdk-go without HTML escaping) stay equal.
func TestHistoryEventsHTMLCharacters(t *testing.T) {
	t.Parallel()
	ev := schemas.Event{Type: schemas.EventJobFailed, Time: time.Unix(0, 0), Data: schemas.HistoryData{Job: "J2", Seq: 4, Reason: "a <b> & c"}}
	raws := splitBatch(t, schemas.AppendHistoryBatch(nil, schemas.HistorySourceEngine, "J2", 4, []schemas.Event{ev}))
	e := sdkEvent(t, "J2/4/0", schemas.HistorySourceEngine, &ev)
	want, _ := json.Marshal(&e)
	unescaped := strings.NewReplacer(`\u003c`, "<", `\u003e`, ">", `\u0026`, "&").Replace(string(want))
	if string(raws[0]) != unescaped {
		t.Errorf("ours %s\nsdk-go, HTML escapes undone: %s", raws[0], unescaped)
	}
}

// TestHistoryBatchDecodesThroughSDKGo: a history message decodes through
// sdk-go's event formats (the batch content type it is published with is
// sdk-go's JSONBatch format; each event reads with format.JSON and
// validates), and each event marshals back to the same bytes.
func TestHistoryBatchDecodesThroughSDKGo(t *testing.T) {
	t.Parallel()
	if f := format.Lookup(schemas.HistoryContentType); f != format.JSONBatch {
		t.Fatalf("content type %s is not sdk-go's batch format (%v)", schemas.HistoryContentType, f)
	}
	evs := historySample()
	batch := schemas.AppendHistoryBatch(nil, schemas.HistorySourceEngine, "J1", 2, evs)
	var all []event.Event
	if err := json.Unmarshal(batch, &all); err != nil {
		t.Fatalf("sdk-go cannot read the batch: %v", err)
	}
	for i, raw := range splitBatch(t, batch) {
		var e event.Event
		if err := format.Unmarshal(format.JSON.MediaType(), raw, &e); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if err := e.Validate(); err != nil {
			t.Errorf("event %d does not validate: %v", i, err)
		}
		if e.ID() != all[i].ID() || e.Type() != evs[i].Type || e.Subject() != "J1" || !e.Time().Equal(evs[i].Time) || e.DataContentType() != event.ApplicationJSON {
			t.Errorf("event %d read as %s", i, e.String())
		}
		var d schemas.HistoryData
		if err := e.DataAs(&d); err != nil || d.Seq != evs[i].Data.Seq || d.Step != evs[i].Data.Step {
			t.Errorf("event %d data %+v, %v", i, d, err)
		}
		again, err := format.JSON.Marshal(&e)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, raw) {
			t.Errorf("event %d does not round-trip through sdk-go\nours:   %s\nsdk-go: %s", i, raw, again)
		}
	}
}
