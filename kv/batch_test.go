package kv_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// TestGroupCommit writes the checkpoints of many jobs at once through the
// group committer: they travel as atomic batches, each write gets the
// revision the bucket stored it at, and a stale revision in a batch fails
// only its own write (the server refuses the batch, the committer sends
// its writes again one by one).
func TestGroupCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{GroupCommit: true})
	cps := b.store.Checkpoints
	const n = 40
	job := func(i int) string { return fmt.Sprintf("gc-%02d", i) }
	writeAll := func(seq uint64, revs []uint64) ([]uint64, []error) {
		t.Helper()
		got, errs := make([]uint64, n), make([]error, n)
		var ws []*kv.PendingWrite
		for i := range n {
			w, err := cps.WriteAsync(checkpoint(job(i), seq), revs[i])
			if err != nil {
				t.Fatalf("send %d: %v", i, err)
			}
			ws = append(ws, w)
		}
		var wg sync.WaitGroup
		for i, w := range ws {
			wg.Go(func() { got[i], errs[i] = w.Wait(ctx(t)) })
		}
		wg.Wait()
		return got, errs
	}
	check := func(revs []uint64, seq uint64) {
		t.Helper()
		for i, rev := range revs {
			e, err := cps.Get(ctx(t), job(i))
			if err != nil || e.Revision != rev || e.Checkpoint.Seq != seq {
				t.Fatalf("%s: stored revision %d seq %d (%v); the write said revision %d seq %d", job(i), e.Revision, e.Checkpoint.Seq, err, rev, seq)
			}
		}
	}

	revs, errs := writeAll(1, make([]uint64, n))
	for i, err := range errs {
		if err != nil {
			t.Fatalf("create %s: %v", job(i), err)
		}
	}
	check(revs, 1)
	c := cps.GroupCommitCounts()
	if c.Batches == 0 || c.Batched+c.Alone != n || c.Refused != 0 {
		t.Fatalf("after the creates: %+v, want %d writes, some in batches, none refused", c, n)
	}

	// Job 7 was written by another writer meanwhile: its write conflicts,
	// every other one is stored.
	rev7, err := b.store.Checkpoints.Update(ctx(t), checkpoint(job(7), 2), revs[7])
	if err != nil {
		t.Fatal(err)
	}
	before := cps.GroupCommitCounts()
	next, errs := writeAll(2, revs)
	for i, err := range errs {
		switch {
		case i == 7 && !errors.Is(err, schemas.ErrConflict):
			t.Fatalf("%s = %v, want ErrConflict", job(i), err)
		case i != 7 && err != nil:
			t.Fatalf("%s = %v, want stored", job(i), err)
		}
	}
	next[7] = rev7
	check(next, 2)
	if after := cps.GroupCommitCounts(); after.Refused == before.Refused && after.Alone == before.Alone {
		t.Fatalf("counts %+v after %+v: the stale revision went through a batch unrefused", after, before)
	}

	// A create over the key of a removed job (a purge marker) is refused
	// in its batch and written alone over the marker; the other create of
	// the batch is stored.
	if err := cps.Remove(ctx(t), job(3), next[3]); err != nil {
		t.Fatal(err)
	}
	list := []*schemas.Checkpoint{checkpoint(job(3), 1), checkpoint("gc-new", 1)}
	var ws []*kv.PendingWrite
	for _, cp := range list {
		w, err := cps.WriteAsync(cp, 0)
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	for i, w := range ws {
		rev, err := w.Wait(ctx(t))
		e, gerr := cps.Get(ctx(t), list[i].JobID)
		if err != nil || gerr != nil || e.Revision != rev || e.Checkpoint.Seq != 1 {
			t.Fatalf("create %s: revision %d, %v; stored %d, %v", list[i].JobID, rev, err, e.Revision, gerr)
		}
	}
	if _, err := cps.Create(ctx(t), checkpoint("gc-new", 1)); !errors.Is(err, schemas.ErrConflict) {
		t.Fatalf("second create of gc-new = %v, want ErrConflict", err)
	}
}
