package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nuid"
	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/engine/trigger"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

func newEventsCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "events",
		Short: "CloudEvents intake: send an event that starts jobs by the workflows' triggers",
	}
	requireSubcommand(cmd)
	cmd.AddCommand(newEventsSendCmd(g))
	return cmd
}

func newEventsSendCmd(g *globals) *cobra.Command {
	var typ, source, id, subject, data, contentType, dataSchema, output string
	var exts []string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "send --type TYPE --source SOURCE [--id ID] [--data FILE] [--subject SUBJECT]",
		Short: "Send a CloudEvent to the engines over NATS and print the jobs it started",
		Long: `Send sends one CloudEvent (spec 1.0) in binary mode on <prefix>.trigger.<type> and
waits for the engine's answer: the jobs the event started by the live triggers
(each workflow's latest stored definition). Sending the same --source and --id
again starts nothing and prints the same jobs, marked duplicate. Without --id a
fresh id is made (so the event is new). --data is the event's data (a file, or -
for stdin; JSON unless --data-content-type says otherwise). Exit status: 0
accepted; 1 refused (no trigger takes the event, its input breaks the
workflow's input schema) or no engine answered; 2 bad usage.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if timeout <= 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--timeout %v: want a positive duration", timeout)}
			}
			ev := event.New()
			if id == "" {
				id = strings.ToLower(nuid.Next())
			}
			ev.SetID(id)
			ev.SetType(typ)
			ev.SetSource(source)
			ev.SetTime(time.Now().UTC())
			if subject != "" {
				ev.SetSubject(subject)
			}
			if dataSchema != "" {
				ev.SetDataSchema(dataSchema)
			}
			for _, kvp := range exts {
				k, v, ok := strings.Cut(kvp, "=")
				if !ok || k == "" {
					return &ExitError{Code: 2, Err: fmt.Errorf("--ext %q: want name=value", kvp)}
				}
				ev.SetExtension(k, v)
			}
			if data != "" {
				raw, err := readData(data, cmd.InOrStdin())
				if err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("--data: %w", err)}
				}
				if strings.Contains(contentType, "json") && !json.Valid(raw) {
					return &ExitError{Code: 2, Err: fmt.Errorf("--data %s: not JSON (set --data-content-type for other data)", data)}
				}
				ev.SetDataContentType(contentType)
				ev.DataEncoded = raw
			}
			if err := ev.Validate(); err != nil {
				return &ExitError{Code: 2, Err: fmt.Errorf("not a valid CloudEvent (set --type and --source): %w", err)}
			}
			cfg, err := g.kvConfig(kv.Config{})
			if err != nil {
				return err
			}
			nc, err := g.connect("waymark-cli")
			if err != nil {
				return err
			}
			defer nc.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			a, err := trigger.Send(ctx, nc, cfg.WithDefaults().Prefix, &ev)
			var ref *trigger.Refusal
			if errors.As(err, &ref) {
				if output == "json" {
					_ = printJSON(g.stdout, map[string]any{"error": ref})
				}
				return &ExitError{Code: 1, Err: err}
			}
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(g.stdout, a)
			}
			fmt.Fprintf(g.stdout, "event %s from %s\n", a.Event.ID, a.Event.Source)
			for _, j := range a.Jobs {
				how := "started"
				if j.Duplicate {
					how = "duplicate (started before)"
				}
				fmt.Fprintf(g.stdout, "job %s (%s, trigger %s): %s\n", j.JobID, j.Workflow, j.Trigger, how)
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&typ, "type", "", "the event's type (required), e.g. com.example.order.created")
	fl.StringVar(&source, "source", "", "the event's source (required), e.g. /shop/orders")
	fl.StringVar(&id, "id", "", "the event's id; with --source its dedup key (default: a fresh id)")
	fl.StringVar(&subject, "subject", "", "the event's subject")
	fl.StringVar(&data, "data", "", "the event's data: a file, or - for stdin")
	fl.StringVar(&contentType, "data-content-type", "application/json", "the data's content type")
	fl.StringVar(&dataSchema, "data-schema", "", "the event's dataschema (a URI)")
	fl.StringArrayVar(&exts, "ext", nil, "an extension attribute name=value (repeatable)")
	fl.DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the engine's answer")
	fl.StringVarP(&output, "output", "o", "text", "text or json (the answer as the HTTP API gives it)")
	return cmd
}

// readData reads --data: a file, or - for stdin.
func readData(path string, stdin io.Reader) ([]byte, error) {
	if path == "-" {
		return io.ReadAll(io.LimitReader(stdin, trigger.MaxEventBytes+1))
	}
	return os.ReadFile(path)
}

func newTriggersCmd(g *globals) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "triggers [add WORKFLOW]",
		Short: "List the live CloudEvents triggers (each workflow's latest stored definition), or store a workflow's",
		Long: `Triggers lists the trigger rules that take CloudEvents now: those of each
workflow's latest stored definition. "engine triggers add WORKFLOW" stores the
workflow file (as engine start does, without starting a job), which makes its
triggers live, then lists them.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.listTriggers(cmd.Context(), nil, output)
		},
	}
	cmd.PersistentFlags().StringVarP(&output, "output", "o", "text", "text or json")
	add := &cobra.Command{
		Use:   "add WORKFLOW",
		Short: "Store a workflow file so that its triggers are live",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			def, err := loadWorkflowForAnyWorker(args[0], nil, nil)
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if len(def.Triggers) == 0 {
				return &ExitError{Code: 2, Err: fmt.Errorf("%s declares no triggers (add a triggers: list)", args[0])}
			}
			return g.listTriggers(cmd.Context(), def, output)
		},
	}
	cmd.AddCommand(add)
	return cmd
}

// listTriggers stores def (when not nil) and prints the live triggers.
func (g *globals) listTriggers(ctx context.Context, def *schemas.Definition, output string) error {
	return g.withClient(ctx, func(_ *client.Client, st *kv.Store) error {
		if def != nil {
			if err := st.Definitions.Put(ctx, def); err != nil {
				return err
			}
			if output == "text" {
				fmt.Fprintf(g.stdout, "stored %s v%d (%s)\n", def.Name, def.Version, def.Hash[:12])
			}
		}
		in, err := trigger.New(trigger.Config{Store: st})
		if err != nil {
			return err
		}
		rules, err := in.Triggers(ctx)
		if err != nil {
			return err
		}
		if output == "json" {
			return printJSON(g.stdout, map[string]any{"triggers": rules})
		}
		if len(rules) == 0 {
			fmt.Fprintln(g.stdout, "no live triggers (no stored workflow declares triggers)")
			return nil
		}
		tw := tabwriter.NewWriter(g.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "WORKFLOW\tVERSION\tTRIGGER\tTYPE\tSOURCE\tSUBJECT\tFILTER")
		for _, r := range rules {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\n", r.Workflow, r.Version, r.Name, r.Type, dash(r.Source), dash(r.Subject), dash(r.Filter))
		}
		return tw.Flush()
	})
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
