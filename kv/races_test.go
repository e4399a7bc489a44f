package kv_test

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// epochAgrees fails the test unless the queue epoch record and the last
// marker message are the same id, and every store reads the queues as
// intact.
func epochAgrees(t *testing.T, js jetstream.JetStream, stores ...*kv.Store) string {
	t.Helper()
	n := stores[0].Names
	defs, err := js.KeyValue(ctx(t), n.DefinitionBucket)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := defs.Get(ctx(t), "meta.queue_epoch")
	if err != nil {
		t.Fatalf("queue epoch record: %v", err)
	}
	st, err := js.Stream(ctx(t), n.EpochStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(ctx(t), kv.DefaultPrefix+".queue_epoch")
	if err != nil {
		t.Fatalf("queue epoch marker: %v", err)
	}
	if string(rec.Value()) != string(m.Data) {
		t.Fatalf("queue epoch record %q, last marker %q: they disagree", rec.Value(), m.Data)
	}
	for i, s := range stores {
		if ok, err := s.QueuesIntact(ctx(t)); err != nil || !ok {
			t.Fatalf("store %d: QueuesIntact = %v, %v; want true", i, ok, err)
		}
	}
	return string(m.Data)
}

// TestMarkQueuesRace: engines marking the queues at once end with one
// epoch that the marker stream and the record agree on; each loses with
// ErrConflict or wins, and at least one wins.
func TestMarkQueuesRace(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	const engines, rounds = 4, 15
	stores := make([]*kv.Store, engines)
	for i := range stores {
		stores[i] = srv.Store(t, kv.Config{})
	}
	js := newJS(t, srv)
	for round := range rounds {
		start := make(chan struct{})
		errs := make([]error, engines)
		var wg sync.WaitGroup
		for i, s := range stores {
			wg.Go(func() {
				<-start
				errs[i] = s.MarkQueues(ctx(t))
			})
		}
		close(start)
		wg.Wait()
		won := 0
		for i, err := range errs {
			switch {
			case err == nil:
				won++
			case !errors.Is(err, schemas.ErrConflict):
				t.Fatalf("round %d, store %d: MarkQueues = %v; want nil or ErrConflict", round, i, err)
			}
		}
		if won == 0 {
			t.Fatalf("round %d: every MarkQueues lost: %v", round, errs)
		}
		epochAgrees(t, js, stores...)
	}
}

// TestMarkQueuesInterleavings holds each race open at the point where the
// old protocol (publish, then a plain put of one's own id) let the record
// and the stream disagree.
func TestMarkQueuesInterleavings(t *testing.T) {
	t.Parallel()

	t.Run("a later marker lands while the first is unrecorded", func(t *testing.T) {
		t.Parallel()
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		a, b := srv.Store(t, kv.Config{}), srv.Store(t, kv.Config{})
		bDone := make(chan error, 1)
		kv.SetEpochHook(a, func(stage string) {
			if stage == "published" {
				bDone <- b.MarkQueues(ctx(t)) // B reads A's marker and marks after it
			}
		})
		if err := a.MarkQueues(ctx(t)); err != nil {
			t.Fatalf("A: %v", err)
		}
		if err := <-bDone; err != nil {
			t.Fatalf("B: %v", err)
		}
		epochAgrees(t, newJS(t, srv), a, b)
	})

	t.Run("both read the same marker, then publish", func(t *testing.T) {
		t.Parallel()
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		a, b := srv.Store(t, kv.Config{}), srv.Store(t, kv.Config{})
		if err := a.MarkQueues(ctx(t)); err != nil { // an earlier epoch, so both read a marker
			t.Fatal(err)
		}
		var read sync.WaitGroup
		read.Add(2)
		hold := func(stage string) {
			if stage == "read" {
				read.Done()
				read.Wait()
			}
		}
		kv.SetEpochHook(a, hold)
		kv.SetEpochHook(b, hold)
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, s := range []*kv.Store{a, b} {
			wg.Go(func() { errs[i] = s.MarkQueues(ctx(t)) })
		}
		wg.Wait()
		if (errs[0] == nil) == (errs[1] == nil) {
			t.Fatalf("MarkQueues = %v, %v; want one nil and one ErrConflict", errs[0], errs[1])
		}
		for _, err := range errs {
			if err != nil && !errors.Is(err, schemas.ErrConflict) {
				t.Fatalf("loser: %v, want ErrConflict", err)
			}
		}
		epochAgrees(t, newJS(t, srv), a, b)
	})
}

// TestQueueStorageRecordRace: processes opening a fresh deployment at
// once record its queue storage once, never over each other; with
// contradictory settings the losers stop with ErrIncompatible and the
// record, if any, matches the streams.
func TestQueueStorageRecordRace(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		storages []string
	}{
		{"same setting", []string{kv.QueueMemory, kv.QueueMemory, kv.QueueMemory, kv.QueueMemory}},
		{"contradictory settings", []string{kv.QueueMemory, kv.QueueFile, kv.QueueMemory, kv.QueueFile}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := testsupport.StartServer(t, testsupport.ServerOptions{})
			start := make(chan struct{})
			errs := make([]error, len(tc.storages))
			var wg sync.WaitGroup
			for i, storage := range tc.storages {
				js := newJS(t, srv)
				wg.Go(func() {
					<-start
					_, errs[i] = kv.Open(ctx(t), js, kv.Config{QueueStorage: storage}, nil)
				})
			}
			close(start)
			wg.Wait()
			js := newJS(t, srv)
			work := storageName(streamConfig(t, js, kv.NamesFor(kv.DefaultPrefix).WorkStream).Storage)
			for i, err := range errs {
				switch {
				case err == nil && tc.storages[i] != work:
					t.Errorf("Open %d with %s queues succeeded over %s work stream", i, tc.storages[i], work)
				case err != nil && !errors.Is(err, kv.ErrIncompatible):
					t.Errorf("Open %d: %v, want nil or ErrIncompatible", i, err)
				case err != nil && tc.storages[i] == work && tc.name == "same setting":
					t.Errorf("Open %d: %v", i, err)
				}
			}
			defs, err := js.KeyValue(ctx(t), kv.NamesFor(kv.DefaultPrefix).DefinitionBucket)
			if err != nil {
				t.Fatal(err)
			}
			rec, err := defs.Get(ctx(t), "meta.queue_storage")
			switch {
			case errors.Is(err, jetstream.ErrKeyNotFound) && tc.name == "same setting":
				t.Error("no queue storage recorded")
			case err == nil && string(rec.Value()) != work:
				t.Errorf("recorded %q, the work stream is %s", rec.Value(), work)
			}
		})
	}
}

func storageName(s jetstream.StorageType) string {
	if s == jetstream.MemoryStorage {
		return kv.QueueMemory
	}
	return kv.QueueFile
}

// TestQueueStorageRecordFollowsASwitch: after the queue streams were
// deleted to switch storage (README, Durability), the record moves to the
// new storage by compare-and-swap.
func TestQueueStorageRecordFollowsASwitch(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	first := srv.Store(t, kv.Config{QueueStorage: kv.QueueMemory})
	js := newJS(t, srv)
	for _, name := range []string{first.Names.WorkStream, first.Names.InboxStream, first.Names.EpochStream} {
		if err := js.DeleteStream(ctx(t), name); err != nil {
			t.Fatal(err)
		}
	}
	srv.Store(t, kv.Config{QueueStorage: kv.QueueFile})
	if got := srv.Store(t, kv.Config{}).Config.QueueStorage; got != kv.QueueFile {
		t.Errorf("after the switch a process without the setting resolves %q, want file", got)
	}
}

// variant is a definition of name and version whose content (and hash)
// depends on tag.
func variant(t *testing.T, name string, version int, tag string) *schemas.Definition {
	t.Helper()
	src := fmt.Sprintf("name: %s\nversion: %d\nvars: {tag: %q}\nsteps:\n  - id: greet\n    kind: noop\n", name, version, tag)
	def, err := schemas.Parse(name+".yaml", []byte(src), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return def
}

// latestOf reads the workflow's latest definition through a fresh store.
func latestOf(t *testing.T, srv *testsupport.Server, name string) *schemas.Definition {
	t.Helper()
	def, err := srv.Store(t, kv.Config{}).Definitions.Latest(ctx(t), name)
	if err != nil {
		t.Fatal(err)
	}
	return def
}

// TestDefinitionPointer: name.<workflow> names the definition stored
// last, except that a store that lost a race to another keeps a version as
// high as its own: a race never moves the pointer back.
func TestDefinitionPointer(t *testing.T) {
	t.Parallel()

	t.Run("same version: the one stored last", func(t *testing.T) {
		t.Parallel()
		b := setup(t, kv.Config{})
		first, second := variant(t, "flow", 2, "a"), variant(t, "flow", 2, "b")
		for _, d := range []*schemas.Definition{first, second} {
			if err := b.store.Definitions.Put(ctx(t), d); err != nil {
				t.Fatal(err)
			}
		}
		if got := latestOf(t, b.srv, "flow"); got.Hash != second.Hash {
			t.Errorf("latest = %s, want the one stored last (%s)", got.Hash[:12], second.Hash[:12])
		}
	})

	t.Run("a newer version lands between the read and the write", func(t *testing.T) {
		t.Parallel()
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		older, newer := srv.Store(t, kv.Config{}), srv.Store(t, kv.Config{})
		v1, v2, v3 := variant(t, "flow", 1, "a"), variant(t, "flow", 2, "a"), variant(t, "flow", 3, "a")
		if err := older.Definitions.Put(ctx(t), v1); err != nil {
			t.Fatal(err)
		}
		once := sync.Once{}
		kv.SetBeforePointerWrite(older.Definitions, func() {
			// v2's writer read v1; v3 is stored before it writes.
			once.Do(func() {
				if err := newer.Definitions.Put(ctx(t), v3); err != nil {
					t.Errorf("v3: %v", err)
				}
			})
		})
		if err := older.Definitions.Put(ctx(t), v2); err != nil {
			t.Fatal(err)
		}
		if got := latestOf(t, srv, "flow"); got.Hash != v3.Hash {
			t.Errorf("latest = v%d, want v3", got.Version)
		}
	})

	t.Run("an older version lands between the read and the write", func(t *testing.T) {
		t.Parallel()
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		a, b := srv.Store(t, kv.Config{}), srv.Store(t, kv.Config{})
		v1, v2, v3 := variant(t, "flow", 1, "a"), variant(t, "flow", 2, "a"), variant(t, "flow", 3, "a")
		if err := a.Definitions.Put(ctx(t), v1); err != nil {
			t.Fatal(err)
		}
		once := sync.Once{}
		kv.SetBeforePointerWrite(a.Definitions, func() {
			once.Do(func() {
				if err := b.Definitions.Put(ctx(t), v2); err != nil {
					t.Errorf("v2: %v", err)
				}
			})
		})
		if err := a.Definitions.Put(ctx(t), v3); err != nil {
			t.Fatal(err)
		}
		if got := latestOf(t, srv, "flow"); got.Hash != v3.Hash {
			t.Errorf("latest = v%d, want v3 (it lost the race to a lower version, so it moves on)", got.Version)
		}
	})

	t.Run("stores that all read before any writes end at the highest", func(t *testing.T) {
		t.Parallel()
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		const writers = 8
		var arrived atomic.Int32
		var barrier sync.WaitGroup
		barrier.Add(writers)
		hold := func() {
			// Every writer's first read happens before any write.
			if arrived.Add(1) <= writers {
				barrier.Done()
				barrier.Wait()
			}
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range writers {
			d, s := variant(t, "flow", writers-i, "a"), srv.Store(t, kv.Config{})
			kv.SetBeforePointerWrite(s.Definitions, hold)
			wg.Go(func() {
				<-start
				if err := s.Definitions.Put(ctx(t), d); err != nil {
					t.Errorf("Put v%d: %v", d.Version, err)
				}
			})
		}
		close(start)
		wg.Wait()
		if got := latestOf(t, srv, "flow"); got.Version != writers {
			t.Errorf("latest = v%d, want v%d", got.Version, writers)
		}
	})
}

// TestCreateAfterDeleteOrPurge: a key whose value was deleted or purged
// (a retention sweep) can be created again on both stores, through the
// synchronous and the asynchronous path; a live key still conflicts.
func TestCreateAfterDeleteOrPurge(t *testing.T) {
	t.Parallel()
	removals := map[string]func(jetstream.KeyValue, string) error{
		"delete": func(b jetstream.KeyValue, key string) error { return b.Delete(ctx(t), key) },
		"purge":  func(b jetstream.KeyValue, key string) error { return b.Purge(ctx(t), key) },
	}
	for how, remove := range removals {
		t.Run("checkpoint after "+how, func(t *testing.T) {
			t.Parallel()
			b := setup(t, kv.Config{})
			raw := rawBucket(t, b)
			for _, async := range []bool{false, true} {
				job := fmt.Sprintf("job-%v", async)
				if _, err := b.store.Checkpoints.Create(ctx(t), checkpoint(job, 1)); err != nil {
					t.Fatal(err)
				}
				if err := remove(raw, job); err != nil {
					t.Fatal(err)
				}
				var rev uint64
				var err error
				if async {
					var p *kv.PendingWrite
					if p, err = b.store.Checkpoints.WriteAsync(checkpoint(job, 1), 0); err == nil {
						rev, err = p.Wait(ctx(t))
					}
				} else {
					rev, err = b.store.Checkpoints.Create(ctx(t), checkpoint(job, 1))
				}
				if err != nil {
					t.Fatalf("create %s again after %s (async %v): %v", job, how, async, err)
				}
				if e, err := b.store.Checkpoints.Get(ctx(t), job); err != nil || e.Revision != rev {
					t.Fatalf("Get after re-create: %+v, %v; want revision %d", e, err, rev)
				}
				if _, err := b.store.Checkpoints.Create(ctx(t), checkpoint(job, 1)); !errors.Is(err, schemas.ErrConflict) {
					t.Errorf("create over a live checkpoint: %v, want ErrConflict", err)
				}
			}
		})
		t.Run("effect after "+how, func(t *testing.T) {
			t.Parallel()
			b := setup(t, kv.Config{})
			raw, err := b.js.KeyValue(ctx(t), b.store.Names.EffectBucket)
			if err != nil {
				t.Fatal(err)
			}
			r := &schemas.EffectRecord{Key: "job-1/charge", Job: "job-1", Step: "charge", Class: schemas.EffectIdempotent, State: schemas.EffectPrepared, Attempt: 1}
			if _, err := b.store.Effects.Create(ctx(t), r); err != nil {
				t.Fatal(err)
			}
			if err := remove(raw, r.Key); err != nil {
				t.Fatal(err)
			}
			rev, err := b.store.Effects.Create(ctx(t), r)
			if err != nil {
				t.Fatalf("create again after %s: %v", how, err)
			}
			if e, err := b.store.Effects.Get(ctx(t), r.Key); err != nil || e.Revision != rev {
				t.Fatalf("Get after re-create: %+v, %v; want revision %d", e, err, rev)
			}
			if _, err := b.store.Effects.Create(ctx(t), r); !errors.Is(err, schemas.ErrConflict) {
				t.Errorf("create over a live record: %v, want ErrConflict", err)
			}
		})
	}
	t.Run("effect after the store's own Delete", func(t *testing.T) {
		t.Parallel()
		b := setup(t, kv.Config{})
		r := &schemas.EffectRecord{Key: "job-2/charge", Job: "job-2", Step: "charge", Class: schemas.EffectIdempotent, State: schemas.EffectPrepared, Attempt: 1}
		if _, err := b.store.Effects.Create(ctx(t), r); err != nil {
			t.Fatal(err)
		}
		if err := b.store.Effects.Delete(ctx(t), r.Key); err != nil {
			t.Fatal(err)
		}
		if _, err := b.store.Effects.Create(ctx(t), r); err != nil {
			t.Fatalf("create after Delete: %v", err)
		}
	})
}

// TestPageWhileJobsEnd: a listing read while jobs end lists each job once.
// A job that ends between the listing's snapshot and its reads is gone
// from its active place and written past the snapshot; it must be found
// at its old position all the same.
func TestPageWhileJobsEnd(t *testing.T) {
	b := setup(t, kv.Config{})
	const n = 60
	cps := make([]*schemas.Checkpoint, n)
	revs := make([]uint64, n)
	for i := range cps {
		cps[i] = &schemas.Checkpoint{JobID: fmt.Sprintf("j%02d", i), Workflow: "w", Version: 1, Status: schemas.JobRunning, CreatedAt: time.Now()}
		rev, err := b.store.Jobs.CreateActive(ctx(t), cps[i])
		if err != nil {
			t.Fatal(err)
		}
		revs[i] = rev
	}
	done := make(chan error, 1)
	go func() {
		for i, cp := range cps {
			end := *cp
			end.Status = schemas.JobCompleted
			if err := b.store.Jobs.End(ctx(t), &end, revs[i]); err != nil {
				done <- fmt.Errorf("end %s: %w", cp.JobID, err)
				return
			}
		}
		done <- nil
	}()
	for listing := 0; ; listing++ {
		page, _, err := b.store.Jobs.Page(ctx(t), kv.IndexFilter{Workflow: "w"}, 0, 0, 2*n)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]int{}
		for _, e := range page {
			seen[e.Job]++
		}
		for _, cp := range cps {
			if seen[cp.JobID] != 1 {
				t.Fatalf("listing %d: job %s listed %d times (%d entries)", listing, cp.JobID, seen[cp.JobID], len(page))
			}
		}
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			return
		default:
		}
	}
}
