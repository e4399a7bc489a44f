package httpauth

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestIsLoopback(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string]bool{
		"127.0.0.1:8080": true, "127.9.9.9:80": true, "[::1]:8080": true, "localhost:8080": true, "LOCALHOST:1": true,
		":8080": false, "0.0.0.0:8080": false, "[::]:8080": false, "10.0.0.5:8080": false, "example.com:80": false,
		"garbage": false, "[::ffff:127.0.0.1]:80": true,
	} {
		if got := IsLoopback(addr); got != want {
			t.Errorf("IsLoopback(%q) = %v, want %v", addr, got, want)
		}
	}
	if err := CheckExposure("0.0.0.0:80", false, false); !errors.Is(err, ErrUnprotected) {
		t.Errorf("public, no auth: %v, want ErrUnprotected", err)
	}
	for _, c := range [][2]bool{{true, false}, {false, true}} {
		if err := CheckExposure("0.0.0.0:80", c[0], c[1]); err != nil {
			t.Errorf("public with tokens=%v mtls=%v: %v", c[0], c[1], err)
		}
	}
}

func TestTokensAndRequire(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(path, []byte("# ops\nabcdefghijklmnop\n\nqrstuvwxyz0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tok, err := LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	if tok.Len() != 2 || !tok.Valid("abcdefghijklmnop") || tok.Valid("abcdefghijklmno") || tok.Valid("") || tok.Valid("# ops") {
		t.Fatalf("tokens: len %d; validity wrong", tok.Len())
	}
	h := Require(tok, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(204) }))
	for _, tc := range []struct {
		path, auth string
		want       int
	}{
		{"/v1/jobs", "", 401}, {"/v1/jobs", "Bearer abcdefghijklmnop", 204}, {"/v1/jobs", "bearer qrstuvwxyz0123456789", 204},
		{"/v1/jobs", "Basic abcdefghijklmnop", 401}, {"/v1/jobs", "Bearer nope", 401}, {"/healthz", "", 204}, {"/readyz", "", 204},
		{"/healthz/x", "", 401},
	} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", tc.path, nil)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		h.ServeHTTP(rec, req)
		if rec.Code != tc.want {
			t.Errorf("%s %q: %d, want %d", tc.path, tc.auth, rec.Code, tc.want)
		}
		if rec.Code == 401 && (!strings.HasPrefix(rec.Header().Get("WWW-Authenticate"), `Bearer realm="waymark"`) || !strings.Contains(rec.Body.String(), `{"error":{"code":"unauthorized"`)) {
			t.Errorf("%s %q: 401 without the challenge or the JSON body: %q %s", tc.path, tc.auth, rec.Header().Get("WWW-Authenticate"), rec.Body)
		}
		if strings.Contains(rec.Body.String(), "abcdefghijklmnop") {
			t.Errorf("the answer echoes a token")
		}
	}
	// A reload that fails keeps the tokens in use.
	if err := os.WriteFile(path, []byte("tiny\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := tok.Reload(); err == nil || !strings.Contains(err.Error(), path+":1") || strings.Contains(err.Error(), "tiny") {
		t.Fatalf("reload of a bad file: %v, want an error naming file and line, not the token", err)
	}
	if !tok.Valid("abcdefghijklmnop") {
		t.Fatal("a failed reload dropped the tokens in use")
	}
}
