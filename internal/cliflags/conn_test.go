package cliflags

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jsm.go/natscontext"
	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// contextHome points the nats CLI's context directory at a fresh
// directory (natscontext and ContextDir both read XDG_CONFIG_HOME).
func contextHome(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", dir)
	return dir
}

// saveContext writes a context with the nats CLI's own library, so the
// test proves that Waymark reads the files the nats CLI writes.
func saveContext(t *testing.T, name string, opts ...natscontext.Option) {
	t.Helper()
	c, err := natscontext.New(name, false, opts...)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Save(name); err != nil {
		t.Fatalf("save context %s: %v", name, err)
	}
}

func TestEveryConnectionFlagIsBound(t *testing.T) {
	for _, env := range []string{"NATS_URL", "NATS_CREDS", "NATS_NKEY", "NATS_CERT", "NATS_KEY", "NATS_CA", "NATS_CONTEXT"} {
		t.Setenv(env, "")
	}
	var g Globals
	cmd := &cobra.Command{Use: "x", RunE: func(*cobra.Command, []string) error { return nil }}
	g.Bind(cmd)
	cmd.SetArgs([]string{"--server", "nats://a:4222", "--creds", "c.creds", "--nkey", "n.nk", "--tlscert", "c.pem",
		"--tlskey", "k.pem", "--tlsca", "ca.pem", "--context", "prod"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	want := Conn{URL: "nats://a:4222", Creds: "c.creds", NKey: "n.nk", TLSCert: "c.pem", TLSKey: "k.pem", TLSCA: "ca.pem", Context: "prod"}
	if g.Conn != want {
		t.Fatalf("flags bound to %+v, want %+v", g.Conn, want)
	}
	t.Setenv("NATS_NKEY", "from-env.nk")
	t.Setenv("NATS_CONTEXT", "staging")
	var h Globals
	cmd = &cobra.Command{Use: "x", RunE: func(*cobra.Command, []string) error { return nil }}
	h.Bind(cmd)
	cmd.SetArgs(nil)
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	if h.Conn.NKey != "from-env.nk" || h.Conn.Context != "staging" {
		t.Fatalf("environment defaults: %+v, want nkey from NATS_NKEY and context from NATS_CONTEXT", h.Conn)
	}
}

func TestContextSettingsAndFlagsWin(t *testing.T) {
	home := contextHome(t)
	saveContext(t, "prod", natscontext.WithServerURL("nats://ctx-host:4222"), natscontext.WithNKey("$HOME_SEEDS/engine.nk"),
		natscontext.WithCertificate("/ctx/cert.pem"), natscontext.WithKey("/ctx/key.pem"), natscontext.WithCA("/ctx/ca.pem"),
		natscontext.WithInboxPrefix("_INBOX_waymark"))
	t.Setenv("HOME_SEEDS", "/seeds")
	if _, err := os.Stat(filepath.Join(home, "nats", "context", "prod.json")); err != nil {
		t.Fatalf("natscontext did not write where ContextDir looks: %v", err)
	}
	for _, tc := range []struct {
		name string
		conn Conn
		want Settings
	}{
		{"context alone", Conn{Context: "prod"}, Settings{URL: "nats://ctx-host:4222", NKey: "/seeds/engine.nk",
			TLSCert: "/ctx/cert.pem", TLSKey: "/ctx/key.pem", TLSCA: "/ctx/ca.pem", InboxPrefix: "_INBOX_waymark"}},
		{"server flag wins", Conn{Context: "prod", URL: "nats://flag:4222"}, Settings{URL: "nats://flag:4222", NKey: "/seeds/engine.nk",
			TLSCert: "/ctx/cert.pem", TLSKey: "/ctx/key.pem", TLSCA: "/ctx/ca.pem", InboxPrefix: "_INBOX_waymark"}},
		{"creds flag replaces the context's nkey", Conn{Context: "prod", Creds: "/flag/u.creds"}, Settings{URL: "nats://ctx-host:4222",
			Creds: "/flag/u.creds", TLSCert: "/ctx/cert.pem", TLSKey: "/ctx/key.pem", TLSCA: "/ctx/ca.pem", InboxPrefix: "_INBOX_waymark"}},
		{"tls flags win one by one", Conn{Context: "prod", TLSCA: "/flag/ca.pem"}, Settings{URL: "nats://ctx-host:4222", NKey: "/seeds/engine.nk",
			TLSCert: "/ctx/cert.pem", TLSKey: "/ctx/key.pem", TLSCA: "/flag/ca.pem", InboxPrefix: "_INBOX_waymark"}},
		{"no context: defaults", Conn{}, Settings{URL: "nats://127.0.0.1:4222"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.conn.Resolve(nil)
			if err != nil {
				t.Fatal(err)
			}
			got.ContextFile = ""
			if got != tc.want {
				t.Fatalf("Resolve = %+v\nwant      %+v", got, tc.want)
			}
		})
	}
}

func TestContextErrorsNameTheContextAndFile(t *testing.T) {
	home := contextHome(t)
	dir := filepath.Join(home, "nats", "context")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name+".json"), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("broken", "{not json")
	write("domain", `{"url":"nats://x","jetstream_domain":"hub"}`)
	write("vault", `{"url":"nats://x","creds":"op://vault/item"}`)
	for _, tc := range []struct {
		name, context string
		want          []string
	}{
		{"unknown", "nope", []string{`--context "nope"`, "no such context", filepath.Join(dir, "nope.json")}},
		{"not json", "broken", []string{`--context "broken"`, filepath.Join(dir, "broken.json"), "not a nats context"}},
		{"unsupported field", "domain", []string{"jetstream_domain", "does not support"}},
		{"unsupported scheme", "vault", []string{"op://", "only files"}},
		{"bad name", "../etc/passwd", []string{"want a context name"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Conn{Context: tc.context}.Resolve(nil)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// userSeed writes a fresh user nkey seed file and returns its path and
// the public key.
func userSeed(t *testing.T, dir, name string) (string, string) {
	t.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	pub, _ := kp.PublicKey()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, pub
}

func TestBadFilesAreUsageErrorsNamingFlagAndFile(t *testing.T) {
	t.Setenv("NATS_CREDS", "")
	dir := t.TempDir()
	seed, _ := userSeed(t, dir, "user.nk")
	garbage := filepath.Join(dir, "garbage")
	if err := os.WriteFile(garbage, []byte("hello\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	acct, _ := nkeys.CreateAccount()
	accountSeedFile := filepath.Join(dir, "account.nk")
	aseed, _ := acct.Seed()
	if err := os.WriteFile(accountSeedFile, aseed, 0o600); err != nil {
		t.Fatal(err)
	}
	goodCreds := filepath.Join(dir, "user.creds")
	{
		ukp, _ := nkeys.CreateUser()
		upub, _ := ukp.PublicKey()
		claims := jwt.NewUserClaims(upub)
		tok, err := claims.Encode(acct)
		if err != nil {
			t.Fatal(err)
		}
		useed, _ := ukp.Seed()
		body, err := jwt.FormatUserConfig(tok, useed)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(goodCreds, body, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	certs := testsupport.NewCerts(t)
	missing := filepath.Join(dir, "missing.creds")
	for _, tc := range []struct {
		name string
		conn Conn
		want []string // "" conn is valid
	}{
		{"missing creds", Conn{Creds: missing}, []string{"--creds", missing, "no such file"}},
		{"creds without jwt", Conn{Creds: garbage}, []string{"--creds", garbage, "not a credentials file"}},
		{"good creds", Conn{Creds: goodCreds}, nil},
		{"missing nkey", Conn{NKey: missing}, []string{"--nkey", missing, "no such file"}},
		{"nkey garbage", Conn{NKey: garbage}, []string{"--nkey", garbage, "not an nkey seed"}},
		{"account seed as nkey", Conn{NKey: accountSeedFile}, []string{"--nkey", accountSeedFile, "not a user nkey seed"}},
		{"good nkey", Conn{NKey: seed}, nil},
		{"both", Conn{Creds: goodCreds, NKey: seed}, []string{"--creds", "--nkey", "drop one"}},
		{"cert without key", Conn{TLSCert: certs.ClientCert}, []string{"--tlscert", "without --tlskey"}},
		{"key without cert", Conn{TLSKey: certs.ClientKey}, []string{"--tlskey", "without --tlscert"}},
		{"cert with wrong key", Conn{TLSCert: certs.ClientCert, TLSKey: certs.OtherKey}, []string{"--tlscert", certs.ClientCert, certs.OtherKey}},
		{"ca garbage", Conn{TLSCA: garbage}, []string{"--tlsca", garbage, "no PEM certificates"}},
		{"good tls", Conn{TLSCert: certs.ClientCert, TLSKey: certs.ClientKey, TLSCA: certs.CA}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Connect(Conn{URL: "nats://127.0.0.1:1", Creds: tc.conn.Creds, NKey: tc.conn.NKey, TLSCert: tc.conn.TLSCert,
				TLSKey: tc.conn.TLSKey, TLSCA: tc.conn.TLSCA}, nil, "test")
			var ee *ExitError
			if tc.want == nil {
				// The settings pass; the dial fails (nothing listens on port 1).
				if err == nil || errors.As(err, &ee) {
					t.Fatalf("valid settings: %v, want a dial error", err)
				}
				return
			}
			if !errors.As(err, &ee) || ee.Code != 2 {
				t.Fatalf("%v, want a usage error (exit 2)", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
	t.Run("a seed given as creds is not echoed", func(t *testing.T) {
		_, err := Connect(Conn{URL: "nats://127.0.0.1:1", Creds: seed}, nil, "test")
		body, _ := os.ReadFile(seed)
		if err == nil || strings.Contains(err.Error(), strings.TrimSpace(string(body))) || strings.Contains(err.Error(), "SU") {
			t.Fatalf("%v: want an error that does not hold the seed", err)
		}
	})
	t.Run("from the environment", func(t *testing.T) {
		t.Setenv("NATS_CREDS", missing)
		var g Globals
		cmd := &cobra.Command{Use: "x", RunE: func(*cobra.Command, []string) error { return nil }}
		g.Bind(cmd)
		cmd.SetArgs(nil)
		_ = cmd.Execute()
		_, err := g.Connect("test")
		if err == nil || !strings.Contains(err.Error(), "(from NATS_CREDS)") {
			t.Fatalf("%v, want the error to say the value came from NATS_CREDS", err)
		}
	})
}

// startServer starts a plain nats-server (no JetStream) with opts on a
// loopback port.
func startServer(t *testing.T, opts *server.Options) *server.Server {
	t.Helper()
	opts.Host, opts.Port, opts.NoLog, opts.NoSigs = "127.0.0.1", -1, true, true
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	t.Cleanup(s.Shutdown)
	return s
}

func TestNKeyAuthenticates(t *testing.T) {
	dir := t.TempDir()
	seed, pub := userSeed(t, dir, "engine.nk")
	other, _ := userSeed(t, dir, "other.nk")
	s := startServer(t, &server.Options{Nkeys: []*server.NkeyUser{{Nkey: pub}}})
	nc, err := Connect(Conn{URL: s.ClientURL(), NKey: seed}, nil, "test")
	if err != nil {
		t.Fatalf("with the user's seed: %v", err)
	}
	nc.Close()
	if _, err := Connect(Conn{URL: s.ClientURL(), NKey: other}, nil, "test"); err == nil || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("with another seed: %v, want an authorization error", err)
	}
	// The same through a context.
	contextHome(t)
	saveContext(t, "engine", natscontext.WithServerURL(s.ClientURL()), natscontext.WithNKey(seed))
	nc, err = Connect(Conn{Context: "engine"}, nil, "test")
	if err != nil {
		t.Fatalf("through the context: %v", err)
	}
	nc.Close()
}

func TestTLSAndClientCertificates(t *testing.T) {
	certs := testsupport.NewCerts(t)
	tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: certs.ServerCert, KeyFile: certs.ServerKey, CaFile: certs.CA, Verify: true})
	if err != nil {
		t.Fatal(err)
	}
	s := startServer(t, &server.Options{TLS: true, TLSVerify: true, TLSConfig: tc, TLSTimeout: 2})
	url := strings.Replace(s.ClientURL(), "nats://", "tls://", 1)
	for _, row := range []struct {
		name   string
		conn   Conn
		wantOK bool
	}{
		{"ca and client certificate", Conn{URL: url, TLSCA: certs.CA, TLSCert: certs.ClientCert, TLSKey: certs.ClientKey}, true},
		{"no client certificate", Conn{URL: url, TLSCA: certs.CA}, false},
		{"client certificate of another CA", Conn{URL: url, TLSCA: certs.CA, TLSCert: certs.OtherCert, TLSKey: certs.OtherKey}, false},
		{"no CA: the server's certificate is not trusted", Conn{URL: url, TLSCert: certs.ClientCert, TLSKey: certs.ClientKey}, false},
	} {
		t.Run(row.name, func(t *testing.T) {
			nc, err := Connect(row.conn, nil, "test")
			if row.wantOK != (err == nil) {
				t.Fatalf("connect: %v, want ok=%v", err, row.wantOK)
			}
			if nc != nil {
				if !nc.IsConnected() {
					t.Fatal("not connected")
				}
				nc.Close()
			}
		})
	}
	contextHome(t)
	saveContext(t, "tls", natscontext.WithServerURL(url), natscontext.WithCA(certs.CA),
		natscontext.WithCertificate(certs.ClientCert), natscontext.WithKey(certs.ClientKey))
	nc, err := Connect(Conn{Context: "tls"}, nil, "test")
	if err != nil {
		t.Fatalf("through the context: %v", err)
	}
	nc.Close()
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"nats://127.0.0.1:4222":                         "nats://127.0.0.1:4222",
		"nats://engine:s3cret@host:4222":                "nats://redacted@host:4222",
		"nats://tok3n@host:4222, nats://a:b@other:4222": "nats://redacted@host:4222,nats://redacted@other:4222",
		"tls://u:p@h:1":                                 "tls://redacted@h:1",
		"nats://u:%zz@host":                             "(a URL that does not parse, not shown: it may hold credentials)",
		"":                                              "",
	} {
		if got := RedactURL(in); got != want {
			t.Errorf("RedactURL(%q) = %q, want %q", in, got, want)
		}
	}
}

type syncBuffer = testsupport.SyncBuffer

func TestWaitingLogsNoCredentials(t *testing.T) {
	t.Parallel()
	var buf syncBuffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := ConnectWaiting(ctx, Conn{URL: "nats://engine:hunter2-secret@127.0.0.1:1"}, nil, "test", log)
		done <- err
	}()
	testsupport.Eventually(t, 10*time.Second, func() bool { return strings.Count(buf.String(), "retrying") >= 2 }, "no retry logged: %s", &buf)
	cancel()
	err := <-done
	if err == nil {
		t.Fatal("connected to nothing")
	}
	for _, s := range []string{buf.String(), err.Error()} {
		if strings.Contains(s, "hunter2") {
			t.Fatalf("the password leaked: %s", s)
		}
	}
	if !strings.Contains(buf.String(), "redacted@127.0.0.1:1") {
		t.Fatalf("log does not name the (redacted) URL: %s", buf.String())
	}
}

// TestWaitingGivesUpOnAnAuthorizationError: a long-running process with
// the wrong seed stops with the server's answer instead of retrying for
// ever in silence.
func TestWaitingGivesUpOnAnAuthorizationError(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, pub := userSeed(t, dir, "engine.nk")
	other, _ := userSeed(t, dir, "other.nk")
	s := startServer(t, &server.Options{Nkeys: []*server.NkeyUser{{Nkey: pub}}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	_, err := ConnectWaiting(ctx, Conn{URL: s.ClientURL(), NKey: other}, nil, "test", slog.New(slog.DiscardHandler))
	if err == nil || ctx.Err() != nil || !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("after %v: %v, want an authorization error before the deadline", time.Since(start), err)
	}
}
