package kv_test

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// TestOpenMigratesLayout1: a deployment made by layout 1 (one work subject
// per pool, ledger events on the job's history subject) is brought to
// layout 2 by Open: the work stream is made again with a subject per job,
// and the queue epoch is forgotten so that engines dispatch running jobs
// again from their checkpoints; the history stream keeps its messages and
// gains the effects subject.
func TestOpenMigratesLayout1(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	js := newJS(t, srv)
	c := ctx(t)
	meta := map[string]string{"waymark_layout": "1"}
	for _, sc := range []jetstream.StreamConfig{
		{Name: "WAYMARK_WORK", Subjects: []string{"waymark.work.*"}, Retention: jetstream.WorkQueuePolicy, Duplicates: 2 * time.Minute, Metadata: meta},
		{Name: "WAYMARK_HISTORY", Subjects: []string{"waymark.history.*"}, Retention: jetstream.LimitsPolicy, Duplicates: 2 * time.Minute, Metadata: meta},
	} {
		if _, err := js.CreateStream(c, sc); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := js.Publish(c, "waymark.work.default", []byte("a step of layout 1")); err != nil {
		t.Fatal(err)
	}
	// Two jobs of layout 1, one running and one completed, with no index.
	cps, err := js.CreateKeyValue(c, jetstream.KeyValueConfig{Bucket: "waymark_checkpoints", History: 1, Metadata: meta})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	for _, cp := range []*schemas.Checkpoint{
		{Schema: schemas.CheckpointSchema, JobID: "old-running", Workflow: "w", Version: 1, DefinitionHash: "h", Seq: 3, Status: schemas.JobRunning,
			State: []byte(`{}`), CreatedAt: now, UpdatedAt: now},
		{Schema: schemas.CheckpointSchema, JobID: "old-done", Workflow: "w", Version: 1, DefinitionHash: "h", Seq: 5, Status: schemas.JobCompleted,
			State: []byte(`{}`), CreatedAt: now, UpdatedAt: now, CompletedAt: &now},
	} {
		if _, err := cps.Put(c, cp.JobID, cp.AppendJSON(nil)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := js.Publish(c, "waymark.history.j1", []byte("[]")); err != nil {
		t.Fatal(err)
	}
	st, err := kv.Open(c, js, kv.Config{}, nil)
	if err != nil {
		t.Fatalf("Open over layout 1: %v", err)
	}
	work := streamConfig(t, js, "WAYMARK_WORK")
	if !slices.Equal(work.Subjects, []string{"waymark.work.*.*"}) || work.Metadata["waymark_layout"] != kv.LayoutVersion {
		t.Errorf("work stream after migration: subjects %v, layout %q", work.Subjects, work.Metadata["waymark_layout"])
	}
	ws, _ := js.Stream(c, "WAYMARK_WORK")
	if n := ws.CachedInfo().State.Msgs; n != 0 {
		t.Errorf("work stream holds %d messages of layout 1, want none (they are dispatched again from checkpoints)", n)
	}
	if intact, err := st.QueuesIntact(c); err != nil || intact {
		t.Errorf("QueuesIntact = %v, %v; want false, so that engines dispatch running jobs again", intact, err)
	}
	hist := streamConfig(t, js, "WAYMARK_HISTORY")
	if !slices.Equal(hist.Subjects, []string{"waymark.history.*", "waymark.history.*.effects"}) {
		t.Errorf("history stream subjects %v", hist.Subjects)
	}
	hs, _ := js.Stream(c, "WAYMARK_HISTORY")
	if info, err := hs.Info(c); err != nil || info.State.Msgs != 1 {
		t.Errorf("history stream lost its messages: %+v %v", info, err)
	}
	// The jobs stored before the index existed are in it now.
	if _, err := st.Jobs.Get(c, kv.ActiveKey("w", "old-running")); err != nil {
		t.Errorf("the running job of layout 1 is not indexed as active: %v", err)
	}
	if _, err := st.Jobs.Get(c, kv.EndedKey(schemas.JobCompleted, "w", "old-done")); err != nil {
		t.Errorf("the finished job of layout 1 is not indexed as ended: %v", err)
	}
	// A second Open changes nothing more.
	if _, err := kv.Open(c, js, kv.Config{}, nil); err != nil {
		t.Fatalf("second Open: %v", err)
	}
}
