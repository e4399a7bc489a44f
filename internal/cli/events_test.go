package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine/trigger"
	"github.com/waymark-dev/waymark/internal/testsupport"
)

// TestEventsSendAndTriggers drives the CLI against a real engine serve:
// engine triggers add stores a workflow with a trigger, engine triggers
// lists it, engine events send over NATS starts one job for an event sent
// twice (the second answer a duplicate naming the same job), and an event
// no trigger takes exits 1 naming no_trigger.
func TestEventsSendAndTriggers(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var serveOut, serveErr bytes.Buffer
	wg.Add(1)
	go func() {
		defer wg.Done()
		cmd := NewEngineCommand(&serveOut, &serveErr)
		cmd.SetArgs([]string{"serve", "--nats-url", srv.URL(), "--http", "", "--workers", "1"})
		if err := cmd.ExecuteContext(ctx); err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })

	wf := writeWorkflow(t, `name: tickets
version: 1
input_schema: {type: object, required: [title], properties: {title: {type: string}}}
steps:
  - id: file
    kind: noop
triggers:
  - name: opened
    type: com.example.ticket.opened
    input: {title: event.data.title}
`)
	out, errOut, code := execute(t, "triggers", "add", wf, "--nats-url", srv.URL())
	if code != 0 || !strings.Contains(out, "opened") || !strings.Contains(out, "com.example.ticket.opened") {
		t.Fatalf("triggers add: exit %d\n%s%s", code, out, errOut)
	}
	data := filepath.Join(t.TempDir(), "data.json")
	if err := os.WriteFile(data, []byte(`{"title": "printer on fire"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	send := func(args ...string) (trigger.Answer, string, int) {
		var out, errOut string
		var code int
		// Until the engine's intake subscribed: "no responders".
		testsupport.Eventually(t, 30*time.Second, func() bool {
			out, errOut, code = execute(t, append([]string{"events", "send", "--nats-url", srv.URL(), "-o", "json"}, args...)...)
			return !strings.Contains(errOut, "no responders")
		}, "the engine never answered: %s", errOut)
		var a trigger.Answer
		_ = json.Unmarshal([]byte(out), &a)
		return a, out + errOut, code
	}
	args := []string{"--type", "com.example.ticket.opened", "--source", "/helpdesk", "--id", "t-1", "--data", data}
	first, text, code := send(args...)
	if code != 0 || len(first.Jobs) != 1 || first.Jobs[0].Duplicate {
		t.Fatalf("first send: exit %d\n%s", code, text)
	}
	second, text, code := send(args...)
	if code != 0 || len(second.Jobs) != 1 || second.Jobs[0].JobID != first.Jobs[0].JobID || !second.Jobs[0].Duplicate {
		t.Fatalf("second send: exit %d\n%s", code, text)
	}
	_, text, code = send("--type", "com.example.ticket.closed", "--source", "/helpdesk")
	if code != 1 || !strings.Contains(text, "no_trigger") || !strings.Contains(text, "tickets/opened") {
		t.Fatalf("unmatched send: exit %d\n%s", code, text)
	}
	out, errOut, code = execute(t, "triggers", "--nats-url", srv.URL(), "-o", "json")
	var listed struct{ Triggers []trigger.Rule }
	if code != 0 || json.Unmarshal([]byte(out), &listed) != nil || len(listed.Triggers) != 1 || listed.Triggers[0].Workflow != "tickets" {
		t.Fatalf("triggers: exit %d\n%s%s", code, out, errOut)
	}
	if _, errOut, code := execute(t, "events", "send", "--source", "/x", "--nats-url", srv.URL()); code != 2 || !strings.Contains(errOut, "type") {
		t.Fatalf("send without --type: exit %d %s", code, errOut)
	}
}
