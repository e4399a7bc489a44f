// Package crashtest runs a workflow once per failpoint and step, crashing
// a real engine or worker process there, resuming it, and reporting what
// the crash did: the job's final status, its resume count, the steps run
// again, the effect ledger by state, and, where the step talks to a
// bundled test provider, how many calls and effects each idempotency key
// got. It backs `engine crashtest` and the crash-matrix test.
//
// One case, with its own NATS server (in this process, file storage) and
// its own bundled providers:
//
//	start engine and worker processes, one with WAYMARK_FAILPOINTS=<point>=crash/<step>
//	start the job ─► the process SIGKILLs itself at the point
//	start that process again, without the failpoint ─► wait until the job stops
//	read the job, the ledger, the history and the providers' counters
//
// Parallel and map steps: a parallel step is performed by its branches,
// each a step with cases of its own (the parallel step itself has none);
// the engine dispatches the branches in one transition, so its
// dispatch-side points name the first branch (Point.Target). A map step's
// cases crash at the first item the point is reached for, with the other
// items in flight; each item's effect is counted under its own key,
// <job>/<step>/<item name>. Point.Problems says which promises a case
// broke.
package crashtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// Config says what to crash.
type Config struct {
	// Binary is the engine binary the cases run (its serve and worker
	// commands). Required.
	Binary string
	// Workflow and Input are the files to run. Required.
	Workflow, Input string
	// Points are the failpoints to crash at, and the outcome cases
	// (SlowProvider, DeadLetter); empty means every one.
	Points []string
	// Steps are the steps to crash in; empty means every step.
	Steps []string
	// Parallel is how many cases run at once. Default 2.
	Parallel int
	// Timeout bounds one case. Default 90s.
	Timeout time.Duration
	// Dir holds the cases' files; default a temporary directory, removed.
	Dir string
	// Services maps service names the workflow uses to URLs, for services
	// that are not bundled (calls to them are not counted).
	Services map[string]string
	// Children are workflow files the workflow's workflow steps start as
	// child jobs; each case stores them before it starts the job.
	Children []string
	// Logger receives progress; nil discards it.
	Logger *slog.Logger
}

// Point is the outcome of one case.
type Point struct {
	Failpoint        string         `json:"failpoint"`
	Step             string         `json:"step"`
	Target           string         `json:"target,omitempty"` // the step the failpoint names, when not Step (see failpointTarget)
	EffectClass      string         `json:"effect_class"`
	Reached          bool           `json:"reached"` // the process crashed at the point
	FinalStatus      string         `json:"final_status"`
	Reason           string         `json:"reason,omitempty"` // why a job that did not complete stopped: its error, or what it waits on
	ResumeCount      int            `json:"resume_count"`
	StepsRerun       int            `json:"steps_rerun"`       // dispatches beyond the first, over all steps
	CallsRepeated    int            `json:"calls_repeated"`    // provider calls beyond the first per key (retries with the same key)
	MaxCallsPerKey   int            `json:"max_calls_per_key"` // at the bundled providers (retries with a key count)
	MaxEffectsPerKey int            `json:"max_effects_per_key"`
	Ledger           map[string]int `json:"ledger"` // effect records by state
	Calls            map[string]int `json:"calls,omitempty"`
	Effects          map[string]int `json:"effects,omitempty"`
	History          []string       `json:"history,omitempty"`       // event types, in order
	HistorySteps     []string       `json:"history_steps,omitempty"` // the step of each History event ("" for job events)
	Error            string         `json:"error,omitempty"`
	Seconds          float64        `json:"seconds"`
}

// Outcome cases: not a crash at a failpoint, but an outcome a provider or
// a pool can leave a step with, run for each step like the failpoints.
const (
	// SlowProvider: the step's provider answers every call that performs
	// its effect 3 s late, past the step's timeout (cut to 1 s for the
	// case, with 2 attempts), so no attempt ever hears the outcome.
	SlowProvider = "slow-provider"
	// DeadLetter: the worker dies right after every call of the step
	// (worker.after_remote_commit), so the step message reaches the pool's
	// last delivery (3 for the case) and becomes a dead letter.
	DeadLetter = "dead-letter"
)

// Failpoints lists the failpoints a job's steps pass, the crash cases:
// every known point but the CloudEvents intake's (crashtest starts its
// jobs itself).
func Failpoints() []string {
	var points []string
	for _, p := range failpoint.Known {
		if !strings.HasPrefix(p, "trigger.") {
			points = append(points, p)
		}
	}
	return points
}

// Cases lists every case: the failpoints, then the outcome cases.
func Cases() []string {
	return append(Failpoints(), SlowProvider, DeadLetter)
}

// Report is every case's outcome, in failpoint then step order.
type Report struct {
	Points []Point `json:"points"`
}

// Run runs every case and returns the report. A case that could not be
// run is reported with its Error; Run fails only on bad configuration.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if cfg.Binary == "" || cfg.Workflow == "" {
		return nil, errors.New("crashtest: a binary and a workflow are required")
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = 2
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 90 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	env := &steps.Env{ModelMode: steps.ModelReplay, Services: map[string]string{}}
	for k, v := range cfg.Services {
		env.Services[k] = v
	}
	for _, n := range demo.Names() {
		if _, ok := env.Services[n]; !ok {
			env.Services[n] = "http://placeholder.invalid"
		}
	}
	// Parallel steps are the engine's, not a worker kind: allowed here so
	// that the registry's check does not refuse them as unknown.
	def, err := schemas.Load(cfg.Workflow, schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().Check(env, schemas.KindParallel)}})
	if err != nil {
		return nil, err
	}
	var children []*schemas.Definition
	for _, path := range cfg.Children {
		cd, err := schemas.Load(path, schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().Check(env, schemas.KindParallel)}})
		if err != nil {
			return nil, err
		}
		children = append(children, cd)
	}
	input := json.RawMessage("{}")
	if cfg.Input != "" {
		if input, err = os.ReadFile(cfg.Input); err != nil {
			return nil, fmt.Errorf("crashtest: read input: %w", err)
		}
	}
	if err := client.CheckInput(def, input); err != nil {
		return nil, fmt.Errorf("crashtest: input %s: %w", cfg.Input, err)
	}
	points := cfg.Points
	if len(points) == 0 {
		points = Cases()
	}
	for _, p := range points {
		if !known(p) {
			return nil, fmt.Errorf("crashtest: unknown failpoint or case %q; known: %s", p, strings.Join(Cases(), ", "))
		}
	}
	stepIDs, err := caseSteps(def, cfg.Steps)
	if err != nil {
		return nil, err
	}
	dir := cfg.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "waymark-crashtest-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
	}
	var cases []Point
	for _, p := range points {
		for _, s := range stepIDs {
			step, tool := splitTool(def, s)
			switch {
			case tool == nil && step.Kind == schemas.KindAgent && (p == SlowProvider || p == DeadLetter):
				// An agent's own dispatches are model turns: no provider of
				// the workflow's to slow down, no call of its own to die
				// after. Its tools get these cases.
			case tool == nil:
				cases = append(cases, Point{Failpoint: p, Step: s, EffectClass: string(def.EffectOf(step))})
			case p == DeadLetter && def.ToolEffectOf(step, tool) == schemas.EffectPure:
				// A pure tool has no call to die after (the point is the
				// ledger's): no dead-letter case.
			case strings.HasPrefix(p, "worker.") || p == DeadLetter:
				// A tool call is a worker's: the engine's points name the step.
				cases = append(cases, Point{Failpoint: p, Step: s, EffectClass: string(def.ToolEffectOf(step, tool))})
			}
		}
	}
	if len(cases) == 0 {
		return nil, fmt.Errorf("crashtest: no case for points %s and steps %s: an agent's tools take the worker's points and dead-letter only, an agent's turns neither slow-provider nor dead-letter",
			strings.Join(points, ", "), strings.Join(stepIDs, ", "))
	}
	sem := make(chan struct{}, cfg.Parallel)
	var wg sync.WaitGroup
	for i := range cases {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer func() { <-sem; wg.Done() }()
			c := &cases[i]
			start := time.Now()
			cctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
			defer cancel()
			if err := runCase(cctx, cfg, def, children, input, filepath.Join(dir, fmt.Sprintf("case-%02d", i)), c); err != nil {
				c.Error = err.Error()
			}
			c.Seconds = time.Since(start).Seconds()
			cfg.Logger.Info("crash case done", "failpoint", c.Failpoint, "step", c.Step, "status", c.FinalStatus, "error", c.Error)
		}(i)
	}
	wg.Wait()
	return &Report{Points: cases}, nil
}

// caseSteps returns the steps to crash in: those named, else every step
// that is dispatched. A parallel step is not: its branches are, each a
// step of its own with its own cases. A map (for_each) step is, once per
// item; its cases crash at the first item the point is reached for, with
// the other items in flight.
func caseSteps(def *schemas.Definition, named []string) ([]string, error) {
	if len(named) == 0 {
		var out []string
		for _, s := range def.Steps {
			if s.Kind != schemas.KindParallel {
				out = append(out, s.ID)
			}
			for _, t := range s.Tools { // an agent's tool calls: "<step>.<tool>"
				out = append(out, s.ID+"."+t.Name)
			}
		}
		return out, nil
	}
	for _, id := range named {
		s, tool := splitTool(def, id)
		if tool != nil {
			continue
		}
		if s == nil {
			return nil, fmt.Errorf("crashtest: workflow %s has no step %q", def.Name, id)
		}
		if s.Kind == schemas.KindParallel {
			return nil, fmt.Errorf("crashtest: step %q is a parallel step, which no process performs: name its branches (%s)", id, strings.Join(s.Branches, ", "))
		}
	}
	return named, nil
}

// splitTool returns the step id names, or for "<step>.<tool>" the agent
// step and its tool; nil when there is none.
func splitTool(def *schemas.Definition, id string) (*schemas.Step, *schemas.Tool) {
	if s := def.Step(id); s != nil {
		return s, nil
	}
	step, name, ok := strings.Cut(id, ".")
	s := def.Step(step)
	if !ok || s == nil || s.ToolOf(name) == nil {
		return nil, nil
	}
	return s, s.ToolOf(name)
}

func known(p string) bool {
	for _, k := range Cases() {
		if k == p {
			return true
		}
	}
	return false
}

// Settings shared by every process of a case: short ack waits, so that a
// crash is noticed within a second.
var caseEnv = []string{
	"WAYMARK_INBOX_ACK_WAIT=1s",
	"WAYMARK_WORK_ACK_WAIT=1s",
	"WAYMARK_LOG_LEVEL=error",
	"WAYMARK_MODEL_MODE=replay",
}

var caseKV = kv.Config{InboxAckWait: time.Second, WorkAckWait: time.Second}

func runCase(ctx context.Context, cfg Config, def *schemas.Definition, children []*schemas.Definition, input json.RawMessage, dir string, c *Point) error {
	env := caseEnv
	var delayed string // the bundled provider that answers late
	switch c.Failpoint {
	case SlowProvider:
		var err error
		if def, err = withShortTimeout(def, c.Step); err != nil {
			return err
		}
		for _, name := range demo.Names() {
			if stepRefersTo(def.Step(c.Step), name) {
				delayed = name
			}
		}
	case DeadLetter:
		env = append(append([]string(nil), caseEnv...), "WAYMARK_WORK_MAX_DELIVER=3")
	}
	srv, err := natsserver.Start(natsserver.Config{DataDir: filepath.Join(dir, "nats"), Listen: "127.0.0.1:0", Sync: natsserver.SyncInterval})
	if err != nil {
		return err
	}
	defer srv.Stop(context.WithoutCancel(ctx))
	url := srv.ClientURL()
	services := map[string]string{}
	var running []*demo.Running
	defer func() {
		for _, r := range running {
			_ = r.Close()
		}
	}()
	for k, v := range cfg.Services {
		services[k] = v
	}
	for _, name := range demo.Names() {
		used := refersTo(def, name)
		for _, cd := range children {
			used = used || refersTo(cd, name)
		}
		if _, given := services[name]; given || !used {
			continue
		}
		opts := demo.Options{Dir: filepath.Join(dir, "demo", name)}
		if name == delayed {
			opts.Delay = 3 * time.Second
		}
		r, err := demo.Start(context.WithoutCancel(ctx), name, opts)
		if err != nil {
			return err
		}
		running = append(running, r)
		services[name] = r.URL
	}
	var serviceArgs []string
	for k, v := range services {
		serviceArgs = append(serviceArgs, "--service="+k+"="+v)
	}
	nc, js, err := srv.JetStream("crashtest")
	if err != nil {
		return err
	}
	defer nc.Close()
	store, err := kv.Open(ctx, js, caseKV, nil)
	if err != nil {
		return err
	}

	target := failpointTarget(def, c.Failpoint, c.Step)
	if target != c.Step {
		c.Target = target
	}
	fp := c.Failpoint + "=crash/" + target
	engineArgs := []string{"serve", "--nats-url=" + url, "--http=", "--workers=0"}
	workerArgs := append([]string{"worker", "--nats-url=" + url}, serviceArgs...)
	crashEngine := strings.HasPrefix(c.Failpoint, "engine.")
	switch c.Failpoint {
	case SlowProvider:
		fp = ""
	case DeadLetter:
		fp = failpoint.WorkerAfterRemoteCommit + "=crash/" + target // every delivery
	}
	eng := spawn(cfg.Binary, engineArgs, pick(crashEngine, fp), env)
	wrk := spawn(cfg.Binary, workerArgs, pick(!crashEngine, fp), env)
	defer eng.kill()
	defer func() { wrk.kill() }()
	victim, restart := wrk, func() *proc { return spawn(cfg.Binary, workerArgs, "", env) }
	if crashEngine {
		victim, restart = eng, func() *proc { return spawn(cfg.Binary, engineArgs, "", env) }
	}

	for _, cd := range children {
		if err := store.Definitions.Put(ctx, cd); err != nil {
			return fmt.Errorf("crashtest: store child workflow %s: %w", cd.Name, err)
		}
	}
	cl := client.New(store)
	const job = "crashtest"
	if _, err := cl.Start(ctx, def, input, client.StartOptions{JobID: job}); err != nil {
		return err
	}
	switch c.Failpoint {
	case SlowProvider:
		c.Reached = true
		return follow(ctx, cl, store, running, job, c)
	case DeadLetter:
		// The worker dies after each call; start it again, with the
		// failpoint, until the job stops.
		wctx, cancelWait := context.WithCancel(ctx)
		defer cancelWait()
		stopped := make(chan struct{})
		go func() {
			_, _ = cl.Wait(wctx, job, nil)
			close(stopped)
		}()
		for {
			select {
			case <-wrk.done:
				if wrk.killed() {
					c.Reached = true
				}
				wrk = spawn(cfg.Binary, workerArgs, fp, env)
				continue
			case <-stopped:
			case <-ctx.Done():
				return fmt.Errorf("waiting for the dead letter: %w", ctx.Err())
			}
			break
		}
		return follow(ctx, cl, store, running, job, c)
	}
	// Either the victim dies at its point, or the job stops without it.
	stopped := make(chan *client.JobView, 1)
	wctx, cancelWait := context.WithCancel(ctx)
	defer cancelWait()
	go func() {
		v, _ := cl.Wait(wctx, job, nil)
		stopped <- v
	}()
	var view *client.JobView
	select {
	case <-victim.done:
	case view = <-stopped:
		// The job may stop a moment before the victim dies (a crash after
		// the result was published): give it that moment.
		select {
		case <-victim.done:
		case <-time.After(time.Second):
		}
	case <-ctx.Done():
		return fmt.Errorf("waiting for the crash: %w", ctx.Err())
	}
	select {
	case <-victim.done:
		if !victim.killed() {
			return fmt.Errorf("the process at %s exited without crashing: %v\n%s", fp, victim.err, victim.stderr.String())
		}
		c.Reached = true
		next := restart()
		defer next.kill()
	default:
	}
	if view == nil {
		view = <-stopped
	}
	if view == nil {
		return fmt.Errorf("the job did not stop within the case's time: %w", ctx.Err())
	}
	return follow(ctx, cl, store, running, job, c)
}

// follow reads the outcome of a case whose job stopped: once the
// processes have finished what the crash left (a result or start
// delivered again), the job as it settled, its ledger, the providers'
// counters and the history.
func follow(ctx context.Context, cl *client.Client, store *kv.Store, running []*demo.Running, job string, c *Point) error {
	if _, err := cl.Wait(ctx, job, nil); err != nil {
		return fmt.Errorf("the job did not stop within the case's time: %w", err)
	}
	if err := drained(ctx, store); err != nil {
		return err
	}
	view, err := cl.Job(ctx, job)
	if err != nil {
		return err
	}
	c.FinalStatus = string(view.Status)
	switch {
	case view.Error != nil:
		c.Reason = view.Error.Message
	case view.Blocked != nil:
		c.Reason = fmt.Sprintf("effect %s of %s: %s", view.Blocked.EffectKey, view.Blocked.Step, view.Blocked.Reason)
	case view.BlockedReason != "":
		c.Reason = view.BlockedReason
	}
	c.ResumeCount = view.ResumeCount
	for _, s := range view.Steps {
		if s.Attempts > 1 && s.Kind != schemas.KindAgent {
			c.StepsRerun += s.Attempts - 1
		}
	}
	recs, err := cl.Effects(ctx, client.EffectFilter{Job: job})
	if err != nil {
		return err
	}
	c.Ledger = map[string]int{}
	for _, r := range recs {
		c.Ledger[string(r.State)]++
	}
	c.Calls, c.Effects = map[string]int{}, map[string]int{}
	for _, r := range running {
		st := r.Stats()
		for k, n := range st.Calls {
			c.Calls[k] += n
			c.MaxCallsPerKey = max(c.MaxCallsPerKey, c.Calls[k])
		}
		for _, n := range st.Calls {
			c.CallsRepeated += max(n-1, 0)
		}
		for k, n := range st.Effects {
			c.Effects[k] += n
			c.MaxEffectsPerKey = max(c.MaxEffectsPerKey, c.Effects[k])
		}
	}
	evs, err := cl.History(ctx, job)
	if err != nil {
		return err
	}
	// An agent's turns are attempts of its step by design: what was
	// dispatched again is a turn or a tool call dispatched more than once.
	dispatched := map[string]int{}
	for _, e := range evs {
		c.History = append(c.History, strings.TrimPrefix(e.Type, "dev.waymark."))
		c.HistorySteps = append(c.HistorySteps, e.Data.Step)
		if e.Type == schemas.EventStepDispatched && (e.Data.Turn > 0 || e.Data.Tool != "") {
			key := fmt.Sprintf("%s/t%d/i%d", e.Data.Step, e.Data.Turn, e.Data.Item)
			if e.Data.Tool != "" {
				key = fmt.Sprintf("%s/i%d", e.Data.Step, e.Data.Item)
			}
			if dispatched[key]++; dispatched[key] > 1 {
				c.StepsRerun++
			}
		}
	}
	return nil
}

// drained waits until the engines' inbox and every work consumer have
// nothing pending or unacknowledged.
func drained(ctx context.Context, store *kv.Store) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		busy := false
		for _, stream := range []string{store.Names.InboxStream, store.Names.WorkStream} {
			st, err := store.JS.Stream(ctx, stream)
			if err != nil {
				return err
			}
			lister := st.ListConsumers(ctx)
			for info := range lister.Info() {
				if info.NumPending > 0 || info.NumAckPending > 0 {
					busy = true
				}
			}
		}
		if !busy {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("messages still pending 15s after the job stopped")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// failpointTarget returns the step the case's failpoint names. The
// engine dispatches a parallel step's branches in one transition, and its
// dispatch-side points (before and after the checkpoint, after the
// dispatch) name the first step that transition sends: for a branch, its
// parallel step's first branch. (A branch dispatched alone, on a retry,
// would name itself, but a case's job retries nothing.)
func failpointTarget(def *schemas.Definition, point, step string) string {
	switch point {
	case failpoint.EngineBeforeCheckpoint, failpoint.EngineAfterCheckpoint, failpoint.EngineAfterDispatch:
	default:
		return step
	}
	for _, s := range def.Steps {
		if s.Kind == schemas.KindParallel && len(s.Branches) > 0 && contains(s.Branches, step) {
			return s.Branches[0]
		}
	}
	return step
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Problems returns what in p breaks the promises every case must keep:
// the case ran and crashed where it should (the slow provider crashes
// nothing), no effect was performed twice, and the job stopped: completed
// with every effect in its ledger confirmed, or failed, blocked, waiting
// for a person or quarantined with a recorded reason. Empty when p holds.
func (p *Point) Problems() []string {
	if p.Error != "" {
		return []string{"the case did not run to the end: " + p.Error}
	}
	var out []string
	if !p.Reached {
		out = append(out, "the process never crashed at the point")
	}
	if p.MaxEffectsPerKey > 1 {
		out = append(out, fmt.Sprintf("an effect was performed %d times: %v", p.MaxEffectsPerKey, p.Effects))
	}
	switch schemas.JobStatus(p.FinalStatus) {
	case schemas.JobCompleted:
		for st, n := range p.Ledger {
			if st != string(schemas.EffectConfirmed) && st != string(schemas.EffectReconciled) {
				out = append(out, fmt.Sprintf("the job completed with %d effect records %s", n, st))
			}
		}
	case schemas.JobFailed, schemas.JobCancelled, schemas.JobNeedsReconciliation, schemas.JobBlocked, schemas.JobQuarantined:
		if p.Reason == "" {
			out = append(out, fmt.Sprintf("the job stopped %s without a recorded reason", p.FinalStatus))
		}
	default:
		out = append(out, fmt.Sprintf("the job did not stop: final status %q", p.FinalStatus))
	}
	return out
}

func pick(ok bool, s string) string {
	if ok {
		return s
	}
	return ""
}

// refersTo reports whether def's steps name service name in a template.
func refersTo(def *schemas.Definition, name string) bool {
	for i := range def.Steps {
		if stepRefersTo(&def.Steps[i], name) {
			return true
		}
	}
	return false
}

// stepRefersTo reports whether step s (or one of its tools) names
// service name in a template.
func stepRefersTo(s *schemas.Step, name string) bool {
	withs := []json.RawMessage{s.With}
	for _, t := range s.Tools {
		withs = append(withs, t.With)
	}
	for _, with := range withs {
		w := string(with)
		if strings.Contains(w, `service \"`+name+`\"`) || strings.Contains(w, `service "`+name+`"`) {
			return true
		}
	}
	return false
}

// withShortTimeout returns def with step's timeout cut to 1s and its
// retries to 2 attempts (100 ms apart), for the slow-provider case: the
// definition is loaded again, so it is a definition of its own (its own
// hash).
func withShortTimeout(def *schemas.Definition, step string) (*schemas.Definition, error) {
	var doc map[string]any
	if err := json.Unmarshal(def.Canonical(), &doc); err != nil {
		return nil, fmt.Errorf("crashtest: %w", err)
	}
	steps, _ := doc["steps"].([]any)
	for _, s := range steps {
		if m, ok := s.(map[string]any); ok && m["id"] == step {
			m["timeout"] = "1s"
			m["retry"] = map[string]any{"max_attempts": 2, "backoff": map[string]any{"initial": "100ms", "max": "100ms"}}
		}
	}
	data, err := json.Marshal(doc)
	if err != nil {
		return nil, fmt.Errorf("crashtest: %w", err)
	}
	// The canonical form has its assets embedded: decoded, not parsed as a
	// file (which names assets by path).
	return schemas.DecodeDefinition(data)
}

// proc is a child process.
type proc struct {
	cmd    *exec.Cmd
	stderr *lockedBuffer
	done   chan struct{}
	err    error
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func spawn(bin string, args []string, failpoints string, env []string) *proc {
	p := &proc{cmd: exec.Command(bin, args...), stderr: &lockedBuffer{}, done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	if failpoints != "" {
		p.cmd.Env = append(p.cmd.Env, failpoint.EnvVar+"="+failpoints)
	}
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		p.err = err
		close(p.done)
		return p
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	return p
}

func (p *proc) killed() bool {
	var ee *exec.ExitError
	if !errors.As(p.err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

func (p *proc) kill() {
	if p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
	}
	<-p.done
}

// Sorted returns the report's points sorted by failpoint order, then by
// step order in the workflow.
func (r *Report) Sorted(def *schemas.Definition) []Point {
	order := map[string]int{}
	for i, k := range Cases() {
		order[k] = i
	}
	out := append([]Point(nil), r.Points...)
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Failpoint != out[j].Failpoint {
			return order[out[i].Failpoint] < order[out[j].Failpoint]
		}
		// A tool's cases follow its agent step's, in the order of its tools.
		si, ti := splitTool(def, out[i].Step)
		sj, tj := splitTool(def, out[j].Step)
		if si != sj {
			return def.StepIndex(si.ID) < def.StepIndex(sj.ID)
		}
		return toolIndex(si, ti) < toolIndex(sj, tj)
	})
	return out
}

// toolIndex is t's place among s's tools, -1 for none (the step itself).
func toolIndex(s *schemas.Step, t *schemas.Tool) int {
	for i := range s.Tools {
		if t != nil && s.Tools[i].Name == t.Name {
			return i
		}
	}
	return -1
}
