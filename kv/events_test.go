package kv_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// TestEventRecords: an event's record is created once, keyed by source and
// id; a second create returns the first record and writes nothing; the
// same id from another source is another record.
func TestEventRecords(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	st := srv.Store(t, kv.Config{})
	ctx := context.Background()
	if _, err := st.Events.Get(ctx, "/s", "1"); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("Get of nothing = %v, want not found", err)
	}
	first := &schemas.EventRecord{Source: "/s", ID: "1", Type: "t", ReceivedAt: time.Now().UTC(), Jobs: []schemas.EventJob{{Trigger: "a", Workflow: "w", JobID: "j1"}}}
	if got, created, err := st.Events.Create(ctx, first); err != nil || !created || got != first {
		t.Fatalf("Create = %v, %v, %v", got, created, err)
	}
	second := &schemas.EventRecord{Source: "/s", ID: "1", Type: "t", Jobs: []schemas.EventJob{{Trigger: "a", Workflow: "w", JobID: "j2"}}}
	got, created, err := st.Events.Create(ctx, second)
	if err != nil || created || got.Jobs[0].JobID != "j1" {
		t.Fatalf("second Create = %+v, %v, %v; want the first record", got, created, err)
	}
	if _, created, err := st.Events.Create(ctx, &schemas.EventRecord{Source: "/other", ID: "1"}); err != nil || !created {
		t.Fatalf("same id, other source: %v, %v", created, err)
	}
	rec, err := st.Events.Get(ctx, "/s", "1")
	if err != nil || rec.Jobs[0].JobID != "j1" || rec.Type != "t" {
		t.Fatalf("Get = %+v, %v", rec, err)
	}
}

// TestWorkflowNames: Definitions.Workflows lists each stored workflow once,
// whatever its versions.
func TestWorkflowNames(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	st := srv.Store(t, kv.Config{})
	ctx := context.Background()
	if names, err := st.Definitions.Workflows(ctx); err != nil || len(names) != 0 {
		t.Fatalf("Workflows of an empty bucket = %v, %v", names, err)
	}
	for _, src := range []string{
		"name: a\nversion: 1\nsteps: [{id: s, kind: noop}]\n",
		"name: a\nversion: 2\nsteps: [{id: s, kind: noop}]\n",
		"name: b\nversion: 1\nsteps: [{id: s, kind: noop}]\n",
	} {
		def, err := schemas.Parse("w.yaml", []byte(src), schemas.LoadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Definitions.Put(ctx, def); err != nil {
			t.Fatal(err)
		}
	}
	names, err := st.Definitions.Workflows(ctx)
	slices.Sort(names)
	if err != nil || !slices.Equal(names, []string{"a", "b"}) {
		t.Fatalf("Workflows = %v, %v", names, err)
	}
}
