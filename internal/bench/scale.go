package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// ScaleConfig says what RunScale measures.
type ScaleConfig struct {
	// Jobs are the numbers of jobs in flight at which the engine's memory
	// is read, ascending; the last is also the restart's. Default 100, 10000.
	Jobs []int `json:"jobs"`
	// Binary is the engine binary run as the engine process (engine serve
	// --workers 0); default this process's executable.
	Binary string `json:"-"`
	// Settle is how long the jobs are held before memory is read, so that
	// reconcile passes over them count. Default 3s.
	Settle time.Duration `json:"settle_ns"`
	// Finished is how many finished jobs are stored (checkpoint and job
	// index entry, written directly) before anything runs: what an engine
	// must not pay for. Default 0.
	Finished int `json:"finished"`
	// Idle is how long the idle engine's CPU is measured, with only the
	// finished jobs stored. Default 10s (with Finished > 0).
	Idle time.Duration `json:"idle_ns"`
	// Waiting is what the jobs wait on: "slow" (default: a step no worker
	// serves; the restart is measured too), "approval" (an approval gate
	// with a 24h expiry timer) or "sleep" (a 1h sleep step's timer).
	Waiting string       `json:"waiting,omitempty"`
	Dir     string       `json:"-"` // server files; default a temporary directory
	Logger  *slog.Logger `json:"-"`
}

// ScalePoint is the engine process's memory with Jobs jobs in flight, each
// dispatched to a pool no worker serves yet (a slow step).
type ScalePoint struct {
	Jobs      int    `json:"jobs"`
	RSS       uint64 `json:"engine_rss_bytes"`
	HeapInuse uint64 `json:"engine_heap_inuse_bytes"` // go_memstats_heap_inuse_bytes, after the engine's own GC cycles
}

// ScaleResult is what RunScale measured.
type ScaleResult struct {
	Config ScaleConfig  `json:"config"`
	Points []ScalePoint `json:"points"`
	// Restart: the engine process was killed (SIGKILL) with RestartJobs in
	// flight, a worker then finished every job's slow step, and a new
	// engine process started. FirstProgressMs runs from its exec to the
	// first checkpoint it wrote; DrainMs to the last job completed.
	RestartJobs     int     `json:"restart_jobs"`
	FirstProgressMs float64 `json:"first_progress_ms"`
	DrainMs         float64 `json:"drain_ms"`
	// With Finished jobs stored and none running: the engine process's CPU
	// over Idle, in percent of one core; and the p50 (over 20 tries) of
	// listing running jobs through the client (what engine list --status
	// running does) and of the first page of GET /v1/jobs.
	FinishedJobs     int     `json:"finished_jobs"`
	IdleCPUPercent   float64 `json:"idle_cpu_percent"`
	ListRunningP50Ms float64 `json:"list_running_p50_ms"`
	FirstPageP50Ms   float64 `json:"first_page_p50_ms"`
}

// waitingWorkflows are the workflows of ScaleConfig.Waiting other than
// "slow": their jobs wait on a durable timer (an approval's expiry, a
// sleep), with nothing dispatched to a worker.
var waitingWorkflows = map[string]string{
	"approval": "name: scale-approval\nversion: 1\nsteps:\n  - {id: gate, kind: approval, with: {action: go on, expires_in: 24h}, next: [{to: done}]}\n  - {id: done, kind: noop}\n",
	"sleep":    "name: scale-sleep\nversion: 1\nsteps:\n  - {id: nap, kind: sleep, with: {for: 1h}, next: [{to: done}]}\n  - {id: done, kind: noop}\n",
}

const scaleWorkflow = `name: scale
version: 1
steps:
  - id: slow
    kind: noop
    pool: slow
    next: [{to: done}]
  - id: done
    kind: noop
`

// RunScale measures what jobs in flight cost the engine: its memory with
// each of cfg.Jobs waiting on a slow step, and how soon a new engine makes
// progress after the old one was killed with the last count in flight.
// The engine runs as a separate process (cfg.Binary serve) against an
// embedded server in this process, so that its memory is its own. Linux
// only: memory is read from /proc.
func RunScale(ctx context.Context, cfg ScaleConfig) (*ScaleResult, error) {
	if runtime.GOOS != "linux" {
		return nil, errors.New("bench scale: reads process memory from /proc; Linux only")
	}
	if len(cfg.Jobs) == 0 {
		cfg.Jobs = []int{100, 10000}
	}
	for i, n := range cfg.Jobs {
		if n < 1 || (i > 0 && n <= cfg.Jobs[i-1]) {
			return nil, fmt.Errorf("bench scale: jobs %v: want ascending counts of at least 1", cfg.Jobs)
		}
	}
	if cfg.Binary == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("bench scale: find the engine binary: %w", err)
		}
		cfg.Binary = exe
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Settle == 0 {
		cfg.Settle = 3 * time.Second
	}
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "waymark-bench-scale-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	srv, err := natsserver.Start(natsserver.Config{DataDir: dir, Sync: natsserver.SyncInterval, Listen: "127.0.0.1:0"})
	if err != nil {
		return nil, err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		srv.Stop(sctx)
		cancel()
	}()
	nc, js, err := srv.JetStream("bench-scale")
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	store, err := kv.Open(ctx, js, kv.Config{}, cfg.Logger)
	if err != nil {
		return nil, err
	}
	wf := scaleWorkflow
	switch cfg.Waiting {
	case "", "slow":
	case "approval", "sleep":
		wf = waitingWorkflows[cfg.Waiting]
	default:
		return nil, fmt.Errorf("bench scale: waiting %q: want slow, approval or sleep", cfg.Waiting)
	}
	def, err := schemas.Parse("scale.yaml", []byte(wf), schemas.LoadOptions{
		Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().Check(&steps.Env{})}})
	if err != nil {
		return nil, err
	}
	cl := client.New(store)
	res := &ScaleResult{Config: cfg}
	if err := storeFinished(ctx, store, def, cfg.Finished); err != nil {
		return nil, err
	}
	res.FinishedJobs = cfg.Finished

	eng, err := startEngineProcess(ctx, cfg.Binary, srv.ClientURL())
	if err != nil {
		return nil, err
	}
	defer eng.kill()
	if cfg.Finished > 0 {
		if err := measureIdle(ctx, cfg, eng, cl, res); err != nil {
			return nil, err
		}
	}

	started := 0
	for _, n := range cfg.Jobs {
		if err := startScaleJobs(ctx, cl, def, started, n); err != nil {
			return nil, err
		}
		started = n
		if err := waitFor(ctx, 5*time.Minute, func() (bool, error) {
			if wf != scaleWorkflow {
				// Each job's timer is set once its gate or sleep is written.
				q, err := subjectCount(ctx, store, store.Names.TimerStream, store.Names.TimerPrefix+"set.*.*")
				return q >= uint64(n), err
			}
			q, err := subjectCount(ctx, store, store.Names.WorkStream, store.Names.WorkSubject("slow", "*"))
			return q >= uint64(n), err
		}); err != nil {
			return nil, fmt.Errorf("bench scale: waiting for %d jobs to be dispatched: %w", n, err)
		}
		// Let a reconcile pass or two run over the jobs in flight: their
		// cost is part of holding them.
		select {
		case <-time.After(cfg.Settle):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		p := ScalePoint{Jobs: n, RSS: procMemory(strconv.Itoa(eng.cmd.Process.Pid), "VmRSS")}
		p.HeapInuse, _ = eng.metric(ctx, "go_memstats_heap_inuse_bytes")
		res.Points = append(res.Points, p)
	}

	if wf != scaleWorkflow {
		return res, nil // timers of an hour and more: no restart to time
	}
	// Restart: kill the engine, let a worker finish every slow step (the
	// results wait in the inbox), start a new engine and time it.
	eng.kill()
	res.RestartJobs = started
	wctx, stopWorkers := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stopWorkers(); wg.Wait() }()
	for _, pool := range []string{"slow", schemas.DefaultPool} {
		w, err := steps.NewWorker(steps.WorkerConfig{Store: store, Env: &steps.Env{}, Pool: pool, Concurrency: 256, Logger: cfg.Logger})
		if err != nil {
			return nil, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = w.Run(wctx)
		}()
	}
	if err := waitFor(ctx, 5*time.Minute, func() (bool, error) {
		q, err := subjectCount(ctx, store, store.Names.InboxStream, store.Names.InboxPrefix+"result.*")
		return q >= uint64(started), err
	}); err != nil {
		return nil, fmt.Errorf("bench scale: waiting for the slow steps' results: %w", err)
	}
	watch, err := store.JS.KeyValue(ctx, store.Names.CheckpointBucket)
	if err != nil {
		return nil, err
	}
	w, err := watch.WatchAll(ctx, jetstream.UpdatesOnly())
	if err != nil {
		return nil, err
	}
	defer func() { _ = w.Stop() }()
	began := time.Now()
	eng2, err := startEngineProcess(ctx, cfg.Binary, srv.ClientURL())
	if err != nil {
		return nil, err
	}
	defer eng2.kill()
	completed := map[string]bool{}
	deadline := time.After(10 * time.Minute)
	for len(completed) < started {
		select {
		case e := <-w.Updates():
			if e == nil {
				continue
			}
			if res.FirstProgressMs == 0 {
				res.FirstProgressMs = float64(time.Since(began).Microseconds()) / 1000
			}
			cp, err := kv.DecodeCheckpoint(e.Key(), e.Value())
			if err == nil && cp.Status == schemas.JobCompleted {
				completed[e.Key()] = true
			}
		case <-deadline:
			return nil, fmt.Errorf("bench scale: %d of %d jobs completed after the restart", len(completed), started)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	res.DrainMs = float64(time.Since(began).Microseconds()) / 1000
	return res, nil
}

// storeFinished writes n finished jobs of def: a completed checkpoint and
// its ended index entry each, as an engine leaves them, from 64 goroutines.
func storeFinished(ctx context.Context, store *kv.Store, def *schemas.Definition, n int) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	now := time.Now().UTC()
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				req := &schemas.StartRequest{JobID: "done-" + strconv.FormatInt(i, 10)}
				cp := schemas.NewPendingCheckpoint(def, req, []byte(`{}`), "bench", now)
				cp.Status, cp.Seq = schemas.JobCompleted, 4
				cp.Completed = "0-1"
				done := now
				cp.CompletedAt = &done
				if _, err := store.Checkpoints.Create(ctx, cp); err != nil {
					errs <- err
					return
				}
				if err := store.Jobs.End(ctx, cp, 0); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// measureIdle measures the engine process with only finished jobs stored:
// its CPU over cfg.Idle after a settling pass, and the latency of the two
// listings people start with.
func measureIdle(ctx context.Context, cfg ScaleConfig, eng *engineProcess, cl *client.Client, res *ScaleResult) error {
	idle := cfg.Idle
	if idle <= 0 {
		idle = 10 * time.Second
	}
	select {
	case <-time.After(cfg.Settle):
	case <-ctx.Done():
		return ctx.Err()
	}
	pid := eng.cmd.Process.Pid
	before, err := procCPU(pid)
	if err != nil {
		return err
	}
	began := time.Now()
	select {
	case <-time.After(idle):
	case <-ctx.Done():
		return ctx.Err()
	}
	after, err := procCPU(pid)
	if err != nil {
		return err
	}
	res.IdleCPUPercent = 100 * (after - before).Seconds() / time.Since(began).Seconds()
	p50 := func(f func() error) (float64, error) {
		var ms []float64
		for range 20 {
			t0 := time.Now()
			if err := f(); err != nil {
				return 0, err
			}
			ms = append(ms, float64(time.Since(t0).Microseconds())/1000)
		}
		slices.Sort(ms)
		return ms[len(ms)/2], nil
	}
	if res.ListRunningP50Ms, err = p50(func() error {
		_, err := cl.List(ctx, client.ListFilter{Status: schemas.JobRunning})
		return err
	}); err != nil {
		return err
	}
	res.FirstPageP50Ms, err = p50(func() error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+eng.http+"/v1/jobs", nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET /v1/jobs: %s", resp.Status)
		}
		return nil
	})
	return err
}

// procCPU is the user and system CPU time the process has used.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name may hold spaces: fields count from its closing ')'.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: utime %q stime %q", pid, f[11], f[12])
	}
	const hz = 100 // USER_HZ on Linux
	return time.Duration(ut+st) * time.Second / hz, nil
}

// startScaleJobs starts jobs scale-<from>..scale-<to-1> from 32 goroutines.
func startScaleJobs(ctx context.Context, cl *client.Client, def *schemas.Definition, from, to int) error {
	var next atomic.Int64
	next.Store(int64(from))
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(to) {
					return
				}
				if _, err := cl.Start(ctx, def, nil, client.StartOptions{JobID: "scale-" + strconv.FormatInt(i, 10)}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// subjectCount counts the messages of stream on subjects matching filter.
func subjectCount(ctx context.Context, store *kv.Store, stream, filter string) (uint64, error) {
	st, err := store.JS.Stream(ctx, stream)
	if err != nil {
		return 0, err
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n, nil
}

// waitFor polls cond every 100 ms until it holds, fails, or timeout.
func waitFor(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not done after %v", timeout)
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// engineProcess is an engine serve process with its HTTP address.
type engineProcess struct {
	cmd  *exec.Cmd
	http string
	once sync.Once
}

func startEngineProcess(ctx context.Context, bin, natsURL string) (*engineProcess, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	cmd := exec.Command(bin, "serve", "--nats-url", natsURL, "--workers", "0", "--http", addr, "--log-level", "error")
	cmd.Env = os.Environ()
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench scale: start %s serve: %w", bin, err)
	}
	p := &engineProcess{cmd: cmd, http: addr}
	// serve prints its addresses once it runs; drain the rest.
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(out)
		signalled := false
		for sc.Scan() {
			if !signalled && strings.HasPrefix(sc.Text(), "http:") {
				close(ready)
				signalled = true
			}
		}
		if !signalled {
			close(ready)
		}
	}()
	select {
	case <-ready:
	case <-time.After(30 * time.Second):
		p.kill()
		return nil, errors.New("bench scale: the engine process did not start within 30s")
	case <-ctx.Done():
		p.kill()
		return nil, ctx.Err()
	}
	return p, nil
}

func (p *engineProcess) kill() {
	p.once.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		_ = p.cmd.Wait()
	})
}

// metric reads one unlabelled gauge from the process's /metrics.
func (p *engineProcess) metric(ctx context.Context, name string) (uint64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.http+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return uint64(f), err
		}
	}
	return 0, fmt.Errorf("metric %s not served", name)
}
