// Package httpauth secures the engine's HTTP API: bearer tokens from a
// file (RFC 6750), HTTPS, and client certificates (mTLS), and the rule
// that an API listening beyond loopback must use one of them.
//
//	request ──► exempt path (/healthz, /readyz)? ──► handler
//	        └─► TLS client certificate verified (mTLS)? ──► handler
//	        └─► Authorization: Bearer <token in the file>? ──► handler
//	        └─► 401, WWW-Authenticate: Bearer realm="waymark"
//
// No token is ever logged or echoed: a refusal says only whether a token
// was missing or wrong.
package httpauth

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
)

// MinTokenBytes is the shortest token a token file may hold: a shorter
// one is guessable and refused.
const MinTokenBytes = 16

// Tokens are the bearer tokens of a token file. Safe for concurrent use;
// Reload swaps the set atomically.
type Tokens struct {
	path string
	set  atomic.Pointer[[][sha256.Size]byte] // digests: compared in constant time, equal length
}

// LoadTokens reads a token file: one token per line; blank lines and
// lines starting with '#' are skipped; spaces around a token are
// trimmed. A file without tokens, or with a token shorter than
// MinTokenBytes or holding spaces, is an error naming the file and line
// (never the token).
func LoadTokens(path string) (*Tokens, error) {
	t := &Tokens{path: path}
	if err := t.Reload(); err != nil {
		return nil, err
	}
	return t, nil
}

// Reload reads the file again; on error the tokens in use stay.
func (t *Tokens) Reload() error {
	data, err := os.ReadFile(t.path)
	if err != nil {
		return fmt.Errorf("token file: %w", err)
	}
	var set [][sha256.Size]byte
	sc := bufio.NewScanner(bytes.NewReader(data))
	for line := 1; sc.Scan(); line++ {
		tok := strings.TrimSpace(sc.Text())
		if tok == "" || strings.HasPrefix(tok, "#") {
			continue
		}
		switch {
		case strings.ContainsAny(tok, " \t"):
			return fmt.Errorf("token file %s:%d: a token holds a space; write one token per line", t.path, line)
		case len(tok) < MinTokenBytes:
			return fmt.Errorf("token file %s:%d: token shorter than %d bytes; generate one with `openssl rand -hex 32`", t.path, line, MinTokenBytes)
		}
		set = append(set, sha256.Sum256([]byte(tok)))
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("token file %s: %w", t.path, err)
	}
	if len(set) == 0 {
		return fmt.Errorf("token file %s: no tokens (one per line; '#' starts a comment)", t.path)
	}
	t.set.Store(&set)
	return nil
}

// Len is the number of tokens in use.
func (t *Tokens) Len() int { return len(*t.set.Load()) }

// Valid reports whether tok is one of the tokens. It compares digests in
// constant time and looks at every token, so the time taken says nothing
// about which token, or how much of one, matched.
func (t *Tokens) Valid(tok string) bool {
	d := sha256.Sum256([]byte(tok))
	ok := 0
	for _, s := range *t.set.Load() {
		ok |= subtle.ConstantTimeCompare(d[:], s[:])
	}
	return ok == 1
}

// Exempt are the paths served without authentication: the probes, which
// a load balancer or kubelet calls without credentials and which reveal
// nothing but up or down.
var Exempt = []string{"/healthz", "/readyz"}

// Require wraps next: a request passes with a verified client certificate
// (when the server asks for them, mTLS) or a valid bearer token (when
// tokens is not nil); the Exempt paths always pass. Anything else gets 401
// with WWW-Authenticate: Bearer realm="waymark" (error="invalid_token"
// when a token was given) and the API's error body {"error": {"code":
// "unauthorized", "message": ...}}.
func Require(tokens *Tokens, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, p := range Exempt {
			if r.URL.Path == p {
				next.ServeHTTP(w, r)
				return
			}
		}
		if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 {
			next.ServeHTTP(w, r)
			return
		}
		auth := r.Header.Get("Authorization")
		scheme, tok, _ := strings.Cut(auth, " ")
		if tokens != nil && strings.EqualFold(scheme, "Bearer") && tokens.Valid(strings.TrimSpace(tok)) {
			next.ServeHTTP(w, r)
			return
		}
		challenge, msg := `Bearer realm="waymark"`, "authentication required: send Authorization: Bearer <token>"
		if tokens == nil {
			msg = "authentication required: present a client certificate signed by the API's CA"
		}
		if auth != "" {
			challenge += `, error="invalid_token"`
			msg = "the token is not valid"
			if !strings.EqualFold(scheme, "Bearer") {
				msg = "only Bearer tokens are accepted"
			}
		}
		w.Header().Set("WWW-Authenticate", challenge)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnauthorized)
		_ = json.NewEncoder(w).Encode(map[string]map[string]string{"error": {"code": "unauthorized", "message": msg}})
	})
}

// IsLoopback reports whether addr (host:port, as --http takes it) listens
// on loopback only: 127.0.0.0/8, ::1 or localhost. An empty host, 0.0.0.0
// and :: listen on every interface; any other name may resolve to a
// public address: both count as beyond loopback.
func IsLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// ErrUnprotected is returned by CheckExposure for an API beyond loopback
// without authentication.
var ErrUnprotected = errors.New("HTTP API beyond loopback without authentication")

// CheckExposure refuses an API on addr beyond loopback with neither
// tokens nor client certificates, saying what to add.
func CheckExposure(addr string, tokens, mtls bool) error {
	if tokens || mtls || IsLoopback(addr) {
		return nil
	}
	return fmt.Errorf("--http %q listens beyond loopback, and anyone who reaches it could start, approve and cancel jobs: add --http-token-file FILE (bearer tokens, one per line), or --http-tlscert, --http-tlskey and --http-tlsca (client certificates), or listen on 127.0.0.1: %w", addr, ErrUnprotected)
}

// ServerTLS builds the API's TLS configuration from PEM files: the
// server's certificate and key and, when caFile is given, the CA whose
// signature a client certificate must carry (mTLS). The handshake
// verifies a certificate a client presents but lets one without through,
// so that the probes (Exempt) answer a kubelet that has none; Require
// then refuses every other request without a verified certificate or a
// token. Errors name the flag and the file.
func ServerTLS(certFile, keyFile, caFile string) (*tls.Config, error) {
	switch {
	case certFile == "" && keyFile == "" && caFile == "":
		return nil, nil
	case certFile == "" || keyFile == "":
		return nil, errors.New("--http-tlscert and --http-tlskey go together: HTTPS needs the certificate and its key")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("--http-tlscert %q, --http-tlskey %q: %v", certFile, keyFile, unwrapPath(err))
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}
	if caFile != "" {
		data, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("--http-tlsca %q: %v", caFile, unwrapPath(err))
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(data) {
			return nil, fmt.Errorf("--http-tlsca %q: no PEM certificates in the file", caFile)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.VerifyClientCertIfGiven
	}
	return cfg, nil
}

func unwrapPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
