package natsserver

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/nats-io/nats-server/v2/server"
)

// Ciphers of JetStream's encryption at rest.
const (
	CipherChaCha = "chacha" // ChaCha20-Poly1305, the default
	CipherAES    = "aes"    // AES-256-GCM
)

// MinKeyBytes is the shortest encryption key accepted.
const MinKeyBytes = 32

// Errors of a data directory whose encryption does not match the key.
var (
	// ErrKeyRequired: the directory was written encrypted and no key was given.
	ErrKeyRequired = errors.New("data directory is encrypted")
	// ErrWrongKey: the key given is not the one the directory was written with.
	ErrWrongKey = errors.New("wrong encryption key")
)

// keyCheckFile, beside DataDir/jetstream, records that the directory is
// encrypted and lets a start tell a wrong key from the right one before
// the server runs: the server itself would start, log that it cannot
// decrypt a stream, and serve without it, and the engine would then
// create that stream again, empty. It holds the cipher, a random salt and
// HMAC-SHA256(key, salt): it proves nothing about the data that the
// encrypted files do not prove already (each is checked against the key
// too), and reveals nothing of a strong key.
const keyCheckFile = "encryption.json"

type keyCheck struct {
	Version int    `json:"version"`
	Cipher  string `json:"cipher"`
	Salt    string `json:"salt"`
	Check   string `json:"check"`
}

func keyMAC(key string, salt []byte) string {
	m := hmac.New(sha256.New, []byte(key))
	m.Write([]byte("waymark jetstream key check\x00"))
	m.Write(salt)
	return base64.StdEncoding.EncodeToString(m.Sum(nil))
}

func (k keyCheck) matches(key string) bool {
	salt, err := base64.StdEncoding.DecodeString(k.Salt)
	if err != nil || key == "" {
		return false
	}
	return hmac.Equal([]byte(keyMAC(key, salt)), []byte(k.Check))
}

func writeKeyCheck(dir, key, cipher string) error {
	salt := make([]byte, 16)
	if _, err := rand.Read(salt); err != nil {
		return err
	}
	data, err := json.MarshalIndent(keyCheck{Version: 1, Cipher: cipher, Salt: base64.StdEncoding.EncodeToString(salt), Check: keyMAC(key, salt)}, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, keyCheckFile+".tmp")
	if err := os.WriteFile(tmp, append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("record encryption in %s: %w", dir, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, keyCheckFile)); err != nil {
		return fmt.Errorf("record encryption in %s: %w", dir, err)
	}
	return nil
}

// hasEncryptedStreams reports whether the JetStream directory holds a
// stream or consumer key file, which only encrypted stores write.
func hasEncryptedStreams(jsDir string) bool {
	found := false
	_ = filepath.WalkDir(jsDir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == server.JetStreamMetaFileKey {
			found = true
			return filepath.SkipAll
		}
		return nil
	})
	return found
}

// prepareEncryption checks cfg's key against the data directory before
// the server starts, records a new encryption (or a new key after a
// rotation) and sets the server's options. See Config.EncryptionKey.
func prepareEncryption(cfg Config, opts *server.Options) (commit func() error, err error) {
	commit = func() error { return nil }
	dir := cfg.DataDir
	var rec *keyCheck
	data, err := os.ReadFile(filepath.Join(dir, keyCheckFile))
	switch {
	case err == nil:
		rec = &keyCheck{}
		if err := json.Unmarshal(data, rec); err != nil || rec.Salt == "" || rec.Check == "" {
			return commit, fmt.Errorf("data directory %s: %s is damaged (%v): restore it from a backup of the directory, or remove it only if the directory was never encrypted", dir, keyCheckFile, err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return commit, fmt.Errorf("data directory %s: %w", dir, err)
	}
	if cfg.EncryptionKey == "" {
		if rec != nil || hasEncryptedStreams(filepath.Join(dir, "jetstream")) {
			return commit, fmt.Errorf("data directory %s was written encrypted: give its key with --encryption-key-file FILE or WAYMARK_ENCRYPTION_KEY: %w", dir, ErrKeyRequired)
		}
		return commit, nil
	}
	if len(cfg.EncryptionKey) < MinKeyBytes {
		return commit, fmt.Errorf("encryption key: %d bytes, want at least %d (generate one with `openssl rand -hex 32`)", len(cfg.EncryptionKey), MinKeyBytes)
	}
	cipher := cfg.EncryptionCipher
	switch cipher {
	case "", CipherChaCha:
		cipher, opts.JetStreamCipher = CipherChaCha, server.ChaCha
	case CipherAES:
		opts.JetStreamCipher = server.AES
	default:
		return commit, fmt.Errorf("encryption cipher %q: want %s or %s", cfg.EncryptionCipher, CipherChaCha, CipherAES)
	}
	opts.JetStreamKey = cfg.EncryptionKey
	switch {
	case rec == nil && hasEncryptedStreams(filepath.Join(dir, "jetstream")):
		// Encrypted by something else (the record was removed): the server
		// checks the key against the files itself.
		return func() error { return writeKeyCheck(dir, cfg.EncryptionKey, cipher) }, nil
	case rec == nil:
		// A new directory, or a plain one the server now encrypts in place.
		// Recorded before the server writes: a crash in between must not
		// leave encrypted files that a start without the key takes for new.
		return commit, writeKeyCheck(dir, cfg.EncryptionKey, cipher)
	case rec.matches(cfg.EncryptionKey):
		if rec.Cipher != cipher {
			return func() error { return writeKeyCheck(dir, cfg.EncryptionKey, cipher) }, nil
		}
		return commit, nil
	}
	return commit, fmt.Errorf("data directory %s: the encryption key is not the one it was written with (check --encryption-key-file or WAYMARK_ENCRYPTION_KEY): %w", dir, ErrWrongKey)
}
