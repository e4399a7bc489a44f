package kv

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/waymark-dev/waymark/schemas"
)

// DefaultValueCacheBytes bounds the values a Values made by Open keeps in
// memory: 64 MiB.
const DefaultValueCacheBytes = 64 << 20

// Values is the value store: the large values of job states, kept by
// reference (schemas.ValueRef, schemas.ExternalizeMembers) in a JetStream
// object store bucket (Names.ValueBucket, "waymark_values"). An object is
// named "<owner>/<64 hex digits of its SHA-256>", where owner is the job's
// message prefix (e.g. "job-1/i3"): objects belong to one job, so that
// retention removes a job's objects with it (DeleteOwner), and two jobs
// that hold the same value hold an object each.
//
// Values keeps the values it read or wrote in an LRU cache by digest,
// bounded by their total size in bytes. It is safe for concurrent use.
type Values struct {
	js     jetstream.JetStream
	obj    jetstream.ObjectStore
	stream jetstream.Stream // OBJ_<bucket>: to purge the chunks of a replaced object
	bucket string
	cache  *valueCache
}

// OpenValues returns a value store over the existing object bucket named
// bucket (the one Open makes is Names.ValueBucket; Open sets Store.Values
// itself, with the default cache). cacheBytes bounds the cache, in bytes:
// 0 means DefaultValueCacheBytes, negative disables the cache; a value
// larger than the bound is never cached. Errors: jetstream.ErrBucketNotFound
// (wrapped) when there is no such bucket; the server's or the context's.
func OpenValues(ctx context.Context, js jetstream.JetStream, bucket string, cacheBytes int64) (*Values, error) {
	obj, err := js.ObjectStore(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("open object bucket %s: %w", bucket, err)
	}
	st, err := js.Stream(ctx, "OBJ_"+bucket)
	if err != nil {
		return nil, fmt.Errorf("open object bucket %s: %w", bucket, err)
	}
	return newValues(js, obj, st, bucket, cacheBytes), nil
}

func newValues(js jetstream.JetStream, obj jetstream.ObjectStore, st jetstream.Stream, bucket string, cacheBytes int64) *Values {
	if cacheBytes == 0 {
		cacheBytes = DefaultValueCacheBytes
	}
	return &Values{js: js, obj: obj, stream: st, bucket: bucket, cache: newValueCache(cacheBytes)}
}

// ObjectName returns the name of owner's object for ref:
// "<owner>/<hex digest>".
func ObjectName(owner string, ref schemas.ValueRef) string { return owner + "/" + ref.Hex() }

// Put stores value (compact JSON; its bytes are kept as given) as owner's
// object and returns its reference. When an object of that name already
// holds the same digest, Put stores nothing (one metadata read); an object
// of that name with other content (corrupted) is written again. Put does
// not retain value.
//
// Errors: owner is empty; the server's or the context's error, which
// leaves the outcome unknown: the object may or may not have been stored,
// so the caller must Put it again (which is a no-op once it is stored)
// before writing a checkpoint that names the reference. An object stored
// by a Put whose reference no checkpoint ever names is not removed by
// DeleteOwner (it does not know it); it costs storage, nothing else.
func (v *Values) Put(ctx context.Context, owner string, value []byte) (schemas.ValueRef, error) {
	ref := schemas.NewValueRef(value)
	if owner == "" {
		return schemas.ValueRef{}, fmt.Errorf("put value %s: empty owner", ref.Digest)
	}
	name := ObjectName(owner, ref)
	info, err := v.obj.GetInfo(ctx, name)
	switch {
	case err == nil && sameObject(info, ref):
		// Stored before (a retry, or the same value written twice).
	case err == nil || errors.Is(err, jetstream.ErrObjectNotFound):
		if err := v.putObject(ctx, name, value, info); err != nil {
			return schemas.ValueRef{}, fmt.Errorf("put value object %q in bucket %s: %w", name, v.bucket, err)
		}
	default:
		return schemas.ValueRef{}, fmt.Errorf("put value object %q in bucket %s: %w", name, v.bucket, err)
	}
	v.cache.add(ref.Digest, value)
	return ref, nil
}

// objectChunkBytes is the chunk size of the objects Values writes, the
// object store's default.
const objectChunkBytes = 128 << 10

// putObject writes value as the object name, in the object store's format
// (NATS ADR-20: chunks on $O.<bucket>.C.<nuid>, then the object's
// metadata on $O.<bucket>.M.<base64url name> with a subject rollup), so
// that jetstream.ObjectStore reads it. It publishes synchronously instead
// of calling ObjectStore.Put: nats.go v1.55's Put makes a JetStream
// context per call for async publishes whose reconnect watcher can miss
// the channel Put clears at its end and then blocks forever, one
// goroutine leaked per object. old is the object being replaced (nil when
// none): its chunks are purged once the new metadata is stored.
func (v *Values) putObject(ctx context.Context, name string, value []byte, old *jetstream.ObjectInfo) error {
	id := nuid.Next()
	chunkSubj := "$O." + v.bucket + ".C." + id
	chunks := 0
	for off := 0; off < len(value); off += objectChunkBytes {
		m := nats.NewMsg(chunkSubj)
		m.Data = value[off:min(off+objectChunkBytes, len(value))]
		if _, err := v.js.PublishMsg(ctx, m); err != nil {
			v.purgeChunks(ctx, id)
			return err
		}
		chunks++
	}
	sum := sha256.Sum256(value)
	info := jetstream.ObjectInfo{
		ObjectMeta: jetstream.ObjectMeta{Name: name, Opts: &jetstream.ObjectMetaOptions{ChunkSize: objectChunkBytes}},
		Bucket:     v.bucket,
		NUID:       id,
		Size:       uint64(len(value)),
		Chunks:     uint32(chunks),
		Digest:     "SHA-256=" + base64.URLEncoding.EncodeToString(sum[:]),
	}
	meta := nats.NewMsg("$O." + v.bucket + ".M." + base64.URLEncoding.EncodeToString([]byte(name)))
	meta.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupSubject)
	var err error
	if meta.Data, err = json.Marshal(info); err != nil {
		return err
	}
	if _, err := v.js.PublishMsg(ctx, meta); err != nil {
		// The metadata may be stored all the same: its chunks stay.
		return err
	}
	if old != nil && old.NUID != "" && old.NUID != id {
		v.purgeChunks(ctx, old.NUID)
	}
	return nil
}

// purgeChunks removes the chunks of object instance id, best effort: a
// chunk left behind costs storage, nothing else.
func (v *Values) purgeChunks(ctx context.Context, id string) {
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = v.stream.Purge(pctx, jetstream.WithPurgeSubject("$O."+v.bucket+".C."+id))
}

// sameObject reports whether info describes an object holding ref's value:
// the object store's digest ("SHA-256=<base64url>") and size match.
func sameObject(info *jetstream.ObjectInfo, ref schemas.ValueRef) bool {
	if info.Size != uint64(ref.Bytes) {
		return false
	}
	have, err := jetstream.DecodeObjectDigest(info.Digest)
	if err != nil {
		return false
	}
	want, err := hex.DecodeString(ref.Hex())
	return err == nil && bytes.Equal(have, want)
}

// Get returns the value ref names, from the cache or from owner's object.
// The returned slice is the caller's (a copy of what is cached). The cache
// is by digest: a cached value is returned whichever owner asks (it is the
// same content), so a Get answered from it does not prove that owner's
// object exists.
//
// Errors: one matching schemas.ErrValueMissing, naming the digest and the
// object, when the object is absent (removed with its job, or never
// stored); one matching schemas.ErrValueCorrupt, naming the object, when
// the object's length or SHA-256 is not the reference's (or the object
// store's own digest check fails); an invalid ref or an empty owner; the
// server's or the context's error.
func (v *Values) Get(ctx context.Context, owner string, ref schemas.ValueRef) ([]byte, error) {
	if !ref.Valid() {
		return nil, fmt.Errorf("get value %q of %d bytes: not a valid reference", ref.Digest, ref.Bytes)
	}
	if owner == "" {
		return nil, fmt.Errorf("get value %s: empty owner", ref.Digest)
	}
	if b, ok := v.cache.get(ref.Digest); ok {
		return b, nil
	}
	name := ObjectName(owner, ref)
	data, err := v.obj.GetBytes(ctx, name)
	switch {
	case errors.Is(err, jetstream.ErrObjectNotFound):
		return nil, schemas.Errorf(schemas.CodeValueMissing, "value %s: no object %q in bucket %s: %w", ref.Digest, name, v.bucket, err)
	case errors.Is(err, jetstream.ErrDigestMismatch):
		return nil, schemas.Errorf(schemas.CodeValueCorrupt, "value object %q in bucket %s: its chunks do not match its digest: %w", name, v.bucket, err)
	case err != nil:
		return nil, fmt.Errorf("get value object %q from bucket %s: %w", name, v.bucket, err)
	}
	if !ref.Matches(data) {
		return nil, schemas.Errorf(schemas.CodeValueCorrupt, "value object %q in bucket %s holds %d bytes with digest %s; its reference says %d bytes, %s",
			name, v.bucket, len(data), schemas.NewValueRef(data).Digest, ref.Bytes, ref.Digest)
	}
	v.cache.add(ref.Digest, data)
	return data, nil
}

// DeleteOwner removes owner's objects for refs (a reference listed twice
// is removed once) and drops their values from this Values's cache.
// Objects already absent are fine. It is meant for retention, once the
// job that owns the objects is finished and no longer read: another
// process's cache may still answer a Get for a removed value.
//
// Errors: an empty owner or an invalid ref (nothing is removed); the
// server's or the context's errors, joined, after trying every object: the
// objects named in them may or may not have been removed, and
// DeleteOwner may be called again.
func (v *Values) DeleteOwner(ctx context.Context, owner string, refs []schemas.ValueRef) error {
	if owner == "" {
		return errors.New("delete values: empty owner")
	}
	for _, r := range refs {
		if !r.Valid() {
			return fmt.Errorf("delete values of %s: %q of %d bytes is not a valid reference", owner, r.Digest, r.Bytes)
		}
	}
	var errs []error
	done := make(map[string]bool, len(refs))
	for _, r := range refs {
		if done[r.Digest] {
			continue
		}
		done[r.Digest] = true
		v.cache.remove(r.Digest)
		name := ObjectName(owner, r)
		if err := v.obj.Delete(ctx, name); err != nil && !errors.Is(err, jetstream.ErrObjectNotFound) {
			errs = append(errs, fmt.Errorf("delete value object %q in bucket %s: %w", name, v.bucket, err))
		}
	}
	return errors.Join(errs...)
}

// Resolve returns doc with every reference it holds (schemas.ValueRef)
// replaced by owner's value (schemas.ResolveRefs over Get); doc itself
// when it holds none. Errors are Get's.
func (v *Values) Resolve(ctx context.Context, owner string, doc json.RawMessage) (json.RawMessage, error) {
	if !schemas.HasRefs(doc) {
		return doc, nil
	}
	return schemas.ResolveRefs(doc, func(r schemas.ValueRef) ([]byte, error) { return v.Get(ctx, owner, r) })
}

// CachedBytes returns the total size, in bytes, of the values in the
// cache: never more than its bound.
func (v *Values) CachedBytes() int64 { return v.cache.size() }

// valueCache is an LRU of values by digest bounded by their total length.
// simplelru counts entries; the byte count is kept here, under mu.
type valueCache struct {
	mu    sync.Mutex
	lru   *simplelru.LRU[string, []byte]
	bytes int64
	max   int64 // <= 0: caches nothing
}

func newValueCache(maxBytes int64) *valueCache {
	c := &valueCache{max: maxBytes}
	if maxBytes > 0 {
		// The entry count is not a bound here: bytes are.
		c.lru, _ = simplelru.NewLRU[string, []byte](math.MaxInt, nil)
	}
	return c
}

func (c *valueCache) get(digest string) ([]byte, bool) {
	if c.lru == nil {
		return nil, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	b, ok := c.lru.Get(digest)
	if !ok {
		return nil, false
	}
	return bytes.Clone(b), true
}

// add caches a copy of value (the caller keeps its slice), evicting the
// least recently used values until the total fits the bound.
func (c *valueCache) add(digest string, value []byte) {
	if c.lru == nil || int64(len(value)) > c.max {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lru.Contains(digest) {
		c.lru.Get(digest) // same digest, same value: only mark it used
		return
	}
	c.lru.Add(digest, bytes.Clone(value))
	c.bytes += int64(len(value))
	for c.bytes > c.max {
		_, old, ok := c.lru.RemoveOldest()
		if !ok {
			break
		}
		c.bytes -= int64(len(old))
	}
}

func (c *valueCache) remove(digest string) {
	if c.lru == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.lru.Peek(digest); ok {
		c.lru.Remove(digest)
		c.bytes -= int64(len(old))
	}
}

func (c *valueCache) size() int64 {
	if c.lru == nil {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bytes
}

// ensureValues creates the value bucket if absent and checks an existing
// one, as ensureBucket does for key-value buckets (the storage and the
// replicas of the checkpoint bucket, no TTL), and returns its Values with
// the default cache.
func (s *Store) ensureValues(ctx context.Context) (*Values, error) {
	cfg := jetstream.ObjectStoreConfig{
		Bucket:      s.Names.ValueBucket,
		Description: "Waymark large state values by reference: object <job message prefix>/<sha256 hex> = compact JSON value; removed with its job",
		Storage:     s.storage(),
		Replicas:    s.Config.Replicas,
		Metadata:    map[string]string{"waymark_layout": LayoutVersion},
	}
	obj, err := s.JS.ObjectStore(ctx, cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		obj, err = s.JS.CreateObjectStore(ctx, cfg)
		if err == nil {
			s.log.Debug("created object bucket", "bucket", cfg.Bucket)
			st, err := s.JS.Stream(ctx, "OBJ_"+cfg.Bucket)
			if err != nil {
				return nil, fmt.Errorf("open object bucket %s: %w", cfg.Bucket, err)
			}
			return newValues(s.JS, obj, st, cfg.Bucket, DefaultValueCacheBytes), nil
		}
		if !errors.Is(err, jetstream.ErrBucketExists) {
			return nil, fmt.Errorf("create object bucket %s: %w", cfg.Bucket, err)
		}
		// Another process created it first: check it like any existing one.
		obj, err = s.JS.ObjectStore(ctx, cfg.Bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("open object bucket %s: %w", cfg.Bucket, err)
	}
	st, err := s.JS.Stream(ctx, "OBJ_"+cfg.Bucket)
	if err != nil {
		return nil, fmt.Errorf("settings of object bucket %s: %w", cfg.Bucket, err)
	}
	if err := s.judge("object bucket "+cfg.Bucket, objectBucketMismatches(cfg, st.CachedInfo().Config)); err != nil {
		return nil, err
	}
	return newValues(s.JS, obj, st, cfg.Bucket, DefaultValueCacheBytes), nil
}

// objectBucketMismatches compares an existing object bucket's stream with
// want.
func objectBucketMismatches(want jetstream.ObjectStoreConfig, have jetstream.StreamConfig) []mismatch {
	var ms []mismatch
	if have.MaxAge != want.TTL {
		ms = append(ms, mismatch{"ttl", ageName(have.MaxAge), ageName(want.TTL), true,
			"values would expire while the checkpoints that name them are kept"})
	}
	if have.Storage != want.Storage {
		ms = append(ms, mismatch{"storage", storageName(have.Storage), storageName(want.Storage), true,
			"this process is configured for the other storage (memory loses everything in a server restart)"})
	}
	if have.Discard == jetstream.DiscardOld && hasLimit(have) {
		ms = append(ms, mismatch{"discard", discardName(have.Discard), "new (with a size or count limit)", true,
			"a full bucket would drop the oldest values without telling anyone"})
	}
	if have.Sealed {
		ms = append(ms, mismatch{"sealed", "true", "false", true, "nothing can be written"})
	}
	if have.Replicas != want.Replicas {
		ms = append(ms, mismatch{"replicas", strconv.Itoa(have.Replicas), strconv.Itoa(want.Replicas), false,
			"values are replicated as the bucket says, not as this process's settings say"})
	}
	return ms
}
