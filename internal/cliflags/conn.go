package cliflags

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/spf13/pflag"
)

// Conn holds the NATS connection flags, named as the nats CLI names them.
// Each field is a flag, its environment variable is the flag's default,
// and a value given either way wins over the same setting of the context
// (--context). Empty fields mean "not given".
type Conn struct {
	URL     string // --server, -s (alias --nats-url); env NATS_URL; comma-separated URLs of one cluster
	Creds   string // --creds FILE; env NATS_CREDS: a user JWT and its seed (nsc/nats CLI .creds file)
	NKey    string // --nkey FILE; env NATS_NKEY: a user nkey seed (SU...)
	TLSCert string // --tlscert FILE; env NATS_CERT: client certificate (PEM), with --tlskey
	TLSKey  string // --tlskey FILE; env NATS_KEY: the certificate's private key (PEM)
	TLSCA   string // --tlsca FILE; env NATS_CA: CA certificates (PEM) that sign the server's certificate
	Context string // --context NAME; env NATS_CONTEXT: a nats CLI context, read only when named
}

// BindConn binds c's flags on fs and returns fs.
func BindConn(fs *pflag.FlagSet, c *Conn) *pflag.FlagSet {
	fs.StringVarP(&c.URL, "nats-url", "s", os.Getenv("NATS_URL"), "NATS server URL(s), comma-separated (env NATS_URL); alias --server")
	fs.StringVar(&c.Creds, "creds", os.Getenv("NATS_CREDS"), "NATS user credentials file: JWT and seed (env NATS_CREDS)")
	fs.StringVar(&c.NKey, "nkey", os.Getenv("NATS_NKEY"), "NATS user nkey seed file (env NATS_NKEY)")
	fs.StringVar(&c.TLSCert, "tlscert", os.Getenv("NATS_CERT"), "TLS client certificate file, with --tlskey (env NATS_CERT)")
	fs.StringVar(&c.TLSKey, "tlskey", os.Getenv("NATS_KEY"), "TLS client private key file, with --tlscert (env NATS_KEY)")
	fs.StringVar(&c.TLSCA, "tlsca", os.Getenv("NATS_CA"), "CA certificates that sign the NATS server's certificate (env NATS_CA)")
	fs.StringVar(&c.Context, "context", os.Getenv("NATS_CONTEXT"), "nats CLI context to connect with (~/.config/nats/context/NAME.json); flags win over its settings (env NATS_CONTEXT)")
	return fs
}

// Remote reports whether c names a server (a URL or a context), rather
// than leaving the command to its default (the embedded server, or
// nats.DefaultURL).
func (c Conn) Remote() bool { return c.URL != "" || c.Context != "" }

// natsContext is the part of a nats CLI context file Waymark reads (the
// format of github.com/nats-io/jsm.go/natscontext). Fields it cannot honour
// are read too, so that a context using them is refused instead of half
// applied.
type natsContext struct {
	URL         string `json:"url"`
	User        string `json:"user"`
	Password    string `json:"password"`
	Token       string `json:"token"`
	Creds       string `json:"creds"`
	NKey        string `json:"nkey"`
	Cert        string `json:"cert"`
	Key         string `json:"key"`
	CA          string `json:"ca"`
	InboxPrefix string `json:"inbox_prefix"`
	TLSFirst    bool   `json:"tls_first"`

	UserJWT     string `json:"user_jwt"`
	UserSeed    string `json:"user_seed"`
	NSC         string `json:"nsc"`
	SocksProxy  string `json:"socks_proxy"`
	JSDomain    string `json:"jetstream_domain"`
	JSAPIPrefix string `json:"jetstream_api_prefix"`
	WinCerts    string `json:"windows_cert_store"`
}

var contextNameRE = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

// ContextDir is where the nats CLI keeps its contexts:
// $XDG_CONFIG_HOME/nats/context, or ~/.config/nats/context.
func ContextDir() (string, error) {
	root := os.Getenv("XDG_CONFIG_HOME")
	if root == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("find the nats CLI's contexts: %w", err)
		}
		root = filepath.Join(home, ".config")
	}
	return filepath.Join(root, "nats", "context"), nil
}

// loadContext reads the named context. Errors name the flag, the file
// and what is wrong.
func loadContext(name string, fs *pflag.FlagSet) (*natsContext, string, error) {
	what := FlagValue(fs, "context", "NATS_CONTEXT", name)
	if !contextNameRE.MatchString(name) || strings.Trim(name, ".") == "" {
		return nil, "", fmt.Errorf("%s: want a context name (letters, digits, '.', '-' and '_'), as `nats context ls` lists", what)
	}
	dir, err := ContextDir()
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", what, err)
	}
	path := filepath.Join(dir, name+".json")
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, path, fmt.Errorf("%s: no such context (%s does not exist; `nats context ls` lists the known ones)", what, path)
	}
	if err != nil {
		return nil, path, fmt.Errorf("%s: %w", what, err)
	}
	var c natsContext
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, path, fmt.Errorf("%s: %s: not a nats context: %v", what, path, err)
	}
	for field, v := range map[string]string{"user_jwt": c.UserJWT, "user_seed": c.UserSeed, "nsc": c.NSC,
		"socks_proxy": c.SocksProxy, "jetstream_domain": c.JSDomain, "jetstream_api_prefix": c.JSAPIPrefix,
		"windows_cert_store": c.WinCerts} {
		if v != "" {
			return nil, path, fmt.Errorf("%s: %s sets %q, which Waymark does not support; use creds, nkey, user/password or token, and cert/key/ca", what, path, field)
		}
	}
	for _, p := range []*string{&c.Creds, &c.NKey, &c.Cert, &c.Key, &c.CA} {
		if *p, err = contextPath(*p); err != nil {
			return nil, path, fmt.Errorf("%s: %s: %w", what, path, err)
		}
	}
	return &c, path, nil
}

// contextPath expands a path field as the nats CLI does: ~ and $VAR;
// file:// references are paths too, other schemes are refused.
func contextPath(p string) (string, error) {
	if p == "" {
		return "", nil
	}
	if rest, ok := strings.CutPrefix(p, "file://"); ok {
		p = rest
	} else if i := strings.Index(p, "://"); i > 0 {
		return "", fmt.Errorf("credential reference %q: only files are supported", p[:i+3]+"...")
	}
	p = os.ExpandEnv(p)
	if p == "~" || strings.HasPrefix(p, "~/") {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", err
		}
		p = filepath.Join(home, p[1:])
	}
	return p, nil
}

// Settings are the connection settings after the context and the flags
// are merged: what a connection is dialled with.
type Settings struct {
	URL         string // never "": nats.DefaultURL when nothing names one
	Creds       string
	NKey        string
	TLSCert     string
	TLSKey      string
	TLSCA       string
	User        string // from the context
	Password    string // from the context; never logged
	Token       string // from the context; never logged
	InboxPrefix string // from the context; "" means _INBOX
	TLSFirst    bool   // from the context
	ContextFile string // the context file read, or ""
}

// Resolve merges c with its context (when c.Context names one): each
// setting given as a flag or environment variable wins over the
// context's. An explicit --creds or --nkey replaces the context's
// authentication (user, password, token, creds, nkey) altogether. fs is
// where the flags were bound, for error messages (nil is allowed).
func (c Conn) Resolve(fs *pflag.FlagSet) (Settings, error) {
	s := Settings{URL: c.URL, Creds: c.Creds, NKey: c.NKey, TLSCert: c.TLSCert, TLSKey: c.TLSKey, TLSCA: c.TLSCA}
	if c.Context != "" {
		ctx, path, err := loadContext(c.Context, fs)
		if err != nil {
			return s, err
		}
		s.ContextFile = path
		or := func(flag *string, ctxValue string) {
			if *flag == "" {
				*flag = ctxValue
			}
		}
		or(&s.URL, ctx.URL)
		if s.Creds == "" && s.NKey == "" {
			s.Creds, s.NKey = ctx.Creds, ctx.NKey
			s.User, s.Password, s.Token = ctx.User, ctx.Password, ctx.Token
		}
		or(&s.TLSCert, ctx.Cert)
		or(&s.TLSKey, ctx.Key)
		or(&s.TLSCA, ctx.CA)
		s.InboxPrefix, s.TLSFirst = ctx.InboxPrefix, ctx.TLSFirst
	}
	if s.URL == "" {
		s.URL = nats.DefaultURL
	}
	return s, nil
}

// source names where a setting came from, for error messages: the flag
// (with its variable when the value came from there), or the context file.
func (s Settings) source(fs *pflag.FlagSet, flag, env, flagValue, value string) string {
	if flagValue != "" {
		return FlagValue(fs, flag, env, value)
	}
	return fmt.Sprintf("%s %q (from context file %s)", contextField[flag], value, s.ContextFile)
}

var contextField = map[string]string{"creds": "creds", "nkey": "nkey", "tlscert": "cert", "tlskey": "key", "tlsca": "ca"}

// Options checks the merged settings and turns them into nats.go options.
// Files are read now, so that a missing or malformed one is an error at
// once naming the flag (or context field) and the file: a credentials
// file without a user JWT and seed, a seed that is not a user nkey seed,
// a certificate without its key, a CA file without certificates. The
// connection reads the files again on every (re)connect, so rotated
// credentials and certificates take effect without a restart. No error
// holds a secret.
func (s Settings) Options(c Conn, fs *pflag.FlagSet) ([]nats.Option, error) {
	var opts []nats.Option
	if s.Creds != "" && s.NKey != "" {
		return nil, fmt.Errorf("%s and %s both given: a connection authenticates with one; drop one",
			s.source(fs, "creds", "NATS_CREDS", c.Creds, s.Creds), s.source(fs, "nkey", "NATS_NKEY", c.NKey, s.NKey))
	}
	if s.Creds != "" {
		what := s.source(fs, "creds", "NATS_CREDS", c.Creds, s.Creds)
		data, err := os.ReadFile(s.Creds)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, unwrapPath(err))
		}
		tok, err := jwt.ParseDecoratedJWT(data)
		if err == nil {
			_, err = jwt.DecodeUserClaims(tok)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: not a credentials file (want a user JWT and its seed, as `nsc generate creds` writes): %v", what, err)
		}
		kp, err := jwt.ParseDecoratedUserNKey(data)
		if err != nil {
			return nil, fmt.Errorf("%s: no usable user seed in the credentials file: %v", what, err)
		}
		kp.Wipe()
		opts = append(opts, nats.UserCredentials(s.Creds))
	}
	if s.NKey != "" {
		what := s.source(fs, "nkey", "NATS_NKEY", c.NKey, s.NKey)
		data, err := os.ReadFile(s.NKey)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, unwrapPath(err))
		}
		kp, err := nkeys.ParseDecoratedNKey(data)
		clear(data)
		if err != nil {
			return nil, fmt.Errorf("%s: not an nkey seed file (want a user seed starting SU, as `nk -gen user` writes): %v", what, err)
		}
		pub, err := kp.PublicKey()
		kp.Wipe()
		if err != nil || !nkeys.IsValidPublicUserKey(pub) {
			return nil, fmt.Errorf("%s: the seed is not a user nkey seed (want one starting SU)", what)
		}
		opt, err := nats.NkeyOptionFromSeed(s.NKey)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", what, err)
		}
		opts = append(opts, opt)
	}
	switch {
	case s.User != "":
		opts = append(opts, nats.UserInfo(s.User, s.Password))
	case s.Token != "":
		opts = append(opts, nats.Token(s.Token))
	}
	certWhat := s.source(fs, "tlscert", "NATS_CERT", c.TLSCert, s.TLSCert)
	keyWhat := s.source(fs, "tlskey", "NATS_KEY", c.TLSKey, s.TLSKey)
	switch {
	case s.TLSCert != "" && s.TLSKey == "":
		return nil, fmt.Errorf("%s given without --tlskey: a client certificate needs its private key", certWhat)
	case s.TLSKey != "" && s.TLSCert == "":
		return nil, fmt.Errorf("%s given without --tlscert: a private key needs its client certificate", keyWhat)
	case s.TLSCert != "":
		if _, err := tls.LoadX509KeyPair(s.TLSCert, s.TLSKey); err != nil {
			return nil, fmt.Errorf("%s, %s: %v", certWhat, keyWhat, unwrapPath(err))
		}
		opts = append(opts, nats.ClientCert(s.TLSCert, s.TLSKey))
	}
	if s.TLSCA != "" {
		what := s.source(fs, "tlsca", "NATS_CA", c.TLSCA, s.TLSCA)
		data, err := os.ReadFile(s.TLSCA)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, unwrapPath(err))
		}
		if !x509.NewCertPool().AppendCertsFromPEM(data) {
			return nil, fmt.Errorf("%s: no PEM certificates in the file", what)
		}
		opts = append(opts, nats.RootCAs(s.TLSCA))
	}
	if s.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(s.InboxPrefix))
	}
	if s.TLSFirst {
		opts = append(opts, nats.TLSHandshakeFirst())
	}
	return opts, nil
}

// unwrapPath drops the *PathError's own "open FILE:" when the message
// names the file already.
func unwrapPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// RedactURL returns urls (comma-separated) with any user information
// replaced: nats://engine:secret@host:4222 becomes
// nats://redacted@host:4222, and a token in the user part goes the same
// way. What does not parse is replaced whole, since it may hold a secret.
func RedactURL(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		p = strings.TrimSpace(p)
		if !strings.Contains(p, "@") {
			parts[i] = p
			continue
		}
		u, err := url.Parse(p)
		if err != nil || u.User == nil {
			parts[i] = "(a URL that does not parse, not shown: it may hold credentials)"
			continue
		}
		u.User = url.User("redacted")
		parts[i] = u.String()
	}
	return strings.Join(parts, ",")
}
