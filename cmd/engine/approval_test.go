package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// TestApprovalExample: examples/approval as a user runs it. engine run
// stops at the gate (exit 4, naming gate, action and digest); the gate
// survives an engine killed with SIGKILL; an approval by someone not named
// is refused (exit 1); alice's approval pays the refund once; approving
// again answers "already decided" (exit 1) and pays nothing more.
func TestApprovalExample(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	bin := testsupport.Binary(t, "engine")
	dir := t.TempDir()
	nats := "--nats-url=" + srv.URL()
	env := []string{"WAYMARK_DATA_DIR=" + dir} // where the demo services keep their data
	run := commandRunner(t, env, bin, nats)
	p, code := run("run", "../../examples/approval/workflow.yaml", "--input", "../../examples/approval/input.json", "--job-id", "refund-1")
	if code != 4 || !strings.Contains(p.errOut.String(), "waits for approval at gate approve: refund 4000 eur cents to C1 for order A-1042 (digest ") ||
		!strings.Contains(p.errOut.String(), "engine approve refund-1 approve") {
		t.Fatalf("run: exit %d\n%s%s", code, p.out.String(), p.errOut.String())
	}
	serve := spawn(t, env, bin, "serve", nats, "--demo", "--http=")
	testsupport.Eventually(t, 30*time.Second, func() bool { return strings.Contains(serve.out.String(), "engine running") }, "engine serve never ran: %s", serve.errOut.String())
	_ = serve.cmd.Process.Signal(syscall.SIGKILL)
	serve.waitKilled(t, 10*time.Second)
	spawn(t, env, bin, "serve", nats, "--demo", "--http=")

	p, code = run("status", "refund-1", "-o", "json")
	var v struct {
		Status    string `json:"status"`
		Approvals []struct {
			Gate, Digest, Status string
			ExpiresAt            *time.Time `json:"expires_at"`
		} `json:"approvals"`
		State struct {
			Refund struct {
				ID string `json:"id"`
			} `json:"refund"`
		} `json:"state"`
	}
	if err := json.Unmarshal([]byte(p.out.String()), &v); err != nil || code != 0 || v.Status != "waiting_approval" || len(v.Approvals) != 1 ||
		v.Approvals[0].Gate != "approve" || v.Approvals[0].Status != "pending" || len(v.Approvals[0].Digest) != 64 || v.Approvals[0].ExpiresAt == nil {
		t.Fatalf("status: exit %d %v %+v\n%s", code, err, v, p.out.String())
	}
	if p, code := run("approve", "refund-1", "approve", "--by", "mallory"); code != 1 || !strings.Contains(p.errOut.String(), "may be decided by alice, bob, not mallory") {
		t.Fatalf("approve by mallory: exit %d %s", code, p.errOut.String())
	}
	if p, code := run("approve", "refund-1", "approve", "--by", "alice", "--digest", v.Approvals[0].Digest, "--reason", "order checked"); code != 0 ||
		!strings.Contains(p.out.String(), "job refund-1 gate approve approved by alice: order checked") {
		t.Fatalf("approve: exit %d\n%s%s", code, p.out.String(), p.errOut.String())
	}
	testsupport.Eventually(t, 30*time.Second, func() bool {
		p, _ = run("status", "refund-1", "-o", "json")
		return json.Unmarshal([]byte(p.out.String()), &v) == nil && v.Status == "completed"
	}, "the job never completed: %s", p.out.String())
	if !strings.HasPrefix(v.State.Refund.ID, "ch_") {
		t.Errorf("refund %+v", v.State.Refund)
	}
	if p, code := run("approve", "refund-1", "approve", "--by", "alice"); code != 1 || !strings.Contains(p.errOut.String(), "already decided") {
		t.Fatalf("second approval: exit %d %s", code, p.errOut.String())
	}
	charges, err := os.ReadFile(filepath.Join(dir, "demo", "payments", "charges.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(strings.TrimSpace(string(charges)), "\n") + 1; n != 1 {
		t.Fatalf("%d refunds paid:\n%s", n, charges)
	}
}
