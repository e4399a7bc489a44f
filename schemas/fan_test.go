package schemas_test

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// TestFanEncodingRoundTrips: a fan's item dispatches are stored compact
// (step, pool and message id left out) and come back whole once FillIDs
// has the job's prefix; branch dispatches are stored as they are.
func TestFanEncodingRoundTrips(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 1, 16, 0, 0, 123_000_000, time.UTC)
	nb := at.Add(2 * time.Second)
	const prefix = "job-1/i3"
	f := &schemas.Fan{Step: "each", Run: 2, Total: 100, Next: 3, Done: schemas.StepSet("0"), Running: []*schemas.Dispatch{
		{Step: "each", Attempt: 1, RunAttempt: 1, Item: 2, Pool: "default", DispatchedAt: at, MsgID: schemas.ItemMsgID(prefix, "each", 2, 2, 1)},
		{Step: "each", Attempt: 3, RunAttempt: 2, Item: 3, Pool: "default", DispatchedAt: at, NotBefore: &nb, EffectKey: "job-1/each/run-2/doc-2", MsgID: schemas.ItemMsgID(prefix, "each", 2, 3, 3)},
	}}
	data, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	var got schemas.Fan
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	got.FillIDs(prefix)
	if !reflect.DeepEqual(&got, f) {
		g, _ := json.Marshal(got.Running)
		w, _ := json.Marshal(f.Running)
		t.Fatalf("round trip:\n got %s\nwant %s", g, w)
	}
	if per := len(data) / 2; per > 200 {
		t.Errorf("%d bytes for a fan of two items in flight: %s", len(data), data)
	}
	branch := &schemas.Fan{Step: "p", Run: 1, Total: 2, Running: []*schemas.Dispatch{{Step: "a", Attempt: 1, RunAttempt: 1, Pool: "default", DispatchedAt: at, MsgID: prefix + "/a/1"}}}
	data, _ = json.Marshal(branch)
	var gotB schemas.Fan
	if err := json.Unmarshal(data, &gotB); err != nil || !reflect.DeepEqual(&gotB, branch) {
		t.Fatalf("branch round trip: %+v %v", gotB.Running, err)
	}
}

// TestFanKeepsAToolCallsChild: a tool call that is a child job keeps its
// child through the compact encoding of a fan's items.
func TestFanKeepsAToolCallsChild(t *testing.T) {
	t.Parallel()
	f := &schemas.Fan{Step: "agent", Run: 1, Total: 2, Agent: &schemas.AgentRun{}, Running: []*schemas.Dispatch{
		{Step: "agent", Item: 1, Attempt: 1, RunAttempt: 1, Pool: "default", MsgID: schemas.ItemMsgID("j", "agent", 1, 1, 1)},
		{Step: "agent", Item: 2, Attempt: 1, RunAttempt: 1, Pool: "default", MsgID: schemas.ItemMsgID("j", "agent", 1, 2, 1), Child: "j-agent-c2-r1-0000"},
	}}
	b, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	var back schemas.Fan
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	back.FillIDs("j")
	if d := back.RunningOf("agent", 2); d == nil || d.Child != "j-agent-c2-r1-0000" || d.MsgID != f.Running[1].MsgID {
		t.Fatalf("after a round trip: %+v", d)
	}
}
