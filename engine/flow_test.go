package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// runEngines starts n more engines on b's store until the test ends;
// tune adjusts each before it runs.
func (b *bundle) runEngines(n int, cfg Config, tune func(*Engine)) []*Engine {
	b.t.Helper()
	var out []*Engine
	for i := 0; i < n; i++ {
		c := cfg
		c.Store = b.store
		if c.ReconcileInterval == 0 {
			c.ReconcileInterval = -1
		}
		e, err := New(c)
		if err != nil {
			b.t.Fatal(err)
		}
		if tune != nil {
			tune(e)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			if err := e.Run(ctx); err != nil {
				b.t.Errorf("engine run: %v", err)
			}
		}()
		b.t.Cleanup(func() { cancel(); <-done })
		out = append(out, e)
	}
	return out
}

// waitFlow is wait, with the job's record and the flow bucket's keys
// reported when it does not end.
func (b *bundle) waitFlow(id string) *client.JobView {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := b.client.Wait(ctx, id, nil)
	if err != nil {
		v, _ = b.client.Job(context.Background(), id)
		data, _ := json.Marshal(v)
		b.t.Fatalf("wait for %s: %v\njob: %s\nslots: %v\nwaiters: %v", id, err, data, flowKeys(b.t, b.store, "c.>"), flowKeys(b.t, b.store, "w.>"))
	}
	return v
}

// flowKeys lists the flow bucket's keys under filter.
func flowKeys(t *testing.T, st *kv.Store, filter string) []string {
	t.Helper()
	bucket, err := st.JS.KeyValue(context.Background(), st.Names.FlowBucket)
	if err != nil {
		t.Fatal(err)
	}
	l, err := bucket.ListKeysFiltered(context.Background(), filter)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Stop() }()
	var out []string
	for k := range l.Keys() {
		out = append(out, k)
	}
	return out
}

// flowEvents returns job's history events of type typ.
func flowEvents(t *testing.T, c *client.Client, job, typ string) []schemas.HistoryEvent {
	t.Helper()
	evs, err := c.History(context.Background(), job)
	if err != nil {
		t.Fatal(err)
	}
	var out []schemas.HistoryEvent
	for _, ev := range evs {
		if ev.Type == typ {
			out = append(out, ev)
		}
	}
	return out
}

const perCustomer = `
name: orders
version: 1
input_schema: {type: object, required: [customer], properties: {customer: {type: string}}}
steps:
  - id: charge
    kind: noop
    save_as: charged
    concurrency: {limit: 2, key: "{{.state.customer}}"}
    next: [{to: notify}]
  - id: notify
    kind: noop
    save_as: notified
`

// The test: 2 engines, 4 workers, 20 jobs over 3 customers, at
// most 2 jobs per customer running charge. The workers record how many
// charges of each customer run at once; the limit holds under load, every
// job completes, some were seen waiting in their status, and no slot or
// waiter is left in the bucket.
func TestConcurrencyLimitPerKeyHoldsAcrossEnginesAndWorkers(t *testing.T) {
	t.Parallel()
	for _, cluster := range []bool{false, true} {
		name := "one server"
		if cluster {
			name = "three-node cluster, three replicas"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if cluster && testing.Short() {
				t.Skip("the cluster run is skipped with -short")
			}
			concurrencyLimitHolds(t, setup(t, setupOptions{noEngine: true, cluster: cluster}))
		})
	}
}

// concurrencyLimitHolds runs 20 jobs over 3 customers, at most 2 charges
// per customer at once, with 2 engines and 4 workers on b.
func concurrencyLimitHolds(t *testing.T, b *bundle) {
	engines := b.runEngines(2, Config{}, nil)
	def := b.define(perCustomer)

	var mu sync.Mutex
	running, most := map[string]int{}, map[string]int{}
	release := make(chan struct{})
	var charges atomic.Int64
	work := func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step != "charge" {
			return json.RawMessage(`{}`), nil
		}
		var st struct{ Customer string }
		_ = json.Unmarshal(sm.State, &st)
		mu.Lock()
		running[st.Customer]++
		most[st.Customer] = max(most[st.Customer], running[st.Customer])
		mu.Unlock()
		// The first charges wait for the test to have seen jobs waiting;
		// later ones take a little time, as a payment call would.
		if charges.Add(1) <= 4 {
			<-release
		} else {
			time.Sleep(20 * time.Millisecond) // simulated work, not synchronisation
		}
		mu.Lock()
		running[st.Customer]--
		mu.Unlock()
		return json.RawMessage(`{"ok": true}`), nil
	}
	for i := 0; i < 4; i++ {
		b.worker(work)
	}
	customers := []string{"acme", "globex", "initech"}
	var ids []string
	for i := 0; i < 20; i++ {
		ids = append(ids, b.start(def, fmt.Sprintf(`{"customer": %q}`, customers[i%3]), fmt.Sprintf("order-%02d", i)))
	}
	// While the first charges are held, the others of their customers are
	// recorded waiting, and their status says for what.
	var seen *client.JobView
	testsupport.Eventually(t, 20*time.Second, func() bool {
		for _, id := range ids {
			v, err := b.client.Job(context.Background(), id)
			if err == nil && len(v.Waiting) > 0 {
				seen = v
				return true
			}
		}
		return false
	}, "no job was seen waiting for the concurrency limit")
	w := seen.Waiting[0]
	if w.Step != "charge" || w.Flow.Kind != schemas.FlowConcurrency || w.Flow.Max != 2 || w.Flow.InUse != 2 || !strings.Contains(w.Reason, "2 of 2 running") {
		t.Errorf("waiting = %+v (%s), want charge waiting with 2 of 2 slots taken", w, w.Reason)
	}
	page, err := b.client.List(context.Background(), client.ListFilter{Limit: 50})
	if err != nil {
		t.Fatal(err)
	}
	listed := false
	for _, j := range page.Jobs {
		listed = listed || strings.Contains(j.Waiting, "concurrency limit")
	}
	if !listed {
		t.Error("engine list shows no job waiting")
	}
	close(release)
	for _, id := range ids {
		if v := b.waitFlow(id); v.Status != schemas.JobCompleted {
			t.Fatalf("job %s ended %s: %+v", id, v.Status, v.Error)
		}
	}
	mu.Lock()
	for _, c := range customers {
		if most[c] > 2 {
			t.Errorf("customer %s had %d charges running at once; the limit is 2", c, most[c])
		}
		if most[c] == 0 {
			t.Errorf("customer %s had no charge", c)
		}
	}
	mu.Unlock()
	if n := charges.Load(); n != 20 {
		t.Errorf("charges run = %d, want 20 (one per job)", n)
	}
	var waits, handed uint64
	for _, e := range engines {
		waits += e.Stats().FlowWaits
		handed += e.Stats().FlowHandedOver
	}
	if waits == 0 || handed == 0 {
		t.Errorf("flow waits %d, hand-overs %d; want both above 0", waits, handed)
	}
	if got := len(flowEvents(t, b.client, seen.ID, schemas.EventStepWaiting)); got != 1 {
		t.Errorf("job %s has %d step.waiting events, want 1", seen.ID, got)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		return len(flowKeys(t, b.store, "c.>")) == 0 && len(flowKeys(t, b.store, "w.>")) == 0
	}, "slots or waiters left in the flow bucket: %v %v", flowKeys(t, b.store, "c.>"), flowKeys(t, b.store, "w.>"))
}

// A step without limits costs no flow bucket round trip: nothing is ever
// written there.
func TestStepsWithoutLimitsLeaveTheFlowBucketAlone(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	def := b.define(threeSteps)
	for i := 0; i < 3; i++ {
		b.wait(b.start(def, `{"n": 1}`, fmt.Sprintf("plain-%d", i)))
	}
	st, err := b.store.JS.Stream(context.Background(), "KV_"+b.store.Names.FlowBucket)
	if err != nil {
		t.Fatal(err)
	}
	if n := st.CachedInfo().State.Msgs; n != 0 {
		t.Errorf("flow bucket holds %d messages after jobs without limits", n)
	}
}

const rateLimited = `
name: mail
version: 1
steps:
  - id: send
    kind: noop
    save_as: sent
    rate_limit: {limit: 3, period: 1s}
`

// No rate window admits more than its limit: every admission is recorded
// in the job's history with the window it counted in; the service's
// record of the calls agrees (a call never precedes its window), and the
// jobs over the limit waited for later windows.
func TestRateLimitNoWindowAdmitsMoreThanItsLimit(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	b.runEngines(2, Config{}, nil)
	def := b.define(rateLimited)
	var mu sync.Mutex
	called := map[string]time.Time{}
	for i := 0; i < 2; i++ {
		b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
			mu.Lock()
			called[sm.Job] = time.Now()
			mu.Unlock()
			return json.RawMessage(`{}`), nil
		})
	}
	var ids []string
	for i := 0; i < 10; i++ {
		ids = append(ids, b.start(def, `{}`, fmt.Sprintf("mail-%02d", i)))
	}
	perWindow := map[time.Time]int{}
	waited := 0
	for _, id := range ids {
		if v := b.waitFlow(id); v.Status != schemas.JobCompleted {
			t.Fatalf("job %s ended %s", id, v.Status)
		}
		adm := flowEvents(t, b.client, id, schemas.EventStepAdmitted)
		if len(adm) != 1 || adm[0].Data.Flow == nil || adm[0].Data.Flow.Kind != schemas.FlowRate || adm[0].Data.Flow.Until == nil {
			t.Fatalf("job %s: admissions %+v, want one rate admission", id, adm)
		}
		f := adm[0].Data.Flow
		perWindow[f.Since]++
		if f.Until.Sub(f.Since) != time.Second || f.InUse > 3 {
			t.Errorf("job %s admitted in window %v–%v as %d of %d", id, f.Since, f.Until, f.InUse, f.Max)
		}
		mu.Lock()
		at := called[id]
		mu.Unlock()
		if at.Before(f.Since) {
			t.Errorf("job %s called at %v, before its window %v", id, at, f.Since)
		}
		waited += len(flowEvents(t, b.client, id, schemas.EventStepWaiting))
	}
	total := 0
	for w, n := range perWindow {
		total += n
		if n > 3 {
			t.Errorf("window %v admitted %d dispatches; the limit is 3", w, n)
		}
	}
	if total != 10 || len(perWindow) < 4 {
		t.Errorf("%d admissions over %d windows, want 10 over at least 4", total, len(perWindow))
	}
	if waited == 0 {
		t.Error("no job waited for a later window")
	}
}

const priorityFlow = `
name: %s
version: 1
steps:
  - id: work
    kind: noop
    save_as: done
    priority: %d
    concurrency: {limit: 1, group: shared}
`

// Among the dispatches waiting for one limit, the higher priority goes
// first, then the oldest: a limit of 1 shared (group) by a bulk workflow
// (priority 1) and a vip one (priority 9); while a bulk job holds it,
// three bulk jobs and then three vip jobs queue; they run vip first, each
// in the order it came.
func TestPriorityOrdersTheWaitersOfALimit(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	bulk := b.define(fmt.Sprintf(priorityFlow, "bulk", 1))
	vip := b.define(fmt.Sprintf(priorityFlow, "vip", 9))
	var mu sync.Mutex
	var order []string
	hold := make(chan struct{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Job == "first" {
			<-hold
		}
		mu.Lock()
		order = append(order, sm.Job)
		mu.Unlock()
		return json.RawMessage(`{}`), nil
	})
	b.start(bulk, `{}`, "first")
	waitingN := func(ids ...string) {
		t.Helper()
		testsupport.Eventually(t, 10*time.Second, func() bool {
			for _, id := range ids {
				v, err := b.client.Job(context.Background(), id)
				if err != nil || len(v.Waiting) == 0 {
					return false
				}
			}
			return true
		}, "jobs %v not all waiting", ids)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(flowKeys(t, b.store, "c.>")) == 1 }, "first job holds no slot")
	for _, id := range []string{"bulk-1", "bulk-2", "bulk-3"} {
		b.start(bulk, `{}`, id)
		waitingN(id) // each waits before the next comes: their ages differ
	}
	for _, id := range []string{"vip-1", "vip-2", "vip-3"} {
		b.start(vip, `{}`, id)
		waitingN(id)
	}
	if v, _ := b.client.Job(context.Background(), "vip-1"); v.Waiting[0].Flow.Priority != 9 {
		t.Errorf("vip-1 waits with priority %d, want 9", v.Waiting[0].Flow.Priority)
	}
	close(hold)
	for _, id := range []string{"first", "bulk-1", "bulk-2", "bulk-3", "vip-1", "vip-2", "vip-3"} {
		if v := b.waitFlow(id); v.Status != schemas.JobCompleted {
			t.Fatalf("job %s ended %s", id, v.Status)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	want := []string{"first", "vip-1", "vip-2", "vip-3", "bulk-1", "bulk-2", "bulk-3"}
	if !slices.Equal(order, want) {
		t.Errorf("ran in order %v, want %v", order, want)
	}
}

const oneAtATime = `
name: exclusive
version: 1
steps:
  - id: lock
    kind: noop
    save_as: locked
    concurrency: {limit: 1}
    next: [{to: after}]
  - id: after
    kind: noop
    save_as: after
`

// An engine that dies between writing a checkpoint and releasing its
// slot (here: an engine that never releases) leaves slots its holders'
// checkpoints no longer name; the reconciler of a live engine frees each
// and hands it to the next waiter, so every job completes.
func TestReconcilerFreesSlotsALostReleaseLeftBehind(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	crashy := b.runEngines(1, Config{}, func(e *Engine) { e.skipFlowRelease = true })
	b.worker(echo)
	def := b.define(oneAtATime)
	// The first job completes; its slot is never released, so the others
	// wait.
	ids := []string{b.start(def, `{}`, "excl-0")}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err := b.client.Job(context.Background(), ids[0])
		return err == nil && v.Status == schemas.JobCompleted
	}, "first job did not complete")
	ids = append(ids, b.start(def, `{}`, "excl-1"), b.start(def, `{}`, "excl-2"))
	for _, id := range ids[1:] {
		testsupport.Eventually(t, 10*time.Second, func() bool {
			v, err := b.client.Job(context.Background(), id)
			return err == nil && len(v.Waiting) > 0
		}, "job %s not waiting behind the leaked slot", id)
	}
	// A second engine whose reconciler runs often frees the slot.
	healer := b.runEngines(1, Config{ReconcileInterval: 100 * time.Millisecond}, nil)
	for _, id := range ids {
		if v := b.waitFlow(id); v.Status != schemas.JobCompleted {
			t.Fatalf("job %s ended %s", id, v.Status)
		}
	}
	if n := healer[0].Stats().FlowLeaked; n < 1 {
		t.Errorf("flow slots freed by the reconciler = %d, want at least 1", n)
	}
	_ = crashy
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(flowKeys(t, b.store, "c.>")) == 0 },
		"slots left: %v", flowKeys(t, b.store, "c.>"))
}

// A job cancelled while it waits leaves no waiter behind, and a job
// cancelled while it holds a slot hands it to the next.
func TestCancelWhileWaitingOrHolding(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	def := b.define(oneAtATime)
	hold := make(chan struct{})
	for i := 0; i < 2; i++ { // the holder's call keeps one busy
		b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
			if sm.Job == "holder" && sm.Step == "lock" {
				<-hold
			}
			return json.RawMessage(`{}`), nil
		})
	}
	b.start(def, `{}`, "holder")
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(flowKeys(t, b.store, "c.>")) == 1 }, "holder has no slot")
	b.start(def, `{}`, "waiter-1")
	b.start(def, `{}`, "waiter-2")
	for _, id := range []string{"waiter-1", "waiter-2"} {
		testsupport.Eventually(t, 10*time.Second, func() bool {
			v, err := b.client.Job(context.Background(), id)
			return err == nil && len(v.Waiting) > 0
		}, "%s not waiting", id)
	}
	ctx := context.Background()
	if err := b.store.SignalCancel(ctx, "waiter-1", "test", "not needed"); err != nil {
		t.Fatal(err)
	}
	if v := b.wait("waiter-1"); v.Status != schemas.JobCancelled {
		t.Fatalf("waiter-1 ended %s", v.Status)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(flowKeys(t, b.store, "w.>")) == 1 }, "waiters: %v", flowKeys(t, b.store, "w.>"))
	if err := b.store.SignalCancel(ctx, "holder", "test", "stuck"); err != nil {
		t.Fatal(err)
	}
	if v := b.wait("waiter-2"); v.Status != schemas.JobCompleted {
		t.Fatalf("waiter-2 ended %s", v.Status)
	}
	// The holder's call returns now; its result, for a cancelled job, is
	// dropped (waited for, so that it is not published after the test).
	close(hold)
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.engine.Stats().StaleDropped >= 1 }, "the cancelled holder's result was not dropped")
	testsupport.Eventually(t, 10*time.Second, func() bool {
		return len(flowKeys(t, b.store, "c.>")) == 0 && len(flowKeys(t, b.store, "w.>")) == 0
	}, "flow bucket not empty: %v %v", flowKeys(t, b.store, "c.>"), flowKeys(t, b.store, "w.>"))
}

var _ = jetstream.ErrKeyNotFound

// A paused job's waiting dispatch is not admitted: a slot handed to it
// goes on (here, freed: nobody else waits), and engine resume admits it.
func TestPausedWaiterDoesNotHoardASlot(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	def := b.define(oneAtATime)
	hold := make(chan struct{})
	for i := 0; i < 2; i++ {
		b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
			if sm.Job == "holder" && sm.Step == "lock" {
				<-hold
			}
			return json.RawMessage(`{}`), nil
		})
	}
	b.start(def, `{}`, "holder")
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(flowKeys(t, b.store, "c.>")) == 1 }, "holder has no slot")
	b.start(def, `{}`, "paused")
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err := b.client.Job(context.Background(), "paused")
		return err == nil && len(v.Waiting) > 0
	}, "paused job not waiting")
	ctx := context.Background()
	if _, err := b.client.Pause(ctx, "paused", client.ControlRequest{By: "test"}); err != nil {
		t.Fatal(err)
	}
	close(hold)
	b.waitFlow("holder")
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(flowKeys(t, b.store, "c.>")) == 0 },
		"the paused job keeps a slot: %v", flowKeys(t, b.store, "c.>"))
	if v, _ := b.client.Job(ctx, "paused"); len(v.Waiting) == 0 || v.Status != schemas.JobRunning {
		t.Fatalf("paused job: status %s, waiting %+v", v.Status, v.Waiting)
	}
	if _, err := b.client.Resume(ctx, "paused", client.ControlRequest{By: "test"}); err != nil {
		t.Fatal(err)
	}
	if v := b.waitFlow("paused"); v.Status != schemas.JobCompleted {
		t.Fatalf("resumed job ended %s", v.Status)
	}
}

const versionedLimit = `
name: versioned
version: %d
steps:
  - id: charge
    kind: noop
    save_as: charged
    concurrency: {limit: %d}
`

// Two versions of a workflow that declare other limits for one step
// share its slots, each taking only as many as its own limit: version 1
// (limit 1) never runs two charges at once even while version 2 (limit
// 3) releases slots it may not take, and no more than 3 run in all.
func TestVersionsWithOtherConcurrencyLimitsKeepTheirOwn(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	b.runEngines(2, Config{}, nil)
	v1, v2 := b.define(fmt.Sprintf(versionedLimit, 1, 1)), b.define(fmt.Sprintf(versionedLimit, 2, 3))
	var mu sync.Mutex
	running, most := map[int]int{}, map[int]int{}
	total, mostTotal := 0, 0
	for i := 0; i < 4; i++ {
		b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
			v := 1
			if strings.HasPrefix(sm.Job, "v2-") {
				v = 2
			}
			mu.Lock()
			running[v]++
			total++
			most[v], mostTotal = max(most[v], running[v]), max(mostTotal, total)
			mu.Unlock()
			time.Sleep(30 * time.Millisecond) // simulated work, not synchronisation
			mu.Lock()
			running[v]--
			total--
			mu.Unlock()
			return json.RawMessage(`{}`), nil
		})
	}
	var ids []string
	for i := 0; i < 6; i++ {
		ids = append(ids, b.start(v1, `{}`, fmt.Sprintf("v1-%d", i)), b.start(v2, `{}`, fmt.Sprintf("v2-%d", i)))
	}
	for _, id := range ids {
		if v := b.waitFlow(id); v.Status != schemas.JobCompleted {
			t.Fatalf("job %s ended %s", id, v.Status)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if most[1] > 1 || most[2] > 3 || mostTotal > 3 {
		t.Errorf("at once: version 1 %d (limit 1), version 2 %d (limit 3), in all %d (at most 3)", most[1], most[2], mostTotal)
	}
}

const versionedRate = `
name: paced
version: %d
steps:
  - id: send
    kind: noop
    save_as: sent
    rate_limit: {limit: 1, period: %s}
`

// Two versions with other rate periods count in windows of their own: a
// window of one is never reset by the other, so each admits at most its
// limit per window (here 1 an hour and 1 in two hours: 2 admissions,
// not all 6).
func TestVersionsWithOtherRatePeriodsCountApart(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	b.runEngines(2, Config{}, nil)
	v1, v2 := b.define(fmt.Sprintf(versionedRate, 1, "1h")), b.define(fmt.Sprintf(versionedRate, 2, "2h"))
	b.worker(func(*schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`{}`), nil })
	var ids []string
	for i := 0; i < 3; i++ {
		ids = append(ids, b.start(v1, `{}`, fmt.Sprintf("p1-%d", i)), b.start(v2, `{}`, fmt.Sprintf("p2-%d", i)))
	}
	// Each version admits one now; the others wait for their windows.
	testsupport.Eventually(t, 20*time.Second, func() bool {
		waiting := 0
		for _, id := range ids {
			if v, err := b.client.Job(context.Background(), id); err == nil && len(v.Waiting) > 0 {
				waiting++
			}
		}
		return waiting == 4
	}, "want 4 of 6 jobs waiting for a rate window")
	done := 0
	for _, id := range ids {
		if v, err := b.client.Job(context.Background(), id); err == nil && v.Status == schemas.JobCompleted {
			done++
		}
	}
	if done != 2 {
		t.Errorf("%d jobs completed in the first windows, want 2 (one per version)", done)
	}
}

const slotThenRate = `
name: metered
version: 1
input_schema: {type: object, required: [customer], properties: {customer: {type: string}}}
steps:
  - id: call
    kind: noop
    save_as: called
    concurrency: {limit: 2, key: "{{.state.customer}}"}
    rate_limit: {limit: 3, period: 1s, key: "{{.state.customer}}"}
`

// A dispatch that holds its concurrency slot and waits for a rate window
// is woken when the window ends, with two engines taking turns: every
// job completes with the reconcilers off (a lost wake-up would leave the
// key stalled).
func TestRateWaitersHoldingSlotsAreWoken(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	b.runEngines(2, Config{}, nil)
	def := b.define(slotThenRate)
	for i := 0; i < 2; i++ {
		b.worker(func(*schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`{}`), nil })
	}
	var ids []string
	for i := 0; i < 16; i++ {
		ids = append(ids, b.start(def, fmt.Sprintf(`{"customer": "c%d"}`, i%2), fmt.Sprintf("metered-%02d", i)))
	}
	for _, id := range ids {
		if v := b.waitFlow(id); v.Status != schemas.JobCompleted {
			t.Fatalf("job %s ended %s", id, v.Status)
		}
	}
}
