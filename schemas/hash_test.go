package schemas_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

// small is an asset-free workflow used where a test edits the source.
const small = `# Greets and waits.
name: greeter
version: 2
description: "Say hello <then> wait & see"
vars: {greeting: hello}
defaults:
  retry: {max_attempts: 5, backoff: {initial: 1s, multiplier: 1.5}}
steps:
  - id: greet
    kind: noop
    timeout: 1m30s
    next:
      - to: wait
        when: 'state.count > 2'
      - end: true
  - id: wait
    kind: noop
    output_schema: {type: object, required: [ok]}
`

// smallReformatted is small with keys reordered, other quoting, indents,
// flow and block styles swapped, and comments: the same content.
const smallReformatted = `steps:
- kind: "noop"
  next:
  - {when: "state.count > 2", to: wait}
  - end: true
  id: greet
  timeout: "1m30s"
- output_schema:
    required:
    - ok
    type: object
  kind: noop
  id: 'wait'
defaults: {retry: {backoff: {multiplier: 1.50, initial: "1s"}, max_attempts: 5}}
vars:
  greeting: 'hello'   # trailing comment
description: Say hello <then> wait & see
version: 2
name: greeter
`

// mustParse parses src or fails the test.
func mustParse(t *testing.T, name, src string, opts schemas.LoadOptions) *schemas.Definition {
	t.Helper()
	def, err := schemas.Parse(name, []byte(src), opts)
	if err != nil {
		t.Fatal(err)
	}
	return def
}

func TestHashStableAcrossFormats(t *testing.T) {
	t.Parallel()
	t.Run("YAML and JSON twins", func(t *testing.T) {
		t.Parallel()
		y := loadValid(t)
		j, err := schemas.Load(filepath.Join("testdata", "valid", "workflow.json"), schemas.LoadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if y.Hash != j.Hash {
			t.Errorf("YAML hash %s != JSON hash %s\nYAML: %s\nJSON: %s", y.Hash, j.Hash, y.Canonical(), j.Canonical())
		}
	})
	t.Run("reordered and reformatted YAML", func(t *testing.T) {
		t.Parallel()
		a := mustParse(t, "a.yaml", small, schemas.LoadOptions{})
		b := mustParse(t, "b.yaml", smallReformatted, schemas.LoadOptions{})
		if a.Hash != b.Hash {
			t.Errorf("hashes differ:\n%s\n%s", a.Canonical(), b.Canonical())
		}
	})
	t.Run("canonical JSON parsed again", func(t *testing.T) {
		t.Parallel()
		a := mustParse(t, "a.yaml", small, schemas.LoadOptions{})
		b := mustParse(t, "canonical.json", string(a.Canonical()), schemas.LoadOptions{})
		if a.Hash != b.Hash {
			t.Errorf("canonical form is not a fixed point:\n%s\n%s", a.Canonical(), b.Canonical())
		}
	})
}

func TestHashChangesWithContent(t *testing.T) {
	t.Parallel()
	// load copies testdata/valid to a fresh folder, applies edit to
	// the workflow file and overwrites files, then loads it.
	load := func(t *testing.T, old, new string, files map[string]string) *schemas.Definition {
		t.Helper()
		dir := t.TempDir()
		for _, n := range []string{"workflow.yaml", "prompt.txt", "cassette.json"} {
			b, err := os.ReadFile(filepath.Join("testdata", "valid", n))
			if err != nil {
				t.Fatal(err)
			}
			if n == "workflow.yaml" && old != "" {
				if !bytes.Contains(b, []byte(old)) {
					t.Fatalf("test bug: %q not in workflow.yaml", old)
				}
				b = bytes.Replace(b, []byte(old), []byte(new), 1)
			}
			if c, ok := files[n]; ok {
				b = []byte(c)
			}
			if err := os.WriteFile(filepath.Join(dir, n), b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		def, err := schemas.Load(filepath.Join(dir, "workflow.yaml"), schemas.LoadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return def
	}
	base := load(t, "", "", nil)
	rows := []struct {
		name     string
		old, new string
		files    map[string]string
	}{
		{name: "version", old: "version: 3", new: "version: 4"},
		{name: "description", old: "or escalate.", new: "or escalate!"},
		{name: "a var", old: "currency: eur", new: "currency: usd"},
		{name: "a default timeout", old: "timeout: 90s", new: "timeout: 91s"},
		{name: "a step's retry", old: "max_attempts: 6", new: "max_attempts: 7"},
		{name: "a transition condition", old: "< 5000", new: "<= 5000"},
		{name: "transition order", old: "      - to: escalate\n        when: state.review.approve\n      - fail: refund rejected by review\n", new: "      - fail: refund rejected by review\n      - to: escalate\n        when: state.review.approve\n"},
		{name: "a schema", old: "maxLength: 500", new: "maxLength: 501"},
		{name: "a step kind setting", old: "temperature: 0.2", new: "temperature: 0.3"},
		{name: "a text asset's content", files: map[string]string{"prompt.txt": "Decide.\n"}},
		{name: "a JSON asset's content", files: map[string]string{"cassette.json": `{"version": 2}`}},
		{name: "whitespace in a text asset", files: map[string]string{"prompt.txt": "Decide whether order {{.input.order_id}} deserves a refund of {{.input.amount_cents}} cents.\nReply with {\"approve\": true|false, \"reason\": \"...\"}.\n\n"}},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			if got := load(t, r.old, r.new, r.files); got.Hash == base.Hash {
				t.Errorf("hash unchanged: %s", got.Hash)
			}
		})
	}
	t.Run("formatting of a JSON asset does not count", func(t *testing.T) {
		t.Parallel()
		got := load(t, "", "", map[string]string{"cassette.json": `{
  "interactions": [{"replies": [{"text": "{\"approve\": true, \"reason\": \"damaged in transit\"}"}], "model": "small", "step": "review"}],
  "version": 1
}`})
		if got.Hash != base.Hash {
			t.Errorf("hash changed with the JSON asset's layout")
		}
	})
}

func TestCanonicalRoundTrip(t *testing.T) {
	t.Parallel()
	for _, def := range []*schemas.Definition{loadValid(t), mustParse(t, "small.yaml", small, schemas.LoadOptions{})} {
		again, err := schemas.DecodeDefinition(def.Canonical())
		if err != nil {
			t.Fatalf("DecodeDefinition(Canonical()): %v", err)
		}
		if again.Hash != def.Hash {
			t.Errorf("%s: hash %s after the round trip, want %s", def.Name, again.Hash, def.Hash)
		}
		if !reflect.DeepEqual(again, def) {
			t.Errorf("%s: round trip changed the definition:\n%+v\n%+v", def.Name, again, def)
		}
	}
}

func TestDecodeDefinition(t *testing.T) {
	t.Parallel()
	rows := []struct {
		name string
		data string
		want string // substring of the error; "" for success
	}{
		{name: "minimal", data: `{"name":"x","version":1,"steps":[{"id":"a","kind":"noop"}]}`},
		{name: "unknown top-level field", data: `{"name":"x","version":1,"owner":"me","steps":[{"id":"a","kind":"noop"}]}`, want: `unknown field "owner"`},
		{name: "unknown step field", data: `{"name":"x","version":1,"steps":[{"id":"a","kind":"noop","retries":2}]}`, want: `unknown field "retries"`},
		{name: "unknown transition field", data: `{"name":"x","version":1,"steps":[{"id":"a","kind":"noop","next":[{"goto":"a"}]}]}`, want: `unknown field "goto"`},
		{name: "no steps", data: `{"name":"x","version":1,"steps":[]}`, want: "no steps"},
		{name: "not JSON", data: `name: x`, want: "decode definition"},
		{name: "wrong type", data: `{"name":"x","version":"1","steps":[{"id":"a","kind":"noop"}]}`, want: "decode definition"},
		{name: "bad duration", data: `{"name":"x","version":1,"steps":[{"id":"a","kind":"noop","timeout":"soon"}]}`, want: `duration "soon"`},
		{name: "trailing data", data: `{"name":"x","version":1,"steps":[{"id":"a","kind":"noop"}]} {}`, want: "unexpected data"},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			def, err := schemas.DecodeDefinition([]byte(r.data))
			if r.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				if def.Hash == "" || !bytes.Equal(def.Canonical(), []byte(r.data)) {
					t.Errorf("Hash %q, Canonical %s", def.Hash, def.Canonical())
				}
				return
			}
			if !errors.Is(err, schemas.ErrDefinitionInvalid) || !strings.Contains(err.Error(), r.want) {
				t.Errorf("err = %v, want ErrDefinitionInvalid containing %q", err, r.want)
			}
		})
	}
}
