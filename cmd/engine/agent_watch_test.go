package main

import (
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// TestWatchStreamsAnAgentsTurns: engine watch, started before the job
// runs, prints the text of each agent turn as the worker streams it (on
// the core NATS subject <prefix>.stream.<job>) between the job's
// transitions, and exits 0 when the job completes; engine transcript then
// prints the conversation from the value store.
func TestWatchStreamsAnAgentsTurns(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	bin := testsupport.Binary(t, "engine")
	nats := "--nats-url=" + srv.URL()
	start := spawn(t, nil, bin, "start", "testdata/agent-stream.yaml", nats, "--job-id", "watched-1")
	<-start.done
	if start.err != nil {
		t.Fatalf("engine start: %v\n%s", start.err, start.errOut.String())
	}
	watch := spawn(t, nil, bin, "watch", "watched-1", nats, "--timeout", "60s")
	testsupport.Eventually(t, 20*time.Second, func() bool { return strings.Contains(watch.out.String(), "watching job watched-1") },
		"engine watch never said it was watching")
	spawn(t, []string{"WAYMARK_MODEL_MODE=replay"}, bin, "serve", nats, "--http=")
	select {
	case <-watch.done:
	case <-time.After(60 * time.Second):
		t.Fatal("engine watch did not stop when the job did")
	}
	out := watch.out.String()
	if watch.err != nil {
		t.Fatalf("engine watch: %v\n%s\n%s", watch.err, out, watch.errOut.String())
	}
	for _, want := range []string{
		"agent turn 1 > Let me look that up for you.",
		"agent.weather#1",
		"agent turn 2 > It is 19 degrees in Paris right now.",
		"job watched-1 completed",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("engine watch printed no %q:\n%s", want, out)
		}
	}
	if i, j := strings.Index(out, "turn 1 >"), strings.Index(out, "agent.weather#1"); i < 0 || j < i {
		t.Errorf("turn 1's text does not come before its tool call:\n%s", out)
	}
	tr := spawn(t, nil, bin, "transcript", "watched-1", nats)
	<-tr.done
	for _, want := range []string{
		"user:     Weather in Paris?",
		"assistant: Let me look that up for you.",
		`assistant: → weather {"city":"Paris"}  [c1]`,
		`user:     ← {"celsius":19}  [c1]`,
		"assistant: It is 19 degrees in Paris right now.",
	} {
		if !strings.Contains(tr.out.String(), want) {
			t.Errorf("engine transcript printed no %q:\n%s%s", want, tr.out.String(), tr.errOut.String())
		}
	}
}
