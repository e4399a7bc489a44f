package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// ExitError carries a process exit code out of a command.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// globals are the flags every command shares.
type globals struct {
	natsURL   string
	creds     string
	prefix    string
	logLevel  string
	logFormat string
	stdout    io.Writer
	stderr    io.Writer
	flags     *pflag.FlagSet // where the flags above were bound, to tell flag from environment
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func (g *globals) bind(cmd *cobra.Command) {
	f := cmd.PersistentFlags()
	g.flags = f
	f.StringVarP(&g.natsURL, "nats-url", "s", os.Getenv("NATS_URL"), "NATS server URL (env NATS_URL); alias --server")
	f.StringVar(&g.creds, "creds", os.Getenv("NATS_CREDS"), "NATS credentials file (env NATS_CREDS)")
	f.StringVar(&g.prefix, "prefix", envOr("WAYMARK_PREFIX", kv.DefaultPrefix), "prefix of every stream, bucket and subject (env WAYMARK_PREFIX)")
	f.StringVar(&g.logLevel, "log-level", envOr("WAYMARK_LOG_LEVEL", "warn"), "log level: debug, info, warn, error (env WAYMARK_LOG_LEVEL)")
	f.StringVar(&g.logFormat, "log-format", envOr("WAYMARK_LOG_FORMAT", "text"), "log format: text or json (env WAYMARK_LOG_FORMAT)")
	f.SetNormalizeFunc(func(_ *pflag.FlagSet, name string) pflag.NormalizedName {
		if name == "server" {
			name = "nats-url"
		}
		return pflag.NormalizedName(name)
	})
}

func (g *globals) logger() (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(g.logLevel)); err != nil {
		return nil, fmt.Errorf("%s: want debug, info, warn or error", flagValue(g.flags, "log-level", "WAYMARK_LOG_LEVEL", g.logLevel))
	}
	opts := &slog.HandlerOptions{Level: lvl}
	switch g.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(g.stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(g.stderr, opts)), nil
	}
	return nil, fmt.Errorf("%s: want text or json", flagValue(g.flags, "log-format", "WAYMARK_LOG_FORMAT", g.logFormat))
}

// flagValue names a flag and its value for an error message, and the
// environment variable when the value came from it (the flag was not
// given): --sync "disk" (from WAYMARK_SYNC). fs may be nil when the flag
// set is unknown; then a value equal to the variable's is taken as its.
func flagValue(fs *pflag.FlagSet, flag, env, value string) string {
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

// connect dials the NATS server named by --nats-url.
func (g *globals) connect(name string) (*nats.Conn, error) {
	url := g.natsURL
	if url == "" {
		url = nats.DefaultURL
	}
	opts := []nats.Option{nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond)}
	if g.creds != "" {
		opts = append(opts, nats.UserCredentials(g.creds))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w (is an engine running? start `engine serve --data-dir DIR` on the data directory your jobs use (default .waymark), or point --nats-url / NATS_URL at your NATS server)", url, err)
	}
	return nc, nil
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
	{"WAYMARK_EFFECT_RETENTION", func(c *kv.Config, v string) (err error) { c.EffectRetention, err = time.ParseDuration(v); return }},
}

// kvConfigFromEnv applies the WAYMARK_* layout variables to cfg. A value
// that does not parse, or that the layout refuses (kv.Config.Validate),
// is an error naming the variable and the value.
func kvConfigFromEnv(cfg kv.Config) (kv.Config, error) {
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

// kvConfig completes cfg with the WAYMARK_* layout variables and --prefix
// and checks it, before anything reaches the server. Errors are usage
// errors (exit status 2) naming the variable or flag at fault.
func (g *globals) kvConfig(cfg kv.Config) (kv.Config, error) {
	cfg, err := kvConfigFromEnv(cfg)
	if err != nil {
		return cfg, &ExitError{Code: 2, Err: err}
	}
	cfg.Prefix = g.prefix
	if err := (kv.Config{Prefix: g.prefix}).WithDefaults().Validate(); err != nil {
		return cfg, &ExitError{Code: 2, Err: fmt.Errorf("%s: %w", flagValue(g.flags, "prefix", "WAYMARK_PREFIX", g.prefix), err)}
	}
	if err := cfg.WithDefaults().Validate(); err != nil {
		return cfg, &ExitError{Code: 2, Err: err}
	}
	return cfg, nil
}

// openStore opens the Waymark layout over nc.
func (g *globals) openStore(ctx context.Context, nc *nats.Conn, cfg kv.Config, log *slog.Logger) (*kv.Store, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	if cfg, err = g.kvConfig(cfg); err != nil {
		return nil, err
	}
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
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

// embeddedFlags configure the embedded nats-server.
type embeddedFlags struct {
	dataDir      string
	sync         string
	syncInterval time.Duration
	flags        *pflag.FlagSet
}

func (e *embeddedFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	e.flags = f
	f.StringVar(&e.dataDir, "data-dir", envOr("WAYMARK_DATA_DIR", ".waymark"), "embedded server's data directory (env WAYMARK_DATA_DIR)")
	f.StringVar(&e.sync, "sync", envOr("WAYMARK_SYNC", natsserver.SyncAlways), "embedded JetStream sync policy: always (fsync before every acknowledgement) or interval (env WAYMARK_SYNC)")
	f.DurationVar(&e.syncInterval, "sync-interval", time.Second, "fsync period under --sync interval")
}

// validate checks the flags before anything starts.
func (e *embeddedFlags) validate() error {
	if e.sync != natsserver.SyncAlways && e.sync != natsserver.SyncInterval {
		return fmt.Errorf("%s: want always or interval", flagValue(e.flags, "sync", "WAYMARK_SYNC", e.sync))
	}
	if e.syncInterval <= 0 {
		return fmt.Errorf("--sync-interval %v: want a positive duration", e.syncInterval)
	}
	return nil
}

func (e *embeddedFlags) start(listen string, log *slog.Logger) (*natsserver.Server, error) {
	return natsserver.Start(natsserver.Config{
		DataDir: e.dataDir, Listen: listen, Sync: e.sync, SyncInterval: e.syncInterval,
		Logger: log,
	})
}

// loadWorkflow loads and checks a workflow file with every check the
// engine and the built-in kinds can make, for workers of this process
// (env). Warnings are on the definition (Definition.Warnings).
func loadWorkflow(path string, env *steps.Env, allowKinds []string) (*schemas.Definition, error) {
	return schemas.Load(path, schemas.LoadOptions{Checks: []schemas.CheckFunc{
		engine.Check,
		steps.Builtins().Check(env, allowKinds...),
	}})
}

// loadWorkflowForAnyWorker is loadWorkflow for steps that workers
// elsewhere will run, whose model mode and keys this process cannot know
// (steps.Registry.CheckAnyWorker).
func loadWorkflowForAnyWorker(path string, env *steps.Env, allowKinds []string) (*schemas.Definition, error) {
	return schemas.Load(path, schemas.LoadOptions{Checks: []schemas.CheckFunc{
		engine.Check,
		steps.Builtins().CheckAnyWorker(env, allowKinds...),
	}})
}

// readInput reads a JSON input file ("-" for stdin). Errors name the file
// and the byte offset of a syntax error.
func readInput(path string, stdin io.Reader) (json.RawMessage, error) {
	if path == "" {
		return json.RawMessage("{}"), nil
	}
	var data []byte
	var err error
	if path == "-" {
		data, err = io.ReadAll(io.LimitReader(stdin, 64<<20))
	} else {
		data, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, fmt.Errorf("read input %s: %w", path, err)
	}
	if _, err := schemas.DecodeJSON(data); err != nil {
		var se *json.SyntaxError
		off := int64(-1)
		switch {
		case errors.As(err, &se):
			off = se.Offset - 1 // the offset is just past the offending byte
		case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
			off = int64(len(data))
		}
		if off >= 0 {
			line, col := lineCol(data, max(off, 0))
			return nil, fmt.Errorf("input %s:%d:%d: not valid JSON: %v", path, line, col, err)
		}
		return nil, fmt.Errorf("input %s: not valid JSON: %v", path, err)
	}
	if err := schemas.CheckJSONText(data); err != nil {
		file := path
		if path == "-" {
			file = "stdin"
		}
		var te *schemas.TextError
		if errors.As(err, &te) {
			line, col := lineCol(data, int64(te.Offset))
			file = fmt.Sprintf("%s:%d:%d", file, line, col)
		}
		return nil, &inputErr{msg: fmt.Sprintf("input %s: %s", file, schemas.AsError(err).Message), cause: err}
	}
	return json.RawMessage(data), nil
}

func lineCol(data []byte, off int64) (int, int) {
	line, col := 1, 1
	for i := int64(0); i < off && i < int64(len(data)); i++ {
		if data[i] == '\n' {
			line++
			col = 1
		} else {
			col++
		}
	}
	return line, col
}

// parseVars parses --var name=value pairs; each name must be one of the
// vars def declares.
func parseVars(pairs []string, def *schemas.Definition) (map[string]string, error) {
	if len(pairs) == 0 {
		return nil, nil
	}
	out := map[string]string{}
	for _, p := range pairs {
		k, v, ok := strings.Cut(p, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--var %q: want name=value", p)
		}
		if _, declared := def.Vars[k]; !declared {
			declares := "it declares none"
			if len(def.Vars) > 0 {
				declares = "it declares: " + strings.Join(slices.Sorted(maps.Keys(def.Vars)), ", ")
			}
			return nil, fmt.Errorf("--var %q: workflow %s declares no var %q (%s)", p, def.Name, k, declares)
		}
		out[k] = v
	}
	if err := schemas.CheckStringsText("", out); err != nil {
		var te *schemas.TextError
		if errors.As(err, &te) {
			return nil, fmt.Errorf("--var %s: the value holds %s at byte %d; vars must be UTF-8 text", strings.TrimPrefix(te.Path, "/"), te.Reason, te.Offset)
		}
		return nil, err
	}
	return out, nil
}

// checkJobID checks a --job-id before anything starts.
func checkJobID(id string) error {
	if id == "" {
		return nil // a fresh id is picked
	}
	if err := engine.ValidateJobID(id); err != nil {
		msg := schemas.AsError(err).Message
		return fmt.Errorf("--job-id %q: %s", id, strings.TrimPrefix(msg, fmt.Sprintf("job id %q: ", id)))
	}
	return nil
}

// inputName names where a job's input came from, for messages.
func inputName(path string) string {
	switch path {
	case "":
		return "{} (no --input given)"
	case "-":
		return "from stdin"
	}
	return path
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func checkOutput(o string) error {
	if o != "text" && o != "json" {
		return fmt.Errorf("--output %q: want text or json", o)
	}
	return nil
}

// inputError adds file positions to the schema problems of an input error:
// "input.json:12:5: at /reports/3/id: does not match pattern". path is the
// --input flag: "" when none was given (the input is {}), "-" for stdin.
func inputError(path string, data []byte, err error) error {
	var se *schemas.SchemaError
	if !errors.As(err, &se) || len(se.Problems) == 0 {
		if path == "" {
			return &inputErr{msg: fmt.Sprintf("no --input given, and the input {} is refused: %v; give the job's input with --input FILE (- for stdin)", err), cause: err}
		}
		return fmt.Errorf("input %s: %w", inputName(path), err)
	}
	file := path
	var b strings.Builder
	switch path {
	case "":
		b.WriteString("no --input given, and the input {} does not match the workflow's schema:")
	case "-":
		file = "stdin"
		b.WriteString("input from stdin does not match the workflow's schema:")
	default:
		fmt.Fprintf(&b, "input %s does not match the workflow's schema:", path)
	}
	for _, p := range se.Problems {
		at := p.Path
		if at == "" {
			at = "/"
		}
		if path == "" {
			fmt.Fprintf(&b, "\n  at %s: %s", at, p.Message)
			continue
		}
		line, col := schemas.LocateInJSON(data, p.Path)
		where := file
		if line > 0 {
			where = fmt.Sprintf("%s:%d:%d", file, line, col)
		}
		fmt.Fprintf(&b, "\n  %s: at %s: %s", where, at, p.Message)
	}
	if path == "" {
		b.WriteString("\ngive the job's input with --input FILE (- for stdin)")
	}
	return &inputErr{msg: b.String(), cause: err}
}

type inputErr struct {
	msg   string
	cause error
}

func (e *inputErr) Error() string { return e.msg }
func (e *inputErr) Unwrap() error { return e.cause }
