package steps

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// lockedBuffer is a log sink safe for the worker's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestWorkerScrubsWhatACustomKindResolved: a custom kind that reads a
// secret with Call.Secret and lets it slip into its output or its error
// has it scrubbed by the worker before the result is published, the
// effect ledger records it, or the log shows it.
func TestWorkerScrubsWhatACustomKindResolved(t *testing.T) {
	t.Parallel()
	const value = "custom-kind-secret-7Hq2"
	b := setupWorker(t, workerOptions{noStart: true})
	def := parseDef(t, `
name: leaky
version: 1
steps:
  - id: leak
    kind: leak
    effect: idempotent
`)
	if err := b.store.Definitions.Put(t.Context(), def); err != nil {
		t.Fatal(err)
	}
	if err := b.reg.Register("leak", Func(func(_ context.Context, c *Call) (any, error) {
		v, err := c.Secret("LEAKY")
		if err != nil {
			return nil, err
		}
		st, _ := c.StateMap()
		if st["fail"] == true {
			return nil, errors.New("provider refused key " + v)
		}
		return &Outcome{Output: map[string]any{"echo": v}, ExternalID: "ext-" + v}, nil
	})); err != nil {
		t.Fatal(err)
	}
	env := *b.env
	env.Getenv = func(k string) string {
		if k == SecretEnvPrefix+"LEAKY" {
			return value
		}
		return ""
	}
	var logs lockedBuffer
	b.start(WorkerConfig{Env: &env, Logger: slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})

	for _, tt := range []struct {
		job, state string
	}{{job: "ok-job", state: `{}`}, {job: "fail-job", state: `{"fail": true}`}} {
		sm := b.send(schemas.StepMessage{Job: tt.job, Step: "leak", DefinitionHash: def.Hash, State: []byte(tt.state)})
		res := b.result(tt.job)
		var ent string
		testsupport.Eventually(t, 10*time.Second, func() bool {
			e, err := b.store.Effects.Get(t.Context(), sm.IdempotencyKey)
			if err != nil {
				return false
			}
			raw, _ := json.Marshal(e.Record)
			ent = string(raw)
			return e.Record.State != schemas.EffectPrepared || e.Record.LastError != nil
		}, "no effect record for %s", tt.job)
		res.Worker = ""
		for what, text := range map[string]string{"result output": string(res.Output), "effect record": ent, "log": logs.String()} {
			if strings.Contains(text, value) {
				t.Errorf("%s: %s holds the secret: %s", tt.job, what, text)
			}
		}
		if res.Error != nil {
			if strings.Contains(res.Error.Message, value) || !strings.Contains(res.Error.Message, "[redacted:LEAKY]") {
				t.Errorf("%s: result error %q", tt.job, res.Error.Message)
			}
		} else if string(res.Output) != `{"echo":"[redacted:LEAKY]"}` {
			t.Errorf("%s: output %s", tt.job, res.Output)
		}
		if tt.job == "ok-job" && !strings.Contains(ent, `"external_id":"ext-[redacted:LEAKY]"`) {
			t.Errorf("effect record %s: want the external id scrubbed", ent)
		}
	}
}
