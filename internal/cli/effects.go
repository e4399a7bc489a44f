package cli

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

func newEffectsCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "effects",
		Short: "Inspect the effect ledger and settle ambiguous effects",
	}
	cmd.AddCommand(newEffectsListCmd(g), newEffectsResolveCmd(g))
	requireSubcommand(cmd)
	return cmd
}

func newEffectsListCmd(g *globals) *cobra.Command {
	var job, state, output string
	cmd := &cobra.Command{
		Use:   "list [--job JOB] [--state STATE]",
		Short: "List effect records, most recently updated first",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			switch schemas.EffectState(state) {
			case "", schemas.EffectPrepared, schemas.EffectDispatched, schemas.EffectConfirmed, schemas.EffectAmbiguous, schemas.EffectReconciled:
			default:
				return &ExitError{Code: 2, Err: fmt.Errorf("--state %q: want prepared, dispatched, confirmed, ambiguous or reconciled", state)}
			}
			if job != "" {
				if err := client.ValidateJobID(job); err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("--job: %w", err)}
				}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				recs, err := c.Effects(cmd.Context(), client.EffectFilter{Job: job, State: schemas.EffectState(state)})
				if err != nil {
					return err
				}
				if output == "json" {
					if recs == nil {
						recs = []*schemas.EffectRecord{}
					}
					return printJSON(g.stdout, map[string]any{"effects": recs})
				}
				tw := tabwriter.NewWriter(g.stdout, 2, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "KEY\tJOB\tSTEP\tCLASS\tSTATE\tCALLS\tEXTERNAL ID\tUPDATED")
				for _, r := range recs {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", r.Key, r.Job, r.Step, r.Class, r.State, r.Calls, r.ExternalID, r.UpdatedAt.Format(time.RFC3339))
				}
				return tw.Flush()
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&job, "job", "", "only this job's effects")
	f.StringVar(&state, "state", "", "only effects in this state (prepared, dispatched, confirmed, ambiguous, reconciled)")
	f.StringVarP(&output, "output", "o", "text", "text or json")
	return cmd
}

func newEffectsResolveCmd(g *globals) *cobra.Command {
	var happened, notHappened bool
	var externalID, resultFile, by, note, output string
	cmd := &cobra.Command{
		Use:   "resolve KEY (--happened [--external-id ID] [--result FILE] | --not-happened)",
		Short: "Settle an ambiguous effect; the job waiting on it resumes",
		Long: `Resolve records what a person found out about an ambiguous effect: it happened
(with the provider's id and its result, which becomes the step's output) or it
did not (the step will perform it). Who decided and when are recorded in the
ledger and the job's history, and the job waiting on the effect resumes.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if happened == notHappened {
				return &ExitError{Code: 2, Err: errors.New("say either --happened or --not-happened")}
			}
			res := schemas.EffectResolution{Happened: happened, ExternalID: externalID, By: by, Note: note}
			if resultFile != "" {
				data, err := readInput(resultFile, cmd.InOrStdin())
				if err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("--result: %w", err)}
				}
				res.Result = data
			}
			if res.By == "" {
				res.By = whoami()
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				got, err := c.ResolveEffect(cmd.Context(), args[0], res)
				switch {
				case errors.Is(err, schemas.ErrNotFound), errors.Is(err, client.ErrNotAmbiguous), errors.Is(err, schemas.ErrInputInvalid),
					errors.Is(err, client.ErrNothingToResume), errors.Is(err, schemas.ErrConflict), errors.Is(err, schemas.ErrTooLarge):
					return &ExitError{Code: 2, Err: err}
				case err != nil:
					return err
				}
				if output == "json" {
					return printJSON(g.stdout, got)
				}
				what := "did not happen; the step will perform it again under the same idempotency key"
				if happened {
					what = "happened; its result becomes the step's output"
				}
				switch len(got.Resumed) {
				case 0:
					fmt.Fprintf(g.stdout, "effect %s was already reconciled by %s: %s. No job waits on it now.\n", got.Key, got.ReconciledBy, what)
				case 1:
					fmt.Fprintf(g.stdout, "effect %s reconciled by %s: %s. Job %s resumes.\n", got.Key, got.ReconciledBy, what, got.Resumed[0])
				default:
					fmt.Fprintf(g.stdout, "effect %s reconciled by %s: %s. Jobs %s resume.\n", got.Key, got.ReconciledBy, what, strings.Join(got.Resumed, ", "))
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.BoolVar(&happened, "happened", false, "the effect took place")
	f.BoolVar(&notHappened, "not-happened", false, "the effect did not take place")
	f.StringVar(&externalID, "external-id", "", "the provider's id for the effect (with --happened)")
	f.StringVar(&resultFile, "result", "", "a JSON file (or - for stdin) holding the effect's result (with --happened)")
	f.StringVar(&by, "by", "", "who decides (default: the current user)")
	f.StringVar(&note, "note", "", "why, for the record")
	f.StringVarP(&output, "output", "o", "text", "text or json")
	return cmd
}

func whoami() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	if v := os.Getenv("USER"); v != "" {
		return v
	}
	return "unknown"
}
