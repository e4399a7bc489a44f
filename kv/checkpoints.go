package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// Checkpoints stores one checkpoint per job in a JetStream KV bucket. Every
// write is a compare-and-swap on the revision the writer read (DESIGN.md
// invariant 1): Create succeeds only if the key is absent, Update only if
// the revision is still current. Safe for concurrent use.
type Checkpoints struct {
	kv       jetstream.KeyValue
	js       jetstream.JetStream
	maxBytes int
	// group commits the writes of every writer in this process as atomic
	// batches (Config.GroupCommit); nil: each write goes alone.
	group *groupCommit
}

// Entry is a decoded checkpoint with the KV revision it was read at.
type Entry struct {
	Checkpoint *schemas.Checkpoint
	Revision   uint64
	Size       int // encoded bytes
}

// Get returns job's checkpoint. Errors: schemas.ErrNotFound when absent;
// schemas.ErrQuarantined (with the decode error) when the stored value is
// not a checkpoint this version can read.
func (c *Checkpoints) Get(ctx context.Context, job string) (Entry, error) {
	e, err := c.kv.Get(ctx, job)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return Entry{}, schemas.Errorf(schemas.CodeNotFound, "no job %q", job)
	}
	if errors.Is(err, jetstream.ErrInvalidKey) {
		return Entry{}, schemas.Errorf(schemas.CodeNotFound, "no job %q (not a valid job id)", job)
	}
	if err != nil {
		return Entry{}, fmt.Errorf("load checkpoint %s: %w", job, err)
	}
	cp, err := DecodeCheckpoint(job, e.Value())
	if err != nil {
		return Entry{}, err
	}
	return Entry{Checkpoint: cp, Revision: e.Revision(), Size: len(e.Value())}, nil
}

// DecodeCheckpoint decodes a stored checkpoint for job. A value that does
// not decode, has another schema version, or belongs to another job gives
// schemas.ErrQuarantined: it is never resumed from.
func DecodeCheckpoint(job string, data []byte) (*schemas.Checkpoint, error) {
	var cp schemas.Checkpoint
	if err := json.Unmarshal(data, &cp); err != nil {
		return nil, schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s does not decode: %v", job, err)
	}
	switch {
	case cp.Schema != schemas.CheckpointSchema:
		return nil, schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s has schema version %d; this build reads %d (migrate it first)", job, cp.Schema, schemas.CheckpointSchema)
	case cp.JobID != job:
		return nil, schemas.Errorf(schemas.CodeQuarantined, "checkpoint under key %s names job %q", job, cp.JobID)
	case cp.DefinitionHash == "" || cp.Seq == 0 || cp.Status == "":
		return nil, schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s lacks definition hash, sequence or status", job)
	}
	if err := cp.Completed.Validate(); err != nil {
		return nil, schemas.Errorf(schemas.CodeQuarantined, "checkpoint %s: completed: %v", job, err)
	}
	if cp.Fan != nil {
		cp.Fan.FillIDs(cp.MsgPrefix()) // item dispatches are stored without them
	}
	for i := range cp.Events { // stored without their job (schemas.Checkpoint.AppendJSON)
		if cp.Events[i].Data.Job == "" {
			cp.Events[i].Data.Job = job
		}
	}
	return &cp, nil
}

// Encode returns cp's stored form, or schemas.ErrTooLarge naming the job
// and both sizes.
func (c *Checkpoints) Encode(cp *schemas.Checkpoint) ([]byte, error) {
	data := cp.AppendJSON(make([]byte, 0, EncodedSizeHint(cp)))
	if len(data) > c.maxBytes {
		return nil, (&schemas.Error{Code: schemas.CodeTooLarge, Job: cp.JobID,
			Message: fmt.Sprintf("checkpoint is %d bytes; the bucket's limit is %d", len(data), c.maxBytes)})
	}
	return data, nil
}

// EncodedSizeHint estimates the bytes of cp's encoding, in excess rather
// than short, so that encoding it allocates once.
func EncodedSizeHint(cp *schemas.Checkpoint) int {
	n := 768 + len(cp.State) + 320*len(cp.Events) + 128*len(cp.Steps) + 64*len(cp.Vars) + 64*len(cp.EffectKeys)
	for _, ev := range cp.Events {
		n += len(ev.Data.Input)
	}
	if cp.Error != nil {
		n += len(cp.Error.Message)
	}
	return n
}

// Create stores cp for a new job and returns its revision. A job whose
// checkpoint was deleted or purged counts as absent (as with
// jetstream.KeyValue.Create). Errors: schemas.ErrConflict if the job exists; schemas.ErrTooLarge;
// jetstream.ErrInvalidKey if the job id cannot be a KV key.
func (c *Checkpoints) Create(ctx context.Context, cp *schemas.Checkpoint) (uint64, error) {
	return c.write(ctx, cp, 0)
}

// Update stores cp if job's revision is still rev and returns the new
// revision. Errors: schemas.ErrConflict if another writer got there first
// (reload and decide again, never overwrite); schemas.ErrTooLarge.
func (c *Checkpoints) Update(ctx context.Context, cp *schemas.Checkpoint, rev uint64) (uint64, error) {
	if rev == 0 {
		return 0, fmt.Errorf("update checkpoint %s: revision 0 (use Create)", cp.JobID)
	}
	return c.write(ctx, cp, rev)
}

func (c *Checkpoints) write(ctx context.Context, cp *schemas.Checkpoint, rev uint64) (uint64, error) {
	f, err := c.WriteAsync(cp, rev)
	if err != nil {
		return 0, err
	}
	return f.Wait(ctx)
}

// PendingWrite is a checkpoint write in flight.
type PendingWrite struct {
	job  string
	rev  uint64
	size int
	f    jetstream.PubAckFuture
	kv   jetstream.KeyValue // for a create that met a delete or purge marker
	data []byte
	// gc: the write travels in a group commit.
	gc *committed
}

// WriteAsync starts a compare-and-swap write of cp expecting revision rev
// (0: the job must not exist; a delete or purge marker counts as absent,
// and Wait then writes over it with a compare-and-swap on the marker's
// revision, as jetstream.KeyValue.Create does) without waiting for the
// server. Many writes
// may be in flight at once; Wait collects each outcome. The expected
// revision travels as Nats-Expected-Last-Subject-Sequence (ADR-8, KV). A
// job id that is not a valid KV key gives jetstream.ErrInvalidKey.
func (c *Checkpoints) WriteAsync(cp *schemas.Checkpoint, rev uint64) (*PendingWrite, error) {
	// The id becomes a subject token (prepare checks it): a wildcard would
	// compare and write across other jobs' keys, an empty token is never
	// answered.
	w, err := c.prepare(cp, rev)
	if err != nil {
		return nil, err
	}
	if c.group != nil {
		w.gc = c.group.add(c.message(w))
		return w, nil
	}
	if w.f, err = c.js.PublishMsgAsync(c.message(w)); err != nil {
		return nil, fmt.Errorf("write checkpoint %s: %w", cp.JobID, err)
	}
	return w, nil
}

// prepare encodes cp as a write that has not been sent yet.
func (c *Checkpoints) prepare(cp *schemas.Checkpoint, rev uint64) (*PendingWrite, error) {
	if !validKey(cp.JobID) {
		return nil, fmt.Errorf("write checkpoint %q: %w", cp.JobID, jetstream.ErrInvalidKey)
	}
	data, err := c.Encode(cp)
	if err != nil {
		return nil, err
	}
	return &PendingWrite{job: cp.JobID, rev: rev, size: len(data), kv: c.kv, data: data}, nil
}

// message is w's stored form with its expected revision.
func (c *Checkpoints) message(w *PendingWrite) *nats.Msg {
	m := nats.NewMsg("$KV." + c.kv.Bucket() + "." + w.job)
	m.Data = w.data
	m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(w.rev, 10))
	return m
}

// GroupCommitCounts returns what the group committer has done (zero
// without Config.GroupCommit).
func (c *Checkpoints) GroupCommitCounts() GroupCommitCounts {
	if c.group == nil {
		return GroupCommitCounts{}
	}
	return c.group.counts()
}

// Wait blocks until the write is acknowledged or ctx ends, and returns the
// new revision. Errors: schemas.ErrConflict on a revision mismatch;
// schemas.ErrTooLarge if the bucket refused the size. Any other error
// leaves the outcome unknown: the write may or may not have
// been stored, so the caller must reload before deciding again.
func (p *PendingWrite) Wait(ctx context.Context) (uint64, error) {
	var err error
	if p.gc != nil {
		select {
		case <-p.gc.done:
		case <-ctx.Done():
			return 0, fmt.Errorf("write checkpoint %s: outcome unknown: %w", p.job, ctx.Err())
		}
		if p.gc.err == nil {
			return p.gc.seq, nil
		}
		if p.gc.unknown {
			return 0, fmt.Errorf("write checkpoint %s: outcome unknown: %w", p.job, p.gc.err)
		}
		err = p.gc.err
	} else {
		select {
		case ack := <-p.f.Ok():
			return ack.Sequence, nil
		case err = <-p.f.Err():
		case <-ctx.Done():
			return 0, fmt.Errorf("write checkpoint %s: outcome unknown: %w", p.job, ctx.Err())
		}
	}
	return p.refused(ctx, err)
}

// refused classifies the server's answer to a write it did not store.
func (p *PendingWrite) refused(ctx context.Context, err error) (uint64, error) {
	if isRevisionConflict(err) && p.rev == 0 {
		// The key may hold a delete or purge marker (a job removed by a
		// sweep) rather than a checkpoint: KeyValue.Create writes over
		// a marker with a compare-and-swap on its revision, and
		// reports a live key as existing.
		rev, cerr := p.kv.Create(ctx, p.job, p.data)
		if cerr == nil {
			return rev, nil
		}
		err = cerr
	}
	if isRevisionConflict(err) {
		if p.rev == 0 {
			return 0, schemas.Errorf(schemas.CodeConflict, "job %s already exists", p.job).WithCause(err)
		}
		return 0, schemas.Errorf(schemas.CodeConflict, "checkpoint %s changed since revision %d", p.job, p.rev).WithCause(err)
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum {
		// A bucket made with a smaller limit than Encode checks: refused, so not stored.
		return 0, (&schemas.Error{Code: schemas.CodeTooLarge, Job: p.job,
			Message: fmt.Sprintf("checkpoint is %d bytes; the bucket refused it as over its limit", p.size)}).WithCause(err)
	}
	return 0, fmt.Errorf("write checkpoint %s: outcome unknown: %w", p.job, err)
}

var validKeyRE = regexp.MustCompile(`^[-/_=.a-zA-Z0-9]+$`)

// validKey applies JetStream KV's key rules (those Get enforces through the
// client) to a job id.
func validKey(k string) bool {
	return k != "" && k[0] != '.' && k[len(k)-1] != '.' && !strings.Contains(k, "..") && validKeyRE.MatchString(k)
}

// isRevisionConflict classifies a compare-and-swap failure by the client's
// sentinels and both server codes (10071 on R1, 10164 on replicated streams).
func isRevisionConflict(err error) bool {
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		return apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
			apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
	}
	return false
}

// List calls fn with every stored checkpoint, in key order of the bucket's
// stream, until fn returns false or ctx ends. Entries that fail to decode
// are passed with a nil Checkpoint and the error.
func (c *Checkpoints) List(ctx context.Context, fn func(job string, e Entry, err error) bool) error {
	w, err := c.kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return fmt.Errorf("list checkpoints: %w", err)
	}
	defer w.Stop()
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("list checkpoints: %w", ctx.Err())
		case e, ok := <-w.Updates():
			if !ok {
				return nil
			}
			if e == nil { // initial values delivered
				return nil
			}
			cp, derr := DecodeCheckpoint(e.Key(), e.Value())
			if !fn(e.Key(), Entry{Checkpoint: cp, Revision: e.Revision(), Size: len(e.Value())}, derr) {
				return nil
			}
		}
	}
}

// Watch calls fn for job's current checkpoint and every later write until
// fn returns false or ctx ends.
func (c *Checkpoints) Watch(ctx context.Context, job string, fn func(e Entry, err error) bool) error {
	w, err := c.kv.Watch(ctx, job, jetstream.IgnoreDeletes())
	if err != nil {
		return fmt.Errorf("watch checkpoint %s: %w", job, err)
	}
	defer w.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case e, ok := <-w.Updates():
			if !ok {
				return fmt.Errorf("watch checkpoint %s: watcher closed", job)
			}
			if e == nil {
				continue
			}
			cp, derr := DecodeCheckpoint(job, e.Value())
			if !fn(Entry{Checkpoint: cp, Revision: e.Revision(), Size: len(e.Value())}, derr) {
				return nil
			}
		}
	}
}

// Remove deletes job's checkpoint if its revision is still rev (retention
// sweeps): a purge of the key's messages up to rev, so a checkpoint written
// since (the job reopened, or an id reused) survives, and no delete marker
// is left behind. The key can be created again.
func (c *Checkpoints) Remove(ctx context.Context, job string, rev uint64) error {
	return purgeUpTo(ctx, c.js, "KV_"+c.kv.Bucket(), "$KV."+c.kv.Bucket()+"."+job, rev)
}

// Size is the encoded size of the checkpoint being written, in bytes.
func (p *PendingWrite) Size() int { return p.size }

// GetFromLeader is Get, read from the bucket's stream leader rather than
// by a direct get, which any replica may answer and a replica behind the
// leader answers with an older revision (or none). Callers that drop work
// because a checkpoint says it is no longer current (a stale result, a
// fenced attempt) confirm with it first: on one server it is the same
// answer, on a cluster the current one. Errors as Get.
func (c *Checkpoints) GetFromLeader(ctx context.Context, job string) (Entry, error) {
	if !validKey(job) {
		return Entry{}, schemas.Errorf(schemas.CodeNotFound, "no job %q (not a valid job id)", job)
	}
	m, err := leaderLastMsg(ctx, c.js, "KV_"+c.kv.Bucket(), "$KV."+c.kv.Bucket()+"."+job)
	if err != nil {
		return Entry{}, fmt.Errorf("load checkpoint %s: %w", job, err)
	}
	if m == nil || m.Header.Get("KV-Operation") != "" {
		return Entry{}, schemas.Errorf(schemas.CodeNotFound, "no job %q", job)
	}
	cp, err := DecodeCheckpoint(job, m.Data)
	if err != nil {
		return Entry{}, err
	}
	return Entry{Checkpoint: cp, Revision: m.Sequence, Size: len(m.Data)}, nil
}

// leaderLastMsg reads subject's last message in stream through the
// stream's leader ($JS.API.STREAM.MSG.GET), nil when there is none.
func leaderLastMsg(ctx context.Context, js jetstream.JetStream, stream, subject string) (*jetstream.RawStreamMsg, error) {
	req, _ := json.Marshal(map[string]string{"last_by_subj": subject})
	var r struct {
		Message *struct {
			Subject string    `json:"subject"`
			Seq     uint64    `json:"seq"`
			Header  []byte    `json:"hdrs"`
			Data    []byte    `json:"data"`
			Time    time.Time `json:"time"`
		} `json:"message"`
		Error *jetstream.APIError `json:"error"`
	}
	if err := apiRequest(ctx, js, "STREAM.MSG.GET."+stream, req, &r); err != nil {
		return nil, fmt.Errorf("read %s: %w", subject, err)
	}
	if r.Error != nil {
		if r.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound {
			return nil, nil
		}
		return nil, fmt.Errorf("read %s: %w", subject, r.Error)
	}
	if r.Message == nil {
		return nil, fmt.Errorf("read %s: empty answer", subject)
	}
	m := &jetstream.RawStreamMsg{Subject: r.Message.Subject, Sequence: r.Message.Seq, Data: r.Message.Data, Time: r.Message.Time}
	if len(r.Message.Header) > 0 {
		var err error
		if m.Header, err = nats.DecodeHeadersMsg(r.Message.Header); err != nil {
			return nil, fmt.Errorf("read %s: headers: %w", subject, err)
		}
	}
	return m, nil
}
