// Package cliflags holds what every Waymark command shares and a worker
// needs without the engine: the NATS connection flags (named as the nats
// CLI names them), logging flags, the WAYMARK_* layout environment, the
// step flags of in-process and separate workers, and usage exit codes.
// It imports neither the engine nor nats-server, so that a custom worker
// built with workercmd links neither (see internal/linkcheck).
//
// Connecting comes in two kinds. A one-shot command (status, list,
// start) connects with Connect and fails at once with a message saying
// what to check. A long-running one (a worker, engine serve --nats-url,
// engine run --nats-url) connects with ConnectWaiting: it retries with
// backoff until the server answers, logging each retry with the URL and
// the next delay, and keeps reconnecting the same way if the server goes
// away later.
package cliflags

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// ExitError carries a process exit code out of a command: 2 for usage
// errors (bad flags or settings), anything else as given.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// EnvOr returns the environment variable key, or def when it is empty.
func EnvOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// FlagValue names a flag and its value for an error message, and the
// environment variable when the value came from it (the flag was not
// given): --sync "disk" (from WAYMARK_SYNC). fs may be nil when the flag
// set is unknown; then a value equal to the variable's is taken as its.
func FlagValue(fs *pflag.FlagSet, flag, env, value string) string {
	s := fmt.Sprintf("--%s %q", flag, value)
	fromEnv := os.Getenv(env) != "" && os.Getenv(env) == value
	if fs != nil {
		if f := fs.Lookup(flag); f != nil && f.Changed {
			fromEnv = false
		}
	}
	if fromEnv {
		s += " (from " + env + ")"
	}
	return s
}

// Globals are the flags every command shares, bound as persistent flags.
type Globals struct {
	Conn      Conn   // the NATS connection flags (--server, --creds, --nkey, --tlscert, --tlskey, --tlsca, --context)
	Prefix    string // --prefix; env WAYMARK_PREFIX; default kv.DefaultPrefix
	LogLevel  string // --log-level; env WAYMARK_LOG_LEVEL; default warn
	LogFormat string // --log-format; env WAYMARK_LOG_FORMAT; default text
	Stdout    io.Writer
	Stderr    io.Writer
	Flags     *pflag.FlagSet // where the flags were bound, to tell flag from environment
}

// Bind binds g's flags on cmd as persistent flags.
func (g *Globals) Bind(cmd *cobra.Command) {
	g.Flags = BindGlobals(cmd, &g.Conn, &g.Prefix, &g.LogLevel, &g.LogFormat)
}

// BindGlobals binds the shared flags to the given variables on cmd's
// persistent flags and returns that flag set: the connection flags (see
// BindConn), --prefix, --log-level and --log-format.
func BindGlobals(cmd *cobra.Command, conn *Conn, prefix, logLevel, logFormat *string) *pflag.FlagSet {
	f := BindConn(cmd.PersistentFlags(), conn)
	f.StringVar(prefix, "prefix", EnvOr("WAYMARK_PREFIX", kv.DefaultPrefix), "prefix of every stream, bucket and subject (env WAYMARK_PREFIX)")
	f.StringVar(logLevel, "log-level", EnvOr("WAYMARK_LOG_LEVEL", "warn"), "log level: debug, info, warn, error (env WAYMARK_LOG_LEVEL)")
	f.StringVar(logFormat, "log-format", EnvOr("WAYMARK_LOG_FORMAT", "text"), "log format: text or json (env WAYMARK_LOG_FORMAT)")
	// A global normalisation reaches the flag sets cobra merges the
	// persistent flags into, and subcommands added later; a NormalizeFunc
	// on f alone left --server refused as an unknown flag.
	cmd.SetGlobalNormalizationFunc(func(_ *pflag.FlagSet, name string) pflag.NormalizedName {
		if name == "server" {
			name = "nats-url"
		}
		return pflag.NormalizedName(name)
	})
	return f
}

// Logger builds the slog logger the flags ask for, writing to w. Errors
// name the flag (and the variable it came from).
func Logger(level, format string, w io.Writer, fs *pflag.FlagSet) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("%s: want debug, info, warn or error", FlagValue(fs, "log-level", "WAYMARK_LOG_LEVEL", level))
	}
	opts := &slog.HandlerOptions{Level: lvl}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("%s: want text or json", FlagValue(fs, "log-format", "WAYMARK_LOG_FORMAT", format))
}

// Logger builds the logger g's flags ask for, writing to g.Stderr.
func (g *Globals) Logger() (*slog.Logger, error) {
	return Logger(g.LogLevel, g.LogFormat, g.Stderr, g.Flags)
}

// URL returns the server URL to dial: url, or nats.DefaultURL when empty.
func URL(url string) string {
	if url == "" {
		return nats.DefaultURL
	}
	return url
}

// dial merges c with its context and checks its files (Conn.Resolve,
// Settings.Options); errors are usage errors (ExitError, exit status 2).
func dial(c Conn, fs *pflag.FlagSet, name string) (Settings, []nats.Option, error) {
	s, err := c.Resolve(fs)
	if err != nil {
		return s, nil, &ExitError{Code: 2, Err: err}
	}
	opts, err := s.Options(c, fs)
	if err != nil {
		return s, nil, &ExitError{Code: 2, Err: err}
	}
	return s, append([]nats.Option{nats.Name(name), nats.MaxReconnects(-1)}, opts...), nil
}

// Connect dials c's server once, for a one-shot command: an unreachable
// server is an error at once, saying what to check. Once connected, a
// lost connection is retried every 250ms. A bad flag or file (a missing
// credentials file, a malformed seed) is an *ExitError with code 2 naming
// the flag and the file. fs is where c was bound (nil is allowed). URLs
// in errors have their credentials redacted.
func Connect(c Conn, fs *pflag.FlagSet, name string) (*nats.Conn, error) {
	s, opts, err := dial(c, fs, name)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(s.URL, append(opts, nats.ReconnectWait(250*time.Millisecond))...)
	if errors.Is(err, nats.ErrNoServers) {
		return nil, fmt.Errorf("connect to NATS at %s: %w (is an engine running? start `engine serve --data-dir DIR` on the data directory your jobs use (default .waymark), or point --nats-url (--server), NATS_URL or --context at your NATS server)", RedactURL(s.URL), err)
	}
	if err != nil {
		// The server answered: refused credentials, a TLS mismatch.
		return nil, fmt.Errorf("connect to NATS at %s: %w (the server answered: check --creds, --nkey, --tlscert, --tlskey, --tlsca or the --context)", RedactURL(s.URL), err)
	}
	return nc, nil
}

// Reconnect backoff of ConnectWaiting: the delay before retry n (from 1)
// is ReconnectBase·2^(n-1), at most ReconnectMax, less up to a fifth at
// random so that many workers do not retry in step.
const (
	ReconnectBase = 250 * time.Millisecond
	ReconnectMax  = 5 * time.Second
)

// ReconnectDelay is the delay before retry attempt (1 for the first).
func ReconnectDelay(attempt int) time.Duration {
	d := ReconnectMax
	if attempt >= 1 && attempt < 16 {
		d = min(ReconnectBase<<(attempt-1), ReconnectMax)
	}
	return d - time.Duration(rand.Int64N(int64(d)/5+1))
}

// ConnectWaiting dials c's server (see Connect for the settings and
// their errors) for a long-running process and blocks until connected. While the server is unreachable,
// at start or later, it retries with ReconnectDelay's backoff, logging
// each retry at warn with the URL, the attempt, the next delay and the
// last error (nats.go's RetryOnFailedConnect and CustomReconnectDelay).
// It returns ctx's error if ctx ends first, and the connection's error if
// the server refuses it for good (an authorisation error, say). Logged
// URLs have their credentials redacted.
func ConnectWaiting(ctx context.Context, c Conn, fs *pflag.FlagSet, name string, log *slog.Logger) (*nats.Conn, error) {
	s, base, err := dial(c, fs, name)
	if err != nil {
		return nil, err
	}
	url := RedactURL(s.URL) // for messages; s.URL is dialled
	if log == nil {
		log = slog.Default()
	}
	connected := make(chan struct{})
	closed := make(chan struct{})
	var lastErr error // set by nats.go's callbacks, which run one at a time
	errs := make(chan error, 1)
	note := func(err error) {
		select {
		case <-errs:
		default:
		}
		errs <- err
	}
	opts := append(base,
		nats.RetryOnFailedConnect(true),
		nats.CustomReconnectDelay(func(attempt int) time.Duration {
			d := ReconnectDelay(attempt)
			select {
			case lastErr = <-errs:
			default:
			}
			args := []any{"url", url, "attempt", attempt, "retry_in", d.Round(time.Millisecond)}
			if lastErr != nil {
				args = append(args, "err", lastErr)
			}
			log.Warn("NATS server not reachable; retrying", args...)
			return d
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) { note(err) }),
		nats.ConnectHandler(func(*nats.Conn) { close(connected) }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("lost the NATS connection; reconnecting", "url", url, "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("reconnected to NATS", "url", nc.ConnectedUrlRedacted()) }),
		nats.ClosedHandler(func(*nats.Conn) { close(closed) }),
	)
	nc, err := nats.Connect(s.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", url, err)
	}
	if nc.IsConnected() {
		return nc, nil
	}
	args := []any{"url", url}
	if err := nc.LastError(); err != nil {
		args = append(args, "err", err)
	}
	log.Warn("NATS server not reachable; waiting for it, retrying with backoff", args...)
	select {
	case <-connected:
		log.Info("connected to NATS", "url", nc.ConnectedUrlRedacted())
		return nc, nil
	case <-closed:
		err := nc.LastError()
		if err == nil {
			err = nats.ErrConnectionClosed
		}
		return nil, fmt.Errorf("connect to NATS at %s: %w", url, err)
	case <-ctx.Done():
		nc.Close()
		return nil, fmt.Errorf("connect to NATS at %s: %w", url, ctx.Err())
	}
}

// Connect dials g's server once (see Connect).
func (g *Globals) Connect(name string) (*nats.Conn, error) { return Connect(g.Conn, g.Flags, name) }

// ConnectWaiting dials g's server and waits for it (see ConnectWaiting).
func (g *Globals) ConnectWaiting(ctx context.Context, name string, log *slog.Logger) (*nats.Conn, error) {
	return ConnectWaiting(ctx, g.Conn, g.Flags, name, log)
}

// kvEnv lists the environment variables that tune the JetStream layout.
// Every process of a deployment must see the same values.
var kvEnv = []struct {
	name string
	set  func(*kv.Config, string) error
}{
	{"WAYMARK_DUPLICATES", func(c *kv.Config, v string) (err error) { c.Duplicates, err = time.ParseDuration(v); return }},
	{"WAYMARK_INBOX_ACK_WAIT", func(c *kv.Config, v string) (err error) { c.InboxAckWait, err = time.ParseDuration(v); return }},
	{"WAYMARK_WORK_ACK_WAIT", func(c *kv.Config, v string) (err error) { c.WorkAckWait, err = time.ParseDuration(v); return }},
	{"WAYMARK_WORK_MAX_DELIVER", func(c *kv.Config, v string) (err error) { c.WorkMaxDeliver, err = strconv.Atoi(v); return }},
	{"WAYMARK_REPLICAS", func(c *kv.Config, v string) (err error) { c.Replicas, err = strconv.Atoi(v); return }},
	{"WAYMARK_HISTORY_MAX_AGE", func(c *kv.Config, v string) (err error) { c.HistoryMaxAge, err = time.ParseDuration(v); return }},
	{"WAYMARK_QUEUE_STORAGE", func(c *kv.Config, v string) error { c.QueueStorage = v; return nil }},
	{"WAYMARK_GROUP_COMMIT", func(c *kv.Config, v string) error {
		switch v {
		case "on", "off":
			c.GroupCommit = v == "on"
			return nil
		}
		return fmt.Errorf("want on or off (default: on for an embedded server under --sync always, else off)")
	}},
	{"WAYMARK_JOB_RETENTION", func(c *kv.Config, v string) (err error) {
		if c.JobRetention, err = time.ParseDuration(v); err == nil && c.JobRetention == 0 {
			c.JobRetention = -1 // 0 keeps finished jobs forever
		} else if err == nil && c.JobRetention < 0 {
			err = fmt.Errorf("want a positive duration, or 0 to keep finished jobs forever")
		}
		return
	}},
	{"WAYMARK_VALUE_THRESHOLD", func(c *kv.Config, v string) error {
		n, err := humanize.ParseBytes(v)
		if err != nil || n == 0 || n > math.MaxInt32 {
			return fmt.Errorf("want a size in bytes such as 65536 or 64KiB")
		}
		c.ValueThreshold = int(n)
		return nil
	}},
	{"WAYMARK_MAX_JOB_STATE", func(c *kv.Config, v string) error {
		n, err := humanize.ParseBytes(v)
		if err != nil || n == 0 || n > math.MaxInt64 {
			return fmt.Errorf("want a size in bytes such as 67108864 or 64MiB")
		}
		c.MaxJobStateBytes = int64(n)
		return nil
	}},
	{"WAYMARK_EVENT_RETENTION", func(c *kv.Config, v string) (err error) {
		if c.EventRetention, err = time.ParseDuration(v); err == nil && c.EventRetention < time.Second {
			err = fmt.Errorf("want a duration of at least 1s, such as 168h")
		}
		return
	}},
	{"WAYMARK_EFFECT_RETENTION", func(c *kv.Config, v string) error {
		return fmt.Errorf("renamed: effect records are now removed with their job; set WAYMARK_JOB_RETENTION")
	}},
}

// KVConfigFromEnv applies the WAYMARK_* layout variables to cfg. A value
// that does not parse, or that the layout refuses (kv.Config.Validate),
// is an error naming the variable and the value.
func KVConfigFromEnv(cfg kv.Config) (kv.Config, error) {
	for _, e := range kvEnv {
		v := os.Getenv(e.name)
		if v == "" {
			continue
		}
		if err := e.set(&cfg, v); err != nil {
			return cfg, fmt.Errorf("%s=%q: %w", e.name, v, err)
		}
		// Validate checks each field on its own: the variable alone, over
		// the defaults, tells whether its value is acceptable.
		var alone kv.Config
		_ = e.set(&alone, v)
		if err := alone.WithDefaults().Validate(); err != nil {
			return cfg, fmt.Errorf("%s=%q: %w", e.name, v, err)
		}
	}
	return cfg, nil
}

// KVConfig completes cfg with the WAYMARK_* layout variables and the
// prefix and checks it, before anything reaches the server. Errors are
// usage errors (ExitError, exit status 2) naming the variable or flag at
// fault; fs is where --prefix was bound.
func KVConfig(cfg kv.Config, prefix string, fs *pflag.FlagSet) (kv.Config, error) {
	cfg, err := KVConfigFromEnv(cfg)
	if err != nil {
		return cfg, &ExitError{Code: 2, Err: err}
	}
	cfg.Prefix = prefix
	if err := (kv.Config{Prefix: prefix}).WithDefaults().Validate(); err != nil {
		return cfg, &ExitError{Code: 2, Err: fmt.Errorf("%s: %w", FlagValue(fs, "prefix", "WAYMARK_PREFIX", prefix), err)}
	}
	if err := cfg.WithDefaults().Validate(); err != nil {
		return cfg, &ExitError{Code: 2, Err: err}
	}
	return cfg, nil
}

// OpenStore opens the Waymark layout over nc with cfg completed by
// KVConfig, giving up after 30s.
func OpenStore(ctx context.Context, nc *nats.Conn, cfg kv.Config, prefix string, fs *pflag.FlagSet, log *slog.Logger) (*kv.Store, error) {
	return openStore(ctx, nc, cfg, prefix, fs, log, 30*time.Second)
}

func openStore(ctx context.Context, nc *nats.Conn, cfg kv.Config, prefix string, fs *pflag.FlagSet, log *slog.Logger, timeout time.Duration) (*kv.Store, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	if cfg, err = KVConfig(cfg, prefix, fs); err != nil {
		return nil, err
	}
	octx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st, err := kv.Open(octx, js, cfg, log)
	if err != nil {
		if errors.Is(err, jetstream.ErrJetStreamNotEnabled) || errors.Is(err, context.DeadlineExceeded) {
			return nil, fmt.Errorf("open Waymark streams and buckets: %w (does the server have JetStream enabled?)", err)
		}
		return nil, fmt.Errorf("open Waymark streams and buckets: %w", err)
	}
	return st, nil
}

// OpenAttemptTimeout bounds one attempt of OpenStoreWaiting.
const OpenAttemptTimeout = 10 * time.Second

// OpenStoreWaiting opens the layout as OpenStore does, for a long-running
// process that creates none of it (a worker): while the streams and
// buckets cannot be opened in time (absent, and the process's NATS user
// may not create them; the server's permission refusals go unanswered),
// it logs at warn and tries again with ReconnectDelay's backoff until ctx
// ends, so a worker started before any engine waits for one. Other
// errors (settings Waymark cannot work with, no JetStream) return at once.
func OpenStoreWaiting(ctx context.Context, nc *nats.Conn, cfg kv.Config, prefix string, fs *pflag.FlagSet, log *slog.Logger) (*kv.Store, error) {
	for attempt := 1; ; attempt++ {
		st, err := openStore(ctx, nc, cfg, prefix, fs, log, OpenAttemptTimeout)
		if err == nil || ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
			return st, err
		}
		d := ReconnectDelay(attempt)
		log.Warn("cannot open the Waymark streams and buckets yet; retrying (is an engine running? it creates them; a worker may lack the permission to)",
			"attempt", attempt, "retry_in", d.Round(time.Millisecond), "err", err)
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("open Waymark streams and buckets: %w", ctx.Err())
		case <-time.After(d):
		}
	}
}

// OpenStore opens the layout with g's prefix (see OpenStore).
func (g *Globals) OpenStore(ctx context.Context, nc *nats.Conn, cfg kv.Config, log *slog.Logger) (*kv.Store, error) {
	return OpenStore(ctx, nc, cfg, g.Prefix, g.Flags, log)
}

// StepFlags configure a worker's step kinds: services for templates, the
// model source, and where secrets come from.
type StepFlags struct {
	Services   []string // --service name=URL, repeatable
	ModelMode  string   // --model-mode; env WAYMARK_MODEL_MODE; default steps.ModelAuto
	SecretsDir string   // --secrets-dir; env WAYMARK_SECRETS_DIR; default $CREDENTIALS_DIRECTORY
	SecretEnv  []string // --secret-env NAME, repeatable; env WAYMARK_SECRETS_ENV, comma-separated
	MCPServers []string // --mcp-server NAME='command args', repeatable
	Prices     string   // --prices FILE; env WAYMARK_PRICES
	AllowKinds []string // kinds a definition may use beyond the built-ins (set by commands that load definitions)
	Flags      *pflag.FlagSet
}

// Bind binds the step flags on cmd: --service, --model-mode,
// --secrets-dir and --secret-env.
func (s *StepFlags) Bind(cmd *cobra.Command) {
	f := cmd.Flags()
	s.Flags = f
	f.StringArrayVar(&s.Services, "service", nil, "name=URL of a service that step templates reach as {{service \"name\"}} (repeatable)")
	f.StringVar(&s.Prices, "prices", os.Getenv("WAYMARK_PRICES"), "YAML or JSON file of model prices per million tokens ({MODEL: {input, output, cache_read, cache_write}}) for agent steps whose definition has none (env WAYMARK_PRICES)")
	f.StringArrayVar(&s.MCPServers, "mcp-server", nil, "NAME='command args' of an MCP server over stdio that mcp steps and tools reach as with.server NAME (repeatable)")
	f.StringVar(&s.ModelMode, "model-mode", EnvOr("WAYMARK_MODEL_MODE", steps.ModelAuto), "model steps: auto (live when the API key is set, else the cassette), live or replay (env WAYMARK_MODEL_MODE)")
	f.StringVar(&s.SecretsDir, "secrets-dir", EnvOr("WAYMARK_SECRETS_DIR", os.Getenv("CREDENTIALS_DIRECTORY")),
		"directory of secret files for {{secret \"NAME\"}}, one file per secret (env WAYMARK_SECRETS_DIR; default systemd's $CREDENTIALS_DIRECTORY)")
	var fromEnv []string
	for _, n := range strings.Split(os.Getenv("WAYMARK_SECRETS_ENV"), ",") {
		if n = strings.TrimSpace(n); n != "" {
			fromEnv = append(fromEnv, n)
		}
	}
	f.StringArrayVar(&s.SecretEnv, "secret-env", fromEnv, "expose the environment variable NAME to workflows as the secret NAME, besides WAYMARK_SECRET_* (repeatable; env WAYMARK_SECRETS_ENV, comma-separated)")
}

var envNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// Env checks the step flags and returns the workers' environment. Errors
// name the flag (or variable) at fault.
func (s *StepFlags) Env() (*steps.Env, error) {
	switch s.ModelMode {
	case steps.ModelAuto, steps.ModelLive, steps.ModelReplay:
	default:
		return nil, fmt.Errorf("%s: want auto, live or replay", FlagValue(s.Flags, "model-mode", "WAYMARK_MODEL_MODE", s.ModelMode))
	}
	svc, err := steps.ParseServices(s.Services)
	if err != nil {
		return nil, err
	}
	if s.SecretsDir != "" {
		var problem error
		fi, err := os.Stat(s.SecretsDir)
		switch {
		case err != nil:
			problem = errors.Unwrap(err) // the path is in the message already
		case !fi.IsDir():
			problem = errors.New("not a directory")
		}
		if problem != nil {
			what := FlagValue(s.Flags, "secrets-dir", "WAYMARK_SECRETS_DIR", s.SecretsDir)
			if os.Getenv("WAYMARK_SECRETS_DIR") == "" && s.SecretsDir == os.Getenv("CREDENTIALS_DIRECTORY") && (s.Flags == nil || !s.Flags.Changed("secrets-dir")) {
				what += " (from CREDENTIALS_DIRECTORY)"
			}
			return nil, fmt.Errorf("%s: %w", what, problem)
		}
	}
	for _, n := range s.SecretEnv {
		if !envNameRE.MatchString(n) || steps.CheckSecretName(n) != nil {
			return nil, fmt.Errorf("--secret-env %q: want an environment variable name (letters, digits and '_', not starting with a digit)", n)
		}
	}
	mcp, err := steps.ParseMCPServers(s.MCPServers)
	if err != nil {
		return nil, err
	}
	var prices map[string]schemas.Price
	if s.Prices != "" {
		if prices, err = steps.LoadPrices(s.Prices); err != nil {
			return nil, fmt.Errorf("%s: %w", FlagValue(s.Flags, "prices", "WAYMARK_PRICES", s.Prices), err)
		}
	}
	return &steps.Env{Services: svc, ModelMode: s.ModelMode, Secrets: steps.Secrets{Dir: s.SecretsDir, Env: s.SecretEnv}, MCPServers: mcp, Prices: prices}, nil
}

// NoArgs refuses positional arguments with exit status 2 (usage).
func NoArgs(cmd *cobra.Command, args []string) error {
	if err := cobra.NoArgs(cmd, args); err != nil {
		return &ExitError{Code: 2, Err: fmt.Errorf("%w (usage: %s)", err, cmd.UseLine())}
	}
	return nil
}
