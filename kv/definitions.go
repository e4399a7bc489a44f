package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
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

	// beforePointerWrite, when set (tests), runs between reading the name
	// pointer and writing it.
	beforePointerWrite func()
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
//
// The pointer names the workflow's latest definition: the one stored last,
// in the order of the pointer's compare-and-swaps (create-only when
// absent, else on the revision read), so storing an older version on
// purpose (a rollback) moves it back. Two stores racing are told apart
// from a rollback by the swap: one whose swap fails because another store
// moved the pointer after it read keeps what it then finds unless its own
// version is higher, so a race never moves the pointer to an older
// version, and of two racing stores of one version the first to land
// stays. Errors: the write's, wrapped with the workflow's name and
// version; the pointer may then still name the previous definition.
func (d *Definitions) Put(ctx context.Context, def *schemas.Definition) error {
	if def.Hash == "" || len(def.Canonical()) == 0 {
		return fmt.Errorf("store definition %s: not loaded through schemas.Load", def.Name)
	}
	_, err := d.kv.Create(ctx, def.Hash, def.Canonical())
	if err != nil && !errors.Is(err, jetstream.ErrKeyExists) {
		return fmt.Errorf("store definition %s@%d (%s): %w", def.Name, def.Version, def.Hash[:12], err)
	}
	if err := d.point(ctx, def); err != nil {
		return fmt.Errorf("store definition pointer %s@%d: %w", def.Name, def.Version, err)
	}
	d.remember(def)
	return nil
}

// point moves name.<workflow> to def (see Put for the rule).
func (d *Definitions) point(ctx context.Context, def *schemas.Definition) error {
	key := "name." + def.Name
	ptr, _ := json.Marshal(latest{Hash: def.Hash, Version: def.Version})
	for raced := false; ; raced = true {
		var rev uint64
		e, err := d.kv.Get(ctx, key)
		switch {
		case err == nil:
			rev = e.Revision()
			var cur latest
			// A pointer that does not decode is replaced; it only ever
			// names what is also stored by hash.
			if json.Unmarshal(e.Value(), &cur) == nil && (cur.Hash == def.Hash || raced && cur.Version >= def.Version) {
				return nil
			}
		case !errors.Is(err, jetstream.ErrKeyNotFound):
			return err
		}
		if d.beforePointerWrite != nil {
			d.beforePointerWrite()
		}
		if rev == 0 {
			_, err = d.kv.Create(ctx, key, ptr)
		} else {
			_, err = d.kv.Update(ctx, key, ptr, rev)
		}
		if err == nil || !isRevisionConflict(err) {
			return err
		}
		// Another store moved the pointer since the read: a race.
	}
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

// Workflows returns the name of every workflow with a stored definition
// (the name.<workflow> pointers), in no particular order. It reads the
// keys only; Latest gives each one's definition. Errors: the listing's,
// wrapped.
func (d *Definitions) Workflows(ctx context.Context) ([]string, error) {
	lister, err := d.kv.ListKeysFiltered(ctx, "name.*")
	if err != nil {
		return nil, fmt.Errorf("list workflows: %w", err)
	}
	// The lister's subscription ends by itself once every key came; Stop
	// only matters when the loop is left early.
	defer func() { _ = lister.Stop() }()
	var names []string
	for k := range lister.Keys() {
		names = append(names, strings.TrimPrefix(k, "name."))
	}
	return names, nil
}

// LastRevision returns the definitions bucket's last revision (its
// stream's last sequence): it changes whenever anything is stored in the
// bucket, so a reader that cached what it listed knows whether to list
// again. Errors: the bucket's status, wrapped.
func (d *Definitions) LastRevision(ctx context.Context) (uint64, error) {
	st, err := d.kv.Status(ctx)
	if err != nil {
		return 0, fmt.Errorf("definitions bucket status: %w", err)
	}
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	if !ok {
		return 0, fmt.Errorf("definitions bucket status: unexpected type %T", st)
	}
	return bs.StreamInfo().State.LastSeq, nil
}
