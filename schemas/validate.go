package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync/atomic"

	"github.com/santhosh-tekuri/jsonschema/v5"
)

// Validator checks JSON values against one compiled JSON Schema (draft
// 2020-12 unless the schema says otherwise). Formats are asserted and remote
// $ref is refused. Safe for concurrent use.
type Validator struct {
	schema *jsonschema.Schema
}

var schemaSeq atomic.Uint64

// CompileSchema compiles raw (a JSON Schema document) into a Validator.
// name is used in error messages. Empty raw gives a nil Validator, which
// accepts everything. Errors wrap ErrDefinitionInvalid.
func CompileSchema(name string, raw json.RawMessage) (*Validator, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil, nil
	}
	c := jsonschema.NewCompiler()
	c.Draft = jsonschema.Draft2020
	c.AssertFormat = true
	c.LoadURL = func(u string) (io.ReadCloser, error) {
		return nil, fmt.Errorf("remote $ref %q is not allowed: schemas must be self-contained", u)
	}
	url := fmt.Sprintf("mem://waymark/%d/%s.json", schemaSeq.Add(1), sanitizeName(name))
	if err := c.AddResource(url, bytes.NewReader(raw)); err != nil {
		return nil, Errorf(CodeDefinitionInvalid, "%s: not a JSON Schema: %v", name, trimSchemaURL(err.Error()))
	}
	s, err := c.Compile(url)
	if err != nil {
		return nil, Errorf(CodeDefinitionInvalid, "%s: %v", name, trimSchemaURL(err.Error()))
	}
	return &Validator{schema: s}, nil
}

// Validate checks v, which must hold only plain JSON types (as produced by
// json.Unmarshal into any); use ValidateJSON for raw bytes. It returns nil
// or a *SchemaError listing every violation.
func (v *Validator) Validate(doc any) (err error) {
	if v == nil {
		return nil
	}
	defer func() {
		// The library panics on Go types JSON cannot produce; report, never crash.
		if r := recover(); r != nil {
			err = &SchemaError{Problems: []SchemaProblem{{Message: fmt.Sprintf("value is not plain JSON: %v", r)}}}
		}
	}()
	err = v.schema.Validate(doc)
	if err == nil {
		return nil
	}
	ve, ok := err.(*jsonschema.ValidationError)
	if !ok {
		return &SchemaError{Problems: []SchemaProblem{{Path: "", Message: err.Error()}}}
	}
	return newSchemaError(ve)
}

// ValidateJSON decodes raw and validates it. Malformed JSON is reported as
// a *SchemaError at the document root.
func (v *Validator) ValidateJSON(raw []byte) error {
	if v == nil {
		return nil
	}
	doc, err := DecodeJSON(raw)
	if err != nil {
		return &SchemaError{Problems: []SchemaProblem{{Message: "not valid JSON: " + err.Error()}}}
	}
	return v.Validate(doc)
}

// DecodeJSON decodes raw into plain JSON types, numbers as json.Number so
// that large integers keep their value. It rejects trailing data.
func DecodeJSON(raw []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, fmt.Errorf("unexpected data after the JSON value at offset %d", dec.InputOffset())
	}
	return v, nil
}

// SchemaProblem is one violation: where in the instance (a JSON Pointer,
// RFC 6901) and what is wrong.
type SchemaProblem struct {
	Path    string `json:"path"`
	Message string `json:"message"`
}

// SchemaError lists the violations found by a Validator, most specific
// first, without duplicates.
type SchemaError struct {
	Problems []SchemaProblem
}

// Error joins the problems as "at /path: message; ...".
func (e *SchemaError) Error() string {
	parts := make([]string, 0, len(e.Problems))
	for _, p := range e.Problems {
		path := p.Path
		if path == "" {
			path = "/"
		}
		parts = append(parts, "at "+path+": "+p.Message)
	}
	return strings.Join(parts, "; ")
}

func newSchemaError(ve *jsonschema.ValidationError) *SchemaError {
	// Keep the leaves: they name the actual violation; inner nodes only say
	// "doesn't validate with ...".
	var leaves []SchemaProblem
	seen := map[string]bool{}
	var walk func(*jsonschema.ValidationError)
	walk = func(e *jsonschema.ValidationError) {
		if len(e.Causes) == 0 {
			key := e.InstanceLocation + "\x00" + e.Message
			if !seen[key] {
				seen[key] = true
				leaves = append(leaves, SchemaProblem{Path: e.InstanceLocation, Message: e.Message})
			}
			return
		}
		for _, c := range e.Causes {
			walk(c)
		}
	}
	walk(ve)
	// Deeper paths are more specific; keep the order stable otherwise.
	sort.SliceStable(leaves, func(i, j int) bool {
		return strings.Count(leaves[i].Path, "/") > strings.Count(leaves[j].Path, "/")
	})
	return &SchemaError{Problems: leaves}
}

func sanitizeName(s string) string {
	var b strings.Builder
	for _, r := range s {
		if r == '/' || r == '#' || r == '?' || r == ' ' || r == '%' {
			r = '_'
		}
		b.WriteRune(r)
	}
	return b.String()
}

// trimSchemaURL replaces every internal mem:// URL in s with "schema".
func trimSchemaURL(s string) string {
	for {
		i := strings.Index(s, "mem://waymark/")
		if i < 0 {
			return s
		}
		j := strings.Index(s[i:], ".json")
		if j < 0 {
			return s
		}
		s = s[:i] + "schema" + s[i+j+len(".json"):]
	}
}
