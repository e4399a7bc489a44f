package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// An engine killed (SIGKILL) between writing the checkpoint that applied a
// concurrency-limited step's result and releasing the step's slot leaves
// the slot held by a job that no longer runs the step, and the next job
// waiting behind it: the reconciler of the engine started after it frees
// the slot, hands it on, and both jobs complete, each call made once.
func TestCrashBeforeASlotIsReleasedDoesNotLeakIt(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	count := newCounter(t)
	store := srv.Store(t, crashKV)
	bin := testsupport.Binary(t, "engine")
	nats := "--nats-url=" + srv.URL()
	spawn(t, nil, testsupport.Binary(t, "worker"), nats, "--service=count="+count.srv.URL)
	first := spawn(t, []string{"WAYMARK_FAILPOINTS=engine.after_checkpoint=crash/after"}, bin, "serve", nats, "--http=", "--workers=0")

	cl := client.New(store)
	def := loadDef(t, "testdata/one-at-a-time.yaml")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if _, err := cl.Start(ctx, def, json.RawMessage(`{}`), client.StartOptions{JobID: "first"}); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 30*time.Second, func() bool { return count.count("/lock") == 1 }, "the first job's lock was not called")
	if _, err := cl.Start(ctx, def, json.RawMessage(`{}`), client.StartOptions{JobID: "second"}); err != nil {
		t.Fatal(err)
	}
	first.waitKilled(t, 30*time.Second)
	if !strings.Contains(first.errOut.String(), "failpoint engine.after_checkpoint") {
		t.Fatalf("engine died, but not at its failpoint:\n%s", lastLines(first.errOut.String(), 20))
	}
	spawn(t, nil, bin, "serve", nats, "--http=", "--workers=0")
	for _, id := range []string{"first", "second"} {
		v, err := cl.Wait(ctx, id, nil)
		if err != nil {
			t.Fatalf("wait for %s: %v", id, err)
		}
		if v.Status != schemas.JobCompleted {
			t.Fatalf("%s: status %s: %v", id, v.Status, v.Error)
		}
	}
	for _, p := range []string{"/lock", "/after"} {
		if n := count.count(p); n != 2 {
			t.Errorf("%s called %d times, want 2 (once per job)", p, n)
		}
	}
	bucket, err := store.JS.KeyValue(ctx, store.Names.FlowBucket)
	if err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		l, err := bucket.ListKeysFiltered(ctx, "c.>")
		if err != nil {
			return false
		}
		defer func() { _ = l.Stop() }()
		for range l.Keys() {
			return false
		}
		return true
	}, "a slot is left in the flow bucket")
}
