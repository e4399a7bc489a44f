package kv_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// definition parses a small workflow of the given name and version.
func definition(t *testing.T, name string, version int) *schemas.Definition {
	t.Helper()
	src := fmt.Sprintf("name: %s\nversion: %d\nsteps:\n  - id: greet\n    kind: noop\n    next: [{to: wait}]\n  - id: wait\n    kind: noop\n", name, version)
	def, err := schemas.Parse(name+".yaml", []byte(src), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return def
}

func TestDefinitionsPutGet(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	def := definition(t, "greeter", 1)
	if err := b.store.Definitions.Put(ctx(t), def); err != nil {
		t.Fatal(err)
	}
	if err := b.store.Definitions.Put(ctx(t), def); err != nil {
		t.Fatalf("second Put of the same definition: %v", err)
	}
	if err := b.store.Definitions.Put(ctx(t), definition(t, "greeter", 1)); err != nil {
		t.Fatalf("Put of an equal definition: %v", err)
	}

	// A fresh store has nothing cached: this reads the bucket.
	fresh := b.srv.Store(t, kv.Config{})
	got, err := fresh.Definitions.Get(ctx(t), def.Hash)
	if err != nil {
		t.Fatal(err)
	}
	if got.Hash != def.Hash || !reflect.DeepEqual(got, def) {
		t.Errorf("Get = %+v, want %+v", got, def)
	}
	if again, err := fresh.Definitions.Get(ctx(t), def.Hash); err != nil || again.Hash != def.Hash {
		t.Errorf("cached Get = %v, %v", again, err)
	}
}

func TestDefinitionsGetErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	def := definition(t, "greeter", 1)
	if err := b.store.Definitions.Put(ctx(t), def); err != nil {
		t.Fatal(err)
	}
	bucket, err := b.js.KeyValue(ctx(t), b.store.Names.DefinitionBucket)
	if err != nil {
		t.Fatal(err)
	}
	other := definition(t, "other", 1)
	const forged = "0000000000000000000000000000000000000000000000000000000000000000"
	if _, err := bucket.Put(ctx(t), forged, other.Canonical()); err != nil {
		t.Fatal(err)
	}
	const garbage = "1111111111111111111111111111111111111111111111111111111111111111"
	if _, err := bucket.Put(ctx(t), garbage, []byte("{not json")); err != nil {
		t.Fatal(err)
	}

	rows := []struct {
		name    string
		ctx     context.Context
		hash    string
		wantErr error
		wantMsg string
	}{
		{name: "stored", hash: def.Hash},
		{name: "unknown hash", hash: strings.Repeat("ab", 32), wantErr: schemas.ErrNotFound, wantMsg: "no definition with hash"},
		{name: "empty hash", hash: "", wantErr: schemas.ErrNotFound},
		{name: "not a key", hash: "a b*", wantErr: schemas.ErrNotFound},
		{name: "bytes of another hash", hash: forged, wantErr: schemas.ErrDefinitionInvalid, wantMsg: "hashes to " + other.Hash},
		{name: "not a definition", hash: garbage, wantErr: schemas.ErrDefinitionInvalid, wantMsg: garbage},
		{name: "context deadline", ctx: expired(t), hash: def.Hash, wantErr: context.DeadlineExceeded},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			c := r.ctx
			if c == nil {
				c = ctx(t)
			}
			// Each row reads through a store of its own, so that nothing
			// comes from a cache.
			got, err := b.srv.Store(t, kv.Config{}).Definitions.Get(c, r.hash)
			if r.wantErr == nil {
				if err != nil || got.Hash != r.hash {
					t.Fatalf("Get = %v, %v", got, err)
				}
				return
			}
			if !errors.Is(err, r.wantErr) || got != nil {
				t.Fatalf("Get(%q) = %v, %v; want %v", r.hash, got, err, r.wantErr)
			}
			if !strings.Contains(err.Error(), r.wantMsg) {
				t.Errorf("error %q does not contain %q", err, r.wantMsg)
			}
		})
	}
}

func TestDefinitionsLatest(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	defs := b.store.Definitions
	if _, err := defs.Latest(ctx(t), "greeter"); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("Latest before any Put = %v, want ErrNotFound", err)
	}
	v1, v2 := definition(t, "greeter", 1), definition(t, "greeter", 2)
	for _, d := range []*schemas.Definition{v1, v2, definition(t, "other", 7)} {
		if err := defs.Put(ctx(t), d); err != nil {
			t.Fatal(err)
		}
	}
	latest := func(name string) *schemas.Definition {
		t.Helper()
		// Through a fresh store: the pointer lives in the bucket.
		d, err := b.srv.Store(t, kv.Config{}).Definitions.Latest(ctx(t), name)
		if err != nil {
			t.Fatalf("Latest(%s): %v", name, err)
		}
		return d
	}
	if got := latest("greeter"); got.Hash != v2.Hash || got.Version != 2 {
		t.Errorf("Latest = version %d (%s), want 2 (%s)", got.Version, got.Hash, v2.Hash)
	}
	if got := latest("other"); got.Version != 7 {
		t.Errorf("Latest(other) = version %d", got.Version)
	}
	// Latest is the last stored, as documented, even when that is an older
	// version (a rollback); v2 stays retrievable by its hash.
	if err := defs.Put(ctx(t), v1); err != nil {
		t.Fatal(err)
	}
	if got := latest("greeter"); got.Hash != v1.Hash {
		t.Errorf("Latest after storing v1 again = version %d, want 1", got.Version)
	}
	if got, err := defs.Get(ctx(t), v2.Hash); err != nil || got.Version != 2 {
		t.Errorf("Get(v2) = %v, %v", got, err)
	}
	if _, err := defs.Latest(ctx(t), "bad name"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("Latest(bad name) = %v, want ErrNotFound", err)
	}
}

func TestDefinitionsPutRefusesUnloaded(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{})
	byHand := &schemas.Definition{Name: "x", Version: 1, Steps: []schemas.Step{{ID: "a", Kind: "noop"}}, Hash: strings.Repeat("0", 64)}
	err := b.store.Definitions.Put(ctx(t), byHand)
	if err == nil || !strings.Contains(err.Error(), "not loaded through schemas.Load") {
		t.Errorf("Put(hand-built) = %v", err)
	}
	if err := b.store.Definitions.Put(expired(t), definition(t, "late", 1)); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Put with an expired context = %v, want context.DeadlineExceeded", err)
	}
}
