package steps

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"text/template"
	"text/template/parse"

	"github.com/waymark-dev/waymark/schemas"
)

// templatePaths are, by built-in kind, the members of a step's with whose
// string values are templates, as JSON Pointers into with: "*" stands for
// any one member or item, "**" for any number of them (an http body given
// as a JSON value has a template in every string).
var templatePaths = map[string][]string{
	schemas.KindHTTP:  {"/url", "/headers/*", "/body/**", "/lookup/url"},
	schemas.KindModel: {"/system", "/prompt"},
	schemas.KindAgent: {"/system", "/prompt"},
	KindMCP:           {"/url", "/headers/*", "/arguments/**"},
}

// elem stands for "an item of" in a field chain: the dot inside {{range}}.
const elem = "[]"

// TemplateRead is one field chain a template reads from its data, from the
// data's root: {{.state.order.id}} reads ["state", "order", "id"];
// {{range .state.items}} reads ["state", "items", "[]"] (it iterates), and
// inside it {{.sku}} reads ["state", "items", "[]", "sku"].
type TemplateRead struct {
	Chain []string
	// Pos is the byte offset of the read in the template's text.
	Pos int
}

// String gives the chain as a template writes it: .state.items[].sku.
func (r TemplateRead) String() string {
	var b strings.Builder
	for _, f := range r.Chain {
		if f == elem {
			b.WriteString(elem)
			continue
		}
		b.WriteString(".")
		b.WriteString(f)
	}
	return b.String()
}

// TemplateReads walks every template associated with t (its {{define}}d
// ones through {{template}} calls) and returns the field chains it reads
// from the data it is executed with: fields of the dot, followed through
// {{with}} and {{range}} (whose dot is an item), of $ and of variables
// bound to a chain. Reads whose start the walk cannot follow (the result
// of a function, a variable bound to one) are not listed. Safe on any
// parsed template; recursion through {{template}} stops at a depth of 16.
func TemplateReads(t *template.Template) []TemplateRead {
	if t == nil || t.Tree == nil {
		return nil
	}
	w := &readWalker{t: t}
	w.list(t.Tree.Root, []string{}, map[string][]string{"$": {}}, 0)
	return w.reads
}

type readWalker struct {
	t     *template.Template
	reads []TemplateRead
}

// list walks a list of nodes. In the walk, a chain is the data path of a
// value (dot, a variable's value); nil when the walk cannot follow it.
func (w *readWalker) list(l *parse.ListNode, dot []string, vars map[string][]string, depth int) {
	if l == nil {
		return
	}
	for _, n := range l.Nodes {
		w.node(n, dot, vars, depth)
	}
}

func (w *readWalker) node(n parse.Node, dot []string, vars map[string][]string, depth int) {
	switch n := n.(type) {
	case *parse.ActionNode:
		w.pipe(n.Pipe, dot, vars)
	case *parse.IfNode:
		w.pipe(n.Pipe, dot, vars)
		w.list(n.List, dot, scope(vars), depth)
		w.list(n.ElseList, dot, scope(vars), depth)
	case *parse.WithNode:
		inner := scope(vars)
		c := w.pipe(n.Pipe, dot, inner)
		w.list(n.List, c, inner, depth)
		w.list(n.ElseList, dot, scope(vars), depth)
	case *parse.RangeNode:
		inner := scope(vars)
		c := w.pipe(n.Pipe, dot, inner)
		var item []string
		if c != nil {
			item = append(append([]string{}, c...), elem)
			w.reads = append(w.reads, TemplateRead{Chain: item, Pos: int(n.Pos)})
		}
		if d := n.Pipe.Decl; len(d) > 0 {
			// {{range $i, $e := ...}}: $e is the item; {{range $e := ...}} too.
			inner[d[len(d)-1].Ident[0]] = item
			if len(d) == 2 {
				inner[d[0].Ident[0]] = nil
			}
		}
		w.list(n.List, item, inner, depth)
		w.list(n.ElseList, dot, scope(vars), depth)
	case *parse.TemplateNode:
		var c []string
		if n.Pipe != nil {
			c = w.pipe(n.Pipe, dot, vars)
		}
		if depth < 16 {
			if sub := w.t.Lookup(n.Name); sub != nil && sub.Tree != nil {
				w.list(sub.Tree.Root, c, map[string][]string{"$": c}, depth+1)
			}
		}
	case *parse.ListNode:
		w.list(n, dot, vars, depth)
	}
}

// pipe records the reads of a pipeline and returns the chain of its value
// when it is a single field chain (for {{with}}, {{range}} and variables).
func (w *readWalker) pipe(p *parse.PipeNode, dot []string, vars map[string][]string) []string {
	if p == nil {
		return nil
	}
	var result []string
	for i, cmd := range p.Cmds {
		for j, arg := range cmd.Args {
			c := w.arg(arg, dot, vars)
			if i == 0 && j == 0 && len(p.Cmds) == 1 && len(cmd.Args) == 1 {
				result = c
			}
		}
	}
	for _, v := range p.Decl {
		vars[v.Ident[0]] = result
	}
	return result
}

// arg records the reads of one argument and returns its chain.
func (w *readWalker) arg(n parse.Node, dot []string, vars map[string][]string) []string {
	switch n := n.(type) {
	case *parse.FieldNode:
		return w.read(dot, n.Ident, int(n.Pos))
	case *parse.VariableNode:
		base, ok := vars[n.Ident[0]]
		if !ok {
			return nil
		}
		return w.read(base, n.Ident[1:], int(n.Pos))
	case *parse.DotNode:
		return dot
	case *parse.ChainNode:
		var base []string
		switch inner := n.Node.(type) {
		case *parse.FieldNode, *parse.VariableNode, *parse.DotNode:
			base = w.arg(inner, dot, vars)
		case *parse.PipeNode:
			base = w.pipe(inner, dot, scope(vars))
		}
		return w.read(base, n.Field, int(n.Pos))
	case *parse.PipeNode:
		w.pipe(n, dot, scope(vars))
	}
	return nil
}

func (w *readWalker) read(base, fields []string, pos int) []string {
	if base == nil {
		return nil
	}
	c := append(append([]string{}, base...), fields...)
	if len(fields) > 0 {
		w.reads = append(w.reads, TemplateRead{Chain: c, Pos: pos})
	}
	return c
}

func scope(vars map[string][]string) map[string][]string {
	out := make(map[string][]string, len(vars))
	for k, v := range vars {
		out[k] = v
	}
	return out
}

// checkTemplates checks the field chains the templates of step i read
// against what its template data holds (Call.TemplateData): .state with
// the shape of the state (schemas.StateShape, narrowed by the step's
// input_schema), .vars with the declared vars, and the strings .job,
// .step, .idempotency_key and the number .attempt. A member a closed
// schema cannot have is an error; one the schemas leave open, or one that
// is declared but may be absent (missingkey=error then fails the step), is
// a warning. Templates that do not parse are left to the kind's Prepare.
func checkTemplates(def *schemas.Definition, i int, state *schemas.Shape) []schemas.Problem {
	s := &def.Steps[i]
	base := fmt.Sprintf("/steps/%d", i)
	var data *schemas.Shape
	if s.ForEach != nil {
		// A map item's input_schema is the item's; the state is the job's
		// without the list.
		data = templateDataShape(def, state)
		item := schemas.ShapeOf(s.InputSchema)
		if item == nil {
			if list := state.At(s.ForEach.Items); list != nil {
				item = list.Items
			}
		}
		data.Properties["item"] = item
		data.Properties["index"] = &schemas.Shape{Type: "integer"}
		data.Properties["item_name"] = &schemas.Shape{Type: "string"}
		data.Required["item"], data.Required["index"], data.Required["item_name"] = true, true, true
	} else {
		data = templateDataShape(def, schemas.Intersect(state, schemas.ShapeOf(s.InputSchema)))
	}
	ps := checkSources(templateSources(s, base), data)
	for j := range s.Tools {
		// A tool call's templates see its arguments as .args (and .item).
		t := &s.Tools[j]
		td := templateDataShape(def, state)
		args := schemas.ShapeOf(t.InputSchema)
		td.Properties["args"], td.Properties["item"] = args, args
		td.Properties["tool_call_id"] = &schemas.Shape{Type: "string"}
		td.Required["args"], td.Required["item"], td.Required["tool_call_id"] = true, true, true
		ps = append(ps, checkSources(templateSources(schemas.ToolStep(s, t), fmt.Sprintf("%s/tools/%d", base, j)), td)...)
	}
	return ps
}

// templateSources returns the templates of s (its idempotency_key and
// the settings its kind renders), at JSON Pointers under base.
func templateSources(s *schemas.Step, base string) []templateSource {
	var sources []templateSource
	if s.IdempotencyKey != "" {
		sources = append(sources, templateSource{ptr: base + "/idempotency_key", text: s.IdempotencyKey})
	}
	if pats := templatePaths[s.Kind]; len(pats) > 0 && len(s.With) > 0 {
		dec := json.NewDecoder(bytes.NewReader(s.With))
		dec.UseNumber()
		var with any
		if dec.Decode(&with) == nil {
			collectTemplates(with, "", pats, func(ptr, text string) {
				sources = append(sources, templateSource{ptr: base + "/with" + ptr, text: text})
			})
		}
	}
	return sources
}

// checkSources checks the field chains of sources against data.
func checkSources(sources []templateSource, data *schemas.Shape) []schemas.Problem {
	var ps []schemas.Problem
	for _, src := range sources {
		t, err := template.New(src.ptr).Option("missingkey=error").Funcs(templateFuncs(nil)).Parse(src.text)
		if err != nil {
			continue
		}
		ps = append(ps, checkReads(src.ptr, src.text, TemplateReads(t), data)...)
	}
	return ps
}

type templateSource struct{ ptr, text string }

// collectTemplates calls fn for every string of v, at JSON Pointer ptr,
// that a pattern of pats matches and that holds an action ("{{").
func collectTemplates(v any, ptr string, pats []string, fn func(ptr, text string)) {
	switch v := v.(type) {
	case string:
		if strings.Contains(v, "{{") && matchesAny(ptr, pats) {
			fn(ptr, v)
		}
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			collectTemplates(v[k], ptr+"/"+strings.ReplaceAll(strings.ReplaceAll(k, "~", "~0"), "/", "~1"), pats, fn)
		}
	case []any:
		for i, x := range v {
			collectTemplates(x, ptr+"/"+strconv.Itoa(i), pats, fn)
		}
	}
}

func matchesAny(ptr string, pats []string) bool {
	toks := strings.Split(strings.TrimPrefix(ptr, "/"), "/")
	for _, p := range pats {
		if matchTokens(toks, strings.Split(strings.TrimPrefix(p, "/"), "/")) {
			return true
		}
	}
	return false
}

func matchTokens(toks, pat []string) bool {
	switch {
	case len(pat) == 0:
		return len(toks) == 0
	case pat[0] == "**":
		for i := 0; i <= len(toks); i++ {
			if matchTokens(toks[i:], pat[1:]) {
				return true
			}
		}
		return false
	case len(toks) == 0:
		return false
	case pat[0] == "*" || pat[0] == toks[0]:
		return matchTokens(toks[1:], pat[1:])
	}
	return false
}

// templateDataShape is the shape of Call.TemplateData for a state shape.
func templateDataShape(def *schemas.Definition, state *schemas.Shape) *schemas.Shape {
	vars := &schemas.Shape{Type: "object", Closed: true, Properties: map[string]*schemas.Shape{}, Required: map[string]bool{}}
	for k := range def.Vars {
		vars.Properties[k] = &schemas.Shape{Type: "string"}
		vars.Required[k] = true
	}
	str := &schemas.Shape{Type: "string"}
	return &schemas.Shape{Type: "object", Closed: true,
		Properties: map[string]*schemas.Shape{"state": state, "vars": vars, "job": str, "step": str, "idempotency_key": str, "attempt": {Type: "integer"}},
		Required:   map[string]bool{"state": true, "vars": true, "job": true, "step": true, "idempotency_key": true, "attempt": true}}
}

// checkReads checks reads against data: errors for what cannot exist, one
// warning for the members that cannot be checked and one for those that
// may be absent.
func checkReads(ptr, text string, reads []TemplateRead, data *schemas.Shape) []schemas.Problem {
	var ps []schemas.Problem
	var open, optional []string
	seen := map[string]bool{}
	for _, r := range reads {
		name := r.String()
		if seen[name] {
			continue
		}
		seen[name] = true
		s := data
		for k, f := range r.Chain {
			so := TemplateRead{Chain: r.Chain[:k+1]}.String()
			if f == elem {
				if s != nil && s.Type != "" && s.Type != "array" && !s.IsObject() {
					ps = append(ps, schemas.Problem{Path: ptr, Message: fmt.Sprintf("template ranges over %s, which is of type %s", TemplateRead{Chain: r.Chain[:k]}, s.Type)})
					break
				}
				if s.IsObject() {
					s = nil // ranging over an object gives its values
				} else if s != nil {
					s = s.Items
				}
				continue
			}
			m := s.Lookup(f)
			if m.Impossible != "" {
				why := "it cannot exist: " + m.Impossible
				switch {
				case k == 0:
					why = "templates see .state, .vars, .job, .step, .attempt and .idempotency_key"
				case r.Chain[0] == "vars" && k == 1:
					why = fmt.Sprintf("the workflow declares no var %q (vars:)", f)
				}
				line := 1 + strings.Count(text[:min(max(r.Pos, 0), len(text))], "\n")
				ps = append(ps, schemas.Problem{Path: ptr, Message: fmt.Sprintf("template line %d reads %s: %s", line, so, why)})
				break
			}
			if !m.Declared && !m.Required {
				open = append(open, so)
				break
			}
			if !m.Required {
				optional = append(optional, so)
			}
			s = m.Shape
		}
	}
	if len(open) > 0 {
		ps = append(ps, schemas.Problem{Path: ptr, Warning: true, Message: fmt.Sprintf(
			"%s cannot be checked at load: the schemas leave %s open (declare %s in state_schema, or in the output_schema of the step that saves %s, with additionalProperties: false)",
			strings.Join(open, ", "), pronoun(open), pronoun(open), pronoun(open))})
	}
	if len(optional) > 0 {
		ps = append(ps, schemas.Problem{Path: ptr, Warning: true, Message: fmt.Sprintf(
			"%s may be absent (declared, but not required, and no step saves %s): the template then fails the step (missingkey=error); make %s required, or read %s with index",
			strings.Join(optional, ", "), pronoun(optional), pronoun(optional), pronoun(optional))})
	}
	return ps
}

func pronoun(xs []string) string {
	if len(xs) == 1 {
		return "it"
	}
	return "them"
}
