package schemas_test

import (
	"encoding/json"
	"errors"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

// mustCompile compiles a non-empty schema or fails the test.
func mustCompile(t *testing.T, schema string) *schemas.Validator {
	t.Helper()
	v, err := schemas.CompileSchema("test", json.RawMessage(schema))
	if err != nil {
		t.Fatal(err)
	}
	if v == nil {
		t.Fatal("CompileSchema returned a nil validator for a non-empty schema")
	}
	return v
}

func TestCompileSchemaEmpty(t *testing.T) {
	t.Parallel()
	for _, raw := range []json.RawMessage{nil, {}, json.RawMessage("  \n")} {
		v, err := schemas.CompileSchema("empty", raw)
		if err != nil || v != nil {
			t.Fatalf("CompileSchema(%q) = %v, %v; want nil, nil", raw, v, err)
		}
		if err := v.Validate(map[string]any{"anything": []any{1.5, "x"}}); err != nil {
			t.Errorf("nil validator rejected a value: %v", err)
		}
		if err := v.Validate(map[string]int{"not": 1}); err != nil {
			t.Errorf("nil validator rejected a value: %v", err)
		}
		if err := v.ValidateJSON([]byte("not json")); err != nil {
			t.Errorf("nil validator rejected bytes: %v", err)
		}
	}
}

func TestCompileSchemaErrors(t *testing.T) {
	t.Parallel()
	rows := []struct {
		name, schema, want string
	}{
		{"not JSON", `{"type": `, "not a JSON Schema"},
		{"bad keyword value", `{"type": "text"}`, "value must be one of"},
		{"bad regex", `{"pattern": "(["}`, "regex"},
		{"remote ref", `{"$ref": "https://example.com/s.json"}`, `remote $ref "https://example.com/s.json" is not allowed`},
		{"file ref", `{"$ref": "file:///etc/passwd"}`, "is not allowed"},
		{"missing local ref", `{"$ref": "#/$defs/absent"}`, "absent"},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			v, err := schemas.CompileSchema("my schema", json.RawMessage(r.schema))
			if v != nil || !errors.Is(err, schemas.ErrDefinitionInvalid) {
				t.Fatalf("CompileSchema = %v, %v; want nil and ErrDefinitionInvalid", v, err)
			}
			if !strings.Contains(err.Error(), "my schema") || !strings.Contains(err.Error(), r.want) {
				t.Errorf("error %q lacks the name or %q", err, r.want)
			}
			if strings.Contains(err.Error(), "mem://") {
				t.Errorf("error %q leaks the internal schema URL", err)
			}
		})
	}
}

func TestValidateReportsEveryLeaf(t *testing.T) {
	t.Parallel()
	v := mustCompile(t, `{
		"type": "object",
		"required": ["name", "items"],
		"properties": {
			"name": {"type": "string", "minLength": 3},
			"age": {"type": "integer", "minimum": 0},
			"items": {"type": "array", "items": {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}},
			"a/b": {"type": "boolean"}
		}
	}`)
	doc, err := schemas.DecodeJSON([]byte(`{"name": "x", "age": -1, "items": [{"id": "ok"}, {"id": 7}, {}], "a/b": "yes"}`))
	if err != nil {
		t.Fatal(err)
	}
	err = v.Validate(doc)
	var se *schemas.SchemaError
	if !errors.As(err, &se) {
		t.Fatalf("Validate = %v, want a *SchemaError", err)
	}
	var paths []string
	for _, p := range se.Problems {
		if p.Message == "" {
			t.Errorf("problem at %q has no message", p.Path)
		}
		paths = append(paths, p.Path)
	}
	sort.Strings(paths)
	want := []string{"/age", "/a~1b", "/items/1/id", "/items/2", "/name"}
	if strings.Join(paths, " ") != strings.Join(want, " ") {
		t.Errorf("problem paths = %q, want %q\n%v", paths, want, err)
	}
	if !strings.HasPrefix(se.Problems[0].Path, "/items/1/id") {
		t.Errorf("first problem %q, want the deepest (/items/1/id)", se.Problems[0].Path)
	}
	for _, w := range []string{"at /name: ", "at /items/1/id: ", "; "} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("Error() = %q lacks %q", err, w)
		}
	}

	t.Run("root problem", func(t *testing.T) {
		t.Parallel()
		err := v.Validate("a string")
		if !errors.As(err, &se) || len(se.Problems) != 1 || se.Problems[0].Path != "" || !strings.HasPrefix(err.Error(), "at /: ") {
			t.Errorf("Validate(string) = %v", err)
		}
	})
	t.Run("valid", func(t *testing.T) {
		t.Parallel()
		if err := v.ValidateJSON([]byte(`{"name": "xyz", "items": [], "age": 12345678901234567890}`)); err != nil {
			t.Errorf("ValidateJSON = %v", err)
		}
	})
}

func TestValidateNotPlainJSON(t *testing.T) {
	t.Parallel()
	v := mustCompile(t, `{"type": "object", "properties": {"n": {"type": "integer"}}}`)
	for _, doc := range []any{
		map[string]int{"n": 1},
		struct{ N int }{1},
		map[string]any{"n": complex(1, 2)},
		[]string{"a"},
	} {
		var err error
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("Validate(%T) panicked: %v", doc, r)
				}
			}()
			err = v.Validate(doc)
		}()
		var se *schemas.SchemaError
		if !errors.As(err, &se) {
			t.Errorf("Validate(%T) = %v, want a *SchemaError", doc, err)
		}
	}
}

func TestValidateFormats(t *testing.T) {
	t.Parallel()
	rows := []struct {
		format, value string
		ok            bool
	}{
		{"email", "ada@example.com", true},
		{"email", "not-an-email", false},
		{"date-time", "2024-02-29T12:00:00Z", true},
		{"date-time", "yesterday", false},
		{"uri", "https://example.com/x", true},
		{"uri", "::", false},
		{"uuid", "f47ac10b-58cc-4372-a567-0e02b2c3d479", true},
		{"uuid", "f47ac10b", false},
	}
	for _, r := range rows {
		v := mustCompile(t, `{"type": "string", "format": "`+r.format+`"}`)
		err := v.Validate(r.value)
		if (err == nil) != r.ok {
			t.Errorf("format %s, value %q: err = %v, want ok=%v", r.format, r.value, err, r.ok)
		}
	}
}

func TestValidateJSON(t *testing.T) {
	t.Parallel()
	v := mustCompile(t, `{"type": "object"}`)
	for _, raw := range []string{`{"a": `, `{} {}`, ``, `nul`} {
		err := v.ValidateJSON([]byte(raw))
		var se *schemas.SchemaError
		if !errors.As(err, &se) || !strings.Contains(err.Error(), "not valid JSON") {
			t.Errorf("ValidateJSON(%q) = %v, want not valid JSON", raw, err)
		}
	}
	if err := v.ValidateJSON([]byte(` {"a": [1, 2.5, "x", null]} `)); err != nil {
		t.Errorf("ValidateJSON = %v", err)
	}
}

func TestDecodeJSON(t *testing.T) {
	t.Parallel()
	v, err := schemas.DecodeJSON([]byte(`{"big": 12345678901234567890, "f": 0.1}`))
	if err != nil {
		t.Fatal(err)
	}
	m := v.(map[string]any)
	if n, ok := m["big"].(json.Number); !ok || n.String() != "12345678901234567890" {
		t.Errorf("big = %#v, want the exact json.Number", m["big"])
	}
	if _, err := schemas.DecodeJSON([]byte(`1 2`)); err == nil || !strings.Contains(err.Error(), "unexpected data after the JSON value") {
		t.Errorf("DecodeJSON(1 2) = %v", err)
	}
}

func TestValidatorConcurrentUse(t *testing.T) {
	t.Parallel()
	v := mustCompile(t, `{"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "format": "email"}}}`)
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			for j := range 50 {
				doc := map[string]any{"id": "a@b.example"}
				if (i+j)%2 == 1 {
					doc = map[string]any{"id": "nope"}
				}
				if err := v.Validate(doc); (err == nil) != ((i+j)%2 == 0) {
					t.Errorf("Validate(%v) = %v", doc, err)
				}
			}
		})
	}
	wg.Wait()
}

func TestWorkflowSchemaIsValid(t *testing.T) {
	t.Parallel()
	if _, err := schemas.CompileSchema("workflow.schema.json", schemas.WorkflowSchemaJSON); err != nil {
		t.Fatal(err)
	}
}

// TestCheckJobInputHugeNumber: a number JSON allows but a 64-bit float
// cannot hold is refused in JSON's terms, not Go's.
func TestCheckJobInputHugeNumber(t *testing.T) {
	t.Parallel()
	v := mustCompile(t, `{"type": "object"}`)
	_, err := schemas.CheckJobInput(json.RawMessage(`{"amount": 1e400}`), v, nil)
	if !errors.Is(err, schemas.ErrInputInvalid) || !strings.Contains(err.Error(), "number 1e400") || strings.Contains(err.Error(), "Go value") {
		t.Fatalf("err = %v, want input_invalid naming the number without Go types", err)
	}
}

// TestCheckJobInputNull: a null input is no input, as an absent one is.
func TestCheckJobInputNull(t *testing.T) {
	t.Parallel()
	got, err := schemas.CheckJobInput(json.RawMessage(` null `), mustCompile(t, `{"type": "object"}`), nil)
	if err != nil || string(got) != "{}" {
		t.Fatalf("CheckJobInput(null) = %s, %v; want {}", got, err)
	}
}
