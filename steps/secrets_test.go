package steps

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// secretsEnv returns an Env whose secrets directory holds files and whose
// environment is vars.
func secretsEnv(t *testing.T, files, vars map[string]string, exposed ...string) *Env {
	t.Helper()
	dir := t.TempDir()
	for name, v := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return &Env{Getenv: func(k string) string { return vars[k] }, Secrets: Secrets{Dir: dir, Env: exposed}}
}

func TestSecretSources(t *testing.T) {
	t.Parallel()
	env := secretsEnv(t,
		map[string]string{
			"stripe-key": "sk_live_from_file\n",
			"crlf":       "value-crlf\r\n",
			"kept":       "two newlines\n\n",
			"both":       "file-wins",
			"short":      "q#3",
			".hidden":    "not-a-secret",
		},
		map[string]string{
			"WAYMARK_SECRET_TOKEN":  "token-from-env",
			"WAYMARK_SECRET_both":   "env-loses",
			"GITHUB_TOKEN":          "ghp_exposed_value",
			"AWS_SECRET_ACCESS_KEY": "aws-not-exposed",
			"WAYMARK_SECRET_tiny":   "Z9",
		},
		"GITHUB_TOKEN")
	if err := os.Mkdir(filepath.Join(env.Secrets.Dir, "adir"), 0o700); err != nil {
		t.Fatal(err)
	}
	big := strings.Repeat("x", MaxSecretBytes+1)
	if err := os.WriteFile(filepath.Join(env.Secrets.Dir, "huge"), []byte(big), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, secret, want string
		wantErr            []string // all in the message
		wantUnknown        bool
	}{
		{name: "file, one trailing newline dropped", secret: "stripe-key", want: "sk_live_from_file"},
		{name: "file with CRLF", secret: "crlf", want: "value-crlf"},
		{name: "only one newline dropped", secret: "kept", want: "two newlines\n"},
		{name: "file wins over the environment", secret: "both", want: "file-wins"},
		{name: "prefixed variable", secret: "TOKEN", want: "token-from-env"},
		{name: "exposed variable", secret: "GITHUB_TOKEN", want: "ghp_exposed_value"},
		{name: "variables are not secrets unless exposed", secret: "AWS_SECRET_ACCESS_KEY", wantUnknown: true,
			wantErr: []string{`secret "AWS_SECRET_ACCESS_KEY" is not set on this worker`, "WAYMARK_SECRET_AWS_SECRET_ACCESS_KEY"}},
		{name: "unknown", secret: "nope", wantUnknown: true, wantErr: []string{`secret "nope"`, "no file " + filepath.Join(env.Secrets.Dir, "nope")}},
		{name: "dot files are not secrets", secret: ".hidden", wantErr: []string{`secret name ".hidden"`}},
		{name: "no path traversal", secret: "../etc/passwd", wantErr: []string{`secret name "../etc/passwd"`}},
		{name: "no separators", secret: "a/b", wantErr: []string{"secret name"}},
		{name: "empty name", secret: "", wantErr: []string{"secret name"}},
		{name: "too short a file", secret: "short", wantErr: []string{`secret "short"`, "is 3 bytes", "at least 4"}},
		{name: "too short a variable", secret: "tiny", wantErr: []string{`secret "tiny"`, "WAYMARK_SECRET_tiny", "is 2 bytes"}},
		{name: "too long a file", secret: "huge", wantErr: []string{`secret "huge"`, "over 65536 bytes"}},
		{name: "a directory", secret: "adir", wantErr: []string{`secret "adir"`, "is a directory"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := env.lookupSecret(tt.secret)
			if tt.wantErr == nil {
				if err != nil || got != tt.want {
					t.Fatalf("lookupSecret(%q) = %q, %v; want %q", tt.secret, got, err, tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("lookupSecret(%q) = %q, want an error", tt.secret, got)
			}
			for _, w := range tt.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if errors.Is(err, ErrUnknownSecret) != tt.wantUnknown {
				t.Errorf("errors.Is(%v, ErrUnknownSecret) = %v, want %v", err, !tt.wantUnknown, tt.wantUnknown)
			}
			for _, v := range []string{"aws-not-exposed", "q#3", "Z9", "sk_live", "token-from-env", "ghp_", big[:20]} {
				if strings.Contains(err.Error(), v) {
					t.Errorf("error %q shows a value", err)
				}
			}
		})
	}
}

func TestSecretFileIsReadAtEachCall(t *testing.T) {
	t.Parallel()
	env := secretsEnv(t, map[string]string{"rotating": "first-value"}, nil)
	if v, err := env.lookupSecret("rotating"); err != nil || v != "first-value" {
		t.Fatalf("lookupSecret = %q, %v", v, err)
	}
	// A Kubernetes secret volume is updated in place.
	if err := os.WriteFile(filepath.Join(env.Secrets.Dir, "rotating"), []byte("second-value"), 0o600); err != nil {
		t.Fatal(err)
	}
	if v, err := env.lookupSecret("rotating"); err != nil || v != "second-value" {
		t.Fatalf("after rotation lookupSecret = %q, %v; want the new value", v, err)
	}
}

func TestSecretZeroEnvReadsOnlyThePrefix(t *testing.T) {
	t.Setenv("WAYMARK_SECRET_WM_TEST_ZERO", "zero-env-value")
	t.Setenv("WM_TEST_ZERO", "not-exposed-value")
	var nilEnv *Env
	for _, e := range []*Env{nilEnv, {}} {
		if v, err := e.lookupSecret("WM_TEST_ZERO"); err != nil || v != "zero-env-value" {
			t.Errorf("lookupSecret = %q, %v; want the WAYMARK_SECRET_ variable", v, err)
		}
		if _, err := e.lookupSecret("OTHER_WM_TEST"); !errors.Is(err, ErrUnknownSecret) || !strings.Contains(err.Error(), "no --secrets-dir is set") {
			t.Errorf("unknown secret = %v", err)
		}
	}
}

func TestCallSecretIsNotPerformedAndScrubbed(t *testing.T) {
	t.Parallel()
	env := secretsEnv(t, map[string]string{"api": "custom-kind-credential"}, nil)
	c := &Call{Env: env}
	v, err := c.Secret("api")
	if err != nil || v != "custom-kind-credential" {
		t.Fatalf("Secret = %q, %v", v, err)
	}
	out, err := c.scrubResult(map[string]any{"echo": "got " + v}, errors.New("provider said: bad key "+v))
	if b, _ := out.([]byte); strings.Contains(string(b), v) {
		t.Errorf("output %s holds the secret", b)
	}
	raw, _ := encodeOutput(out)
	if string(raw) != `{"echo":"got [redacted:api]"}` {
		t.Errorf("output = %s", raw)
	}
	e := toError(err)
	if e.Message != "provider said: bad key [redacted:api]" || !e.Retryable {
		t.Errorf("error = %+v; want the secret scrubbed and still retryable", e)
	}

	_, err = c.Secret("missing")
	wantStepError(t, err, "step_failed", false, `secret "missing" is not set`)
	if !notPerformed(err) || !errors.Is(err, ErrUnknownSecret) {
		t.Errorf("unknown secret error %v: not performed %v, ErrUnknownSecret %v; want both", err, notPerformed(err), errors.Is(err, ErrUnknownSecret))
	}
}
