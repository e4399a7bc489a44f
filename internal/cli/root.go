package cli

import (
	"fmt"
	"io"
	"strings"

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
	requireSubcommand(root)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &ExitError{Code: 2, Err: err} })
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.AddCommand(newRunCmd(g), newServeCmd(g), newStartCmd(g), newStatusCmd(g), newListCmd(g),
		newHistoryCmd(g), newWatchCmd(g), newTranscriptCmd(g), newCancelCmd(g), newPauseCmd(g), newResumeCmd(g), newRetryCmd(g),
		newDecisionCmd(g, true), newDecisionCmd(g, false), newSignalCmd(g), newInspectCmd(g), newRewindCmd(g), newForkCmd(g), newScheduleCmd(g), newMigrateCmd(g), newStoreCmd(g), newValidateCmd(g), newBenchCmd(g), newEffectsCmd(g), newCrashtestCmd(g), newEventsCmd(g), newTriggersCmd(g))
	w := NewWorkerCommand(stdout, stderr, nil)
	w.Short = "Run a worker in this process (same as the worker binary)"
	root.AddCommand(w)
	return root
}

// requireSubcommand makes cmd, which only groups subcommands, refuse an
// unknown one with exit status 2 (cobra's own error exits 1, and a group
// below the root would print its help and exit 0). Without arguments cmd
// prints its help.
func requireSubcommand(cmd *cobra.Command) {
	cmd.Args = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return nil
		}
		msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
		if cmd.SuggestionsMinimumDistance <= 0 {
			cmd.SuggestionsMinimumDistance = 2 // cobra's default, which only its own error sets
		}
		if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
			msg += fmt.Sprintf(" (did you mean %s?)", strings.Join(s, " or "))
		}
		return &ExitError{Code: 2, Err: fmt.Errorf("%s; run '%s --help' for the commands", msg, cmd.CommandPath())}
	}
	cmd.RunE = func(cmd *cobra.Command, _ []string) error { return cmd.Help() }
}

// exactArgs and noArgs check argument counts as cobra's do, with exit
// status 2 (usage).
func exactArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := cobra.ExactArgs(n)(cmd, args); err != nil {
			return &ExitError{Code: 2, Err: fmt.Errorf("%w (usage: %s)", err, cmd.UseLine())}
		}
		return nil
	}
}

func noArgs(cmd *cobra.Command, args []string) error {
	if err := cobra.NoArgs(cmd, args); err != nil {
		return &ExitError{Code: 2, Err: fmt.Errorf("%w (usage: %s)", err, cmd.UseLine())}
	}
	return nil
}
