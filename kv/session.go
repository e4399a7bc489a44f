package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// SessionStore is the session-level store: JSON values by namespace and
// key, kept across jobs (a user's memory, as LangGraph's store keeps
// one), in the KV bucket waymark_store under "<namespace>.<key>". Every
// write gets a revision; a write may require the revision it read
// (compare-and-swap). Store steps and agent tools of kind store, engine
// store and the HTTP API use it.
type SessionStore struct{ kv jetstream.KeyValue }

// StoreEntry is one value of the session store.
type StoreEntry struct {
	Namespace string          `json:"namespace"`
	Key       string          `json:"key"`
	Value     json.RawMessage `json:"value"`
	Revision  uint64          `json:"revision"`
	Updated   time.Time       `json:"updated"`
}

// MaxStoreValueBytes caps a session store value.
const MaxStoreValueBytes = 64 << 10

var storeName = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)

// CheckStoreName reports whether name can be a namespace or key: 1 to 128
// letters, digits, '_' and '-'. Errors: schemas.ErrInputInvalid, naming
// what.
func CheckStoreName(what, name string) error {
	if !storeName.MatchString(name) {
		return schemas.Errorf(schemas.CodeInputInvalid, "store %s %q: want 1 to 128 letters, digits, '_' and '-'", what, name)
	}
	return nil
}

func storeKey(ns, key string) (string, error) {
	if err := CheckStoreName("namespace", ns); err != nil {
		return "", err
	}
	if err := CheckStoreName("key", key); err != nil {
		return "", err
	}
	return ns + "." + key, nil
}

// Get returns the value under ns and key. Errors: schemas.ErrNotFound;
// schemas.ErrInputInvalid for a bad name.
func (s *SessionStore) Get(ctx context.Context, ns, key string) (StoreEntry, error) {
	k, err := storeKey(ns, key)
	if err != nil {
		return StoreEntry{}, err
	}
	e, err := s.kv.Get(ctx, k)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return StoreEntry{}, fmt.Errorf("store %s/%s: %w", ns, key, schemas.ErrNotFound)
	}
	if err != nil {
		return StoreEntry{}, fmt.Errorf("store %s/%s: %w", ns, key, err)
	}
	return StoreEntry{Namespace: ns, Key: key, Value: e.Value(), Revision: e.Revision(), Updated: e.Created()}, nil
}

// Put writes value (JSON) under ns and key and returns its revision. With
// expect nil it writes whatever is there; with *expect 0 only when there
// is no value; else only over revision *expect. Errors: schemas.ErrConflict
// when the revision is not the one expected (or a value exists);
// schemas.ErrInputInvalid for a bad name or value.
func (s *SessionStore) Put(ctx context.Context, ns, key string, value json.RawMessage, expect *uint64) (uint64, error) {
	k, err := storeKey(ns, key)
	if err != nil {
		return 0, err
	}
	if !json.Valid(value) {
		return 0, schemas.Errorf(schemas.CodeInputInvalid, "store %s/%s: the value is not JSON", ns, key)
	}
	if err := schemas.CheckJSONText(value); err != nil {
		return 0, schemas.Errorf(schemas.CodeInputInvalid, "store %s/%s: %v", ns, key, err)
	}
	if len(value) > MaxStoreValueBytes {
		return 0, schemas.Errorf(schemas.CodeInputInvalid, "store %s/%s: the value is %d bytes; the limit is %d", ns, key, len(value), MaxStoreValueBytes)
	}
	var rev uint64
	switch {
	case expect == nil:
		rev, err = s.kv.Put(ctx, k, value)
	case *expect == 0:
		rev, err = s.kv.Create(ctx, k, value)
	default:
		rev, err = s.kv.Update(ctx, k, value, *expect)
	}
	if errors.Is(err, jetstream.ErrKeyExists) || isWrongSequence(err) {
		now := "none"
		if e, gerr := s.kv.Get(ctx, k); gerr == nil {
			now = fmt.Sprint(e.Revision())
		}
		if *expect == 0 {
			return 0, fmt.Errorf("store %s/%s: there is a value already (revision %s): %w", ns, key, now, schemas.ErrConflict)
		}
		return 0, fmt.Errorf("store %s/%s: expected revision %d, it is at %s: %w", ns, key, *expect, now, schemas.ErrConflict)
	}
	if err != nil {
		return 0, fmt.Errorf("store %s/%s: %w", ns, key, err)
	}
	return rev, nil
}

func isWrongSequence(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence
}

// Delete removes the value under ns and key (expect as for Put). Errors:
// schemas.ErrNotFound when there is none; schemas.ErrConflict.
func (s *SessionStore) Delete(ctx context.Context, ns, key string, expect *uint64) error {
	k, err := storeKey(ns, key)
	if err != nil {
		return err
	}
	if _, err := s.kv.Get(ctx, k); errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("store %s/%s: there is no value: %w", ns, key, schemas.ErrNotFound)
	}
	var opts []jetstream.KVDeleteOpt
	if expect != nil {
		opts = append(opts, jetstream.LastRevision(*expect))
	}
	if err := s.kv.Purge(ctx, k, opts...); err != nil {
		if isWrongSequence(err) {
			return fmt.Errorf("store %s/%s: expected revision %d: %w", ns, key, *expect, schemas.ErrConflict)
		}
		return fmt.Errorf("store %s/%s: %w", ns, key, err)
	}
	return nil
}

// List returns the values of namespace ns, by key.
func (s *SessionStore) List(ctx context.Context, ns string) ([]StoreEntry, error) {
	if err := CheckStoreName("namespace", ns); err != nil {
		return nil, err
	}
	lister, err := s.kv.ListKeysFiltered(ctx, ns+".*")
	if err != nil {
		return nil, fmt.Errorf("store %s: %w", ns, err)
	}
	var out []StoreEntry
	for k := range lister.Keys() {
		key := strings.TrimPrefix(k, ns+".")
		if e, err := s.Get(ctx, ns, key); err == nil {
			out = append(out, e)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}
