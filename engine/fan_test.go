package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
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
	send  func(res *schemas.StepResult) // a result made by the test
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
		}, send: func(res *schemas.StepResult) { b.publishResultID(res, id) }}
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

// TestMapItemsFailAndCollect: under on_item_error collect a failed item is
// listed with its key and error and the others are kept; under fail (the
// default) the first item to fail for good fails the step, naming it.
// Items retry on their own: a retryable failure of one item is tried again
// under a new attempt of that item only.
func TestMapItemsFailAndCollect(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	var mu sync.Mutex
	attempts := map[string]int{}
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		mu.Lock()
		attempts[sm.ItemName]++
		n := attempts[sm.ItemName]
		mu.Unlock()
		switch {
		case sm.ItemName == "doc-3":
			return nil, &schemas.Error{Code: schemas.CodeStepFailed, Message: "doc-3 is unreadable"}
		case sm.ItemName == "doc-5" && n == 1:
			return nil, &schemas.Error{Code: schemas.CodeStepFailed, Retryable: true, Message: "flaky"}
		}
		return json.RawMessage(`"ok"`), nil
	})
	retry := "defaults: {retry: {max_attempts: 3, backoff: {initial: 10ms, max: 20ms}}}\nsteps:"
	collect := b.define(strings.Replace(strings.Replace(mapDocs, "concurrency: 4}", "concurrency: 4, on_item_error: collect}", 1), "steps:", retry, 1))
	v := b.wait(b.start(collect, docsInput(8), "collect-1"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("collect: status %s, error %+v", v.Status, v.Error)
	}
	var got struct {
		Results []any `json:"results"`
		Errors  []struct {
			Index int            `json:"index"`
			Key   string         `json:"key"`
			Error *schemas.Error `json:"error"`
		} `json:"errors"`
	}
	raw, _ := json.Marshal(decodeState(t, v.State)["doubled"])
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	if r, _ := json.Marshal(got.Results); string(r) != `["ok","ok","ok",null,"ok","ok","ok","ok"]` {
		t.Errorf("results %s", r)
	}
	if len(got.Errors) != 1 || got.Errors[0].Index != 3 || got.Errors[0].Key != "doc-3" || got.Errors[0].Error.Message != "doc-3 is unreadable" {
		t.Errorf("errors %s", raw)
	}
	mu.Lock()
	if attempts["doc-5"] != 2 || attempts["doc-4"] != 1 {
		t.Errorf("attempts per item: %v; want doc-5 twice and the others once (doc-3 once: not retryable)", attempts)
	}
	mu.Unlock()

	fail := b.define(strings.Replace(strings.Replace(mapDocs, "version: 1", "version: 2", 1), "steps:", retry, 1))
	v = b.wait(b.start(fail, docsInput(8), "fail-1"))
	if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, "item 3 (doc-3) failed: doc-3 is unreadable") {
		t.Fatalf("fail: status %s, error %+v", v.Status, v.Error)
	}
}

// TestMapRefusesBadLists: a list too long, a path that is not a list and
// two items with the same key each fail the step before anything is
// dispatched, with the sizes or the items named.
func TestMapRefusesBadLists(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	calls := b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`{}`), nil })
	open := `
name: open
version: 1
steps:
  - id: each
    kind: noop
    save_as: out
    for_each: {items: docs, key: "{{.item.id}}", max_items: 3}
`
	def := b.define(open)
	for _, tc := range []struct{ id, input, want string }{
		{"long", `{"docs": [{"id": "a"}, {"id": "b"}, {"id": "c"}, {"id": "d"}]}`, "state.docs has 4 items; the step takes at most 3 (for_each.max_items)"},
		{"object", `{"docs": {"id": "a"}}`, "state.docs is an object, not a list"},
		{"absent", `{"other": 1}`, `state.docs: no member "docs"`},
		{"dup", `{"docs": [{"id": "a"}, {"id": "b"}, {"id": "a"}]}`, `items 0 and 2 have the same key "a"`},
		{"nokey", `{"docs": [{"id": "a"}, {"name": "b"}]}`, "for_each.key of item 1"},
	} {
		v := b.wait(b.start(def, tc.input, tc.id))
		if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, tc.want) {
			t.Errorf("%s: status %s, error %+v; want failed with %q", tc.id, v.Status, v.Error, tc.want)
		}
	}
	if n := calls.Load(); n != 0 {
		t.Errorf("%d items were dispatched from bad lists", n)
	}
	// An empty list completes the step at once with [].
	v := b.wait(b.start(def, `{"docs": []}`, "empty"))
	if got, _ := json.Marshal(decodeState(t, v.State)["out"]); v.Status != schemas.JobCompleted || string(got) != "[]" {
		t.Errorf("empty list: status %s, out %s", v.Status, got)
	}
}

// TestMapOutputsLeaveTheCheckpoint: 300 items of 1 KiB outputs gather
// 300 KiB; they go to the value store in chunks, every checkpoint written
// stays small, and the outputs come back complete and in order.
func TestMapOutputsLeaveTheCheckpoint(t *testing.T) {
	t.Parallel()
	var largest atomic.Int64
	var mu sync.Mutex
	chunks := map[string]schemas.FanChunk{}
	owner := ""
	b := setup(t, setupOptions{engine: Config{OnWrite: func(cp *schemas.Checkpoint) {
		if n := int64(len(cp.AppendJSON(nil))); n > largest.Load() {
			largest.Store(n)
		}
		if cp.Fan != nil {
			mu.Lock()
			for _, ch := range cp.Fan.Chunks {
				chunks[ch.Digest] = ch
			}
			owner = cp.MsgPrefix()
			mu.Unlock()
		}
	}}})
	pad := strings.Repeat("x", 1000)
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		return json.RawMessage(fmt.Sprintf(`{"i": %d, "pad": %q}`, sm.Item-1, pad)), nil
	})
	def := b.define(strings.Replace(mapDocs, "concurrency: 4}", "concurrency: 50}", 1))
	v := b.wait(b.start(def, docsInput(300), "big-1"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	var st struct {
		Doubled []struct {
			I int `json:"i"`
		} `json:"doubled"`
	}
	if err := json.Unmarshal(v.State, &st); err != nil || len(st.Doubled) != 300 {
		t.Fatalf("state: %v, %d outputs", err, len(st.Doubled))
	}
	for i, o := range st.Doubled {
		if o.I != i {
			t.Fatalf("output %d is item %d's", i, o.I)
		}
	}
	if n := largest.Load(); n > 64<<10 {
		t.Errorf("largest checkpoint written: %d bytes; want under 64 KiB", n)
	}
	// The finished map's chunks are deleted.
	mu.Lock()
	defer mu.Unlock()
	if len(chunks) < 2 {
		t.Fatalf("%d output chunks; 300 KiB of outputs should make many", len(chunks))
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		for _, ch := range chunks {
			if _, err := b.store.Values.Get(context.Background(), owner, schemas.ValueRef{Digest: ch.Digest, Bytes: ch.Bytes}); !errors.Is(err, schemas.ErrValueMissing) {
				return false
			}
		}
		return true
	}, "the finished map's output chunks were not deleted")
}

// TestLargeValuesByReference: a step output over the threshold is kept in
// the value store and the checkpoint holds its reference; conditions and
// the state schema see the value; the next step's message carries the
// reference and names its owner; the client shows the value; a state past
// the job's limit fails the job with the sizes.
func TestLargeValuesByReference(t *testing.T) {
	t.Parallel()
	var largest atomic.Int64
	b := setup(t, setupOptions{kv: kv.Config{MaxJobStateBytes: 400 << 10}, engine: Config{OnWrite: func(cp *schemas.Checkpoint) {
		if n := int64(len(cp.AppendJSON(nil))); n > largest.Load() {
			largest.Store(n)
		}
	}}})
	big := strings.Repeat("y", 100<<10)
	var sawRef atomic.Bool
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		switch sm.Step {
		case "c":
			var st map[string]json.RawMessage
			_ = json.Unmarshal(sm.State, &st)
			ref, ok := schemas.ParseValueRef(st["big"])
			if ok && sm.ValueOwner != "" {
				v, err := b.store.Values.Get(context.Background(), sm.ValueOwner, ref)
				sawRef.Store(err == nil && len(v) == len(big)+2)
			}
			return json.RawMessage(`{}`), nil
		case "grow":
			return json.RawMessage(fmt.Sprintf(`{"more%d": %q}`, sm.Attempt, big)), nil
		}
		return json.RawMessage(fmt.Sprintf(`%q`, big)), nil
	})
	def := b.define(`
name: large
version: 1
state_schema: {type: object, properties: {big: {type: string, minLength: 102400}}}
steps:
  - id: a
    kind: noop
    save_as: big
    next:
      - {to: c, when: "len(state.big) == 102400"}
      - {fail: "the condition did not see the value"}
  - {id: c, kind: noop, save_as: c}
`)
	v := b.wait(b.start(def, `{}`, "large-1"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	if !sawRef.Load() {
		t.Error("the step after did not get a reference it could read")
	}
	if st := decodeState(t, v.State); st["big"] != big {
		t.Errorf("the client shows state.big as %.60v", st["big"])
	}
	if n := largest.Load(); n > 16<<10 {
		t.Errorf("largest checkpoint %d bytes; the large value should be by reference", n)
	}

	grow := b.define(`
name: grow
version: 1
max_steps: 20
steps:
  - id: grow
    kind: noop
    next: [{to: grow}]
`)
	v = b.wait(b.start(grow, `{}`, "grow-1"))
	if v.Status != schemas.JobFailed || v.Error == nil || v.Error.Code != schemas.CodeTooLarge || !strings.Contains(v.Error.Message, "the job's limit is 409600") {
		t.Fatalf("grow: status %s, error %+v; want too_large naming the limit", v.Status, v.Error)
	}
}

// TestRequeueSendsLostFanDispatchesAgain: the messages of a map's items in
// flight are lost with the queues; Requeue sends each again under a new
// attempt, the late answers of the old attempts are stale, and the job
// completes with every output once.
func TestRequeueSendsLostFanDispatchesAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(mapDocs)
	id := b.start(def, docsInput(6), "requeue-1")
	var lost []held
	for range 4 { // the concurrency: taken and never answered, as if lost
		lost = append(lost, b.nextOf(id, ch))
	}
	lostAt := time.Now()
	testsupport.Eventually(t, 10*time.Second, func() bool {
		if _, err := b.engine.Requeue(context.Background(), lostAt); err != nil {
			t.Fatal(err)
		}
		return b.engine.Stats().Requeued > 0
	}, "Requeue sent nothing again")
	again := map[int]held{}
	for range 4 {
		h := b.nextOf(id, ch)
		if h.sm.Attempt != 2 {
			t.Fatalf("item %d came again as attempt %d", h.sm.Item, h.sm.Attempt)
		}
		again[h.sm.Item] = h
	}
	for _, h := range lost {
		if _, ok := again[h.sm.Item]; !ok {
			t.Fatalf("item %d was not sent again", h.sm.Item)
		}
		h.reply(json.RawMessage(`"stale"`), nil)
	}
	for _, h := range again {
		h.reply(json.RawMessage(`"fresh"`), nil)
	}
	for range 2 {
		h := b.nextOf(id, ch)
		h.reply(json.RawMessage(`"fresh"`), nil)
	}
	b.nextOf(id, ch).reply(json.RawMessage(`{}`), nil) // the step after
	v := b.wait(id)
	got, _ := json.Marshal(decodeState(t, v.State)["doubled"])
	if v.Status != schemas.JobCompleted || string(got) != `["fresh","fresh","fresh","fresh","fresh","fresh"]` {
		t.Fatalf("status %s, outputs %s", v.Status, got)
	}
}

// TestSweepDeletesAJobsValues: once a finished job is past its retention,
// the values its state kept by reference go with it.
func TestSweepDeletesAJobsValues(t *testing.T) {
	t.Parallel()
	var offset atomic.Int64
	b := setup(t, setupOptions{kv: kv.Config{JobRetention: time.Hour}, engine: Config{Now: func() time.Time {
		return time.Now().Add(time.Duration(offset.Load()))
	}}})
	big := strings.Repeat("z", 80<<10)
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		return json.RawMessage(fmt.Sprintf("%q", big)), nil
	})
	def := b.define("name: keep\nversion: 1\nsteps:\n  - {id: a, kind: noop, save_as: big}\n")
	id := b.start(def, `{}`, "sweep-values")
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s", v.Status)
	}
	ctx := context.Background()
	ent, err := b.store.Checkpoints.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	refs, _ := schemas.FindRefs(ent.Checkpoint.State)
	if len(refs) != 1 {
		t.Fatalf("state refs %v, want the one value", refs)
	}
	if _, err := b.store.Values.Get(ctx, ent.Checkpoint.MsgPrefix(), refs[0]); err != nil {
		t.Fatalf("the value before the sweep: %v", err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		_, err := b.store.Jobs.Get(ctx, kv.EndedKey(schemas.JobCompleted, "keep", id))
		return err == nil
	}, "the job's ended index entry never came")
	offset.Store(int64(2 * time.Hour))
	if err := b.engine.SweepJobs(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Values.Get(ctx, ent.Checkpoint.MsgPrefix(), refs[0]); !errors.Is(err, schemas.ErrValueMissing) {
		t.Fatalf("the value after the sweep: %v, want ErrValueMissing", err)
	}
}

// TestMapItemWithUnknownOutcomeWaitsForAPerson: an item of an unsafe map
// fails for good while its effect may have happened; the job stops in
// needs_reconciliation naming the item's key; the item in flight finishes
// and none is started; the resolution sends that item again and the map
// goes on to the end.
func TestMapItemWithUnknownOutcomeWaitsForAPerson(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(strings.Replace(strings.Replace(mapDocs, "kind: noop\n    save_as: doubled", "kind: noop\n    effect: unsafe\n    save_as: doubled", 1), "concurrency: 4}", "concurrency: 2}", 1))
	id := b.start(def, docsInput(4), "unsafe-map")
	first, second := b.nextOf(id, ch), b.nextOf(id, ch)
	key := first.sm.EffectKey
	if want := id + "/each/" + first.sm.ItemName; key != want {
		t.Fatalf("item effect key %q, want %q", key, want)
	}
	first.send(&schemas.StepResult{Job: id, Step: "each", Attempt: first.sm.Attempt, Item: first.sm.Item, EffectKey: key,
		EffectState: schemas.EffectDispatched, Error: &schemas.Error{Code: schemas.CodeTimeout, Message: "no answer from the provider"}})
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, _ := b.client.Job(context.Background(), id)
		return v != nil && v.Status == schemas.JobNeedsReconciliation
	}, "the job did not stop for reconciliation")
	v, _ := b.client.Job(context.Background(), id)
	if v.Blocked == nil || v.Blocked.EffectKey != key || v.Blocked.Item != first.sm.Item || v.Fan == nil || v.Fan.Blocked != 1 {
		t.Fatalf("blocked %+v fan %+v", v.Blocked, v.Fan)
	}
	second.reply(json.RawMessage(`"two"`), nil) // in flight: still applied
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, _ := b.client.Job(context.Background(), id)
		return v.Fan != nil && v.Fan.Completed == 1
	}, "the item in flight was not applied")
	select {
	case h := <-ch:
		t.Fatalf("item %d was dispatched while the job waits for a person", h.sm.Item)
	case <-time.After(200 * time.Millisecond):
	}
	sig := nats.NewMsg(b.store.Names.InboxSubject(kv.InboxSignal, id))
	sig.Data, _ = json.Marshal(schemas.Signal{Job: id, Type: schemas.SignalEffectResolved, Key: key, By: "test"})
	if _, err := b.store.JS.PublishMsg(context.Background(), sig); err != nil {
		t.Fatal(err)
	}
	again := b.nextOf(id, ch)
	if again.sm.Item != first.sm.Item || again.sm.Attempt != first.sm.Attempt+1 || again.sm.EffectKey != key {
		t.Fatalf("after the resolution came item %d attempt %d key %s", again.sm.Item, again.sm.Attempt, again.sm.EffectKey)
	}
	again.reply(json.RawMessage(`"one"`), nil)
	for range 2 {
		b.nextOf(id, ch).reply(json.RawMessage(`"more"`), nil)
	}
	b.nextOf(id, ch).reply(json.RawMessage(`{}`), nil) // after
	v = b.wait(id)
	got, _ := json.Marshal(decodeState(t, v.State)["doubled"])
	if v.Status != schemas.JobCompleted || string(got) != `["one","two","more","more"]` {
		t.Fatalf("status %s outputs %s", v.Status, got)
	}
}

// TestLargeInputByReference: an input member over the threshold is stored
// by the client before the job's first checkpoint, which holds its
// reference; the job runs; starting it again with the same input attaches.
func TestLargeInputByReference(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	def := b.define("name: bigin\nversion: 1\ninput_schema: {type: object, required: [doc], properties: {doc: {type: string, minLength: 300000}}}\nsteps:\n  - {id: a, kind: noop, save_as: a}\n")
	input := fmt.Sprintf(`{"doc": %q}`, strings.Repeat("d", 300<<10))
	id := b.start(def, input, "bigin-1")
	v := b.wait(id)
	if v.Status != schemas.JobCompleted || decodeState(t, v.State)["doc"] != strings.Repeat("d", 300<<10) {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
	ent, err := b.store.Checkpoints.Get(context.Background(), id)
	if err != nil || ent.Size > 8<<10 {
		t.Fatalf("checkpoint of %d bytes (%v); the input should be by reference", ent.Size, err)
	}
	res, err := b.client.Start(context.Background(), def, json.RawMessage(input), client.StartOptions{JobID: id})
	if err != nil || !res.Attached {
		t.Fatalf("start again: %+v %v, want attached", res, err)
	}
}

// TestMapWithSeveralUnknownOutcomes: two items of a map end with their
// effects' outcome unknown; both are listed, each can be resolved in any
// order, and the job goes on once both are.
func TestMapWithSeveralUnknownOutcomes(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(strings.Replace(strings.Replace(mapDocs, "kind: noop\n    save_as: doubled", "kind: noop\n    effect: unsafe\n    save_as: doubled", 1), "concurrency: 4}", "concurrency: 2}", 1))
	id := b.start(def, docsInput(3), "unsafe-two")
	hs := []held{b.nextOf(id, ch), b.nextOf(id, ch)}
	for _, h := range hs {
		h.send(&schemas.StepResult{Job: id, Step: "each", Attempt: h.sm.Attempt, Item: h.sm.Item, EffectKey: h.sm.EffectKey,
			EffectState: schemas.EffectDispatched, Error: &schemas.Error{Code: schemas.CodeTimeout, Message: "no answer"}})
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, _ := b.client.Job(context.Background(), id)
		return v != nil && v.Fan != nil && v.Fan.Blocked == 2
	}, "both items were not listed as waiting for a person")
	resolve := func(key string) {
		sig := nats.NewMsg(b.store.Names.InboxSubject(kv.InboxSignal, id))
		sig.Data, _ = json.Marshal(schemas.Signal{Job: id, Type: schemas.SignalEffectResolved, Key: key, By: "test"})
		sig.Header.Set(jetstream.MsgIDHeader, "resolve/"+key)
		if _, err := b.store.JS.PublishMsg(context.Background(), sig); err != nil {
			t.Fatal(err)
		}
	}
	resolve(hs[1].sm.EffectKey) // the second first
	again := b.nextOf(id, ch)
	if again.sm.Item != hs[1].sm.Item {
		t.Fatalf("after resolving item %d came item %d", hs[1].sm.Item, again.sm.Item)
	}
	if v, _ := b.client.Job(context.Background(), id); v.Status != schemas.JobNeedsReconciliation || v.Blocked == nil || v.Blocked.EffectKey != hs[0].sm.EffectKey {
		t.Fatalf("with one left: status %s blocked %+v", v.Status, v.Blocked)
	}
	again.reply(json.RawMessage(`"b"`), nil)
	resolve(hs[0].sm.EffectKey)
	first := b.nextOf(id, ch)
	first.reply(json.RawMessage(`"a"`), nil)
	b.nextOf(id, ch).reply(json.RawMessage(`"c"`), nil)
	b.nextOf(id, ch).reply(json.RawMessage(`{}`), nil) // after
	v := b.wait(id)
	got, _ := json.Marshal(decodeState(t, v.State)["doubled"])
	if v.Status != schemas.JobCompleted || string(got) != `["a","b","c"]` {
		t.Fatalf("status %s outputs %s", v.Status, got)
	}
}

// TestMapWhoseLastOutputFillsAChunk: the output that completes a map
// would fill a chunk; the map completes with it in the state.
func TestMapWhoseLastOutputFillsAChunk(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	pad := strings.Repeat("p", 9000)
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		return json.RawMessage(fmt.Sprintf(`{"pad": %q}`, pad)), nil
	})
	def := b.define("name: fill\nversion: 1\nsteps:\n  - id: m\n    kind: noop\n    for_each: {items: xs, concurrency: 3}\n    save_as: rs\n")
	for _, n := range []int{1, 2, 7} {
		var xs []string
		for i := range n {
			xs = append(xs, strconv.Itoa(i))
		}
		v := b.wait(b.start(def, `{"xs": [`+strings.Join(xs, ",")+`]}`, fmt.Sprintf("fill-%d", n)))
		var st struct {
			Rs []map[string]string `json:"rs"`
		}
		if err := json.Unmarshal(v.State, &st); v.Status != schemas.JobCompleted || err != nil || len(st.Rs) != n || st.Rs[n-1]["pad"] != pad {
			t.Fatalf("%d items: status %s, %d outputs (%v)", n, v.Status, len(st.Rs), err)
		}
	}
}

// TestMapItemTooLargeForAMessageFails: an item whose step message would
// be over the message limit fails on its own, naming the sizes; under
// collect the map goes on.
func TestMapItemTooLargeForAMessageFails(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{kv: kv.Config{MaxMessageBytes: 64 << 10, MaxValueBytes: 1 << 20}})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`"ok"`), nil })
	def := b.define("name: fat\nversion: 1\nsteps:\n  - id: m\n    kind: noop\n    for_each: {items: xs, on_item_error: collect}\n    save_as: rs\n")
	input := fmt.Sprintf(`{"xs": ["a", %q, "c"]}`, strings.Repeat("b", 70<<10))
	v := b.wait(b.start(def, input, "fat-1"))
	var st struct {
		Rs struct {
			Results []any `json:"results"`
			Errors  []struct {
				Index int            `json:"index"`
				Error *schemas.Error `json:"error"`
			} `json:"errors"`
		} `json:"rs"`
	}
	if err := json.Unmarshal(v.State, &st); err != nil || v.Status != schemas.JobCompleted {
		t.Fatalf("status %s error %+v (%v)", v.Status, v.Error, err)
	}
	if len(st.Rs.Errors) != 1 || st.Rs.Errors[0].Index != 1 || st.Rs.Errors[0].Error.Code != schemas.CodeTooLarge || !strings.Contains(st.Rs.Errors[0].Error.Message, "step message is") {
		t.Fatalf("errors %+v", st.Rs.Errors)
	}
}

// TestMapListLeavesTheCheckpointWhileItRuns: a list under the value
// threshold (2,000 items, about 54 KB) is still kept by reference while
// the map runs, so no checkpoint of the map carries it (the first one's
// job.started event holds the input); the client shows it in place.
func TestMapListLeavesTheCheckpointWhileItRuns(t *testing.T) {
	t.Parallel()
	var largest atomic.Int64
	b := setup(t, setupOptions{engine: Config{OnWrite: func(cp *schemas.Checkpoint) {
		for _, ev := range cp.Events {
			if ev.Type == schemas.EventJobStarted {
				return // the first carries the input, list and all, in job.started
			}
		}
		if n := int64(len(cp.AppendJSON(nil))); n > largest.Load() {
			largest.Store(n)
		}
	}}})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`1`), nil })
	def := b.define(mapDocs)
	v := b.wait(b.start(def, docsInput(2000), "list-ref"))
	var st struct {
		Docs    []json.RawMessage `json:"docs"`
		Doubled []int             `json:"doubled"`
	}
	if err := json.Unmarshal(v.State, &st); err != nil || v.Status != schemas.JobCompleted || len(st.Docs) != 2000 || len(st.Doubled) != 2000 {
		t.Fatalf("status %s, %d docs, %d outputs (%v)", v.Status, len(st.Docs), len(st.Doubled), err)
	}
	if n := largest.Load(); n > 24<<10 {
		t.Errorf("largest checkpoint %d bytes; the list should be by reference", n)
	}
}

// TestWaitingWithRetryAfterHoldsTheNextAttempt: a step answered "waiting"
// with the provider's Retry-After is dispatched again after that long,
// without using up an attempt of its retry budget.
func TestWaitingWithRetryAfterHoldsTheNextAttempt(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define("name: limited\nversion: 1\ndefaults: {retry: {max_attempts: 1}}\nsteps:\n  - {id: a, kind: noop, save_as: a}\n")
	id := b.start(def, `{}`, "limited-1")
	first := b.nextOf(id, ch)
	sent := time.Now()
	first.reply(nil, &schemas.Error{Code: schemas.CodeWaiting, Retryable: true, RetryAfterMs: 1500, Message: "rate limited"})
	again := b.nextOf(id, ch)
	if again.sm.NotBefore == nil || again.sm.NotBefore.Sub(sent) < 1400*time.Millisecond || again.sm.RunAttempt != first.sm.RunAttempt {
		t.Fatalf("the next attempt: not before %v (sent %v), run attempt %d (was %d)", again.sm.NotBefore, sent, again.sm.RunAttempt, first.sm.RunAttempt)
	}
	again.reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s error %+v (max_attempts 1: the wait must not count)", v.Status, v.Error)
	}
}

// TestMapItemsDoNotCountAgainstMaxSteps: a map of 30 items runs in a job
// whose max_steps is 5.
func TestMapItemsDoNotCountAgainstMaxSteps(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`1`), nil })
	def := b.define(strings.Replace(mapDocs, "version: 1", "version: 1\nmax_steps: 5", 1))
	v := b.wait(b.start(def, docsInput(30), "budget-1"))
	if got, _ := json.Marshal(decodeState(t, v.State)["doubled"]); v.Status != schemas.JobCompleted || strings.Count(string(got), "1") != 30 {
		t.Fatalf("status %s error %+v outputs %s", v.Status, v.Error, got)
	}
}
