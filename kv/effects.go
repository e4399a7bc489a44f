package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// Effects is the effect ledger: one record per logical side effect, keyed
// by its idempotency key, in a KV bucket that keeps records for the job's
// lifetime plus a retention (not the JetStream duplicate window: DESIGN.md
// invariant 5). Every transition is a compare-and-swap on the revision
// read. Safe for concurrent use.
type Effects struct {
	kv       jetstream.KeyValue
	js       jetstream.JetStream
	maxBytes int
}

// EffectEntry is a decoded record with its revision.
type EffectEntry struct {
	Record   *schemas.EffectRecord
	Revision uint64
}

// Get returns the record under key. Errors: schemas.ErrNotFound.
func (e *Effects) Get(ctx context.Context, key string) (EffectEntry, error) {
	ent, err := e.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrInvalidKey) {
		return EffectEntry{}, schemas.Errorf(schemas.CodeNotFound, "no effect %q", key)
	}
	if err != nil {
		return EffectEntry{}, fmt.Errorf("load effect %s: %w", key, err)
	}
	var r schemas.EffectRecord
	if err := json.Unmarshal(ent.Value(), &r); err != nil {
		return EffectEntry{}, schemas.Errorf(schemas.CodeQuarantined, "effect record %s does not decode: %v", key, err)
	}
	return EffectEntry{Record: &r, Revision: ent.Revision()}, nil
}

// Create writes a new record (create-only) and returns its revision. A
// key whose record was deleted or purged (a retention sweep) counts as
// absent, as with jetstream.KeyValue.Create. Errors: schemas.ErrConflict
// if the key exists; schemas.ErrTooLarge.
func (e *Effects) Create(ctx context.Context, r *schemas.EffectRecord) (uint64, error) {
	return e.write(ctx, r, 0)
}

// Update writes r if the record's revision is still rev. Errors:
// schemas.ErrConflict when another writer got there first.
func (e *Effects) Update(ctx context.Context, r *schemas.EffectRecord, rev uint64) (uint64, error) {
	if rev == 0 {
		return 0, fmt.Errorf("update effect %s: revision 0 (use Create)", r.Key)
	}
	return e.write(ctx, r, rev)
}

func (e *Effects) write(ctx context.Context, r *schemas.EffectRecord, rev uint64) (uint64, error) {
	if !validKey(r.Key) {
		return 0, fmt.Errorf("write effect %q: %w", r.Key, jetstream.ErrInvalidKey)
	}
	data, err := schemas.Marshal(r)
	if err != nil {
		return 0, fmt.Errorf("encode effect %s: %w", r.Key, err)
	}
	if len(data) > e.maxBytes {
		return 0, &schemas.Error{Code: schemas.CodeTooLarge, Job: r.Job, Step: r.Step,
			Message: fmt.Sprintf("effect record %s is %d bytes; the limit is %d (store large results elsewhere)", r.Key, len(data), e.maxBytes)}
	}
	m := nats.NewMsg("$KV." + e.kv.Bucket() + "." + r.Key)
	m.Data = data
	m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(rev, 10))
	ack, err := e.js.PublishMsg(ctx, m)
	if err != nil && rev == 0 && isRevisionConflict(err) {
		// A record removed by a sweep leaves a delete or purge marker:
		// KeyValue.Create writes over one with a compare-and-swap on its
		// revision, and reports a live record as existing.
		var seq uint64
		if seq, err = e.kv.Create(ctx, r.Key, data); err == nil {
			return seq, nil
		}
	}
	if err != nil {
		if isRevisionConflict(err) {
			return 0, schemas.Errorf(schemas.CodeConflict, "effect %s changed since revision %d", r.Key, rev).WithCause(err)
		}
		return 0, fmt.Errorf("write effect %s: outcome unknown: %w", r.Key, err)
	}
	return ack.Sequence, nil
}

// Delete removes a record (retention sweeps).
func (e *Effects) Delete(ctx context.Context, key string) error {
	if err := e.kv.Purge(ctx, key); err != nil {
		return fmt.Errorf("delete effect %s: %w", key, err)
	}
	return nil
}

// List calls fn with every record until fn returns false.
func (e *Effects) List(ctx context.Context, fn func(EffectEntry) bool) error {
	w, err := e.kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return fmt.Errorf("list effects: %w", err)
	}
	defer w.Stop()
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("list effects: %w", ctx.Err())
		case ent, ok := <-w.Updates():
			if !ok || ent == nil {
				return nil
			}
			var r schemas.EffectRecord
			if err := json.Unmarshal(ent.Value(), &r); err != nil {
				continue
			}
			if !fn(EffectEntry{Record: &r, Revision: ent.Revision()}) {
				return nil
			}
		}
	}
}

// Remove deletes the record under key if its revision is still rev
// (retention sweeps): a purge of the key's messages up to rev, which
// leaves no delete marker, so the key can be created again.
func (e *Effects) Remove(ctx context.Context, key string, rev uint64) error {
	if !validKey(key) {
		return fmt.Errorf("remove effect %q: %w", key, jetstream.ErrInvalidKey)
	}
	return purgeUpTo(ctx, e.js, "KV_"+e.kv.Bucket(), "$KV."+e.kv.Bucket()+"."+key, rev)
}
