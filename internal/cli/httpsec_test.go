package cli

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// served is an engine serve running in this process.
type served struct {
	out, log *syncBuf
	httpURL  string // scheme://host:port of the HTTP API
	natsURL  string
}

// startServe runs engine serve with args (after serve's own data
// directory and listeners) until the test ends, and waits for its HTTP
// API to be announced.
func startServe(t *testing.T, args ...string) *served {
	t.Helper()
	s := &served{out: &syncBuf{}, log: &syncBuf{}}
	cmd := NewEngineCommand(s.out, s.log)
	cmd.SetArgs(append([]string{"serve", "--data-dir", t.TempDir(), "--sync", "interval", "--listen", "127.0.0.1:0",
		"--workers", "0", "--log-level", "debug", "--log-format", "json"}, args...))
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()
	t.Cleanup(func() {
		stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("serve did not stop within 30s")
		}
	})
	re := regexp.MustCompile(`(?m)^nats: (nats://\S+).*\n(?:.*\n)*?http: (https?)://(\S+)`)
	testsupport.Eventually(t, 30*time.Second, func() bool {
		select {
		case err := <-done:
			t.Fatalf("serve stopped: %v\n%s\n%s", err, s.out, s.log)
		default:
		}
		m := re.FindStringSubmatch(s.out.String())
		if m != nil {
			s.natsURL = m[1]
			host := m[3]
			if strings.HasPrefix(host, "0.0.0.0:") || strings.HasPrefix(host, "[::]:") {
				host = "127.0.0.1:" + host[strings.LastIndex(host, ":")+1:]
			}
			s.httpURL = m[2] + "://" + host
		}
		return m != nil
	}, "serve did not print its addresses: %s %s", s.out, s.log)
	return s
}

func writeFile(t *testing.T, name, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// call sends method path with an optional bearer token and returns the
// status and the WWW-Authenticate header.
func call(t *testing.T, c *http.Client, method, url, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("WWW-Authenticate")
}

func TestServeRefusesAPublicAPIWithoutAuthentication(t *testing.T) {
	t.Parallel()
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0", "example.com:8080"} {
		dir := t.TempDir()
		_, errOut, code := execute(t, "serve", "--data-dir", dir, "--listen", "127.0.0.1:0", "--http", addr)
		if code != 2 || !strings.Contains(errOut, "beyond loopback") || !strings.Contains(errOut, "--http-token-file") || !strings.Contains(errOut, "--http-tlsca") {
			t.Errorf("--http %s without authentication: exit %d\n%s\nwant 2 saying what to add", addr, code, errOut)
		}
		if _, err := os.Stat(filepath.Join(dir, "jetstream")); err == nil {
			t.Errorf("--http %s: the embedded server started before the refusal", addr)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--http-token-file", "/nonexistent/tokens"}, `--http-token-file "/nonexistent/tokens"`},
		{[]string{"--http-token-file", writeFile(t, "short", "# a comment\nshort\n")}, "shorter than 16 bytes"},
		{[]string{"--http-token-file", writeFile(t, "empty", "# only comments\n\n")}, "no tokens"},
		{[]string{"--http-tlsca", "/nonexistent/ca.pem"}, "--http-tlsca"},
		{[]string{"--http-tlscert", "/nonexistent/cert.pem"}, "go together"},
	} {
		_, errOut, code := execute(t, append([]string{"serve", "--data-dir", t.TempDir(), "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"}, tc.args...)...)
		if code != 2 || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d\n%s\nwant 2 containing %q", tc.args, code, errOut, tc.want)
		}
	}
}

func TestServeBearerTokens(t *testing.T) {
	const tokA, tokB, tokC = "token-a-0123456789abcdef", "token-b-0123456789abcdef", "token-c-0123456789abcdef"
	file := writeFile(t, "tokens", "# engine API tokens\n"+tokA+"\n\n  "+tokB+"  \n")
	s := startServe(t, "--http", "0.0.0.0:0", "--http-token-file", file)
	c := http.DefaultClient
	for _, tc := range []struct {
		method, path, token string
		want                int
		challenge           string
	}{
		{"GET", "/v1/jobs", "", 401, `Bearer realm="waymark"`},
		{"GET", "/v1/jobs", "wrong-token-0123456789", 401, `Bearer realm="waymark", error="invalid_token"`},
		{"POST", "/v1/jobs/j1/cancel", "", 401, `Bearer realm="waymark"`},
		{"GET", "/metrics", "", 401, `Bearer realm="waymark"`},
		{"GET", "/v1/jobs", tokA, 200, ""},
		{"GET", "/v1/jobs", tokB, 200, ""},
		{"GET", "/metrics", tokB, 200, ""},
		{"GET", "/healthz", "", 200, ""},
		{"GET", "/readyz", "", 200, ""},
	} {
		code, challenge := call(t, c, tc.method, s.httpURL+tc.path, tc.token)
		if code != tc.want || challenge != tc.challenge {
			t.Errorf("%s %s with %q: %d %q, want %d %q", tc.method, tc.path, tc.token, code, challenge, tc.want, tc.challenge)
		}
	}
	// SIGHUP reloads the file: B is revoked, C added.
	if err := os.WriteFile(file, []byte(tokA+"\n"+tokC+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		b, _ := call(t, c, "GET", s.httpURL+"/v1/jobs", tokB)
		cc, _ := call(t, c, "GET", s.httpURL+"/v1/jobs", tokC)
		return b == 401 && cc == 200
	}, "SIGHUP did not reload the token file: %s", s.log)
	for _, tok := range []string{tokA, tokB, tokC} {
		if strings.Contains(s.out.String()+s.log.String(), tok) {
			t.Fatalf("a token reached the output or the log")
		}
	}
	if !strings.Contains(s.out.String(), "bearer tokens (2)") || !strings.Contains(s.log.String(), "plain HTTP beyond loopback") {
		t.Errorf("serve does not say how its API authenticates, or does not warn about tokens over plain HTTP:\n%s\n%s", s.out, s.log)
	}
}

func TestServeClientCertificates(t *testing.T) {
	t.Parallel()
	certs := testsupport.NewCerts(t)
	s := startServe(t, "--http", "0.0.0.0:0", "--http-tlscert", certs.ServerCert, "--http-tlskey", certs.ServerKey, "--http-tlsca", certs.CA)
	if !strings.HasPrefix(s.httpURL, "https://") {
		t.Fatalf("API not on HTTPS: %s", s.httpURL)
	}
	pool := x509.NewCertPool()
	ca, _ := os.ReadFile(certs.CA)
	pool.AppendCertsFromPEM(ca)
	client := func(cert, key string) *http.Client {
		cfg := &tls.Config{RootCAs: pool}
		if cert != "" {
			kp, err := tls.LoadX509KeyPair(cert, key)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Certificates = []tls.Certificate{kp}
		}
		return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 10 * time.Second}
	}
	signed, anonymous := client(certs.ClientCert, certs.ClientKey), client("", "")
	if code, _ := call(t, signed, "GET", s.httpURL+"/v1/jobs", ""); code != 200 {
		t.Errorf("with a signed client certificate: %d, want 200", code)
	}
	if code, challenge := call(t, anonymous, "GET", s.httpURL+"/v1/jobs", ""); code != 401 || challenge == "" {
		t.Errorf("without a client certificate: %d %q, want 401 with a challenge", code, challenge)
	}
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, _ := call(t, anonymous, "GET", s.httpURL+p, ""); code != 200 {
			t.Errorf("%s without a client certificate: %d, want 200 (probes are exempt)", p, code)
		}
	}
	// A certificate of another CA is refused: in the handshake, or (Go's
	// client sends none that the server's CA list does not name) with 401.
	req, _ := http.NewRequest("GET", s.httpURL+"/v1/jobs", nil)
	if resp, err := client(certs.OtherCert, certs.OtherKey).Do(req); err == nil {
		resp.Body.Close()
		if resp.StatusCode != 401 {
			t.Errorf("a certificate of another CA was accepted: %d", resp.StatusCode)
		}
	}
	other, err := tls.LoadX509KeyPair(certs.OtherCert, certs.OtherKey)
	if err != nil {
		t.Fatal(err)
	}
	forced := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &other, nil }}}}
	if resp, err := forced.Get(s.httpURL + "/healthz"); err == nil {
		resp.Body.Close()
		t.Errorf("a certificate of another CA, presented, passed the handshake: %d", resp.StatusCode)
	}
}

// TestContextNamesTheServer: --context replaces the embedded server as
// --nats-url does, and is refused beside the embedded server's flags.
func TestContextNamesTheServer(t *testing.T) {
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	wf := writeWorkflow(t, testsupport.NoopChain("ctx", 1))
	_, errOut, code := execute(t, "run", wf, "--context", "prod")
	if code != 2 || !strings.Contains(errOut, `--context "prod": no such context`) {
		t.Errorf("run --context prod (none saved): exit %d\n%s\nwant 2 naming the context", code, errOut)
	}
	_, errOut, code = execute(t, "serve", "--context", "prod", "--data-dir", t.TempDir())
	if code != 2 || !strings.Contains(errOut, "--context and --data-dir both given") {
		t.Errorf("serve --context --data-dir: exit %d\n%s", code, errOut)
	}
	_, errOut, code = execute(t, "status", "j1", "--nkey", "/nonexistent/seed")
	if code != 2 || !strings.Contains(errOut, `--nkey "/nonexistent/seed"`) {
		t.Errorf("status --nkey missing: exit %d\n%s", code, errOut)
	}
}
