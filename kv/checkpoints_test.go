package kv_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// sameCheckpoint fails the test unless got and want encode the same.
func sameCheckpoint(t *testing.T, got, want *schemas.Checkpoint) {
	t.Helper()
	g, _ := json.Marshal(got)
	w, _ := json.Marshal(want)
	if string(g) != string(w) {
		t.Errorf("checkpoint\n got %s\nwant %s", g, w)
	}
}

// rawBucket opens the checkpoint bucket directly, to write what the store
// never would.
func rawBucket(t *testing.T, b *bundle) jetstream.KeyValue {
	t.Helper()
	bucket, err := b.js.KeyValue(ctx(t), b.store.Names.CheckpointBucket)
	if err != nil {
		t.Fatal(err)
	}
	return bucket
}

func TestCheckpointCreateUpdate(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	cps := b.store.Checkpoints

	cp := checkpoint("job-1", 1)
	rev1, err := cps.Create(ctx(t), cp)
	if err != nil || rev1 == 0 {
		t.Fatalf("Create = %d, %v", rev1, err)
	}
	if _, err := cps.Create(ctx(t), checkpoint("job-1", 1)); !errors.Is(err, schemas.ErrConflict) || !strings.Contains(err.Error(), "job-1") {
		t.Fatalf("second Create = %v, want ErrConflict naming the job", err)
	}

	e, err := cps.Get(ctx(t), "job-1")
	if err != nil {
		t.Fatal(err)
	}
	sameCheckpoint(t, e.Checkpoint, cp)
	if e.Revision != rev1 || e.Size == 0 {
		t.Errorf("Get: revision %d (want %d), size %d", e.Revision, rev1, e.Size)
	}

	cp2 := checkpoint("job-1", 2)
	cp2.State = []byte(`{"count":2}`)
	rev2, err := cps.Update(ctx(t), cp2, rev1)
	if err != nil || rev2 <= rev1 {
		t.Fatalf("Update = %d, %v; want a revision above %d", rev2, err, rev1)
	}

	// A writer that read revision 1 lost: it must not overwrite.
	stale := checkpoint("job-1", 2)
	stale.State = []byte(`{"count":"stale"}`)
	if _, err := cps.Update(ctx(t), stale, rev1); !errors.Is(err, schemas.ErrConflict) {
		t.Fatalf("stale Update = %v, want ErrConflict", err)
	} else if !strings.Contains(err.Error(), "job-1") || !strings.Contains(err.Error(), strconv.FormatUint(rev1, 10)) {
		t.Errorf("conflict %q does not name the job and the revision", err)
	}
	e, err = cps.Get(ctx(t), "job-1")
	if err != nil {
		t.Fatal(err)
	}
	sameCheckpoint(t, e.Checkpoint, cp2)
	if e.Revision != rev2 {
		t.Errorf("revision %d after the stale write, want %d", e.Revision, rev2)
	}

	if _, err := cps.Update(ctx(t), checkpoint("job-1", 3), 0); err == nil || errors.Is(err, schemas.ErrConflict) || !strings.Contains(err.Error(), "use Create") {
		t.Errorf("Update at revision 0 = %v, want a usage error", err)
	}
	if _, err := cps.Update(ctx(t), checkpoint("job-absent", 2), rev2); !errors.Is(err, schemas.ErrConflict) {
		t.Errorf("Update of an absent job = %v, want ErrConflict", err)
	}
	// Revisions are per key: another job's revision is no licence.
	if _, err := cps.Create(ctx(t), checkpoint("job-2", 1)); err != nil {
		t.Fatal(err)
	}
	if _, err := cps.Update(ctx(t), checkpoint("job-2", 2), rev2); !errors.Is(err, schemas.ErrConflict) {
		t.Errorf("Update of job-2 at job-1's revision = %v, want ErrConflict", err)
	}
}

func TestCheckpointConcurrentWriters(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	rev, err := b.store.Checkpoints.Create(ctx(t), checkpoint("race", 1))
	if err != nil {
		t.Fatal(err)
	}

	t.Run("WriteAsync in flight together", func(t *testing.T) {
		const n = 64
		pending := make([]*kv.PendingWrite, n)
		for i := range pending {
			cp := checkpoint("race", 2)
			cp.State = []byte(fmt.Sprintf(`{"writer":%d}`, i))
			if pending[i], err = b.store.Checkpoints.WriteAsync(cp, rev); err != nil {
				t.Fatal(err)
			}
		}
		winner, newRev := -1, uint64(0)
		for i, p := range pending {
			r, err := p.Wait(ctx(t))
			switch {
			case err == nil && winner >= 0:
				t.Errorf("writers %d and %d both won", winner, i)
			case err == nil:
				winner, newRev = i, r
			case !errors.Is(err, schemas.ErrConflict):
				t.Errorf("writer %d: %v, want ErrConflict", i, err)
			}
		}
		if winner < 0 {
			t.Fatal("no writer won")
		}
		e, err := b.store.Checkpoints.Get(ctx(t), "race")
		if err != nil {
			t.Fatal(err)
		}
		if got, want := string(e.Checkpoint.State), fmt.Sprintf(`{"writer":%d}`, winner); got != want || e.Revision != newRev {
			t.Errorf("stored %s at %d, want the winner's %s at %d", got, e.Revision, want, newRev)
		}
		rev = newRev
	})

	t.Run("Update from separate connections", func(t *testing.T) {
		const n = 8
		stores := make([]*kv.Store, n)
		for i := range stores {
			stores[i] = b.srv.Store(t, kv.Config{})
		}
		var (
			wg    sync.WaitGroup
			mu    sync.Mutex
			wins  []int
			start = make(chan struct{})
		)
		for i, st := range stores {
			wg.Go(func() {
				cp := checkpoint("race", 3)
				cp.State = []byte(fmt.Sprintf(`{"engine":%d}`, i))
				<-start
				_, err := st.Checkpoints.Update(ctx(t), cp, rev)
				switch {
				case err == nil:
					mu.Lock()
					wins = append(wins, i)
					mu.Unlock()
				case !errors.Is(err, schemas.ErrConflict):
					t.Errorf("engine %d: %v, want ErrConflict", i, err)
				}
			})
		}
		close(start)
		wg.Wait()
		if len(wins) != 1 {
			t.Fatalf("winners %v, want exactly one", wins)
		}
		e, err := b.store.Checkpoints.Get(ctx(t), "race")
		if err != nil {
			t.Fatal(err)
		}
		if got, want := string(e.Checkpoint.State), fmt.Sprintf(`{"engine":%d}`, wins[0]); got != want {
			t.Errorf("stored %s, want the winner's %s", got, want)
		}
	})
}

func TestCheckpointGet(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	bucket := rawBucket(t, b)
	put := func(job string, v any) {
		t.Helper()
		data, ok := v.([]byte)
		if !ok {
			var err error
			if data, err = json.Marshal(v); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := bucket.Put(ctx(t), job, data); err != nil {
			t.Fatal(err)
		}
	}
	edit := func(job string, f func(*schemas.Checkpoint)) *schemas.Checkpoint {
		cp := checkpoint(job, 4)
		f(cp)
		return cp
	}
	put("good", checkpoint("good", 4))
	put("garbage", []byte("\x00not json"))
	put("truncated", []byte(`{"schema":1,"id":"truncated"`))
	put("null", []byte("null"))
	put("array", []byte(`[1,2]`))
	put("wrong-type", []byte(`{"schema":"1","id":"wrong-type"}`))
	put("schema-2", edit("schema-2", func(c *schemas.Checkpoint) { c.Schema = 2 }))
	put("schema-0", edit("schema-0", func(c *schemas.Checkpoint) { c.Schema = 0 }))
	put("mismatch", checkpoint("someone-else", 4))
	put("no-hash", edit("no-hash", func(c *schemas.Checkpoint) { c.DefinitionHash = "" }))
	put("no-seq", edit("no-seq", func(c *schemas.Checkpoint) { c.Seq = 0 }))
	put("no-status", edit("no-status", func(c *schemas.Checkpoint) { c.Status = "" }))

	rows := []struct {
		name    string
		ctx     context.Context
		job     string
		wantErr error
		wantMsg string
	}{
		{name: "stored", job: "good"},
		{name: "missing job", job: "absent", wantErr: schemas.ErrNotFound, wantMsg: `no job "absent"`},
		{name: "empty id", job: "", wantErr: schemas.ErrNotFound},
		{name: "id with a space", job: "a b", wantErr: schemas.ErrNotFound},
		{name: "id with a wildcard", job: "a.*", wantErr: schemas.ErrNotFound},
		{name: "garbage", job: "garbage", wantErr: schemas.ErrQuarantined, wantMsg: "does not decode"},
		{name: "truncated JSON", job: "truncated", wantErr: schemas.ErrQuarantined, wantMsg: "does not decode"},
		{name: "JSON null", job: "null", wantErr: schemas.ErrQuarantined},
		{name: "JSON array", job: "array", wantErr: schemas.ErrQuarantined, wantMsg: "does not decode"},
		{name: "field of the wrong type", job: "wrong-type", wantErr: schemas.ErrQuarantined, wantMsg: "does not decode"},
		{name: "newer schema version", job: "schema-2", wantErr: schemas.ErrQuarantined, wantMsg: "schema version 2"},
		{name: "no schema version", job: "schema-0", wantErr: schemas.ErrQuarantined, wantMsg: "schema version 0"},
		{name: "key and id differ", job: "mismatch", wantErr: schemas.ErrQuarantined, wantMsg: `names job "someone-else"`},
		{name: "no definition hash", job: "no-hash", wantErr: schemas.ErrQuarantined, wantMsg: "lacks"},
		{name: "no sequence", job: "no-seq", wantErr: schemas.ErrQuarantined, wantMsg: "lacks"},
		{name: "no status", job: "no-status", wantErr: schemas.ErrQuarantined, wantMsg: "lacks"},
		{name: "context deadline", ctx: expired(t), job: "good", wantErr: context.DeadlineExceeded, wantMsg: "good"},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			c := r.ctx
			if c == nil {
				c = ctx(t)
			}
			e, err := b.store.Checkpoints.Get(c, r.job)
			if r.wantErr == nil {
				if err != nil {
					t.Fatal(err)
				}
				sameCheckpoint(t, e.Checkpoint, checkpoint(r.job, 4))
				return
			}
			if !errors.Is(err, r.wantErr) {
				t.Fatalf("Get(%q) = %v, want %v", r.job, err, r.wantErr)
			}
			if !strings.Contains(err.Error(), r.wantMsg) {
				t.Errorf("error %q does not contain %q", err, r.wantMsg)
			}
			if errors.Is(r.wantErr, schemas.ErrQuarantined) && !strings.Contains(err.Error(), r.job) {
				t.Errorf("error %q does not name the job", err)
			}
			if e.Checkpoint != nil {
				t.Errorf("Get returned a checkpoint with the error: %+v", e.Checkpoint)
			}
		})
	}
}

func TestDecodeCheckpoint(t *testing.T) {
	t.Parallel()
	good, _ := json.Marshal(checkpoint("j", 1))
	if cp, err := kv.DecodeCheckpoint("j", good); err != nil || cp.JobID != "j" {
		t.Fatalf("DecodeCheckpoint = %+v, %v", cp, err)
	}
	for name, data := range map[string]string{
		"empty":       "",
		"not JSON":    "{",
		"other job":   string(good),
		"zero object": "{}",
	} {
		job := "k"
		if _, err := kv.DecodeCheckpoint(job, []byte(data)); !errors.Is(err, schemas.ErrQuarantined) {
			t.Errorf("%s: err = %v, want ErrQuarantined", name, err)
		}
	}
}

// An outbox event is stored without its job and read back with it; one
// stored with its job (an older engine's) keeps it.
func TestOutboxEventsKeepTheirJob(t *testing.T) {
	t.Parallel()
	cp := checkpoint("j", 1)
	cp.Events = []schemas.Event{
		{Type: schemas.EventStepCompleted, Data: schemas.HistoryData{Job: "j", Seq: 1, Step: "a"}},
		{Type: schemas.EventStepDispatched, Data: schemas.HistoryData{Job: "j", Seq: 1, Step: "b"}},
	}
	stored := cp.AppendJSON(nil)
	if bytes.Contains(stored, []byte(`"job":"j"`)) {
		t.Errorf("outbox stored with its job: %s", stored)
	}
	older, _ := json.Marshal(cp)
	for name, data := range map[string][]byte{"stored": stored, "older": older} {
		got, err := kv.DecodeCheckpoint("j", data)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, ev := range got.Events {
			if ev.Data.Job != "j" {
				t.Errorf("%s: event %s of step %s decoded with job %q", name, ev.Type, ev.Data.Step, ev.Data.Job)
			}
		}
	}
}

func TestCheckpointTooLarge(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{MaxValueBytes: 1024})
	cp := checkpoint("big-job", 1)
	cp.State = []byte(`{"text":"` + strings.Repeat("x", 2000) + `"}`)
	size := len(cp.AppendJSON(nil)) // the stored encoding

	_, err := b.store.Checkpoints.Encode(cp)
	if !errors.Is(err, schemas.ErrTooLarge) {
		t.Fatalf("Encode = %v, want ErrTooLarge", err)
	}
	var we *schemas.Error
	if !errors.As(err, &we) || we.Job != "big-job" {
		t.Errorf("error %+v does not carry the job", we)
	}
	for _, want := range []string{"big-job", strconv.Itoa(size), "1024"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}

	if _, err := b.store.Checkpoints.Create(ctx(t), cp); !errors.Is(err, schemas.ErrTooLarge) {
		t.Errorf("Create = %v, want ErrTooLarge", err)
	}
	if _, err := b.store.Checkpoints.Get(ctx(t), "big-job"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("Get after a refused Create = %v, want ErrNotFound", err)
	}
	// A checkpoint of exactly the limit is stored: the bucket leaves room
	// for the write's headers.
	edge := sized(t, "edge-job", 1024)
	if _, err := b.store.Checkpoints.Create(ctx(t), edge); err != nil {
		t.Errorf("Create of a checkpoint at the limit: %v", err)
	}

	t.Run("bucket smaller than the config", func(t *testing.T) {
		t.Parallel()
		// A bucket created without header room (by an older version, or
		// by hand): the server's refusal is reported as ErrTooLarge, not
		// as an unknown outcome.
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		js := newJS(t, srv)
		if _, err := js.CreateKeyValue(ctx(t), jetstream.KeyValueConfig{Bucket: "waymark_checkpoints", MaxValueSize: 1024}); err != nil {
			t.Fatal(err)
		}
		st := srv.Store(t, kv.Config{MaxValueBytes: 1024})
		_, err := st.Checkpoints.Create(ctx(t), sized(t, "tight", 1024))
		if !errors.Is(err, schemas.ErrTooLarge) || !strings.Contains(err.Error(), "tight") || !strings.Contains(err.Error(), "1024 bytes") {
			t.Fatalf("Create = %v, want ErrTooLarge naming the job and size", err)
		}
		if _, err := st.Checkpoints.Get(ctx(t), "tight"); !errors.Is(err, schemas.ErrNotFound) {
			t.Errorf("Get = %v, want ErrNotFound", err)
		}
	})
}

// sized returns a checkpoint of job whose encoding is exactly n bytes.
func sized(t *testing.T, job string, n int) *schemas.Checkpoint {
	t.Helper()
	cp := checkpoint(job, 1)
	cp.State = []byte(`{"t":""}`)
	pad := n - len(cp.AppendJSON(nil))
	if pad < 0 {
		t.Fatalf("test bug: a checkpoint of %s is over %d bytes", job, n)
	}
	cp.State = []byte(`{"t":"` + strings.Repeat("x", pad) + `"}`)
	if got := len(cp.AppendJSON(nil)); got != n {
		t.Fatalf("test bug: sized checkpoint is %d bytes, want %d", got, n)
	}
	return cp
}

// must returns v, panicking on err: for encodings that cannot fail.
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestCheckpointList(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	cps := b.store.Checkpoints

	calls := 0
	if err := cps.List(ctx(t), func(string, kv.Entry, error) bool { calls++; return true }); err != nil || calls != 0 {
		t.Fatalf("List of an empty bucket: %d calls, %v", calls, err)
	}

	want := map[string]bool{}
	for i := range 25 {
		job := fmt.Sprintf("job-%02d", i)
		want[job] = true
		rev, err := cps.Create(ctx(t), checkpoint(job, 1))
		if err != nil {
			t.Fatal(err)
		}
		if i%5 == 0 { // some jobs have moved on
			if _, err := cps.Update(ctx(t), checkpoint(job, 2), rev); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := rawBucket(t, b).Put(ctx(t), "broken", []byte("garbage")); err != nil {
		t.Fatal(err)
	}
	if _, err := cps.Create(ctx(t), checkpoint("gone", 1)); err != nil {
		t.Fatal(err)
	}
	if err := rawBucket(t, b).Delete(ctx(t), "gone"); err != nil {
		t.Fatal(err)
	}

	seen := map[string]int{}
	err := cps.List(ctx(t), func(job string, e kv.Entry, err error) bool {
		seen[job]++
		switch {
		case job == "broken":
			if !errors.Is(err, schemas.ErrQuarantined) || e.Checkpoint != nil {
				t.Errorf("broken: %+v, %v; want ErrQuarantined and no checkpoint", e, err)
			}
		case err != nil:
			t.Errorf("%s: %v", job, err)
		case e.Checkpoint.JobID != job || e.Revision == 0:
			t.Errorf("%s: %+v", job, e)
		case job == "job-05" && e.Checkpoint.Seq != 2:
			t.Errorf("job-05 listed at seq %d, want the latest, 2", e.Checkpoint.Seq)
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	want["broken"] = true
	for job := range want {
		if seen[job] != 1 {
			t.Errorf("%s visited %d times", job, seen[job])
		}
	}
	if len(seen) != len(want) {
		t.Errorf("visited %d jobs, want %d (deleted ones excluded): %v", len(seen), len(want), seen)
	}

	calls = 0
	if err := cps.List(ctx(t), func(string, kv.Entry, error) bool { calls++; return false }); err != nil || calls != 1 {
		t.Errorf("List stopped by fn: %d calls, %v", calls, err)
	}
}

func TestCheckpointWatch(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	cps := b.store.Checkpoints
	rev, err := cps.Create(ctx(t), checkpoint("watched", 1))
	if err != nil {
		t.Fatal(err)
	}

	type event struct {
		seq uint64
		rev uint64
		err error
	}
	events := make(chan event, 16)
	done := make(chan error, 1)
	go func() {
		done <- cps.Watch(ctx(t), "watched", func(e kv.Entry, err error) bool {
			ev := event{rev: e.Revision, err: err}
			if e.Checkpoint != nil {
				ev.seq = e.Checkpoint.Seq
			}
			events <- ev
			return ev.seq != 4
		})
	}()
	next := func() event {
		t.Helper()
		select {
		case ev := <-events: // an event already sent comes first: Watch may have returned after it
			return ev
		default:
		}
		select {
		case ev := <-events:
			return ev
		case err := <-done:
			t.Fatalf("Watch returned early: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("no watch event within 10s")
		}
		return event{}
	}

	if ev := next(); ev.seq != 1 || ev.rev != rev || ev.err != nil {
		t.Fatalf("first event %+v, want the current checkpoint (seq 1, revision %d)", ev, rev)
	}
	rev, err = cps.Update(ctx(t), checkpoint("watched", 2), rev)
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(); ev.seq != 2 || ev.rev != rev {
		t.Fatalf("event %+v, want seq 2 at revision %d", ev, rev)
	}
	// Writes to other jobs are not seen.
	if _, err := cps.Create(ctx(t), checkpoint("watched-not", 1)); err != nil {
		t.Fatal(err)
	}
	// A value that is not a checkpoint arrives as ErrQuarantined.
	if _, err := rawBucket(t, b).Put(ctx(t), "watched", []byte("garbage")); err != nil {
		t.Fatal(err)
	}
	if ev := next(); !errors.Is(ev.err, schemas.ErrQuarantined) {
		t.Fatalf("event %+v, want ErrQuarantined", ev)
	}
	if _, err := rawBucket(t, b).Put(ctx(t), "watched", must(json.Marshal(checkpoint("watched", 4)))); err != nil {
		t.Fatal(err)
	}
	if ev := next(); ev.seq != 4 {
		t.Fatalf("event %+v, want seq 4", ev)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Watch = %v after fn returned false, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Watch did not return after fn returned false")
	}

	t.Run("ends with its context", func(t *testing.T) {
		c, cancel := context.WithCancel(ctx(t))
		defer cancel()
		seen := make(chan struct{}, 1)
		done := make(chan error, 1)
		go func() {
			done <- cps.Watch(c, "later", func(kv.Entry, error) bool {
				seen <- struct{}{}
				return true
			})
		}()
		// The job does not exist yet: Watch waits for it.
		if _, err := cps.Create(ctx(t), checkpoint("later", 1)); err != nil {
			t.Fatal(err)
		}
		select {
		case <-seen:
		case <-time.After(10 * time.Second):
			t.Fatal("Watch did not see the job created after it started")
		}
		cancel()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Watch = %v, want context.Canceled", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Watch did not end with its context")
		}
	})
}

func TestPendingWriteOutcomeUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	rev, err := b.store.Checkpoints.Create(ctx(t), checkpoint("limbo", 1))
	if err != nil {
		t.Fatal(err)
	}
	// With the server gone, no acknowledgement can come: the write may or
	// may not happen, and Wait must say so rather than claim a conflict.
	b.srv.Stop()
	p, err := b.store.Checkpoints.WriteAsync(checkpoint("limbo", 2), rev)
	if err != nil {
		if errors.Is(err, schemas.ErrConflict) {
			t.Fatalf("WriteAsync = %v, a conflict it cannot know", err)
		}
		t.Logf("WriteAsync refused up front: %v", err)
		return
	}
	c, cancel := context.WithTimeout(ctx(t), 200*time.Millisecond)
	defer cancel()
	// Either the deadline passes or the client fails the write as
	// disconnected; both leave the outcome unknown.
	_, err = p.Wait(c)
	if err == nil || errors.Is(err, schemas.ErrConflict) {
		t.Fatalf("Wait = %v, want an error that is not a conflict", err)
	}
	if !strings.Contains(err.Error(), "outcome unknown") || !strings.Contains(err.Error(), "limbo") {
		t.Errorf("error %q does not say the outcome of limbo's write is unknown", err)
	}
}

func TestCheckpointInvalidJobID(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	rev, err := b.store.Checkpoints.Create(ctx(t), checkpoint("job-1", 1))
	if err != nil {
		t.Fatal(err)
	}
	// Job ids become subject tokens; one that is not a KV key must be
	// refused at once, never compared against or written over other jobs.
	for _, job := range []string{"", "a b", "job-*", ">", "*", ".a", "a.", "a..b", "a\tb"} {
		for name, write := range map[string]func() (uint64, error){
			"Create": func() (uint64, error) { return b.store.Checkpoints.Create(ctx(t), checkpoint(job, 1)) },
			"Update": func() (uint64, error) { return b.store.Checkpoints.Update(ctx(t), checkpoint(job, 2), rev) },
		} {
			if _, err := write(); !errors.Is(err, jetstream.ErrInvalidKey) || !strings.Contains(err.Error(), strconv.Quote(job)) {
				t.Errorf("%s(%q) = %v, want jetstream.ErrInvalidKey naming the id", name, job, err)
			}
		}
	}
	var keys []string
	l, err := rawBucket(t, b).ListKeys(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	for k := range l.Keys() {
		keys = append(keys, k)
	}
	if len(keys) != 1 || keys[0] != "job-1" {
		t.Errorf("bucket keys = %q, want only job-1", keys)
	}
	if e, err := b.store.Checkpoints.Get(ctx(t), "job-1"); err != nil || e.Revision != rev {
		t.Errorf("job-1 = %+v, %v; want untouched at revision %d", e, err, rev)
	}
}
