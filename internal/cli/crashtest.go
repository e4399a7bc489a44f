package cli

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/crashtest"
)

func newCrashtestCmd(g *globals) *cobra.Command {
	var input, points, stepList, output string
	var children []string
	var parallel int
	var timeout time.Duration
	var services []string
	cmd := &cobra.Command{
		Use:   "crashtest WORKFLOW --input FILE [--points all|LIST]",
		Short: "Crash a job at every failpoint and step, resume it, and report what each crash did",
		Long: `Crashtest runs WORKFLOW once per failpoint and step: a real engine or worker process
kills itself (SIGKILL) at the point while handling the step, is started again,
and the job is followed until it stops. For each case it reports the final
status, the resume count, the steps run again, the effect ledger by state and,
for steps that call the bundled test providers (payments, records, mail,
tickets), the calls and effects each idempotency key received.

Failpoints: ` + strings.Join(crashtest.Failpoints(), ", ") + `.

Besides the crashes, two outcome cases per step: ` + crashtest.SlowProvider + ` (the step's
bundled provider answers every call 3 s late, past the step's timeout, cut to
1 s with 2 attempts for the case) and ` + crashtest.DeadLetter + ` (the worker dies after
every call of the step, until the step message is a dead letter, with
WAYMARK_WORK_MAX_DELIVER=3).`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			log, err := g.logger()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			bin, err := os.Executable()
			if err != nil {
				return fmt.Errorf("crashtest: find this binary: %w", err)
			}
			cfg := crashtest.Config{Binary: bin, Workflow: args[0], Input: input, Parallel: parallel, Timeout: timeout, Logger: log, Children: children}
			if points != "" && points != "all" {
				cfg.Points = strings.Split(points, ",")
			}
			if stepList != "" {
				cfg.Steps = strings.Split(stepList, ",")
			}
			if len(services) > 0 {
				svc, err := parseServiceFlags(services)
				if err != nil {
					return &ExitError{Code: 2, Err: err}
				}
				cfg.Services = svc
			}
			rep, err := crashtest.Run(cmd.Context(), cfg)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if output == "json" {
				return printJSON(g.stdout, rep)
			}
			printCrashReport(g.stdout, rep)
			for _, p := range rep.Points {
				if p.Error != "" {
					return &ExitError{Code: 1, Err: fmt.Errorf("%s at %s: %s", p.Failpoint, p.Step, p.Error)}
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&input, "input", "i", "", "job input: a JSON file")
	f.StringVar(&points, "points", "all", "failpoints to crash at and outcome cases (slow-provider, dead-letter): all, or a comma-separated list")
	f.StringVar(&stepList, "steps", "", "steps to crash in, comma-separated (default: every step)")
	f.IntVar(&parallel, "parallel", 2, "cases run at once")
	f.DurationVar(&timeout, "timeout", 90*time.Second, "time allowed for one case")
	f.StringArrayVar(&services, "service", nil, "name=URL of a service that is not bundled (repeatable)")
	f.StringVarP(&output, "output", "o", "text", "text or json")
	f.StringArrayVar(&children, "child", nil, "a workflow file that workflow steps start as child jobs (repeatable)")
	return cmd
}

func parseServiceFlags(pairs []string) (map[string]string, error) {
	out := map[string]string{}
	for _, p := range pairs {
		k, v, ok := strings.Cut(p, "=")
		if !ok || k == "" || v == "" {
			return nil, fmt.Errorf("--service %q: want name=URL", p)
		}
		out[k] = v
	}
	return out, nil
}

func printCrashReport(w interface{ Write([]byte) (int, error) }, rep *crashtest.Report) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FAILPOINT\tSTEP (CLASS)\tCRASHED\tFINAL STATUS\tRESUMES\tRE-DISPATCHED\tCALLS/KEY\tEFFECTS/KEY\tLEDGER")
	for _, p := range rep.Points {
		crashed := "yes"
		switch {
		case p.Failpoint == crashtest.SlowProvider:
			crashed = "-" // nothing crashes: the provider is late
		case !p.Reached:
			crashed = "not reached"
		}
		status := p.FinalStatus
		if p.Error != "" {
			status = "ERROR: " + oneLine(p.Error, 60)
		}
		var ledger []string
		for st, n := range p.Ledger {
			ledger = append(ledger, fmt.Sprintf("%s=%d", st, n))
		}
		sort.Strings(ledger)
		fmt.Fprintf(tw, "%s\t%s (%s)\t%s\t%s\t%d\t%d\t%d\t%d\t%s\n", p.Failpoint, p.Step, p.EffectClass, crashed, status,
			p.ResumeCount, p.StepsRerun, p.MaxCallsPerKey, p.MaxEffectsPerKey, strings.Join(ledger, " "))
	}
	_ = tw.Flush()
}
