package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine/client"
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
		client.JobView
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
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--job-id", "no spaces"}, `--job-id "no spaces"`},
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--var", "novalue"}, `--var "novalue"`},
		{[]string{"run", repo("examples/quickstart/workflow.yaml"), "--log-level", "loud"}, `--log-level "loud"`},
		{[]string{"validate", "testdata/typed-input.yaml", "--input", "testdata/bad-input.json"}, "/amount_cents"},
		{[]string{"status", "bad id!", "--output", "text"}, `job id "bad id!"`},
		{[]string{"history", "bad id!", "--output", "json"}, `job id "bad id!"`},
		{[]string{"effects", "list", "--job", "bad id!"}, `--job: input_invalid: job id "bad id!"`},
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
	var v client.JobView
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("output: %v\n%s", err, out)
	}
	steps := map[string]client.StepView{}
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
	evs, err := client.New(nc).History(context.Background(), v.ID)
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

// writeWorkflow writes a workflow file into a fresh directory.
func writeWorkflow(t *testing.T, yaml string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "workflow.yaml")
	if err := os.WriteFile(p, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// unreachable is a NATS URL nothing listens on: commands that get past
// their checks fail to connect, with exit status 1.
const unreachable = "nats://127.0.0.1:1"

func TestStartChecksBeforeConnecting(t *testing.T) {
	t.Parallel()
	quickstart := repo("examples/quickstart/workflow.yaml")
	input := repo("examples/quickstart/input.json")
	withVars := writeWorkflow(t, "name: greeter\nversion: 1\nvars:\n  greeting: hi\n  name: you\nsteps:\n  - id: a\n    kind: noop\n")
	tests := []struct {
		name   string
		args   []string
		want   []string // all must appear in stderr
		unwant []string // none may
	}{
		{"no input, schema needs one", []string{"start", "testdata/typed-input.yaml"},
			[]string{"no --input given", "{}", "at /: missing properties", "--input FILE"}, []string{"input :"}},
		{"no input on run", []string{"run", "testdata/typed-input.yaml", "--data-dir", t.TempDir()},
			[]string{"no --input given", "at /: missing properties", "--input FILE"}, []string{"input :"}},
		{"undeclared var, none declared", []string{"start", quickstart, "--input", input, "--var", "nope=1"},
			[]string{`--var "nope=1"`, `workflow bug-triage declares no var "nope" (it declares none)`}, []string{"input.json", "declares: )"}},
		{"undeclared var on run", []string{"run", quickstart, "--input", input, "--var", "nope=1", "--data-dir", t.TempDir()},
			[]string{`--var "nope=1"`, "(it declares none)"}, []string{"input.json"}},
		{"undeclared var, some declared", []string{"start", withVars, "--var", "nope=1"},
			[]string{`--var "nope=1"`, "(it declares: greeting, name)"}, nil},
		{"bad job id", []string{"start", quickstart, "--input", input, "--job-id", "x y"},
			[]string{`--job-id "x y": want 1-128 letters`}, []string{"input.json"}},
		{"bad job id on run", []string{"run", quickstart, "--input", input, "--job-id", "x y", "--data-dir", t.TempDir()},
			[]string{`--job-id "x y": want 1-128 letters`}, []string{"input.json"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, errOut, code := execute(t, append(tt.args, "--nats-url", unreachable)...)
			if code != 2 {
				t.Fatalf("exit %d, want 2\n%s", code, errOut)
			}
			for _, w := range tt.want {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q:\n%s", w, errOut)
				}
			}
			for _, w := range tt.unwant {
				if strings.Contains(errOut, w) {
					t.Errorf("stderr has %q:\n%s", w, errOut)
				}
			}
		})
	}
}

func TestStartWithoutInputStartsWithEmptyInput(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	wf := writeWorkflow(t, "name: greeter\nversion: 1\nvars:\n  greeting: hi\nsteps:\n  - id: a\n    kind: noop\n")
	out, errOut, code := execute(t, "start", wf, "--job-id", "no-input", "--var", "greeting=hello", "--nats-url", srv.URL(), "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	var res client.StartResult
	if err := json.Unmarshal([]byte(out), &res); err != nil || res.JobID != "no-input" || res.Attached {
		t.Fatalf("start printed %q (%v), want job no-input started", out, err)
	}
	st := srv.Store(t, kv.Config{})
	ent, err := st.Checkpoints.Get(context.Background(), "no-input")
	if err != nil {
		t.Fatal(err)
	}
	var compact bytes.Buffer
	_ = json.Compact(&compact, ent.Checkpoint.State)
	if compact.String() != "{}" {
		t.Errorf("state = %s, want {}", ent.Checkpoint.State)
	}
}

func TestValidateCountsSteps(t *testing.T) {
	t.Parallel()
	out, errOut, code := execute(t, "validate", "testdata/typed-input.yaml")
	if code != 0 || !strings.Contains(out, "(typed-input v1, 1 step, definition ") {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
}

func TestUnknownCommandIsAUsageError(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"frobnicate"}, {"effects", "frobnicate"}, {"strat"}} {
		out, errOut, code := execute(t, args...)
		if code != 2 || !strings.Contains(errOut, `unknown command "`+args[len(args)-1]+`"`) {
			t.Errorf("%v: exit %d\n%s%s", args, code, out, errOut)
		}
	}
	if _, errOut, _ := execute(t, "strat"); !strings.Contains(errOut, "did you mean start?") {
		t.Errorf("strat: no suggestion: %s", errOut)
	}
	if out, errOut, code := execute(t); code != 0 || !strings.Contains(out, "Available Commands") {
		t.Errorf("no command: exit %d\n%s%s; want the help", code, out, errOut)
	}
}

func TestBenchFlagErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"--jobs", "0"}, `--jobs 0`},
		{[]string{"--steps", "0"}, `--steps 0`},
		{[]string{"--rounds", "0"}, `--rounds 0`},
		{[]string{"--worker-concurrency", "0"}, `--worker-concurrency 0`},
		{[]string{"--concurrency", "-1"}, `--concurrency -1`},
		{[]string{"--jobs", "10", "--concurrency", "11"}, `--concurrency 11`},
		{[]string{"--payload", "-1"}, `--payload -1`},
		{[]string{"--kind", "fax"}, `--kind "fax"`},
		{[]string{"--cluster", "2"}, `--cluster 2`},
		{[]string{"--group-commit", "maybe"}, `--group-commit "maybe"`},
		{[]string{"--sync", "never"}, `--sync "never"`},
		{[]string{"--queue-storage", "disk"}, `--queue-storage "disk"`},
		{[]string{"--no-floor", "--floor-only"}, "--no-floor and --floor-only"},
		{[]string{"scale", "--settle", "-1s"}, `--settle -1s`},
		{[]string{"scale", "--jobs", "100,10"}, `--jobs 100,10: want ascending`},
		{[]string{"scale", "--jobs", "0,10"}, `--jobs 0,10`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			t.Parallel()
			out, errOut, code := execute(t, append([]string{"bench"}, tt.args...)...)
			if code != 2 || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d stderr %q, want 2 and %q\n%s", code, errOut, tt.want, out)
			}
		})
	}
	cmd := NewEngineCommand(&bytes.Buffer{}, &bytes.Buffer{})
	b, _, err := cmd.Find([]string{"bench"})
	if err != nil || !strings.Contains(b.Flags().Lookup("sync").Usage, "serve default to always") {
		t.Errorf("bench --sync help does not say how its default differs: %v", err)
	}
}

// TestBadEnvironmentIsAUsageError sets WAYMARK_* variables, so it does not
// run in parallel.
func TestBadEnvironmentIsAUsageError(t *testing.T) {
	quickstart := repo("examples/quickstart/workflow.yaml")
	input := repo("examples/quickstart/input.json")
	tests := []struct {
		env, value string
		args       []string
		want       string
	}{
		{"WAYMARK_QUEUE_STORAGE", "disk", []string{"list"}, `WAYMARK_QUEUE_STORAGE="disk": kv config: queue storage "disk"`},
		{"WAYMARK_GROUP_COMMIT", "yes", []string{"run", quickstart, "--input", input}, `WAYMARK_GROUP_COMMIT="yes": want on or off`},
		{"WAYMARK_REPLICAS", "2", []string{"effects", "list"}, `WAYMARK_REPLICAS="2": kv config: replicas 2`},
		{"WAYMARK_REPLICAS", "two", []string{"status", "j"}, `WAYMARK_REPLICAS="two": strconv.Atoi`},
		{"WAYMARK_INBOX_ACK_WAIT", "-1s", []string{"list"}, `WAYMARK_INBOX_ACK_WAIT="-1s": kv config: inbox ack wait -1s`},
		{"WAYMARK_JOB_RETENTION", "-1h", []string{"start", quickstart, "--input", input}, `WAYMARK_JOB_RETENTION="-1h": want a positive duration, or 0 to keep finished jobs forever`},
		{"WAYMARK_EFFECT_RETENTION", "720h", []string{"list"}, `WAYMARK_EFFECT_RETENTION="720h": renamed`},
		{"WAYMARK_EVENT_RETENTION", "10ms", []string{"events", "send", "--type", "t", "--source", "/s"}, `WAYMARK_EVENT_RETENTION="10ms": want a duration of at least 1s`},
		{"WAYMARK_EVENT_RETENTION", "week", []string{"list"}, `WAYMARK_EVENT_RETENTION="week": time: invalid duration`},
		{"WAYMARK_HISTORY_MAX_AGE", "-1h", []string{"history", "j"}, `WAYMARK_HISTORY_MAX_AGE="-1h"`},
		{"WAYMARK_DUPLICATES", "10ms", []string{"list"}, `WAYMARK_DUPLICATES="10ms"`},
		{"WAYMARK_WORK_MAX_DELIVER", "1", []string{"list"}, `WAYMARK_WORK_MAX_DELIVER="1"`},
		{"WAYMARK_PREFIX", "Bad.Prefix", []string{"list"}, `--prefix "Bad.Prefix" (from WAYMARK_PREFIX)`},
		{"WAYMARK_LOG_LEVEL", "loud", []string{"list"}, `--log-level "loud" (from WAYMARK_LOG_LEVEL)`},
		{"WAYMARK_MODEL_MODE", "psychic", []string{"run", quickstart, "--input", input}, `--model-mode "psychic" (from WAYMARK_MODEL_MODE)`},
		{"WAYMARK_SYNC", "sometimes", []string{"run", quickstart, "--input", input}, `--sync "sometimes" (from WAYMARK_SYNC): want always or interval`},
		{"WAYMARK_QUEUE_STORAGE", "disk", []string{"run", quickstart, "--input", input}, `WAYMARK_QUEUE_STORAGE="disk"`},
	}
	for _, tt := range tests {
		t.Run(tt.env+"="+tt.value+" "+tt.args[0], func(t *testing.T) {
			t.Setenv(tt.env, tt.value)
			dir := t.TempDir()
			args := append(tt.args, "--nats-url", unreachable)
			if tt.args[0] == "run" { // on an embedded server, which must not start
				args = append(tt.args, "--data-dir", dir)
				if tt.env != "WAYMARK_MODEL_MODE" {
					args = append(args, "--model-mode", "replay")
				}
			}
			out, errOut, code := execute(t, args...)
			if code != 2 || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d, want 2 and %q\nstdout %s\nstderr %s", code, tt.want, out, errOut)
			}
			if _, err := os.Stat(filepath.Join(dir, "jetstream")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a server started before the variable was refused (%v)", err)
			}
		})
	}

	// A flag given on the command line is named as the flag alone.
	t.Setenv("WAYMARK_SYNC", "interval")
	_, errOut, code := execute(t, "run", quickstart, "--input", input, "--data-dir", t.TempDir(), "--sync", "sometimes")
	if code != 2 || !strings.Contains(errOut, `--sync "sometimes": want`) {
		t.Errorf("exit %d stderr %q, want the --sync flag named alone", code, errOut)
	}
	// Zero keeps finished jobs forever.
	t.Setenv("WAYMARK_JOB_RETENTION", "0s")
	if _, errOut, code := execute(t, "list", "--nats-url", unreachable); code != 1 || !strings.Contains(errOut, "connect to NATS") {
		t.Errorf("WAYMARK_JOB_RETENTION=0s: exit %d stderr %q, want it accepted (then no server)", code, errOut)
	}
}

func TestUnreachableServerNamesEngineServe(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"effects", "list"}, {"effects", "resolve", "j/notify", "--happened"}, {"list"}} {
		_, errOut, code := execute(t, append(args, "--nats-url", unreachable)...)
		if code != 1 || !strings.Contains(errOut, "engine serve --data-dir DIR") || !strings.Contains(errOut, "NATS_URL") {
			t.Errorf("%v: exit %d stderr %q; want 1 and how to start a server", args, code, errOut)
		}
	}
}

// TestNeedsReconciliationHint: a run whose unsafe effect's outcome is
// unknown exits 3 and tells how to settle it: the resolve command needs an
// engine serving the same data directory.
func TestNeedsReconciliationHint(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	mail := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		calls.Add(1)
		// Hang up without an answer: the mail may or may not have gone.
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			_ = conn.Close()
		}
	}))
	t.Cleanup(mail.Close)
	wf := writeWorkflow(t, `name: notify-once
version: 1
steps:
  - id: notify
    kind: http
    effect: unsafe
    with:
      method: POST
      url: '{{service "mail"}}/v1/send'
      body: '{"to": "a@example.com"}'
`)
	dir := filepath.Join(t.TempDir(), "my data")
	out, errOut, code := execute(t, "run", wf, "--data-dir", dir, "--sync", "interval", "--job-id", "hint",
		"--service", "mail="+mail.URL)
	if code != 3 {
		t.Fatalf("exit %d, want 3\nstdout %s\nstderr %s", code, out, errOut)
	}
	for _, want := range []string{
		"job hint needs reconciliation",
		"start `engine serve --data-dir '" + dir + "' --service mail=" + mail.URL + "` (or point NATS_URL at your server)",
		"then run `engine effects resolve hint/notify --happened",
		"`engine effects resolve hint/notify --not-happened`",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("mail called %d times, want once", n)
	}
}

// TestEmbeddedFlagsWinOverNATSURL: with NATS_URL exported, giving the
// embedded server's flags uses the embedded server (flags win over the
// environment) and says so; with --nats-url given too, it is an error.
func TestEmbeddedFlagsWinOverNATSURL(t *testing.T) {
	t.Setenv("NATS_URL", "nats://127.0.0.1:1")
	dir := t.TempDir()
	out, errOut, code := execute(t, "run", repo("examples/quickstart/workflow.yaml"),
		"--input", repo("examples/quickstart/input.json"), "--data-dir", dir, "--sync", "interval", "--model-mode", "replay")
	if code != 0 || !strings.Contains(out, "completed") {
		t.Fatalf("run with NATS_URL set and --data-dir: exit %d\n%s\n%s", code, out, errOut)
	}
	if !strings.Contains(errOut, "flags win: using the embedded server") {
		t.Errorf("no warning that NATS_URL was set aside:\n%s", errOut)
	}
	_, errOut, code = execute(t, "serve", "--nats-url", "nats://127.0.0.1:1", "--data-dir", dir)
	if code != 2 || !strings.Contains(errOut, "--nats-url and --data-dir both given") {
		t.Errorf("serve --nats-url --data-dir: exit %d, want 2 saying both were given:\n%s", code, errOut)
	}
}

// TestInputFileWithAByteOrderMark: a UTF-8 byte order mark an editor wrote
// before the JSON is not part of the input.
func TestInputFileWithAByteOrderMark(t *testing.T) {
	t.Parallel()
	p := filepath.Join(t.TempDir(), "input.json")
	if err := os.WriteFile(p, []byte("\xef\xbb\xbf{\"title\": \"x\"}"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := readInput(p, nil)
	if err != nil || string(got) != `{"title": "x"}` {
		t.Fatalf("readInput = %s, %v; want the JSON without the mark", got, err)
	}
}

// TestRunStopsWhenItsChildWaitsForAPerson: a child job whose unsafe call
// timed out stops in needs_reconciliation; engine run of the parent exits
// 3 naming the child and the effect, instead of waiting for ever.
func TestRunStopsWhenItsChildWaitsForAPerson(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select { // slower than the step's timeout
		case <-release:
		case <-time.After(5 * time.Second):
		}
		_, _ = w.Write([]byte(`{}`))
	}))
	defer srv.Close()
	defer close(release)
	dir := t.TempDir()
	parent := filepath.Join(dir, "parent.yaml")
	child := filepath.Join(dir, "child.yaml")
	if err := os.WriteFile(parent, []byte("name: parent\nversion: 1\nsteps:\n  - {id: call, kind: workflow, with: {workflow: mailer}, save_as: r}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(child, []byte("name: mailer\nversion: 1\nsteps:\n  - id: send\n    kind: http\n    effect: unsafe\n    timeout: 500ms\n    retry: {max_attempts: 1}\n    with: {method: POST, url: '"+srv.URL+"/send', body: {to: x}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, errOut, code := execute(t, "run", parent, "--child", child, "--data-dir", filepath.Join(dir, "data"), "--sync", "interval", "--timeout", "60s")
	if code != 3 || !strings.Contains(errOut, "waits on its child job") || !strings.Contains(errOut, "needs_reconciliation") || !strings.Contains(errOut, "/send") {
		t.Fatalf("exit %d, want 3 naming the waiting child and its effect\n%s", code, errOut)
	}
}
