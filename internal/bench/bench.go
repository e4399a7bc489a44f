// Package bench measures what a step costs: Waymark's engine and worker
// against the floor, a bare JetStream loop doing the least our design
// needs per step (a checkpoint compare-and-swap, a dispatch publish with a
// dedup id, a pull and ack, a result publish, a consume and ack), with the
// same payload and concurrency, in the same process, on a fresh embedded
// server each. Jobs are chains of steps (ShapeChain), or one map step over
// many items (ShapeMap, measured against chain jobs of the same total
// steps), or one parallel step and a step after it (ShapeParallel).
package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Shapes of the bench's jobs (Config.Shape).
const (
	// ShapeChain: jobs of Config.Steps steps, one after the other.
	ShapeChain = "chain"
	// ShapeMap: jobs of one for_each step over Config.Items items, at most
	// Config.ItemConcurrency in flight per job; every item is a step. The
	// baseline is chain jobs of ten steps with the same total steps, run in
	// the same rounds (Result.Baseline).
	ShapeMap = "map"
	// ShapeParallel: jobs of one parallel step of Config.Branches branches
	// followed by one step; Branches+1 steps per job (the parallel step
	// itself is the engine's and is not counted).
	ShapeParallel = "parallel"
	// ShapeAgent: jobs of one agent step of Config.Turns model turns,
	// replayed from a cassette, each turn but the last calling one pure
	// no-op tool; 2*Turns-1 steps per job (turns and tool calls).
	ShapeAgent = "agent"
)

// Defaults and bounds of the map and parallel shapes.
const (
	DefaultItems           = 10000 // Config.Items of ShapeMap
	DefaultItemConcurrency = 100   // Config.ItemConcurrency of ShapeMap
	DefaultBranches        = 8     // Config.Branches of ShapeParallel
	DefaultTurns           = 20    // Config.Turns of ShapeAgent
	MaxTurns               = 200   // the most Config.Turns taken
	MaxBranches            = 64    // the most Config.Branches taken
	// BaselineSteps is the length of the chain jobs a map is compared with.
	BaselineSteps = 10
)

// Config says what to measure. Zero fields take the defaults stated.
type Config struct {
	Shape string `json:"shape"`           // chain (default), map or parallel
	Jobs  int    `json:"jobs"`            // jobs per round; default 100
	Steps int    `json:"steps,omitempty"` // steps per job of a chain; default 10 (chain only)
	// Items is the number of items of a map job (ShapeMap only; default
	// DefaultItems), ItemConcurrency its for_each.concurrency (default
	// DefaultItemConcurrency, at most schemas.MaxMapConcurrency).
	Items           int `json:"items,omitempty"`
	ItemConcurrency int `json:"item_concurrency,omitempty"`
	// Branches is the number of branches of a parallel job (ShapeParallel
	// only; default DefaultBranches, at most MaxBranches).
	Branches int `json:"branches,omitempty"`
	// Turns is the number of model turns of an agent job (ShapeAgent only;
	// default DefaultTurns, at most MaxTurns).
	Turns int `json:"turns,omitempty"`
	// StepConcurrency, when above 0, gives every step of a chain job a
	// concurrency limit of this many across all jobs (schemas.Concurrency,
	// no key): the cost of flow control. 0: no limit (chain only).
	StepConcurrency int `json:"step_concurrency,omitempty"`
	Concurrency     int `json:"concurrency"`   // jobs in flight; default Jobs
	Payload         int `json:"payload_bytes"` // state size in bytes; default 1024
	// StateValues splits the payload into that many state members of
	// Payload/StateValues bytes each (v1..vN); 0 or 1: one member. Members
	// over the value threshold (64 KiB) are kept by reference.
	StateValues int    `json:"state_values,omitempty"`
	Kind        string `json:"kind"` // noop (default), http (a local server) or model (replay)
	Workers     int    `json:"worker_concurrency"`
	Sync        string `json:"sync"`          // always or interval (default)
	Queues      string `json:"queue_storage"` // Waymark's work and inbox queues: file (default) or memory; the floor's stay on file
	Rounds      int    `json:"rounds"`        // rounds of each; medians are reported; default 1
	// HistoryBatch and CacheBytes are the engine's (engine.Config); zero
	// means its default, a negative CacheBytes no cache.
	HistoryBatch int `json:"history_batch,omitempty"`
	CacheBytes   int `json:"cache_bytes,omitempty"`
	// Lanes is engine.Config.Lanes; zero means its default.
	Lanes int `json:"lanes,omitempty"`
	// Cluster runs each round on a loopback cluster of that many nodes
	// (3 or 5), every stream and bucket replicated on all of them; 0 means
	// one embedded server. CPU is of this process, which runs every node.
	Cluster int `json:"cluster,omitempty"`
	// GroupCommit is kv.Config's: "on", "off", or "" for on under sync
	// always (as the CLI does for an embedded server).
	GroupCommit string       `json:"group_commit,omitempty"`
	Floor       bool         `json:"floor"`  // also measure the floor
	Engine      bool         `json:"engine"` // measure Waymark (default true via WithDefaults)
	Dir         string       `json:"-"`      // where servers keep files; default a temporary directory
	Logger      *slog.Logger `json:"-"`

	// Events runs the lifecycle events relay (notify.Relay, its default
	// types) beside the engine, as engine serve and engine run do unless
	// --events=false: its cost shows in Waymark's figures.
	Events bool `json:"events,omitempty"`
}

// WithDefaults fills zero fields.
func (c Config) WithDefaults() Config {
	if c.Shape == "" {
		c.Shape = ShapeChain
	}
	if c.Jobs == 0 {
		c.Jobs = 100
		if c.Shape == ShapeMap {
			c.Jobs = 1
		}
	}
	switch c.Shape {
	case ShapeChain:
		if c.Steps == 0 {
			c.Steps = 10
		}
	case ShapeMap:
		if c.Items == 0 {
			c.Items = DefaultItems
		}
		if c.ItemConcurrency == 0 {
			c.ItemConcurrency = DefaultItemConcurrency
		}
	case ShapeParallel:
		if c.Branches == 0 {
			c.Branches = DefaultBranches
		}
	case ShapeAgent:
		if c.Turns == 0 {
			c.Turns = DefaultTurns
		}
	}
	if c.Concurrency == 0 {
		c.Concurrency = c.Jobs
	}
	if c.Payload == 0 {
		c.Payload = 1024
	}
	if c.Kind == "" {
		c.Kind = "noop"
	}
	if c.Workers == 0 {
		c.Workers = 256
	}
	if c.Sync == "" {
		c.Sync = natsserver.SyncInterval
	}
	if c.Rounds == 0 {
		c.Rounds = 1
	}
	if c.Queues == "" {
		c.Queues = kv.QueueFile
	}
	return c
}

func (c Config) validate() error {
	if err := c.validateShape(); err != nil {
		return err
	}
	switch {
	case c.Jobs < 1 || c.Concurrency < 1 || c.Rounds < 1:
		return fmt.Errorf("bench: jobs, concurrency and rounds must be at least 1")
	case c.Concurrency > c.Jobs:
		return fmt.Errorf("bench: concurrency %d exceeds jobs %d", c.Concurrency, c.Jobs)
	case c.StateValues < 0 || c.StateValues > 256:
		return fmt.Errorf("bench: state values %d: want 0..256", c.StateValues)
	case c.StateValues <= 1 && (c.Payload < 0 || c.Payload > 512<<10):
		return fmt.Errorf("bench: payload %d bytes: want 0..524288 (or split it with state values)", c.Payload)
	case c.StateValues > 1 && (c.Payload > 16<<20 || c.Payload/c.StateValues > 512<<10):
		return fmt.Errorf("bench: payload %d bytes in %d values: want at most 16 MiB, 512 KiB a value", c.Payload, c.StateValues)
	case c.Kind != "noop" && c.Kind != "http" && c.Kind != "model":
		return fmt.Errorf("bench: kind %q: want noop, http or model", c.Kind)
	case c.Sync != natsserver.SyncAlways && c.Sync != natsserver.SyncInterval:
		return fmt.Errorf("bench: sync %q: want always or interval", c.Sync)
	case c.Queues != kv.QueueFile && c.Queues != kv.QueueMemory:
		return fmt.Errorf("bench: queue storage %q: want file or memory", c.Queues)
	case c.Cluster != 0 && c.Cluster != 3 && c.Cluster != 5:
		return fmt.Errorf("bench: cluster of %d nodes: want 3 or 5 (or 0)", c.Cluster)
	}
	return nil
}

func (c Config) validateShape() error {
	switch c.Shape {
	case ShapeChain:
		switch {
		case c.Steps < 1:
			return fmt.Errorf("bench: steps %d: want at least 1", c.Steps)
		case c.Items != 0 || c.ItemConcurrency != 0:
			return fmt.Errorf("bench: items and item concurrency are for the map shape, not chain")
		case c.Branches != 0:
			return fmt.Errorf("bench: branches are for the parallel shape, not chain")
		}
		return nil
	case ShapeMap, ShapeParallel, ShapeAgent:
	default:
		return fmt.Errorf("bench: shape %q: want chain, map, parallel or agent", c.Shape)
	}
	if c.Turns != 0 && c.Shape != ShapeAgent {
		return fmt.Errorf("bench: turns are for the agent shape, not %s", c.Shape)
	}
	switch {
	case c.Steps != 0:
		return fmt.Errorf("bench: steps are for the chain shape; a %s job's steps follow from its shape", c.Shape)
	case c.Kind != "noop":
		return fmt.Errorf("bench: kind %q: the %s shape runs noop steps only", c.Kind, c.Shape)
	case c.Floor:
		return fmt.Errorf("bench: the floor is measured for the chain shape only, not %s", c.Shape)
	case !c.Engine:
		return fmt.Errorf("bench: the %s shape measures Waymark: Engine must be set", c.Shape)
	}
	if c.Shape == ShapeAgent {
		switch {
		case c.Turns < 1 || c.Turns > MaxTurns:
			return fmt.Errorf("bench: turns %d: want 1..%d", c.Turns, MaxTurns)
		case c.Items != 0 || c.ItemConcurrency != 0 || c.Branches != 0:
			return fmt.Errorf("bench: items, item concurrency and branches are not for the agent shape")
		}
		return nil
	}
	if c.Shape == ShapeMap {
		switch {
		case c.Items < 1 || c.Items > schemas.DefaultMaxItems:
			return fmt.Errorf("bench: items %d: want 1..%d", c.Items, schemas.DefaultMaxItems)
		case c.ItemConcurrency < 1 || c.ItemConcurrency > schemas.MaxMapConcurrency:
			return fmt.Errorf("bench: item concurrency %d: want 1..%d", c.ItemConcurrency, schemas.MaxMapConcurrency)
		case c.Branches != 0:
			return fmt.Errorf("bench: branches are for the parallel shape, not map")
		}
		return nil
	}
	switch {
	case c.Branches < 1 || c.Branches > MaxBranches:
		return fmt.Errorf("bench: branches %d: want 1..%d", c.Branches, MaxBranches)
	case c.Items != 0 || c.ItemConcurrency != 0:
		return fmt.Errorf("bench: items and item concurrency are for the map shape, not parallel")
	}
	return nil
}

// baseline is the chain run a map is compared with: ten-step no-op jobs
// with the map's total steps (rounded up to whole jobs), as many steps in
// flight as the map has items in flight (or all the jobs, if fewer).
func (c Config) baseline() Config {
	b := c
	b.Shape, b.Items, b.ItemConcurrency, b.Branches = ShapeChain, 0, 0, 0
	b.Steps = BaselineSteps
	b.Jobs = (c.Jobs*c.Items + BaselineSteps - 1) / BaselineSteps
	b.Concurrency = min(b.Jobs, c.Concurrency*c.ItemConcurrency)
	b.Floor, b.Engine = false, true
	return b
}

// stepsPerJob is how many steps a job of c's shape counts.
func (c Config) stepsPerJob() int {
	switch c.Shape {
	case ShapeMap:
		return c.Items
	case ShapeParallel:
		return c.Branches + 1
	case ShapeAgent:
		return 2*c.Turns - 1
	}
	return c.Steps
}

// Sample is one round's measurements of one system.
type Sample struct {
	// Steps are those completed: for a chain jobs x steps; for a map or
	// parallel shape counted from the outputs in the jobs' final states.
	Steps         int             `json:"steps"`
	Jobs          int             `json:"jobs_completed"`
	Elapsed       time.Duration   `json:"elapsed_ns"`
	CPU           time.Duration   `json:"cpu_ns"` // user + system, whole process
	StepLatency   []time.Duration `json:"-"`      // per step: from the previous step's completion (or the job's start) to this one's
	JobLatency    []time.Duration `json:"-"`
	Writes        uint64          `json:"js_writes"`     // messages stored in any stream (KV included)
	Ops           uint64          `json:"js_ops"`        // client messages into the server: publishes, KV writes, acks, pulls, API calls
	BytesWritten  uint64          `json:"bytes_written"` // to storage, by this process
	PeakRSS       uint64          `json:"peak_rss_bytes"`
	PeakHeap      uint64          `json:"peak_heap_bytes"`
	Checkpoint    int64           `json:"checkpoint_bytes"`     // largest final checkpoint of a job
	MaxCheckpoint int64           `json:"max_checkpoint_bytes"` // largest checkpoint written at any time (Waymark only)
	Commits       uint64          `json:"group_commits"`        // atomic batches of checkpoints (kv.Config.GroupCommit)
	Committed     uint64          `json:"group_committed"`      // checkpoint writes they carried
	Replicas      int             `json:"replicas"`             // of Waymark's streams, as the server reports them
}

// Result is what Run reports: medians over the rounds.
type Result struct {
	Config Config `json:"config"`

	StepsPerS      float64 `json:"steps_per_s"`
	FloorStepsPerS float64 `json:"floor_steps_per_s"`

	StepP50Ms      float64 `json:"step_p50_ms"`
	StepP90Ms      float64 `json:"step_p90_ms"`
	StepP99Ms      float64 `json:"step_p99_ms"`
	StepMaxMs      float64 `json:"step_max_ms"`
	FloorStepP50Ms float64 `json:"floor_step_p50_ms"`
	FloorStepP90Ms float64 `json:"floor_step_p90_ms"`
	FloorStepP99Ms float64 `json:"floor_step_p99_ms"`
	FloorStepMaxMs float64 `json:"floor_step_max_ms"`
	JobP50Ms       float64 `json:"job_p50_ms"`
	JobP99Ms       float64 `json:"job_p99_ms"`
	FloorJobP50Ms  float64 `json:"floor_job_p50_ms"`
	FloorJobP99Ms  float64 `json:"floor_job_p99_ms"`

	CPUUsPerStep      float64 `json:"cpu_us_per_step"`
	FloorCPUUsPerStep float64 `json:"floor_cpu_us_per_step"`

	JSOpsPerStep             float64 `json:"js_ops_per_step"`
	FloorJSOpsPerStep        float64 `json:"floor_js_ops_per_step"`
	JSWritesPerStep          float64 `json:"js_writes_per_step"`
	FloorJSWritesPerStep     float64 `json:"floor_js_writes_per_step"`
	BytesWrittenPerStep      float64 `json:"bytes_written_per_step"`
	FloorBytesWrittenPerStep float64 `json:"floor_bytes_written_per_step"`

	EnginePeakRSS  uint64 `json:"engine_peak_rss_bytes"` // the process running server, engine and worker
	EnginePeakHeap uint64 `json:"engine_peak_heap_bytes"`
	// CheckpointBytes is the largest final checkpoint of a job (the state
	// plus what the engine keeps about steps; history is elsewhere).
	CheckpointBytes int64 `json:"checkpoint_bytes"`
	// MaxCheckpointBytes is the largest checkpoint the engine wrote at any
	// time during the rounds, of any job (its JSON encoding, as
	// CheckpointBytes).
	MaxCheckpointBytes int64 `json:"max_checkpoint_bytes"`
	// StepsCounted and JobsCompleted are of Waymark's round with the fewest:
	// steps completed (for a map or parallel shape counted from the
	// outputs in the final states) and jobs completed.
	StepsCounted  int `json:"steps_counted"`
	JobsCompleted int `json:"jobs_completed"`
	// WritesPerCommit is the mean number of checkpoint writes per group
	// commit (0 without group commit).
	WritesPerCommit float64 `json:"checkpoint_writes_per_commit"`
	// Replicas of Waymark's streams, as the server reported them.
	Replicas     int    `json:"replicas"`
	FloorPeakRSS uint64 `json:"floor_peak_rss_bytes"`

	ThroughputRatio float64 `json:"throughput_ratio"` // steps_per_s / floor_steps_per_s
	LatencyRatio    float64 `json:"latency_ratio"`    // step_p50 / floor_step_p50
	CPURatio        float64 `json:"cpu_ratio"`        // cpu_us_per_step / floor_cpu_us_per_step

	// Map shape only: the chain jobs it is compared with, measured in the
	// same rounds (Baseline, whose StepsPerS is ChainStepsPerS), and the
	// ratio of the map's steps/s to theirs. Step latencies are not
	// measured for a map or parallel shape (a checkpoint write there
	// carries several steps); job latencies are.
	ChainStepsPerS float64 `json:"chain_steps_per_s,omitempty"`
	MapChainRatio  float64 `json:"map_chain_ratio,omitempty"`
	Baseline       *Result `json:"baseline,omitempty"`
}

// Run measures cfg.Rounds rounds of the engine and (if cfg.Floor) of the
// floor, alternating, each on a fresh server, and returns the medians.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "waymark-bench-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	var ours, floors, chains []Sample
	for r := 0; r < cfg.Rounds; r++ {
		if cfg.Shape == ShapeMap {
			s, err := measure(ctx, cfg.baseline(), fmt.Sprintf("%s/chain-%d", dir, r), runEngine)
			if err != nil {
				return nil, fmt.Errorf("chain baseline round %d: %w", r+1, err)
			}
			chains = append(chains, s)
		}
		if cfg.Floor {
			s, err := measure(ctx, cfg, fmt.Sprintf("%s/floor-%d", dir, r), runFloor)
			if err != nil {
				return nil, fmt.Errorf("floor round %d: %w", r+1, err)
			}
			floors = append(floors, s)
		}
		if cfg.Engine {
			s, err := measure(ctx, cfg, fmt.Sprintf("%s/engine-%d", dir, r), runEngine)
			if err != nil {
				return nil, fmt.Errorf("engine round %d: %w", r+1, err)
			}
			ours = append(ours, s)
		}
	}
	res := summarise(cfg, ours, floors)
	if cfg.Shape == ShapeMap {
		res.Baseline = summarise(cfg.baseline(), chains, nil)
		res.ChainStepsPerS = res.Baseline.StepsPerS
		if res.ChainStepsPerS > 0 {
			res.MapChainRatio = res.StepsPerS / res.ChainStepsPerS
		}
	}
	return res, nil
}

// system runs cfg's jobs on tg and records per-step completion times in rec.
type system func(ctx context.Context, cfg Config, tg *target, rec *recorder) error

// target is where a round runs: one embedded server, or a loopback
// cluster (Config.Cluster) whose streams have that many replicas.
type target struct {
	connect  func(name string) (*nats.Conn, jetstream.JetStream, error)
	inMsgs   func() int64 // client messages into the server(s)
	replicas int
}

// startTarget starts cfg's servers with their files under dir; stop ends
// them.
func startTarget(cfg Config, dir string) (tg *target, stop func(), err error) {
	if cfg.Cluster > 0 {
		c, err := natsserver.StartCluster(dir, cfg.Cluster, cfg.Sync == natsserver.SyncAlways)
		if err != nil {
			return nil, nil, err
		}
		connect := func(name string) (*nats.Conn, jetstream.JetStream, error) {
			nc, err := nats.Connect(c.URLs(), nats.Name(name), nats.MaxReconnects(-1))
			if err != nil {
				return nil, nil, err
			}
			js, err := jetstream.New(nc)
			return nc, js, err
		}
		return &target{connect: connect, inMsgs: c.InMsgs, replicas: cfg.Cluster}, c.Stop, nil
	}
	srv, err := natsserver.Start(natsserver.Config{DataDir: dir, Sync: cfg.Sync})
	if err != nil {
		return nil, nil, err
	}
	inMsgs := func() int64 {
		vz, err := srv.Varz(nil)
		if err != nil {
			return 0
		}
		return vz.InMsgs
	}
	stop = func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		srv.Stop(sctx)
		cancel()
	}
	return &target{connect: func(name string) (*nats.Conn, jetstream.JetStream, error) { return srv.JetStream(name) }, inMsgs: inMsgs, replicas: 1}, stop, nil
}

func measure(ctx context.Context, cfg Config, dir string, run system) (Sample, error) {
	tg, stop, err := startTarget(cfg, dir)
	if err != nil {
		return Sample{}, err
	}
	defer func() {
		stop()
		_ = os.RemoveAll(dir)
	}()
	runtime.GC()
	resetPeakRSS()
	rec := newRecorder(cfg)
	heap := sampleHeap()
	in0 := tg.inMsgs()
	cpu0, io0 := cpuTime(), bytesWritten()
	writes0 := streamWrites(ctx, tg)
	rctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	err = run(rctx, cfg, tg, rec)
	peakHeap := heap()
	if err != nil {
		return Sample{}, err
	}
	if n := rec.failed.Load(); n > 0 {
		return Sample{}, fmt.Errorf("%d of %d jobs did not complete; the first: %s", n, cfg.Jobs, rec.firstFailure())
	}
	steps := cfg.Jobs * cfg.Steps
	if cfg.Shape != ShapeChain {
		steps = int(rec.counted.Load())
	}
	s := Sample{
		Steps:         steps,
		Jobs:          cfg.Jobs - int(rec.failed.Load()),
		MaxCheckpoint: rec.cpAny.Load(),
		Elapsed:       rec.elapsed(),
		CPU:           cpuTime() - cpu0,
		BytesWritten:  bytesWritten() - io0,
		PeakRSS:       peakRSS(),
		PeakHeap:      peakHeap,
		Checkpoint:    rec.cpMax.Load(),
		Commits:       rec.commits.Load(),
		Committed:     rec.committed.Load(),
		Replicas:      int(rec.replicas.Load()),
	}
	s.StepLatency, s.JobLatency = rec.latencies()
	s.Ops = uint64(tg.inMsgs() - in0)
	s.Writes = streamWrites(ctx, tg) - writes0
	return s, nil
}

// recorder collects completion times. Safe for concurrent use.
type recorder struct {
	mu      sync.Mutex
	start   time.Time
	end     time.Time
	last    map[string]time.Time // job → previous event
	begun   map[string]time.Time
	steps   []time.Duration
	jobs    []time.Duration
	pending int
	done    chan struct{}
	cpMax   atomic.Int64 // largest final checkpoint, bytes (Waymark only)
	cpAny   atomic.Int64 // largest checkpoint written at any time, bytes (Waymark only)
	// counted: steps counted from the final states (Waymark's map and
	// parallel shapes); failed: jobs that ended other than completed, the
	// first of them described in failure.
	counted, failed atomic.Int64
	failure         string
	// commits, committed: group commits of checkpoints and the writes they
	// carried (Waymark only).
	commits, committed atomic.Uint64
	// replicas of the checkpoint bucket's stream (Waymark only).
	replicas atomic.Int64
}

func newRecorder(cfg Config) *recorder {
	return &recorder{last: map[string]time.Time{}, begun: map[string]time.Time{},
		steps: make([]time.Duration, 0, cfg.Jobs*cfg.Steps), pending: cfg.Jobs, done: make(chan struct{})}
}

func (r *recorder) began(job string) {
	now := time.Now()
	r.mu.Lock()
	if r.start.IsZero() {
		r.start = now
	}
	r.last[job], r.begun[job] = now, now
	r.mu.Unlock()
}

// stepDone records a completed step; final marks the job's last.
func (r *recorder) stepDone(job string, final bool) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if prev, ok := r.last[job]; ok {
		r.steps = append(r.steps, now.Sub(prev))
	}
	r.last[job] = now
	if final {
		r.jobs = append(r.jobs, now.Sub(r.begun[job]))
		delete(r.last, job)
		delete(r.begun, job)
		r.pending--
		if r.pending == 0 {
			r.end = now
			close(r.done)
		}
	}
}

// jobFailed records a job that ended other than completed.
func (r *recorder) jobFailed(what string) {
	r.mu.Lock()
	if r.failed.Add(1) == 1 {
		r.failure = what
	}
	r.mu.Unlock()
}

func (r *recorder) firstFailure() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failure
}

func (r *recorder) wait(ctx context.Context) error {
	select {
	case <-r.done:
		return nil
	case <-ctx.Done():
		r.mu.Lock()
		n := r.pending
		r.mu.Unlock()
		return fmt.Errorf("%d jobs unfinished: %w", n, ctx.Err())
	}
}

func (r *recorder) elapsed() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.end.Sub(r.start)
}

func (r *recorder) latencies() ([]time.Duration, []time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Duration(nil), r.steps...), append([]time.Duration(nil), r.jobs...)
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// bytesWritten reads write_bytes from /proc/self/io: bytes this process
// sent to the storage layer. 0 where unavailable.
func bytesWritten() uint64 {
	data, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "write_bytes: "); ok {
			n, _ := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// resetPeakRSS resets the kernel's peak resident set size of this process
// (VmHWM), so that the next peakRSS covers only what follows.
func resetPeakRSS() { _ = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) }

func peakRSS() uint64 { return procMemory("self", "VmHWM") }

// procMemory reads a memory field (VmRSS, VmHWM) of process pid ("self"
// for this one) from /proc, in bytes; 0 when it cannot be read.
func procMemory(pid, field string) uint64 {
	data, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			f := strings.Fields(v)
			if len(f) >= 1 {
				n, _ := strconv.ParseUint(f[0], 10, 64)
				return n * 1024
			}
		}
	}
	return 0
}

// sampleHeap samples the Go heap every 50ms until the returned function is
// called, which returns the peak.
func sampleHeap() func() uint64 {
	var mu sync.Mutex
	var peak uint64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		var ms runtime.MemStats
		for {
			runtime.ReadMemStats(&ms)
			mu.Lock()
			peak = max(peak, ms.HeapInuse)
			mu.Unlock()
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	return func() uint64 {
		close(stop)
		<-done
		mu.Lock()
		defer mu.Unlock()
		return peak
	}
}

// streamWrites sums the last sequence of every stream: messages ever
// stored, KV writes included.
func streamWrites(ctx context.Context, tg *target) uint64 {
	nc, js, err := tg.connect("bench-stats")
	if err != nil {
		return 0
	}
	defer nc.Close()
	var total uint64
	l := js.ListStreams(ctx)
	for info := range l.Info() {
		total += info.State.LastSeq
	}
	if err := l.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
		return 0
	}
	return total
}

func percentile(ds []time.Duration, p float64) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(p * float64(len(s)-1))
	return float64(s[i]) / float64(time.Millisecond)
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func summarise(cfg Config, ours, floors []Sample) *Result {
	r := &Result{Config: cfg}
	type agg struct {
		sps, p50, p90, p99, pmax, j50, j99, cpu, ops, writes, bytes []float64
		rss, heap                                                   uint64
		cp, cpAny                                                   int64
		steps, jobs                                                 int
	}
	collect := func(ss []Sample) agg {
		var a agg
		for _, s := range ss {
			n := float64(s.Steps)
			a.sps = append(a.sps, n/s.Elapsed.Seconds())
			a.p50 = append(a.p50, percentile(s.StepLatency, 0.50))
			a.p90 = append(a.p90, percentile(s.StepLatency, 0.90))
			a.p99 = append(a.p99, percentile(s.StepLatency, 0.99))
			a.pmax = append(a.pmax, percentile(s.StepLatency, 1))
			a.j50 = append(a.j50, percentile(s.JobLatency, 0.50))
			a.j99 = append(a.j99, percentile(s.JobLatency, 0.99))
			a.cpu = append(a.cpu, float64(s.CPU.Microseconds())/n)
			a.ops = append(a.ops, float64(s.Ops)/n)
			a.writes = append(a.writes, float64(s.Writes)/n)
			a.bytes = append(a.bytes, float64(s.BytesWritten)/n)
			a.rss = max(a.rss, s.PeakRSS)
			a.heap = max(a.heap, s.PeakHeap)
			a.cp = max(a.cp, s.Checkpoint)
			a.cpAny = max(a.cpAny, s.MaxCheckpoint)
			if a.steps == 0 || s.Steps < a.steps {
				a.steps = s.Steps
			}
			if a.jobs == 0 || s.Jobs < a.jobs {
				a.jobs = s.Jobs
			}
		}
		return a
	}
	o, f := collect(ours), collect(floors)
	r.StepsPerS, r.FloorStepsPerS = median(o.sps), median(f.sps)
	r.StepP50Ms, r.StepP90Ms, r.StepP99Ms, r.StepMaxMs = median(o.p50), median(o.p90), median(o.p99), median(o.pmax)
	r.FloorStepP50Ms, r.FloorStepP90Ms, r.FloorStepP99Ms, r.FloorStepMaxMs = median(f.p50), median(f.p90), median(f.p99), median(f.pmax)
	r.JobP50Ms, r.JobP99Ms, r.FloorJobP50Ms, r.FloorJobP99Ms = median(o.j50), median(o.j99), median(f.j50), median(f.j99)
	r.CPUUsPerStep, r.FloorCPUUsPerStep = median(o.cpu), median(f.cpu)
	r.JSOpsPerStep, r.FloorJSOpsPerStep = median(o.ops), median(f.ops)
	r.JSWritesPerStep, r.FloorJSWritesPerStep = median(o.writes), median(f.writes)
	r.BytesWrittenPerStep, r.FloorBytesWrittenPerStep = median(o.bytes), median(f.bytes)
	r.EnginePeakRSS, r.EnginePeakHeap, r.FloorPeakRSS = o.rss, o.heap, f.rss
	r.CheckpointBytes, r.MaxCheckpointBytes = o.cp, o.cpAny
	r.StepsCounted, r.JobsCompleted = o.steps, o.jobs
	var commits, committed uint64
	for _, s := range ours {
		commits, committed = commits+s.Commits, committed+s.Committed
	}
	for _, s := range ours {
		r.Replicas = max(r.Replicas, s.Replicas)
	}
	if commits > 0 {
		r.WritesPerCommit = float64(committed) / float64(commits)
	}
	ratio := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return a / b
	}
	r.ThroughputRatio = ratio(r.StepsPerS, r.FloorStepsPerS)
	r.LatencyRatio = ratio(r.StepP50Ms, r.FloorStepP50Ms)
	r.CPURatio = ratio(r.CPUUsPerStep, r.FloorCPUUsPerStep)
	return r
}
