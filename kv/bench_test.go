package kv_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// BenchmarkCheckpointUpdate measures one compare-and-swap write of a
// checkpoint with a 1 KiB state, waited for (Update) and pipelined
// (WriteAsync, 64 in flight), under both sync policies.
func BenchmarkCheckpointUpdate(b *testing.B) {
	for _, sync := range []string{natsserver.SyncInterval, natsserver.SyncAlways} {
		b.Run(sync, func(b *testing.B) {
			srv := testsupport.StartServer(b, testsupport.ServerOptions{Sync: sync})
			st := srv.Store(b, kv.Config{})
			now := time.Now()
			cp := &schemas.Checkpoint{Schema: schemas.CheckpointSchema, JobID: "bench", Workflow: "w", Version: 1,
				DefinitionHash: strings.Repeat("a", 64), Seq: 1, Status: schemas.JobRunning,
				State: json.RawMessage(`{"payload":"` + strings.Repeat("x", 1024) + `"}`), CreatedAt: now, UpdatedAt: now}
			ctx := context.Background()
			rev, err := st.Checkpoints.Create(ctx, cp)
			if err != nil {
				b.Fatal(err)
			}
			b.Run("update", func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					cp.Seq++
					if rev, err = st.Checkpoints.Update(ctx, cp, rev); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("pipelined-64-jobs", func(b *testing.B) {
				jobs := make([]*schemas.Checkpoint, 64)
				revs := make([]uint64, 64)
				for i := range jobs {
					c := *cp
					c.JobID = "bench-" + strings.Repeat("j", 1) + string(rune('a'+i%26)) + string(rune('a'+i/26))
					jobs[i] = &c
					if revs[i], err = st.Checkpoints.Create(ctx, &c); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportAllocs()
				b.ResetTimer()
				for n := 0; n < b.N; n += len(jobs) {
					ws := make([]*kv.PendingWrite, len(jobs))
					for i, c := range jobs {
						c.Seq++
						if ws[i], err = st.Checkpoints.WriteAsync(c, revs[i]); err != nil {
							b.Fatal(err)
						}
					}
					for i, w := range ws {
						if revs[i], err = w.Wait(ctx); err != nil {
							b.Fatal(err)
						}
					}
				}
			})
		})
	}
}
