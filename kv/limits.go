package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Limits holds the providers' rate limits that workers share: for each
// provider and API key (key "<provider>.<digest>"), the time before which
// no worker calls it. A worker that gets a 429 or 529 with Retry-After
// holds the key until then; every worker reads it before a call and waits
// instead of calling, so that 20 workers back off together rather than
// each finding the limit on its own. Values are JSON {"until": RFC 3339};
// `nats kv get waymark_limits <key>` shows them.
type Limits struct {
	kv jetstream.KeyValue
}

type limitRecord struct {
	Until time.Time `json:"until"`
}

// Until returns the time before which name must not be called; the zero
// time when it is not held.
func (l *Limits) Until(ctx context.Context, name string) (time.Time, error) {
	ent, err := l.kv.Get(ctx, name)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return time.Time{}, nil
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("read rate limit %s: %w", name, err)
	}
	var r limitRecord
	if err := json.Unmarshal(ent.Value(), &r); err != nil {
		return time.Time{}, nil // unreadable: not held
	}
	return r.Until, nil
}

// Hold records that name must not be called before until, unless it is
// held longer already (compare-and-swap on the revision read: two workers
// holding at once keep the later time).
func (l *Limits) Hold(ctx context.Context, name string, until time.Time) error {
	data, _ := json.Marshal(limitRecord{Until: until.UTC()})
	for try := 0; try < 8; try++ {
		ent, err := l.kv.Get(ctx, name)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			if _, err := l.kv.Create(ctx, name, data); err == nil || !isRevisionConflict(err) {
				return wrapLimit(name, err)
			}
			continue
		case err != nil:
			return wrapLimit(name, err)
		}
		var r limitRecord
		if json.Unmarshal(ent.Value(), &r) == nil && !r.Until.Before(until) {
			return nil
		}
		if _, err := l.kv.Update(ctx, name, data, ent.Revision()); err == nil || !isRevisionConflict(err) {
			return wrapLimit(name, err)
		}
	}
	return fmt.Errorf("hold rate limit %s: too many concurrent writers", name)
}

func wrapLimit(name string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("hold rate limit %s: %w", name, err)
}
