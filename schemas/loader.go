package schemas

import (
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/goccy/go-yaml"
	"github.com/goccy/go-yaml/ast"
	"github.com/goccy/go-yaml/parser"
	"github.com/goccy/go-yaml/token"
)

// WorkflowSchemaJSON is schemas/workflow.schema.json, the JSON Schema every
// workflow definition must pass.
//
//go:embed workflow.schema.json
var WorkflowSchemaJSON []byte

// Size limits applied by the loader.
const (
	MaxDefinitionBytes = 4 << 20 // a workflow file, assets excluded
	MaxAssetBytes      = 4 << 20 // one embedded asset
)

var workflowValidator = sync.OnceValues(func() (*Validator, error) {
	return CompileSchema("workflow.schema.json", WorkflowSchemaJSON)
})

// Problem is one thing wrong with a definition, at a JSON Pointer (RFC
// 6901) into the definition document, for example "/steps/2/next/0/to".
type Problem struct {
	Path    string `json:"path"`
	Message string `json:"message"`
	// Warning marks what the loader cannot check and the author should
	// know (a template field the state schema leaves open, a model step
	// that replay-mode workers cannot run): it does not refuse the
	// definition. Parse returns warnings with the Definition (Warnings)
	// or, beside the errors, in the DefinitionError.
	Warning bool `json:"warning,omitempty"`
}

// CheckFunc inspects a definition that has passed the workflow schema and
// the loader's own checks, and reports problems by path; those marked
// Warning do not refuse it. The engine checks transition conditions this
// way, workers their kinds and templates.
type CheckFunc func(*Definition) []Problem

// LoadOptions adjusts Load and Parse.
type LoadOptions struct {
	// BaseDir resolves asset paths. Load defaults it to the file's folder;
	// Parse to the working directory.
	BaseDir string
	// Checks run after the built-in checks; their problems are reported with
	// file positions like the built-in ones.
	Checks []CheckFunc
	// NoAssetFiles refuses definitions that list assets, which would be
	// read from the local file system: for definitions that arrive over a
	// network API.
	NoAssetFiles bool
}

// LocatedProblem is a Problem with its place in the source file. Line and
// Column are 1-based; 0 when unknown.
type LocatedProblem struct {
	Problem
	Line   int `json:"line,omitempty"`
	Column int `json:"column,omitempty"`
}

// DefinitionError lists everything wrong with a workflow file. It matches
// ErrDefinitionInvalid with errors.Is.
type DefinitionError struct {
	File     string
	Problems []LocatedProblem
	// Warnings are what the checks could not decide (Problem.Warning);
	// they did not cause the refusal.
	Warnings []LocatedProblem
}

// Error gives one line per problem: "file:line:col: path: message".
func (e *DefinitionError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: invalid workflow definition (%d problem", e.File, len(e.Problems))
	if len(e.Problems) != 1 {
		b.WriteString("s")
	}
	b.WriteString(")")
	for _, p := range e.Problems {
		b.WriteString("\n  ")
		b.WriteString(p.Format(e.File))
	}
	for _, p := range e.Warnings {
		b.WriteString("\n  ")
		b.WriteString(p.Format(e.File))
	}
	return b.String()
}

// Format gives "file:line:col: path: message", with "warning: " before the
// path of a warning.
func (p LocatedProblem) Format(file string) string {
	var b strings.Builder
	b.WriteString(file)
	if p.Line > 0 {
		fmt.Fprintf(&b, ":%d", p.Line)
		if p.Column > 0 {
			fmt.Fprintf(&b, ":%d", p.Column)
		}
	}
	b.WriteString(": ")
	if p.Warning {
		b.WriteString("warning: ")
	}
	if p.Path != "" {
		b.WriteString(PointerToPath(p.Path))
		b.WriteString(": ")
	}
	b.WriteString(p.Message)
	return b.String()
}

// Is matches ErrDefinitionInvalid.
func (e *DefinitionError) Is(target error) bool { return target == ErrDefinitionInvalid }

// Load reads, validates and hashes the workflow file at path (YAML or JSON).
// Errors are a *DefinitionError naming the file, line and path of each
// problem, or an I/O error wrapped with the path.
func Load(path string, opts LoadOptions) (*Definition, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read workflow %s: %w", path, err)
	}
	if opts.BaseDir == "" {
		opts.BaseDir = filepath.Dir(path)
	}
	return Parse(path, data, opts)
}

// Parse is Load on bytes already read; name is used in messages.
func Parse(name string, data []byte, opts LoadOptions) (*Definition, error) {
	fail := func(ps ...LocatedProblem) error { return &DefinitionError{File: name, Problems: ps} }
	// A byte order mark some editors write starts no key (YAML 1.2 allows
	// one at the start of a stream); lines and columns count without it.
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf"))
	if len(data) > MaxDefinitionBytes {
		return nil, fail(LocatedProblem{Problem: Problem{Message: fmt.Sprintf("file is %d bytes; the limit is %d", len(data), MaxDefinitionBytes)}})
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, fail(LocatedProblem{Problem: Problem{Message: "file is empty"}})
	}
	isJSON := strings.EqualFold(filepath.Ext(name), ".json")
	if isJSON {
		// YAML accepts what JSON does not (trailing commas, single quotes,
		// comments); a .json file must be JSON.
		if p, bad := jsonSyntaxProblem(data); bad {
			return nil, fail(p)
		}
	}
	if p, bad := definitionTextProblem(data, isJSON); bad {
		return nil, fail(p)
	}
	file, err := parser.ParseBytes(data, 0)
	if err != nil {
		return nil, fail(yamlProblem(err))
	}
	if len(file.Docs) != 1 {
		p := LocatedProblem{Problem: Problem{Message: fmt.Sprintf("want exactly one YAML document, found %d", len(file.Docs))}}
		if len(file.Docs) > 1 {
			pos := tokenPosition(file.Docs[1].Start)
			if pos.Line == 0 {
				pos = nodePosition(file.Docs[1].Body)
			}
			p.Line, p.Column = pos.Line, pos.Column
		}
		return nil, fail(p)
	}
	if x := (&expansion{anchors: map[string]int{}}); x.size(file.Docs[0].Body) > maxExpandedBytes {
		pos := tokenPosition(x.firstAlias)
		return nil, fail(LocatedProblem{Problem: Problem{Message: fmt.Sprintf("YAML aliases expand the file beyond %d bytes", maxExpandedBytes)}, Line: pos.Line, Column: pos.Column})
	}
	var raw any
	if err := yaml.UnmarshalWithOptions(data, &raw); err != nil {
		return nil, fail(yamlProblem(err))
	}
	loc := &locator{file: file}
	doc, err := normalise(raw)
	if err != nil {
		line, col := loc.position("")
		return nil, fail(LocatedProblem{Problem: Problem{Message: err.Error()}, Line: line, Column: col})
	}
	located := func(ps []Problem) []LocatedProblem {
		out := make([]LocatedProblem, 0, len(ps))
		for _, p := range ps {
			line, col := loc.position(p.Path)
			out = append(out, LocatedProblem{Problem: p, Line: line, Column: col})
		}
		sort.SliceStable(out, func(i, j int) bool { return out[i].Line < out[j].Line })
		return out
	}
	locate := func(ps []Problem) error { return fail(located(ps)...) }

	wv, err := workflowValidator()
	if err != nil {
		return nil, fmt.Errorf("compile embedded workflow schema: %w", err)
	}
	if err := wv.Validate(doc); err != nil {
		var se *SchemaError
		if !errors.As(err, &se) {
			return nil, fail(LocatedProblem{Problem: Problem{Message: err.Error()}})
		}
		return nil, locate(schemaProblems(se))
	}

	m := doc.(map[string]any)
	if _, has := m["assets"]; has && opts.NoAssetFiles {
		return nil, locate([]Problem{{Path: "/assets", Message: "assets are read from files and cannot be used here; load the workflow from a file with the CLI"}})
	}
	if ps := embedAssets(m, opts.BaseDir); len(ps) > 0 {
		return nil, locate(ps)
	}
	canonical, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode definition %s: %w", name, err)
	}
	def, err := DecodeDefinition(canonical)
	if err != nil {
		return nil, fail(LocatedProblem{Problem: Problem{Message: err.Error()}})
	}
	ps := checkDefinition(def)
	if len(ps) == 0 {
		for _, check := range opts.Checks {
			ps = append(ps, check(def)...)
		}
	}
	var errs, warns []Problem
	for _, p := range ps {
		if p.Warning {
			warns = append(warns, p)
		} else {
			errs = append(errs, p)
		}
	}
	if len(errs) > 0 {
		return nil, &DefinitionError{File: name, Problems: located(errs), Warnings: located(warns)}
	}
	if len(warns) > 0 {
		def.warnings = located(warns)
	}
	return def, nil
}

// Warnings returns what the loader's checks could not decide about d
// (Problem.Warning), in line order; nil for a definition decoded from
// storage, which is not checked again.
func (d *Definition) Warnings() []LocatedProblem { return d.warnings }

// DecodeDefinition decodes the canonical JSON of a stored definition and
// sets its Hash to the SHA-256 of data. It does not re-run the loader's
// checks; stored definitions passed them when they were loaded.
func DecodeDefinition(data []byte) (*Definition, error) {
	var def Definition
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&def); err != nil {
		return nil, Errorf(CodeDefinitionInvalid, "decode definition: %v", err)
	}
	if dec.More() {
		// The hash covers every byte: data after the definition is damage,
		// not something to pin jobs to.
		return nil, Errorf(CodeDefinitionInvalid, "decode definition: unexpected data after the JSON value at offset %d", dec.InputOffset())
	}
	if len(def.Steps) == 0 {
		return nil, Errorf(CodeDefinitionInvalid, "decode definition: no steps")
	}
	sum := sha256.Sum256(data)
	def.Hash = hex.EncodeToString(sum[:])
	def.canonical = data
	def.buildIndex()
	return &def, nil
}

// Canonical returns the definition's canonical JSON: the bytes its Hash is
// the SHA-256 of, and the form stored in the definitions bucket.
func (d *Definition) Canonical() []byte { return d.canonical }

// PointerToPath turns a JSON Pointer into the dotted form people read:
// "/steps/2/next/0" → "steps[2].next[0]".
func PointerToPath(ptr string) string {
	if ptr == "" || ptr == "/" {
		return "(root)"
	}
	var b strings.Builder
	for _, tok := range strings.Split(strings.TrimPrefix(ptr, "/"), "/") {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		if _, err := strconv.Atoi(tok); err == nil {
			b.WriteString("[" + tok + "]")
			continue
		}
		if b.Len() > 0 {
			b.WriteString(".")
		}
		b.WriteString(tok)
	}
	return b.String()
}

func schemaProblems(se *SchemaError) []Problem {
	ps := make([]Problem, 0, len(se.Problems))
	for _, p := range se.Problems {
		// An unknown key is reported at its parent object; move it to the
		// key itself so that its line is the key's line.
		if names, ok := unknownProperties(p.Message); ok {
			for _, n := range names {
				ps = append(ps, Problem{Path: p.Path + "/" + escapePointer(n), Message: fmt.Sprintf("unknown field %q", n)})
			}
			continue
		}
		ps = append(ps, Problem{Path: p.Path, Message: p.Message})
	}
	// A failed oneOf/if-then reports every branch; the deepest paths carry
	// the useful message, so drop problems whose path is a strict prefix of
	// another's.
	var out []Problem
	for i, p := range ps {
		shadowed := false
		for j, q := range ps {
			if i != j && strings.HasPrefix(q.Path, p.Path+"/") {
				shadowed = true
				break
			}
		}
		if !shadowed {
			out = append(out, p)
		}
	}
	return out
}

// unknownProperties parses the names out of jsonschema's message
// "additionalProperties 'a', 'b' not allowed", where each name is Go-quoted
// between single quotes, with ' escaped as \'.
func unknownProperties(msg string) ([]string, bool) {
	rest, ok := strings.CutPrefix(msg, "additionalProperties ")
	if !ok {
		return nil, false
	}
	rest, ok = strings.CutSuffix(rest, " not allowed")
	if !ok {
		return nil, false
	}
	var names []string
	for {
		if len(rest) == 0 || rest[0] != '\'' {
			return nil, false
		}
		end := -1
		for i := 1; i < len(rest); i++ {
			if rest[i] == '\\' {
				i++
				continue
			}
			if rest[i] == '\'' {
				end = i
				break
			}
		}
		if end < 0 {
			return nil, false
		}
		inner := strings.ReplaceAll(rest[1:end], `\'`, `'`)
		inner = strings.ReplaceAll(inner, `"`, `\"`)
		n, err := strconv.Unquote(`"` + inner + `"`)
		if err != nil {
			return nil, false
		}
		names = append(names, n)
		rest = rest[end+1:]
		if rest == "" {
			return names, true
		}
		if rest, ok = strings.CutPrefix(rest, ", "); !ok {
			return nil, false
		}
	}
}

func escapePointer(tok string) string {
	return strings.ReplaceAll(strings.ReplaceAll(tok, "~", "~0"), "/", "~1")
}

// jsonSyntaxProblem reports where data stops being one JSON value, if it
// does.
func jsonSyntaxProblem(data []byte) (LocatedProblem, bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	var v any
	err := dec.Decode(&v)
	var bad int // offset of the offending byte
	var se *json.SyntaxError
	switch {
	case err == nil && !dec.More():
		return LocatedProblem{}, false
	case err == nil:
		bad = int(dec.InputOffset())
		for bad < len(data) && strings.IndexByte(" \t\r\n", data[bad]) >= 0 {
			bad++
		}
		err = errors.New("unexpected data after the JSON value")
	case errors.As(err, &se):
		bad = int(se.Offset) - 1 // Offset counts the offending byte
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		bad = len(bytes.TrimRight(data, " \t\r\n")) // just past the last value
		err = errors.New("unexpected end of input")
	default:
		bad = len(data)
	}
	bad = min(max(bad, 0), len(data))
	lineStart := bytes.LastIndexByte(data[:bad], '\n') + 1
	return LocatedProblem{
		Problem: Problem{Message: "JSON: " + err.Error()},
		Line:    1 + bytes.Count(data[:bad], []byte("\n")),
		Column:  1 + utf8.RuneCount(data[lineStart:bad]),
	}, true
}

func yamlProblem(err error) LocatedProblem {
	var ye yaml.Error
	if errors.As(err, &ye) {
		p := LocatedProblem{Problem: Problem{Message: "YAML: " + ye.GetMessage()}}
		if tok := ye.GetToken(); tok != nil && tok.Position != nil {
			p.Line, p.Column = tok.Position.Line, tok.Position.Column
		}
		return p
	}
	return LocatedProblem{Problem: Problem{Message: "YAML: " + err.Error()}}
}

// maxExpandedBytes bounds what a file's YAML aliases may expand to, counted
// as scalar bytes plus one per node. Decoding copies an alias's value
// wherever it is used, so without a bound a few hundred bytes of nested
// aliases ("billion laughs") become gigabytes; a file without aliases
// never comes near it.
const maxExpandedBytes = 2 * MaxDefinitionBytes

// expansion sizes a YAML tree with every alias replaced by its anchor's
// value, saturating just above maxExpandedBytes.
type expansion struct {
	anchors    map[string]int
	firstAlias *token.Token
}

func (x *expansion) size(n ast.Node) int {
	add := func(a, b int) int { return min(a+b, maxExpandedBytes+1) }
	switch n := n.(type) {
	case nil:
		return 0
	case *ast.AnchorNode:
		s := x.size(n.Value)
		if n.Name != nil {
			x.anchors[n.Name.GetToken().Value] = s
		}
		return s
	case *ast.AliasNode:
		if x.firstAlias == nil {
			x.firstAlias = n.GetToken()
		}
		if n.Value == nil {
			return 1
		}
		return max(1, x.anchors[n.Value.GetToken().Value])
	case *ast.TagNode:
		return add(1, x.size(n.Value))
	case *ast.MappingKeyNode:
		return add(1, x.size(n.Value))
	case *ast.MappingValueNode:
		return add(x.size(n.Key), x.size(n.Value))
	case *ast.MappingNode:
		s := 1
		for _, mv := range n.Values {
			s = add(s, x.size(mv))
		}
		return s
	case *ast.SequenceNode:
		s := 1
		for _, v := range n.Values {
			s = add(s, x.size(v))
		}
		return s
	case ast.ScalarNode:
		if v, ok := n.GetValue().(string); ok {
			return add(1, len(v))
		}
	}
	if t := n.GetToken(); t != nil {
		return add(1, len(t.Value))
	}
	return 1
}

// normalise turns what the YAML decoder produced into plain JSON types
// (map[string]any, []any, json.Number, string, bool, nil).
func normalise(v any) (any, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("definition is not representable as JSON (keys must be strings): %v", err)
	}
	out, err := DecodeJSON(b)
	if err != nil {
		return nil, err
	}
	if _, ok := out.(map[string]any); !ok {
		return nil, fmt.Errorf("top level must be a mapping, not %s", jsonKind(out))
	}
	return out, nil
}

func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case map[string]any:
		return "a mapping"
	case []any:
		return "a list"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	}
	return "a number"
}

// embedAssets replaces each asset path with the file's content.
func embedAssets(m map[string]any, base string) []Problem {
	assets, _ := m["assets"].(map[string]any)
	var ps []Problem
	names := make([]string, 0, len(assets))
	for n := range assets {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		rel := assets[name].(string)
		ptr := "/assets/" + name
		path := rel
		if !filepath.IsAbs(path) {
			path = filepath.Join(base, rel)
		}
		data, err := readAsset(path)
		if err != nil {
			ps = append(ps, Problem{Path: ptr, Message: fmt.Sprintf("read asset: %v", err)})
			continue
		}
		if len(data) > MaxAssetBytes {
			ps = append(ps, Problem{Path: ptr, Message: fmt.Sprintf("asset %s is over the limit of %d bytes", rel, MaxAssetBytes)})
			continue
		}
		if strings.EqualFold(filepath.Ext(path), ".json") {
			v, err := DecodeJSON(data)
			if err != nil {
				ps = append(ps, Problem{Path: ptr, Message: fmt.Sprintf("asset %s is not valid JSON: %v", rel, err)})
				continue
			}
			if err := CheckJSONText(data); err != nil {
				ps = append(ps, Problem{Path: ptr, Message: fmt.Sprintf("asset %s: %s", rel, AsError(err).Message)})
				continue
			}
			assets[name] = v
			continue
		}
		if off, b, ok := firstInvalidUTF8(string(data)); !ok {
			line, col := lineColumn(data, off)
			ps = append(ps, Problem{Path: ptr, Message: fmt.Sprintf("asset %s:%d:%d: invalid UTF-8 byte 0x%02x (byte %d); a text asset must be UTF-8", rel, line, col, b, off)})
			continue
		}
		assets[name] = string(data)
	}
	return ps
}

// readAsset reads a regular file, at most one byte past MaxAssetBytes so
// that the caller can report the size: a device or a pipe named as an
// asset must not block the loader or fill its memory.
func readAsset(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	return io.ReadAll(io.LimitReader(f, MaxAssetBytes+1))
}

// checkDefinition finds what the schema cannot: duplicate ids, missing
// targets and schemas that do not compile.
func checkDefinition(d *Definition) []Problem {
	var ps []Problem
	seen := map[string]int{}
	for i, s := range d.Steps {
		if j, dup := seen[s.ID]; dup {
			ps = append(ps, Problem{Path: fmt.Sprintf("/steps/%d/id", i), Message: fmt.Sprintf("duplicate step id %q (first at steps[%d])", s.ID, j)})
			continue
		}
		seen[s.ID] = i
	}
	exists := func(id string) bool { _, ok := seen[id]; return ok }
	if d.Start != "" && !exists(d.Start) {
		ps = append(ps, Problem{Path: "/start", Message: fmt.Sprintf("start step %q does not exist", d.Start)})
	}
	for _, sc := range []struct {
		ptr string
		raw json.RawMessage
	}{{"/input_schema", d.InputSchema}, {"/state_schema", d.StateSchema}} {
		if _, err := CompileSchema(sc.ptr, sc.raw); err != nil {
			ps = append(ps, Problem{Path: sc.ptr, Message: AsError(err).Message})
		}
	}
	for i, s := range d.Steps {
		base := fmt.Sprintf("/steps/%d", i)
		for j, t := range s.Next {
			if t.To != "" && !exists(t.To) {
				ps = append(ps, Problem{Path: fmt.Sprintf("%s/next/%d/to", base, j), Message: fmt.Sprintf("transition to step %q, which does not exist", t.To)})
			}
		}
		if s.OnError != "" && !exists(s.OnError) {
			ps = append(ps, Problem{Path: base + "/on_error", Message: fmt.Sprintf("on_error names step %q, which does not exist", s.OnError)})
		}
		for _, sc := range []struct {
			ptr string
			raw json.RawMessage
		}{{base + "/input_schema", s.InputSchema}, {base + "/output_schema", s.OutputSchema}} {
			if _, err := CompileSchema(sc.ptr, sc.raw); err != nil {
				ps = append(ps, Problem{Path: sc.ptr, Message: AsError(err).Message})
			}
		}
	}
	ps = append(ps, checkFans(d)...)
	ps = append(ps, checkAgents(d)...)
	ps = append(ps, checkControls(d)...)
	ps = append(ps, checkTriggers(d)...)
	ps = append(ps, checkFlow(d)...)
	return append(ps, checkEffectKeys(d)...)
}

// locator maps JSON Pointers to positions in the YAML source.
type locator struct{ file *ast.File }

// position returns the line and column of what ptr names: the key of a
// mapping entry (where a reader looks for "steps[0].with", not at the
// value on the line below), the first key of a block mapping reached by
// index, or the node itself. A path that leaves the source (a missing
// property, a value merged in from an alias) stops at the deepest node on
// it, so a missing property points at its parent.
func (l *locator) position(ptr string) (int, int) {
	if len(l.file.Docs) == 0 || l.file.Docs[0].Body == nil {
		return 0, 0
	}
	toks := []string{}
	if ptr != "" && ptr != "/" {
		toks = strings.Split(strings.TrimPrefix(ptr, "/"), "/")
	}
	node := l.file.Docs[0].Body
	pos := nodePosition(node)
	for _, t := range toks {
		t = strings.ReplaceAll(strings.ReplaceAll(t, "~1", "/"), "~0", "~")
		switch n := unwrapNode(node).(type) {
		case *ast.MappingNode:
			mv := findKey(n.Values, t)
			if mv == nil {
				return pos.Line, pos.Column
			}
			pos, node = tokenPosition(mv.Key.GetToken()), mv.Value
		case *ast.MappingValueNode:
			if findKey([]*ast.MappingValueNode{n}, t) == nil {
				return pos.Line, pos.Column
			}
			pos, node = tokenPosition(n.Key.GetToken()), n.Value
		case *ast.SequenceNode:
			i, err := strconv.Atoi(t)
			if err != nil || i < 0 || i >= len(n.Values) {
				return pos.Line, pos.Column
			}
			node = n.Values[i]
			pos = nodePosition(node)
		default:
			return pos.Line, pos.Column
		}
	}
	return pos.Line, pos.Column
}

func findKey(values []*ast.MappingValueNode, key string) *ast.MappingValueNode {
	for _, mv := range values {
		var k ast.Node = mv.Key
		if mk, ok := k.(*ast.MappingKeyNode); ok {
			k = mk.Value
		}
		k = unwrapNode(k)
		if sc, ok := k.(ast.ScalarNode); ok && fmt.Sprint(sc.GetValue()) == key {
			return mv
		}
	}
	return nil
}

func unwrapNode(n ast.Node) ast.Node {
	for {
		switch w := n.(type) {
		case *ast.TagNode:
			n = w.Value
		case *ast.AnchorNode:
			n = w.Value
		default:
			return n
		}
	}
}

// nodePosition is where a node starts for a reader: the first key of a
// block mapping (its own token is the first ':'), else its first token.
func nodePosition(n ast.Node) token.Position {
	if n == nil {
		return token.Position{}
	}
	if m, ok := unwrapNode(n).(*ast.MappingNode); ok && !m.IsFlowStyle && len(m.Values) > 0 {
		return tokenPosition(m.Values[0].Key.GetToken())
	}
	return tokenPosition(n.GetToken())
}

func tokenPosition(t *token.Token) token.Position {
	if t == nil || t.Position == nil {
		return token.Position{}
	}
	return *t.Position
}

// LocateInJSON returns the line and column (1-based) of the value at the
// JSON Pointer ptr in a JSON (or YAML) document, or of its deepest existing
// parent; 0, 0 when data does not parse.
func LocateInJSON(data []byte, ptr string) (int, int) {
	file, err := parser.ParseBytes(data, 0)
	if err != nil {
		return 0, 0
	}
	return (&locator{file: file}).position(ptr)
}
