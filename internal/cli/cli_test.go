package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// execute runs the engine CLI in this process and returns its output and
// exit code.
func execute(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := NewEngineCommand(&out, &errb)
	cmd.SetArgs(args)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := cmd.ExecuteContext(ctx)
	if err != nil {
		errb.WriteString("error: " + err.Error() + "\n")
		code = 1
		var ee *ExitError
		if errors.As(err, &ee) {
			code = ee.Code
		}
	}
	return out.String(), errb.String(), code
}

func repo(p string) string { return filepath.Join(testsupport.ModuleRoot(), p) }

func TestQuickstartCompletes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	out, errOut, code := execute(t, "run", repo("examples/quickstart/workflow.yaml"),
		"--input", repo("examples/quickstart/input.json"), "--data-dir", dir, "--sync", "interval",
		"--model-mode", "replay", "--output", "json")
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
	}
	var v struct {
		engine.JobView
		State struct {
			Triage struct {
				Tickets []struct {
					ReportID string `json:"report_id"`
					Severity string `json:"severity"`
				} `json:"tickets"`
				NotFiled []struct {
					ReportID    string `json:"report_id"`
					Reason      string `json:"reason"`
					DuplicateOf string `json:"duplicate_of"`
				} `json:"not_filed"`
				Digest string `json:"digest"`
			} `json:"triage"`
			Filed struct {
				Tickets []struct {
					ID       string `json:"id"`
					ReportID string `json:"report_id"`
				} `json:"tickets"`
			} `json:"filed"`
		} `json:"state"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("output is not one JSON object: %v\n%s", err, out)
	}
	if v.Status != schemas.JobCompleted || v.Workflow != "bug-triage" || len(v.DefinitionHash) != 64 || v.ResumeCount != 0 || v.ID == "" {
		t.Fatalf("record = %+v", v.JobView)
	}
	if len(v.Steps) != 2 || v.Steps[0].ID != "classify" || v.Steps[1].ID != "file_tickets" {
		t.Fatalf("steps = %+v", v.Steps)
	}
	for _, s := range v.Steps {
		if s.Status != schemas.StepCompleted || s.Attempts != 1 {
			t.Errorf("step %s = %+v, want completed in 1 attempt", s.ID, s)
		}
	}
	tr := v.State.Triage
	if len(tr.Tickets) != 5 || tr.Tickets[0].ReportID != "BR-2108" || tr.Tickets[0].Severity != "critical" {
		t.Errorf("triage tickets = %+v", tr.Tickets)
	}
	dup := false
	for _, n := range tr.NotFiled {
		dup = dup || (n.ReportID == "BR-2106" && n.Reason == "duplicate" && n.DuplicateOf == "BR-2102")
	}
	if !dup || tr.Digest == "" {
		t.Errorf("not_filed %+v digest %q", tr.NotFiled, tr.Digest)
	}
	if len(v.State.Filed.Tickets) != 5 || v.State.Filed.Tickets[0].ID != "WM-1001" || v.State.Filed.Tickets[4].ID != "WM-1005" {
		t.Errorf("filed = %+v", v.State.Filed.Tickets)
	}
	data, err := os.ReadFile(filepath.Join(dir, "demo", "tickets", "tickets.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(data, []byte("\n")); n != 5 {
		t.Errorf("tickets.jsonl holds %d tickets, want 5", n)
	}

	// The text output names each transition and the final state.
	out, errOut, code = execute(t, "run", repo("examples/quickstart/workflow.yaml"),
		"--input", repo("examples/quickstart/input.json"), "--data-dir", dir, "--sync", "interval", "--model-mode", "replay")
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
	}
	for _, want := range []string{"classify", "attempt 1", "completed", "file_tickets", "final state:", "resume_count 0", "tickets.jsonl"} {
		if !strings.Contains(out, want) {
			t.Errorf("text output lacks %q:\n%s", want, out)
		}
	}
}

func TestRunRejectsBadInputClearly(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		workflow string
		input    string
		want     []string // all must appear in stderr
	}{
		{"malformed YAML", "testdata/bad-yaml.yaml", "", []string{"bad-yaml.yaml:6", "YAML"}},
		{"fails the workflow schema", "testdata/bad-schema.yaml", "", []string{"bad-schema.yaml:7", "steps[0].retry.max_attempts", ">= 1"}},
		{"unknown step kind", "testdata/unknown-kind.yaml", "", []string{"unknown-kind.yaml:8", "steps[1].kind", `unknown step kind "sendfax"`, "model"}},
		{"transition to a missing step", "testdata/missing-target.yaml", "", []string{"missing-target.yaml:9", "steps[0].next[1].to", `"nowhere"`}},
		{"input fails the input schema", "testdata/typed-input.yaml", "testdata/bad-input.json", []string{"bad-input.json", "/amount_cents", ">= 1", "-5"}},
		{"input is not JSON", "testdata/typed-input.yaml", "testdata/malformed-input.json", []string{"malformed-input.json:2:", "not valid JSON"}},
		{"no such workflow file", "testdata/absent.yaml", "", []string{"absent.yaml", "no such file"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			args := []string{"run", tt.workflow, "--data-dir", dir, "--job-id", "rejected", "--sync", "interval"}
			if tt.input != "" {
				args = append(args, "--input", tt.input)
			}
			out, errOut, code := execute(t, args...)
			if code != 2 && !(tt.name == "no such workflow file" && code != 0) {
				t.Fatalf("exit %d, want 2\nstdout %s\nstderr %s", code, out, errOut)
			}
			for _, w := range tt.want {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q:\n%s", w, errOut)
				}
			}
			assertNothingStored(t, dir)
		})
	}
}

// assertNothingStored checks that a data directory, if a server ever ran on
// it, holds no job, no definition and no message.
func assertNothingStored(t *testing.T, dir string) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(dir, "jetstream")); errors.Is(err, os.ErrNotExist) {
		return // rejected before any server started
	}
	srv, err := natsserver.Start(natsserver.Config{DataDir: dir, Sync: natsserver.SyncInterval})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop(context.Background())
	nc, err := srv.Connect("check")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx := context.Background()
	st, err := kv.Open(ctx, js, kv.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Checkpoints.Get(ctx, "rejected"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("a checkpoint was stored for a rejected job: %v", err)
	}
	for _, name := range []string{st.Names.InboxStream, st.Names.WorkStream, "KV_" + st.Names.DefinitionBucket} {
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		info, _ := s.Info(ctx)
		if info.State.Msgs != 0 {
			t.Errorf("%s holds %d messages after a rejected run", name, info.State.Msgs)
		}
	}
}

func TestFlagErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--output", "yaml"}, `--output "yaml"`},
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--model-mode", "psychic"}, `--model-mode "psychic"`},
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--job-id", "no spaces"}, `job id "no spaces"`},
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--var", "novalue"}, `--var "novalue"`},
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--log-level", "loud"}, `--log-level "loud"`},
		{[]string{"validate", "testdata/typed-input.yaml", "--input", "testdata/bad-input.json"}, "/amount_cents"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args[2:], " "), func(t *testing.T) {
			t.Parallel()
			args := tt.args
			if args[0] == "run" {
				args = append(args, "--data-dir", t.TempDir())
			}
			_, errOut, code := execute(t, args...)
			if code != 2 || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d stderr %q, want 2 and %q", code, errOut, tt.want)
			}
		})
	}
}

func TestValidateAcceptsTheExamples(t *testing.T) {
	t.Parallel()
	out, errOut, code := execute(t, "validate", repo("examples/quickstart/workflow.yaml"), "--input", repo("examples/quickstart/input.json"))
	if code != 0 || !strings.Contains(out, "ok (bug-triage v1, 2 steps") {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
}

func TestModelRepliesThatAreNotJSONOrBreakTheSchemaAreRetried(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	in := filepath.Join(dir, "in.json")
	if err := os.WriteFile(in, []byte(`{"text": "both"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := execute(t, "run", "testdata/model-retry.yaml", "--input", in, "--data-dir", dir,
		"--sync", "interval", "--output", "json")
	if code != 1 || !strings.Contains(errOut, "stubborn") || !strings.Contains(errOut, "confidence") {
		t.Fatalf("exit %d, want 1 naming the step and the schema problem\nstdout %s\nstderr %s", code, out, errOut)
	}
	var v engine.JobView
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("output: %v\n%s", err, out)
	}
	steps := map[string]engine.StepView{}
	for _, s := range v.Steps {
		steps[s.ID] = s
	}
	// flaky: a reply that is not JSON, then one that breaks the schema, then a good one.
	if s := steps["flaky"]; s.Status != schemas.StepCompleted || s.Attempts != 3 {
		t.Errorf("flaky = %+v, want completed on the third attempt", s)
	}
	// stubborn: the same schema violation three times fails the job.
	if s := steps["stubborn"]; s.Status != schemas.StepFailed || s.Attempts != 3 || s.LastError == nil ||
		s.LastError.Code != schemas.CodeOutputInvalid || !strings.Contains(s.LastError.Message, "confidence") {
		t.Errorf("stubborn = %+v, want failed after 3 attempts quoting the schema", s)
	}
	if v.Status != schemas.JobFailed || v.Error == nil || v.Error.Step != "stubborn" {
		t.Errorf("job = %s %+v", v.Status, v.Error)
	}
	// The state before the failure is intact.
	var compact bytes.Buffer
	_ = json.Compact(&compact, v.State)
	v.State = compact.Bytes()
	if !strings.Contains(string(v.State), `"prepared":true`) || !strings.Contains(string(v.State), `"confidence":0.92`) ||
		strings.Contains(string(v.State), "second") {
		t.Errorf("state = %s", v.State)
	}

	// The history tells the story: the two failed attempts of flaky, with reasons.
	nc, srvStop := openDataDir(t, dir)
	defer srvStop()
	evs, err := engine.NewClient(nc).History(context.Background(), v.ID)
	if err != nil {
		t.Fatal(err)
	}
	var reasons []string
	for _, e := range evs {
		if e.Type == schemas.EventStepFailed && e.Data.Step == "flaky" {
			reasons = append(reasons, string(e.Data.Error.Code))
		}
	}
	if strings.Join(reasons, ",") != "reply_not_json,output_invalid" {
		t.Errorf("flaky's failures = %v, want reply_not_json then output_invalid", reasons)
	}
}

// openDataDir starts a server on a data directory a finished run left and
// opens the store.
func openDataDir(t *testing.T, dir string) (*kv.Store, func()) {
	t.Helper()
	srv, err := natsserver.Start(natsserver.Config{DataDir: dir, Sync: natsserver.SyncInterval})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := srv.Connect("check")
	if err != nil {
		t.Fatal(err)
	}
	js, _ := jetstream.New(nc)
	st, err := kv.Open(context.Background(), js, kv.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st, func() { nc.Close(); srv.Stop(context.Background()) }
}
