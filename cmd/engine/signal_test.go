package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// TestSignalCommand: engine signal --start starts the job and its wait
// step takes the signal (exit 0); data breaking the schema exits 2 and a
// name no wait step has 1, both before anything is started; the same
// signal again is answered as received before (exit 0), a new one to the
// ended job exits 1.
func TestSignalCommand(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	bin := testsupport.Binary(t, "engine")
	nats := "--nats-url=" + srv.URL()
	spawn(t, nil, bin, "serve", nats, "--http=", "--workers=0")
	dir := t.TempDir()
	good, bad := filepath.Join(dir, "good.json"), filepath.Join(dir, "bad.json")
	if err := os.WriteFile(good, []byte(`{"amount": 12}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, []byte(`{"amount": "twelve"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	run := commandRunner(t, nil, bin, nats)
	if p, code := run("signal", "order-7", "paid", "--data", bad, "--start", "testdata/wait-signal.yaml"); code != 2 || !strings.Contains(p.errOut.String(), "does not satisfy the schema of wait step paid") {
		t.Fatalf("bad data: exit %d %s", code, p.errOut.String())
	}
	if p, code := run("signal", "order-7", "refunded", "--by", "psp", "--start", "testdata/wait-signal.yaml"); code != 1 || !strings.Contains(p.errOut.String(), "no wait step for signal") {
		t.Fatalf("unknown signal: exit %d %s", code, p.errOut.String())
	}
	if p, code := run("status", "order-7"); code != 1 {
		t.Fatalf("a refused signal with --start started the job: exit %d %s", code, p.out.String())
	}
	p, code := run("signal", "order-7", "paid", "--data", good, "--id", "evt-1", "--by", "psp", "--start", "testdata/wait-signal.yaml")
	if code != 0 || !strings.Contains(p.out.String(), "taken by wait step paid") {
		t.Fatalf("signal: exit %d\n%s%s", code, p.out.String(), p.errOut.String())
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		p, _ = run("status", "order-7")
		return strings.Contains(p.out.String(), "completed")
	}, "the job never completed: %s", p.out.String())
	if p, code := run("signal", "order-7", "paid", "--data", good, "--id", "evt-1"); code != 0 || !strings.Contains(p.out.String(), "was received before (taken by wait step paid") {
		t.Fatalf("the same signal again (a retried webhook): exit %d %s%s", code, p.out.String(), p.errOut.String())
	}
	if p, code := run("signal", "order-7", "paid", "--data", good, "--id", "evt-2"); code != 1 || !strings.Contains(p.errOut.String(), "completed") {
		t.Fatalf("a new signal to the ended job: exit %d %s", code, p.errOut.String())
	}
}
