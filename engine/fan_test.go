package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

const parallelThree = `
name: par
version: 1
steps:
  - id: fan
    kind: parallel
    branches: [a, b, c]
    next: [{to: after}]
  - {id: a, kind: noop, save_as: a}
  - {id: b, kind: noop, save_as: b}
  - {id: c, kind: noop, save_as: c}
  - {id: after, kind: noop, save_as: after}
`

func decodeState(t *testing.T, raw json.RawMessage) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("state %s: %v", raw, err)
	}
	return m
}

// TestParallelBranchesRunAtOnceAndJoin: the three branches are in flight
// together (none is answered before all three came), each saves its own
// part of state, and the step after the join runs once.
func TestParallelBranchesRunAtOnceAndJoin(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(parallelThree)
	id := b.start(def, `{}`, "par-1")
	seen := map[string]bool{}
	var hs []held
	for range 3 {
		h := next(t, ch)
		seen[h.sm.Step] = true
		hs = append(hs, h)
	}
	if !seen["a"] || !seen["b"] || !seen["c"] {
		t.Fatalf("in flight together: %v, want a, b and c", seen)
	}
	for _, h := range hs {
		h.reply(json.RawMessage(fmt.Sprintf(`{"by": %q}`, h.sm.Step)), nil)
	}
	after := next(t, ch)
	if after.sm.Step != "after" {
		t.Fatalf("after the join came %s", after.sm.Step)
	}
	if !strings.Contains(string(after.sm.State), `"c":{"by": "c"}`) {
		t.Errorf("the step after the join sees state %s", after.sm.State)
	}
	after.reply(json.RawMessage(`{}`), nil)
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	st := decodeState(t, v.State)
	for _, k := range []string{"a", "b", "c", "after"} {
		if _, ok := st[k]; !ok {
			t.Errorf("state has no %s: %s", k, v.State)
		}
	}
	select {
	case h := <-ch:
		t.Errorf("a step message after the job completed: %s", h.sm.Step)
	default:
	}
}

// held is a step message a test answers when it wants to.
type held struct {
	sm    *schemas.StepMessage
	reply func(out json.RawMessage, e *schemas.Error)
}

// manualWorker acknowledges step messages of the default pool and hands
// them to the test on the returned channel, to answer when it likes.
func (b *bundle) manualWorker() <-chan held {
	ch := make(chan held, 1024)
	cons, err := b.store.EnsureWorkConsumer(context.Background(), schemas.DefaultPool)
	if err != nil {
		b.t.Fatal(err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		sm, err := schemas.DecodeStepMessage(m.Headers(), m.Data())
		if err != nil {
			b.t.Errorf("decode step message: %v", err)
			return
		}
		id := m.Headers().Get(jetstream.MsgIDHeader) + "/result"
		_ = m.Ack()
		ch <- held{sm: sm, reply: func(out json.RawMessage, e *schemas.Error) {
			b.publishResultID(&schemas.StepResult{Job: sm.Job, Step: sm.Step, Attempt: sm.Attempt, Item: sm.Item, Output: out, Error: e, DurationMs: 1}, id)
		}}
	})
	if err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(cc.Stop)
	return ch
}

func next(t *testing.T, ch <-chan held) held {
	t.Helper()
	select {
	case h := <-ch:
		return h
	case <-time.After(10 * time.Second):
		t.Fatal("no step message came")
	}
	return held{}
}

// nextOf is next, saying where the job stands when nothing comes.
func (b *bundle) nextOf(id string, ch <-chan held) held {
	b.t.Helper()
	select {
	case h := <-ch:
		return h
	case <-time.After(10 * time.Second):
		v, err := b.client.Job(context.Background(), id)
		b.t.Fatalf("no step message came; job %s: %+v %v", id, v, err)
	}
	return held{}
}

// TestParallelJoinFirstCancelsTheOthers: with join first the job goes on
// when one branch completes; the others are cancelled, and their late
// results change nothing.
func TestParallelJoinFirstCancelsTheOthers(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(strings.Replace(parallelThree, "    next: [{to: after}]", "    join: {mode: first}\n    save_as: race\n    next: [{to: after}]", 1))
	id := b.start(def, `{}`, "first-1")
	got := map[string]held{}
	for range 3 {
		h := next(t, ch)
		got[h.sm.Step] = h
	}
	got["b"].reply(json.RawMessage(`{"won": true}`), nil)
	after := next(t, ch)
	if after.sm.Step != "after" {
		t.Fatalf("after the join came %s", after.sm.Step)
	}
	got["a"].reply(json.RawMessage(`{"late": true}`), nil)
	got["c"].reply(nil, &schemas.Error{Code: schemas.CodeStepFailed, Message: "late failure"})
	after.reply(json.RawMessage(`{}`), nil)
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	st := decodeState(t, v.State)
	if _, ok := st["a"]; ok {
		t.Errorf("a cancelled branch's late output was saved: %s", v.State)
	}
	race, _ := json.Marshal(st["race"])
	if string(race) != `{"cancelled":["a","c"],"completed":["b"],"failed":[]}` {
		t.Errorf("state.race = %s", race)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.engine.Stats().StaleDropped >= 2 }, "the late results were not dropped as stale")
}

// TestParallelJoinNWaitsAndToleratesFailures: join n=2 with others wait:
// one branch fails for good, the two others complete, the job goes on.
// With n=3 the same failure fails the parallel step, and on_error runs.
func TestParallelJoinNWaitsAndToleratesFailures(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "b" {
			return nil, &schemas.Error{Code: schemas.CodeStepFailed, Message: "b cannot"}
		}
		return json.RawMessage(`{"ok": true}`), nil
	})
	two := b.define(strings.Replace(parallelThree, "    next: [{to: after}]", "    join: {mode: n, n: 2, others: wait}\n    save_as: join\n    next: [{to: after}]", 1))
	v := b.wait(b.start(two, `{}`, "n-2"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("n=2: status %s, error %+v", v.Status, v.Error)
	}
	join, _ := json.Marshal(decodeState(t, v.State)["join"])
	if string(join) != `{"cancelled":[],"completed":["a","c"],"failed":["b"]}` {
		t.Errorf("state.join = %s", join)
	}
	three := b.define(strings.Replace(strings.Replace(parallelThree, "version: 1", "version: 2", 1), "    next: [{to: after}]", "    on_error: rescue\n    next: [{to: after}]\n  - {id: rescue, kind: noop, save_as: rescued}", 1))
	v = b.wait(b.start(three, `{}`, "n-3"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("all: status %s, error %+v", v.Status, v.Error)
	}
	st := decodeState(t, v.State)
	if _, ok := st["rescued"]; !ok {
		t.Errorf("on_error did not run: %s", v.State)
	}
	if _, ok := st["after"]; ok {
		t.Errorf("the step after a failed join ran: %s", v.State)
	}
	if s := stepOf(v, "fan"); s.Status != schemas.StepFailed || s.LastError == nil || !strings.Contains(s.LastError.Message, "b cannot") {
		t.Errorf("fan step %+v, want failed naming b's error", s)
	}
}

const mapDocs = `
name: mapdocs
version: 1
input_schema:
  type: object
  required: [docs]
  properties:
    docs: {type: array, items: {type: object, required: [id, n], properties: {id: {type: string}, n: {type: integer}}}}
steps:
  - id: each
    kind: noop
    save_as: doubled
    for_each: {items: docs, key: "{{.item.id}}", concurrency: 4}
    next: [{to: after}]
  - {id: after, kind: noop, save_as: after}
`

func docsInput(n int) string {
	var b strings.Builder
	b.WriteString(`{"docs": [`)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"id": "doc-%d", "n": %d}`, i, i)
	}
	b.WriteString(`], "title": "t"}`)
	return b.String()
}

// TestMapGathersOutputsInInputOrder: 25 items, at most 4 in flight,
// answered out of order; the outputs are saved in input order, each item
// carries its own value and name and not the list, and the step after
// runs once.
func TestMapGathersOutputsInInputOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(mapDocs)
	id := b.start(def, docsInput(25), "map-1")
	var inFlight []held
	maxInFlight, answered := 0, 0
	for answered < 25 {
		// Take what has come, then answer the newest first.
		if len(inFlight) == 0 {
			inFlight = append(inFlight, b.nextOf(id, ch))
		}
	drain:
		for {
			select {
			case h := <-ch:
				inFlight = append(inFlight, h)
			case <-time.After(50 * time.Millisecond):
				break drain
			}
		}
		maxInFlight = max(maxInFlight, len(inFlight))
		h := inFlight[len(inFlight)-1]
		inFlight = inFlight[:len(inFlight)-1]
		if h.sm.Item == 0 {
			t.Fatalf("a message of step %s without an item before the map finished", h.sm.Step)
		}
		var item struct {
			ID string `json:"id"`
			N  int    `json:"n"`
		}
		if err := json.Unmarshal(h.sm.ItemValue, &item); err != nil || item.N != h.sm.Item-1 || h.sm.ItemName != item.ID {
			t.Fatalf("item %d: value %s name %q", h.sm.Item, h.sm.ItemValue, h.sm.ItemName)
		}
		if strings.Contains(string(h.sm.State), "docs") || !strings.Contains(string(h.sm.State), "title") {
			t.Fatalf("an item's state should be the job's without the list: %s", h.sm.State)
		}
		h.reply(json.RawMessage(strconv.Itoa(item.N*2)), nil)
		answered++
	}
	if maxInFlight > 4 {
		t.Errorf("%d items were in flight at once; the concurrency is 4", maxInFlight)
	}
	after := next(t, ch)
	if after.sm.Step != "after" || after.sm.Item != 0 {
		t.Fatalf("after the map came %s item %d", after.sm.Step, after.sm.Item)
	}
	after.reply(json.RawMessage(`{}`), nil)
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	var want []string
	for i := range 25 {
		want = append(want, strconv.Itoa(i*2))
	}
	got, _ := json.Marshal(decodeState(t, v.State)["doubled"])
	if string(got) != "["+strings.Join(want, ",")+"]" {
		t.Errorf("state.doubled = %s", got)
	}
}
