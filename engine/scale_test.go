package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
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

const fiveSteps = `
name: five
version: 1
steps:
  - {id: s1, kind: noop, next: [{to: s2}]}
  - {id: s2, kind: noop, next: [{to: s3}]}
  - {id: s3, kind: noop, next: [{to: s4}]}
  - {id: s4, kind: noop, next: [{to: s5}]}
  - {id: s5, kind: noop}
`

// runEngine runs another engine until the test ends, on cfg.Store or, when
// nil, b's store.
func (b *bundle) runEngine(cfg Config) *Engine {
	b.t.Helper()
	if cfg.Store == nil {
		cfg.Store = b.store
	}
	if cfg.ReconcileInterval == 0 {
		cfg.ReconcileInterval = -1
	}
	e, err := New(cfg)
	if err != nil {
		b.t.Fatal(err)
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
	return e
}

// historyMessages reads every message of the history stream, by subject.
func allHistory(t *testing.T, st *kv.Store) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx := context.Background()
	s, err := st.JS.Stream(ctx, st.Names.HistoryStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// TestHistoryIsStoredOncePerTransition: with two engines taking turns on
// the same jobs and no checkpoint cache, every transition's events reach
// the history stream exactly once, in sequence order, and no checkpoint
// carries another transition's events.
func TestHistoryIsStoredOncePerTransition(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		cacheBytes int
		batch      int
	}{{"no cache, batch 2", -1, 2}, {"cache, batch 8", 0, 8}, {"no cache, batch 1", -1, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var outboxes sync.Map // job → a checkpoint whose outbox was wrong
			onWrite := func(cp *schemas.Checkpoint) {
				if n := transitions(cp.Events); n > tc.batch {
					outboxes.Store(cp.JobID, fmt.Sprintf("seq %d carries %d transitions, more than a batch (%d)", cp.Seq, n, tc.batch))
				}
				for _, ev := range cp.Events {
					if ev.Data.Seq <= cp.Flushed || ev.Data.Seq > cp.Seq {
						outboxes.Store(cp.JobID, fmt.Sprintf("seq %d (flushed to %d) carries an event of seq %d", cp.Seq, cp.Flushed, ev.Data.Seq))
					}
				}
			}
			b := setup(t, setupOptions{engine: Config{CacheBytes: tc.cacheBytes, HistoryBatch: tc.batch, OnWrite: onWrite}})
			second := b.runEngine(Config{CacheBytes: tc.cacheBytes, HistoryBatch: tc.batch, OnWrite: onWrite})
			b.worker(echo)
			def := b.define(fiveSteps)
			const jobs = 20
			var ids []string
			for i := range jobs {
				ids = append(ids, b.start(def, `{}`, fmt.Sprintf("h-%d", i)))
			}
			final := map[string]uint64{}
			for _, id := range ids {
				v := b.wait(id)
				if v.Status != schemas.JobCompleted {
					t.Fatalf("job %s: %s", id, v.Status)
				}
				final[id] = v.Seq
			}
			outboxes.Range(func(k, v any) bool { t.Errorf("job %s: %s", k, v); return true })
			// A stopped job's outbox is published after its last write:
			// wait until every job's last sequence is in the stream. Then
			// every event is stored exactly once, in messages that each hold
			// whole transitions and follow one another.
			events := map[string]map[string]int{} // job → event id → copies
			seqs := map[string]map[uint64]bool{}
			testsupport.Eventually(t, 10*time.Second, func() bool {
				events, seqs = map[string]map[string]int{}, map[string]map[uint64]bool{}
				last := map[string]uint64{}
				for _, m := range allHistory(t, b.store) {
					if strings.HasSuffix(m.Subject, ".effects") {
						continue
					}
					job := strings.TrimPrefix(m.Subject, b.store.Names.HistoryPrefix)
					evs, err := schemas.DecodeHistory(m.Data)
					if err != nil {
						t.Fatal(err)
					}
					if events[job] == nil {
						events[job], seqs[job] = map[string]int{}, map[uint64]bool{}
					}
					for _, h := range evs {
						events[job][h.ID]++
						seqs[job][h.Data.Seq] = true
						if h.Data.Seq < last[job] {
							t.Errorf("job %s: event %s (seq %d) after seq %d", job, h.ID, h.Data.Seq, last[job])
						}
						last[job] = h.Data.Seq
					}
				}
				for _, id := range ids {
					if last[id] != final[id] {
						return false
					}
				}
				return true
			}, "the final transitions never reached the history stream")
			// Sequence 1 is the pending checkpoint its client created: no
			// events. Every later one is a transition with events.
			for _, id := range ids {
				for ev, n := range events[id] {
					if n != 1 {
						t.Errorf("job %s: event %s stored %d times, want once", id, ev, n)
					}
				}
				for seq := uint64(2); seq <= final[id]; seq++ {
					if !seqs[id][seq] {
						t.Errorf("job %s: no event of seq %d in the history stream", id, seq)
					}
				}
			}
			// The history read back is whole and in order.
			evs, err := b.client.History(context.Background(), ids[0])
			if err != nil {
				t.Fatal(err)
			}
			if len(evs) == 0 || evs[0].Type != schemas.EventJobStarted || evs[len(evs)-1].Type != schemas.EventJobCompleted {
				t.Errorf("history of %s: %d events, first %v", ids[0], len(evs), evs)
			}
			st := b.engine.Stats()
			st2 := second.Stats()
			t.Logf("engines: %d + %d transitions, %d + %d outboxes published again, %d + %d conflicts",
				st.Transitions, st2.Transitions, st.HistoryRepublished, st2.HistoryRepublished, st.CASConflicts, st2.CASConflicts)
		})
	}
}

// TestBulkyOutboxIsPublishedAtOnce: a job's input of 1 KiB is published
// with the transition that started the job, so no later checkpoint
// carries it again, and the history still holds it once.
func TestBulkyOutboxIsPublishedAtOnce(t *testing.T) {
	t.Parallel()
	var carried sync.Map // job → the checkpoint that carried the input again
	onWrite := func(cp *schemas.Checkpoint) {
		for _, ev := range cp.Events {
			if ev.Type == schemas.EventJobStarted && ev.Data.Seq < cp.Seq {
				carried.Store(cp.JobID, fmt.Sprintf("seq %d carries job.started of seq %d", cp.Seq, ev.Data.Seq))
			}
		}
	}
	b := setup(t, setupOptions{engine: Config{HistoryBatch: 8, OnWrite: onWrite}})
	b.worker(echo)
	def := b.define(fiveSteps)
	input := `{"notes": "` + strings.Repeat("n", 1024) + `"}`
	small := b.start(def, `{}`, "small")
	big := b.start(def, input, "big")
	for _, id := range []string{small, big} {
		if v := b.wait(id); v.Status != schemas.JobCompleted {
			t.Fatalf("job %s: %s", id, v.Status)
		}
	}
	if v, ok := carried.Load(big); ok {
		t.Errorf("job %s: %s", big, v)
	}
	if _, ok := carried.Load(small); !ok {
		t.Errorf("job %s: a small input was published at once too; want it batched", small)
	}
	evs, err := b.client.History(context.Background(), big)
	if err != nil {
		t.Fatal(err)
	}
	started := 0
	for _, ev := range evs {
		if ev.Type == schemas.EventJobStarted {
			started++
			if !bytes.Equal(compactJSON(t, ev.Data.Input), compactJSON(t, []byte(input))) {
				t.Errorf("job.started input = %.80s..., want the job's input", ev.Data.Input)
			}
		}
	}
	if started != 1 {
		t.Errorf("history of %s holds %d job.started events, want 1", big, started)
	}
}

func compactJSON(t *testing.T, b []byte) []byte {
	t.Helper()
	var out bytes.Buffer
	if err := json.Compact(&out, b); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

// TestIndexFollowsCrashesBetweenWrites: the job index is kept consistent
// with the checkpoints through a crash between the two writes that create
// a job and between the two that end it.
func TestIndexFollowsCrashesBetweenWrites(t *testing.T) {
	t.Parallel()
	var clock atomic.Int64
	clock.Store(time.Now().UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()) }
	b := setup(t, setupOptions{engine: Config{Now: now, OrphanGrace: time.Minute}})
	ctx := context.Background()
	def := b.define(fiveSteps)
	if err := b.store.Definitions.Put(ctx, def); err != nil {
		t.Fatal(err)
	}

	// A client died after writing the index entry, before the checkpoint.
	orphan := schemas.NewPendingCheckpoint(def, &schemas.StartRequest{JobID: "orphan"}, json.RawMessage(`{}`), "x", now())
	rev, err := b.store.Jobs.CreateActive(ctx, orphan)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.engine.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Jobs.Get(ctx, kv.ActiveKey("five", "orphan")); err != nil {
		t.Fatalf("an entry younger than the grace was removed: %v", err)
	}
	clock.Add(int64(2 * time.Minute))
	if err := b.engine.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Jobs.Get(ctx, kv.ActiveKey("five", "orphan")); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("orphan entry (revision %d) after the grace: %v, want it removed", rev, err)
	}
	// The same id can be started afterwards.
	b.worker(echo)
	if v := b.wait(b.start(def, `{}`, "orphan")); v.Status != schemas.JobCompleted {
		t.Fatalf("job started again: %s", v.Status)
	}

	// An engine died after writing a terminal checkpoint, before it
	// published its events and moved the index entry: a job that ended but
	// is still indexed as active, whose last events are nowhere else.
	id := b.start(def, `{}`, "cut")
	b.wait(id)
	ent, err := b.store.Checkpoints.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	var ended kv.IndexEntry
	testsupport.Eventually(t, 10*time.Second, func() bool {
		// The index moves after the terminal checkpoint, off the lane: the
		// ended entry is written, then the active one purged.
		ended, err = b.store.Jobs.Get(ctx, kv.EndedKey(schemas.JobCompleted, "five", id))
		_, aerr := b.store.Jobs.Get(ctx, kv.ActiveKey("five", id))
		return err == nil && errors.Is(aerr, schemas.ErrNotFound)
	}, "the index never moved to the ended entry: %v", err)
	if err := b.store.Jobs.Remove(ctx, ended.Key, ended.Revision); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Jobs.CreateActive(ctx, ent.Checkpoint); err != nil {
		t.Fatal(err)
	}
	cp := ent.Checkpoint
	cp.Seq++
	cp.Events = []schemas.Event{{Type: schemas.EventJobCompleted, Time: now(), Data: schemas.HistoryData{Job: id, Seq: cp.Seq, Status: "completed"}}}
	if _, err := b.store.Checkpoints.Update(ctx, cp, ent.Revision); err != nil {
		t.Fatal(err)
	}
	if err := b.engine.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.store.Jobs.Get(ctx, kv.ActiveKey("five", id)); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("active entry of a finished job: %v, want it removed", err)
	}
	if _, err := b.store.Jobs.Get(ctx, kv.EndedKey(schemas.JobCompleted, "five", id)); err != nil {
		t.Errorf("ended entry: %v", err)
	}
	if seq, err := b.store.History.LastSeq(ctx, id); err != nil || seq != cp.Seq {
		t.Errorf("last history sequence %d (%v), want the final %d published", seq, err, cp.Seq)
	}
	if b.engine.Stats().IndexRepaired < 2 {
		t.Errorf("index repairs = %d, want at least 2", b.engine.Stats().IndexRepaired)
	}
}

// TestConflictingStartLeavesOneIndexEntry: starting a taken id with
// another workflow or another version is refused and leaves the job
// indexed once; an entry such a start left behind (its client died) is
// removed by the reconciler once, not on every pass.
func TestConflictingStartLeavesOneIndexEntry(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	ctx := context.Background()
	def := b.define(fiveSteps)
	other := b.define(strings.Replace(fiveSteps, "name: five", "name: other", 1))
	newer := b.define(strings.Replace(fiveSteps, "version: 1", "version: 2", 1))
	id := "taken"
	entries := func() []string {
		var keys []string
		for _, f := range []func(context.Context, func(kv.IndexEntry) bool) error{b.store.Jobs.Active, b.store.Jobs.Ended} {
			if err := f(ctx, func(ie kv.IndexEntry) bool {
				if ie.Job == id {
					keys = append(keys, ie.Key)
				}
				return true
			}); err != nil {
				t.Fatal(err)
			}
		}
		return keys
	}
	b.start(def, `{}`, id)
	b.wait(id)
	ended := kv.EndedKey(schemas.JobCompleted, "five", id)
	// The ended entry follows the terminal checkpoint, and the active one is
	// purged after it: wait for both before the conflicting starts.
	testsupport.Eventually(t, 10*time.Second, func() bool {
		got := entries()
		return len(got) == 1 && got[0] == ended
	}, "the finished job's index entries never settled")
	for _, d := range []*schemas.Definition{other, newer, other} {
		if _, err := b.client.Start(ctx, d, json.RawMessage(`{}`), client.StartOptions{JobID: id}); !errors.Is(err, schemas.ErrConflict) {
			t.Fatalf("start %s with %s v%d: %v, want a conflict", id, d.Name, d.Version, err)
		}
	}
	if got := entries(); len(got) != 1 || got[0] != ended {
		t.Fatalf("index entries of %s: %v, want only its ended entry", id, got)
	}
	page, err := b.client.List(ctx, client.ListFilter{Workflow: "other"})
	if err != nil || len(page.Jobs) != 0 {
		t.Fatalf("jobs of workflow other: %+v, %v; want none", page.Jobs, err)
	}

	// The entry a dead client left: removed by one pass, then left alone.
	if _, err := b.store.Jobs.CreateActive(ctx, &schemas.Checkpoint{JobID: id, Workflow: "other", Version: 1, CreatedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := b.engine.Reconcile(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := entries(); len(got) != 1 {
		t.Errorf("index entries of %s after the reconciler: %v, want one", id, got)
	}
	if n := b.engine.Stats().IndexRepaired; n != 1 {
		t.Errorf("index repairs = %d, want 1", n)
	}
}

// TestListPagesNewestFirst: a listing returns every job once, newest first,
// page by page, and filters by status and workflow.
func TestListPagesNewestFirst(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	five, three := b.define(fiveSteps), b.define(threeSteps)
	// Jobs of a pool no worker serves stay running.
	idle := b.define("name: idle\nversion: 1\nsteps:\n  - {id: a, kind: noop, pool: idle}\n")
	ctx := context.Background()
	var done []string
	for i := range 12 {
		def, input := five, `{}`
		if i%3 == 0 {
			def, input = three, `{"n": 1}`
		}
		id := b.start(def, input, fmt.Sprintf("done-%02d", i))
		b.wait(id)
		// Indexed as finished before the next one starts: the index is
		// written just after the final checkpoint, off the lane.
		testsupport.Eventually(t, 10*time.Second, func() bool {
			_, err := b.store.Jobs.Get(ctx, kv.EndedKey(schemas.JobCompleted, def.Name, id))
			return err == nil
		}, "job %s never indexed as completed", id)
		done = append(done, id)
	}
	var running []string
	for i := range 5 {
		id := b.start(idle, `{}`, fmt.Sprintf("run-%d", i))
		running = append(running, id)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		page, err := b.client.List(ctx, client.ListFilter{Status: schemas.JobRunning})
		return err == nil && len(page.Jobs) == len(running)
	}, "running jobs never listed")

	var all []string
	cursor := ""
	for pages := 0; ; pages++ {
		page, err := b.client.List(ctx, client.ListFilter{Limit: 4, After: cursor})
		if err != nil {
			t.Fatal(err)
		}
		for _, j := range page.Jobs {
			all = append(all, j.ID)
		}
		if page.Cursor == "" {
			break
		}
		if pages > 10 {
			t.Fatal("listing does not end")
		}
		cursor = page.Cursor
	}
	want := append(slices.Clone(running), done...)
	slices.Reverse(want[:len(running)])
	slices.Reverse(want[len(running):])
	if fmt.Sprint(all) != fmt.Sprint(want) {
		t.Errorf("pages = %v\nwant    %v (running newest first, then finished newest first)", all, want)
	}

	page, err := b.client.List(ctx, client.ListFilter{Status: schemas.JobCompleted, Workflow: "three"})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, j := range page.Jobs {
		got = append(got, j.ID)
		if j.Status != schemas.JobCompleted || j.Workflow != "three" {
			t.Errorf("filtered listing holds %+v", j)
		}
	}
	if fmt.Sprint(got) != "[done-09 done-06 done-03 done-00]" {
		t.Errorf("completed jobs of three = %v", got)
	}
	if _, err := b.client.List(ctx, client.ListFilter{After: "bogus"}); !errors.Is(err, schemas.ErrInputInvalid) {
		t.Errorf("bad cursor: %v, want ErrInputInvalid", err)
	}

	// A job that finishes between two pages is listed once all the same.
	first, err := b.client.List(ctx, client.ListFilter{Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	b.publishResultFor(t, "run-4")
	rest, err := b.client.List(ctx, client.ListFilter{Limit: 100, After: first.Cursor})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, j := range append(first.Jobs, rest.Jobs...) {
		seen[j.ID]++
	}
	for id, n := range seen {
		if n != 1 {
			t.Errorf("job %s listed %d times across the pages", id, n)
		}
	}
}

// TestListingWhileJobsFinish: a listing walked page by page while jobs
// finish (below and above the cursor) and new jobs start returns every job
// that existed when it began exactly once, and none created since.
func TestListingWhileJobsFinish(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	idle := b.define("name: idle\nversion: 1\nsteps:\n  - {id: a, kind: noop, pool: idle}\n")
	ctx := context.Background()
	var before []string
	for i := range 30 {
		before = append(before, b.start(idle, `{}`, fmt.Sprintf("w-%02d", i)))
	}
	for _, id := range before {
		testsupport.Eventually(t, 10*time.Second, func() bool {
			ent, err := b.store.Checkpoints.Get(ctx, id)
			return err == nil && ent.Checkpoint.Current != nil
		}, "job %s never dispatched", id)
	}
	finish := func(id string) {
		b.publishResultFor(t, id)
		testsupport.Eventually(t, 10*time.Second, func() bool {
			_, err := b.store.Jobs.Get(ctx, kv.EndedKey(schemas.JobCompleted, "idle", id))
			return err == nil
		}, "job %s never indexed as completed", id)
	}
	seen := map[string]int{}
	finished := map[string]bool{}
	cursor := ""
	for pages := 0; ; pages++ {
		page, err := b.client.List(ctx, client.ListFilter{Limit: 4, After: cursor})
		if err != nil {
			t.Fatal(err)
		}
		for _, j := range page.Jobs {
			seen[j.ID]++
		}
		if page.Cursor == "" {
			break
		}
		if pages > 20 {
			t.Fatal("listing does not end")
		}
		cursor = page.Cursor
		// Finish the two oldest jobs not yet listed and one listed, and
		// start a new one.
		n := 0
		for _, id := range before {
			if seen[id] == 0 && !finished[id] && n < 2 {
				finish(id)
				finished[id] = true
				n++
			}
		}
		for _, j := range page.Jobs {
			if !finished[j.ID] {
				finish(j.ID)
				finished[j.ID] = true
				break
			}
		}
		b.start(idle, `{}`, fmt.Sprintf("new-%02d", pages))
	}
	for _, id := range before {
		if seen[id] != 1 {
			t.Errorf("job %s listed %d times, want once", id, seen[id])
		}
	}
	for id := range seen {
		if strings.HasPrefix(id, "new-") {
			t.Errorf("job %s, started after the listing began, was listed", id)
		}
	}
	if len(finished) < 10 {
		t.Fatalf("only %d jobs finished during the walk", len(finished))
	}
	if _, err := b.client.List(ctx, client.ListFilter{After: "99999999.99999999"}); !errors.Is(err, schemas.ErrInputInvalid) {
		t.Errorf("cursor beyond the index: %v, want ErrInputInvalid", err)
	}
	if _, err := b.client.List(ctx, client.ListFilter{Workflow: "*"}); !errors.Is(err, schemas.ErrInputInvalid) {
		t.Errorf("workflow '*': %v, want ErrInputInvalid", err)
	}
}

// publishResultFor completes job's current step (whatever it is) and
// waits until the job has moved on.
func (b *bundle) publishResultFor(t *testing.T, job string) {
	t.Helper()
	ent, err := b.store.Checkpoints.Get(context.Background(), job)
	if err != nil || ent.Checkpoint.Current == nil {
		t.Fatalf("job %s has no current step: %v", job, err)
	}
	cur := ent.Checkpoint.Current
	b.publishResult(&schemas.StepResult{Job: job, Step: cur.Step, Attempt: cur.Attempt, Output: json.RawMessage(`{}`)})
	testsupport.Eventually(t, 10*time.Second, func() bool {
		e, err := b.store.Checkpoints.Get(context.Background(), job)
		return err == nil && e.Checkpoint.Seq > ent.Checkpoint.Seq
	}, "job %s never moved on", job)
}

// TestLostAttemptIsFoundWhileThePoolHasABacklog: the reconciler decides
// from facts about each job's step message, so a pool whose queue is busy
// (or has no worker) does not hide a message that was lost.
func TestLostAttemptIsFoundWhileThePoolHasABacklog(t *testing.T) {
	t.Parallel()
	var clock atomic.Int64
	clock.Store(time.Now().UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()) }
	b := setup(t, setupOptions{engine: Config{Now: now, StallGrace: time.Second}})
	def := b.define(`
name: backlog
version: 1
steps:
  - {id: a, kind: noop, timeout: 1s, pool: busy}
`)
	ctx := context.Background()
	queued := b.start(def, `{}`, "queued")
	lost := b.start(def, `{}`, "lost")
	for _, id := range []string{queued, lost} {
		testsupport.Eventually(t, 10*time.Second, func() bool {
			ent, err := b.store.Checkpoints.Get(ctx, id)
			if err != nil || ent.Checkpoint.Current == nil {
				return false
			}
			_, ok, err := b.store.Queues.StepQueued(ctx, "busy", id)
			return err == nil && ok
		}, "job %s never dispatched", id)
	}
	s, _ := b.store.JS.Stream(ctx, b.store.Names.WorkStream)
	if err := s.Purge(ctx, jetstream.WithPurgeSubject(b.store.Names.WorkSubject("busy", lost))); err != nil {
		t.Fatal(err)
	}
	// Past the attempt's deadline (timeout + 2 x ack wait + grace), well
	// before its message's last possible delivery.
	clock.Add(int64(30 * time.Second))
	if err := b.engine.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	st := b.engine.Stats()
	if st.AttemptsLost != 1 || st.StepsWaitingForWorkers != 1 {
		t.Fatalf("lost %d, waiting %d; want the purged one lost and the queued one waiting", st.AttemptsLost, st.StepsWaitingForWorkers)
	}
	for id, want := range map[string]int{queued: 1, lost: 2} {
		ent, _ := b.store.Checkpoints.Get(ctx, id)
		if cur := ent.Checkpoint.Current; cur == nil || cur.Attempt != want {
			t.Errorf("job %s: current %+v, want attempt %d", id, cur, want)
		}
	}
	// Past every delivery the pool could still make of it (max deliver x
	// (timeout + ack wait)), a queued message is a dead letter: its step
	// fails with the reason, and the message goes.
	clock.Add(int64(2 * time.Minute))
	if err := b.engine.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	v := b.wait(queued)
	if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, "poison step") {
		t.Fatalf("the never-delivered job: %s (%v), want failed as a poison step", v.Status, v.Error)
	}
	if _, ok, err := b.store.Queues.StepQueued(ctx, "busy", queued); ok || err != nil {
		t.Errorf("the dead letter is still queued (%v)", err)
	}
}

// TestLostResolutionSignalIsFoundByTheReconciler: a job waiting on an
// effect that was resolved while the signal was lost goes on at the next
// reconcile pass, without any queue having been lost.
func TestLostResolutionSignalIsFoundByTheReconciler(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	var calls atomic.Int64
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if calls.Add(1) == 1 {
			return nil, &schemas.Error{Code: schemas.CodeAmbiguous, Message: "unknown outcome"}
		}
		return echo(sm)
	})
	def := b.define(`
name: signal
version: 1
steps:
  - {id: send, kind: noop, effect: unsafe}
`)
	ctx := context.Background()
	id := b.start(def, `{}`, "signal")
	v := b.wait(id)
	if v.Status != schemas.JobNeedsReconciliation || v.Blocked == nil {
		t.Fatalf("status %s, blocked %+v", v.Status, v.Blocked)
	}
	// Resolved in the ledger, but the signal never sent.
	happened := true
	now := time.Now().UTC()
	rec := &schemas.EffectRecord{Key: v.Blocked.EffectKey, Job: id, Step: "send", Class: schemas.EffectUnsafe, State: schemas.EffectReconciled,
		Happened: &happened, ReconciledBy: "ops", Result: json.RawMessage(`{}`), PreparedAt: now, UpdatedAt: now}
	if _, err := b.store.Effects.Create(ctx, rec); err != nil {
		t.Fatal(err)
	}
	if err := b.engine.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err := b.client.Job(ctx, id)
		return err == nil && v.Status == schemas.JobCompleted
	}, "the job never went on")
}

// TestMissingDefinitionBlocksTheJobUntilStoredAgain: a job whose pinned
// definition cannot be loaded stops in blocked, with the reason in its
// status and history, and goes on by itself once the definition is back.
func TestMissingDefinitionBlocksTheJobUntilStoredAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	b.worker(echo)
	def := b.define(fiveSteps)
	ctx := context.Background()
	id := b.start(def, `{}`, "orphaned")
	// The definition goes away before any engine loads it.
	defs, err := b.store.JS.KeyValue(ctx, b.store.Names.DefinitionBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := defs.Purge(ctx, def.Hash); err != nil {
		t.Fatal(err)
	}
	// An engine of its own (a process started after the definition went):
	// its store has never read the definition.
	e := b.runEngine(Config{Store: b.srv.Store(t, kv.Config{InboxAckWait: 2 * time.Second, WorkAckWait: 2 * time.Second})})
	var v *client.JobView
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err = b.client.Job(ctx, id)
		return err == nil && v.Status == schemas.JobBlocked
	}, "the job never blocked")
	want := "definition " + def.Hash + " not found"
	if v.BlockedReason != want {
		t.Errorf("blocked reason %q, want %q", v.BlockedReason, want)
	}
	// Counted when the transition's messages are settled, after the write.
	testsupport.Eventually(t, 10*time.Second, func() bool { return e.Stats().DefinitionBlocked == 1 },
		"definition blocked = %d, want 1", e.Stats().DefinitionBlocked)
	evs, err := b.client.History(ctx, id)
	if err != nil || !slices.ContainsFunc(evs, func(h schemas.HistoryEvent) bool {
		return h.Type == schemas.EventJobBlocked && h.Data.Reason == want
	}) {
		t.Errorf("history %v (%v) has no job.blocked saying %q", evs, err, want)
	}
	// Stored again (by any client): the kept start request applies.
	if err := b.store.Definitions.Put(ctx, def); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		v, err = b.client.Job(ctx, id)
		return err == nil && v.Status == schemas.JobCompleted
	}, "the job never went on after its definition came back: %+v", v)
}

// TestInconsistentCheckpointIsQuarantined: a checkpoint that decodes but
// could not have been written by an engine (a current dispatch without its
// step record) holds its job's messages back; the engine neither panics
// nor stops serving other jobs.
func TestInconsistentCheckpointIsQuarantined(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	def := b.define(fiveSteps)
	ctx := context.Background()
	id := b.start(def, `{}`, "broken")
	var ent kv.Entry
	testsupport.Eventually(t, 10*time.Second, func() bool {
		var err error
		ent, err = b.store.Checkpoints.Get(ctx, id)
		return err == nil && ent.Checkpoint.Current != nil
	}, "job never started")
	cp := ent.Checkpoint
	cur := *cp.Current
	delete(cp.Steps, cur.Step)
	cp.Seq++
	if _, err := b.store.Checkpoints.Update(ctx, cp, ent.Revision); err != nil {
		t.Fatal(err)
	}
	b.publishResult(&schemas.StepResult{Job: id, Step: cur.Step, Attempt: cur.Attempt, Output: json.RawMessage(`{}`)})
	testsupport.Eventually(t, 10*time.Second, func() bool { return b.engine.Stats().Quarantined > 0 }, "never quarantined")
	after, err := b.store.Checkpoints.Get(ctx, id)
	if err != nil || after.Revision == ent.Revision || after.Checkpoint.Seq != cp.Seq {
		t.Errorf("the quarantined checkpoint changed: %+v %v", after, err)
	}
	b.worker(echo)
	if v := b.wait(b.start(def, `{}`, "healthy")); v.Status != schemas.JobCompleted {
		t.Fatalf("another job: %s", v.Status)
	}
}

// TestPanicInADecisionIsContained: a panic while deciding one job's
// transition is logged and counted, its messages come back later, and the
// engine goes on with other jobs.
func TestPanicInADecisionIsContained(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	b.worker(echo)
	var armed atomic.Bool
	armed.Store(true)
	e := b.runEngine(Config{beforeDecide: func(job string) {
		if job == "boom" && armed.Load() {
			panic("injected")
		}
	}})
	def := b.define(fiveSteps)
	boom := b.start(def, `{}`, "boom")
	if v := b.wait(b.start(def, `{}`, "calm")); v.Status != schemas.JobCompleted {
		t.Fatalf("calm job: %s", v.Status)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool { return e.Stats().Panics > 0 }, "no panic counted")
	armed.Store(false)
	if v := b.wait(boom); v.Status != schemas.JobCompleted {
		t.Fatalf("the job whose decision panicked: %s", v.Status)
	}
}

// TestCleanRestartIsNoResume: with SoleEngine (the embedded server), a job
// a new engine process takes over from one that stopped cleanly is not
// resumed; from one that left no record of a clean stop (killed), it is.
func TestCleanRestartIsNoResume(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	ctx := context.Background()
	run := func() func() { return b.runSoleEngine() }
	// Two steps on a pool no worker serves: the test answers them.
	def := b.define("name: two\nversion: 1\nsteps:\n  - {id: a, kind: noop, pool: idle, next: [{to: b}]}\n  - {id: b, kind: noop, pool: idle}\n")
	waitStep := func(id, step string) {
		testsupport.Eventually(t, 10*time.Second, func() bool {
			ent, err := b.store.Checkpoints.Get(ctx, id)
			return err == nil && ent.Checkpoint.Current != nil && ent.Checkpoint.Current.Step == step
		}, "job %s never dispatched %s", id, step)
	}
	resumes := func(id string) int {
		ent, err := b.store.Checkpoints.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return ent.Checkpoint.ResumeCount
	}

	stop := run()
	clean := b.start(def, `{}`, "clean")
	killed := b.start(def, `{}`, "killed")
	waitStep(clean, "a")
	waitStep(killed, "a")
	stop()
	stop = run()
	b.publishResultFor(t, clean)
	waitStep(clean, "b")
	if n := resumes(clean); n != 0 {
		t.Errorf("after a clean restart: resume_count %d, want 0", n)
	}
	stop()
	// The next stop leaves no record, as a killed process would not.
	defs, err := b.store.JS.KeyValue(ctx, b.store.Names.DefinitionBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := defs.Purge(ctx, "meta.clean_stops"); err != nil {
		t.Fatal(err)
	}
	run()
	b.publishResultFor(t, killed)
	waitStep(killed, "b")
	if n := resumes(killed); n != 1 {
		t.Errorf("after a takeover from a process that did not stop cleanly: resume_count %d, want 1", n)
	}
}

// TestCleanStopWhileBusy stops an engine (its context ends, as on
// SIGTERM) while jobs stream through it, and starts another: the batches
// the first had in hand are finished, never left
// to the inbox ack wait (a minute here), and no job counts a resume.
func TestCleanStopWhileBusy(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true, kv: kv.Config{InboxAckWait: time.Minute}})
	ctx := context.Background()
	run := func() func() { return b.runSoleEngine() }
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`{}`), nil })
	def := b.define(testsupport.NoopChain("long", 200))
	stop := run()
	var ids []string
	for i := range 10 {
		ids = append(ids, b.start(def, `{}`, fmt.Sprintf("busy-%d", i)))
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		ent, err := b.store.Checkpoints.Get(ctx, ids[len(ids)-1])
		return err == nil && ent.Checkpoint.Seq > 20
	}, "jobs never got going")
	stop()
	run()
	for _, id := range ids {
		testsupport.Eventually(t, 30*time.Second, func() bool {
			ent, err := b.store.Checkpoints.Get(ctx, id)
			return err == nil && ent.Checkpoint.Status == schemas.JobCompleted
		}, "job %s did not complete within 30s of the restart (messages left to the ack wait?)", id)
		ent, _ := b.store.Checkpoints.Get(ctx, id)
		if n := ent.Checkpoint.ResumeCount; n != 0 {
			t.Errorf("job %s: resume_count %d after a clean stop, want 0", id, n)
		}
	}
}

// runSoleEngine runs an engine process's worth of engine (SoleEngine, as
// with the embedded server) on b's store until the returned stop, or the
// end of the test.
func (b *bundle) runSoleEngine() (stop func()) {
	t := b.t
	e, err := New(Config{Store: b.store, SoleEngine: true, ReconcileInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := e.Run(ctx); err != nil {
			t.Errorf("engine run: %v", err)
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// TestSoleEngineTakesBackDeliveries: inbox messages delivered to an
// earlier engine process and never acknowledged (it stopped or died with
// them in hand) are taken back by the next sole engine at once, not after
// the inbox ack wait (a minute here).
func TestSoleEngineTakesBackDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true, kv: kv.Config{InboxAckWait: time.Minute}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	def := b.define("name: one\nversion: 1\nsteps:\n  - {id: a, kind: noop, pool: idle}\n")
	id := b.start(def, `{}`, "held")
	// The earlier process: it takes the start request and never answers.
	cons, err := b.store.EngineConsumer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for range batch.Messages() {
		n++
	}
	if n != 1 {
		t.Fatalf("fetched %d start requests, want 1", n)
	}
	b.runSoleEngine()
	testsupport.Eventually(t, 10*time.Second, func() bool {
		ent, err := b.store.Checkpoints.Get(ctx, id)
		return err == nil && ent.Checkpoint.Status == schemas.JobRunning && ent.Checkpoint.Current != nil
	}, "the job was not started within 10s: its start request waits out the inbox ack wait")
}
