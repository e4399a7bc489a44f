package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/nats-io/nats.go/jetstream"
)

// cleanStopsKey holds, in the definitions bucket, the incarnations of the
// engine processes that stopped cleanly: a JSON array, newest last, of at
// most maxCleanStops.
const (
	cleanStopsKey = "meta.clean_stops"
	maxCleanStops = 32
)

// CleanStops returns the incarnations of the last engine processes that
// stopped cleanly (RecordCleanStop), newest last: a job a new process
// takes over from one of them was not left by a crash. A missing or
// unreadable record is no clean stop. Errors: the read failed.
func (s *Store) CleanStops(ctx context.Context) ([]string, error) {
	got, _, err := s.cleanStops(ctx)
	return got, err
}

func (s *Store) cleanStops(ctx context.Context) ([]string, uint64, error) {
	e, err := s.Definitions.kv.Get(ctx, cleanStopsKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read clean stops: %w", err)
	}
	var list []string
	if json.Unmarshal(e.Value(), &list) != nil {
		list = nil // rewritten by the next clean stop
	}
	return list, e.Revision(), nil
}

// RecordCleanStop adds incarnation to the clean stops: a create when there
// is no record, else a compare-and-swap on the revision read, tried again
// when another process wrote between. Errors: a write failed for another
// reason.
func (s *Store) RecordCleanStop(ctx context.Context, incarnation string) error {
	for try := 0; try < 8; try++ {
		list, rev, err := s.cleanStops(ctx)
		if err != nil {
			return err
		}
		if slices.Contains(list, incarnation) {
			return nil
		}
		list = append(list, incarnation)
		if len(list) > maxCleanStops {
			list = list[len(list)-maxCleanStops:]
		}
		data, _ := json.Marshal(list)
		if rev == 0 {
			_, err = s.Definitions.kv.Create(ctx, cleanStopsKey, data)
		} else {
			_, err = s.Definitions.kv.Update(ctx, cleanStopsKey, data, rev)
		}
		if err == nil || !isRevisionConflict(err) {
			if err != nil {
				return fmt.Errorf("record clean stop: %w", err)
			}
			return nil
		}
	}
	return fmt.Errorf("record clean stop: the record kept changing")
}
