package cli

import (
	"bytes"
	"testing"

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
	} {
		var b bytes.Buffer
		printEvent(&b, tc.ev)
		if b.String() != tc.want {
			t.Errorf("printed %q, want %q", b.String(), tc.want)
		}
	}
}
