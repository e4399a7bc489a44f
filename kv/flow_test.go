package kv_test

import (
	"sync"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/kv"
)

// TestFlowSlotsAreExclusive: of many engines acquiring one limit's N
// slots at once, exactly N succeed; a release with nobody waiting frees
// the slot for the next, and one by a job that does not hold it changes
// nothing.
func TestFlowSlotsAreExclusive(t *testing.T) {
	b := setup(t, kv.Config{})
	c, f := ctx(t), b.store.Flow
	const n, tries = 3, 12
	var wg sync.WaitGroup
	var mu sync.Mutex
	var got []string
	for i := 0; i < tries; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			key, _, err := f.Acquire(c, "w-s", "k", n, i, kv.FlowHolder{Job: "job", MsgID: "m", At: time.Now()})
			if err != nil {
				t.Error(err)
				return
			}
			if key != "" {
				mu.Lock()
				got = append(got, key)
				mu.Unlock()
			}
		}(i)
	}
	wg.Wait()
	if len(got) != n {
		t.Fatalf("%d acquisitions of %d slots succeeded: %v", len(got), n, got)
	}
	if key, taken, err := f.Acquire(c, "w-s", "k", n, 0, kv.FlowHolder{Job: "late"}); err != nil || key != "" || taken != n {
		t.Fatalf("acquire over a full limit = %q, %d taken, %v", key, taken, err)
	}
	if r, err := f.Release(c, got[0], "another-job"); err != nil || r.To != nil {
		t.Fatalf("release by a job that does not hold it: %+v %v", r, err)
	}
	if key, _, _ := f.Acquire(c, "w-s", "k", n, 0, kv.FlowHolder{Job: "late"}); key != "" {
		t.Fatal("a slot released by a job that did not hold it was freed")
	}
	if r, err := f.Release(c, got[0], "job"); err != nil || r.To != nil {
		t.Fatalf("release: %+v %v", r, err)
	}
	if key, _, err := f.Acquire(c, "w-s", "k", n, 0, kv.FlowHolder{Job: "late"}); err != nil || key != got[0] {
		t.Fatalf("acquire after a release = %q, %v; want %q", key, err, got[0])
	}
}

// TestFlowReleaseHandsOverByPriorityThenAge: a released slot goes to the
// waiter with the highest priority, then the oldest; its record leaves
// the line, and the slot names it.
func TestFlowReleaseHandsOverByPriorityThenAge(t *testing.T) {
	b := setup(t, kv.Config{})
	c, f := ctx(t), b.store.Flow
	slot, _, err := f.Acquire(c, "lim", "kd", 1, 0, kv.FlowHolder{Job: "holder", MsgID: "holder/s/1"})
	if err != nil || slot == "" {
		t.Fatalf("acquire: %q %v", slot, err)
	}
	t0 := time.Unix(1700000000, 0)
	waiters := []struct {
		job  string
		prio int
		at   time.Time
	}{{"old-low", 1, t0}, {"new-high", 9, t0.Add(2 * time.Second)}, {"old-high", 9, t0.Add(time.Second)}, {"new-low", 1, t0.Add(3 * time.Second)}}
	for _, w := range waiters {
		key := kv.WaiterKey("lim", "kd", w.prio, w.at, w.job)
		if err := f.Wait(c, "lim", "kd", key, kv.FlowHolder{Job: w.job, MsgID: w.job + "/s/1", Prio: w.prio, At: w.at}); err != nil {
			t.Fatal(err)
		}
	}
	holder := "holder"
	for _, want := range []string{"old-high", "new-high", "old-low", "new-low"} {
		r, err := f.Release(c, slot, holder)
		if err != nil || r.To == nil || !r.Handed || r.To.Job != want {
			t.Fatalf("release by %s went to %+v (handed %v, %v), want %s", holder, r.To, r.Handed, err, want)
		}
		s, err := f.Slot(c, slot)
		if err != nil || s.Holder.Job != want || s.Holder.MsgID != want+"/s/1" {
			t.Fatalf("slot after hand-over: %+v %v", s.Holder, err)
		}
		holder = want
	}
	if r, err := f.Release(c, slot, holder); err != nil || r.To != nil {
		t.Fatalf("last release: %+v %v", r, err)
	}
	if _, err := f.Slot(c, slot); err == nil {
		t.Fatal("slot still held after the last release")
	}
}

// TestFlowRateWindowCounts: a window admits at most its limit, an id
// counted once is admitted again without counting, and the next window
// starts afresh.
func TestFlowRateWindowCounts(t *testing.T) {
	b := setup(t, kv.Config{})
	c, f := ctx(t), b.store.Flow
	now := time.Unix(1700000000, 0).Add(300 * time.Millisecond)
	for i, id := range []string{"a", "b", "a"} {
		ok, w, err := f.Count(c, "rl", "_", 2, time.Second, now, id)
		if err != nil || !ok {
			t.Fatalf("count %d (%s): %v %v", i, id, ok, err)
		}
		if want := min(i+1, 2); w.Count != want {
			t.Errorf("count %d: window holds %d, want %d", i, w.Count, want)
		}
	}
	ok, w, err := f.Count(c, "rl", "_", 2, time.Second, now, "c")
	if err != nil || ok || w.Count != 2 || !w.Start.Equal(now.Truncate(time.Second)) {
		t.Fatalf("third in a window of 2: admitted %v, %+v, %v", ok, w, err)
	}
	ok, w, err = f.Count(c, "rl", "_", 2, time.Second, now.Add(time.Second), "c")
	if err != nil || !ok || w.Count != 1 {
		t.Fatalf("first of the next window: admitted %v, %+v, %v", ok, w, err)
	}
}
