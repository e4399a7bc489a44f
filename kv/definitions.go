package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// Definitions stores workflow definitions by content hash. A stored
// definition never changes (its key is its hash), so reads are cached
// without bound checks beyond a size cap. Safe for concurrent use.
type Definitions struct {
	kv jetstream.KeyValue

	mu    sync.Mutex
	cache map[string]*schemas.Definition
}

const maxCachedDefinitions = 512

func newDefinitions(kv jetstream.KeyValue) *Definitions {
	return &Definitions{kv: kv, cache: map[string]*schemas.Definition{}}
}

// latest is the value of a name.<workflow> key.
type latest struct {
	Hash    string `json:"hash"`
	Version int    `json:"version"`
}

// Put stores def under its hash (create-only: an existing entry is the same
// bytes) and points name.<workflow> at it. Storing never changes a job
// already started: jobs pin the hash.
func (d *Definitions) Put(ctx context.Context, def *schemas.Definition) error {
	if def.Hash == "" || len(def.Canonical()) == 0 {
		return fmt.Errorf("store definition %s: not loaded through schemas.Load", def.Name)
	}
	_, err := d.kv.Create(ctx, def.Hash, def.Canonical())
	if err != nil && !errors.Is(err, jetstream.ErrKeyExists) {
		return fmt.Errorf("store definition %s@%d (%s): %w", def.Name, def.Version, def.Hash[:12], err)
	}
	ptr, _ := json.Marshal(latest{Hash: def.Hash, Version: def.Version})
	if _, err := d.kv.Put(ctx, "name."+def.Name, ptr); err != nil {
		return fmt.Errorf("store definition pointer %s: %w", def.Name, err)
	}
	d.remember(def)
	return nil
}

// Get returns the definition with the given hash. Errors:
// schemas.ErrNotFound; schemas.ErrDefinitionInvalid if the stored bytes do
// not decode or do not hash to the key.
func (d *Definitions) Get(ctx context.Context, hash string) (*schemas.Definition, error) {
	d.mu.Lock()
	def, ok := d.cache[hash]
	d.mu.Unlock()
	if ok {
		return def, nil
	}
	e, err := d.kv.Get(ctx, hash)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrInvalidKey) {
		return nil, schemas.Errorf(schemas.CodeNotFound, "no definition with hash %q", hash)
	}
	if err != nil {
		return nil, fmt.Errorf("load definition %s: %w", hash, err)
	}
	def, err = schemas.DecodeDefinition(e.Value())
	if err != nil {
		return nil, fmt.Errorf("load definition %s: %w", hash, err)
	}
	if def.Hash != hash {
		return nil, schemas.Errorf(schemas.CodeDefinitionInvalid, "definition stored under %s hashes to %s", hash, def.Hash)
	}
	d.remember(def)
	return def, nil
}

// Latest returns the most recently stored definition of workflow name.
// Errors: schemas.ErrNotFound.
func (d *Definitions) Latest(ctx context.Context, name string) (*schemas.Definition, error) {
	e, err := d.kv.Get(ctx, "name."+name)
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrInvalidKey) {
		return nil, schemas.Errorf(schemas.CodeNotFound, "no workflow named %q has been stored", name)
	}
	if err != nil {
		return nil, fmt.Errorf("load definition pointer %s: %w", name, err)
	}
	var l latest
	if err := json.Unmarshal(e.Value(), &l); err != nil {
		return nil, fmt.Errorf("decode definition pointer %s: %w", name, err)
	}
	return d.Get(ctx, l.Hash)
}

func (d *Definitions) remember(def *schemas.Definition) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.cache) >= maxCachedDefinitions {
		for k := range d.cache { // drop an arbitrary entry; definitions are cheap to reload
			delete(d.cache, k)
			break
		}
	}
	d.cache[def.Hash] = def
}
