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
			if v.Status != schemas.JobCompleted || v.ResumeCount != 1 || st.Purchase.Turns != 4 || st.Purchase.ToolCalls != 4 || answer.OrderID != "po-cooling-loop-1" {
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
