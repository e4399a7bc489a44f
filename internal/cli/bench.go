package cli

import (
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/bench"
)

func newBenchCmd(g *globals) *cobra.Command {
	var c bench.Config
	var output string
	var noFloor, floorOnly bool
	var cpuProfile string
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure steps/s, step latency, CPU and JetStream work per step against the bare JetStream floor",
		Long: `Bench runs jobs of a chain of steps through an embedded server, the engine and an
in-process worker, and, in the same process on a fresh server, the floor: a bare
JetStream loop doing the least Waymark's design needs per step (checkpoint CAS,
dispatch publish with a dedup id, pull and ack, result publish, consume and ack).
It prints both and their ratios; medians over --rounds.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			log, err := g.logger()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			c.Logger = log
			c.Floor, c.Engine = !noFloor, !floorOnly
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
			if output == "json" {
				return printJSON(g.stdout, res)
			}
			printBench(g.stdout, res)
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&c.Jobs, "jobs", 100, "jobs per round")
	f.IntVar(&c.Steps, "steps", 10, "steps per job")
	f.IntVar(&c.Concurrency, "concurrency", 0, "jobs in flight (default: all of them)")
	f.IntVar(&c.Payload, "payload", 1024, "state size in bytes")
	f.StringVar(&c.Kind, "kind", "noop", "step kind: noop, http (a local server) or model (replayed)")
	f.IntVar(&c.Workers, "worker-concurrency", 256, "steps the worker runs at once")
	f.StringVar(&c.Sync, "sync", "interval", "embedded JetStream sync policy: always or interval")
	f.StringVar(&c.Queues, "queue-storage", "file", "Waymark's work and inbox queues: file or memory (the floor's stay on file)")
	f.IntVar(&c.Rounds, "rounds", 1, "rounds of each system; medians are reported")
	f.BoolVar(&noFloor, "no-floor", false, "skip the floor")
	f.BoolVar(&floorOnly, "floor-only", false, "measure only the floor")
	f.StringVarP(&output, "output", "o", "text", "text or json")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile (pprof) of the whole run to this file")
	return cmd
}

func printBench(w io.Writer, r *bench.Result) {
	c := r.Config
	fmt.Fprintf(w, "%d jobs x %d %s steps, %d in flight, %d-byte state, sync %s, %s queues, %d round(s)\n\n",
		c.Jobs, c.Steps, c.Kind, c.Concurrency, c.Payload, c.Sync, c.Queues, c.Rounds)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\twaymark\tfloor\tratio\t")
	row := func(name string, a, b float64, format string) {
		ratio := "-"
		if b > 0 {
			ratio = fmt.Sprintf("%.2f", a/b)
		}
		fmt.Fprintf(tw, "%s\t"+format+"\t"+format+"\t%s\t\n", name, a, b, ratio)
	}
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
	fmt.Fprintf(w, "\npeak Go heap (waymark): %.1f MiB; largest final checkpoint: %d bytes; CPU and memory are of the whole process (server, engine, worker)\n",
		float64(r.EnginePeakHeap)/(1<<20), r.CheckpointBytes)
}
