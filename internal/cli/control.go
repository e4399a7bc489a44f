package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// controlOp is one of the commands that act on jobs by id or, in bulk,
// by filter: cancel, pause, resume, retry.
type controlOp struct {
	name, use, short, long string
	// bulkStatus is the status a bulk form selects when --status is not
	// given ("" : every job of the workflow).
	bulkStatus schemas.JobStatus
	// call acts on one job and says what it did ("" when nothing).
	call func(ctx context.Context, c *client.Client, id string, r client.ControlRequest) (*client.JobView, string, error)
	// applies says whether a job listed as s would be acted on (dry run).
	applies func(s client.JobSummary) bool
}

func newControlCmd(g *globals, op controlOp) *cobra.Command {
	var output, by, reason, from, workflow, status string
	var timeout time.Duration
	var dryRun bool
	cmd := &cobra.Command{
		Use:   op.use,
		Short: op.short,
		Long:  op.long,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 1 || (len(args) == 0 && workflow == "" && status == "") || (len(args) == 1 && (workflow != "" || status != "")) {
				return &ExitError{Code: 2, Err: fmt.Errorf("name one job, or select jobs with --workflow and --status (usage: %s)", cmd.UseLine())}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBy(cmd, &by); err != nil {
				return err
			}
			if timeout <= 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--timeout %v: want a positive duration", timeout)}
			}
			if err := checkStatusFlag(status); err != nil {
				return err
			}
			if dryRun && len(args) == 1 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--dry-run is for the bulk form (--workflow, --status)")}
			}
			req := client.ControlRequest{By: by, Reason: reason, From: from}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				if len(args) == 1 {
					return g.controlOne(cmd.Context(), c, op, args[0], req, timeout, output)
				}
				st := schemas.JobStatus(status)
				if st == "" {
					st = op.bulkStatus
				}
				return g.controlBulk(cmd.Context(), c, op, client.ListFilter{Workflow: workflow, Status: st}, req, timeout, dryRun, output)
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().StringVar(&by, "by", "", "who does it (default: the current user)")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the record")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for an engine to record it, per job")
	cmd.Flags().StringVar(&workflow, "workflow", "", "bulk: the jobs of this workflow")
	cmd.Flags().StringVar(&status, "status", "", "bulk: the jobs with this status"+map[bool]string{true: " (default " + string(op.bulkStatus) + ")", false: ""}[op.bulkStatus != ""])
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "bulk: list the jobs it would act on, act on none")
	if op.name == "retry" {
		cmd.Flags().StringVar(&from, "from", "", "the step to go on from (default: the step that failed)")
	}
	return cmd
}

// controlOne acts on job id and prints the outcome.
func (g *globals) controlOne(ctx context.Context, c *client.Client, op controlOp, id string, req client.ControlRequest, timeout time.Duration, output string) error {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	v, done, err := op.call(cctx, c, id, req)
	if err != nil {
		return controlExit(op.name, id, timeout, err)
	}
	if output == "json" {
		return printJSON(g.stdout, v)
	}
	fmt.Fprintf(g.stdout, "job %s %s\n", id, done)
	return nil
}

// controlExit maps an error of op on job id to an exit status: 2 for bad
// input, 130 when the request waits in the inbox past timeout, 1 else.
func controlExit(op, id string, timeout time.Duration, err error) error {
	switch {
	case errors.Is(err, context.DeadlineExceeded) && (errors.Is(err, client.ErrControlPending) || errors.Is(err, client.ErrCancelPending)):
		return &ExitError{Code: 130, Err: fmt.Errorf("--timeout %v passed before an engine recorded the %s of %s: it waits in the job's inbox, and the next engine to run applies it", timeout, op, id)}
	case schemas.AsError(err).Code == schemas.CodeInputInvalid:
		return &ExitError{Code: 2, Err: err}
	}
	return &ExitError{Code: 1, Err: err}
}

// controlBulk acts on every job f selects (or lists them, dryRun).
func (g *globals) controlBulk(ctx context.Context, c *client.Client, op controlOp, f client.ListFilter, req client.ControlRequest, timeout time.Duration, dryRun bool, output string) error {
	var jobs []client.JobSummary
	for {
		page, err := c.List(ctx, f)
		if err != nil {
			return controlExit(op.name, "the jobs selected", timeout, err)
		}
		jobs = append(jobs, page.Jobs...)
		if page.Cursor == "" {
			break
		}
		f.After = page.Cursor
	}
	type outcome struct {
		Job    string `json:"job"`
		Status string `json:"status"`
		Done   string `json:"done,omitempty"`
		Error  string `json:"error,omitempty"`
	}
	var out []outcome
	failed, skipped := 0, 0
	for _, s := range jobs {
		if dryRun {
			if op.applies(s) {
				out = append(out, outcome{Job: s.ID, Status: string(s.Status), Done: "would " + op.name})
			}
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, timeout)
		v, done, err := op.call(cctx, c, s.ID, req)
		cancel()
		o := outcome{Job: s.ID, Status: string(s.Status), Done: done}
		if v != nil {
			o.Status = string(v.Status)
		}
		if err != nil {
			if errors.Is(err, client.ErrNotApplicable) {
				// Not one the request applies to (paused already, say).
				o.Done = "skipped: " + strings.TrimPrefix(strings.TrimSuffix(err.Error(), ": "+client.ErrNotApplicable.Error()), op.name+" job "+s.ID+": ")
				skipped++
				out = append(out, o)
				continue
			}
			o.Error, o.Done = err.Error(), ""
			failed++
		}
		out = append(out, o)
	}
	if output == "json" {
		if out == nil {
			out = []outcome{}
		}
		if err := printJSON(g.stdout, map[string]any{"dry_run": dryRun, "jobs": out}); err != nil {
			return err
		}
	} else {
		for _, o := range out {
			if o.Error != "" {
				fmt.Fprintf(g.stdout, "%s: %s\n", o.Job, o.Error)
				continue
			}
			fmt.Fprintf(g.stdout, "%s: %s\n", o.Job, o.Done)
		}
		verb := map[bool]string{true: "would be", false: "were"}[dryRun]
		fmt.Fprintf(g.stdout, "%d of %d jobs selected %s acted on (%s)", len(out)-failed-skipped, len(jobs), verb, op.name)
		if skipped > 0 {
			fmt.Fprintf(g.stdout, ", %d skipped", skipped)
		}
		fmt.Fprintln(g.stdout)
	}
	if failed > 0 {
		return &ExitError{Code: 1, Err: fmt.Errorf("%s failed for %d of the jobs selected", op.name, failed)}
	}
	return nil
}

// checkBy fills an absent --by with the current user; an empty one given
// is refused (exit 2).
func checkBy(cmd *cobra.Command, by *string) error {
	if strings.TrimSpace(*by) != "" {
		return nil
	}
	if cmd.Flags().Changed("by") {
		return &ExitError{Code: 2, Err: fmt.Errorf("--by is empty: say who does it (or leave --by out for the current user)")}
	}
	*by = whoami()
	return nil
}

// saying makes the call of a control op that says what it did as done
// "by WHO: WHY".
func saying(call func(*client.Client, context.Context, string, client.ControlRequest) (*client.JobView, error), done string) func(context.Context, *client.Client, string, client.ControlRequest) (*client.JobView, string, error) {
	return func(ctx context.Context, c *client.Client, id string, r client.ControlRequest) (*client.JobView, string, error) {
		v, err := call(c, ctx, id, r)
		if err != nil {
			return nil, "", err
		}
		return v, done + " " + who(r.By, r.Reason), nil
	}
}

func who(by, reason string) string {
	s := "by " + by
	if reason != "" {
		s += ": " + reason
	}
	return s
}

func newCancelCmd(g *globals) *cobra.Command {
	return newControlCmd(g, controlOp{
		name:  "cancel",
		use:   "cancel JOB | --workflow NAME [--status S] [--dry-run] [--reason TEXT] [--by WHO]",
		short: "Cancel a job: nothing more is dispatched, its child jobs are cancelled too",
		long: `Cancel records that WHO cancelled JOB and why, and waits for the engine to do
it: the job ends cancelled (a terminal status, like completed and failed);
nothing more of it is dispatched; results of steps in flight are dropped when
they come (an effect in flight is in the ledger as whatever it became: the
job.cancelled event lists what was in flight, and engine effects list --job
shows their records); child jobs in flight are cancelled too. A job that
had already completed or failed is left as it is (exit 1). Exit 0 once
cancelled; 130 when --timeout passes first (the cancel then waits in the
job's inbox and the next engine to run applies it).

With --workflow and/or --status instead of JOB, every job selected is
cancelled (--dry-run lists them and changes nothing).`,
		call: func(ctx context.Context, c *client.Client, id string, r client.ControlRequest) (*client.JobView, string, error) {
			v, err := c.Cancel(ctx, id, client.CancelRequest{By: r.By, Reason: r.Reason})
			if err != nil {
				return nil, "", err
			}
			if v.Status != schemas.JobCancelled {
				return v, "", fmt.Errorf("job %s had already %s: left as it is: %w", v.ID, v.Status, client.ErrNotApplicable)
			}
			return v, "cancelled " + v.Error.Message, nil
		},
		applies: func(s client.JobSummary) bool { return !s.Status.Terminal() },
	})
}

func newPauseCmd(g *globals) *cobra.Command {
	return newControlCmd(g, controlOp{
		name:  "pause",
		use:   "pause JOB | --workflow NAME [--status S] [--dry-run] [--reason TEXT] [--by WHO]",
		short: "Pause a job: running steps finish, nothing new is dispatched until resume",
		long: `Pause holds JOB: the steps in flight run to their end and their results are
applied, but whatever the job would dispatch next is recorded as held and not
sent (engine status shows "paused" and the held dispatch). engine resume sends
it. A gate can still be approved while paused. Exit 0 once the engine recorded
it; 1 for a job that ended or is paused already; 130 when --timeout passes
first (the request waits in the job's inbox).

With --workflow and/or --status (default running) instead of JOB, every job
selected is paused (--dry-run lists them and changes nothing).`,
		bulkStatus: schemas.JobRunning,
		call:       saying((*client.Client).Pause, "paused"),
		applies:    func(s client.JobSummary) bool { return !s.Status.Terminal() },
	})
}

func newResumeCmd(g *globals) *cobra.Command {
	return newControlCmd(g, controlOp{
		name:  "resume",
		use:   "resume JOB | --workflow NAME [--status S] [--dry-run] [--by WHO]",
		short: "Resume a paused job: its held dispatches are sent",
		long: `Resume lifts engine pause: the dispatches recorded while the job was paused
are sent, and it goes on. Exit 0 once recorded; 1 for a job that is not
paused; 130 when --timeout passes first.

With --workflow and/or --status instead of JOB, every paused job selected is
resumed (--dry-run lists the jobs it would try).`,
		call:    saying((*client.Client).Resume, "resumed"),
		applies: func(s client.JobSummary) bool { return !s.Status.Terminal() },
	})
}

func newRetryCmd(g *globals) *cobra.Command {
	return newControlCmd(g, controlOp{
		name:  "retry",
		use:   "retry JOB [--from STEP] | --workflow NAME [--dry-run] [--reason TEXT] [--by WHO]",
		short: "Retry a failed job from its failed step, or from an earlier one",
		long: `Retry reopens a failed JOB: it goes on from the step that failed (or --from
STEP) with a fresh retry budget, under new attempts. Every step it reaches
again runs under the idempotency key of its last run, so an effect the ledger
holds as confirmed answers with its recorded result and is not performed
again; one that was refused or never made is performed. Exit 0 once the engine
reopened it; 1 for a job that did not fail; 2 for a --from that is not a step.

With --workflow and/or --status (default failed) instead of JOB, every failed
job selected is retried (--dry-run lists them and changes nothing).`,
		bulkStatus: schemas.JobFailed,
		call: func(ctx context.Context, c *client.Client, id string, r client.ControlRequest) (*client.JobView, string, error) {
			v, err := c.Retry(ctx, id, r)
			if err != nil {
				return nil, "", err
			}
			at := r.From
			if at == "" && v.Current != nil {
				at = v.Current.Step
			}
			done := "retried " + who(r.By, r.Reason)
			if at != "" {
				done = "retried from " + at + " " + who(r.By, r.Reason)
			}
			return v, fmt.Sprintf("%s (retry %d)", done, v.Retries), nil
		},
		applies: func(s client.JobSummary) bool { return s.Status == schemas.JobFailed },
	})
}

func newDecisionCmd(g *globals, approve bool) *cobra.Command {
	var output, by, reason, digest string
	var timeout time.Duration
	name, verb := "approve", "Approve"
	if !approve {
		name, verb = "reject", "Reject"
	}
	cmd := &cobra.Command{
		Use:   name + " JOB GATE [--reason TEXT] [--by WHO] [--digest HEX]",
		Short: verb + " a job's open approval gate",
		Long: verb + ` the approval gate GATE (the step id engine status lists under
approvals) of JOB, as WHO. The decision binds to the gate's digest: with
--digest, the one you reviewed, and a gate whose action changed since is
refused. Approved, the gate's step goes on (an approval step completes; a step
with requires_approval starts its run); rejected, it fails with code
approval_rejected and the job follows the step's on_error, or fails. A gate
decided before answers "already decided" and nothing changes; one past its
expiry (by the engine's clock) is refused and the job follows the expiry path.
Exit 0 once decided; 1 when refused; 130 when --timeout passes first.`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBy(cmd, &by); err != nil {
				return err
			}
			if timeout <= 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--timeout %v: want a positive duration", timeout)}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
				defer cancel()
				decide := c.Approve
				if !approve {
					decide = c.Reject
				}
				v, err := decide(ctx, args[0], args[1], client.ControlRequest{By: by, Reason: reason, Digest: digest})
				if err != nil {
					if v != nil && output == "json" {
						_ = printJSON(g.stdout, v)
					}
					return controlExit(name, args[0], timeout, err)
				}
				if output == "json" {
					return printJSON(g.stdout, v)
				}
				fmt.Fprintf(g.stdout, "job %s gate %s %s %s; job %s\n", args[0], args[1], map[bool]string{true: "approved", false: "rejected"}[approve], who(by, reason), v.Status)
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().StringVar(&by, "by", "", "who decides (default: the current user)")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the record")
	cmd.Flags().StringVar(&digest, "digest", "", "the digest of the action you reviewed (engine status lists it)")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for an engine to record it")
	return cmd
}

// approvalLines describes v's approval gates for engine status.
func approvalLines(v *client.JobView) []string {
	var out []string
	for _, a := range v.Approvals {
		line := fmt.Sprintf("gate %s (%s): %s", a.ID, a.Status, a.Action)
		switch {
		case a.Status == schemas.ApprovalPending && a.ExpiresAt != nil:
			line += ", expires " + a.ExpiresAt.UTC().Format(time.RFC3339)
		case a.DecidedBy != "":
			line += ", " + string(a.Status) + " " + who(a.DecidedBy, a.Reason)
		case a.Reason != "":
			line += ", " + a.Reason
		}
		if len(a.Approvers) > 0 && a.Status == schemas.ApprovalPending {
			line += "; approvers: " + strings.Join(a.Approvers, ", ")
		}
		out = append(out, line+"; digest "+a.Digest)
	}
	return out
}

func newSignalCmd(g *globals) *cobra.Command {
	var output, by, data, sigID, start, input string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "signal JOB NAME [--data FILE] [--id ID] [--start WORKFLOW [--input FILE]]",
		Short: "Send a named signal to a job's wait steps",
		Long: `Signal sends the signal NAME, with the JSON in --data (a file, or - for stdin;
default null), to JOB and waits until the engine recorded it: the wait step for
NAME the job is at takes it (its output is {signal, id, data, by, at}), or it is
kept until the job reaches one (a signal that comes first is not lost; a
checkpoint keeps 32). The data is checked against the wait steps' schema
before it is sent. --id names the signal, so that sending it again (a retried
webhook) is one signal. With --start WORKFLOW, the job is started first when it
does not exist (signal-with-start; an existing job is attached to, as engine
start --job-id does). Exit 0 once recorded; 1 for an ended job, a name no wait
step has, or a signal the engine refused; 2 for bad input; 130 when --timeout
passes first.`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBy(cmd, &by); err != nil {
				return err
			}
			if timeout <= 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--timeout %v: want a positive duration", timeout)}
			}
			var raw json.RawMessage
			if data != "" {
				var err error
				if raw, err = readInput(data, cmd.InOrStdin()); err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("--data: %w", err)}
				}
			}
			var def *schemas.Definition
			var in json.RawMessage
			if start != "" {
				var err error
				if def, err = loadWorkflowForAnyWorker(start, nil, nil); err != nil {
					return &ExitError{Code: 2, Err: err}
				}
				if in, err = readInput(input, cmd.InOrStdin()); err != nil {
					return &ExitError{Code: 2, Err: err}
				}
				if err := client.CheckInput(def, in); err != nil {
					return &ExitError{Code: 2, Err: inputError(input, in, err)}
				}
			} else if input != "" {
				return &ExitError{Code: 2, Err: fmt.Errorf("--input is for --start")}
			}
			req := client.SignalRequest{Name: args[1], Data: raw, By: by, ID: sigID}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
				defer cancel()
				var v *client.JobView
				var rs *schemas.ReceivedSignal
				var err error
				if def != nil {
					var res client.StartResult
					res, v, rs, err = c.SignalWithStart(ctx, def, in, client.StartOptions{JobID: args[0]}, req)
					if err == nil && !res.Attached && output != "json" {
						fmt.Fprintf(g.stdout, "job %s started\n", args[0])
					}
				} else {
					v, rs, err = c.Signal(ctx, args[0], req)
				}
				if err != nil {
					return controlExit("signal", args[0], timeout, err)
				}
				if output == "json" {
					return printJSON(g.stdout, map[string]any{"signal": rs, "job": v})
				}
				what := "kept until the job reaches a wait step for it"
				switch {
				case rs.Outcome == "received before" && rs.Taken != "":
					what = "was received before (taken by wait step " + rs.Taken + " at " + rs.At.UTC().Format(time.RFC3339) + "): nothing changed; send a new --id to deliver it again"
				case rs.Outcome == "received before":
					what = "was received before: nothing changed"
				case rs.Taken != "":
					what = "taken by wait step " + rs.Taken
				}
				fmt.Fprintf(g.stdout, "job %s signal %s (id %s) %s; job %s\n", args[0], rs.Name, rs.ID, what, v.Status)
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().StringVar(&by, "by", "", "who sends it (default: the current user)")
	cmd.Flags().StringVar(&data, "data", "", "the signal's data: a JSON file, or - for stdin (default: null)")
	cmd.Flags().StringVar(&sigID, "id", "", "the signal's id: sending the same id again is one signal (default: a new one)")
	cmd.Flags().StringVar(&start, "start", "", "a workflow file: start JOB of it first when it does not exist")
	cmd.Flags().StringVarP(&input, "input", "i", "", "with --start: the job's input, a JSON file or - (default: {})")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for an engine to record it")
	return cmd
}

func newInspectCmd(g *globals) *cobra.Command {
	var output string
	var at uint64
	cmd := &cobra.Command{
		Use:   "inspect JOB --at SEQ",
		Short: "Show a job as it stood at a checkpoint sequence, rebuilt from its history",
		Long: `Inspect rebuilds JOB at sequence SEQ (engine history lists them) from its
history: the input, then each transition's state change. It shows the status,
the state, the steps reached and where each stood, the step the job was at (where
engine rewind and engine fork go on from), and the effects the ledger confirmed
after SEQ. Exit 0; 1 for an unknown job; 2 for a sequence the job never reached.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if !cmd.Flags().Changed("at") {
				return &ExitError{Code: 2, Err: fmt.Errorf("--at SEQ is required (engine history lists the sequences)")}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				s, err := c.StateAt(cmd.Context(), args[0], at)
				if err != nil {
					return controlExit("inspect", args[0], time.Minute, err)
				}
				if output == "json" {
					return printJSON(g.stdout, s)
				}
				printSnapshot(g, s)
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().Uint64Var(&at, "at", 0, "the checkpoint sequence")
	return cmd
}

func printSnapshot(g *globals, s *client.Snapshot) {
	w := g.stdout
	fmt.Fprintf(w, "job       %s at seq %d of %d (%s)\n", s.Job, s.Seq, s.LastSeq, s.At.UTC().Format(time.RFC3339))
	fmt.Fprintf(w, "status    %s\n", s.Status)
	if s.Next != "" {
		fmt.Fprintf(w, "at step   %s\n", s.Next)
	} else if s.Why != "" {
		fmt.Fprintf(w, "at step   none: %s\n", s.Why)
	}
	ids := make([]string, 0, len(s.Steps))
	for id := range s.Steps {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		fmt.Fprintf(w, "step      %s %s (runs ended: %d)\n", id, s.Steps[id], s.Runs[id])
	}
	for _, e := range s.EffectsAfter {
		fmt.Fprintf(w, "later     effect %s of %s %s %s\n", e.Key, e.Step, e.State, e.ExternalID)
	}
	fmt.Fprintln(w, "state:")
	_ = printJSON(w, s.State)
}

func newRewindCmd(g *globals) *cobra.Command {
	var output, by, reason string
	var to uint64
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "rewind JOB --to SEQ [--reason TEXT] [--by WHO]",
		Short: "Set a job back to a checkpoint sequence and let it go on from there",
		Long: `Rewind sets JOB back to sequence SEQ: its state then (rebuilt from the history,
as engine inspect shows it) and each step's runs then, and the job goes on
from the step it was at. A step it runs again reuses the idempotency key of
that run: an effect the ledger confirmed after SEQ is answered from the ledger
with its recorded result and is not performed again (rewind lists them). The
job must have completed or failed, wait for approval, or be paused (engine
pause it first; what was in flight is dropped); open gates of the timeline
left behind expire. Exit 0 once the engine recorded it; 1 when the job is in
another state; 2 for a sequence at which the job was at no single step.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBy(cmd, &by); err != nil {
				return err
			}
			if !cmd.Flags().Changed("to") {
				return &ExitError{Code: 2, Err: fmt.Errorf("--to SEQ is required (engine history lists the sequences)")}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
				defer cancel()
				res, err := c.Rewind(ctx, args[0], to, client.ControlRequest{By: by, Reason: reason})
				if err != nil {
					return controlExit("rewind", args[0], timeout, err)
				}
				if output == "json" {
					return printJSON(g.stdout, res)
				}
				fmt.Fprintf(g.stdout, "job %s rewound to seq %d, going on from %s; job %s\n", args[0], to, res.Snapshot.Next, res.Job.Status)
				for _, e := range res.Snapshot.EffectsAfter {
					fmt.Fprintf(g.stdout, "  effect %s (%s, %s) is answered from the ledger, not performed again\n", e.Key, e.Step, e.State)
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().Uint64Var(&to, "to", 0, "the checkpoint sequence to go back to")
	cmd.Flags().StringVar(&by, "by", "", "who does it (default: the current user)")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the record")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for an engine to record it")
	return cmd
}

func newForkCmd(g *globals) *cobra.Command {
	var output, by, jobID string
	var from uint64
	var sets []string
	cmd := &cobra.Command{
		Use:   "fork JOB --from SEQ [--set PATH=JSON]... [--job-id ID]",
		Short: "Start a new job from a job as it stood at a checkpoint sequence",
		Long: `Fork starts a new job from JOB as it stood at sequence SEQ: the same pinned
definition and vars, the state then with each --set applied (a dotted state
path and a JSON value: --set quote.amount=50, --set 'note="again"'), starting
at the step JOB was at. JOB is not changed, and goes on if it runs. engine
status shows the fork's origin under fork. A run of a step that JOB had
reached when the fork was taken takes JOB's idempotency key, so an effect JOB
confirmed is answered from the ledger and never made twice; later runs are the
fork's own. Prints the new job's id. Exit 0; 1 for an unknown job; 2 for a bad
--set or a sequence at which the job was at no single step.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBy(cmd, &by); err != nil {
				return err
			}
			if !cmd.Flags().Changed("from") {
				return &ExitError{Code: 2, Err: fmt.Errorf("--from SEQ is required (engine history lists the sequences)")}
			}
			set := map[string]json.RawMessage{}
			for _, s := range sets {
				path, val, ok := strings.Cut(s, "=")
				if !ok || path == "" {
					return &ExitError{Code: 2, Err: fmt.Errorf("--set %q: want PATH=JSON (quote.amount=50)", s)}
				}
				if !json.Valid([]byte(val)) {
					return &ExitError{Code: 2, Err: fmt.Errorf("--set %s: %q is not JSON (a string needs its quotes: --set '%s=\"text\"')", path, val, path)}
				}
				set[path] = json.RawMessage(val)
			}
			return g.withClient(cmd.Context(), func(c *client.Client, _ *kv.Store) error {
				res, err := c.Fork(cmd.Context(), args[0], from, client.ForkRequest{JobID: jobID, By: by, Set: set})
				if err != nil {
					return controlExit("fork", args[0], time.Minute, err)
				}
				if output == "json" {
					return printJSON(g.stdout, res)
				}
				fmt.Fprintln(g.stdout, res.JobID)
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text (the new job's id) or json")
	cmd.Flags().Uint64Var(&from, "from", 0, "the checkpoint sequence to fork at")
	cmd.Flags().StringArrayVar(&sets, "set", nil, "PATH=JSON: a state change for the fork (repeatable)")
	cmd.Flags().StringVar(&jobID, "job-id", "", "the new job's id (default: JOB-fork-SEQ-…)")
	cmd.Flags().StringVar(&by, "by", "", "who forks it (default: the current user)")
	return cmd
}

func newScheduleCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "schedule",
		Short: "Cron schedules: start a job of a workflow at each firing",
		Long: `A cron schedule starts a job of its workflow (the definition of that name
stored last) at each firing, with the schedule's input, under the id
<name>-<firing time, UTC, to the second>: the same firing delivered twice
starts one job. Schedules are JetStream message schedules in WAYMARK_TIMERS;
the NATS server's clock fires them. Firings that come while no engine runs
roll up into one: the next engine starts one job for them, not one each.`,
	}
	requireSubcommand(cmd)
	var input, tz, output string
	var vars []string
	add := &cobra.Command{
		Use:   "add NAME WORKFLOW --cron EXPR [--input FILE] [--tz ZONE]",
		Short: "Store (or replace) a cron schedule",
		Long: `Add stores WORKFLOW and the schedule NAME (1 to 64 letters, digits, '_', '-'):
--cron takes 6 fields, seconds first ("0 30 9 * * 1-5": 09:30 on weekdays),
@hourly, @daily, @weekly, @monthly, @yearly, or @every DURATION (at least
1s); --tz an IANA time zone for the cron fields (default
UTC). A schedule of the same name is replaced. Exit 0; 2 for a bad name,
expression, zone or input.`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			cron, _ := cmd.Flags().GetString("cron")
			if err := kv.CheckCronName(args[0]); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if strings.TrimSpace(cron) == "" {
				return &ExitError{Code: 2, Err: fmt.Errorf("--cron is required (6 fields, seconds first, or @hourly, @daily, ...)")}
			}
			if tz != "" {
				if _, err := time.LoadLocation(tz); err != nil || tz == "Local" {
					return &ExitError{Code: 2, Err: fmt.Errorf("--tz %q: not an IANA time zone (Europe/Paris, America/New_York, UTC)", tz)}
				}
			}
			def, err := loadWorkflowForAnyWorker(args[1], nil, nil)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			in, err := readInput(input, cmd.InOrStdin())
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := client.CheckInput(def, in); err != nil {
				return &ExitError{Code: 2, Err: inputError(input, in, err)}
			}
			vm, err := parseVars(vars, def)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(_ *client.Client, st *kv.Store) error {
				if err := st.Definitions.Put(cmd.Context(), def); err != nil {
					return err
				}
				sc := &kv.CronSchedule{Name: args[0], Workflow: def.Name, Input: in, Vars: vm, Cron: cron, TimeZone: tz, By: whoami(), Created: time.Now().UTC()}
				if err := st.PutCron(cmd.Context(), sc); err != nil {
					return &ExitError{Code: 2, Err: err}
				}
				fmt.Fprintf(g.stdout, "schedule %s: %s v%d at %q%s\n", sc.Name, def.Name, def.Version, cron, map[bool]string{true: " (" + tz + ")", false: ""}[tz != ""])
				return nil
			})
		},
	}
	add.Flags().String("cron", "", "when: 6 cron fields, seconds first, or @hourly, @daily, @weekly, @monthly, @yearly")
	add.Flags().StringVarP(&input, "input", "i", "", "each job's input: a JSON file, or - for stdin (default: {})")
	add.Flags().StringVar(&tz, "tz", "", "IANA time zone of the cron fields (default UTC)")
	add.Flags().StringArrayVar(&vars, "var", nil, "name=value overriding one of the workflow's vars (repeatable)")
	list := &cobra.Command{
		Use:   "list",
		Short: "List the cron schedules",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(_ *client.Client, st *kv.Store) error {
				scs, err := st.Crons(cmd.Context())
				if err != nil {
					return err
				}
				if output == "json" {
					if scs == nil {
						scs = []*kv.CronSchedule{}
					}
					return printJSON(g.stdout, map[string]any{"schedules": scs})
				}
				for _, sc := range scs {
					zone := sc.TimeZone
					if zone == "" {
						zone = "UTC"
					}
					fmt.Fprintf(g.stdout, "%s\t%s\t%q %s\tby %s since %s\n", sc.Name, sc.Workflow, sc.Cron, zone, sc.By, sc.Created.Format(time.RFC3339))
				}
				return nil
			})
		},
	}
	list.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	remove := &cobra.Command{
		Use:   "remove NAME",
		Short: "Remove a cron schedule (firings already sent still start their jobs)",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.withClient(cmd.Context(), func(_ *client.Client, st *kv.Store) error {
				if err := st.RemoveCron(cmd.Context(), args[0]); err != nil {
					code := 1
					if errors.Is(err, schemas.ErrInputInvalid) {
						code = 2
					}
					return &ExitError{Code: code, Err: err}
				}
				fmt.Fprintf(g.stdout, "schedule %s removed\n", args[0])
				return nil
			})
		},
	}
	cmd.AddCommand(add, list, remove)
	return cmd
}

func newMigrateCmd(g *globals) *cobra.Command {
	var output, by, reason, to, with string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "migrate JOB --to FILE|HASH|NAME[@VERSION] [--with PATCH.json]",
		Short: "Move a job to another definition of its workflow, with a state migration",
		Long: `Migrate moves JOB to another definition of its workflow: --to a workflow file
(stored first), a definition hash, the workflow's name (the definition stored
last) or NAME@VERSION. --with is a JSON Patch (RFC 6902) applied to the job's
state; the patched state is checked against the new definition's state schema
before anything runs, and a migration that breaks it is refused with the JSON
pointer of each problem, changing nothing. The move is recorded in the job's
history (job.migrated) and the job goes on under the new definition; a job
blocked because its pinned definition cannot be loaded goes back to what it
was doing. The job must have failed, wait for approval, be blocked on its
definition, or be paused with nothing in flight (engine pause JOB first).
Exit 0 once the engine recorded it; 1 when refused; 2 for bad input.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := checkBy(cmd, &by); err != nil {
				return err
			}
			var patch json.RawMessage
			if with != "" {
				data, err := os.ReadFile(with)
				if err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("--with: %w", err)}
				}
				if !json.Valid(data) {
					return &ExitError{Code: 2, Err: fmt.Errorf("--with %s: not JSON (a JSON Patch is an array of operations: [{\"op\": \"add\", \"path\": \"/currency\", \"value\": \"eur\"}])", with)}
				}
				patch = data
			}
			var file *schemas.Definition
			looksLikeFile := strings.HasSuffix(to, ".yaml") || strings.HasSuffix(to, ".yml") || strings.HasSuffix(to, ".json") || strings.Contains(to, "/")
			if _, err := os.Stat(to); err != nil && looksLikeFile {
				return &ExitError{Code: 2, Err: fmt.Errorf("--to %s: %w", to, err)}
			}
			if st, err := os.Stat(to); err == nil && !st.IsDir() {
				if file, err = loadWorkflowForAnyWorker(to, nil, nil); err != nil {
					return &ExitError{Code: 2, Err: err}
				}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, st *kv.Store) error {
				ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
				defer cancel()
				// A file's definition is stored only once the migration
				// passed its checks.
				v, err := c.Migrate(ctx, args[0], client.MigrateRequest{To: to, Definition: file, Patch: patch, By: by, Reason: reason})
				if err != nil {
					return controlExit("migrate", args[0], timeout, err)
				}
				if output == "json" {
					return printJSON(g.stdout, v)
				}
				fmt.Fprintf(g.stdout, "job %s moved to %s v%d (definition %s); job %s\n", args[0], v.Workflow, v.Version, v.DefinitionHash[:12], v.Status)
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().StringVar(&to, "to", "", "the definition: a workflow file, a hash, NAME or NAME@VERSION")
	cmd.Flags().StringVar(&with, "with", "", "a JSON Patch (RFC 6902) file applied to the job's state")
	cmd.Flags().StringVar(&by, "by", "", "who does it (default: the current user)")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the record")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for an engine to record it")
	return cmd
}

func newStoreCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "store",
		Short: "The session store: JSON values by namespace and key, kept across jobs",
		Long: `The session store keeps JSON values by namespace and key (each 1 to 128
letters, digits, '_' and '-') across jobs, in the KV bucket waymark_store
under "<namespace>.<key>": a user's memory that store steps and agent tools
of kind store read and write. Every write has a revision; put and delete
take --revision to write only over that one (compare-and-swap), --create to
write only when there is no value.`,
	}
	requireSubcommand(cmd)
	output, value := "text", ""
	var revision uint64
	var create bool
	with := func(run func(ctx context.Context, s *kv.SessionStore, args []string) error) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(_ *client.Client, st *kv.Store) error {
				err := run(cmd.Context(), st.Session, args)
				switch {
				case errors.Is(err, schemas.ErrInputInvalid):
					return &ExitError{Code: 2, Err: err}
				case errors.Is(err, schemas.ErrNotFound), errors.Is(err, schemas.ErrConflict):
					return &ExitError{Code: 1, Err: err}
				}
				return err
			})
		}
	}
	expect := func(cmd *cobra.Command) (*uint64, error) {
		switch {
		case create && cmd.Flags().Changed("revision"):
			return nil, &ExitError{Code: 2, Err: fmt.Errorf("--create and --revision: give one")}
		case create:
			z := uint64(0)
			return &z, nil
		case cmd.Flags().Changed("revision"):
			return &revision, nil
		}
		return nil, nil
	}
	get := &cobra.Command{Use: "get NAMESPACE KEY", Short: "Print a value and its revision", Args: exactArgs(2),
		RunE: with(func(ctx context.Context, s *kv.SessionStore, args []string) error {
			e, err := s.Get(ctx, args[0], args[1])
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(g.stdout, e)
			}
			fmt.Fprintf(g.stdout, "revision %d\n", e.Revision)
			return printJSON(g.stdout, e.Value)
		})}
	put := &cobra.Command{Use: "put NAMESPACE KEY --value JSON [--revision N | --create]", Short: "Write a value", Args: exactArgs(2)}
	put.RunE = with(func(ctx context.Context, s *kv.SessionStore, args []string) error {
		if !put.Flags().Changed("value") {
			return schemas.Errorf(schemas.CodeInputInvalid, "--value is required: the JSON to store (--value '{\"lang\": \"fr\"}')")
		}
		if !json.Valid([]byte(value)) {
			return schemas.Errorf(schemas.CodeInputInvalid, "--value %q is not JSON (a string needs its quotes: --value '\"text\"')", value)
		}
		exp, err := expect(put)
		if err != nil {
			return err
		}
		rev, err := s.Put(ctx, args[0], args[1], json.RawMessage(value), exp)
		if err != nil {
			return err
		}
		fmt.Fprintf(g.stdout, "revision %d\n", rev)
		return nil
	})
	put.Flags().StringVar(&value, "value", "", "the value, JSON")
	put.Flags().Uint64Var(&revision, "revision", 0, "write only over this revision")
	put.Flags().BoolVar(&create, "create", false, "write only when there is no value")
	del := &cobra.Command{Use: "delete NAMESPACE KEY [--revision N]", Short: "Remove a value", Args: exactArgs(2)}
	del.RunE = with(func(ctx context.Context, s *kv.SessionStore, args []string) error {
		var exp *uint64
		if del.Flags().Changed("revision") {
			exp = &revision
		}
		if err := s.Delete(ctx, args[0], args[1], exp); err != nil {
			return err
		}
		fmt.Fprintf(g.stdout, "%s/%s removed\n", args[0], args[1])
		return nil
	})
	del.Flags().Uint64Var(&revision, "revision", 0, "remove only this revision")
	list := &cobra.Command{Use: "list NAMESPACE", Short: "List a namespace's values", Args: exactArgs(1),
		RunE: with(func(ctx context.Context, s *kv.SessionStore, args []string) error {
			es, err := s.List(ctx, args[0])
			if err != nil {
				return err
			}
			if output == "json" {
				if es == nil {
					es = []kv.StoreEntry{}
				}
				return printJSON(g.stdout, map[string]any{"entries": es})
			}
			for _, e := range es {
				fmt.Fprintf(g.stdout, "%s\trevision %d\t%s\n", e.Key, e.Revision, oneLine(string(e.Value), 200))
			}
			return nil
		})}
	for _, c := range []*cobra.Command{get, list} {
		c.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	}
	cmd.AddCommand(get, put, del, list)
	return cmd
}
