package schemas_test

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/waymark-dev/waymark/schemas"
)

// located is one row of a loader test: a workflow file that must be
// refused, and where the refusal must point.
type located struct {
	name string
	file string // the name given to Parse; "workflow.yaml" when empty
	src  string
	// at is the text whose first occurrence in src the problem must be
	// reported at (its line, and its column when col is set); "" means the
	// problem has no position.
	at   string
	col  bool
	path string // JSON Pointer the problem must carry ("" for the document)
	msg  string // substring of the problem's message
	opts schemas.LoadOptions
}

// positionOf returns the 1-based line and column (in runes) of the first
// occurrence of at in src.
func positionOf(t *testing.T, src, at string) (int, int) {
	t.Helper()
	i := strings.Index(src, at)
	if i < 0 {
		t.Fatalf("test bug: %q not in the source", at)
	}
	lineStart := strings.LastIndexByte(src[:i], '\n') + 1
	return 1 + strings.Count(src[:i], "\n"), 1 + utf8.RuneCountInString(src[lineStart:i])
}

// checkLocated parses r.src and asserts that the error is a
// *DefinitionError matching ErrDefinitionInvalid that names the file, and
// that one of its problems carries r.path, r.msg and r.at's position, also
// in the error's text.
func checkLocated(t *testing.T, r located) {
	t.Helper()
	if r.file == "" {
		r.file = "workflow.yaml"
	}
	def, err := schemas.Parse(r.file, []byte(r.src), r.opts)
	if err == nil {
		t.Fatalf("Parse accepted the definition (hash %s)", def.Hash)
	}
	if !errors.Is(err, schemas.ErrDefinitionInvalid) {
		t.Errorf("errors.Is(err, ErrDefinitionInvalid) = false for %v", err)
	}
	var de *schemas.DefinitionError
	if !errors.As(err, &de) {
		t.Fatalf("error is %T, not *schemas.DefinitionError: %v", err, err)
	}
	if de.File != r.file {
		t.Errorf("File = %q, want %q", de.File, r.file)
	}
	var p *schemas.LocatedProblem
	for i := range de.Problems {
		if de.Problems[i].Path == r.path && strings.Contains(de.Problems[i].Message, r.msg) {
			p = &de.Problems[i]
			break
		}
	}
	if p == nil {
		t.Fatalf("no problem at path %q with message containing %q in:\n%v", r.path, r.msg, err)
	}
	text := err.Error()
	if !strings.HasPrefix(text, r.file+": ") {
		t.Errorf("error text does not start with the file name %q:\n%s", r.file, text)
	}
	if r.at == "" {
		if p.Line != 0 {
			t.Errorf("problem has line %d, want none", p.Line)
		}
	} else {
		line, col := positionOf(t, r.src, r.at)
		if p.Line != line {
			t.Errorf("problem %q at line %d, want %d (line of %q)", p.Message, p.Line, line, r.at)
		}
		if p.Column == 0 {
			t.Errorf("problem %q has no column", p.Message)
		}
		if r.col && p.Column != col {
			t.Errorf("problem %q at column %d, want %d (column of %q)", p.Message, p.Column, col, r.at)
		}
		if want := fmt.Sprintf("%s:%d:%d: ", r.file, p.Line, p.Column); !strings.Contains(text, want) {
			t.Errorf("error text lacks %q:\n%s", want, text)
		}
	}
	if r.path != "" {
		if want := schemas.PointerToPath(r.path) + ": "; !strings.Contains(text, want) {
			t.Errorf("error text lacks the path %q:\n%s", want, text)
		}
	}
}

func TestParseMalformed(t *testing.T) {
	t.Parallel()
	rows := []located{
		{
			name: "bad indentation",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n   next: []\n",
			at:   "next: []", col: true, msg: "YAML:",
		},
		{
			name: "unclosed double quote",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    with: {a: \"b}\n",
			at:   `"b}`, col: true, msg: "double-quoted",
		},
		{
			name: "unclosed single quote",
			src:  "name: x\nversion: 1\ndescription: 'it''s\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "'it", msg: "single-quoted",
		},
		{
			name: "tab indentation",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n\tkind: noop\n",
			at:   "\tkind", col: true, msg: "'\t'",
		},
		{
			name: "duplicate key",
			src:  "name: x\nversion: 1\nname: y\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "name: y", col: true, msg: `"name" already defined`,
		},
		{
			name: "JSON missing comma",
			file: "workflow.json",
			src:  "{\n  \"name\": \"x\",\n  \"version\": 1,\n  \"steps\": [\n    {\"id\": \"a\" \"kind\": \"noop\"}\n  ]\n}\n",
			at:   `"kind": "noop"`, col: true, msg: "JSON: invalid character",
		},
		{
			// YAML's flow style accepts this; a .json file must be JSON.
			name: "JSON trailing comma",
			file: "workflow.json",
			src:  "{\n  \"name\": \"x\",\n  \"version\": 1,\n  \"steps\": [{\"id\": \"a\", \"kind\": \"noop\"}],\n}\n",
			at:   "}\n", col: true, msg: "JSON: invalid character '}'",
		},
		{
			name: "JSON unexpected end",
			file: "workflow.json",
			src:  "{\n  \"name\": \"x\",\n  \"version\": 1,\n  \"steps\": [{\"id\": \"a\", \"kind\": \"noop\"}]\n",
			at:   "]\n", msg: "JSON: unexpected end of input",
		},
		{
			name: "JSON trailing data",
			file: "workflow.JSON",
			src:  "{\"name\": \"x\", \"version\": 1, \"steps\": [{\"id\": \"a\", \"kind\": \"noop\"}]}\n\n  {}\n",
			at:   "{}", col: true, msg: "JSON: unexpected data after the JSON value",
		},
		{name: "empty file", src: "", msg: "file is empty"},
		{name: "only whitespace", src: " \n\t\n", msg: "file is empty"},
		{name: "only a comment", src: "# nothing here\n", msg: "top level must be a mapping, not null"},
		{
			name: "two documents",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n---\nname: y\n",
			at:   "---", col: true, msg: "want exactly one YAML document, found 2",
		},
		{
			name: "top-level list",
			src:  "# a list, not a workflow\n- name: x\n- version: 1\n",
			at:   "- name", col: true, msg: "top level must be a mapping, not a list",
		},
		{
			name: "top-level string",
			src:  "\"a workflow\"\n",
			at:   `"a workflow"`, col: true, msg: "not a string",
		},
		{
			name: "non-string key",
			src:  "name: x\nversion: 1\n? [a, b]\n: c\nsteps:\n  - id: a\n    kind: noop\n",
			at:   ": c", col: true, msg: "YAML: found an invalid key",
		},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			checkLocated(t, r)
		})
	}
}

func TestParseSchemaViolations(t *testing.T) {
	t.Parallel()
	rows := []located{
		{
			name: "missing name",
			src:  "# no name\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "version", col: true, path: "", msg: "missing properties: 'name'",
		},
		{
			name: "bad name pattern",
			src:  "name: 9lives\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "name:", col: true, path: "/name", msg: "does not match pattern",
		},
		{
			name: "version 0",
			src:  "name: x\nversion: 0\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "version:", col: true, path: "/version", msg: "must be >= 1",
		},
		{
			name: "version a string",
			src:  "name: x\nversion: \"1\"\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "version:", col: true, path: "/version", msg: "expected integer, but got string",
		},
		{
			name: "unknown top-level key",
			src:  "name: x\nversion: 1\nowner: ops\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "owner:", col: true, path: "/owner", msg: `unknown field "owner"`,
		},
		{
			name: "step without kind",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n  - id: b\n    description: no kind\n",
			at:   "id: b", col: true, path: "/steps/1", msg: "missing properties: 'kind'",
		},
		{
			name: "unknown field in a step",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    retries: 3\n",
			at:   "retries:", col: true, path: "/steps/0/retries", msg: `unknown field "retries"`,
		},
		{
			name: "unknown field with a quote in its name",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    \"it's\": 3\n",
			at:   "\"it's\"", col: true, path: "/steps/0/it's", msg: `unknown field "it's"`,
		},
		{
			name: "bad duration",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    timeout: 5 minutes\n",
			at:   "timeout:", col: true, path: "/steps/0/timeout", msg: "does not match pattern",
		},
		{
			name: "bad default duration",
			src:  "name: x\nversion: 1\ndefaults:\n  retry:\n    backoff: {initial: 1 second}\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "initial:", col: true, path: "/defaults/retry/backoff/initial", msg: "does not match pattern",
		},
		{
			name: "retry max_attempts 0",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    retry:\n      max_attempts: 0\n",
			at:   "max_attempts:", col: true, path: "/steps/0/retry/max_attempts", msg: "must be >= 1",
		},
		{
			name: "transition with both to and fail",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    next:\n      - to: a\n        fail: loop\n",
			at:   "to: a", col: true, path: "/steps/0/next/0", msg: "valid against schemas at indexes 0 and 1",
		},
		{
			name: "transition with nothing to do",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    next:\n      - when: state.done\n",
			at:   "when:", col: true, path: "/steps/0/next/0", msg: "missing properties",
		},
		{
			name: "model step missing with.prompt",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: model\n    with:\n      provider: openai\n      model: m\n",
			at:   "with:", col: true, path: "/steps/0/with", msg: "missing properties: 'prompt'",
		},
		{
			name: "model step without with",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: model\n",
			at:   "id: a", col: true, path: "/steps/0", msg: "missing properties: 'with'",
		},
		{
			name: "http method not in the enum",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: http\n    with:\n      url: http://example.com\n      method: FETCH\n",
			at:   "method:", col: true, path: "/steps/0/with/method", msg: `value must be one of "GET"`,
		},
		{
			name: "problem deep in a JSON file",
			file: "workflow.json",
			src:  "{\n  \"name\": \"x\",\n  \"version\": 1,\n  \"steps\": [\n    {\"id\": \"a\", \"kind\": \"noop\"},\n    {\"id\": \"b\", \"kind\": \"noop\", \"timeout\": \"soon\"}\n  ]\n}\n",
			at:   `"timeout"`, col: true, path: "/steps/1/timeout", msg: "does not match pattern",
		},
		{
			name: "problem under an anchor",
			src:  "name: x\nversion: 1\nsteps:\n  - &s\n    id: a\n    kind: noop\n    pool: Big\n",
			at:   "pool:", col: true, path: "/steps/0/pool", msg: "does not match pattern",
		},
		{
			name: "aliases that expand without bound",
			src: "name: x\nversion: 1\n" +
				"vars: {a0: &a0 \"" + strings.Repeat("x", 1000) + "\"}\n" +
				"steps:\n  - id: a\n    kind: noop\n    with:\n" +
				"      a1: &a1 [*a0,*a0,*a0,*a0,*a0,*a0,*a0,*a0,*a0,*a0]\n" +
				"      a2: &a2 [*a1,*a1,*a1,*a1,*a1,*a1,*a1,*a1,*a1,*a1]\n" +
				"      a3: &a3 [*a2,*a2,*a2,*a2,*a2,*a2,*a2,*a2,*a2,*a2]\n" +
				"      a4: &a4 [*a3,*a3,*a3,*a3,*a3,*a3,*a3,*a3,*a3,*a3]\n" +
				"      a5: &a5 [*a4,*a4,*a4,*a4,*a4,*a4,*a4,*a4,*a4,*a4]\n" +
				"      a6: &a6 [*a5,*a5,*a5,*a5,*a5,*a5,*a5,*a5,*a5,*a5]\n",
			at: "*a0", col: true, msg: "YAML aliases expand the file beyond",
		},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			checkLocated(t, r)
		})
	}
}

func TestParseChecks(t *testing.T) {
	t.Parallel()
	assets := schemas.LoadOptions{BaseDir: filepath.Join("testdata", "assets")}
	rows := []located{
		{
			name: "duplicate step ids",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n  - id: b\n    kind: noop\n  - id: a # again\n    kind: noop\n",
			at:   "id: a # again", col: true, path: "/steps/2/id", msg: `duplicate step id "a" (first at steps[0])`,
		},
		{
			name: "start names a missing step",
			src:  "name: x\nversion: 1\nstart: begin\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "start:", col: true, path: "/start", msg: `start step "begin" does not exist`,
		},
		{
			name: "transition to a missing step",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    next:\n      - end: true\n        when: state.done\n      - to: b\n",
			at:   "to: b", col: true, path: "/steps/0/next/1/to", msg: `transition to step "b", which does not exist`,
		},
		{
			name: "on_error to a missing step",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    on_error: cleanup\n",
			at:   "on_error:", col: true, path: "/steps/0/on_error", msg: `on_error names step "cleanup"`,
		},
		{
			name: "input_schema not a JSON Schema",
			src:  "name: x\nversion: 1\ninput_schema:\n  type: text\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "input_schema:", col: true, path: "/input_schema", msg: "value must be one of",
		},
		{
			name: "state_schema not a JSON Schema",
			src:  "name: x\nversion: 1\nstate_schema:\n  properties: []\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "state_schema:", col: true, path: "/state_schema", msg: "expected object",
		},
		{
			name: "step output_schema not a JSON Schema",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n  - id: b\n    kind: noop\n    output_schema:\n      minLength: -1\n",
			at:   "output_schema:", col: true, path: "/steps/1/output_schema", msg: "must be >= 0",
		},
		{
			name: "step input_schema with a bad pattern",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    input_schema:\n      pattern: \"([\"\n",
			at:   "input_schema:", col: true, path: "/steps/0/input_schema", msg: "regex",
		},
		{
			name: "remote $ref",
			src:  "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    output_schema:\n      $ref: https://example.com/schemas/answer.json\n",
			at:   "output_schema:", col: true, path: "/steps/0/output_schema", msg: `remote $ref "https://example.com/schemas/answer.json" is not allowed`,
		},
		{
			name: "relative $ref with a remote $id",
			src:  "name: x\nversion: 1\ninput_schema:\n  $id: https://example.com/root.json\n  $ref: other.json\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "input_schema:", col: true, path: "/input_schema", msg: "is not allowed",
		},
		{
			name: "asset file missing",
			src:  "name: x\nversion: 1\nassets:\n  note: note.txt\n  gone: missing.txt\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "gone:", col: true, path: "/assets/gone", msg: "missing.txt", opts: assets,
		},
		{
			name: "asset .json invalid",
			src:  "name: x\nversion: 1\nassets:\n  cassette: broken.json\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "cassette:", col: true, path: "/assets/cassette", msg: "asset broken.json is not valid JSON", opts: assets,
		},
		{
			name: "asset is a directory",
			src:  "name: x\nversion: 1\nassets:\n  dir: .\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "dir:", col: true, path: "/assets/dir", msg: "not a regular file", opts: assets,
		},
		{
			name: "assets refused over the network",
			src:  "name: x\nversion: 1\nassets:\n  note: note.txt\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "assets:", col: true, path: "/assets", msg: "cannot be used here",
			opts: schemas.LoadOptions{BaseDir: assets.BaseDir, NoAssetFiles: true},
		},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			checkLocated(t, r)
		})
	}
}

func TestParseReportsEveryProblemInLineOrder(t *testing.T) {
	t.Parallel()
	src := "name: x\nversion: 1\nstart: nowhere\nsteps:\n  - id: a\n    kind: noop\n    on_error: gone\n  - id: a\n    kind: noop\n"
	_, err := schemas.Parse("w.yaml", []byte(src), schemas.LoadOptions{})
	var de *schemas.DefinitionError
	if !errors.As(err, &de) {
		t.Fatalf("err = %v, want a *DefinitionError", err)
	}
	var got []string
	for _, p := range de.Problems {
		got = append(got, fmt.Sprintf("%d %s", p.Line, p.Path))
	}
	want := []string{"3 /start", "7 /steps/0/on_error", "8 /steps/1/id"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("problems = %q, want %q", got, want)
	}
	if !strings.HasPrefix(err.Error(), "w.yaml: invalid workflow definition (3 problems)") {
		t.Errorf("Error() = %q", err)
	}
}

func TestParseCheckFunc(t *testing.T) {
	t.Parallel()
	src := "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n  - id: b\n    kind: sql\n"
	check := func(d *schemas.Definition) []schemas.Problem {
		var ps []schemas.Problem
		for i, s := range d.Steps {
			if s.Kind == "sql" {
				ps = append(ps, schemas.Problem{Path: fmt.Sprintf("/steps/%d/kind", i), Message: "no worker runs kind \"sql\""})
			}
		}
		return ps
	}
	checkLocated(t, located{
		src: src, at: "kind: sql", col: true, path: "/steps/1/kind", msg: `no worker runs kind "sql"`,
		opts: schemas.LoadOptions{Checks: []schemas.CheckFunc{check}},
	})

	t.Run("not called after built-in problems", func(t *testing.T) {
		t.Parallel()
		called := false
		_, err := schemas.Parse("w.yaml", []byte(src+"  - id: a\n    kind: noop\n"), schemas.LoadOptions{
			Checks: []schemas.CheckFunc{func(*schemas.Definition) []schemas.Problem { called = true; return nil }},
		})
		if !errors.Is(err, schemas.ErrDefinitionInvalid) {
			t.Fatalf("err = %v, want ErrDefinitionInvalid", err)
		}
		if called {
			t.Error("CheckFunc ran on a definition that failed the built-in checks")
		}
	})

	t.Run("sees a decoded definition", func(t *testing.T) {
		t.Parallel()
		var seen *schemas.Definition
		def, err := schemas.Parse("w.yaml", []byte(src), schemas.LoadOptions{
			Checks: []schemas.CheckFunc{func(d *schemas.Definition) []schemas.Problem { seen = d; return nil }},
		})
		if err != nil {
			t.Fatal(err)
		}
		if seen != def || seen.Step("b") == nil {
			t.Errorf("CheckFunc saw %+v, want the returned definition", seen)
		}
	})
}

// loadValid loads testdata/valid/workflow.yaml.
func loadValid(t *testing.T) *schemas.Definition {
	t.Helper()
	def, err := schemas.Load(filepath.Join("testdata", "valid", "workflow.yaml"), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return def
}

func TestLoad(t *testing.T) {
	t.Parallel()
	def := loadValid(t)
	if def.Name != "refund-review" || def.Version != 3 || len(def.Steps) != 3 {
		t.Fatalf("loaded %s@%d with %d steps", def.Name, def.Version, len(def.Steps))
	}
	prompt, err := os.ReadFile(filepath.Join("testdata", "valid", "prompt.txt"))
	if err != nil {
		t.Fatal(err)
	}
	// Assets resolve against the workflow file's folder and are embedded:
	// text as a JSON string, .json files as JSON.
	if got, want := string(def.Assets["prompt"]), fmt.Sprintf("%q", prompt); got != want {
		t.Errorf("prompt asset = %s, want %s", got, want)
	}
	if got := string(def.Assets["cassette"]); !strings.HasPrefix(got, `{"interactions":[`) {
		t.Errorf("cassette asset = %s, want the JSON object", got)
	}
	if len(def.Hash) != 64 {
		t.Errorf("Hash = %q, want 64 hex digits", def.Hash)
	}

	t.Run("missing file", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "absent.yaml")
		_, err := schemas.Load(path, schemas.LoadOptions{})
		if !errors.Is(err, fs.ErrNotExist) || errors.Is(err, schemas.ErrDefinitionInvalid) {
			t.Errorf("err = %v, want fs.ErrNotExist and not ErrDefinitionInvalid", err)
		}
		if err != nil && !strings.Contains(err.Error(), path) {
			t.Errorf("error %q does not name %s", err, path)
		}
	})

	t.Run("problems name the path given", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "bad.yaml")
		if err := os.WriteFile(path, []byte("name: x\nversion: 1\nsteps: []\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := schemas.Load(path, schemas.LoadOptions{})
		var de *schemas.DefinitionError
		if !errors.As(err, &de) || de.File != path || len(de.Problems) != 1 || de.Problems[0].Line != 3 {
			t.Errorf("err = %v, want one problem at %s:3", err, path)
		}
	})
}

func TestParseAssetTooLarge(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "big.txt"), make([]byte, schemas.MaxAssetBytes+1), 0o600); err != nil {
		t.Fatal(err)
	}
	checkLocated(t, located{
		src: "name: x\nversion: 1\nassets:\n  big: big.txt\nsteps:\n  - id: a\n    kind: noop\n",
		at:  "big:", col: true, path: "/assets/big", msg: "over the limit",
		opts: schemas.LoadOptions{BaseDir: dir},
	})
}

func TestParseTooLarge(t *testing.T) {
	t.Parallel()
	src := "name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n#" + strings.Repeat("x", schemas.MaxDefinitionBytes) + "\n"
	checkLocated(t, located{src: src, msg: "the limit is"})
}

func TestPointerToPath(t *testing.T) {
	t.Parallel()
	for ptr, want := range map[string]string{
		"":                    "(root)",
		"/":                   "(root)",
		"/name":               "name",
		"/steps/2/next/0/to":  "steps[2].next[0].to",
		"/assets/a~1b~0c":     "assets.a/b~c",
		"/steps/0/with/model": "steps[0].with.model",
	} {
		if got := schemas.PointerToPath(ptr); got != want {
			t.Errorf("PointerToPath(%q) = %q, want %q", ptr, got, want)
		}
	}
}

// TestParseByteOrderMark: a workflow file starting with a UTF-8 byte order
// mark parses as without it, in YAML and in JSON.
func TestParseByteOrderMark(t *testing.T) {
	t.Parallel()
	for name, src := range map[string]string{
		"bom.yaml": "\xef\xbb\xbfname: bom\nversion: 1\nsteps:\n  - {id: a, kind: noop}\n",
		"bom.json": "\xef\xbb\xbf" + `{"name": "bom", "version": 1, "steps": [{"id": "a", "kind": "noop"}]}`,
	} {
		d, err := schemas.Parse(name, []byte(src), schemas.LoadOptions{})
		if err != nil || d.Name != "bom" {
			t.Errorf("%s: %v, want it parsed", name, err)
		}
	}
}
