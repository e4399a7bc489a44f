package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// sweepSlack is how far past the first job that is not yet due a sweep
// looks on: ended entries are written in about the order jobs ended, not
// exactly (an entry the reconciler writes late comes later).
const sweepSlack = time.Hour

// SweepJobs removes the jobs that finished more than the layout's
// JobRetention ago (nothing when it keeps finished jobs forever): for each,
// the effect records no live job uses, its history, its checkpoint and its
// index entry, in that order, each removal conditional on the revision
// read, so a crash between two of them is finished by the next sweep and a
// job reopened meanwhile keeps everything. A record of a shared effect
// (several jobs used one idempotency_key) stays while another job that
// uses it is kept. It reads finished jobs oldest first and stops past the
// ones due. It returns the first error after trying every due job.
func (e *Engine) SweepJobs(ctx context.Context) error {
	keep := e.store.Config.JobRetention
	if keep < 0 {
		return nil
	}
	now := e.cfg.Now()
	cutoff := now.Add(-keep)
	var due []kv.IndexEntry
	err := e.store.Jobs.Ended(ctx, func(ie kv.IndexEntry) bool {
		if ie.EndedAt == nil || ie.EndedAt.Before(cutoff) {
			due = append(due, ie)
			return true
		}
		return ie.EndedAt.Before(cutoff.Add(sweepSlack))
	})
	if err != nil {
		return err
	}
	var firstErr error
	for _, ie := range due {
		if err := e.sweepJob(ctx, ie); err != nil {
			e.ctr.reconcileErrors.Add(1)
			if firstErr == nil {
				firstErr = err
			}
		}
	}
	return firstErr
}

func (e *Engine) sweepJob(ctx context.Context, ie kv.IndexEntry) error {
	ent, err := e.store.Checkpoints.Get(ctx, ie.Job)
	switch {
	case errors.Is(err, schemas.ErrNotFound):
		// Removed by an earlier sweep that stopped before the index.
	case err != nil:
		return fmt.Errorf("sweep job %s: %w", ie.Job, err)
	default:
		cp := ent.Checkpoint
		if !cp.Status.Terminal() || cp.CompletedAt == nil || ie.EndedAt == nil || !cp.CompletedAt.Equal(*ie.EndedAt) {
			// The job was reopened (or its id reused) since: this entry is
			// stale and the job's data is not ours to remove.
			if err := e.store.Jobs.Remove(ctx, ie.Key, ie.Revision); err != nil {
				return fmt.Errorf("sweep job %s: %w", ie.Job, err)
			}
			e.ctr.indexRepaired.Add(1)
			return nil
		}
		keys, err := e.effectKeysOf(ctx, cp)
		if err != nil {
			return fmt.Errorf("sweep job %s: find its effect records: %w", ie.Job, err)
		}
		if len(keys) > 0 {
			// Providers may remember the keys; a job started again under
			// this id must not send them.
			if err := e.store.Jobs.MarkSwept(ctx, cp.JobID); err != nil {
				return fmt.Errorf("sweep job %s: %w", ie.Job, err)
			}
		}
		for _, key := range keys {
			if err := e.sweepEffect(ctx, cp.JobID, key); err != nil {
				return fmt.Errorf("sweep job %s: %w", ie.Job, err)
			}
		}
	}
	if err == nil && ent.Checkpoint != nil && e.store.Values != nil {
		// The values its state keeps by reference are the job's own.
		refs, ferr := schemas.FindRefs(ent.Checkpoint.State)
		if ferr == nil && ent.Checkpoint.Fan != nil {
			for _, ch := range ent.Checkpoint.Fan.Chunks {
				refs = append(refs, schemas.ValueRef{Digest: ch.Digest, Bytes: ch.Bytes})
			}
		}
		for _, p := range ent.Checkpoint.Transcripts { // its agents' transcripts
			refs = append(refs, p.Ref())
		}
		if len(refs) > 0 {
			if err := e.store.Values.DeleteOwner(ctx, ent.Checkpoint.MsgPrefix(), refs); err != nil {
				return fmt.Errorf("sweep job %s: delete its stored values: %w", ie.Job, err)
			}
		}
	}
	if err := e.store.History.Purge(ctx, ie.Job); err != nil {
		return fmt.Errorf("sweep job %s: %w", ie.Job, err)
	}
	if err == nil && ent.Checkpoint != nil {
		if err := e.store.Checkpoints.Remove(ctx, ie.Job, ent.Revision); err != nil {
			return fmt.Errorf("sweep job %s: %w", ie.Job, err)
		}
	}
	if err := e.store.Jobs.Remove(ctx, ie.Key, ie.Revision); err != nil {
		return fmt.Errorf("sweep job %s: %w", ie.Job, err)
	}
	e.ctr.jobsSwept.Add(1)
	return nil
}

// effectKeysOf lists the ledger keys a job may have written: the derived
// key of every run of each step that is not pure, and the shared keys its
// checkpoint recorded. Keys that were never written are looked up and
// skipped. Without the job's definition (deleted by hand) it reads the
// whole ledger for the records that name the job.
func (e *Engine) effectKeysOf(ctx context.Context, cp *schemas.Checkpoint) ([]string, error) {
	keys := slices.Clone(cp.EffectKeys)
	def, err := e.store.Definitions.Get(ctx, cp.DefinitionHash)
	if errors.Is(err, schemas.ErrNotFound) {
		e.log.Warn("sweep: the job's definition is missing; reading the whole effect ledger for its records",
			"job", cp.JobID, "definition", cp.DefinitionHash)
		err = e.store.Effects.List(ctx, func(ent kv.EffectEntry) bool {
			if r := ent.Record; r.Job == cp.JobID || slices.Contains(r.SharedBy, cp.JobID) {
				keys = append(keys, r.Key)
			}
			return true
		})
		return keys, err
	}
	if err != nil {
		return nil, err
	}
	for i := range def.Steps {
		if s := &def.Steps[i]; s.ForEach != nil && def.EffectOf(s) != schemas.EffectPure {
			// Item keys are named after the items, which the job's final
			// state may no longer hold: read the ledger for the job's records.
			err = e.store.Effects.List(ctx, func(ent kv.EffectEntry) bool {
				if r := ent.Record; r.Job == cp.JobID || slices.Contains(r.SharedBy, cp.JobID) {
					keys = append(keys, r.Key)
				}
				return true
			})
			slices.Sort(keys)
			return slices.Compact(keys), err
		}
	}
	for i := range def.Steps {
		s := &def.Steps[i]
		if def.EffectOf(s) == schemas.EffectPure || s.IdempotencyKey != "" {
			continue
		}
		runs := 0
		if r := cp.Steps[s.ID]; r != nil {
			runs = r.Runs
		} else if cp.Completed.Has(i) {
			runs = 1
		}
		for run := 1; run <= runs; run++ {
			keys = append(keys, schemas.IdempotencyKey(cp.KeyBase(), s.ID, run))
		}
	}
	return keys, nil
}

// sweepEffect removes job's use of the record under key: the record
// itself when no other job shares it, else job's name from it (passing it
// on to a sharer when job created it). Every write is conditional on the
// revision read.
func (e *Engine) sweepEffect(ctx context.Context, job, key string) error {
	for try := 0; try < 8; try++ {
		ent, err := e.store.Effects.Get(ctx, key)
		if errors.Is(err, schemas.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		rec := *ent.Record
		others := slices.DeleteFunc(slices.Clone(rec.SharedBy), func(j string) bool { return j == job })
		if rec.Job != job && len(others) == len(rec.SharedBy) {
			return nil // job does not use it
		}
		if len(others) == 0 && (rec.Job == job || rec.Job == "") {
			if err := e.store.Effects.Remove(ctx, key, ent.Revision); err != nil {
				return err
			}
			e.ctr.swept.Add(1)
			return nil
		}
		if rec.Job == job {
			rec.Job, others = others[0], others[1:]
		}
		rec.SharedBy = others
		rec.UpdatedAt = e.cfg.Now().UTC()
		if _, err := e.store.Effects.Update(ctx, &rec, ent.Revision); err == nil {
			return nil
		} else if !errors.Is(err, schemas.ErrConflict) {
			return err
		}
	}
	return fmt.Errorf("effect %s kept changing", key)
}
