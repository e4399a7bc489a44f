package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// Events is the events bucket (<prefix>_events): one dedup record per
// CloudEvent that started jobs, keyed by schemas.EventKey(source, id), kept
// for Config.EventRetention (the bucket's TTL). Safe for concurrent use.
type Events struct {
	kv jetstream.KeyValue
}

// Get returns the record of the event (source, id). Errors:
// schemas.ErrNotFound when there is none (never seen, or expired);
// anything else wrapped with the source and id.
func (e *Events) Get(ctx context.Context, source, id string) (*schemas.EventRecord, error) {
	ent, err := e.kv.Get(ctx, schemas.EventKey(source, id))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, schemas.Errorf(schemas.CodeNotFound, "no record of event %q from %q", id, source)
	}
	if err != nil {
		return nil, fmt.Errorf("read event record %q from %q: %w", id, source, err)
	}
	var rec schemas.EventRecord
	if err := json.Unmarshal(ent.Value(), &rec); err != nil {
		return nil, fmt.Errorf("decode event record %q from %q: %w", id, source, err)
	}
	return &rec, nil
}

// Create stores rec, create-only. When a record of the same event is
// there already (a concurrent delivery recorded it first) it is returned
// with created false and nothing is written. Errors: the write's, wrapped
// with the source and id; the record may then or may not have been
// stored, so the caller must read it again before answering differently.
func (e *Events) Create(ctx context.Context, rec *schemas.EventRecord) (got *schemas.EventRecord, created bool, err error) {
	data, err := json.Marshal(rec)
	if err != nil {
		return nil, false, fmt.Errorf("encode event record %q from %q: %w", rec.ID, rec.Source, err)
	}
	_, err = e.kv.Create(ctx, schemas.EventKey(rec.Source, rec.ID), data)
	if errors.Is(err, jetstream.ErrKeyExists) {
		got, err := e.Get(ctx, rec.Source, rec.ID)
		if err != nil {
			return nil, false, err
		}
		return got, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("record event %q from %q: %w", rec.ID, rec.Source, err)
	}
	return rec, true, nil
}

// ensureEventBucket creates the events bucket if absent, and checks an
// existing one as every bucket is checked, but for its TTL: that is the
// retention an operator may change (WAYMARK_EVENT_RETENTION). A process
// that tunes shared resources (Config.TuneConsumers: engines) sets the
// bucket's TTL to Config.EventRetention, logged at info; any other logs
// the difference at warn and keeps it.
func (s *Store) ensureEventBucket(ctx context.Context) (jetstream.KeyValue, error) {
	n, c := s.Names, s.Config
	want := s.recordBucket(n.EventBucket, "Waymark CloudEvents intake dedup: key e.<sha256 of source and id>, the jobs the event started; kept for the event retention (the bucket's TTL)",
		64<<10, map[string]string{"waymark_layout": LayoutVersion})
	want.TTL = c.EventRetention
	kv, err := s.JS.KeyValue(ctx, want.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = s.JS.CreateKeyValue(ctx, want)
		if err == nil {
			return kv, nil
		}
		if !errors.Is(err, jetstream.ErrBucketExists) {
			return nil, fmt.Errorf("create bucket %s: %w", want.Bucket, err)
		}
		kv, err = s.JS.KeyValue(ctx, want.Bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("open bucket %s: %w", want.Bucket, err)
	}
	st, err := s.JS.Stream(ctx, "KV_"+want.Bucket)
	if err != nil {
		return nil, fmt.Errorf("settings of bucket %s: %w", want.Bucket, err)
	}
	have := st.CachedInfo().Config
	same := want
	same.TTL = have.MaxAge
	if err := s.judge("bucket "+want.Bucket, bucketMismatches(same, have)); err != nil {
		return nil, err
	}
	if have.MaxAge == want.TTL {
		return kv, nil
	}
	if !c.TuneConsumers {
		s.log.Warn("events bucket keeps another retention than this process's; keeping it as it is (engines set it)",
			"bucket", want.Bucket, "have", ageName(have.MaxAge), "want", ageName(want.TTL))
		return kv, nil
	}
	have.MaxAge = want.TTL
	if have.Duplicates > want.TTL {
		have.Duplicates = want.TTL // the server refuses a duplicate window longer than the max age (a bucket created with a TTL under 2m has one as long)
	}
	if _, err := s.JS.UpdateStream(ctx, have); err != nil {
		return nil, fmt.Errorf("set the retention of bucket %s to %v: %w", want.Bucket, want.TTL, err)
	}
	s.log.Info("events bucket retention changed", "bucket", want.Bucket, "from", ageName(st.CachedInfo().Config.MaxAge), "to", ageName(want.TTL))
	return kv, nil
}
