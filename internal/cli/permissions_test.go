package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// permServer is a nats-server started from deploy/nats/permissions.conf
// through the server's own config loader, with JetStream in a temporary
// directory and a fresh nkey per component.
type permServer struct {
	srv   *server.Server
	url   string
	seeds map[string]string // component -> seed file
	log   *traceLog
}

// traceLog collects the server's log: permission violations, and (when
// tracing) every PUB and SUB with the connection that sent it.
type traceLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *traceLog) add(f string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(f, v...))
}
func (l *traceLog) Noticef(f string, v ...any) { l.add(f, v...) }
func (l *traceLog) Warnf(f string, v ...any)   { l.add(f, v...) }
func (l *traceLog) Fatalf(f string, v ...any)  { l.add(f, v...) }
func (l *traceLog) Errorf(f string, v ...any)  { l.add(f, v...) }
func (l *traceLog) Debugf(f string, v ...any)  { l.add(f, v...) }
func (l *traceLog) Tracef(f string, v ...any)  { l.add(f, v...) }

// violations returns the permission violations logged so far.
func (l *traceLog) violations() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, s := range l.lines {
		if strings.Contains(s, "Publish Violation") || strings.Contains(s, "Subscription Violation") {
			out = append(out, s)
		}
	}
	return out
}

func (l *traceLog) String() string { return strings.Join(l.violations(), "\n") }

// startPermServer writes a server config that includes the permissions
// file, the way deploy/'s configurations do, and starts it.
func startPermServer(t *testing.T, trace bool) *permServer {
	t.Helper()
	dir := t.TempDir()
	perms, err := os.ReadFile(repo("deploy/nats/permissions.conf"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "permissions.conf"), perms, 0o600); err != nil {
		t.Fatal(err)
	}
	p := &permServer{seeds: map[string]string{}, log: &traceLog{}}
	for _, c := range []string{"engine", "worker", "cli"} {
		kp, err := nkeys.CreateUser()
		if err != nil {
			t.Fatal(err)
		}
		seed, _ := kp.Seed()
		pub, _ := kp.PublicKey()
		p.seeds[c] = filepath.Join(dir, c+".nk")
		if err := os.WriteFile(p.seeds[c], seed, 0o600); err != nil {
			t.Fatal(err)
		}
		t.Setenv("WAYMARK_"+strings.ToUpper(c)+"_NKEY", pub)
	}
	conf := fmt.Sprintf(`
listen: "127.0.0.1:-1"
server_name: perms
jetstream { store_dir: %q }
include "permissions.conf"
accounts {
  WAYMARK: { jetstream: enabled, users: $WAYMARK_USERS }
}
`, filepath.Join(dir, "js"))
	path := filepath.Join(dir, "server.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatalf("the server's config loader refuses deploy/nats/permissions.conf: %v", err)
	}
	opts.NoSigs, opts.Trace, opts.Debug = true, trace, trace
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	s.SetLoggerV2(p.log, trace, trace, false)
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	t.Cleanup(s.Shutdown)
	p.srv, p.url = s, s.ClientURL()
	return p
}

// conn connects as component.
func (p *permServer) conn(t *testing.T, component string) *nats.Conn {
	t.Helper()
	opt, err := nats.NkeyOptionFromSeed(p.seeds[component])
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(p.url, opt, nats.Name("test-"+component))
	if err != nil {
		t.Fatalf("connect as %s: %v", component, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestPermissionsRunAJob: an engine connected as the engine user, a
// worker as the worker user and the CLI as the cli user run jobs end to
// end (effects of every class, an approval decided from the CLI) against
// a server configured with deploy/nats/permissions.conf, without one
// permission violation; and each user is refused what it must not do.
func TestPermissionsRunAJob(t *testing.T) {
	p := startPermServer(t, os.Getenv("WAYMARK_PERMISSIONS_TRACE") != "")
	as := func(c string) []string { return []string{"--nats-url", p.url, "--nkey", p.seeds[c]} }

	// A worker started before any engine waits for the layout (its user
	// may not create it), then serves (its own pool: it takes no steps).
	// background runs the engine command with args until the test ends.
	background := func(name string, out, log *syncBuf, args ...string) {
		cmd := NewEngineCommand(out, log)
		cmd.SetArgs(args)
		ctx, stop := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- cmd.ExecuteContext(ctx) }()
		t.Cleanup(func() {
			stop()
			if err := <-done; err != nil {
				t.Errorf("%s: %v", name, err)
			}
		})
	}
	var early syncBuf
	background("early worker", &early, &early, append([]string{"worker", "--pool", "early", "--log-level", "info"}, as("worker")...)...)
	testsupport.Eventually(t, 30*time.Second, func() bool {
		return strings.Contains(early.String(), "cannot open the Waymark streams and buckets yet")
	}, "the worker started first did not say it waits: %s", &early)

	// The engine, with the demo services for the worker to call.
	s := &served{out: &syncBuf{}, log: &syncBuf{}}
	t.Setenv("WAYMARK_DATA_DIR", t.TempDir()) // where --demo keeps its services' data (--data-dir would ask for the embedded server)
	background("serve", s.out, s.log, append([]string{"serve", "--http", "", "--workers", "0", "--demo", "--log-level", "info"}, as("engine")...)...)
	services := map[string]string{}
	svcRE := regexp.MustCompile(`(?m)^service (\w+): (\S+)$`)
	testsupport.Eventually(t, 30*time.Second, func() bool {
		for _, m := range svcRE.FindAllStringSubmatch(s.out.String(), -1) {
			services[m[1]] = m[2]
		}
		return strings.Contains(s.out.String(), "engine running")
	}, "engine did not start: %s\n%s\nviolations:\n%s", s.out, s.log, p.log)

	// The worker.
	var wout, wlog syncBuf
	args := append([]string{"worker", "--log-level", "info"}, as("worker")...)
	for name, url := range services {
		args = append(args, "--service", name+"="+url)
	}
	background("worker", &wout, &wlog, args...)
	testsupport.Eventually(t, 30*time.Second, func() bool { return strings.Contains(wout.String(), "worker serving") },
		"worker did not start: %s\n%s\nviolations:\n%s", &wout, &wlog, p.log)

	testsupport.Eventually(t, 60*time.Second, func() bool { return strings.Contains(early.String(), "worker serving") },
		"the worker started before the engine does not serve: %s", &early)
	for _, v := range p.log.violations() {
		if !strings.Contains(v, "$JS.API.STREAM.CREATE.") {
			t.Errorf("while the early worker waited: %s (want only its refused stream creates)", v)
		}
	}
	waited := len(p.log.violations())

	cli := func(args ...string) string {
		t.Helper()
		out, errOut, code := execute(t, append(args, as("cli")...)...)
		if code != 0 {
			t.Fatalf("engine %v as cli: exit %d\n%s\n%s\nviolations:\n%s", args, code, out, errOut, p.log)
		}
		return out
	}
	status := func(job string) schemas.JobStatus {
		var v struct {
			Status schemas.JobStatus `json:"status"`
		}
		if err := json.Unmarshal([]byte(cli("status", job, "-o", "json")), &v); err != nil {
			t.Fatal(err)
		}
		return v.Status
	}
	effects := strings.TrimSpace(cli("start", repo("examples/effects/workflow.yaml"), "--input", repo("examples/effects/input.json")))
	refund := strings.TrimSpace(cli("start", repo("examples/approval/workflow.yaml"), "--input", repo("examples/approval/input.json")))
	testsupport.Eventually(t, 60*time.Second, func() bool { return status(effects) == schemas.JobCompleted },
		"effects job %s did not complete (%s); engine log:\n%s\nviolations:\n%s", effects, lazyStatus(status, effects), s.log, p.log)
	testsupport.Eventually(t, 60*time.Second, func() bool { return status(refund) == schemas.JobWaitingApproval },
		"refund job %s did not reach its gate; violations:\n%s", refund, p.log)
	cli("approve", refund, "approve", "--by", "alice", "--reason", "checked")
	testsupport.Eventually(t, 60*time.Second, func() bool { return status(refund) == schemas.JobCompleted },
		"refund job %s did not complete after the approval; violations:\n%s", refund, p.log)
	cli("history", effects)
	cli("list")
	cli("effects", "list")
	// A value over the object-store threshold: the CLI stores the input,
	// the engine and the worker read it.
	noop := writeWorkflow(t, testsupport.NoopChain("perm-noop", 2))
	big := writeFile(t, "big.json", `{"blob": "`+strings.Repeat("x", 200<<10)+`"}`)
	large := strings.TrimSpace(cli("start", noop, "--input", big))
	testsupport.Eventually(t, 60*time.Second, func() bool { return status(large) == schemas.JobCompleted },
		"job %s with a large input did not complete; violations:\n%s", large, p.log)
	// The session store, a cancel, and a cron schedule the engine fires.
	cli("store", "put", "users", "alice", "--value", `{"tier": "gold"}`)
	if out := cli("store", "get", "users", "alice"); !strings.Contains(out, "gold") {
		t.Errorf("store get: %s", out)
	}
	cli("store", "list", "users")
	waiting := strings.TrimSpace(cli("start", repo("examples/approval/workflow.yaml"), "--input", repo("examples/approval/input.json")))
	testsupport.Eventually(t, 60*time.Second, func() bool { return status(waiting) == schemas.JobWaitingApproval },
		"job %s did not reach its gate; violations:\n%s", waiting, p.log)
	cli("cancel", waiting, "--by", "alice", "--reason", "test")
	testsupport.Eventually(t, 60*time.Second, func() bool { return status(waiting) == schemas.JobCancelled },
		"job %s was not cancelled; violations:\n%s", waiting, p.log)
	cli("schedule", "add", "tick", noop, "--cron", "@every 1s")
	testsupport.Eventually(t, 60*time.Second, func() bool { return strings.Contains(cli("list"), "tick-") },
		"the schedule started no job; violations:\n%s", p.log)
	cli("schedule", "list")
	cli("schedule", "remove", "tick")
	// A CloudEvent over NATS, twice: the engine's intake answers the cli
	// user, and the second delivery names the same job.
	triggered := writeWorkflow(t, "name: perm-orders\nversion: 1\nsteps:\n  - {id: take, kind: noop}\ntriggers:\n  - {name: created, type: com.example.order.created}\n")
	cli("triggers", "add", triggered)
	data := writeFile(t, "order.json", `{"order_id": "o-1"}`)
	first := strings.TrimSpace(cli("events", "send", "--type", "com.example.order.created", "--source", "/shop", "--id", "o-1", "--data", data))
	again := strings.TrimSpace(cli("events", "send", "--type", "com.example.order.created", "--source", "/shop", "--id", "o-1", "--data", data))
	if first == "" || !strings.Contains(again, strings.Fields(first)[0]) {
		t.Errorf("the same event twice: %q, then %q; want the same job", first, again)
	}

	if v := p.log.violations()[waited:]; len(v) > 0 {
		t.Errorf("permission violations while running the jobs:\n%s", strings.Join(v, "\n"))
	}
	if os.Getenv("WAYMARK_PERMISSIONS_TRACE") != "" {
		dumpTrace(t, p.log)
	}

	// What each user must not do.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	names := kv.NamesFor(kv.DefaultPrefix)
	refused := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Errorf("%s: allowed, want a permission error", what)
		}
	}
	// A refused JetStream publish or API request gets no answer: the
	// client sees a timeout (the permission error comes asynchronously).
	short := func() context.Context {
		c, cancel := context.WithTimeout(ctx, time.Second)
		t.Cleanup(cancel)
		return c
	}
	for _, c := range []string{"worker", "cli"} {
		js, err := jetstream.New(p.conn(t, c))
		if err != nil {
			t.Fatal(err)
		}
		kvs, err := js.KeyValue(ctx, names.CheckpointBucket)
		if err != nil {
			t.Fatalf("%s cannot open the checkpoints bucket to read: %v", c, err)
		}
		if _, err := kvs.Get(ctx, effects); err != nil {
			t.Errorf("%s cannot read a checkpoint: %v", c, err)
		}
		if c == "worker" { // the CLI writes a job's first checkpoint (start, fork)
			_, err = kvs.Put(short(), effects, []byte(`{}`))
			refused(c+" writes a checkpoint", err)
		}
		_, err = js.Publish(short(), names.WorkSubject("default", "forged"), []byte(`{}`))
		refused(c+" publishes a step message", err)
		err = js.DeleteStream(short(), names.InboxStream)
		refused(c+" deletes the inbox stream", err)
		_, err = js.CreateStream(short(), jetstream.StreamConfig{Name: "EVIL", Subjects: []string{"evil.>"}})
		refused(c+" creates a stream", err)
	}
	{
		js, err := jetstream.New(p.conn(t, "cli"))
		if err != nil {
			t.Fatal(err)
		}
		_, err = js.Publish(short(), names.InboxSubject(kv.InboxResult, effects), []byte(`{}`))
		refused("cli publishes a step result", err)
	}
	{
		js, err := jetstream.New(p.conn(t, "worker"))
		if err != nil {
			t.Fatal(err)
		}
		_, err = js.Publish(short(), names.InboxSubject(kv.InboxStart, "forged"), []byte(`{}`))
		refused("worker starts a job", err)
		_, err = js.Publish(short(), names.InboxSubject(kv.InboxSignal, refund), []byte(`{}`))
		refused("worker publishes a person's decision", err)
		jobs, err := js.KeyValue(ctx, names.JobsBucket)
		if err == nil {
			_, err = jobs.Put(short(), "forged", []byte(`{}`))
		}
		refused("worker writes the job index", err)
	}
	{
		js, err := jetstream.New(p.conn(t, "engine"))
		if err != nil {
			t.Fatal(err)
		}
		refused("engine deletes the inbox stream", js.DeleteStream(short(), names.InboxStream))
		_, err = js.CreateStream(short(), jetstream.StreamConfig{Name: "EVIL", Subjects: []string{"evil.>"}})
		refused("engine creates a stream outside the layout", err)
	}
	// The refusals above reached the server's log: the check for no
	// violations while the jobs ran could have seen one.
	if len(p.log.violations()) == 0 {
		t.Error("the refusals left no violation in the server's log: the log capture is broken")
	}
	// A refused request is answered with a permission error, not a hang:
	// the client's sentinel tells it apart.
	nc := p.conn(t, "worker")
	errs := make(chan error, 1)
	nc.SetErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		select {
		case errs <- err:
		default:
		}
	})
	_ = nc.Publish(names.WorkSubject("default", "forged"), nil)
	_ = nc.Flush()
	select {
	case err := <-errs:
		if !errors.Is(err, nats.ErrPermissionViolation) {
			t.Errorf("refused publish: %v, want nats.ErrPermissionViolation", err)
		}
	case <-ctx.Done():
		t.Error("a refused publish was not reported")
	}
}

// lazyStatus prints a job's status when a wait fails.
type lazyStatusT struct {
	f   func(string) schemas.JobStatus
	job string
}

func (l lazyStatusT) String() string { return string(l.f(l.job)) }

func lazyStatus(f func(string) schemas.JobStatus, job string) fmt.Stringer {
	return lazyStatusT{f, job}
}

// dumpTrace prints the distinct subjects each test connection published
// and subscribed to (WAYMARK_PERMISSIONS_TRACE=1), for keeping the
// permissions file exact.
func dumpTrace(t *testing.T, l *traceLog) {
	l.mu.Lock()
	defer l.mu.Unlock()
	re := regexp.MustCompile(`"([^"]*:go:(waymark-\w+|test-\w+))".*<<- \[(PUB|SUB|HPUB) (\S+)`)
	seen := map[string]bool{}
	for _, s := range l.lines {
		if m := re.FindStringSubmatch(s); m != nil {
			seen[m[2]+" "+m[3]+" "+m[4]] = true
		}
	}
	keys := make([]string, 0, len(seen))
	for k := range seen {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	t.Logf("trace:\n%s", strings.Join(keys, "\n"))
}
