package cli

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/schemas"
)

// TestPrintEventNamesMapItems: the transition lines of a map name the
// item: by index for the engine's events, by name for the ledger's.
func TestPrintEventNamesMapItems(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ev   schemas.HistoryEvent
		want string
	}{
		{schemas.HistoryEvent{Type: schemas.EventStepCompleted, Data: schemas.HistoryData{Step: "each", Attempt: 1, Item: 3, DurationMs: 4}},
			"  each[2]              attempt 1   completed  4ms\n"},
		{schemas.HistoryEvent{Type: schemas.EventEffectConfirmed, Data: schemas.HistoryData{Step: "each", Attempt: 1, EffectKey: "job-1/i3/each/doc-7"}},
			"  each[doc-7]          attempt 1   effect confirmed\n"},
		{schemas.HistoryEvent{Type: schemas.EventEffectConfirmed, Data: schemas.HistoryData{Step: "charge", Attempt: 2, EffectKey: "job-1/charge"}},
			"  charge               attempt 2   effect confirmed\n"},
		{schemas.HistoryEvent{Type: schemas.EventStepCancelled, Data: schemas.HistoryData{Step: "b", Attempt: 1, Reason: "the join was decided"}},
			"  b                    attempt 1   cancelled: the join was decided\n"},
		{schemas.HistoryEvent{Type: schemas.EventStepWaiting, Data: schemas.HistoryData{Step: "charge", Attempt: 1, Reason: `concurrency limit orders-charge-1 for key "acme": 2 of 2 running`}},
			"  charge               attempt 1   waiting: concurrency limit orders-charge-1 for key \"acme\": 2 of 2 running\n"},
		{schemas.HistoryEvent{Type: schemas.EventStepAdmitted, Data: schemas.HistoryData{Step: "charge", Attempt: 1, Flow: &schemas.FlowWait{Kind: schemas.FlowConcurrency, Limit: "orders-charge-1", Key: "acme", Max: 2, InUse: 1}}},
			"  charge               attempt 1   admitted: concurrency limit orders-charge-1 for key \"acme\", 1 of 2\n"},
	} {
		var b bytes.Buffer
		printEvent(&b, tc.ev)
		if b.String() != tc.want {
			t.Errorf("printed %q, want %q", b.String(), tc.want)
		}
	}
}

// TestPrintViewShowsWhatWaits: engine status names a dispatch waiting for
// a flow limit, and marks its step waiting.
func TestPrintViewShowsWhatWaits(t *testing.T) {
	t.Parallel()
	since := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	w := &schemas.FlowWait{Kind: schemas.FlowConcurrency, Limit: "orders-charge-1", Key: "acme", Max: 2, InUse: 2, Since: since}
	cp := &schemas.Checkpoint{JobID: "order-7", Workflow: "orders", Version: 1, DefinitionHash: "abcdef0123456789", Status: schemas.JobRunning,
		State: json.RawMessage(`{}`), Steps: map[string]*schemas.StepRecord{"charge": {Status: schemas.StepDispatched, Attempts: 1, Runs: 1}},
		Current: &schemas.Dispatch{Step: "charge", Attempt: 1, MsgID: "order-7/charge/1", Waiting: w}}
	var b bytes.Buffer
	printView(&b, client.NewJobView(cp, nil))
	out := b.String()
	for _, want := range []string{
		`waiting   charge (attempt 1), since 2026-12-01T10:00:00Z: concurrency limit orders-charge-1 for key "acme": 2 of 2 running`,
		"charge        waiting",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q:\n%s", want, out)
		}
	}
}
