package schemas_test

import (
	"encoding/json"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

func TestShapeOf(t *testing.T) {
	t.Parallel()
	s := schemas.ShapeOf(json.RawMessage(`{
		"type": "object", "required": ["a"], "additionalProperties": false,
		"properties": {
			"a": {"type": "integer"},
			"b": {"type": ["string", "null"]},
			"c": {"enum": ["x", "y"]},
			"d": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "string"}}}},
			"e": {"$ref": "#/$defs/e"},
			"f": {"allOf": [{"type": "object", "properties": {"x": {}}}, {"required": ["x"], "additionalProperties": false}]},
			"g": {"anyOf": [{"type": "integer"}, {"type": "number"}]},
			"h": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
			"i": {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": false},
			"j": {"type": "object", "additionalProperties": {"type": "boolean"}}
		}}`))
	if !s.IsObject() || !s.Closed || !s.Required["a"] || s.Required["b"] {
		t.Fatalf("top: %+v", s)
	}
	type want struct {
		typ    string
		closed bool
	}
	for name, w := range map[string]want{
		"a": {"integer", false}, "b": {"", false}, "c": {"string", false}, "d": {"array", false},
		"f": {"object", true}, "g": {"number", false}, "i": {"object", false}, "j": {"object", false},
	} {
		m := s.Lookup(name)
		if !m.Declared || m.Shape == nil || m.Shape.Type != w.typ || m.Shape.Closed != w.closed {
			t.Errorf("%s: %+v (shape %+v), want type %q closed %v", name, m, m.Shape, w.typ, w.closed)
		}
	}
	if m := s.Lookup("e"); !m.Declared || m.Shape != nil {
		t.Errorf("$ref: %+v, want declared with any value", m)
	}
	if m := s.Lookup("h"); m.Shape != nil && (m.Shape.Type != "" || m.Shape.IsObject()) {
		t.Errorf("oneOf of different types: %+v, want any", m.Shape)
	}
	if m := s.Lookup("f"); !m.Shape.Required["x"] {
		t.Errorf("allOf: %+v, want x required", m.Shape)
	}
	if m := s.Lookup("nope"); m.Impossible == "" {
		t.Errorf("undeclared member of a closed object: %+v, want impossible", m)
	}
	if m := s.Lookup("a").Shape.Lookup("x"); m.Impossible == "" {
		t.Errorf("member of an integer: %+v, want impossible", m)
	}
	if m := s.Lookup("j").Shape.Lookup("any"); m.Impossible != "" || m.Shape == nil || m.Shape.Type != "boolean" {
		t.Errorf("member of an open object: %+v, want its additionalProperties", m)
	}
	if item := s.Lookup("d").Shape.Items; item == nil || item.Lookup("id").Shape.Type != "string" {
		t.Errorf("items: %+v", item)
	}
	for _, raw := range []string{``, `true`, `[1]`, `{"$ref": "#/x"}`, `not json`} {
		if s := schemas.ShapeOf(json.RawMessage(raw)); s != nil {
			t.Errorf("ShapeOf(%s) = %+v, want nil", raw, s)
		}
	}
}

func TestStateShape(t *testing.T) {
	t.Parallel()
	load := func(src string) *schemas.Shape {
		t.Helper()
		def, err := schemas.Parse("w.yaml", []byte(src), schemas.LoadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return schemas.StateShape(def)
	}
	// A state_schema, refined by the output a step saves.
	s := load(`name: w
version: 1
state_schema: {type: object, required: [a], properties: {a: {type: string}, t: {type: object}}}
steps:
  - id: x
    kind: noop
    save_as: t
    output_schema: {type: object, required: [n], additionalProperties: false, properties: {n: {type: integer}}}
`)
	if m := s.Lookup("t"); !m.Required || m.Shape == nil || !m.Shape.Closed || m.Shape.Lookup("n").Shape.Type != "integer" {
		t.Errorf("saved member: %+v", m)
	}
	if m := s.Lookup("other"); m.Impossible != "" || m.Declared {
		t.Errorf("open state: %+v", m)
	}

	// No state_schema: the input's shape, closed while every output is
	// saved under a name or closed.
	s = load(`name: w
version: 1
input_schema: {type: object, required: [a], additionalProperties: false, properties: {a: {type: integer}}}
steps:
  - id: x
    kind: noop
    save_as: r
  - id: y
    kind: noop
    output_schema: {type: object, required: [z], additionalProperties: false, properties: {z: {type: boolean}}}
`)
	if !s.Closed || s.Lookup("a").Shape.Type != "integer" || !s.Lookup("r").Required || s.Lookup("z").Shape.Type != "boolean" || s.Lookup("q").Impossible == "" {
		t.Errorf("closed merges: %+v", s)
	}

	// A merged output of unknown shape could replace anything.
	s = load(`name: w
version: 1
input_schema: {type: object, required: [a], additionalProperties: false, properties: {a: {type: integer}}}
steps:
  - id: x
    kind: noop
`)
	if s.Closed || s.Lookup("a").Shape != nil || !s.Lookup("a").Required || s.Lookup("q").Impossible != "" {
		t.Errorf("open merge: %+v", s)
	}

	// A state_schema that leaves a member open, and an input_schema that
	// says what the input holds there: no step replaces it.
	s = load(`name: w
version: 1
input_schema: {type: object, required: [reports], properties: {reports: {type: array, items: {type: object, required: [id], properties: {id: {type: string}}}}}}
state_schema: {type: object, required: [reports], properties: {reports: {type: array}, out: {type: object}}}
steps:
  - id: x
    kind: noop
    save_as: out
`)
	if item := s.Lookup("reports").Shape.Items; item == nil || item.Lookup("id").Shape.Type != "string" || !item.Lookup("id").Required {
		t.Errorf("input member under an open state member: %+v", s.Lookup("reports").Shape)
	}

	if s := load("name: w\nversion: 1\nsteps:\n  - id: x\n    kind: noop\n"); s != nil {
		t.Errorf("no schemas, nothing saved: %+v, want nil", s)
	}
}
