package main

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// demoStats reads the counters a bundled demo service keeps in its data
// directory (calls.jsonl and its data file), by reopening it.
func demoStats(t *testing.T, dir, name string) demo.Stats {
	t.Helper()
	s, err := demo.New(name, demo.Options{Dir: filepath.Join(dir, "demo", name)})
	if err != nil {
		t.Fatalf("open demo %s: %v", name, err)
	}
	defer s.Close()
	return s.Stats()
}

func agentRun(dir, id string) []string {
	root := testsupport.ModuleRoot()
	return []string{"run", filepath.Join(root, "examples/agent/workflow.yaml"),
		"--input", filepath.Join(root, "examples/agent/input.json"),
		"--job-id", id, "--data-dir", dir, "--sync", "always", "--output", "json"}
}

func decodeView(t *testing.T, out string) client.JobView {
	t.Helper()
	var v client.JobView
	i := strings.Index(out, "{")
	if i < 0 {
		t.Fatalf("no job record in output:\n%s", out)
	}
	if err := json.Unmarshal([]byte(out[i:]), &v); err != nil {
		t.Fatalf("decode job record: %v\n%s", err, out)
	}
	return v
}

// TestAgentExampleResumesAfterACrash is the README's agent example, killed
// at points of its loop and run again: the job finishes with the same
// answer, the purchase order is charged once, the confirmation mailed
// once, and the vendor searches that had finished are not made again.
func TestAgentExampleResumesAfterACrash(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, failpoint string
		// searches bounds the calls the vendors service sees in all: a
		// search cut off by the crash before its result was published runs
		// again, one whose result was published does not.
		searches int
	}{
		// The purchase order is charged, the ledger does not know yet.
		{"after the charge", "worker.after_remote_commit=crash/buyer", 2},
		// Turn 2's reply is checkpointed, the tool call not yet published.
		{"between a turn and its tool call", "engine.after_checkpoint=crash@4", 2},
		// A search's result is published, its message not acknowledged.
		// The other search, in flight at once, may be cut off.
		{"after a search's result", "worker.after_result_publish=crash/buyer@2", 3},
		// The first turn's message came, the model not yet asked.
		{"before the first turn", "worker.after_receive=crash/buyer", 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			bin := testsupport.Binary(t, "engine")
			dir := t.TempDir()
			env := []string{"WAYMARK_MODEL_MODE=replay"}
			first := spawn(t, append(env, "WAYMARK_FAILPOINTS="+tc.failpoint), bin, agentRun(dir, "po-1")...)
			first.waitKilled(t, 60*time.Second)
			second := spawn(t, env, bin, agentRun(dir, "po-1")...)
			select {
			case <-second.done:
			case <-time.After(60 * time.Second):
				t.Fatal("second run did not finish")
			}
			if second.err != nil {
				t.Fatalf("second run: %v\n%s", second.err, second.errOut.String())
			}
			v := decodeView(t, second.out.String())
			var st struct {
				Purchase schemas.AgentOutput `json:"purchase"`
			}
			if err := json.Unmarshal(v.State, &st); err != nil {
				t.Fatal(err)
			}
			var answer struct {
				OrderID string `json:"order_id"`
			}
			_ = json.Unmarshal(st.Purchase.Answer, &answer)
			// One crash may count twice: the new engine's takeover and the
			// worker's redelivery of the step message it died holding.
			if v.Status != schemas.JobCompleted || v.ResumeCount < 1 || st.Purchase.Turns != 4 || st.Purchase.ToolCalls != 4 || answer.OrderID != "po-cooling-loop-1" {
				t.Fatalf("status %s resume_count %d output %+v", v.Status, v.ResumeCount, st.Purchase)
			}
			pay, mail, vendors := demoStats(t, dir, "payments"), demoStats(t, dir, "mail"), demoStats(t, dir, "vendors")
			for key, n := range pay.Effects {
				if n != 1 {
					t.Errorf("payments: %d charges under %s, want 1", n, key)
				}
			}
			if len(pay.Effects) != 1 || len(mail.Effects) != 1 {
				t.Errorf("charges %v, mails %v: want one each", pay.Effects, mail.Effects)
			}
			total, once := 0, 0
			for _, n := range vendors.Calls {
				total += n
				if n == 1 {
					once++
				}
			}
			if total < 2 || total > tc.searches || once == 0 {
				t.Errorf("vendor searches %v, want 2 to %d in all, one of them made once", vendors.Calls, tc.searches)
			}
		})
	}
}

// TestAgentExampleUnsafeToolLeftDangling: killed after the mail service
// sent the confirmation and before the ledger recorded it, the resumed job
// does not send it again: it stops in needs_reconciliation naming the
// tool call and its arguments (exit 3); the mail went out once.
func TestAgentExampleUnsafeToolLeftDangling(t *testing.T) {
	t.Parallel()
	bin := testsupport.Binary(t, "engine")
	dir := t.TempDir()
	env := []string{"WAYMARK_MODEL_MODE=replay"}
	first := spawn(t, append(env, "WAYMARK_FAILPOINTS=worker.after_remote_commit=crash/buyer@2"), bin, agentRun(dir, "po-2")...)
	first.waitKilled(t, 60*time.Second)
	second := spawn(t, env, bin, agentRun(dir, "po-2")...)
	select {
	case <-second.done:
	case <-time.After(60 * time.Second):
		t.Fatal("second run did not finish")
	}
	var ee *exec.ExitError
	if !errors.As(second.err, &ee) || ee.ExitCode() != 3 {
		t.Fatalf("second run: %v, want exit 3\n%s", second.err, second.errOut.String())
	}
	v := decodeView(t, second.out.String())
	if v.Status != schemas.JobNeedsReconciliation || v.Blocked == nil || !strings.Contains(v.Blocked.Reason, "tool send_confirmation, call toolu_03confirm with arguments") ||
		!strings.Contains(v.Blocked.Reason, "ops@example.com") || !strings.HasSuffix(v.Blocked.EffectKey, "/buyer/turn-3/toolu_03confirm") {
		t.Fatalf("status %s blocked %+v", v.Status, v.Blocked)
	}
	if mail := demoStats(t, dir, "mail"); len(mail.Effects) != 1 {
		t.Fatalf("mails %v, want one", mail.Effects)
	}
	if _, err := os.Stat(filepath.Join(dir, "demo", "mail")); err != nil {
		t.Fatal(err)
	}
}

// TestAgentPricedByTheWorkersPriceFile: an agent with max_cost and no
// prices of its own is priced from the worker's --prices file; without
// one, its first turn fails the step, naming the missing price.
func TestAgentPricedByTheWorkersPriceFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	files := map[string]string{
		"agent.yaml": `
name: priced
version: 1
assets: {cassette: cassette.json}
steps:
  - id: agent
    kind: agent
    save_as: out
    with: {provider: replay, model: m1, prompt: "go", cassette: cassette}
    limits: {max_cost: 1}
    tools: [{name: look, kind: noop, effect: pure}]
`,
		"cassette.json": `{"version": 1, "interactions": [
  {"step": "agent", "turn": 1, "replies": [{"text": "", "model": "m1-2026", "tool_calls": [{"id": "c1", "name": "look", "input": {}}], "usage": {"input_tokens": 1000, "output_tokens": 100}}]},
  {"step": "agent", "turn": 2, "replies": [{"text": "done", "model": "m1-2026", "usage": {"input_tokens": 2000, "output_tokens": 100}}]}]}`,
		"prices.yaml": "m1: {input: 3, output: 15}\n",
		"input.json":  `{}`,
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bin := testsupport.Binary(t, "engine")
	run := func(extra ...string) *proc {
		args := append([]string{"run", filepath.Join(dir, "agent.yaml"), "--input", filepath.Join(dir, "input.json"),
			"--data-dir", t.TempDir(), "--output", "json"}, extra...)
		p := spawn(t, []string{"WAYMARK_MODEL_MODE=replay"}, bin, args...)
		<-p.done
		return p
	}
	p := run("--prices", filepath.Join(dir, "prices.yaml"))
	if p.err != nil {
		t.Fatalf("priced run: %v\n%s", p.err, lastLines(p.errOut.String(), 20))
	}
	var st struct {
		Out schemas.AgentOutput `json:"out"`
	}
	_ = json.Unmarshal(decodeView(t, p.out.String()).State, &st)
	if want := (3000*3.0 + 200*15.0) / 1e6; st.Out.Cost < want*0.999 || st.Out.Cost > want*1.001 {
		t.Errorf("cost %v, want %v (m1's price for m1-2026, from the price file)", st.Out.Cost, want)
	}
	p = run()
	var ee *exec.ExitError
	if !errors.As(p.err, &ee) || ee.ExitCode() != 1 || !strings.Contains(p.errOut.String(), `model "m1-2026" has no price in the worker's price file (--prices)`) {
		t.Errorf("unpriced run: %v\n%s", p.err, lastLines(p.errOut.String(), 10))
	}
}
