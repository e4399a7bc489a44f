package cli

import (
	"io"

	"github.com/spf13/cobra"
)

// Version is set at build time with -ldflags "-X .../internal/cli.Version=...".
var Version = "dev"

// NewEngineCommand returns the engine binary's command tree: run, serve,
// start, status, list, history, validate, worker.
func NewEngineCommand(stdout, stderr io.Writer) *cobra.Command {
	g := &globals{stdout: stdout, stderr: stderr}
	root := &cobra.Command{
		Use:   "engine",
		Short: "Waymark: durable jobs for AI-agent pipelines, on NATS JetStream",
		Long: `Waymark runs workflows as durable jobs: a pinned definition decides which step is
eligible, JetStream KV holds each job's checkpoint, and a crashed job resumes
where it stopped without performing a step's side effect twice.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       Version,
	}
	g.bind(root)
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.AddCommand(newRunCmd(g), newServeCmd(g), newStartCmd(g), newStatusCmd(g), newListCmd(g),
		newHistoryCmd(g), newValidateCmd(g), newBenchCmd(g), newEffectsCmd(g), newCrashtestCmd(g))
	w := NewWorkerCommand(stdout, stderr, nil)
	w.Short = "Run a worker in this process (same as the worker binary)"
	root.AddCommand(w)
	return root
}
