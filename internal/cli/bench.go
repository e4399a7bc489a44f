package cli

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/bench"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

func newBenchCmd(g *globals) *cobra.Command {
	var c bench.Config
	var output string
	var noFloor, floorOnly bool
	var cpuProfile, memProfile string
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure steps/s, step latency, CPU and JetStream work per step against the bare JetStream floor",
		Long: `Bench runs jobs of a chain of steps through an embedded server, the engine and an
in-process worker, and, in the same process on a fresh server, the floor: a bare
JetStream loop doing the least Waymark's design needs per step (checkpoint CAS,
dispatch publish with a dedup id, pull and ack, result publish, consume and ack).
It prints both and their ratios; medians over --rounds.

--shape map runs jobs (one, unless --jobs says) of one for_each step over --items
no-op items, --item-concurrency at a time, and in the same rounds, before each,
the chain jobs it is compared with: ten no-op steps each, the same total steps,
as many steps in flight as the map has items. It prints both, the ratio of the
map's steps/s to the chain's, and the largest checkpoint written at any time.
--shape parallel runs jobs of one parallel step of --branches no-op branches and
a no-op step after it (branches + 1 steps per job). --shape agent runs jobs
of one agent step of --turns model turns replayed from a cassette, every turn
but the last calling one pure no-op tool; it prints turns/s. The floor is the
chain shape's only.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBenchShape(&c, floorOnly, cmd.Flags().Changed); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBenchFlags(c, noFloor, floorOnly); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			log, err := g.logger()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			c.Logger = log
			c.Floor, c.Engine = !noFloor && c.Shape == bench.ShapeChain, !floorOnly
			if cpuProfile != "" {
				f, err := os.Create(cpuProfile)
				if err != nil {
					return err
				}
				defer f.Close()
				if err := pprof.StartCPUProfile(f); err != nil {
					return err
				}
				defer pprof.StopCPUProfile()
			}
			res, err := bench.Run(cmd.Context(), c)
			if err != nil {
				return err
			}
			if memProfile != "" {
				f, err := os.Create(memProfile)
				if err != nil {
					return err
				}
				defer f.Close()
				if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
					return err
				}
			}
			if output == "json" {
				return printJSON(g.stdout, res)
			}
			printBench(g.stdout, res)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&c.Shape, "shape", bench.ShapeChain, "jobs' shape: chain (--steps steps), map (one for_each step over --items items), parallel (--branches branches, then one step) or agent (--turns turns, a tool call each)")
	f.IntVar(&c.Jobs, "jobs", 100, "jobs per round (default 1 with --shape map)")
	f.IntVar(&c.Steps, "steps", 10, "steps per job (--shape chain)")
	f.IntVar(&c.Items, "items", bench.DefaultItems, "items per map job (--shape map)")
	f.IntVar(&c.ItemConcurrency, "item-concurrency", bench.DefaultItemConcurrency, "a map job's items in flight, its for_each.concurrency: 1..1000 (--shape map)")
	f.IntVar(&c.Branches, "branches", bench.DefaultBranches, "branches of a parallel job: 1..64 (--shape parallel)")
	f.IntVar(&c.Turns, "turns", bench.DefaultTurns, "model turns of an agent job: 1..200 (--shape agent)")
	f.IntVar(&c.Concurrency, "concurrency", 0, "jobs in flight (default: all of them)")
	f.IntVar(&c.StepConcurrency, "step-concurrency", 0, "a concurrency limit on every step of a chain job, across all jobs: 1..1000 (default: none)")
	f.IntVar(&c.Payload, "payload", 1024, "state size in bytes (1..524288; up to 16 MiB with --state-values)")
	f.IntVar(&c.StateValues, "state-values", 0, "split the payload into this many state members (members over 64 KiB are kept by reference)")
	f.StringVar(&c.Kind, "kind", "noop", "step kind: noop, http (a local server) or model (replayed)")
	f.IntVar(&c.Workers, "worker-concurrency", 256, "steps the worker runs at once")
	f.StringVar(&c.Sync, "sync", "interval", "embedded JetStream sync policy: always or interval (the default here is interval; engine run and serve default to always)")
	f.StringVar(&c.Queues, "queue-storage", "file", "Waymark's work and inbox queues: file or memory (the floor's stay on file)")
	f.IntVar(&c.Rounds, "rounds", 1, "rounds of each system; medians are reported")
	f.IntVar(&c.HistoryBatch, "history-batch", 0, "transitions a checkpoint carries before its history is published (engine default 8)")
	f.IntVar(&c.Cluster, "cluster", 0, "run on a loopback cluster of 3 or 5 nodes in this process, every stream replicated on all of them (default: one embedded server)")
	f.IntVar(&c.Lanes, "lanes", 0, "the engine's lanes, each deciding a share of the jobs (default: one per two cores)")
	f.IntVar(&c.CacheBytes, "cache-bytes", 0, "the engine's checkpoint cache in bytes (default 64 MiB; -1 for none: every transition reads its checkpoint)")
	f.StringVar(&c.GroupCommit, "group-commit", "", "checkpoint writes as atomic batches, one commit in flight: on or off (default: on under --sync always)")
	f.BoolVar(&c.Events, "events", false, "also run the lifecycle events relay beside the engine, as engine serve and run do by default")
	f.BoolVar(&noFloor, "no-floor", false, "skip the floor")
	f.BoolVar(&floorOnly, "floor-only", false, "measure only the floor")
	f.StringVarP(&output, "output", "o", "text", "text or json")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile (pprof) of the whole run to this file")
	f.StringVar(&memProfile, "memprofile", "", "write an allocation profile (pprof allocs) of the whole run to this file")
	cmd.AddCommand(newBenchScaleCmd(g))
	return cmd
}

func newBenchScaleCmd(g *globals) *cobra.Command {
	var jobs []int
	var output string
	var settle time.Duration
	var finished int
	var waiting string
	cmd := &cobra.Command{
		Use:   "scale [--jobs 100,10000] [--waiting slow|approval|sleep]",
		Short: "Measure the engine's memory with many jobs in flight, and its first progress after a kill",
		Long: `Scale starts an engine process (engine serve --workers 0) against an embedded
server, starts jobs whose first step waits for a worker pool nobody serves, and
reads the engine's RSS and Go heap with each --jobs count in flight. Then it
kills the engine (SIGKILL), lets a worker finish every waiting step, starts a new
engine process and reports how long after its start it wrote its first
checkpoint, and when the last job completed. With --waiting approval or sleep
the jobs wait at an approval gate (with a 24h expiry timer) or in a 1h sleep
instead: durable timers in the server, nothing in the engine; no restart is
timed then. Linux only.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			for i, n := range jobs {
				if n < 1 || (i > 0 && n <= jobs[i-1]) {
					return &ExitError{Code: 2, Err: fmt.Errorf("--jobs %s: want ascending counts of at least 1, e.g. 100,10000", joinInts(jobs))}
				}
			}
			if settle <= 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--settle %v: want a positive duration", settle)}
			}
			log, err := g.logger()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if finished < 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--finished %d: want 0 or more", finished)}
			}
			switch waiting {
			case "slow", "approval", "sleep":
			default:
				return &ExitError{Code: 2, Err: fmt.Errorf("--waiting %q: want slow, approval or sleep", waiting)}
			}
			res, err := bench.RunScale(cmd.Context(), bench.ScaleConfig{Jobs: jobs, Settle: settle, Finished: finished, Waiting: waiting, Logger: log})
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(g.stdout, res)
			}
			if res.FinishedJobs > 0 {
				fmt.Fprintf(g.stdout, "%d finished jobs stored, none running: idle engine CPU %.2f%% of a core; list --status running p50 %.1f ms; first page of GET /v1/jobs p50 %.1f ms\n\n",
					res.FinishedJobs, res.IdleCPUPercent, res.ListRunningP50Ms, res.FirstPageP50Ms)
			}
			tw := tabwriter.NewWriter(g.stdout, 2, 4, 2, ' ', tabwriter.AlignRight)
			fmt.Fprintln(tw, "jobs in flight	engine RSS MiB	engine heap in use MiB	")
			for _, p := range res.Points {
				fmt.Fprintf(tw, "%d	%.1f	%.1f	\n", p.Jobs, float64(p.RSS)/(1<<20), float64(p.HeapInuse)/(1<<20))
			}
			_ = tw.Flush()
			if res.RestartJobs == 0 {
				return nil
			}
			fmt.Fprintf(g.stdout, "\nengine killed with %d jobs in flight; a new engine process wrote its first checkpoint %.0f ms after it started, and completed them all in %.0f ms\n",
				res.RestartJobs, res.FirstProgressMs, res.DrainMs)
			return nil
		},
	}
	cmd.Flags().IntSliceVar(&jobs, "jobs", []int{100, 10000}, "jobs in flight at which memory is read, ascending")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().DurationVar(&settle, "settle", 3*time.Second, "how long jobs are held before memory is read")
	cmd.Flags().StringVar(&waiting, "waiting", "slow", "what jobs wait on: slow (a step no worker serves), approval (a gate with an expiry timer) or sleep (a 1h timer)")
	cmd.Flags().IntVar(&finished, "finished", 0, "finished jobs stored first (checkpoints and index entries): then the idle engine's CPU and the list latencies are measured")
	return cmd
}

// checkBenchShape checks --shape and the flags of each shape, naming the
// flag, and clears in c what its shape does not use (changed says which
// flags were given); a map takes one job unless --jobs says.
func checkBenchShape(c *bench.Config, floorOnly bool, changed func(string) bool) error {
	only := map[string]string{"steps": bench.ShapeChain, "items": bench.ShapeMap, "item-concurrency": bench.ShapeMap, "branches": bench.ShapeParallel, "turns": bench.ShapeAgent,
		"step-concurrency": bench.ShapeChain}
	switch c.Shape {
	case bench.ShapeChain, bench.ShapeMap, bench.ShapeParallel, bench.ShapeAgent:
	default:
		return fmt.Errorf("--shape %q: want chain, map, parallel or agent", c.Shape)
	}
	for _, name := range []string{"steps", "items", "item-concurrency", "branches", "turns", "step-concurrency"} {
		if changed(name) && only[name] != c.Shape {
			return fmt.Errorf("--%s is for --shape %s, not %s", name, only[name], c.Shape)
		}
	}
	if c.StepConcurrency < 0 || c.StepConcurrency > schemas.MaxConcurrencyLimit {
		return fmt.Errorf("--step-concurrency %d: want 1..%d (0: no limit)", c.StepConcurrency, schemas.MaxConcurrencyLimit)
	}
	switch c.Shape {
	case bench.ShapeMap:
		switch {
		case c.Items < 1 || c.Items > schemas.DefaultMaxItems:
			return fmt.Errorf("--items %d: want 1..%d", c.Items, schemas.DefaultMaxItems)
		case c.ItemConcurrency < 1 || c.ItemConcurrency > schemas.MaxMapConcurrency:
			return fmt.Errorf("--item-concurrency %d: want 1..%d", c.ItemConcurrency, schemas.MaxMapConcurrency)
		}
		if !changed("jobs") {
			c.Jobs = 1
		}
	case bench.ShapeParallel:
		if c.Branches < 1 || c.Branches > bench.MaxBranches {
			return fmt.Errorf("--branches %d: want 1..%d", c.Branches, bench.MaxBranches)
		}
	case bench.ShapeAgent:
		if c.Turns < 1 || c.Turns > bench.MaxTurns {
			return fmt.Errorf("--turns %d: want 1..%d", c.Turns, bench.MaxTurns)
		}
	}
	if c.Shape != bench.ShapeChain {
		if c.Kind != "noop" {
			return fmt.Errorf("--kind %s: --shape %s runs noop steps only", c.Kind, c.Shape)
		}
		if floorOnly {
			return fmt.Errorf("--floor-only: the floor is measured for --shape chain only, not %s", c.Shape)
		}
		c.Steps = 0
	}
	if c.Shape != bench.ShapeMap {
		c.Items, c.ItemConcurrency = 0, 0
	}
	if c.Shape != bench.ShapeParallel {
		c.Branches = 0
	}
	if c.Shape != bench.ShapeAgent {
		c.Turns = 0
	}
	return nil
}

// checkBenchFlags refuses, naming the flag, what bench.Config would turn
// into a default (a zero) or refuse later with a less precise message.
func checkBenchFlags(c bench.Config, noFloor, floorOnly bool) error {
	switch {
	case c.Jobs < 1:
		return fmt.Errorf("--jobs %d: want 1 or more", c.Jobs)
	case c.Steps < 1 && c.Shape == bench.ShapeChain:
		return fmt.Errorf("--steps %d: want 1 or more", c.Steps)
	case c.Rounds < 1:
		return fmt.Errorf("--rounds %d: want 1 or more", c.Rounds)
	case c.Workers < 1:
		return fmt.Errorf("--worker-concurrency %d: want 1 or more", c.Workers)
	case c.Concurrency < 0:
		return fmt.Errorf("--concurrency %d: want 1 or more, or 0 for all the jobs at once", c.Concurrency)
	case c.Concurrency > c.Jobs:
		return fmt.Errorf("--concurrency %d: more than the %d jobs (--jobs)", c.Concurrency, c.Jobs)
	case c.StateValues < 0 || c.StateValues > 256:
		return fmt.Errorf("--state-values %d: want 0..256", c.StateValues)
	case c.StateValues <= 1 && (c.Payload < 1 || c.Payload > 512<<10):
		return fmt.Errorf("--payload %d: want 1..524288 bytes (more with --state-values)", c.Payload)
	case c.StateValues > 1 && (c.Payload > 16<<20 || c.Payload/c.StateValues > 512<<10):
		return fmt.Errorf("--payload %d in --state-values %d: want at most 16 MiB, 512 KiB a value", c.Payload, c.StateValues)
	case c.Kind != "noop" && c.Kind != "http" && c.Kind != "model":
		return fmt.Errorf("--kind %q: want noop, http or model", c.Kind)
	case c.Sync != natsserver.SyncAlways && c.Sync != natsserver.SyncInterval:
		return fmt.Errorf("--sync %q: want always or interval", c.Sync)
	case c.Queues != kv.QueueFile && c.Queues != kv.QueueMemory:
		return fmt.Errorf("--queue-storage %q: want file or memory", c.Queues)
	case c.Cluster != 0 && c.Cluster != 3 && c.Cluster != 5:
		return fmt.Errorf("--cluster %d: want 3 or 5 (or 0 for one embedded server)", c.Cluster)
	case c.GroupCommit != "" && c.GroupCommit != "on" && c.GroupCommit != "off":
		return fmt.Errorf("--group-commit %q: want on or off", c.GroupCommit)
	case noFloor && floorOnly:
		return errors.New("--no-floor and --floor-only together leave nothing to measure: give one of them")
	}
	return nil
}

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

func printBench(w io.Writer, r *bench.Result) {
	c := r.Config
	where := "one embedded server"
	if c.Cluster > 0 {
		where = fmt.Sprintf("a %d-node loopback cluster, streams replicated on every node", c.Cluster)
	}
	switch c.Shape {
	case bench.ShapeMap:
		printBenchMap(w, r, where)
		return
	case bench.ShapeParallel:
		printBenchParallel(w, r, where)
		return
	case bench.ShapeAgent:
		printBenchAgent(w, r, where)
		return
	}
	fmt.Fprintf(w, "shape chain: %d jobs x %d %s steps, %d in flight, %d-byte state, sync %s, %s queues, %s, %d round(s)\n\n",
		c.Jobs, c.Steps, c.Kind, c.Concurrency, c.Payload, c.Sync, c.Queues, where, c.Rounds)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\twaymark\tfloor\tratio\t")
	row := func(name string, a, b float64, format string) { ratioRow(tw, name, a, b, format) }
	row("steps/s", r.StepsPerS, r.FloorStepsPerS, "%.0f")
	row("step p50 ms", r.StepP50Ms, r.FloorStepP50Ms, "%.3f")
	row("step p90 ms", r.StepP90Ms, r.FloorStepP90Ms, "%.3f")
	row("step p99 ms", r.StepP99Ms, r.FloorStepP99Ms, "%.3f")
	row("step max ms", r.StepMaxMs, r.FloorStepMaxMs, "%.3f")
	row("job p50 ms", r.JobP50Ms, r.FloorJobP50Ms, "%.1f")
	row("job p99 ms", r.JobP99Ms, r.FloorJobP99Ms, "%.1f")
	row("CPU us/step", r.CPUUsPerStep, r.FloorCPUUsPerStep, "%.0f")
	row("JetStream ops/step", r.JSOpsPerStep, r.FloorJSOpsPerStep, "%.1f")
	row("stored msgs/step", r.JSWritesPerStep, r.FloorJSWritesPerStep, "%.1f")
	row("bytes written/step", r.BytesWrittenPerStep, r.FloorBytesWrittenPerStep, "%.0f")
	row("peak RSS MiB", float64(r.EnginePeakRSS)/(1<<20), float64(r.FloorPeakRSS)/(1<<20), "%.1f")
	_ = tw.Flush()
	fmt.Fprintf(w, "\npeak Go heap (waymark): %.1f MiB; largest final checkpoint: %d bytes; largest written at any time: %d bytes; CPU and memory are of the whole process (server, engine, worker)\n",
		float64(r.EnginePeakHeap)/(1<<20), r.CheckpointBytes, r.MaxCheckpointBytes)
	if r.WritesPerCommit > 0 {
		fmt.Fprintf(w, "group commit: %.1f checkpoint writes per atomic batch\n", r.WritesPerCommit)
	}
}

// ratioRow prints a table row of two figures in format and a/b ("-" when
// b is 0).
func ratioRow(tw io.Writer, name string, a, b float64, format string) {
	ratio := "-"
	if b > 0 {
		ratio = fmt.Sprintf("%.2f", a/b)
	}
	fmt.Fprintf(tw, "%s\t"+format+"\t"+format+"\t%s\t\n", name, a, b, ratio)
}

// Targets the map and parallel shapes are printed against.
const (
	mapChainTarget      = 0.8      // map steps/s over the chain baseline's
	mapCheckpointTarget = 64 << 10 // bytes: the largest checkpoint of a map job
)

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}

func printBenchMap(w io.Writer, r *bench.Result, where string) {
	c, b := r.Config, r.Baseline
	fmt.Fprintf(w, "shape map: %d job(s) x one for_each step over %d noop items, %d items in flight per job, %d job(s) in flight, %d-byte state, sync %s, %s queues, %s, %d round(s)\n",
		c.Jobs, c.Items, c.ItemConcurrency, c.Concurrency, c.Payload, c.Sync, c.Queues, where, c.Rounds)
	fmt.Fprintf(w, "baseline in the same rounds: %d chain jobs x %d noop steps, %d in flight\n\n", b.Config.Jobs, b.Config.Steps, b.Config.Concurrency)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\tmap\tchain\tratio\t")
	row := func(name string, a, b float64, format string) { ratioRow(tw, name, a, b, format) }
	row("steps counted", float64(r.StepsCounted), float64(b.StepsCounted), "%.0f")
	row("steps/s", r.StepsPerS, b.StepsPerS, "%.0f")
	row("job p50 ms", r.JobP50Ms, b.JobP50Ms, "%.1f")
	row("job p99 ms", r.JobP99Ms, b.JobP99Ms, "%.1f")
	row("CPU us/step", r.CPUUsPerStep, b.CPUUsPerStep, "%.0f")
	row("JetStream ops/step", r.JSOpsPerStep, b.JSOpsPerStep, "%.1f")
	row("stored msgs/step", r.JSWritesPerStep, b.JSWritesPerStep, "%.1f")
	row("bytes written/step", r.BytesWrittenPerStep, b.BytesWrittenPerStep, "%.0f")
	row("largest checkpoint B", float64(r.MaxCheckpointBytes), float64(b.MaxCheckpointBytes), "%.0f")
	row("peak RSS MiB", float64(r.EnginePeakRSS)/(1<<20), float64(b.EnginePeakRSS)/(1<<20), "%.1f")
	_ = tw.Flush()
	fmt.Fprintf(w, "\nmap/chain steps/s: %.2f (%.0f vs %.0f; target >= %.1f: %s)\n", r.MapChainRatio, r.StepsPerS, r.ChainStepsPerS, mapChainTarget, met(r.MapChainRatio >= mapChainTarget))
	fmt.Fprintf(w, "largest checkpoint written during the map run: %d bytes (target < %d: %s); largest final: %d bytes\n",
		r.MaxCheckpointBytes, mapCheckpointTarget, met(r.MaxCheckpointBytes < mapCheckpointTarget), r.CheckpointBytes)
	fmt.Fprintf(w, "jobs completed: %d of %d; peak Go heap (map): %.1f MiB; CPU and memory are of the whole process (server, engine, worker)\n",
		r.JobsCompleted, c.Jobs, float64(r.EnginePeakHeap)/(1<<20))
	if r.WritesPerCommit > 0 {
		fmt.Fprintf(w, "group commit (map): %.1f checkpoint writes per atomic batch\n", r.WritesPerCommit)
	}
}

func printBenchParallel(w io.Writer, r *bench.Result, where string) {
	c := r.Config
	fmt.Fprintf(w, "shape parallel: %d jobs x (one parallel step of %d noop branches, then one noop step) = %d steps per job, %d jobs in flight, %d-byte state, sync %s, %s queues, %s, %d round(s)\n\n",
		c.Jobs, c.Branches, c.Branches+1, c.Concurrency, c.Payload, c.Sync, c.Queues, where, c.Rounds)
	printShapeTable(w, r, "step", func(row func(string, float64, string)) {
		row("steps counted", float64(r.StepsCounted), "%.0f")
		row("steps/s", r.StepsPerS, "%.0f")
	})
	fmt.Fprintf(w, "\njobs completed: %d of %d; largest final checkpoint: %d bytes; largest written at any time: %d bytes; peak Go heap %.1f MiB; CPU and memory are of the whole process (server, engine, worker)\n",
		r.JobsCompleted, c.Jobs, r.CheckpointBytes, r.MaxCheckpointBytes, float64(r.EnginePeakHeap)/(1<<20))
	if r.WritesPerCommit > 0 {
		fmt.Fprintf(w, "group commit: %.1f checkpoint writes per atomic batch\n", r.WritesPerCommit)
	}
}

// printBenchAgent prints an agent run: turns/s and the cost per dispatch.
func printBenchAgent(w io.Writer, r *bench.Result, where string) {
	c := r.Config
	fmt.Fprintf(w, "shape agent: %d jobs x (one agent step of %d replayed model turns, a pure noop tool call after each but the last) = %d dispatches per job, %d jobs in flight, sync %s, %s queues, %s, %d round(s)\n\n",
		c.Jobs, c.Turns, 2*c.Turns-1, c.Concurrency, c.Sync, c.Queues, where, c.Rounds)
	printShapeTable(w, r, "dispatch", func(row func(string, float64, string)) {
		perTurn := float64(2*c.Turns-1) / float64(c.Turns)
		row("turns/s", r.StepsPerS/perTurn, "%.0f")
		row("dispatches/s (turns and tool calls)", r.StepsPerS, "%.0f")
	})
	fmt.Fprintf(w, "\njobs completed: %d of %d; largest final checkpoint: %d bytes; largest written at any time: %d bytes; CPU and memory are of the whole process (server, engine, worker)\n",
		r.JobsCompleted, c.Jobs, r.CheckpointBytes, r.MaxCheckpointBytes)
}

// printShapeTable prints a one-system table of r: the rows lead writes,
// then latency, CPU, JetStream and memory figures per unit ("step").
func printShapeTable(w io.Writer, r *bench.Result, unit string, lead func(row func(name string, v float64, format string))) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\twaymark\t")
	row := func(name string, v float64, format string) { fmt.Fprintf(tw, "%s\t"+format+"\t\n", name, v) }
	lead(row)
	row("job p50 ms", r.JobP50Ms, "%.1f")
	row("job p99 ms", r.JobP99Ms, "%.1f")
	row("CPU us/"+unit, r.CPUUsPerStep, "%.0f")
	row("JetStream ops/"+unit, r.JSOpsPerStep, "%.1f")
	row("stored msgs/"+unit, r.JSWritesPerStep, "%.1f")
	row("bytes written/"+unit, r.BytesWrittenPerStep, "%.0f")
	row("peak RSS MiB", float64(r.EnginePeakRSS)/(1<<20), "%.1f")
	_ = tw.Flush()
}
