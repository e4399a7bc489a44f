package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/cliflags"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// ExitError carries a process exit code out of a command (see
// cliflags.ExitError).
type ExitError = cliflags.ExitError

// globals are the flags every command shares.
type globals struct {
	conn      cliflags.Conn // --server (natsURL), --creds, --nkey, --tls*, --context
	prefix    string
	logLevel  string
	logFormat string
	stdout    io.Writer
	stderr    io.Writer
	flags     *pflag.FlagSet // where the flags above were bound, to tell flag from environment
}

func envOr(key, def string) string { return cliflags.EnvOr(key, def) }

func (g *globals) bind(cmd *cobra.Command) {
	g.flags = cliflags.BindGlobals(cmd, &g.conn, &g.prefix, &g.logLevel, &g.logFormat)
}

func (g *globals) logger() (*slog.Logger, error) {
	return cliflags.Logger(g.logLevel, g.logFormat, g.stderr, g.flags)
}

// flagValue names a flag and its value for an error message (see
// cliflags.FlagValue).
func flagValue(fs *pflag.FlagSet, flag, env, value string) string {
	return cliflags.FlagValue(fs, flag, env, value)
}

// remote reports whether a server is named (--server, NATS_URL,
// --context, NATS_CONTEXT) instead of the embedded one.
func (g *globals) remote() bool { return g.conn.Remote() }

// natsURL is the server URL as given, for messages: redacted, or the
// context's name when a context names the server.
func (g *globals) natsURL() string {
	if g.conn.URL == "" && g.conn.Context != "" {
		return "context " + g.conn.Context
	}
	return cliflags.RedactURL(g.conn.URL)
}

// serverFlag is the flag that names the server again, for hints: the
// context when one was given, else --nats-url with the URL redacted.
func (g *globals) serverFlag() string {
	if g.conn.Context != "" {
		return "--context " + shellQuote(g.conn.Context)
	}
	return "--nats-url " + shellQuote(cliflags.RedactURL(g.conn.URL))
}

// connect dials the NATS server named by --nats-url (or --context) once,
// for one-shot commands: an unreachable server is an error at once.
func (g *globals) connect(name string) (*nats.Conn, error) {
	return cliflags.Connect(g.conn, g.flags, name)
}

// connectWaiting dials the NATS server named by --nats-url for a
// long-running command (engine serve, engine run): it waits for the
// server, retrying with backoff and logging each retry.
func (g *globals) connectWaiting(ctx context.Context, name string, log *slog.Logger) (*nats.Conn, error) {
	return cliflags.ConnectWaiting(ctx, g.conn, g.flags, name, log)
}

// kvConfigFromEnv applies the WAYMARK_* layout variables to cfg (see
// cliflags.KVConfigFromEnv).
func kvConfigFromEnv(cfg kv.Config) (kv.Config, error) { return cliflags.KVConfigFromEnv(cfg) }

// kvConfig completes cfg with the WAYMARK_* layout variables and --prefix
// and checks it, before anything reaches the server. Errors are usage
// errors (exit status 2) naming the variable or flag at fault.
func (g *globals) kvConfig(cfg kv.Config) (kv.Config, error) {
	return cliflags.KVConfig(cfg, g.prefix, g.flags)
}

// openStore opens the Waymark layout over nc.
func (g *globals) openStore(ctx context.Context, nc *nats.Conn, cfg kv.Config, log *slog.Logger) (*kv.Store, error) {
	return cliflags.OpenStore(ctx, nc, cfg, g.prefix, g.flags, log)
}

// embeddedFlags configure the embedded nats-server.
type embeddedFlags struct {
	dataDir      string
	sync         string
	syncInterval time.Duration
	maxStore     string // as given; parsed by validate into maxBytes
	maxBytes     int64
	keyFile      string // --encryption-key-file
	cipher       string // --encryption-cipher
	key          string // read by validate from the files or WAYMARK_ENCRYPTION_KEY
	flags        *pflag.FlagSet
}

func (e *embeddedFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	e.flags = f
	f.StringVar(&e.dataDir, "data-dir", envOr("WAYMARK_DATA_DIR", ".waymark"), "embedded server's data directory (env WAYMARK_DATA_DIR)")
	f.StringVar(&e.sync, "sync", envOr("WAYMARK_SYNC", natsserver.SyncAlways), "embedded JetStream sync policy: always (fsync before every acknowledgement) or interval (env WAYMARK_SYNC)")
	f.DurationVar(&e.syncInterval, "sync-interval", time.Second, "fsync period under --sync interval")
	f.StringVar(&e.keyFile, "encryption-key-file", "", "encrypt the embedded server's JetStream files at rest with the key in FILE (at least 32 bytes; default: the key text in env WAYMARK_ENCRYPTION_KEY, if set)")
	f.StringVar(&e.cipher, "encryption-cipher", envOr("WAYMARK_ENCRYPTION_CIPHER", natsserver.CipherChaCha), "cipher of --encryption-key-file: chacha or aes (env WAYMARK_ENCRYPTION_CIPHER)")
	f.StringVar(&e.maxStore, "max-store", envOr("WAYMARK_MAX_STORE", ""), "cap on the embedded server's JetStream file storage, e.g. 512MiB or 10GB; writes beyond it are refused (default: 75% of the disk space free at start) (env WAYMARK_MAX_STORE)")
}

// validate checks the flags before anything starts.
func (e *embeddedFlags) validate() error {
	if e.sync != natsserver.SyncAlways && e.sync != natsserver.SyncInterval {
		return fmt.Errorf("%s: want always or interval", flagValue(e.flags, "sync", "WAYMARK_SYNC", e.sync))
	}
	if e.syncInterval <= 0 {
		return fmt.Errorf("--sync-interval %v: want a positive duration", e.syncInterval)
	}
	n, err := natsserver.ParseSize(e.maxStore)
	if err != nil {
		return fmt.Errorf("%s: want a size such as 512MiB or 10GB, or 0 for the default", flagValue(e.flags, "max-store", "WAYMARK_MAX_STORE", e.maxStore))
	}
	e.maxBytes = n
	if e.cipher != natsserver.CipherChaCha && e.cipher != natsserver.CipherAES {
		return fmt.Errorf("%s: want chacha or aes", flagValue(e.flags, "encryption-cipher", "WAYMARK_ENCRYPTION_CIPHER", e.cipher))
	}
	e.key = os.Getenv("WAYMARK_ENCRYPTION_KEY")
	if e.keyFile != "" {
		if e.key, err = readKeyFile("encryption-key-file", e.keyFile); err != nil {
			return err
		}
	}
	if e.key != "" && len(e.key) < natsserver.MinKeyBytes {
		what := "WAYMARK_ENCRYPTION_KEY"
		if e.keyFile != "" {
			what = fmt.Sprintf("--encryption-key-file %q", e.keyFile)
		}
		return fmt.Errorf("%s: the key is %d bytes, want at least %d (generate one with `openssl rand -hex 32`)", what, len(e.key), natsserver.MinKeyBytes)
	}
	return nil
}

// readKeyFile reads an encryption key file: its text, without the
// trailing newline. Errors name the flag and file, never the key.
func readKeyFile(flag, path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return "", fmt.Errorf("--%s %q: %v", flag, path, err)
	}
	key := strings.TrimRight(string(data), "\r\n")
	if key == "" {
		return "", fmt.Errorf("--%s %q: the file is empty", flag, path)
	}
	return key, nil
}

// chooseServer settles between the server NATS_URL or --nats-url names
// and the embedded one, when flags of the embedded server are given too:
// with --nats-url that is an error (say which); with NATS_URL the flags
// win, as flags win over the environment everywhere, and the log says so.
func (e *embeddedFlags) chooseServer(g *globals, log *slog.Logger) error {
	if !g.remote() {
		return nil
	}
	var given []string
	for _, name := range []string{"data-dir", "listen", "max-store", "sync", "sync-interval", "encryption-key-file", "encryption-cipher"} {
		if f := e.flags.Lookup(name); f != nil && f.Changed {
			given = append(given, "--"+name)
		}
	}
	if len(given) == 0 {
		return nil
	}
	if g.flags.Changed("context") {
		return fmt.Errorf("--context and %s both given: %s set up the embedded server, and the context names a server to connect to instead; drop one", strings.Join(given, ", "), strings.Join(given, ", "))
	}
	if g.flags.Changed("nats-url") {
		return fmt.Errorf("--nats-url and %s both given: %s set up the embedded server, which --nats-url replaces; drop one", strings.Join(given, ", "), strings.Join(given, ", "))
	}
	log.Warn("NATS_URL or NATS_CONTEXT is set, but flags of the embedded server are given; flags win: using the embedded server",
		"server", g.natsURL(), "flags", strings.Join(given, ", "))
	g.conn.URL, g.conn.Context = "", ""
	return nil
}

func (e *embeddedFlags) start(listen string, log *slog.Logger) (*natsserver.Server, error) {
	return natsserver.Start(natsserver.Config{
		DataDir: e.dataDir, Listen: listen, Sync: e.sync, SyncInterval: e.syncInterval,
		MaxStore: e.maxBytes, Logger: log,
		EncryptionKey: e.key, EncryptionCipher: e.cipher,
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
		const limit = 64 << 20
		data, err = io.ReadAll(io.LimitReader(stdin, limit+1))
		if err == nil && len(data) > limit {
			return nil, fmt.Errorf("input -: more than %d bytes on stdin (64 MiB, the most read; a job input may hold far less, see Size limits)", limit)
		}
	} else {
		data, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, fmt.Errorf("read input %s: %w", path, err)
	}
	// A byte order mark some editors write is not part of the JSON.
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf"))
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
	if err := client.ValidateJobID(id); err != nil {
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
	enc.SetEscapeHTML(false) // "<b>" prints as it was given, not as \u003cb\u003e
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

// childCheck reports workflow steps whose child workflow known does not
// know (neither a --child file nor stored).
func childCheck(known func(name string) bool) schemas.CheckFunc {
	return func(def *schemas.Definition) []schemas.Problem {
		var ps []schemas.Problem
		check := func(s *schemas.Step, ptr string) {
			cs, err := schemas.ChildOf(s)
			if err != nil {
				ps = append(ps, schemas.Problem{Path: ptr + "/with", Message: err.Error()})
				return
			}
			if cs.Workflow != def.Name && !known(cs.Workflow) {
				ps = append(ps, schemas.Problem{Path: ptr + "/with/workflow",
					Message: fmt.Sprintf("workflow %q is not stored, and no --child file defines it", cs.Workflow)})
			}
		}
		for i := range def.Steps {
			s := &def.Steps[i]
			if s.Kind == schemas.KindWorkflow {
				check(s, fmt.Sprintf("/steps/%d", i))
			}
			for j := range s.Tools { // an agent's tools that are child jobs
				if t := &s.Tools[j]; t.Kind == schemas.KindWorkflow {
					check(schemas.ToolStep(s, t), fmt.Sprintf("/steps/%d/tools/%d", i, j))
				}
			}
		}
		return ps
	}
}

// loadChildren loads the --child workflow files with the checks of
// loadWorkflowForAnyWorker; by name.
func loadChildren(paths []string, env *steps.Env, allowKinds []string) (map[string]*schemas.Definition, error) {
	out := map[string]*schemas.Definition{}
	for _, p := range paths {
		def, err := loadWorkflowForAnyWorker(p, env, allowKinds)
		if err != nil {
			return nil, err
		}
		out[def.Name] = def
	}
	return out, nil
}

// storeChildren checks that every workflow a workflow step of path (or of
// a child) names is a child file or stored, then stores the children. The
// error names the file, line and path of a step whose workflow is
// missing.
func storeChildren(ctx context.Context, st *kv.Store, path string, children map[string]*schemas.Definition) error {
	main, err := schemas.Load(path, schemas.LoadOptions{})
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	known := func(name string) bool {
		if _, ok := children[name]; ok || name == main.Name {
			return true
		}
		_, err := st.Definitions.Latest(ctx, name)
		return err == nil
	}
	if _, err := schemas.Load(path, schemas.LoadOptions{Checks: []schemas.CheckFunc{childCheck(known)}}); err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	for _, def := range children {
		if ps := childCheck(known)(def); len(ps) > 0 {
			return &ExitError{Code: 2, Err: fmt.Errorf("child workflow %s: %s: %s", def.Name, schemas.PointerToPath(ps[0].Path), ps[0].Message)}
		}
	}
	for _, def := range children {
		if err := st.Definitions.Put(ctx, def); err != nil {
			return fmt.Errorf("store child workflow %s: %w", def.Name, err)
		}
	}
	return nil
}

// asWarnings turns check's problems into warnings, for what the process
// cannot decide (no store to look in).
func asWarnings(check schemas.CheckFunc) schemas.CheckFunc {
	return func(def *schemas.Definition) []schemas.Problem {
		ps := check(def)
		for i := range ps {
			ps[i].Warning = true
			ps[i].Message += " (engine run and engine start refuse it unless it is stored; validate has no store to look in)"
		}
		return ps
	}
}
