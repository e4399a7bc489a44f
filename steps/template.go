package steps

import (
	"fmt"
	"net/url"
	"strings"
	"text/template"
	"text/template/parse"
)

// stepTemplate is a step template that may read secrets ({{secret "NAME"}}),
// with the names it reads. The names are written out in the definition,
// never computed, so a worker knows before rendering which secrets a call
// needs, and a workflow cannot pick a secret by data.
type stepTemplate struct {
	t       *template.Template
	secrets []string // names of the secrets it reads, without repeats
}

// parseSecretTemplate parses text as a step template in which secret may
// be called, as {{secret "NAME"}} with the name written out. Use it only
// for text that goes into a request and nowhere else (an http step's url,
// headers and body); the rendered text must never be stored.
func parseSecretTemplate(name, text string, env *Env) (*stepTemplate, error) {
	t, err := newTemplate(name, text, env)
	if err != nil {
		return nil, err
	}
	names, err := secretCalls(t)
	if err != nil {
		return nil, fmt.Errorf("template %s: %w", name, err)
	}
	return &stepTemplate{t: t, secrets: names}, nil
}

// execute renders st over data for call c: the secrets it reads are
// resolved from env now and remembered by c for scrubbing. Errors from the
// secret sources are returned as they are (non-retryable, not performed).
func (st *stepTemplate) execute(c *Call, env *Env, data any) (string, error) {
	t := st.t
	if len(st.secrets) > 0 {
		vals := make(map[string]string, len(st.secrets))
		for _, n := range st.secrets {
			v, err := c.secretFrom(env, n)
			if err != nil {
				return "", err
			}
			vals[n] = v
		}
		// Bind this call's values on a copy: the parsed template is shared
		// by concurrent calls.
		clone, err := t.Clone()
		if err != nil {
			return "", fmt.Errorf("render %s: %w", t.Name(), err)
		}
		t = clone.Funcs(template.FuncMap{"secret": func(n string) string { return vals[n] }})
	}
	return render(t, data)
}

// secretFunc is secret outside a call: it never runs, because a template
// that calls secret is rendered only through stepTemplate.execute.
func secretFunc(name string) (string, error) {
	return "", fmt.Errorf("secret %q: secrets are resolved only when a worker makes the call", name)
}

// secretCalls returns the names t reads with secret, checking that every
// use is {{secret "NAME"}}: the first command of its pipeline, with one
// string literal argument that is a valid name.
func secretCalls(t *template.Template) ([]string, error) {
	var names []string
	seen := map[string]bool{}
	var bad error
	for _, tt := range t.Templates() {
		if tt.Tree == nil || tt.Tree.Root == nil {
			continue
		}
		tree := tt.Tree
		walkPipes(tree.Root, func(p *parse.PipeNode) {
			for i, cmd := range p.Cmds {
				for j, arg := range cmd.Args {
					id, ok := arg.(*parse.IdentifierNode)
					if !ok || id.Ident != "secret" || bad != nil {
						continue
					}
					where, _ := tree.ErrorContext(id)
					if j != 0 || i != 0 || len(cmd.Args) != 2 {
						bad = fmt.Errorf("%s: call secret as {{secret \"NAME\"}}, with the name written out and nothing piped into it", where)
						continue
					}
					s, ok := cmd.Args[1].(*parse.StringNode)
					if !ok {
						bad = fmt.Errorf("%s: the name given to secret must be written out as a string (%s); a name computed from data could pick any secret", where, cmd.Args[1])
						continue
					}
					if err := CheckSecretName(s.Text); err != nil {
						bad = fmt.Errorf("%s: %w", where, err)
						continue
					}
					if !seen[s.Text] {
						seen[s.Text] = true
						names = append(names, s.Text)
					}
				}
			}
		})
	}
	return names, bad
}

// walkPipes calls fn for every pipeline in the tree under n, including
// those of branch conditions and parenthesised arguments.
func walkPipes(n parse.Node, fn func(*parse.PipeNode)) {
	switch n := n.(type) {
	case *parse.ListNode:
		if n == nil {
			return
		}
		for _, c := range n.Nodes {
			walkPipes(c, fn)
		}
	case *parse.ActionNode:
		walkPipes(n.Pipe, fn)
	case *parse.IfNode:
		walkBranch(&n.BranchNode, fn)
	case *parse.RangeNode:
		walkBranch(&n.BranchNode, fn)
	case *parse.WithNode:
		walkBranch(&n.BranchNode, fn)
	case *parse.TemplateNode:
		walkPipes(n.Pipe, fn)
	case *parse.PipeNode:
		if n == nil {
			return
		}
		fn(n)
		for _, cmd := range n.Cmds {
			for _, a := range cmd.Args {
				walkPipes(a, fn)
			}
		}
	case *parse.ChainNode:
		walkPipes(n.Node, fn)
	}
}

func walkBranch(b *parse.BranchNode, fn func(*parse.PipeNode)) {
	walkPipes(b.Pipe, fn)
	walkPipes(b.List, fn)
	walkPipes(b.ElseList, fn)
}

// endsInJSON reports whether the pipeline's value is the json function's:
// {{json .x}} or {{.x | json}}.
func endsInJSON(p *parse.PipeNode) bool {
	if p == nil || len(p.Cmds) == 0 {
		return false
	}
	last := p.Cmds[len(p.Cmds)-1]
	id, ok := last.Args[0].(*parse.IdentifierNode)
	return ok && id.Ident == "json"
}

// outputsJSON returns the first action under n that prints the json
// function's value, or nil.
func outputsJSON(n parse.Node) *parse.ActionNode {
	var found *parse.ActionNode
	walkActions(n, func(a *parse.ActionNode) {
		if found == nil && len(a.Pipe.Decl) == 0 && endsInJSON(a.Pipe) {
			found = a
		}
	})
	return found
}

// walkActions calls fn for every action under n that prints (inside the
// bodies of if, range and with too, not their conditions).
func walkActions(n parse.Node, fn func(*parse.ActionNode)) {
	switch n := n.(type) {
	case *parse.ListNode:
		if n == nil {
			return
		}
		for _, c := range n.Nodes {
			walkActions(c, fn)
		}
	case *parse.ActionNode:
		fn(n)
	case *parse.IfNode:
		walkActions(n.List, fn)
		walkActions(n.ElseList, fn)
	case *parse.RangeNode:
		walkActions(n.List, fn)
		walkActions(n.ElseList, fn)
	case *parse.WithNode:
		walkActions(n.List, fn)
		walkActions(n.ElseList, fn)
	}
}

// urlPart percent-encodes everything but the unreserved characters of
// RFC 3986 (section 2.3: letters, digits, '-', '.', '_', '~'), so a value
// stands as one path segment or one query value, whatever it holds.
func urlPart(v any) string {
	s := fmt.Sprint(v)
	if s == "." || s == ".." {
		// A dot segment would move the request up the path (RFC 3986
		// section 5.2.4); checkDotSegments refuses the URL anyway.
		return strings.Repeat("%2E", len(s))
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '-', c == '.', c == '_', c == '~':
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// urlPartCmd is the command "urlpart" of a pipeline, to append to others.
var urlPartCmd = func() *parse.CommandNode {
	t := template.Must(template.New("urlpart").Funcs(template.FuncMap{"urlpart": urlPart}).Parse("{{. | urlpart}}"))
	return t.Tree.Root.Nodes[0].(*parse.ActionNode).Pipe.Cmds[1]
}()

// escapeURLActions makes every value a URL template prints go through
// urlpart, so that data cannot add a query parameter, a fragment or a path
// segment: {{.state.title}} with "a&admin=1" prints "a%26admin%3D1". The
// base URL from service, values piped into raw (the template's author
// vouches for them) and urlquery's output print as they are.
func escapeURLActions(t *template.Template) {
	escape := func(n *parse.ActionNode) {
		p := n.Pipe
		if p == nil || len(p.Decl) > 0 || len(p.Cmds) == 0 {
			return
		}
		if id, ok := p.Cmds[len(p.Cmds)-1].Args[0].(*parse.IdentifierNode); ok {
			switch id.Ident {
			case "service", "raw", "urlquery", "urlpart":
				return
			}
		}
		p.Cmds = append(p.Cmds, urlPartCmd)
	}
	for _, tt := range t.Templates() {
		if tt.Tree != nil {
			walkActions(tt.Tree.Root, escape)
		}
	}
}

// checkDotSegments refuses a rendered URL whose path holds a "." or ".."
// segment, written plainly or percent-encoded: a server that resolves it
// (RFC 3986 section 5.2.4) would answer for another path than the
// template's. Authors write none; only data can bring one.
func checkDotSegments(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return nil // the request refuses it, without echoing the URL's query
	}
	for _, seg := range strings.Split(u.EscapedPath(), "/") {
		dec, err := url.PathUnescape(seg)
		if err != nil {
			dec = seg
		}
		if dec == "." || dec == ".." {
			return fmt.Errorf("url %s: path segment %q: a dot segment would send the request to another path (write the URL without one; a template value may not make one)", redactURL(raw), dec)
		}
	}
	return nil
}

// parseURLTemplate is parseSecretTemplate for a URL: every value it prints
// is escaped (escapeURLActions).
func parseURLTemplate(name, text string, env *Env) (*stepTemplate, error) {
	st, err := parseSecretTemplate(name, text, env)
	if err != nil {
		return nil, err
	}
	escapeURLActions(st.t)
	return st, nil
}
