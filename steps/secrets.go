package steps

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// This file is where a worker finds secret values. A definition names a
// secret ({{secret "NAME"}} in an http step's url, headers or body, or a
// model step's api_key_secret); the worker resolves the name when it makes
// the call, sends the value, and scrubs it from every text the call
// produces (see scrub.go). Values never enter a definition, a step
// message, a checkpoint, the ledger or the history.
//
// Which values a workflow may read is the worker operator's choice, never
// the workflow author's: a definition could otherwise send any variable of
// the worker's environment (cloud credentials, the NATS credentials file
// path) to a server of its choosing. So a worker exposes only
//
//   - the files of its secrets directory (Secrets.Dir: a Kubernetes secret
//     volume, or systemd's $CREDENTIALS_DIRECTORY), one secret per file;
//   - environment variables named WAYMARK_SECRET_<NAME> (Kubernetes envFrom
//     with prefix: WAYMARK_SECRET_ gives exactly these);
//   - the unprefixed variables the operator lists in Secrets.Env.

// SecretEnvPrefix starts the name of every environment variable a worker
// exposes as a secret without being told: WAYMARK_SECRET_STRIPE_KEY is the
// secret STRIPE_KEY.
const SecretEnvPrefix = "WAYMARK_SECRET_"

// Limits on secret values.
const (
	// MinSecretBytes is the shortest value a worker accepts: a shorter one
	// could not be scrubbed from texts without mangling them.
	MinSecretBytes = 4
	// MaxSecretBytes is the longest value a worker reads from a file.
	MaxSecretBytes = 64 << 10
)

// ErrUnknownSecret is matched (errors.Is) by the error for a secret name
// that none of the worker's sources holds. The message names the secret
// and where the worker looked; it never holds a value.
var ErrUnknownSecret = errors.New("unknown secret")

// Secrets says where a worker finds secret values besides the
// WAYMARK_SECRET_<NAME> environment variables, which it always reads. The
// zero value exposes only those.
type Secrets struct {
	// Dir is a directory holding one file per secret, named as the secret;
	// its contents, less one trailing newline ("\n" or "\r\n"), are the
	// value. Files are read at each call, so a rotated file (a Kubernetes
	// secret volume updates in place) takes effect at once. Files whose
	// names start with "." are not secrets (Kubernetes keeps its ..data
	// links there). Empty means no directory. A file wins over a variable
	// of the same name.
	Dir string
	// Env lists environment variables exposed under their own names (for
	// example ANTHROPIC_API_KEY, to let a model step with a base_url of its
	// own send it). Nil exposes none beyond WAYMARK_SECRET_*.
	Env []string
}

// secretNameRE is what a secret name may be: the characters of a
// Kubernetes secret key, starting with a letter, digit or underscore (so no
// ".", "..", or path separator reaches the file system).
var secretNameRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)

// CheckSecretName reports a name {{secret}}, api_key_secret or --secret-env
// cannot use: up to 128 letters, digits, '_', '.' and '-', not starting
// with '.' or '-'.
func CheckSecretName(name string) error {
	if !secretNameRE.MatchString(name) {
		return fmt.Errorf("secret name %q: want up to 128 letters, digits, '_', '.' and '-', starting with a letter, digit or '_'", name)
	}
	return nil
}

// exposesEnv reports whether the worker exposes the environment variable
// name to workflows: WAYMARK_SECRET_* always, others when Secrets.Env lists
// them.
func (e *Env) exposesEnv(name string) bool {
	if strings.HasPrefix(name, SecretEnvPrefix) && len(name) > len(SecretEnvPrefix) {
		return true
	}
	return e != nil && contains(e.Secrets.Env, name)
}

// lookupSecret returns the value of the named secret from the worker's
// sources, in order: the secrets directory, WAYMARK_SECRET_<name>, then
// <name> itself when Secrets.Env lists it. Errors: a malformed name, a
// file that cannot be read, a value too short or too long, and
// ErrUnknownSecret. No error message holds a value.
func (e *Env) lookupSecret(name string) (string, error) {
	if err := CheckSecretName(name); err != nil {
		return "", err
	}
	var dir string
	if e != nil {
		dir = e.Secrets.Dir
	}
	if dir != "" {
		v, found, err := readSecretFile(dir, name)
		if err != nil || found {
			return v, err
		}
	}
	if v := e.getenv(SecretEnvPrefix + name); v != "" {
		return v, checkSecretValue(name, v, "environment variable "+SecretEnvPrefix+name)
	}
	if e.exposesEnv(name) {
		if v := e.getenv(name); v != "" {
			return v, checkSecretValue(name, v, "environment variable "+name)
		}
	}
	where := "no --secrets-dir is set"
	if dir != "" {
		where = fmt.Sprintf("no file %s", filepath.Join(dir, name))
	}
	return "", fmt.Errorf("secret %q is not set on this worker (%s, and no environment variable %s%s): %w",
		name, where, SecretEnvPrefix, name, ErrUnknownSecret)
}

// hasSecret reports whether lookupSecret would find name; a source that
// fails (an unreadable file) counts as having it, so the call reports the
// failure.
func (e *Env) hasSecret(name string) bool {
	_, err := e.lookupSecret(name)
	return !errors.Is(err, ErrUnknownSecret)
}

// readSecretFile reads dir/name. found is false when there is no such
// file.
func readSecretFile(dir, name string) (value string, found bool, err error) {
	path := filepath.Join(dir, name)
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", false, nil
	}
	if err != nil {
		return "", true, fmt.Errorf("secret %q: %w", name, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxSecretBytes+1))
	if err != nil {
		return "", true, fmt.Errorf("secret %q: read %s: %w", name, path, err)
	}
	if len(b) > MaxSecretBytes {
		return "", true, fmt.Errorf("secret %q: file %s is over %d bytes", name, path, MaxSecretBytes)
	}
	v := string(b)
	if strings.HasSuffix(v, "\r\n") {
		v = v[:len(v)-2]
	} else {
		v = strings.TrimSuffix(v, "\n")
	}
	return v, true, checkSecretValue(name, v, "file "+path)
}

func checkSecretValue(name, v, from string) error {
	if len(v) < MinSecretBytes {
		return fmt.Errorf("secret %q from %s is %d bytes; a secret needs at least %d, or it could not be scrubbed from texts", name, from, len(v), MinSecretBytes)
	}
	return nil
}

// Secret returns the value of the named secret, read from the worker's
// sources now, and remembers it for this call: the worker scrubs it from
// the call's output and error, and from everything it logs about the call.
// A custom kind reads its credentials with it. An unknown name returns an
// error matching ErrUnknownSecret; return it as it is (it is marked
// non-retryable and not performed). Safe for concurrent use.
func (c *Call) Secret(name string) (string, error) {
	return c.secretFrom(c.Env, name)
}

// secretFrom is Secret with the sources of env (a kind's Prep.Env).
func (c *Call) secretFrom(env *Env, name string) (string, error) {
	v, err := env.lookupSecret(name)
	if err != nil {
		return "", NotPerformed(NonRetryable(err))
	}
	c.scrubber().addSecret(name, v)
	return v, nil
}
