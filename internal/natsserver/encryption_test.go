package natsserver

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

const (
	keyA   = "key-a-0123456789abcdef0123456789abcdef"
	keyB   = "key-b-0123456789abcdef0123456789abcdef"
	canary = "canary-the-plain-text-a-job-was-given-9f3a"
)

// withBucket starts a server on dir with cfg, runs f on a KV bucket
// "t", and stops the server.
func withBucket(t *testing.T, cfg Config, f func(kv jetstream.KeyValue)) {
	t.Helper()
	srv, err := Start(cfg)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	defer srv.Stop(context.Background())
	nc, js, err := srv.JetStream("test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "t"})
	if err != nil {
		t.Fatal(err)
	}
	f(kv)
}

func put(t *testing.T, kv jetstream.KeyValue) {
	t.Helper()
	if _, err := kv.Put(context.Background(), "k", []byte(canary)); err != nil {
		t.Fatal(err)
	}
}

func mustRead(t *testing.T, kv jetstream.KeyValue) {
	t.Helper()
	e, err := kv.Get(context.Background(), "k")
	if err != nil || string(e.Value()) != canary {
		t.Fatalf("read back: %v %v", e, err)
	}
}

// plainIn reports the files under dir that hold the canary in plain.
func plainIn(t *testing.T, dir string) []string {
	t.Helper()
	var hits []string
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if data, err := os.ReadFile(p); err == nil && bytes.Contains(data, []byte(canary)) {
			hits = append(hits, p)
		}
		return nil
	})
	return hits
}

func TestEncryptedDataDirNeedsItsKey(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := Config{DataDir: dir, Sync: SyncAlways, EncryptionKey: keyA}
	withBucket(t, cfg, func(kv jetstream.KeyValue) { put(t, kv) })
	if hits := plainIn(t, dir); len(hits) > 0 {
		t.Fatalf("the value is in plain in %v", hits)
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want error
		msg  string
	}{
		{"no key", Config{DataDir: dir}, ErrKeyRequired, "--encryption-key-file"},
		{"wrong key", Config{DataDir: dir, EncryptionKey: keyB}, ErrWrongKey, "not the one it was written with"},
		{"short key", Config{DataDir: dir, EncryptionKey: "short"}, nil, "at least 32"},
		{"unknown cipher", Config{DataDir: dir, EncryptionKey: keyA, EncryptionCipher: "rot13"}, nil, `"rot13"`},
	} {
		_, err := Start(tc.cfg)
		if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), dir) && tc.want != nil {
			t.Errorf("%s: %v, want %v saying %q and naming the directory", tc.name, err, tc.want, tc.msg)
		}
		if err != nil && strings.Contains(err.Error(), keyA) {
			t.Errorf("%s: the error holds the key", tc.name)
		}
	}
	// The right key reads it back, with either cipher (the server converts).
	withBucket(t, cfg, func(kv jetstream.KeyValue) { mustRead(t, kv) })
	withBucket(t, Config{DataDir: dir, EncryptionKey: keyA, EncryptionCipher: CipherAES}, func(kv jetstream.KeyValue) { mustRead(t, kv) })
	withBucket(t, cfg, func(kv jetstream.KeyValue) { mustRead(t, kv) })
	// Without the record, the key files still give the encryption away.
	if err := os.Remove(filepath.Join(dir, keyCheckFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := Start(Config{DataDir: dir}); !errors.Is(err, ErrKeyRequired) {
		t.Fatalf("no key, record removed: %v, want ErrKeyRequired", err)
	}
}

func TestPlainDataDirIsEncryptedInPlace(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	withBucket(t, Config{DataDir: dir, Sync: SyncAlways}, func(kv jetstream.KeyValue) { put(t, kv) })
	if len(plainIn(t, dir)) == 0 {
		t.Fatal("the plain store does not hold the value in plain: this test could not see encryption")
	}
	withBucket(t, Config{DataDir: dir, Sync: SyncAlways, EncryptionKey: keyA}, func(kv jetstream.KeyValue) { mustRead(t, kv) })
	if hits := plainIn(t, dir); len(hits) > 0 {
		t.Fatalf("after a start with a key, the value is still in plain in %v", hits)
	}
	if _, err := Start(Config{DataDir: dir}); !errors.Is(err, ErrKeyRequired) {
		t.Fatalf("no key after encrypting: %v", err)
	}
}
