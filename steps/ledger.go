package steps

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// This file is the worker's side of the effect ledger (DESIGN.md
// invariants 4 and 5). A step whose effect class is not pure runs through
// runEffect, which records the effect prepared (create-only) before the
// call, dispatched just before it, confirmed with the result right after,
// and consults the record before any call: a settled effect answers
// without calling out; one that may have been performed is retried with
// the same key (idempotent), looked up (lookup), or declared ambiguous
// (unsafe) for a person to settle. A missing response is never taken as
// "did not happen".

// Looker is implemented by a kind's Runner whose provider can be asked
// whether the action with the call's idempotency key happened (effect
// class lookup). found=false means it certainly did not; an error means
// the question could not be answered.
type Looker interface {
	Lookup(ctx context.Context, c *Call) (found bool, output any, err error)
}

// Outcome lets a Runner report, with its output, the provider's id for
// the effect (a charge id, a ticket number); the ledger records it.
type Outcome struct {
	Output     any
	ExternalID string
}

// NotPerformed marks err as a refusal: the provider answered and did not
// perform the action (an HTTP 4xx, say), so calling again is safe even
// for an unsafe effect. Errors without it leave the outcome unknown.
func NotPerformed(err error) error {
	if err == nil {
		return nil
	}
	var se *stepError
	if errors.As(err, &se) {
		c := *se
		c.notPerformed = true
		return &c
	}
	e := toError(err)
	return &stepError{err: e, retryable: e.Retryable, notPerformed: true}
}

func notPerformed(err error) bool {
	var se *stepError
	return errors.As(err, &se) && se.notPerformed
}

// errStaleAttempt: the attempt is no longer the job's current one (the
// engine moved on). The worker acknowledges the message and publishes
// nothing.
var errStaleAttempt = errors.New("attempt is no longer current")

// errOvertaken: a later delivery of this attempt's step message (this
// worker's lease ran out, and another worker took the step) owns the
// effect's record. The worker writes nothing more to the ledger,
// publishes nothing, and leaves the message to the delivery that owns it.
var errOvertaken = errors.New("a later delivery owns the effect")

// effectKey is the call's ledger key when the step message does not carry
// one (an engine older than the key): the idempotency key the engine
// derived (job, step, run), or, when the step names its action with an
// idempotency_key template, the workflow, the step and a digest of that.
func (ps *preparedStep) effectKey(c *Call) (string, error) {
	if ps.keyTemplate == nil {
		return c.IdempotencyKey, nil
	}
	data, err := c.TemplateData()
	if err != nil {
		return "", err
	}
	v, err := render(ps.keyTemplate, data)
	if err != nil {
		return "", err
	}
	if v == "" {
		return "", fmt.Errorf("idempotency_key rendered empty")
	}
	sum := sha256.Sum256([]byte(v))
	return ps.def.Name + "/" + ps.step.ID + "/k-" + hex.EncodeToString(sum[:16]), nil
}

// fence reports errStaleAttempt unless the checkpoint still records this
// attempt as the step's current dispatch (the fencing token).
// A direct read may come from a replica behind the leader; before the
// attempt is dropped as stale, the leader confirms.
func (w *Worker) fence(ctx context.Context, c *Call) error {
	_, err := w.fenceJob(ctx, c)
	return err
}

// fenceJob is fence returning the job's IndexRev (which creation of the
// job this is).
func (w *Worker) fenceJob(ctx context.Context, c *Call) (uint64, error) {
	current := func(ent kv.Entry) bool {
		cp := ent.Checkpoint
		// A fan's dispatches go on while one of its effects waits for a person.
		running := cp.Status == schemas.JobRunning || (cp.Fan != nil && cp.Status == schemas.JobNeedsReconciliation)
		return running && cp.DispatchOf(c.Step.ID, c.Item, c.Attempt) != nil
	}
	ent, err := w.store.Checkpoints.Get(ctx, c.Job)
	if err == nil && current(ent) {
		return ent.Checkpoint.IndexRev, nil
	}
	if err != nil && !errors.Is(err, schemas.ErrNotFound) {
		return 0, Retryable(fmt.Errorf("read checkpoint for fencing: %w", err))
	}
	ent, err = w.store.Checkpoints.GetFromLeader(ctx, c.Job)
	switch {
	case errors.Is(err, schemas.ErrNotFound):
		return 0, errStaleAttempt // the job is gone (swept): nothing to report to
	case err != nil:
		return 0, Retryable(fmt.Errorf("read checkpoint for fencing: %w", err))
	case !current(ent):
		return 0, errStaleAttempt
	}
	return ent.Checkpoint.IndexRev, nil
}

// leftOver reports whether rec, found under the key of job's own effect,
// was written by an earlier job with the same id (creation indexRev is
// this one): its record outlived its checkpoint, and this job's effect
// has not happened.
func leftOver(rec *schemas.EffectRecord, job string, indexRev uint64) bool {
	return rec.Job == job && rec.AttemptOf == "" && len(rec.SharedBy) == 0 &&
		rec.JobIndexRev != 0 && indexRev != 0 && rec.JobIndexRev != indexRev
}

// attemptJob is the job whose attempt last wrote rec.
func attemptJob(rec *schemas.EffectRecord) string {
	if rec.AttemptOf != "" {
		return rec.AttemptOf
	}
	return rec.Job
}

// overtakes reports whether rec was last written by a later attempt or
// delivery of c's own job than (c.Attempt, delivery).
func overtakes(rec *schemas.EffectRecord, c *Call, delivery uint64) bool {
	return attemptJob(rec) == c.Job && (rec.Attempt > c.Attempt || (rec.Attempt == c.Attempt && rec.Delivery > delivery))
}

// share returns rec with job listed among the jobs sharing it (a copy
// when it changes), and whether it changed.
func share(rec *schemas.EffectRecord, job string) (*schemas.EffectRecord, bool) {
	if rec.Job == job || slices.Contains(rec.SharedBy, job) {
		return rec, false
	}
	next := *rec
	next.SharedBy = append(slices.Clone(rec.SharedBy), job)
	return &next, true
}

// runEffect performs the call under the ledger's protocol. state receives
// the record's state when the attempt ends in an error, for the engine to
// tell a failure that may have left the effect done from one that did not.
func (w *Worker) runEffect(ctx context.Context, ps *preparedStep, c *Call, delivery uint64, state *schemas.EffectState) (any, error) {
	class := ps.def.EffectOf(ps.step)
	key := c.IdempotencyKey
	indexRev, err := w.fenceJob(ctx, c)
	if err != nil {
		return nil, err
	}
	eff := w.store.Effects
	now := time.Now().UTC()
	var rec *schemas.EffectRecord
	var rev uint64
	for try := 0; ; try++ {
		if try == 8 {
			return nil, Retryable(fmt.Errorf("effect %s: kept changing under this attempt", key))
		}
		ent, err := eff.Get(ctx, key)
		fresh := func() *schemas.EffectRecord {
			return &schemas.EffectRecord{Key: key, Job: c.Job, Step: c.Step.ID, Class: class, State: schemas.EffectPrepared,
				Attempt: c.Attempt, Delivery: delivery, Worker: w.cfg.ID, JobIndexRev: indexRev, PreparedAt: now, UpdatedAt: now}
		}
		switch {
		case errors.Is(err, schemas.ErrNotFound):
			rec = fresh()
			rev, err = eff.Create(ctx, rec)
			if errors.Is(err, schemas.ErrConflict) {
				continue // prepared by a concurrent delivery: decide on its record
			}
			if err != nil {
				return nil, Retryable(err)
			}
			w.effectEvent(ctx, rec, rev, schemas.EventEffectPrepared)
		case err != nil:
			return nil, Retryable(err)
		case leftOver(ent.Record, c.Job, indexRev):
			w.log.Warn("effect record left by an earlier job with this id; replacing it, this job's effect has not happened",
				"key", key, "job", c.Job, "record_index_rev", ent.Record.JobIndexRev, "job_index_rev", indexRev)
			rec = fresh()
			rev, err = eff.Update(ctx, rec, ent.Revision)
			if errors.Is(err, schemas.ErrConflict) {
				continue
			}
			if err != nil {
				return nil, Retryable(err)
			}
			w.effectEvent(ctx, rec, rev, schemas.EventEffectPrepared)
		default:
			rec, rev = ent.Record, ent.Revision
		}
		*state = rec.State
		if rec.Settled() {
			if try > 0 {
				// This attempt lost a race for the record: the engine may have
				// moved on meanwhile.
				if err := w.fence(ctx, c); err != nil {
					return nil, err
				}
			}
			if shared, changed := share(rec, c.Job); changed {
				// Another job's action with the same key: this job takes its
				// result, and the record must outlive this job's use of it.
				if _, err := eff.Update(ctx, shared, rev); err != nil {
					if errors.Is(err, schemas.ErrConflict) {
						continue
					}
					return nil, Retryable(err)
				}
			}
			// Performed before, with a known result: answer with it.
			w.ctr.replayedEffects.Add(1)
			if rec.State == schemas.EffectConfirmed {
				// The worker that confirmed it may have died before it told
				// the history: tell it again. The copy has the original's
				// ids, so the stream or the history's readers drop it.
				w.effectEvent(ctx, rec, rev, schemas.EventEffectConfirmed)
			}
			w.effectEvent(ctx, rec, rev, schemas.EventEffectReplayed)
			return recordedOutput(rec), nil
		}
		if rec.State == schemas.EffectAmbiguous {
			return nil, ambiguousError(rec)
		}
		if overtakes(rec, c, delivery) {
			return nil, errOvertaken
		}
		mine := attemptJob(rec) == c.Job
		if rec.State == schemas.EffectDispatched {
			switch {
			case class == schemas.EffectIdempotent:
				// Safe to call again: the provider recognises the key.
			case !mine:
				// Another job's call with the same key may be under way; only
				// an idempotent provider can take a second one. This step waits
				// for its outcome, without using up an attempt.
				return nil, &schemas.Error{Code: schemas.CodeWaiting, Retryable: true,
					Message: fmt.Sprintf("effect %s is being performed by job %s; this step waits for its outcome", key, attemptJob(rec))}
			case class == schemas.EffectLookup:
				if out, found, err := w.lookup(ctx, ps, c); err != nil {
					return nil, Retryable(fmt.Errorf("effect %s: look up whether it happened: %w", key, err))
				} else if found {
					return w.confirm(ctx, rec, rev, c, delivery, out)
				}
			default:
				next := *rec
				next.State, next.UpdatedAt, next.SettledAt = schemas.EffectAmbiguous, now, now
				next.Reason = "an earlier attempt dispatched the call and its outcome was never recorded; the provider can neither deduplicate nor be asked"
				nrev, err := eff.Update(ctx, &next, rev)
				if errors.Is(err, schemas.ErrConflict) {
					continue
				}
				if err != nil {
					return nil, Retryable(err)
				}
				*state = next.State
				w.ctr.ambiguousEffects.Add(1)
				w.effectEvent(ctx, &next, nrev, schemas.EventEffectAmbiguous)
				return nil, ambiguousError(&next)
			}
		}
		w.cfg.Failpoints.InjectStep(ctx, failpoint.WorkerAfterPrepared, c.failpointStep())
		next, _ := share(rec, c.Job)
		if next == rec {
			cp := *rec
			next = &cp
		}
		next.State, next.Attempt, next.Delivery, next.Worker = schemas.EffectDispatched, c.Attempt, delivery, w.cfg.ID
		next.AttemptOf = ""
		if c.Job != next.Job {
			next.AttemptOf = c.Job
		} else if next.JobIndexRev == 0 {
			next.JobIndexRev = indexRev
		}
		next.DispatchedAt, next.UpdatedAt, next.LastError = now, now, nil
		next.Happened = nil // a resolution that said "did not happen" is superseded by this call
		next.Calls++
		nrev, err := eff.Update(ctx, next, rev)
		if errors.Is(err, schemas.ErrConflict) {
			continue
		}
		if err != nil {
			return nil, Retryable(err)
		}
		rec, rev = next, nrev
		break
	}
	*state = schemas.EffectDispatched
	w.effectEvent(ctx, rec, rev, schemas.EventEffectDispatched)

	out, runErr := safeRun(ctx, ps.runner, c)
	w.cfg.Failpoints.InjectStep(ctx, failpoint.WorkerAfterRemoteCommit, c.failpointStep())
	// Whatever happened must be recorded, even if this attempt's context
	// has ended meanwhile (a timeout, a worker shutting down).
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if runErr != nil {
		return nil, w.callFailed(lctx, rec, rev, class, c, delivery, runErr, state)
	}
	return w.confirm(lctx, rec, rev, c, delivery, out)
}

// confirm records the effect's result, then checks the fencing token again
// before the result is published. A worker overtaken meanwhile by a later
// delivery of its own step writes nothing (errOvertaken): the record is
// that delivery's, and an idempotent provider gave both calls one outcome.
func (w *Worker) confirm(ctx context.Context, rec *schemas.EffectRecord, rev uint64, c *Call, delivery uint64, out any) (any, error) {
	raw, err := encodeOutput(out)
	if err != nil {
		return nil, NonRetryable(err)
	}
	now := time.Now().UTC()
	for try := 0; ; try++ {
		next := *rec
		next.State, next.Result, next.ResultDigest = schemas.EffectConfirmed, raw, digestOf(raw)
		next.ExternalID = externalID(out, raw)
		next.SettledAt, next.UpdatedAt, next.LastError, next.Reason = now, now, nil, ""
		nrev, err := w.store.Effects.Update(ctx, &next, rev)
		if errors.Is(err, schemas.ErrConflict) && try < 8 {
			ent, gerr := w.store.Effects.Get(ctx, rec.Key)
			if gerr != nil {
				return nil, Retryable(gerr)
			}
			if ent.Record.State == schemas.EffectAmbiguous {
				// A later delivery declared the outcome unknown and stopped
				// the job; this answer settles it.
				return w.settleLate(ctx, ent.Record, ent.Revision, c, raw, out)
			}
			if overtakes(ent.Record, c, delivery) {
				w.log.Info("overtaken by a later delivery while the call was under way; leaving the effect to it", "job", c.Job, "key", rec.Key)
				return nil, errOvertaken
			}
			if ent.Record.Settled() {
				// Another job sharing the key settled it first.
				return recordedOutput(ent.Record), w.fence(ctx, c)
			}
			// Another job sharing the key wrote meanwhile: this call did
			// happen, so record it over theirs.
			rec, rev = ent.Record, ent.Revision
			continue
		}
		if err != nil && !errors.Is(err, schemas.ErrConflict) && try < 5 && ctx.Err() == nil {
			// A passing fault: the result is in hand, keep trying to record
			// it rather than leave the next attempt to guess.
			select {
			case <-time.After(time.Duration(100<<try) * time.Millisecond):
			case <-ctx.Done():
			}
			continue
		}
		if err != nil {
			// The call happened but is not recorded: leave it dispatched; the
			// next attempt retries with the key, looks it up, or reports it
			// ambiguous.
			return nil, Retryable(fmt.Errorf("effect %s performed but not recorded: %w", rec.Key, err))
		}
		w.cfg.Failpoints.InjectStep(ctx, failpoint.WorkerAfterConfirm, c.failpointStep())
		w.effectEvent(ctx, &next, nrev, schemas.EventEffectConfirmed)
		if err := w.fence(ctx, c); err != nil {
			return nil, err
		}
		return json.RawMessage(raw), nil
	}
}

// settleLate records the answer of a call that returned after a later
// delivery had declared the effect ambiguous: the outcome is known now, so
// the effect is reconciled as happened with this result, as a person would
// with engine effects resolve --happened, and every job waiting on it is
// told. This attempt itself is stale by then: its result is not published.
func (w *Worker) settleLate(ctx context.Context, rec *schemas.EffectRecord, rev uint64, c *Call, raw []byte, out any) (any, error) {
	now := time.Now().UTC()
	for try := 0; ; try++ {
		if rec.State != schemas.EffectAmbiguous {
			// Settled meanwhile (a person resolved it): their answer stands.
			return recordedOutput(rec), w.fence(ctx, c)
		}
		happened := true
		next := *rec
		next.State, next.Happened = schemas.EffectReconciled, &happened
		next.ReconciledBy = fmt.Sprintf("worker %s: the call of attempt %d returned after the effect was declared ambiguous", w.cfg.ID, c.Attempt)
		next.Result, next.ResultDigest, next.ExternalID = raw, digestOf(raw), externalID(out, raw)
		next.SettledAt, next.UpdatedAt, next.LastError = now, now, nil
		nrev, err := w.store.Effects.Update(ctx, &next, rev)
		if errors.Is(err, schemas.ErrConflict) && try < 8 {
			ent, gerr := w.store.Effects.Get(ctx, rec.Key)
			if gerr != nil {
				return nil, Retryable(gerr)
			}
			rec, rev = ent.Record, ent.Revision
			continue
		}
		if err != nil {
			return nil, Retryable(fmt.Errorf("effect %s performed, but recording it over the ambiguous record failed: %w", rec.Key, err))
		}
		w.effectEvent(ctx, &next, nrev, schemas.EventEffectReconciled)
		for _, job := range append([]string{next.Job}, next.SharedBy...) {
			if err := w.signalResolved(ctx, job, &next, nrev); err != nil {
				// The engine's reconciler resumes jobs whose effect was
				// resolved while the signal was lost.
				w.log.Warn("effect settled by a late answer; telling the job failed", "job", job, "key", rec.Key, "err", err)
			}
		}
		w.ctr.settledLate.Add(1)
		return recordedOutput(&next), w.fence(ctx, c)
	}
}

// signalResolved tells job that the effect rec, blocking it, was resolved
// (the same signal engine effects resolve sends).
func (w *Worker) signalResolved(ctx context.Context, job string, rec *schemas.EffectRecord, rev uint64) error {
	sig, err := json.Marshal(schemas.Signal{Job: job, Type: schemas.SignalEffectResolved, Key: rec.Key, By: rec.ReconciledBy})
	if err != nil {
		return err
	}
	m := nats.NewMsg(w.store.Names.InboxSubject(kv.InboxSignal, job))
	m.Data = sig
	m.Header.Set(jetstream.MsgIDHeader, job+"/resolve/"+strconv.FormatUint(rev, 10))
	_, err = w.store.JS.PublishMsg(ctx, m)
	return err
}

// callFailed records a failed call: a refusal returns the record to
// prepared (calling again is safe); an unknown outcome leaves it
// dispatched, or makes an unsafe effect ambiguous at once. A worker
// overtaken meanwhile writes nothing (errOvertaken).
func (w *Worker) callFailed(ctx context.Context, rec *schemas.EffectRecord, rev uint64, class schemas.EffectClass, c *Call, delivery uint64, runErr error, state *schemas.EffectState) error {
	now := time.Now().UTC()
	next := *rec
	next.LastError = toError(runErr)
	next.UpdatedAt = now
	evType := ""
	switch {
	case notPerformed(runErr):
		next.State = schemas.EffectPrepared
		evType = schemas.EventEffectPrepared
	case class == schemas.EffectUnsafe:
		next.State, next.SettledAt = schemas.EffectAmbiguous, now
		next.Reason = "the call failed without a clear answer (" + next.LastError.Message + "); the provider can neither deduplicate nor be asked"
		evType = schemas.EventEffectAmbiguous
	}
	nrev, err := w.store.Effects.Update(ctx, &next, rev)
	if errors.Is(err, schemas.ErrConflict) {
		if ent, gerr := w.store.Effects.Get(ctx, rec.Key); gerr == nil {
			*state = ent.Record.State
			if overtakes(ent.Record, c, delivery) {
				return errOvertaken
			}
		}
		return Retryable(fmt.Errorf("%w (and recording the failure: %v)", runErr, err))
	}
	if err != nil {
		return Retryable(fmt.Errorf("%w (and recording the failure: %v)", runErr, err))
	}
	*state = next.State
	if evType != "" {
		w.effectEvent(ctx, &next, nrev, evType)
	}
	if next.State == schemas.EffectAmbiguous {
		w.ctr.ambiguousEffects.Add(1)
		return ambiguousError(&next)
	}
	return runErr
}

func (w *Worker) lookup(ctx context.Context, ps *preparedStep, c *Call) (any, bool, error) {
	l, ok := ps.runner.(Looker)
	if !ok {
		return nil, false, fmt.Errorf("step kind %q cannot look effects up (effect class lookup needs it)", ps.step.Kind)
	}
	found, out, err := l.Lookup(ctx, c)
	return out, found, err
}

func ambiguousError(rec *schemas.EffectRecord) error {
	return &schemas.Error{Code: schemas.CodeAmbiguous,
		Message: fmt.Sprintf("effect %s is ambiguous: %s; settle it with `engine effects resolve %s --happened|--not-happened`", rec.Key, rec.Reason, rec.Key)}
}

func recordedOutput(rec *schemas.EffectRecord) json.RawMessage {
	if len(rec.Result) == 0 {
		return json.RawMessage("{}")
	}
	return rec.Result
}

// externalID takes the provider's id from an Outcome, else from a
// top-level "id" of the output.
func externalID(out any, raw []byte) string {
	if o, ok := out.(*Outcome); ok && o.ExternalID != "" {
		return o.ExternalID
	}
	var top struct {
		ID any `json:"id"`
	}
	if json.Unmarshal(raw, &top) != nil {
		return ""
	}
	switch v := top.ID.(type) {
	case string:
		return v
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	return ""
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:16])
}

// effectEvent appends a ledger transition to the job's history. The
// record itself is the source of truth; an event lost to a crash is a gap
// in the narrative, not in the ledger.
func (w *Worker) effectEvent(ctx context.Context, rec *schemas.EffectRecord, rev uint64, typ string) {
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := w.store.AppendEffectEvent(pctx, rec.Job, "/waymark/worker", typ, rec, rev, time.Now().UTC()); err != nil {
		w.log.Warn("effect event not recorded in history", "key", rec.Key, "type", typ, "err", err)
	}
}
