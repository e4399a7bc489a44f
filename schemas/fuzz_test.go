package schemas_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

// FuzzParse feeds arbitrary bytes to the loader. Whatever comes in, Parse
// must not panic, must refuse with a *DefinitionError, or must return a
// definition whose canonical JSON decodes again to the same hash (and, for
// definitions without assets, loads again to it) and whose references all
// resolve. `go test` runs the seeds only; fuzz with
//
//	go test ./schemas -run '^$' -fuzz FuzzParse -fuzztime 30s
func FuzzParse(f *testing.F) {
	for _, path := range []string{
		filepath.Join("..", "examples", "quickstart", "workflow.yaml"),
		filepath.Join("testdata", "valid", "workflow.yaml"),
		filepath.Join("testdata", "valid", "workflow.json"),
	} {
		data, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	for _, s := range []string{
		small,
		smallReformatted,
		"",
		"- a\n- b\n",
		"name: x\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n---\nname: y\n",
		"name: x\nversion: 1\nsteps: &s [{id: a, kind: noop, with: {x: *s}}]\n",
		"name: x\nversion: 1\nsteps:\n  - id: a\n    kind: model\n    with: {provider: replay, prompt: p}\n    next: [{to: a, when: x}, {fail: f}, {end: true}]\n",
		`{"name": "x", "version": 1, "steps": [{"id": "a", "kind": "noop", "timeout": "99999999999999999999h"}]}`,
		`{"name": "x", "version": 1, "assets": {"c": "cassette.json"}, "steps": [{"id": "a", "kind": "noop"}]}`,
		"name: x\nversion: 1\ndescription: \"\\ud800\\u0041 \\udc00\"\nsteps:\n  - id: a\n    kind: noop\n",
		"name: x\nversion: 1\ndescription: caf\xe9\nsteps:\n  - {id: a, kind: noop, with: {\"k\xff\": \"\\U0000D800\"}}\n",
		`{"name": "x", "version": 1, "description": "\ud83d\ude00 \ud83d", "steps": [{"id": "a", "kind": "noop"}]}`,
	} {
		f.Add([]byte(s))
	}

	// Assets the seeds name, in a folder of their own.
	base := f.TempDir()
	for src, dst := range map[string]string{
		filepath.Join("..", "examples", "quickstart", "cassette.json"): "cassette.json",
		filepath.Join("testdata", "valid", "prompt.txt"):               "prompt.txt",
	} {
		data, err := os.ReadFile(src)
		if err != nil {
			f.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(base, dst), data, 0o600); err != nil {
			f.Fatal(err)
		}
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		name := "fuzz.yaml"
		if bytes.HasPrefix(bytes.TrimSpace(data), []byte("{")) {
			name = "fuzz.json"
		}
		def, err := schemas.Parse(name, data, schemas.LoadOptions{BaseDir: base})
		if err != nil {
			var de *schemas.DefinitionError
			if !errors.As(err, &de) || !errors.Is(err, schemas.ErrDefinitionInvalid) {
				t.Fatalf("Parse error is %T, not a *DefinitionError: %v", err, err)
			}
			if de.File != name || len(de.Problems) == 0 {
				t.Fatalf("DefinitionError without file or problems: %+v", de)
			}
			for _, p := range de.Problems {
				if p.Message == "" || p.Line < 0 || p.Column < 0 {
					t.Fatalf("bad problem %+v", p)
				}
			}
			return
		}

		again, err := schemas.DecodeDefinition(def.Canonical())
		if err != nil {
			t.Fatalf("accepted definition does not decode from its canonical JSON: %v\n%s", err, def.Canonical())
		}
		if again.Hash != def.Hash {
			t.Fatalf("hash %s after decoding, want %s", again.Hash, def.Hash)
		}
		if len(def.Assets) == 0 {
			// Without assets (whose paths become contents), the canonical
			// JSON is a workflow file of its own that loads to itself.
			re, err := schemas.Parse("canonical.json", def.Canonical(), schemas.LoadOptions{BaseDir: base})
			if err != nil {
				t.Fatalf("canonical JSON does not load: %v\n%s", err, def.Canonical())
			}
			if re.Hash != def.Hash {
				t.Fatalf("canonical JSON loads to another hash:\n%s\n%s", def.Canonical(), re.Canonical())
			}
		}
		if def.Step(def.StartStep()) == nil {
			t.Fatalf("start step %q does not exist", def.StartStep())
		}
		for i := range def.Steps {
			s := &def.Steps[i]
			if def.StepIndex(s.ID) != i {
				t.Fatalf("step %q is not unique", s.ID)
			}
			for _, tr := range s.Next {
				if tr.To != "" && def.Step(tr.To) == nil {
					t.Fatalf("step %q moves to missing step %q", s.ID, tr.To)
				}
			}
			if s.OnError != "" && def.Step(s.OnError) == nil {
				t.Fatalf("step %q: on_error names missing step %q", s.ID, s.OnError)
			}
			p := def.RetryOf(s)
			if p.MaxAttempts < 1 || p.Delay(p.MaxAttempts) < 0 || p.Delay(p.MaxAttempts) > def.RetryOf(s).Delay(1000) {
				t.Fatalf("step %q: retry policy %+v %+v", s.ID, p, p.Backoff)
			}
		}
	})
}
