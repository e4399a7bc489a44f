package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/engine/trigger"
	"github.com/waymark-dev/waymark/internal/cliflags"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// stepFlags configure in-process workers: cliflags.StepFlags, with the
// kinds a definition may use beyond the built-ins.
type stepFlags struct {
	cliflags.StepFlags
	allowKinds []string
}

func (s *stepFlags) bind(cmd *cobra.Command) { s.Bind(cmd) }

func (s *stepFlags) env() (*steps.Env, error) { return s.Env() }

type runFlags struct {
	input    string
	jobID    string
	vars     []string
	output   string
	workers  int
	timeout  time.Duration
	embedded embeddedFlags
	steps    stepFlags
	children []string // --child workflow files
	events   eventFlags
}

func newRunCmd(g *globals) *cobra.Command {
	var f runFlags
	cmd := &cobra.Command{
		Use:   "run WORKFLOW [--input FILE]",
		Short: "Run one job to the end on an embedded server (or --nats-url) and print its transitions",
		Long: `Run starts an embedded nats-server (JetStream files under --data-dir), the engine
and in-process workers, runs one job of WORKFLOW to completion, printing one line
per transition, then the final state. Without --input the job's input is {}.
With --job-id, running the same command again after a crash attaches to that job
and finishes it instead of starting another.
Bundled demo services named by the workflow ({{service "tickets"}}) start by
themselves unless --service gives their URL. Exit status: 0 completed, 1 failed,
2 bad input, 3 needs reconciliation (an effect's outcome is unknown: a person
settles it with engine effects resolve), 4 waiting for approval (a person
decides with engine approve or engine reject), 130 interrupted (the job stays
saved and resumes on the next run).`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runJob(cmd.Context(), g, &f, args[0], cmd.InOrStdin())
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&f.input, "input", "i", "", "job input: a JSON file, or - for stdin (default: {})")
	fl.StringVar(&f.jobID, "job-id", "", "job id; an existing id attaches to that job")
	fl.StringArrayVar(&f.vars, "var", nil, "name=value overriding one of the workflow's vars (repeatable)")
	fl.StringArrayVar(&f.children, "child", nil, "a workflow file that workflow steps start as child jobs, stored before the job starts (repeatable)")
	fl.StringVarP(&f.output, "output", "o", "text", "text or json (the final job record as one JSON object)")
	fl.IntVar(&f.workers, "workers", steps.DefaultConcurrency, "steps the in-process worker runs at once; 0 runs none (use separate worker processes)")
	fl.DurationVar(&f.timeout, "timeout", 0, "give up waiting after this long (the job stays saved); 0 waits forever")
	f.embedded.bind(cmd)
	f.steps.bind(cmd)
	fl.StringArrayVar(&f.steps.allowKinds, "allow-kind", nil, "a step kind only separate workers know (with --workers 0 or --nats-url; repeatable)")
	f.events.bind(cmd, false)
	return cmd
}

// stack is a running engine, its workers and whatever they need.
type stack struct {
	nc       *nats.Conn
	srv      *natsserver.Server
	store    *kv.Store
	engine   *engine.Engine
	intake   *trigger.Intake // CloudEvents intake, with an engine: on <prefix>.trigger.> and the HTTP API
	workers  []*steps.Worker
	services []runningService
	notify   *notifiers // lifecycle events relay and webhook sinks
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	errs     chan error
}

// runningService is a bundled demo service this process started.
type runningService struct {
	Name, Dir, URL string
	r              *demo.Running
}

// stackOptions say what to bring up.
type stackOptions struct {
	listen    string // embedded server client address; "" for in-process only
	kvConfig  kv.Config
	env       *steps.Env
	workers   int
	engines   int
	demoDir   string   // where bundled demo services keep their data
	demoNames []string // bundled services to start
	log       *slog.Logger

	// events: lifecycle events and webhooks (engines only); nil for none.
	events *eventPlan
}

func (g *globals) startStack(ctx context.Context, emb *embeddedFlags, o stackOptions) (*stack, error) {
	s := &stack{errs: make(chan error, 8)}
	fail := func(err error) (*stack, error) {
		s.stop()
		return nil, err
	}
	var err error
	if g.remote() {
		s.nc, err = g.connectWaiting(ctx, "waymark-engine", o.log)
	} else {
		s.srv, err = emb.start(o.listen, o.log)
		if err == nil {
			s.nc, err = s.srv.Connect("waymark-engine")
		}
	}
	if err != nil {
		return fail(err)
	}
	o.kvConfig.TuneConsumers = o.engines > 0 // only an engine changes a shared consumer's tuning
	if s.srv != nil && emb.sync == natsserver.SyncAlways && os.Getenv("WAYMARK_GROUP_COMMIT") == "" {
		o.kvConfig.GroupCommit = true // fsyncs shared by many checkpoints
	}
	if s.store, err = g.openStore(ctx, s.nc, o.kvConfig, o.log); err != nil {
		return fail(err)
	}
	for _, name := range o.demoNames {
		dir := filepath.Join(o.demoDir, name)
		r, err := demo.Start(context.WithoutCancel(ctx), name, demo.Options{Dir: dir})
		if err != nil {
			return fail(fmt.Errorf("start bundled %s service: %w", name, err))
		}
		s.services = append(s.services, runningService{Name: name, Dir: dir, URL: r.URL, r: r})
		if o.env.Services == nil {
			o.env.Services = map[string]string{}
		}
		o.env.Services[name] = r.URL
	}
	fp, err := failpoint.FromEnv()
	if err != nil {
		return fail(err)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	if o.engines > 0 {
		if s.engine, err = engine.New(engine.Config{Store: s.store, Logger: o.log, Failpoints: fp, SoleEngine: s.srv != nil}); err != nil {
			return fail(err)
		}
		s.goRun(runCtx, s.engine.Run)
		if s.intake, err = trigger.New(trigger.Config{Store: s.store, Logger: o.log, Failpoints: fp}); err != nil {
			return fail(err)
		}
		if _, err := s.intake.Subscribe(s.nc); err != nil {
			return fail(err)
		}
		if o.events != nil {
			if s.notify, err = o.events.start(runCtx, s, o.log); err != nil {
				return fail(err)
			}
		}
	}
	if o.workers > 0 {
		w, err := steps.NewWorker(steps.WorkerConfig{Store: s.store, Env: o.env, Concurrency: o.workers, Logger: o.log, Failpoints: fp})
		if err != nil {
			return fail(err)
		}
		s.workers = append(s.workers, w)
		s.goRun(runCtx, w.Run)
	}
	return s, nil
}

func (s *stack) goRun(ctx context.Context, run func(context.Context) error) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := run(ctx); err != nil {
			s.errs <- err
		}
	}()
}

func (s *stack) stop() {
	if s.cancel != nil {
		s.cancel()
	}
	s.wg.Wait()
	for _, r := range s.services {
		_ = r.r.Close()
	}
	if s.nc != nil {
		// Acknowledgements still in the client's buffer must reach the
		// server before it stops: one lost would have its message delivered
		// again after the ack wait. Drain is asynchronous; wait for it.
		_ = s.nc.FlushTimeout(2 * time.Second)
		closed := make(chan struct{})
		s.nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
		if err := s.nc.Drain(); err == nil {
			select {
			case <-closed:
			case <-time.After(5 * time.Second):
			}
		}
	}
	if s.srv != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		s.srv.Stop(ctx)
		cancel()
	}
}

// missingServices returns the services def's templates name that env does
// not map and that are not bundled.
func missingServices(def *schemas.Definition, env *steps.Env, bundled []string) []string {
	have := map[string]bool{}
	for _, n := range bundled {
		have[n] = true
	}
	var out []string
	for _, name := range serviceRefs(def) {
		if _, given := env.Services[name]; !given && !have[name] {
			out = append(out, name)
			have[name] = true
		}
	}
	return out
}

// serviceRefs returns the services the templates of def's steps and
// agent tools name ({{service "x"}}), in order of appearance, repeats
// included.
func serviceRefs(def *schemas.Definition) []string {
	var out []string
	add := func(with []byte) {
		for _, m := range serviceRefRE.FindAllStringSubmatch(string(with), -1) {
			out = append(out, m[1])
		}
	}
	for _, s := range def.Steps {
		add(s.With)
		for _, t := range s.Tools {
			add(t.With)
		}
	}
	return out
}

var serviceRefRE = regexp.MustCompile(`service\s+\\?"([A-Za-z0-9_-]+)\\?"`)

// bundledServices returns the bundled demo services def refers to that
// env does not already map.
func bundledServices(def *schemas.Definition, env *steps.Env) []string {
	bundled := map[string]bool{}
	for _, n := range demo.Names() {
		bundled[n] = true
	}
	found := map[string]bool{}
	for _, name := range serviceRefs(def) {
		if _, given := env.Services[name]; !given && bundled[name] {
			found[name] = true
		}
	}
	out := make([]string, 0, len(found))
	for n := range found {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func runJob(ctx context.Context, g *globals, f *runFlags, path string, stdin io.Reader) error {
	if err := checkOutput(f.output); err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	log, err := g.logger()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	env, err := f.steps.env()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	def, err := loadWorkflow(path, env, f.steps.allowKinds)
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	children, err := loadChildren(f.children, env, f.steps.allowKinds)
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	input, err := readInput(f.input, stdin)
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	vars, err := parseVars(f.vars, def)
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	if err := checkJobID(f.jobID); err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	if err := client.CheckInput(def, input); err != nil {
		return &ExitError{Code: 2, Err: inputError(f.input, input, err)}
	}
	// The services of the job's child workflows are started too.
	all := &schemas.Definition{Steps: slices.Clone(def.Steps)}
	for _, c := range children {
		all.Steps = append(all.Steps, c.Steps...)
	}
	names := bundledServices(all, env)
	if missing := missingServices(all, env, names); len(missing) > 0 {
		return &ExitError{Code: 2, Err: fmt.Errorf("workflow %s (or a --child) uses service(s) %s that are neither bundled nor given: add --service NAME=URL", path, strings.Join(missing, ", "))}
	}
	if f.workers < 0 {
		return &ExitError{Code: 2, Err: fmt.Errorf("--workers %d: want 0 or more", f.workers)}
	}
	if err := f.embedded.validate(); err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	if err := f.embedded.chooseServer(g, log); err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	if f.workers == 0 && !g.remote() {
		return &ExitError{Code: 2, Err: errors.New("--workers 0 on the embedded server: no worker could reach it, so the job would wait forever; use engine serve for separate workers")}
	}
	if _, err := g.kvConfig(kv.Config{}); err != nil {
		return err // a bad WAYMARK_* value, reported before any server starts
	}
	events, err := f.events.plan()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	ctx, stopSignals := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stopSignals()

	demoDir := filepath.Join(f.embedded.dataDir, "demo")
	st, err := g.startStack(ctx, &f.embedded, stackOptions{
		env: env, workers: f.workers, engines: 1, demoDir: demoDir, demoNames: names, log: log, events: events,
	})
	if err != nil {
		return err
	}
	defer st.stop()
	out := g.stdout
	text := f.output == "text"
	if err := storeChildren(ctx, st.store, path, children); err != nil {
		return err
	}
	cl := client.New(st.store)
	res, err := cl.Start(ctx, def, input, client.StartOptions{JobID: f.jobID, Vars: vars})
	if err != nil {
		return startError(f.input, err)
	}
	if text {
		if res.Attached {
			fmt.Fprintf(out, "attached to job %s (it exists; following it to the end)\n", res.JobID)
		} else {
			fmt.Fprintf(out, "job %s started: %s v%d (definition %s)\n", res.JobID, def.Name, def.Version, def.Hash[:12])
		}
		for _, r := range st.services {
			fmt.Fprintf(out, "bundled %s service at %s (data in %s)\n", r.Name, r.URL, r.Dir)
		}
	}
	wctx := ctx
	if f.timeout > 0 {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeout(ctx, f.timeout)
		defer cancel()
	}
	if res.Attached && text {
		if v, err := cl.Job(ctx, res.JobID); err == nil && v.Status.Stopped() {
			fmt.Fprintf(out, "job %s had already stopped: %s\n", res.JobID, v.Status)
		}
	}
	start := time.Now()
	// A child job that stops for a person leaves this job running: watch
	// for it, and stop following as for a job of its own that needs one.
	tctx := wctx // with the --timeout
	wctx, stopFollow := context.WithCancel(tctx)
	defer stopFollow()
	var waiting atomic.Pointer[client.ChildWait]
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-wctx.Done():
				return
			case <-tick.C:
				if v, err := cl.Job(wctx, res.JobID); err == nil && v.WaitingChild != nil {
					waiting.Store(v.WaitingChild)
					stopFollow()
					return
				}
			}
		}
	}()
	view, err := cl.Wait(wctx, res.JobID, func(h schemas.HistoryEvent) {
		if text {
			printEvent(out, h)
		}
	})
	stopFollow()
	<-watched
	if cw := waiting.Load(); err != nil && cw != nil && ctx.Err() == nil {
		key := ""
		if cw.Blocked != nil {
			key = cw.Blocked.EffectKey
		}
		return &ExitError{Code: 3, Err: fmt.Errorf("job %s waits on its child job %s, which is %s: the outcome of effect %s is unknown. Find out whether it happened, then %s; the job goes on once its child ends",
			res.JobID, cw.Job, cw.Status, key, resolveHint(g, f, key, len(st.services) > 0))}
	}
	if err != nil {
		if ctx.Err() != nil || tctx.Err() != nil {
			why := "interrupted"
			if ctx.Err() == nil {
				why = fmt.Sprintf("--timeout %v passed", f.timeout)
			}
			return &ExitError{Code: 130, Err: fmt.Errorf("%s; job %s is saved: run the same command with --job-id %s to resume it", why, res.JobID, res.JobID)}
		}
		return err
	}
	if !text {
		if err := printJSON(out, view); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(out, "job %s %s in %v (resume_count %d)\n", view.ID, view.Status, time.Since(start).Round(time.Millisecond), view.ResumeCount)
		fmt.Fprintln(out, "final state:")
		_ = printJSON(out, view.State)
		for _, r := range st.services {
			if r.Name == "tickets" {
				fmt.Fprintf(out, "tickets filed: %s\n", filepath.Join(r.Dir, "tickets.jsonl"))
			}
		}
	}
	switch view.Status {
	case schemas.JobFailed, schemas.JobCancelled:
		reason := "no reason recorded"
		if view.Error != nil {
			reason = view.Error.Error()
		}
		return &ExitError{Code: 1, Err: fmt.Errorf("job %s %s: %s", view.ID, view.Status, reason)}
	case schemas.JobNeedsReconciliation:
		key := ""
		if view.Blocked != nil {
			key = view.Blocked.EffectKey
		}
		return &ExitError{Code: 3, Err: fmt.Errorf("job %s needs reconciliation: the outcome of effect %s is unknown. Find out whether it happened, then %s", view.ID, key, resolveHint(g, f, key, len(st.services) > 0))}
	case schemas.JobWaitingApproval:
		var gate *schemas.Approval
		for _, a := range view.Approvals {
			if a.Status == schemas.ApprovalPending {
				gate = a
			}
		}
		if gate == nil {
			return &ExitError{Code: 4, Err: fmt.Errorf("job %s waits for an approval", view.ID)}
		}
		return &ExitError{Code: 4, Err: fmt.Errorf("job %s waits for approval at gate %s: %s (digest %s). %s",
			view.ID, gate.Gate, gate.Action, gate.Digest, approvalHint(g, f, view.ID, gate.Gate, len(st.services) > 0))}
	}
	return nil
}

// hintFlags are the flags a hint's commands need: extra for every command
// (a prefix of its own), serveFlags for engine serve (and the services the
// run had).
func hintFlags(g *globals, f *runFlags, bundled bool) (extra, serveFlags string) {
	if g.prefix != kv.DefaultPrefix {
		extra = " --prefix " + shellQuote(g.prefix)
	}
	serveFlags = extra
	if bundled {
		serveFlags += " --demo"
	}
	for _, svc := range f.steps.Services {
		serveFlags += " --service " + shellQuote(svc)
	}
	return extra, serveFlags
}

// approvalHint tells how to decide a gate after engine run stopped at it:
// as resolveHint, with engine approve and engine reject.
func approvalHint(g *globals, f *runFlags, job, gate string, bundled bool) string {
	extra, serveFlags := hintFlags(g, f, bundled)
	decide := fmt.Sprintf("`engine approve %s %s%s` (or `engine reject`)", shellQuote(job), shellQuote(gate), extra)
	if g.remote() {
		return fmt.Sprintf("Decide with %s and %s; a running engine goes on with the job", decide, g.serverFlag())
	}
	return fmt.Sprintf("Start `engine serve --data-dir %s%s` (or point NATS_URL at your server), then decide with %s; the engine goes on with the job",
		shellQuote(f.embedded.dataDir), serveFlags, decide)
}

// resolveHint tells how to settle an ambiguous effect after engine run
// stopped: engine effects resolve needs a server holding the job's data
// (the embedded one stops with this process), and an engine with workers
// that reach the same services to resume the job. bundled says whether the
// run started bundled demo services.
func resolveHint(g *globals, f *runFlags, key string, bundled bool) string {
	extra, serveFlags := hintFlags(g, f, bundled)
	resolve := fmt.Sprintf("`engine effects resolve %s%s --happened [--external-id ID] [--result FILE]` or `engine effects resolve %s%s --not-happened`",
		shellQuote(key), extra, shellQuote(key), extra)
	if g.remote() {
		return fmt.Sprintf("run %s with %s (the same server); a running engine resumes the job", resolve, g.serverFlag())
	}
	return fmt.Sprintf("start `engine serve --data-dir %s%s` (or point NATS_URL at your server), then run %s; the engine resumes the job",
		shellQuote(f.embedded.dataDir), serveFlags, resolve)
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@=,+") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// printEvent prints one history event as transition lines: step, attempt,
// status, duration. A completion, failure or unblock that dispatched the
// next attempt prints that dispatch on a line of its own.
func printEvent(w io.Writer, h schemas.HistoryEvent) {
	d := h.Data
	switch {
	case d.Tool != "" && d.Item == 0:
		d.Step = fmt.Sprintf("%s.%s(%s)", d.Step, d.Tool, d.Call) // an agent's tool call refused before dispatch
	case d.Tool != "":
		d.Step = fmt.Sprintf("%s.%s#%d", d.Step, d.Tool, d.Item) // an agent's tool call, counted over its run
	case d.Item > 0:
		d.Step = fmt.Sprintf("%s[%d]", d.Step, d.Item-1) // a map item, by index
	case d.Turn > 0:
		d.Step = fmt.Sprintf("%s turn %d", d.Step, d.Turn) // an agent's model turn
	}
	dispatched := func(step string, attempt int) {
		status := "dispatched"
		switch {
		case !d.NotBefore.IsZero() && (d.Status == string(schemas.StepRetrying) || d.Retrying || h.Type != schemas.EventStepDispatched):
			status = fmt.Sprintf("retrying at %s", d.NotBefore.Format("15:04:05.000"))
		case !d.NotBefore.IsZero():
			status = fmt.Sprintf("sleeping until %s", d.NotBefore.Format("15:04:05.000"))
		}
		fmt.Fprintf(w, "  %-20s attempt %-3d %s\n", step, attempt, status)
	}
	switch h.Type {
	case schemas.EventStepDispatched:
		dispatched(d.Step, d.Attempt)
	case schemas.EventStepCompleted:
		fmt.Fprintf(w, "  %-20s attempt %-3d completed  %dms\n", d.Step, d.Attempt, d.DurationMs)
	case schemas.EventStepFailed:
		what := "failed"
		if d.Retrying {
			what = "failed, will retry"
		}
		msg := ""
		if d.Error != nil {
			msg = ": " + oneLine(d.Error.Message, 200)
		}
		fmt.Fprintf(w, "  %-20s attempt %-3d %s  %dms%s\n", d.Step, d.Attempt, what, d.DurationMs, msg)
	case schemas.EventJobResumed:
		fmt.Fprintf(w, "  (resumed: %s)\n", d.Reason)
	case schemas.EventStepBlocked:
		fmt.Fprintf(w, "  %-20s attempt %-3d blocked: effect %s is ambiguous; the job needs reconciliation\n", d.Step, d.Attempt, d.EffectKey)
	case schemas.EventStepUnblocked:
		fmt.Fprintf(w, "  %-20s unblocked: effect %s resolved by %s\n", d.Step, d.EffectKey, d.By)
	case schemas.EventAgentTurn:
		u := schemas.TokenUsage{}
		if d.Usage != nil {
			u = *d.Usage
		}
		fmt.Fprintf(w, "  %-20s attempt %-3d answered %dms: %s, %d in / %d out / %d cache-read tokens; %s\n",
			d.Step, d.Attempt, d.DurationMs, d.Model, u.Input, u.Output, u.CacheRead, d.Reason)
	case schemas.EventStepCancelled:
		fmt.Fprintf(w, "  %-20s attempt %-3d cancelled: %s\n", d.Step, d.Attempt, d.Reason)
	case schemas.EventStepWaiting:
		fmt.Fprintf(w, "  %-20s attempt %-3d waiting: %s\n", d.Step, d.Attempt, d.Reason)
	case schemas.EventStepAdmitted:
		what := ""
		if f := d.Flow; f != nil {
			what = ": " + f.Kind + " limit " + f.Limit
			if f.Key != "" {
				what += fmt.Sprintf(" for key %q", f.Key)
			}
			what += fmt.Sprintf(", %d of %d", f.InUse, f.Max)
			if f.Kind == schemas.FlowRate && f.Until != nil {
				what += " in the window from " + f.Since.UTC().Format(time.RFC3339)
			}
		}
		fmt.Fprintf(w, "  %-20s attempt %-3d admitted%s\n", d.Step, d.Attempt, what)
	case schemas.EventEffectConfirmed, schemas.EventEffectAmbiguous, schemas.EventEffectReconciled, schemas.EventEffectReplayed:
		ext := ""
		if d.ExternalID != "" {
			ext = " (" + d.ExternalID + ")"
		}
		step := d.Step
		if i := strings.LastIndex(d.EffectKey, "/"+d.Step+"/"); i >= 0 && !strings.HasPrefix(d.EffectKey[i+len(d.Step)+2:], "run-") {
			step += "[" + d.EffectKey[i+len(d.Step)+2:] + "]" // a map item, by name
		}
		fmt.Fprintf(w, "  %-20s attempt %-3d effect %s%s\n", step, d.Attempt, strings.TrimPrefix(h.Type, "dev.waymark.effect."), ext)
	case schemas.EventJobCancelled:
		fmt.Fprintf(w, "  job cancelled: %s\n", oneLine(d.Reason, 300))
	case schemas.EventApprovalRequested:
		if a := d.Approval; a != nil {
			fmt.Fprintf(w, "  %-20s waiting for approval: %s\n", d.Step, oneLine(a.Action, 200))
		}
	case schemas.EventApprovalDecided:
		what := d.Status
		if d.By != "" {
			what += " by " + d.By
		}
		if d.Reason != "" {
			what += ": " + oneLine(d.Reason, 200)
		}
		fmt.Fprintf(w, "  %-20s %s\n", d.Step, what)
	case schemas.EventJobPaused:
		fmt.Fprintf(w, "  job paused by %s%s\n", d.By, reasonSuffix(d.Reason))
	case schemas.EventJobUnpaused:
		fmt.Fprintf(w, "  job resumed by %s%s\n", d.By, reasonSuffix(d.Reason))
	case schemas.EventJobRetried:
		fmt.Fprintf(w, "  job retried from %s by %s%s\n", d.Step, d.By, reasonSuffix(d.Reason))
	case schemas.EventJobRewound:
		fmt.Fprintf(w, "  job rewound to seq %d, going on from %s, by %s%s\n", d.ToSeq, d.Step, d.By, reasonSuffix(d.Reason))
	case schemas.EventSignalReceived:
		if sg := d.Signal; sg != nil {
			fmt.Fprintf(w, "  signal %s (id %s) from %s%s\n", sg.Name, sg.ID, sg.By, reasonSuffix(d.Reason))
		}
	case schemas.EventJobFailed:
		msg := ""
		if d.Error != nil {
			msg = ": " + oneLine(d.Error.Error(), 300)
		}
		fmt.Fprintf(w, "  job failed%s\n", msg)
	}
	if d.Next != "" && d.NextAttempt > 0 && h.Type != schemas.EventStepDispatched {
		dispatched(d.Next, d.NextAttempt)
	}
}

// reasonSuffix is ": reason" on one line, or "" when there is none.
func reasonSuffix(reason string) string {
	if reason == "" {
		return ""
	}
	return ": " + oneLine(reason, 300)
}

func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > n {
		s = s[:n] + "…"
	}
	return s
}
