package kv

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// Jobs is the job index: one small entry per job in a KV bucket, so that
// the reconciler and listings read the jobs they need instead of every
// checkpoint ever written. Keys put what listings filter on into subject
// tokens, so the server does the filtering:
//
//	active.<workflow>.<job>          from creation until the job finished
//	ended.<status>.<workflow>.<job>  once it finished (completed, failed or cancelled)
//
// The index follows the checkpoints, never the other way round, and every
// write to it is conditional:
//
//   - A job's active entry is created (create-only) before its first
//     checkpoint, so no job that can still change is ever missing from
//     the index. A crash between the two leaves an entry without a
//     checkpoint, which the reconciler removes after a grace period.
//   - When a job finishes, its ended entry is created after the terminal
//     checkpoint, and only then is the active entry removed, by a purge
//     that removes nothing newer than the revision read. A crash between
//     leaves an active entry of a finished job, which the reconciler
//     finishes.
//
// Removing an entry purges its messages rather than writing a delete
// marker, so a listing never walks the markers of jobs long gone. Safe for
// concurrent use.
type Jobs struct {
	kv    jetstream.KeyValue
	js    jetstream.JetStream
	names Names
}

// Index classes: the first token of an index key.
const (
	indexActive = "active"
	indexEnded  = "ended"
)

// IndexEntry is one job in the index. Revision is the entry's KV revision,
// which is also its sequence in the bucket's stream: listings are ordered
// by it, newest first.
type IndexEntry struct {
	Key      string `json:"-"`
	Revision uint64 `json:"-"`

	Job       string            `json:"job"`
	Workflow  string            `json:"workflow"`
	Version   int               `json:"version,omitempty"`
	Status    schemas.JobStatus `json:"status,omitempty"` // ended entries: the final status
	CreatedAt time.Time         `json:"created_at"`
	EndedAt   *time.Time        `json:"ended_at,omitempty"`
	// ResumeCount and Error are copied from the final checkpoint, so that a
	// listing of finished jobs reads no checkpoint.
	ResumeCount int            `json:"resume_count,omitempty"`
	Error       *schemas.Error `json:"error,omitempty"`
	// FromRev, on an ended entry, is the revision of the entry it replaced
	// (the job's active entry, or its ended entry before an update): where
	// the job stood in a listing that began before it moved.
	FromRev uint64 `json:"from_rev,omitempty"`

	// Pos is where the entry stands in the listing Page returned it in:
	// its Revision, or FromRev for a job that moved since the listing's
	// snapshot.
	Pos uint64 `json:"-"`
}

// Ended reports whether the entry is of a finished job.
func (e *IndexEntry) Ended() bool { return strings.HasPrefix(e.Key, indexEnded+".") }

// ActiveKey is the index key of a job that may still change.
func ActiveKey(workflow, job string) string { return indexActive + "." + workflow + "." + job }

// EndedKey is the index key of a finished job.
func EndedKey(status schemas.JobStatus, workflow, job string) string {
	return indexEnded + "." + string(status) + "." + workflow + "." + job
}

func (j *Jobs) subject(key string) string { return "$KV." + j.names.JobsBucket + "." + key }

func (j *Jobs) streamName() string { return "KV_" + j.names.JobsBucket }

// CreateActive creates job's active entry (create-only) and returns its
// revision. Errors: schemas.ErrConflict when the entry exists (the job, or
// an attempt to create it, exists).
func (j *Jobs) CreateActive(ctx context.Context, cp *schemas.Checkpoint) (uint64, error) {
	e := IndexEntry{Job: cp.JobID, Workflow: cp.Workflow, Version: cp.Version, CreatedAt: cp.CreatedAt}
	data, err := json.Marshal(&e)
	if err != nil {
		return 0, fmt.Errorf("index job %s: %w", cp.JobID, err)
	}
	rev, err := j.kv.Create(ctx, ActiveKey(cp.Workflow, cp.JobID), data)
	if errors.Is(err, jetstream.ErrKeyExists) {
		return 0, schemas.Errorf(schemas.CodeConflict, "job %s is already indexed", cp.JobID).WithCause(err)
	}
	if err != nil {
		return 0, fmt.Errorf("index job %s: %w", cp.JobID, err)
	}
	return rev, nil
}

// sweptPrefix starts the keys that record a job id whose job was swept
// with effect records: "swept.<job>". Job ids hold no '.', so these never
// match an active or ended listing.
const sweptPrefix = "swept"

// MarkSwept records, before a sweep removes a job that had effect
// records, that its id was used, so that a job started again under it
// takes other idempotency keys (schemas.Checkpoint.Reused). One small
// entry per such id, kept for good: a provider may remember a key longer
// than Waymark keeps the job.
func (j *Jobs) MarkSwept(ctx context.Context, job string) error {
	if _, err := j.kv.Put(ctx, sweptPrefix+"."+job, []byte("{}")); err != nil {
		return fmt.Errorf("record that job %s is swept: %w", job, err)
	}
	return nil
}

// WasSwept reports whether MarkSwept recorded job's id.
func (j *Jobs) WasSwept(ctx context.Context, job string) (bool, error) {
	_, err := j.kv.Get(ctx, sweptPrefix+"."+job)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, jetstream.ErrKeyNotFound), errors.Is(err, jetstream.ErrInvalidKey):
		return false, nil
	}
	return false, fmt.Errorf("read whether job %s was swept: %w", job, err)
}

// Get returns the entry under key. Errors: schemas.ErrNotFound.
func (j *Jobs) Get(ctx context.Context, key string) (IndexEntry, error) {
	ent, err := j.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrInvalidKey) {
		return IndexEntry{}, schemas.Errorf(schemas.CodeNotFound, "no index entry %q", key)
	}
	if err != nil {
		return IndexEntry{}, fmt.Errorf("read index entry %s: %w", key, err)
	}
	return decodeEntry(key, ent.Revision(), ent.Value())
}

func decodeEntry(key string, rev uint64, data []byte) (IndexEntry, error) {
	var e IndexEntry
	if err := json.Unmarshal(data, &e); err != nil {
		return IndexEntry{}, fmt.Errorf("index entry %s does not decode: %w", key, err)
	}
	e.Key, e.Revision = key, rev
	return e, nil
}

// End records that the job of cp (a terminal checkpoint) finished: it
// creates the ended entry (create-only: one that exists stays) and then
// removes the active entry if its revision is still at most activeRev (0:
// whatever revision it has now, read first). Every step may be repeated.
func (j *Jobs) End(ctx context.Context, cp *schemas.Checkpoint, activeRev uint64) error {
	if !cp.Status.Terminal() {
		return fmt.Errorf("index job %s: status %s has not ended", cp.JobID, cp.Status)
	}
	key := ActiveKey(cp.Workflow, cp.JobID)
	if activeRev == 0 {
		got, err := j.Get(ctx, key)
		if err != nil && !errors.Is(err, schemas.ErrNotFound) {
			return err
		}
		activeRev = got.Revision
	}
	e := IndexEntry{Job: cp.JobID, Workflow: cp.Workflow, Version: cp.Version, Status: cp.Status,
		CreatedAt: cp.CreatedAt, EndedAt: cp.CompletedAt, ResumeCount: cp.ResumeCount, Error: cp.Error, FromRev: activeRev}
	data, err := json.Marshal(&e)
	if err != nil {
		return fmt.Errorf("index job %s: %w", cp.JobID, err)
	}
	ended := EndedKey(cp.Status, cp.Workflow, cp.JobID)
	if _, err := j.kv.Create(ctx, ended, data); errors.Is(err, jetstream.ErrKeyExists) {
		// Written before (this is a repeat, or the finished job's checkpoint
		// changed since: a resume counted late): bring it up to date.
		got, err := j.kv.Get(ctx, ended)
		if err != nil {
			return fmt.Errorf("index job %s as %s: %w", cp.JobID, cp.Status, err)
		}
		var old IndexEntry
		if json.Unmarshal(got.Value(), &old) == nil {
			e.FromRev = old.FromRev
			if data, err = json.Marshal(&e); err != nil {
				return fmt.Errorf("index job %s: %w", cp.JobID, err)
			}
		}
		if !bytes.Equal(got.Value(), data) {
			e.FromRev = got.Revision() // it moves: listings under way found it here
			if data, err = json.Marshal(&e); err != nil {
				return fmt.Errorf("index job %s: %w", cp.JobID, err)
			}
			if _, err := j.kv.Update(ctx, ended, data, got.Revision()); err != nil && !errors.Is(err, jetstream.ErrKeyExists) {
				return fmt.Errorf("index job %s as %s: %w", cp.JobID, cp.Status, err)
			}
		}
	} else if err != nil {
		return fmt.Errorf("index job %s as %s: %w", cp.JobID, cp.Status, err)
	}
	if activeRev == 0 {
		return nil
	}
	return j.Remove(ctx, key, activeRev)
}

// Remove removes the entry under key if its revision is at most rev: a
// purge of the key's messages up to rev, so an entry written again since
// survives (a compare-and-swap delete that leaves no marker).
func (j *Jobs) Remove(ctx context.Context, key string, rev uint64) error {
	return purgeUpTo(ctx, j.js, j.streamName(), j.subject(key), rev)
}

// purgeUpTo removes subject's messages in stream whose sequence is at most
// rev, leaving later ones.
// It speaks the purge request of the JetStream API itself: nats.go's needs
// a stream handle, which costs a stream info request first.
func purgeUpTo(ctx context.Context, js jetstream.JetStream, stream, subject string, rev uint64) error {
	req, _ := json.Marshal(struct {
		Filter string `json:"filter"`
		Seq    uint64 `json:"seq"`
	}{subject, rev + 1})
	var resp struct {
		Success bool                `json:"success"`
		Error   *jetstream.APIError `json:"error"`
	}
	if err := apiRequest(ctx, js, "STREAM.PURGE."+stream, req, &resp); err != nil {
		return fmt.Errorf("purge %s up to %d: %w", subject, rev, err)
	}
	if resp.Error != nil {
		return fmt.Errorf("purge %s up to %d: %w", subject, rev, resp.Error)
	}
	return nil
}

// apiRequest sends a JetStream API request (subject after the API prefix)
// and decodes the answer into resp.
func apiRequest(ctx context.Context, js jetstream.JetStream, subject string, req []byte, resp any) error {
	prefix := "$JS.API."
	if o := js.Options(); o.Domain != "" {
		prefix = "$JS." + o.Domain + ".API."
	} else if o.APIPrefix != "" {
		prefix = strings.TrimSuffix(o.APIPrefix, ".") + "."
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
	}
	m, err := js.Conn().RequestWithContext(ctx, prefix+subject, req)
	if err != nil {
		return err
	}
	return json.Unmarshal(m.Data, resp)
}

// Active calls fn with the entry of every job that may still change, in
// the order they were created, until fn returns false. Its cost follows
// the number of such jobs, not of jobs ever run.
func (j *Jobs) Active(ctx context.Context, fn func(IndexEntry) bool) error {
	return j.watch(ctx, []string{indexActive + ".>"}, fn)
}

// Ended calls fn with the entry of every finished job, the longest
// finished first (in the order their entries were written), until fn
// returns false.
func (j *Jobs) Ended(ctx context.Context, fn func(IndexEntry) bool) error {
	return j.watch(ctx, []string{indexEnded + ".>"}, fn)
}

// watch calls fn with the index entries under keys (KV key filters), the
// latest of each key, deleted and purged ones left out, until fn returns
// false or none is left. It reads the bucket's stream through an ordered
// consumer (last per subject) rather than a KV watcher: a watcher waits
// for every message it counted at its start, and an entry purged before it
// arrives (the active entry of a job that just finished) left it waiting
// for ever; here an empty fetch ends the read.
func (j *Jobs) watch(ctx context.Context, keys []string, fn func(IndexEntry) bool) error {
	subjects := make([]string, len(keys))
	for i, k := range keys {
		subjects[i] = "$KV." + j.names.JobsBucket + "." + k
	}
	cons, err := j.js.OrderedConsumer(ctx, "KV_"+j.names.JobsBucket, jetstream.OrderedConsumerConfig{
		FilterSubjects: subjects, DeliverPolicy: jetstream.DeliverLastPerSubjectPolicy,
	})
	if err != nil {
		return fmt.Errorf("read job index %v: %w", keys, err)
	}
	if info := cons.CachedInfo(); info != nil && info.NumPending == 0 {
		return nil
	}
	prefix := "$KV." + j.names.JobsBucket + "."
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("read job index %v: %w", keys, err)
	}
	defer it.Stop()
	for {
		nctx, cancel := context.WithTimeout(ctx, time.Second)
		m, err := it.Next(jetstream.NextContext(nctx))
		cancel()
		switch {
		case ctx.Err() != nil:
			return fmt.Errorf("read job index %v: %w", keys, ctx.Err())
		case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) || errors.Is(err, jetstream.ErrMsgIteratorClosed):
			return nil // what was counted is gone (purged meanwhile)
		case err != nil:
			return fmt.Errorf("read job index %v: %w", keys, err)
		}
		md, err := m.Metadata()
		if err != nil {
			continue
		}
		switch m.Headers().Get("KV-Operation") {
		case "DEL", "PURGE":
		default:
			if e, err := decodeEntry(strings.TrimPrefix(m.Subject(), prefix), md.Sequence.Stream, m.Data()); err == nil && !fn(e) {
				return nil
			}
		}
		if md.NumPending == 0 {
			return nil
		}
	}
}

// IndexFilter selects index entries. Zero fields match everything.
type IndexFilter struct {
	// Active selects jobs that may still change; Ended, finished ones;
	// neither, both.
	Active, Ended bool
	// Status selects finished jobs of this status (implies Ended).
	Status schemas.JobStatus
	// Workflow selects jobs of this workflow.
	Workflow string
}

func (f IndexFilter) subjects(j *Jobs) []string {
	if f == (IndexFilter{}) {
		// Everything: no filter, so that the server need not match the
		// subjects of every job to count what a window holds.
		return nil
	}
	wf := "*"
	if f.Workflow != "" {
		wf = f.Workflow
	}
	status := "*"
	if f.Status != "" {
		status = string(f.Status)
		f.Ended, f.Active = true, false
	}
	var out []string
	if f.Active || !f.Ended {
		out = append(out, j.subject(indexActive+"."+wf+".*"))
	}
	if f.Ended || !f.Active {
		out = append(out, j.subject(indexEnded+"."+status+"."+wf+".*"))
	}
	return out
}

// Page returns up to limit entries matching f, newest first, as the
// index stood at revision snapshot (0: now), with that snapshot. Each job
// stands at one position: the revision its entry had at the snapshot
// (its creation for a job that was active, its end for one that had
// finished); a job that finished since is found at its old position
// (IndexEntry.FromRev), and jobs created since are not listed. So a
// listing continued page by page from one snapshot returns every job
// that existed then and still matches exactly once. before, when not 0,
// continues a listing: only positions below it (the Pos of the previous
// page's last entry). The server filters by subject; the client reads
// windows near the top of the bucket's stream, widening them until the
// page is full or the stream's start is reached, and the entries written
// since the snapshot. Errors: ErrCursor when snapshot or before lie
// beyond the index.
func (j *Jobs) Page(ctx context.Context, f IndexFilter, before, snapshot uint64, limit int) ([]IndexEntry, uint64, error) {
	if limit <= 0 {
		return nil, snapshot, nil
	}
	st, err := j.js.Stream(ctx, j.streamName())
	if err != nil {
		return nil, 0, fmt.Errorf("list jobs: %w", err)
	}
	state := st.CachedInfo().State
	if snapshot == 0 {
		snapshot = state.LastSeq
	}
	if snapshot > state.LastSeq || before > snapshot+1 {
		return nil, 0, ErrCursor
	}
	hi := snapshot + 1
	if before != 0 {
		hi = before
	}
	first := max(state.FirstSeq, 1)
	subjects := f.subjects(j)
	var out []IndexEntry
	lo := hi
	win := uint64(max(4*limit, 64))
	for lo > first && len(out) < limit {
		top := lo
		lo = first
		if top > first+win {
			lo = top - win
		}
		got, err := j.readRange(ctx, subjects, lo, top)
		if err != nil {
			return nil, 0, err
		}
		for i := range got {
			got[i].Pos = got[i].Revision
		}
		slices.Reverse(got)
		out = append(out, got...)
		win *= 4
	}
	if lo <= first {
		lo = 0 // the start: an old position may lie before the stream's first message now
	}
	// A job that ended between its two index writes has both entries at
	// the snapshot: the newer one stands for it.
	slices.SortFunc(out, func(a, b IndexEntry) int { return cmp.Compare(b.Revision, a.Revision) })
	listed := make(map[string]bool, len(out))
	out = slices.DeleteFunc(out, func(e IndexEntry) bool {
		dup := listed[e.Job]
		listed[e.Job] = true
		return dup
	})
	// Jobs that moved since the snapshot, at their old positions. The
	// index is read again after the ranges above: a job that moved while
	// they were read was gone from its old place and not yet in range.
	info, err := st.Info(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("list jobs: %w", err)
	}
	if last := info.State.LastSeq; snapshot < last {
		since, err := j.readRange(ctx, subjects, snapshot+1, last+1)
		if err != nil {
			return nil, 0, err
		}
		for _, e := range since {
			if e.FromRev != 0 && e.FromRev <= snapshot && e.FromRev < hi && e.FromRev >= lo && !listed[e.Job] {
				e.Pos = e.FromRev
				listed[e.Job] = true
				out = append(out, e)
			}
		}
	}
	slices.SortFunc(out, func(a, b IndexEntry) int { return cmp.Compare(b.Pos, a.Pos) })
	if len(out) > limit {
		out = out[:limit]
	}
	return out, snapshot, nil
}

// ErrCursor is returned by Page for a position or snapshot beyond the
// index: a cursor no listing of this deployment gave.
var ErrCursor = errors.New("cursor beyond the job index")

// readRange returns the live entries on subjects with a sequence in
// [lo, hi), in order.
func (j *Jobs) readRange(ctx context.Context, subjects []string, lo, hi uint64) ([]IndexEntry, error) {
	cons, err := j.js.OrderedConsumer(ctx, j.streamName(), jetstream.OrderedConsumerConfig{
		FilterSubjects:    subjects,
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       lo,
		InactiveThreshold: 10 * time.Second,
	})
	if err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	info := cons.CachedInfo()
	defer func() { _ = j.js.DeleteConsumer(context.WithoutCancel(ctx), j.streamName(), info.Name) }()
	pending := info.NumPending
	var out []IndexEntry
	prefix := "$KV." + j.names.JobsBucket + "."
	// Fetches end with this context: one left waiting for messages past hi
	// would otherwise outlive the call until its expiry.
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for pending > 0 {
		batch, err := cons.Fetch(int(min(pending, 256)), jetstream.FetchContext(fctx))
		if err != nil {
			return nil, fmt.Errorf("list jobs: %w", err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				continue
			}
			pending = md.NumPending
			if md.Sequence.Stream >= hi {
				return out, nil
			}
			if op := m.Headers().Get("KV-Operation"); op != "" {
				continue // a delete or purge marker
			}
			e, err := decodeEntry(strings.TrimPrefix(m.Subject(), prefix), md.Sequence.Stream, m.Data())
			if err != nil {
				continue
			}
			out = append(out, e)
		}
		if err := batch.Error(); err != nil {
			return nil, fmt.Errorf("list jobs: %w", err)
		}
		if n == 0 {
			break
		}
	}
	return out, nil
}
