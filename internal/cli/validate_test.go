package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// liveOnly is a model step that only a worker calling a local
// OpenAI-compatible server can run: no cassette.
const liveOnly = `name: local-model
version: 1
state_schema:
  type: object
  required: [question]
  additionalProperties: false
  properties:
    question: {type: string}
    answer: {type: object}
steps:
  - id: ask
    kind: model
    save_as: answer
    with:
      provider: openai
      model: llama3
      base_url: http://localhost:11434/v1
      prompt: "{{.state.question}}"
`

// TestValidateAndStartAcceptALiveOnlyModelStep: the README says a
// cassette is optional. validate and start used to refuse such a step
// ("provider replay mode needs a cassette"); they accept it, validate
// warning that workers in replay mode cannot run it. --strict makes the
// warning an error.
func TestValidateAndStartAcceptALiveOnlyModelStep(t *testing.T) {
	t.Parallel()
	wf := writeWorkflow(t, liveOnly)
	out, errOut, code := execute(t, "validate", wf)
	if code != 0 || !strings.Contains(out, "ok (local-model v1, 1 step, definition ") || !strings.Contains(out, ", 1 warning)") {
		t.Fatalf("validate: exit %d\n%s%s", code, out, errOut)
	}
	if want := wf + ":14:5: warning: steps[0].with: workers that replay (--model-mode replay, or auto without the provider's API key) cannot run this step: provider replay mode needs a cassette"; !strings.Contains(errOut, want) {
		t.Errorf("stderr lacks %q:\n%s", want, errOut)
	}
	if _, errOut, code := execute(t, "validate", wf, "--strict"); code != 2 || !strings.Contains(errOut, "1 warning (--strict)") {
		t.Errorf("validate --strict: exit %d\n%s", code, errOut)
	}

	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	input := filepath.Join(t.TempDir(), "input.json")
	if err := os.WriteFile(input, []byte(`{"question": "why?"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, code = execute(t, "start", wf, "--input", input, "--job-id", "local-1", "--nats-url", srv.URL())
	if code != 0 || strings.TrimSpace(out) != "local-1" {
		t.Fatalf("start: exit %d\n%s%s", code, out, errOut)
	}
	if _, err := srv.Store(t, kv.Config{}).Checkpoints.Get(context.Background(), "local-1"); err != nil {
		t.Errorf("started job not stored: %v", err)
	}
}

// TestValidateChecksConditionsAndTemplatesAgainstTheSchemas: a when that
// is not a boolean and a template field the state schema does not have
// used to pass validate and fail mid-job; both are refused with file,
// line and path.
func TestValidateChecksConditionsAndTemplatesAgainstTheSchemas(t *testing.T) {
	t.Parallel()
	wf := writeWorkflow(t, `name: checked
version: 1
state_schema:
  type: object
  required: [count, email]
  additionalProperties: false
  properties:
    count: {type: integer}
    email: {type: string}
steps:
  - id: notify
    kind: http
    with:
      url: "http://mail.test/send?to={{.state.emial}}"
    next:
      - {to: notify, when: "state.count"}
`)
	_, errOut, code := execute(t, "validate", wf)
	if code != 2 {
		t.Fatalf("exit %d, want 2\n%s", code, errOut)
	}
	for _, want := range []string{
		wf + ":14:7: steps[0].with.url: template line 1 reads .state.emial: it cannot exist",
		wf + ":16:22: steps[0].next[0].when: condition does not type-check", "expected bool, but got float64",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
}

func TestUnknownKindPointsAtAllowKind(t *testing.T) {
	t.Parallel()
	_, errOut, code := execute(t, "validate", "testdata/unknown-kind.yaml")
	if code != 2 || !strings.Contains(errOut, "allow it with --allow-kind sendfax") {
		t.Errorf("exit %d, stderr %s", code, errOut)
	}
	if out, errOut, code := execute(t, "validate", "testdata/unknown-kind.yaml", "--allow-kind", "sendfax"); code != 0 {
		t.Errorf("with --allow-kind: exit %d\n%s%s", code, out, errOut)
	}
	// run and serve take the flag too: a usage error is exit 2, a bad
	// input after the flag parsed is refused for what it is.
	for _, cmd := range []string{"run", "serve"} {
		_, errOut, _ := execute(t, cmd, "--allow-kind", "sendfax", "--sync", "never")
		if strings.Contains(errOut, "unknown flag") {
			t.Errorf("%s does not take --allow-kind: %s", cmd, errOut)
		}
	}
}

// TestInputsThatAreNotUnicodeAreRefused: a lone surrogate or invalid
// UTF-8 in an input, a var or an effect resolution is refused before
// anything connects (exit 2), naming the file, line, column and path.
func TestInputsThatAreNotUnicodeAreRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	surrogate := write("surrogate.json", "{\n  \"reports\": [{\"title\": \"crash \\ud800\"}]\n}\n")
	badByte := write("latin1.json", "{\"name\": \"caf\xe9\"}")
	vars := writeWorkflow(t, "name: greeter\nversion: 1\nvars: {greeting: hi}\nsteps:\n  - id: a\n    kind: noop\n")
	tests := []struct {
		name  string
		args  []string
		stdin string
		want  []string
	}{
		{"start", []string{"start", vars, "--input", surrogate},
			"", []string{"input " + surrogate + ":2:32: at /reports/0/title:", `\ud800 is one half of a UTF-16 surrogate pair`}},
		{"run", []string{"run", vars, "--input", badByte, "--data-dir", t.TempDir()},
			"", []string{"input " + badByte + ":1:14: at /name: invalid UTF-8 byte 0xe9"}},
		{"validate", []string{"validate", vars, "--input", surrogate},
			"", []string{"at /reports/0/title:"}},
		{"stdin", []string{"start", vars, "--input", "-"},
			"{\"a\": \"\\udc00\"}", []string{"input stdin:1:8: at /a:"}},
		{"var", []string{"start", vars, "--var", "greeting=h\xffi"},
			"", []string{"--var greeting: the value holds invalid UTF-8 byte 0xff at byte 1"}},
		{"resolution", []string{"effects", "resolve", "job/step", "--happened", "--result", surrogate},
			"", []string{"--result: input " + surrogate + ":2:32: at /reports/0/title:"}},
		{"resolution note", []string{"effects", "resolve", "job/step", "--not-happened", "--note", "\xfe"},
			"", []string{"at /note: invalid UTF-8 byte 0xfe"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, errOut, code := executeStdin(t, tt.stdin, append(tt.args, "--nats-url", unreachable)...)
			if tt.name == "resolution note" {
				// The note is checked by the client, once connected; here
				// no server answers, so check it against a real one.
				srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
				_, errOut, code = executeStdin(t, "", append(tt.args, "--nats-url", srv.URL())...)
			}
			if code != 2 {
				t.Fatalf("exit %d, want 2\n%s", code, errOut)
			}
			for _, w := range tt.want {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q:\n%s", w, errOut)
				}
			}
		})
	}
}

// TestStartRefusesAnInputThatCannotFit: a 900 KB input (in members under
// the value threshold, which stay in the checkpoint) used to pass start
// (exit 0) and fail the job at once; start refuses it, exit 2, naming the
// file and the sizes, and stores nothing.
func TestStartRefusesAnInputThatCannotFit(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	wf := writeWorkflow(t, "name: big\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n")
	input := filepath.Join(t.TempDir(), "big.json")
	var in strings.Builder
	in.WriteString(`{"p0":"` + strings.Repeat("x", 991) + `"`)
	for i := 1; i < 900; i++ {
		fmt.Fprintf(&in, `,"p%03d":"%s"`, i, strings.Repeat("x", 1000-10))
	}
	in.WriteString("}")
	if in.Len() != 900_000 {
		t.Fatalf("test bug: input of %d bytes", in.Len())
	}
	if err := os.WriteFile(input, []byte(in.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	_, errOut, code := execute(t, "start", wf, "--input", input, "--job-id", "big-1", "--nats-url", srv.URL())
	if code != 2 {
		t.Fatalf("exit %d, want 2\n%s", code, errOut)
	}
	for _, want := range []string{"input " + input + ": input is 900000 bytes", "first checkpoint", "over the limit of 1048576", "bytes fits"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	if _, err := srv.Store(t, kv.Config{}).Checkpoints.Get(context.Background(), "big-1"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("the refused job was stored: %v", err)
	}
}

// executeStdin is execute with stdin.
func executeStdin(t *testing.T, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := NewEngineCommand(&out, &errb)
	cmd.SetArgs(args)
	cmd.SetIn(strings.NewReader(stdin))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := cmd.ExecuteContext(ctx); err != nil {
		errb.WriteString("error: " + err.Error() + "\n")
		code = 1
		var ee *ExitError
		if errors.As(err, &ee) {
			code = ee.Code
		}
	}
	return out.String(), errb.String(), code
}

// TestStdinInputOverItsLimit: more than 64 MiB on --input - is refused by
// saying so, not as JSON cut short.
func TestStdinInputOverItsLimit(t *testing.T) {
	t.Parallel()
	big := io.MultiReader(strings.NewReader(`{"x": "`), io.LimitReader(zeros{}, 65<<20))
	_, err := readInput("-", big)
	if err == nil || !strings.Contains(err.Error(), "more than 67108864 bytes on stdin") {
		t.Fatalf("err = %v, want the stdin limit named", err)
	}
	if _, err := readInput("-", strings.NewReader(`{"x": 1}`)); err != nil {
		t.Fatalf("a small input: %v", err)
	}
}

// zeros reads as an endless run of '0'.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = '0'
	}
	return len(p), nil
}

// TestGroupCommitDefault: engine run with its embedded server under
// --sync always commits checkpoints, step messages and results in atomic
// batches (the streams allow them); under --sync interval it does not.
func TestGroupCommitDefault(t *testing.T) {
	t.Parallel()
	for _, sync := range []string{natsserver.SyncAlways, natsserver.SyncInterval} {
		dir := t.TempDir()
		if out, errOut, code := execute(t, "run", repo("examples/quickstart/workflow.yaml"), "--input", repo("examples/quickstart/input.json"),
			"--data-dir", dir, "--sync", sync, "--model-mode", "replay", "--output", "json"); code != 0 {
			t.Fatalf("--sync %s: exit %d\n%s\n%s", sync, code, out, errOut)
		}
		store, closeStore := openDataDir(t, dir)
		names := store.Names
		for _, name := range []string{"KV_" + names.CheckpointBucket, names.WorkStream, names.InboxStream} {
			st, err := store.JS.Stream(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := st.CachedInfo().Config.AllowAtomicPublish, sync == natsserver.SyncAlways; got != want {
				t.Errorf("--sync %s: stream %s allows atomic batches: %v, want %v", sync, name, got, want)
			}
		}
		closeStore()
	}
}

// TestValidateWarnsOfAChildItCannotSee: validate has no store, so a
// workflow step whose workflow is not a --child file is a warning (exit 2
// under --strict); with the child given there is nothing to warn about.
func TestValidateWarnsOfAChildItCannotSee(t *testing.T) {
	t.Parallel()
	root := testsupport.ModuleRoot()
	wf := filepath.Join(root, "examples/research/workflow.yaml")
	child := filepath.Join(root, "examples/research/file-report.yaml")
	_, errOut, code := execute(t, "validate", wf)
	if code != 0 || !strings.Contains(errOut, `steps[4].with.workflow: workflow "file-report" is not stored, and no --child file defines it`) {
		t.Errorf("without --child: exit %d\n%s", code, errOut)
	}
	if _, _, code := execute(t, "validate", wf, "--strict"); code != 2 {
		t.Errorf("without --child, --strict: exit %d, want 2", code)
	}
	out, errOut, code := execute(t, "validate", wf, "--child", child, "--strict")
	if code != 0 || errOut != "" || !strings.Contains(out, "ok (research-digest v1, 5 steps") {
		t.Errorf("with --child: exit %d\n%s%s", code, out, errOut)
	}
}
