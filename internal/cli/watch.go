package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// watchLine is one line of engine watch --output json: a history event, or
// a piece of an agent turn's text as the model made it.
type watchLine struct {
	Kind  string                `json:"kind"` // "event" or "text"
	Event *schemas.HistoryEvent `json:"event,omitempty"`
	Step  string                `json:"step,omitempty"`
	Turn  int                   `json:"turn,omitempty"`
	Text  string                `json:"text,omitempty"`
}

func newWatchCmd(g *globals) *cobra.Command {
	var output string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "watch JOB",
		Short: "Follow a job live: its transitions, and its agent turns' text as the model writes it",
		Long: `Watch prints a job's transitions as they happen, as engine run does, and the
text of its agent turns as it streams from the model (published by workers on
the core NATS subject <prefix>.stream.<job>, which no stream stores: a watcher
sees what is said while it watches; the durable record is the turn's result,
in the history). It prints the job's transitions so far first, then
follows it, and stops when the job stops: exit 0 completed, 1 failed, 3
waiting for a person (needs_reconciliation, blocked, quarantined), 130 when
--timeout passes first.
--output json prints one JSON object a line: {"kind":"event","event":{…}} or
{"kind":"text","step":…,"turn":…,"text":…}.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			job := args[0]
			if err := client.ValidateJobID(job); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, st *kv.Store) error {
				if _, err := st.Checkpoints.Get(cmd.Context(), job); err != nil {
					return &ExitError{Code: 1, Err: err}
				}
				w := &watcher{out: g.stdout, json: output == "json", seen: map[string]bool{}, ended: map[string]chan struct{}{}}
				// The transitions so far first, then what comes live.
				evs, err := c.History(cmd.Context(), job)
				if err != nil {
					return err
				}
				w.note("watching job %s (Ctrl-C stops watching; the job goes on)", job)
				for _, h := range evs {
					w.event(h)
				}
				sub, err := st.JS.Conn().Subscribe(st.Names.StreamSubject(job), func(m *nats.Msg) {
					turn, _ := strconv.Atoi(m.Header.Get(schemas.HeaderTurn))
					if m.Header.Get(schemas.HeaderStreamEnd) != "" {
						w.streamEnded(m.Header.Get(schemas.HeaderStep), turn)
						return
					}
					w.text(m.Header.Get(schemas.HeaderStep), turn, string(m.Data))
				})
				if err != nil {
					return fmt.Errorf("watch job %s: subscribe to its stream: %w", job, err)
				}
				defer func() { _ = sub.Unsubscribe() }()
				if err := st.JS.Conn().Flush(); err != nil {
					return fmt.Errorf("watch job %s: %w", job, err)
				}
				ctx := cmd.Context()
				if timeout > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, timeout)
					defer cancel()
				}
				v, err := c.Wait(ctx, job, w.liveEvent)
				if err != nil {
					if timeout > 0 && errors.Is(err, context.DeadlineExceeded) {
						return &ExitError{Code: 130, Err: fmt.Errorf("--timeout %v passed; job %s goes on", timeout, job)}
					}
					return err
				}
				w.note("job %s %s (resume_count %d)", v.ID, v.Status, v.ResumeCount)
				switch {
				case v.Status == schemas.JobFailed || v.Status == schemas.JobCancelled:
					return &ExitError{Code: 1, Err: fmt.Errorf("job %s %s: %v", v.ID, v.Status, v.Error)}
				case !v.Status.Terminal():
					return &ExitError{Code: 3, Err: fmt.Errorf("job %s is %s: it waits for a person", v.ID, v.Status)}
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().DurationVar(&timeout, "timeout", 0, "stop watching after this long (0: until the job stops)")
	return cmd
}

// watcher prints events and streamed text, one writer at a time.
type watcher struct {
	mu       sync.Mutex
	out      io.Writer
	json     bool
	midLine  bool   // streamed text was printed without its line's end
	streamOf string // "<step>/<turn>" of the text being printed
	seen     map[string]bool
	// ended holds, by "<step>/<turn>", a channel closed once the turn's
	// text has ended (the worker's end marker).
	ended map[string]chan struct{}
}

// streamEndWait bounds how long a turn's result waits for the end of its
// text (a worker that died, or one without end markers).
const streamEndWait = time.Second

func (w *watcher) endOf(step string, turn int) chan struct{} {
	key := fmt.Sprintf("%s/%d", step, turn)
	ch, ok := w.ended[key]
	if !ok {
		ch = make(chan struct{})
		w.ended[key] = ch
	}
	return ch
}

func (w *watcher) streamEnded(step string, turn int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ch := w.endOf(step, turn)
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// liveEvent is event for what comes live: a turn's result waits (a
// moment at most) for the end of the turn's streamed text, so that the
// text comes before it.
func (w *watcher) liveEvent(h schemas.HistoryEvent) {
	if h.Type == schemas.EventAgentTurn {
		w.mu.Lock()
		ch := w.endOf(h.Data.Step, h.Data.Turn)
		w.mu.Unlock()
		select {
		case <-ch:
		case <-time.After(streamEndWait):
		}
	}
	w.event(h)
}

func (w *watcher) endLine() {
	if w.midLine {
		fmt.Fprintln(w.out)
		w.midLine = false
	}
}

func (w *watcher) note(format string, args ...any) {
	if w.json {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.endLine()
	fmt.Fprintf(w.out, format+"\n", args...)
}

func (w *watcher) event(h schemas.HistoryEvent) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seen[h.ID] {
		return
	}
	w.seen[h.ID] = true
	if w.json {
		_ = json.NewEncoder(w.out).Encode(watchLine{Kind: "event", Event: &h})
		return
	}
	w.endLine()
	w.streamOf = ""
	printEvent(w.out, h)
}

func (w *watcher) text(step string, turn int, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.json {
		_ = json.NewEncoder(w.out).Encode(watchLine{Kind: "text", Step: step, Turn: turn, Text: text})
		return
	}
	if key := fmt.Sprintf("%s/%d", step, turn); key != w.streamOf {
		w.endLine()
		fmt.Fprintf(w.out, "  %s turn %d > ", step, turn)
		w.streamOf = key
	}
	text = strings.ReplaceAll(text, "\n", "\n    ")
	fmt.Fprint(w.out, text)
	w.midLine = true
}

func newTranscriptCmd(g *globals) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "transcript JOB",
		Short: "Print the conversation of a job's agent steps: every message, tool call and tool result",
		Long: `Transcript reads a job's agent transcripts from the value store and prints them:
those of the agent runs that ended (completed or failed), oldest first, then
the running agent's conversation so far; a failed job's error comes last. --output json prints
{"transcripts": [[message, …], …]} with the messages as stored (roles user and
assistant; blocks text, tool_use, tool_result).`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if err := client.ValidateJobID(args[0]); err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			return g.withClient(cmd.Context(), func(c *client.Client, st *kv.Store) error {
				ent, err := st.Checkpoints.Get(cmd.Context(), args[0])
				if err != nil {
					return &ExitError{Code: 1, Err: err}
				}
				cp := ent.Checkpoint
				var runs [][]schemas.TranscriptPart
				var steps []string
				for _, p := range cp.Transcripts {
					runs, steps = append(runs, []schemas.TranscriptPart{p}), append(steps, p.Step)
				}
				if cp.Fan != nil && cp.Fan.Agent != nil && len(cp.Fan.Agent.Transcript) > 0 {
					runs, steps = append(runs, cp.Fan.Agent.Transcript), append(steps, cp.Fan.Step+" (running)")
				}
				if len(runs) == 0 {
					return &ExitError{Code: 1, Err: fmt.Errorf("job %s has no agent transcript", cp.JobID)}
				}
				if st.Values == nil {
					return fmt.Errorf("job %s: this store has no value store", cp.JobID)
				}
				all := make([][]schemas.AgentMessage, 0, len(runs))
				for _, parts := range runs {
					var msgs []schemas.AgentMessage
					for _, p := range parts {
						data, err := st.Values.Get(cmd.Context(), cp.MsgPrefix(), p.Ref())
						if err != nil {
							return fmt.Errorf("job %s: read transcript part %s: %w", cp.JobID, p.Digest, err)
						}
						var part []schemas.AgentMessage
						if err := json.Unmarshal(data, &part); err != nil {
							return fmt.Errorf("job %s: transcript part %s: %w", cp.JobID, p.Digest, err)
						}
						msgs = append(msgs, part...)
					}
					all = append(all, msgs)
				}
				if output == "json" {
					return printJSON(g.stdout, map[string]any{"transcripts": all})
				}
				for i, msgs := range all {
					if len(all) > 1 || steps[i] != "" {
						fmt.Fprintf(g.stdout, "transcript %d of %d: step %s\n", i+1, len(all), steps[i])
					}
					for _, m := range msgs {
						for _, b := range m.Content {
							switch b.Type {
							case "text":
								fmt.Fprintf(g.stdout, "%-9s %s\n", m.Role+":", strings.ReplaceAll(b.Text, "\n", "\n          "))
							case "tool_use":
								fmt.Fprintf(g.stdout, "%-9s → %s %s  [%s]\n", m.Role+":", b.Name, b.Input, b.ToolUseID)
							case "tool_result":
								what := "←"
								if b.IsError {
									what = "← error:"
								}
								fmt.Fprintf(g.stdout, "%-9s %s %s  [%s]\n", m.Role+":", what, oneLine(b.Content, 300), b.ToolUseID)
							}
						}
					}
				}
				if (cp.Status == schemas.JobFailed || cp.Status == schemas.JobCancelled) && cp.Error != nil {
					fmt.Fprintf(g.stdout, "stopped:  %s\n", oneLine(cp.Error.Error(), 500))
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	return cmd
}
