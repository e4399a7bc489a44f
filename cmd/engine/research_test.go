package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/crashtest"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// TestResearchExampleResumesAfterACrash is the README's map, parallel and
// child job example: killed in the middle of the map, run again, the job
// finishes; no document is summarised twice, and the report is filed once
// by one child job.
func TestResearchExampleResumesAfterACrash(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, failpoint string }{
		// Items of the map are done, others in flight.
		{"mid-map", "engine.after_checkpoint=crash@3"},
		// The child job is started, the parent's message not yet
		// acknowledged: the start is made again and attaches.
		{"after starting the child", "engine.after_dispatch=crash/file"},
		// The child's dispatch is recorded, the child not yet started.
		{"before starting the child", "engine.after_checkpoint=crash/file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			researchCrash(t, tc.failpoint)
		})
	}
}

func researchCrash(t *testing.T, fp string) {
	bin := testsupport.Binary(t, "engine")
	root := testsupport.ModuleRoot()
	dir := t.TempDir()
	args := []string{"run", filepath.Join(root, "examples/research/workflow.yaml"),
		"--child", filepath.Join(root, "examples/research/file-report.yaml"),
		"--input", filepath.Join(root, "examples/research/input.json"),
		"--job-id", "digest-1", "--data-dir", dir, "--sync", "always", "--output", "json"}
	env := []string{"WAYMARK_MODEL_MODE=replay"}
	first := spawn(t, append(env, "WAYMARK_FAILPOINTS="+fp), bin, args...)
	first.waitKilled(t, 60*time.Second)

	second := spawn(t, env, bin, args...)
	select {
	case <-second.done:
	case <-time.After(60 * time.Second):
		t.Fatal("second run did not finish")
	}
	if second.err != nil {
		t.Fatalf("second run: %v\n%s", second.err, second.out.String())
	}
	out := second.out.String()
	var v client.JobView
	if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &v); err != nil {
		t.Fatalf("decode job record: %v\n%s", err, out)
	}
	if v.Status != schemas.JobCompleted || v.ResumeCount != 1 || len(v.Children) != 1 {
		t.Fatalf("status %s resume_count %d children %v, want completed after 1 resume with one child", v.Status, v.ResumeCount, v.Children)
	}
	var st struct {
		Summaries []struct {
			Summary string `json:"summary"`
		} `json:"summaries"`
		Headline map[string]string `json:"headline"`
		Filed    struct {
			Ticket struct {
				Tickets []struct {
					ID string `json:"id"`
				} `json:"tickets"`
			} `json:"ticket"`
		} `json:"filed"`
	}
	if err := json.Unmarshal(v.State, &st); err != nil || len(st.Summaries) != 5 || st.Headline["headline"] == "" {
		t.Fatalf("state %s (%v)", v.State, err)
	}
	tickets, err := os.ReadFile(filepath.Join(dir, "demo", "tickets", "tickets.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(tickets, []byte("\n")); n != 1 {
		t.Errorf("tickets.jsonl holds %d tickets, want the report filed once", n)
	}
	if ids := childIDs(t, dir); len(ids) != 1 {
		t.Errorf("child jobs started: %v, want one", ids)
	}
}

// childIDs lists the child jobs whose file-report tickets the demo ticket
// service holds, by the idempotency keys of their requests.
func childIDs(t *testing.T, dir string) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "demo", "tickets", "tickets.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	var out []string
	for _, line := range bytes.Split(bytes.TrimSpace(data), []byte("\n")) {
		var tk struct {
			Key string `json:"idempotency_key"`
		}
		if json.Unmarshal(line, &tk) == nil && !seen[tk.Key] {
			seen[tk.Key] = true
			out = append(out, tk.Key)
		}
	}
	return out
}

// TestResearchExampleNeedsItsChild: without --child the child's workflow
// is unknown: refused at load, naming the file, line and path.
func TestResearchExampleNeedsItsChild(t *testing.T) {
	t.Parallel()
	bin := testsupport.Binary(t, "engine")
	root := testsupport.ModuleRoot()
	env := []string{"WAYMARK_MODEL_MODE=replay"}
	bad := spawn(t, env, bin, "run", filepath.Join(root, "examples/research/workflow.yaml"),
		"--input", filepath.Join(root, "examples/research/input.json"), "--data-dir", t.TempDir())
	<-bad.done
	var ee *exec.ExitError
	code := 0
	if errors.As(bad.err, &ee) {
		code = ee.ExitCode()
	}
	if msg := bad.errOut.String(); code != 2 || !strings.Contains(msg, `workflow.yaml:`) || !strings.Contains(msg, `steps[4].with.workflow: workflow "file-report" is not stored, and no --child file defines it`) {
		t.Errorf("run without --child: exit %d\n%s", code, msg)
	}
}

// TestCrashtestRunsTheResearchExample: engine crashtest takes child
// workflows (--child, Config.Children): crashing the engine around the map
// and the child job's start, every case completes with the ticket filed
// once.
func TestCrashtestRunsTheResearchExample(t *testing.T) {
	t.Parallel()
	root := testsupport.ModuleRoot()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := crashtest.Run(ctx, crashtest.Config{
		Binary:   testsupport.Binary(t, "engine"),
		Workflow: filepath.Join(root, "examples/research/workflow.yaml"),
		Children: []string{filepath.Join(root, "examples/research/file-report.yaml")},
		Input:    filepath.Join(root, "examples/research/input.json"),
		Points:   []string{failpoint.EngineAfterCheckpoint, failpoint.EngineAfterDispatch, crashtest.SlowProvider},
		Steps:    []string{"summarise", "file"},
		Timeout:  40 * time.Second,
		Dir:      t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range rep.Points {
		for _, problem := range p.Problems() {
			t.Errorf("%s at %s: %s", p.Failpoint, p.Step, problem)
		}
		if p.FinalStatus != string(schemas.JobCompleted) {
			t.Errorf("%s at %s: final status %q, want completed", p.Failpoint, p.Step, p.FinalStatus)
		}
	}
}
