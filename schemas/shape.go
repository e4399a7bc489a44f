package schemas

import (
	"encoding/json"
	"fmt"
	"maps"
	"strings"
)

// Shape is what a JSON Schema guarantees about the values it accepts, in
// the terms load-time checks of conditions and templates need: the JSON
// type, an object's declared properties, which of them are required and
// whether others can exist, an array's items. A nil *Shape guarantees
// nothing (any value). Shapes are read by ShapeOf from the keywords
// type, enum, const, properties, required, additionalProperties,
// patternProperties, items and allOf; anyOf and oneOf give what all their
// branches share; $ref and the keywords that only narrow further (not,
// if, minimum, pattern, ...) are not followed, so a Shape may say less
// than its schema but never more.
type Shape struct {
	// Type is the JSON Schema type: object, array, string, number,
	// integer, boolean or null; "" when the schema allows several or does
	// not say.
	Type string
	// Properties are an object's declared members; a nil value is a
	// member declared with any value.
	Properties map[string]*Shape
	// Required are the members every value has.
	Required map[string]bool
	// Closed says that an object has no member besides Properties
	// (additionalProperties: false, without patternProperties).
	Closed bool
	// Additional is the shape of an open object's other members; nil when
	// any.
	Additional *Shape
	// Items is the shape of every item of an array; nil when any.
	Items *Shape
}

// ShapeOf returns the shape of the values the JSON Schema raw accepts;
// nil for an empty or unreadable schema, or one that says nothing this
// package follows.
func ShapeOf(raw json.RawMessage) *Shape {
	if len(raw) == 0 {
		return nil
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil
	}
	return shapeOf(v, 0)
}

// maxShapeDepth bounds nesting: a schema deeper than this is a shape of
// nothing below it.
const maxShapeDepth = 64

func shapeOf(v any, depth int) *Shape {
	m, ok := v.(map[string]any)
	if !ok || depth > maxShapeDepth {
		return nil
	}
	if _, ok := m["$ref"]; ok {
		return nil
	}
	if _, ok := m["$dynamicRef"]; ok {
		return nil
	}
	s := &Shape{}
	switch t := m["type"].(type) {
	case string:
		s.Type = t
	case []any:
		if len(t) == 1 {
			s.Type, _ = t[0].(string)
		}
	}
	if s.Type == "" {
		s.Type = valuesType(m)
	}
	if props, ok := m["properties"].(map[string]any); ok {
		s.Properties = make(map[string]*Shape, len(props))
		for k, p := range props {
			s.Properties[k] = shapeOf(p, depth+1)
		}
	}
	if req, ok := m["required"].([]any); ok {
		s.Required = map[string]bool{}
		for _, r := range req {
			if name, ok := r.(string); ok {
				s.Required[name] = true
			}
		}
	}
	_, patterns := m["patternProperties"]
	switch ap := m["additionalProperties"].(type) {
	case bool:
		s.Closed = !ap && !patterns
	case map[string]any:
		if !patterns {
			s.Additional = shapeOf(ap, depth+1)
		}
	}
	if _, tuple := m["prefixItems"]; !tuple {
		s.Items = shapeOf(m["items"], depth+1)
	}
	if all, ok := m["allOf"].([]any); ok {
		for _, b := range all {
			s = Intersect(s, shapeOf(b, depth+1))
		}
	}
	for _, kw := range []string{"anyOf", "oneOf"} {
		if alts, ok := m[kw].([]any); ok && len(alts) > 0 {
			u := shapeOf(alts[0], depth+1)
			for _, b := range alts[1:] {
				u = Union(u, shapeOf(b, depth+1))
			}
			s = Intersect(s, u)
		}
	}
	return s
}

// At returns the shape of the member at a dotted path ("batch.docs") of
// the values s accepts: declared properties, else the shape of other
// members; nil (any value) when s says nothing of it.
func (s *Shape) At(path string) *Shape {
	sh := s
	for _, name := range strings.Split(path, ".") {
		if sh == nil {
			return nil
		}
		if p, ok := sh.Properties[name]; ok {
			sh = p
		} else {
			sh = sh.Additional
		}
	}
	return sh
}

// valuesType infers the type of a schema that lists its values (enum,
// const) when they share one.
func valuesType(m map[string]any) string {
	var vals []any
	if c, ok := m["const"]; ok {
		vals = []any{c}
	} else if e, ok := m["enum"].([]any); ok {
		vals = e
	}
	t := ""
	for i, v := range vals {
		vt := jsonType(v)
		if i > 0 && vt != t {
			return ""
		}
		t = vt
	}
	return t
}

func jsonType(v any) string {
	switch v := v.(type) {
	case nil:
		return "null"
	case bool:
		return "boolean"
	case string:
		return "string"
	case float64:
		if v == float64(int64(v)) {
			return "integer"
		}
		return "number"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	}
	return ""
}

// IsObject reports whether s describes objects: type object, or declared
// properties without a type.
func (s *Shape) IsObject() bool {
	return s != nil && (s.Type == "object" || s.Type == "" && (s.Properties != nil || s.Closed))
}

// Member is what a Shape says about one member name.
type Member struct {
	// Shape is the member's shape; nil when any.
	Shape *Shape
	// Declared: the member is one of Properties.
	Declared bool
	// Required: every value has the member.
	Required bool
	// Impossible, when set, says why no value can have the member: the
	// object is closed and does not declare it, or the value is not an
	// object at all.
	Impossible string
}

// Lookup returns what s says about member name.
func (s *Shape) Lookup(name string) Member {
	switch {
	case s == nil:
		return Member{}
	case s.Type != "" && s.Type != "object":
		return Member{Impossible: fmt.Sprintf("the value is of type %s, not an object", s.Type)}
	}
	if p, ok := s.Properties[name]; ok {
		return Member{Shape: p, Declared: true, Required: s.Required[name]}
	}
	if s.Closed {
		return Member{Impossible: fmt.Sprintf("the schema declares no property %q and allows no others (additionalProperties: false)", name)}
	}
	return Member{Shape: s.Additional, Required: s.Required[name]}
}

// Intersect returns the shape of the values both a and b accept.
func Intersect(a, b *Shape) *Shape {
	switch {
	case a == nil:
		return b
	case b == nil:
		return a
	}
	s := &Shape{Type: a.Type, Closed: a.Closed || b.Closed}
	switch {
	case a.Type == b.Type || b.Type == "":
	case a.Type == "":
		s.Type = b.Type
	case a.Type == "integer" && b.Type == "number" || a.Type == "number" && b.Type == "integer":
		s.Type = "integer"
	default:
		s.Type = "" // no value has both: the schema rejects everything
	}
	if a.Properties != nil || b.Properties != nil {
		s.Properties = map[string]*Shape{}
		for k, p := range a.Properties {
			if q, ok := b.Properties[k]; ok {
				s.Properties[k] = Intersect(p, q)
			} else if !b.Closed {
				s.Properties[k] = Intersect(p, b.Additional)
			}
		}
		for k, q := range b.Properties {
			if _, ok := a.Properties[k]; !ok && !a.Closed {
				s.Properties[k] = Intersect(q, a.Additional)
			}
		}
	}
	if a.Required != nil || b.Required != nil {
		s.Required = maps.Clone(a.Required)
		if s.Required == nil {
			s.Required = map[string]bool{}
		}
		maps.Copy(s.Required, b.Required)
	}
	if !s.Closed {
		s.Additional = Intersect(a.Additional, b.Additional)
	}
	s.Items = Intersect(a.Items, b.Items)
	return s
}

// Union returns the shape of the values a or b accepts: what both say.
func Union(a, b *Shape) *Shape {
	if a == nil || b == nil {
		return nil
	}
	s := &Shape{Type: a.Type, Closed: a.Closed && b.Closed}
	switch {
	case a.Type == b.Type:
	case a.Type == "integer" && b.Type == "number" || a.Type == "number" && b.Type == "integer":
		s.Type = "number"
	default:
		return nil
	}
	if a.IsObject() {
		s.Properties = map[string]*Shape{}
		for k, p := range a.Properties {
			if q, ok := b.Properties[k]; ok {
				s.Properties[k] = Union(p, q)
			} else if b.Closed {
				s.Properties[k] = p // absent from b's values
			} else {
				s.Properties[k] = Union(p, b.Additional)
			}
		}
		for k, q := range b.Properties {
			if _, ok := a.Properties[k]; ok {
				continue
			}
			if a.Closed {
				s.Properties[k] = q
			} else {
				s.Properties[k] = Union(q, a.Additional)
			}
		}
		s.Required = map[string]bool{}
		for k := range a.Required {
			if b.Required[k] {
				s.Required[k] = true
			}
		}
		if !s.Closed {
			switch {
			case a.Closed:
				s.Additional = b.Additional
			case b.Closed:
				s.Additional = a.Additional
			default:
				s.Additional = Union(a.Additional, b.Additional)
			}
		}
	}
	if a.Items != nil && b.Items != nil {
		s.Items = Union(a.Items, b.Items)
	}
	return s
}

// StateShape returns the shape of a job's state as the definition lets
// load-time checks see it. The state starts as the input and changes only
// by step outputs (saved under a name, or merged into it), and it passes
// the state_schema at the start and after every step, so:
//
//   - it has the state_schema's shape, when there is one;
//   - a top-level member a step produces (save_as NAME, or a required
//     property of an output merged into state) is taken to be present,
//     with the shape of what produces it;
//   - every other member keeps the input's value, with the input_schema's
//     shape (closed, without a state_schema, if the input's is); unless a
//     step merges an output whose shape is open or unknown, which could add
//     or replace any member: then those members keep their presence, but
//     not their type.
//
// The check does not follow the order in which steps run: reading a member
// before the step that produces it has run is a run-time error it cannot
// see. Nil when nothing is known.
func StateShape(def *Definition) *Shape {
	producers := map[string][]*Shape{}
	openMerge := false
	var order []string
	add := func(name string, s *Shape) {
		if _, seen := producers[name]; !seen {
			order = append(order, name)
		}
		producers[name] = append(producers[name], s)
	}
	for i := range def.Steps {
		step := &def.Steps[i]
		out := ShapeOf(step.OutputSchema)
		switch {
		case step.Kind == KindParallel:
			// Its output is the join's record; its branches save their own.
			str := &Shape{Type: "array", Items: &Shape{Type: "string"}}
			out = &Shape{Type: "object", Closed: true,
				Properties: map[string]*Shape{"completed": str, "failed": str, "cancelled": str},
				Required:   map[string]bool{"completed": true, "failed": true, "cancelled": true}}
			if step.SaveAs == "" {
				continue
			}
		case step.Kind == KindWorkflow:
			out = nil // the child's final state
		case step.Kind == KindAgent:
			out = OutputShapeOf(step)
		case step.ForEach != nil:
			// The outputs in input order; under collect, with the errors.
			list := &Shape{Type: "array", Items: out}
			out = list
			if step.ForEach.Collects() {
				out = &Shape{Type: "object", Closed: true,
					Properties: map[string]*Shape{"results": list, "errors": {Type: "array"}},
					Required:   map[string]bool{"results": true, "errors": true}}
			}
		}
		if step.SaveAs != "" {
			add(step.SaveAs, out)
			continue
		}
		if !out.IsObject() || !out.Closed {
			openMerge = true
		}
		if out != nil {
			for k := range out.Required {
				add(k, out.Properties[k])
			}
		}
	}
	st := ShapeOf(def.StateSchema)
	in := ShapeOf(def.InputSchema)
	if in.IsObject() {
		c := *in
		c.Properties = map[string]*Shape{}
		for k, p := range in.Properties {
			if _, produced := producers[k]; produced {
				continue
			}
			if openMerge {
				p = nil
			}
			c.Properties[k] = p
		}
		if openMerge {
			c.Closed, c.Additional = false, nil
		}
		if st != nil {
			// The state_schema says which members may exist; the input
			// only what those it holds look like.
			c.Closed, c.Additional = false, nil
		}
		in = &c
	} else {
		in = nil
	}
	base := Intersect(st, in)
	if base == nil {
		if len(producers) == 0 {
			return nil
		}
		base = &Shape{Type: "object"}
	}
	if !base.IsObject() {
		return base
	}
	s := *base
	s.Properties = maps.Clone(base.Properties)
	s.Required = maps.Clone(base.Required)
	if s.Properties == nil {
		s.Properties = map[string]*Shape{}
	}
	if s.Required == nil {
		s.Required = map[string]bool{}
	}
	for _, name := range order {
		shapes := producers[name]
		produced := shapes[0]
		for _, p := range shapes[1:] {
			produced = Union(produced, p)
		}
		if st != nil {
			m := st.Lookup(name)
			if m.Impossible != "" {
				continue // the state schema forbids it: checks report reads of it
			}
			produced = Intersect(m.Shape, produced)
		}
		s.Properties[name] = produced
		s.Required[name] = true
	}
	return &s
}
