package kv_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// TestReplicatedRevisionConflicts opens the layout with three replicas on
// a three-node cluster and checks that a compare-and-swap with a wrong
// revision is a conflict (schemas.ErrConflict) in both stores that write
// by compare-and-swap: checkpoints and effect records. A replicated
// stream answers a stale revision with 10071 ("wrong last sequence: N"),
// as a single-replica one does, but a write to a key whose previous write
// is still being replicated with 10164 (a constant "wrong last sequence"):
// the answer racing writers get on a cluster. A store that knew only the
// first would take a lost race for an unknown outcome. Racing writers must
// see exactly one winner per revision and a conflict for every other.
func TestReplicatedRevisionConflicts(t *testing.T) {
	t.Parallel()
	c := testsupport.StartCluster(t, 3)
	st := c.Store(t, kv.Config{Replicas: 3})
	js, err := jetstream.New(c.Conn(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, bucket := range []string{st.Names.CheckpointBucket, st.Names.EffectBucket} {
		kvb, err := js.KeyValue(ctx(t), bucket)
		if err != nil {
			t.Fatal(err)
		}
		s, err := kvb.Status(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if r := s.(*jetstream.KeyValueBucketStatus).StreamInfo().Config.Replicas; r != 3 {
			t.Fatalf("bucket %s has %d replicas; want 3", bucket, r)
		}
	}
	const rounds, racers = 20, 8

	t.Run("checkpoints", func(t *testing.T) {
		cps := st.Checkpoints
		rev1, err := cps.Create(ctx(t), checkpoint("r3-job", 1))
		if err != nil {
			t.Fatalf("Create: %v", err)
		}
		if _, err := cps.Create(ctx(t), checkpoint("r3-job", 1)); !errors.Is(err, schemas.ErrConflict) {
			t.Errorf("second Create on R3 = %v; want ErrConflict", err)
		}
		rev, err := cps.Update(ctx(t), checkpoint("r3-job", 2), rev1)
		if err != nil {
			t.Fatalf("Update: %v", err)
		}
		if _, err := cps.Update(ctx(t), checkpoint("r3-job", 2), rev1); !errors.Is(err, schemas.ErrConflict) {
			t.Errorf("Update at the old revision on R3 = %v; want ErrConflict", err)
		}
		if _, err := cps.Update(ctx(t), checkpoint("r3-job", 2), rev+100); !errors.Is(err, schemas.ErrConflict) {
			t.Errorf("Update at a revision from the future on R3 = %v; want ErrConflict", err)
		}

		// Racing writers: the engine's asynchronous path, all writes of a
		// round in flight at once, each expecting the same revision.
		codes := map[int]int{}
		seq := uint64(2)
		for round := range rounds {
			seq++
			var ws []*kv.PendingWrite
			for range racers {
				w, err := cps.WriteAsync(checkpoint("r3-job", seq), rev)
				if err != nil {
					t.Fatal(err)
				}
				ws = append(ws, w)
			}
			won := 0
			for i, w := range ws {
				r, err := w.Wait(ctx(t))
				switch {
				case err == nil:
					won++
					rev = r
				case errors.Is(err, schemas.ErrConflict):
					codes[apiCode(err)]++
				default:
					t.Fatalf("round %d, writer %d: %v; want success or ErrConflict", round, i, err)
				}
			}
			if won != 1 {
				t.Fatalf("round %d: %d of %d writers at revision %d won; want exactly one", round, won, racers, rev)
			}
		}
		e, err := cps.Get(ctx(t), "r3-job")
		if err != nil {
			t.Fatal(err)
		}
		if e.Revision != rev || e.Checkpoint.Seq != seq {
			t.Errorf("after the races: revision %d seq %d; want revision %d seq %d", e.Revision, e.Checkpoint.Seq, rev, seq)
		}
		checkCodes(t, codes)
	})

	t.Run("effects", func(t *testing.T) {
		eff := st.Effects
		rec := &schemas.EffectRecord{Key: "r3-job/charge", Job: "r3-job", Step: "charge",
			Class: schemas.EffectIdempotent, State: schemas.EffectPrepared, Attempt: 1, Delivery: 1}
		rev1, err := eff.Create(ctx(t), rec)
		if err != nil {
			t.Fatalf("Create: %v", err)
		}
		if _, err := eff.Create(ctx(t), rec); !errors.Is(err, schemas.ErrConflict) {
			t.Errorf("second Create on R3 = %v; want ErrConflict", err)
		}
		next := *rec
		next.State = schemas.EffectDispatched
		rev, err := eff.Update(ctx(t), &next, rev1)
		if err != nil {
			t.Fatalf("Update: %v", err)
		}
		stale := *rec
		stale.State = schemas.EffectConfirmed
		if _, err := eff.Update(ctx(t), &stale, rev1); !errors.Is(err, schemas.ErrConflict) {
			t.Errorf("Update at the old revision on R3 = %v; want ErrConflict", err)
		}

		codes := map[int]int{}
		for round := range rounds {
			errs := make([]error, racers)
			revs := make([]uint64, racers)
			var wg sync.WaitGroup
			for i := range racers {
				wg.Go(func() {
					r := *rec
					r.Delivery = uint64(round*racers + i + 2)
					revs[i], errs[i] = eff.Update(ctx(t), &r, rev)
				})
			}
			wg.Wait()
			won := 0
			for i, err := range errs {
				switch {
				case err == nil:
					won++
					rev = revs[i]
				case errors.Is(err, schemas.ErrConflict):
					codes[apiCode(err)]++
				default:
					t.Fatalf("round %d, writer %d: %v; want success or ErrConflict", round, i, err)
				}
			}
			if won != 1 {
				t.Fatalf("round %d: %d of %d writers won; want exactly one", round, won, racers)
			}
		}
		got, err := eff.Get(ctx(t), rec.Key)
		if err != nil {
			t.Fatal(err)
		}
		if got.Revision != rev {
			t.Errorf("after the races: revision %d; want %d", got.Revision, rev)
		}
		checkCodes(t, codes)
	})
}

// apiCode returns the JetStream error code behind err, or 0.
func apiCode(err error) int {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return int(apiErr.ErrorCode)
	}
	return 0
}

// checkCodes logs which server answers the conflicts came from, and fails
// unless the replicated one (10164) was among them: without it the test
// no longer exercises what it is about.
func checkCodes(t *testing.T, codes map[int]int) {
	t.Helper()
	t.Logf("conflicts by server error code: %v", codes)
	if codes[int(jetstream.JSErrCodeStreamWrongLastSequenceConstant)] == 0 {
		t.Errorf("no racing write was answered with %d; the race did not reach the replicated path (codes %v)",
			jetstream.JSErrCodeStreamWrongLastSequenceConstant, codes)
	}
}
