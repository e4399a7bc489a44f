package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

// withClient connects to --nats-url and runs fn with a job client.
func (g *globals) withClient(ctx context.Context, fn func(*client.Client, *kv.Store) error) error {
	log, err := g.logger()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	cfg, err := g.kvConfig(kv.Config{}) // a bad WAYMARK_* value is reported before connecting
	if err != nil {
		return err
	}
	nc, err := g.connect("waymark-cli")
	if err != nil {
		return err
	}
	defer nc.Close()
	st, err := g.openStore(ctx, nc, cfg, log)
	if err != nil {
		return err
	}
	return fn(client.New(st), st)
}

func newStartCmd(g *globals) *cobra.Command {
	var input, jobID, output string
	var vars, childFiles []string
	var sf stepFlags
	cmd := &cobra.Command{
		Use:   "start WORKFLOW [--input FILE]",
		Short: "Start a job on a running engine and print its id",
		Long: `Start stores WORKFLOW and starts a job of it on the engine behind --nats-url,
then prints the job's id without waiting. Without --input the job's input is {},
as with engine run. Exit status: 0 started (or attached to the job of that
--job-id), 2 bad usage or input, 1 any other error (no server, for one).`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			env, err := sf.env()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			def, err := loadWorkflowForAnyWorker(args[0], env, sf.allowKinds)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			in, err := readInput(input, cmd.InOrStdin())
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			vm, err := parseVars(vars, def)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkJobID(jobID); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := client.CheckInput(def, in); err != nil {
				return &ExitError{Code: 2, Err: inputError(input, in, err)}
			}
			children, err := loadChildren(childFiles, env, sf.allowKinds)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, st *kv.Store) error {
				if err := storeChildren(cmd.Context(), st, args[0], children); err != nil {
					return err
				}
				res, err := c.Start(cmd.Context(), def, in, client.StartOptions{JobID: jobID, Vars: vm})
				if err != nil {
					return startError(input, err)
				}
				if output == "json" {
					return printJSON(g.stdout, res)
				}
				fmt.Fprintln(g.stdout, res.JobID)
				return nil
			})
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&input, "input", "i", "", "job input: a JSON file, or - for stdin (default: {})")
	fl.StringVar(&jobID, "job-id", "", "job id; an existing id attaches to that job")
	fl.StringArrayVar(&vars, "var", nil, "name=value overriding one of the workflow's vars (repeatable)")
	fl.StringVarP(&output, "output", "o", "text", "text (the job id) or json")
	fl.StringArrayVar(&childFiles, "child", nil, "a workflow file that workflow steps start as child jobs, stored before the job starts (repeatable)")
	fl.StringArrayVar(&sf.allowKinds, "allow-kind", nil, "a step kind only remote workers know (repeatable)")
	sf.ModelMode = steps.ModelAuto // not used: the workers' mode is unknown here
	return cmd
}

func newStatusCmd(g *globals) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "status JOB",
		Short: "Show a job: status, resume count, steps and state",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := client.ValidateJobID(args[0]); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				v, err := c.Job(cmd.Context(), args[0])
				if errors.Is(err, schemas.ErrNotFound) {
					return &ExitError{Code: 1, Err: err}
				}
				if err != nil {
					return err
				}
				if output == "json" {
					return printJSON(g.stdout, v)
				}
				printView(g.stdout, v)
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	return cmd
}

// checkStatusFlag checks a --status value (empty: any).
func checkStatusFlag(status string) error {
	switch schemas.JobStatus(status) {
	case "", schemas.JobPending, schemas.JobRunning, schemas.JobCompleted, schemas.JobFailed, schemas.JobCancelled, schemas.JobNeedsReconciliation,
		schemas.JobBlocked, schemas.JobQuarantined, schemas.JobWaitingApproval:
		return nil
	}
	return &ExitError{Code: 2, Err: fmt.Errorf("--status %q: want pending, running, completed, failed, cancelled, needs_reconciliation, blocked, quarantined or waiting_approval", status)}
}

func printView(w io.Writer, v *client.JobView) {
	fmt.Fprintf(w, "job       %s\n", v.ID)
	fmt.Fprintf(w, "workflow  %s v%d (definition %s)\n", v.Workflow, v.Version, v.DefinitionHash[:min(12, len(v.DefinitionHash))])
	fmt.Fprintf(w, "status    %s\n", v.Status)
	fmt.Fprintf(w, "resumes   %d\n", v.ResumeCount)
	fmt.Fprintf(w, "updated   %s (seq %d)\n", v.UpdatedAt.Format(time.RFC3339), v.Seq)
	if v.Error != nil {
		fmt.Fprintf(w, "error     %s\n", v.Error.Error())
	}
	if b := v.Blocked; b != nil {
		// What a person must decide: the effect, its key and class.
		fmt.Fprintf(w, "waits on  effect %s of step %s (%s)", b.EffectKey, b.Step, b.Class)
		if b.Reason != "" {
			fmt.Fprintf(w, ": %s", oneLine(b.Reason, 200))
		}
		fmt.Fprintln(w)
		if b.LastError != nil {
			fmt.Fprintf(w, "          last error: %s\n", oneLine(b.LastError.Error(), 200))
		}
		fmt.Fprintf(w, "          settle it: engine effects resolve %s --happened|--not-happened\n", b.EffectKey)
	}
	if v.BlockedReason != "" {
		fmt.Fprintf(w, "blocked   %s\n", oneLine(v.BlockedReason, 300))
	}
	if p := v.Paused; p != nil {
		fmt.Fprintf(w, "paused    %s at %s", who(p.By, p.Reason), p.At.UTC().Format(time.RFC3339))
		if v.Current != nil && v.Current.Held {
			fmt.Fprintf(w, "; %s held until engine resume %s", v.Current.Step, v.ID)
		}
		fmt.Fprintln(w)
	}
	for _, wd := range v.Waiting {
		step := wd.Step
		if wd.Item > 0 {
			step += fmt.Sprintf(" item %d", wd.Item)
		}
		fmt.Fprintf(w, "waiting   %s (attempt %d), since %s: %s\n", step, wd.Attempt, wd.Flow.Since.UTC().Format(time.RFC3339), oneLine(wd.Reason, 300))
	}
	for _, line := range approvalLines(v) {
		fmt.Fprintf(w, "approval  %s\n", oneLine(line, 400))
	}
	for _, a := range v.Approvals {
		if a.Status == schemas.ApprovalPending {
			fmt.Fprintf(w, "          decide: engine approve %s %s (or engine reject)\n", v.ID, a.Gate)
		}
	}
	if v.Retries > 0 {
		fmt.Fprintf(w, "retries   %d\n", v.Retries)
	}
	if v.ParentJob != "" {
		fmt.Fprintf(w, "parent    %s (step %s)\n", v.ParentJob, v.ParentStep)
	}
	for _, c := range v.Children {
		fmt.Fprintf(w, "child     %s\n", c)
	}
	if cw := v.WaitingChild; cw != nil {
		fmt.Fprintf(w, "waits on  child %s, which is %s", cw.Job, cw.Status)
		if cw.Blocked != nil {
			fmt.Fprintf(w, " (effect %s of step %s)", cw.Blocked.EffectKey, cw.Blocked.Step)
		}
		fmt.Fprintln(w)
	}
	if f := v.Fan; f != nil && f.Agent != nil {
		a := f.Agent
		u := a.TotalUsage()
		fmt.Fprintf(w, "agent     %s: turn %d, %d tool calls (%d refused, %d failed), %d tokens, cost %.4f", f.Step, a.Turn, a.ToolCalls, a.InvalidCalls, a.ToolErrors, u.Total(), a.Cost)
		if len(a.Calls) > 0 {
			done := 0
			for _, c := range a.Calls {
				if c.Done {
					done++
				}
			}
			fmt.Fprintf(w, "; this turn's calls: %d done, %d running", done, f.Running)
		} else if f.Running > 0 {
			fmt.Fprintf(w, "; turn %d in flight", a.Turn+1)
		}
		if f.Blocked > 0 {
			fmt.Fprintf(w, ", %d waiting for a person", f.Blocked)
		}
		fmt.Fprintln(w)
	} else if f != nil {
		fmt.Fprintf(w, "%-9s %s: %d %s, %d completed, %d running (%d retrying), %d failed", f.Kind, f.Step, f.Total, map[string]string{"map": "items", "parallel": "branches"}[f.Kind], f.Completed, f.Running, f.Retrying, f.Failed)
		if f.Pending > 0 {
			fmt.Fprintf(w, ", %d pending", f.Pending)
		}
		if f.Cancelled > 0 {
			fmt.Fprintf(w, ", %d cancelled", f.Cancelled)
		}
		if f.Blocked > 0 {
			fmt.Fprintf(w, ", %d waiting for a person", f.Blocked)
		}
		fmt.Fprintln(w)
	}
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nSTEP\tKIND\tSTATUS\tATTEMPTS\tLAST")
	for _, s := range v.Steps {
		last := ""
		if s.LastError != nil {
			last = oneLine(s.LastError.Error(), 100)
		} else if s.DurationMs > 0 {
			last = fmt.Sprintf("%dms", s.DurationMs)
		}
		st := string(s.Status)
		if v.Current != nil && v.Current.Held && v.Current.Step == s.ID {
			st = "held" // recorded while paused, not sent
		}
		if v.Current != nil && v.Current.Waiting != nil && v.Current.Step == s.ID {
			st = "waiting" // recorded, not sent: a flow limit has no room
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", s.ID, s.Kind, st, s.Attempts, last)
	}
	_ = tw.Flush()
	fmt.Fprintln(w, "\nstate:")
	_ = printJSON(w, v.State)
}

func newListCmd(g *globals) *cobra.Command {
	var output, status, workflow, after string
	var limit int
	cmd := &cobra.Command{
		Use:   "list [--status S] [--workflow W] [--limit N] [--after CURSOR]",
		Short: "List jobs, newest first, a page at a time",
		Long: `List jobs, newest first: jobs still running (or waiting) in the order they were
created, finished jobs in the order they finished. Each page ends with the cursor
of the next one (--after); it reads the job index, not every checkpoint.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkStatusFlag(status); err != nil {
				return err
			}
			if limit < 1 || limit > 10000 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--limit %d: want 1..10000", limit)}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				page, err := c.List(cmd.Context(), client.ListFilter{Status: schemas.JobStatus(status), Workflow: workflow, Limit: limit, After: after})
				if errors.Is(err, schemas.ErrInputInvalid) {
					flag := "--after"
					if strings.Contains(err.Error(), "workflow name") {
						flag = "--workflow"
					}
					return &ExitError{Code: 2, Err: fmt.Errorf("%s: %w", flag, err)}
				}
				if err != nil {
					return err
				}
				if output == "json" {
					return printJSON(g.stdout, page)
				}
				tw := tabwriter.NewWriter(g.stdout, 2, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "JOB\tWORKFLOW\tSTATUS\tSTEP\tRESUMES\tUPDATED")
				for _, j := range page.Jobs {
					step := j.CurrentStep
					if j.Waiting != "" {
						// The summary names its step first; the column has it.
						step += " (waiting: " + oneLine(strings.TrimPrefix(j.Waiting, j.CurrentStep+": "), 80) + ")"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", j.ID, j.Workflow, j.Status, step, j.ResumeCount, j.UpdatedAt.Format(time.RFC3339))
				}
				if err := tw.Flush(); err != nil {
					return err
				}
				if page.Cursor != "" {
					fmt.Fprintf(g.stdout, "more: --after %s\n", page.Cursor)
				}
				return nil
			})
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&output, "output", "o", "text", "text or json")
	fl.StringVar(&status, "status", "", "only jobs with this status (pending, running, completed, failed, cancelled, needs_reconciliation, blocked, quarantined, waiting_approval)")
	fl.StringVar(&workflow, "workflow", "", "only jobs of this workflow")
	fl.IntVar(&limit, "limit", 100, "jobs per page (1..10000)")
	fl.StringVar(&after, "after", "", "continue a listing: the cursor the previous page printed")
	return cmd
}

func newHistoryCmd(g *globals) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "history JOB",
		Short: "Print a job's history: every transition, in order",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := client.ValidateJobID(args[0]); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, st *kv.Store) error {
				if _, err := st.Checkpoints.Get(cmd.Context(), args[0]); err != nil {
					return &ExitError{Code: 1, Err: err}
				}
				evs, err := c.History(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				if output == "json" {
					if evs == nil {
						evs = []schemas.HistoryEvent{}
					}
					return printJSON(g.stdout, map[string]any{"events": evs})
				}
				for _, h := range evs {
					seq := "seq " + strconv.FormatUint(h.Data.Seq, 10)
					if h.Data.Seq == 0 {
						seq = "ledger" // effect events are not checkpoint transitions
					}
					for i, row := range historyRows(h) {
						typ := strings.TrimPrefix(h.Type, "dev.waymark.")
						if i > 0 {
							typ = "step.dispatched" // the next step, dispatched by the same transition
						}
						fmt.Fprintf(g.stdout, "%s  %-8s %-26s %s\n", h.Time.Local().Format("15:04:05.000"), seq, typ, row)
					}
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	return cmd
}

// historyRows are the rows engine history prints for h: what printEvent
// prints, one row per line (a transition that dispatched the next step has
// a row for that dispatch), or, for an event it prints nothing for, its
// step and attempt and what happened.
func historyRows(h schemas.HistoryEvent) []string {
	var b strings.Builder
	printEvent(&b, h)
	var rows []string
	for _, l := range strings.Split(strings.TrimRight(b.String(), "\n"), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			rows = append(rows, l)
		}
	}
	if len(rows) > 0 {
		return rows
	}
	d := h.Data
	what := strings.TrimPrefix(h.Type, "dev.waymark.")
	switch {
	case strings.HasPrefix(what, "effect."):
		what = "effect " + strings.TrimPrefix(what, "effect.") + " " + d.EffectKey
	case h.Type == schemas.EventJobStarted:
		what = "started"
	case h.Type == schemas.EventJobCompleted:
		what = "completed"
	}
	if d.Reason != "" {
		what += ": " + oneLine(d.Reason, 200)
	}
	if d.Step == "" {
		return []string{what}
	}
	return []string{fmt.Sprintf("%-20s attempt %-3d %s", d.Step, d.Attempt, what)}
}

func newValidateCmd(g *globals) *cobra.Command {
	var input string
	var childFiles []string
	var strict bool
	var sf stepFlags
	cmd := &cobra.Command{
		Use:   "validate WORKFLOW [--input FILE]",
		Short: "Check a workflow definition (and an input) without running anything",
		Long: `Validate loads WORKFLOW with every check the engine and the built-in step kinds
make: the schema, step references, transition conditions (compiled, and
type-checked against state_schema, output_schema and vars), step settings, and
the fields templates read (against state_schema). What the schemas leave open,
and model steps that some workers cannot run (no cassette for replay mode), are
warnings, printed to stderr. Exit status: 0 valid (warnings included, unless
--strict), 2 invalid.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			sf.ModelMode = steps.ModelAuto
			env, _ := sf.env()
			def, err := loadWorkflowForAnyWorker(args[0], env, sf.allowKinds)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			children, err := loadChildren(childFiles, env, sf.allowKinds)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			warnings := def.Warnings()
			// Without a store, a child workflow that is not a --child file
			// cannot be checked: a warning (run and start refuse it unless
			// it is stored).
			given := func(name string) bool { _, ok := children[name]; return ok }
			if cd, err := schemas.Load(args[0], schemas.LoadOptions{Checks: []schemas.CheckFunc{asWarnings(childCheck(given))}}); err == nil {
				warnings = append(warnings, cd.Warnings()...)
			}
			for _, w := range warnings {
				fmt.Fprintln(g.stderr, w.Format(args[0]))
			}
			if strict && len(warnings) > 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("%s: %s (--strict)", args[0], plural(len(warnings), "warning", "warnings"))}
			}
			if input != "" {
				in, err := readInput(input, cmd.InOrStdin())
				if err != nil {
					return &ExitError{Code: 2, Err: err}
				}
				if err := client.CheckInput(def, in); err != nil {
					return &ExitError{Code: 2, Err: inputError(input, in, err)}
				}
			}
			warned := ""
			if n := len(warnings); n > 0 {
				warned = ", " + plural(n, "warning", "warnings")
			}
			fmt.Fprintf(g.stdout, "%s: ok (%s v%d, %s, definition %s%s)\n", args[0], def.Name, def.Version, plural(len(def.Steps), "step", "steps"), def.Hash[:12], warned)
			return nil
		},
	}
	cmd.Flags().StringVarP(&input, "input", "i", "", "also check this input against the input schema")
	cmd.Flags().BoolVar(&strict, "strict", false, "treat warnings as errors (exit status 2)")
	cmd.Flags().StringArrayVar(&childFiles, "child", nil, "a workflow file that workflow steps start as child jobs (repeatable); others are warned about")
	cmd.Flags().StringArrayVar(&sf.allowKinds, "allow-kind", nil, "a step kind only remote workers know (repeatable)")
	return cmd
}

// startError gives an error of Client.Start its exit status: 2 for what
// the request got wrong (input, size, a job id taken by another job), 1
// otherwise. input is the --input flag.
func startError(input string, err error) error {
	switch {
	case errors.Is(err, schemas.ErrTooLarge):
		return &ExitError{Code: 2, Err: &inputErr{msg: fmt.Sprintf("input %s: %s", inputName(input), schemas.AsError(err).Message), cause: err}}
	case errors.Is(err, schemas.ErrInputInvalid), errors.Is(err, schemas.ErrConflict):
		return &ExitError{Code: 2, Err: err}
	}
	return err
}

// plural returns "1 step" or "n steps".
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.Itoa(n) + " " + many
}
