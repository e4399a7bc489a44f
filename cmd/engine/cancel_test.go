package main

import (
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// TestCancelCommand: engine cancel ends a running job cancelled, naming
// who and why (exit 0); the job is listed under --status cancelled; a
// cancel of an unknown job exits 1, one without a job id 2.
func TestCancelCommand(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	bin := testsupport.Binary(t, "engine")
	nats := "--nats-url=" + srv.URL()
	start := spawn(t, nil, bin, "start", "testdata/agent-stream.yaml", nats, "--job-id", "to-cancel")
	<-start.done
	if start.err != nil {
		t.Fatalf("engine start: %v\n%s", start.err, start.errOut.String())
	}
	spawn(t, nil, bin, "serve", nats, "--http=", "--workers=0") // no worker: the turn waits
	run := commandRunner(t, nil, bin, nats)
	p, code := run("cancel", "to-cancel", "--by", "ops", "--reason", "not needed")
	if code != 0 || !strings.Contains(p.out.String(), "job to-cancel cancelled by ops: not needed") {
		t.Fatalf("cancel: exit %d\n%s%s", code, p.out.String(), p.errOut.String())
	}
	// The index entry of an ended job follows its last checkpoint.
	testsupport.Eventually(t, 20*time.Second, func() bool {
		p, _ = run("list", "--status", "cancelled")
		return strings.Contains(p.out.String(), "to-cancel")
	}, "list --status cancelled never showed the job")
	if _, code := run("cancel", "no-such-job", "--by", "ops"); code != 1 {
		t.Errorf("cancel of an unknown job: exit %d, want 1", code)
	}
	if _, code := run("cancel"); code != 2 {
		t.Errorf("cancel without a job: exit %d, want 2", code)
	}
}
