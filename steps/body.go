package steps

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"text/template/parse"
)

// This file builds the JSON body of an http step so that data can never
// add structure to it: a title in state holding `", "amount": 1` arrives
// as that string, not as a field.
//
// A body written as YAML (or JSON) is a JSON value whose string leaves are
// templates. A leaf's rendering is inserted as one JSON string, escaped;
// a leaf that is exactly one action ending in json ('{{json .state.amount}}')
// inserts that value itself, typed (a number, an object ...), encoded by
// the json function, so it cannot carry structure that is not in the data's
// own shape. json anywhere else in a leaf is refused at load: the author
// meant one of the two and Waymark cannot tell which. Object keys are
// literal.
//
// A body written as one string (the form of earlier versions, still in
// pinned definitions) is JSON text with actions in it. Each action is
// escaped by where it stands: inside a string literal its text is escaped
// as string content; where a value belongs, it must end in json (the
// value, typed) or print a number, true, false or null (checked when the
// call is made). An action anywhere else (an object key, after a value,
// inside an escape sequence) and control actions ({{if}}, {{range}}) are
// refused at load, naming the action and where it is.

// body renders an http step's request body.
type body interface {
	render(c *Call, env *Env, data map[string]any) ([]byte, error)
}

// compileBody compiles with.body of step id: a JSON string is a string
// body, anything else a structured one.
func compileBody(id string, raw json.RawMessage, env *Env) (body, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, nil
	}
	if raw[0] == '"' {
		var text string
		if err := json.Unmarshal(raw, &text); err != nil {
			return nil, fmt.Errorf("with.body: %w", err)
		}
		return compileStringBody(id, text, env)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	n, err := compileNode(dec, id, "body", env)
	if err != nil {
		return nil, err
	}
	return n, nil
}

// node is one part of a structured body.
type node interface {
	body
	write(b *bytes.Buffer, c *Call, env *Env, data map[string]any) error
}

type literalNode []byte // JSON as written

type objectNode struct {
	keys [][]byte // encoded
	vals []node
}

type arrayNode []node

// leafNode is a string leaf with actions.
type leafNode struct {
	t     *stepTemplate
	path  string
	typed bool // the leaf is one action ending in json: insert its value
}

func renderNode(n node, c *Call, env *Env, data map[string]any) ([]byte, error) {
	var b bytes.Buffer
	if err := n.write(&b, c, env, data); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

func (n literalNode) render(c *Call, env *Env, data map[string]any) ([]byte, error) {
	return renderNode(n, c, env, data)
}
func (n *objectNode) render(c *Call, env *Env, data map[string]any) ([]byte, error) {
	return renderNode(n, c, env, data)
}
func (n arrayNode) render(c *Call, env *Env, data map[string]any) ([]byte, error) {
	return renderNode(n, c, env, data)
}
func (n *leafNode) render(c *Call, env *Env, data map[string]any) ([]byte, error) {
	return renderNode(n, c, env, data)
}

func (n literalNode) write(b *bytes.Buffer, _ *Call, _ *Env, _ map[string]any) error {
	b.Write(n)
	return nil
}

func (n *objectNode) write(b *bytes.Buffer, c *Call, env *Env, data map[string]any) error {
	b.WriteByte('{')
	for i, k := range n.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		b.Write(k)
		b.WriteByte(':')
		if err := n.vals[i].write(b, c, env, data); err != nil {
			return err
		}
	}
	b.WriteByte('}')
	return nil
}

func (n arrayNode) write(b *bytes.Buffer, c *Call, env *Env, data map[string]any) error {
	b.WriteByte('[')
	for i, v := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		if err := v.write(b, c, env, data); err != nil {
			return err
		}
	}
	b.WriteByte(']')
	return nil
}

func (n *leafNode) write(b *bytes.Buffer, c *Call, env *Env, data map[string]any) error {
	s, err := n.t.execute(c, env, data)
	if err != nil {
		return err
	}
	if !n.typed {
		b.Write(encodeJSONString(s))
		return nil
	}
	// The json function's output: one valid value. Checked all the same,
	// as the one place a rendering goes into the body unescaped.
	if !json.Valid([]byte(s)) {
		return fmt.Errorf("%s: the json action did not render one JSON value", n.path)
	}
	b.WriteString(s)
	return nil
}

var plainKeyRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_-]*$`)

func keyPath(path, key string) string {
	if plainKeyRE.MatchString(key) {
		return path + "." + key
	}
	return path + "[" + strconv.Quote(key) + "]"
}

// compileNode reads one JSON value from dec; path names it in errors
// ("body.items[2].name").
func compileNode(dec *json.Decoder, id, path string, env *Env) (node, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("with.%s: %w", path, err)
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			obj := &objectNode{}
			seen := map[string]bool{}
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, fmt.Errorf("with.%s: %w", path, err)
				}
				key, _ := kt.(string)
				if strings.Contains(key, "{{") {
					return nil, fmt.Errorf("with.%s: key %q: object keys are written as they are, never templates (a key from data could add a field the workflow never wrote)", path, key)
				}
				if seen[key] {
					return nil, fmt.Errorf("with.%s: key %q appears twice", path, key)
				}
				seen[key] = true
				val, err := compileNode(dec, id, keyPath(path, key), env)
				if err != nil {
					return nil, err
				}
				obj.keys = append(obj.keys, encodeJSONString(key))
				obj.vals = append(obj.vals, val)
			}
			if _, err := dec.Token(); err != nil {
				return nil, fmt.Errorf("with.%s: %w", path, err)
			}
			return obj, nil
		case '[':
			var arr arrayNode
			for i := 0; dec.More(); i++ {
				val, err := compileNode(dec, id, fmt.Sprintf("%s[%d]", path, i), env)
				if err != nil {
					return nil, err
				}
				arr = append(arr, val)
			}
			if _, err := dec.Token(); err != nil {
				return nil, fmt.Errorf("with.%s: %w", path, err)
			}
			if arr == nil {
				arr = arrayNode{}
			}
			return arr, nil
		}
		return nil, fmt.Errorf("with.%s: unexpected %v", path, v)
	case string:
		return compileLeaf(id, path, v, env)
	case json.Number:
		return literalNode(v.String()), nil
	case bool:
		return literalNode(strconv.FormatBool(v)), nil
	case nil:
		return literalNode("null"), nil
	}
	return nil, fmt.Errorf("with.%s: unexpected token %v", path, tok)
}

// compileLeaf compiles one string leaf of a structured body.
func compileLeaf(id, path, text string, env *Env) (node, error) {
	if !strings.Contains(text, "{{") {
		return literalNode(encodeJSONString(text)), nil
	}
	st, err := parseSecretTemplate(id+"."+path, text, env)
	if err != nil {
		return nil, err
	}
	leaf := &leafNode{t: st, path: path}
	root := st.t.Tree.Root
	if len(root.Nodes) == 1 && len(st.t.Templates()) == 1 {
		if a, ok := root.Nodes[0].(*parse.ActionNode); ok && len(a.Pipe.Decl) == 0 && endsInJSON(a.Pipe) {
			leaf.typed = true
			return leaf, nil
		}
	}
	if a := outputsJSON(root); a != nil {
		return nil, fmt.Errorf("with.%s: %s inserts a typed value only when it is the whole string; here it is mixed with other text, where it would become JSON text inside a string. Write the leaf as exactly '%s', or build a string without json", path, a, a)
	}
	return leaf, nil
}

// stringBody is a body written as one JSON text with actions in it.
type stringBody struct {
	path string // "body", for errors
	segs []segment
}

type segKind int

const (
	segText     segKind = iota // literal JSON text
	segInString                // an action inside a string literal: escaped as its content
	segJSON                    // an action where a value belongs, ending in json
	segScalar                  // an action where a value belongs: must print a number, true, false or null
)

type segment struct {
	kind   segKind
	text   string        // segText
	t      *stepTemplate // actions
	action string        // the action as written, for errors
	where  string        // its position, for errors
}

// compileStringBody checks where each action of text stands in the JSON
// around it, and refuses any it cannot insert safely.
func compileStringBody(id, text string, env *Env) (body, error) {
	name := id + ".body"
	st, err := parseSecretTemplate(name, text, env)
	if err != nil {
		return nil, err
	}
	if len(st.t.Templates()) > 1 {
		return nil, fmt.Errorf("with.body: {{define}} and {{block}} are not allowed in a body; write the body as YAML, whose string leaves are templates")
	}
	sb := &stringBody{path: "body"}
	lex := &jsonLexer{}
	tree := st.t.Tree
	actions := 0
	for _, n := range tree.Root.Nodes {
		switch n := n.(type) {
		case *parse.TextNode:
			lex.feed(n.Text)
			sb.segs = append(sb.segs, segment{kind: segText, text: string(n.Text)})
		case *parse.CommentNode:
		case *parse.ActionNode:
			actions++
			where, _ := tree.ErrorContext(n)
			if len(n.Pipe.Decl) > 0 {
				return nil, fmt.Errorf("with.body: %s at %s: variables are not allowed in a string body; write the body as YAML, whose string leaves are templates", n, where)
			}
			kind, err := lex.action(endsInJSON(n.Pipe))
			if err != nil {
				return nil, fmt.Errorf("with.body: %s at %s %w", n, where, err)
			}
			at, err := parseSecretTemplate(name, n.String(), env)
			if err != nil {
				return nil, err
			}
			sb.segs = append(sb.segs, segment{kind: kind, t: at, action: n.String(), where: where})
		default:
			where, _ := tree.ErrorContext(n)
			return nil, fmt.Errorf("with.body: %s at %s: a string body takes plain actions only ({{.state.x}}, {{json .state.x}}, {{secret \"NAME\"}}); for {{if}}, {{range}} and {{with}} write the body as YAML, whose string leaves are templates", n, where)
		}
	}
	if actions > 0 && lex.state != lexDone {
		return nil, fmt.Errorf("with.body: the text around the actions is not one complete JSON value, whatever they print")
	}
	if actions == 0 {
		var b strings.Builder
		for _, s := range sb.segs {
			b.WriteString(s.text)
		}
		if !json.Valid([]byte(b.String())) {
			var v any
			err := json.Unmarshal([]byte(b.String()), &v)
			return nil, fmt.Errorf("with.body is not JSON: %v", err)
		}
	}
	return sb, nil
}

func (sb *stringBody) render(c *Call, env *Env, data map[string]any) ([]byte, error) {
	var b bytes.Buffer
	for _, s := range sb.segs {
		if s.kind == segText {
			b.WriteString(s.text)
			continue
		}
		out, err := s.t.execute(c, env, data)
		if err != nil {
			return nil, err
		}
		switch s.kind {
		case segInString:
			enc := encodeJSONString(out)
			b.Write(enc[1 : len(enc)-1])
		case segJSON:
			if !json.Valid([]byte(out)) {
				return nil, fmt.Errorf("with.body: %s at %s did not render one JSON value", s.action, s.where)
			}
			b.WriteString(out)
		case segScalar:
			if !isJSONScalar(out) {
				// The rendering is not quoted: it may hold anything.
				return nil, fmt.Errorf("with.body: %s at %s stands where a JSON value belongs, so it must print a number, true, false or null; it printed something else. Write {{json …}} to insert a value of any type", s.action, s.where)
			}
			b.WriteString(strings.TrimSpace(out))
		}
	}
	if !json.Valid(b.Bytes()) {
		var v any
		err := json.Unmarshal(b.Bytes(), &v)
		return nil, fmt.Errorf("with.body: the rendered body is not JSON (%v); the text around its actions must be", err)
	}
	return b.Bytes(), nil
}

// isJSONScalar reports whether s is one JSON number, true, false or null.
func isJSONScalar(s string) bool {
	s = strings.TrimSpace(s)
	if s == "" || !json.Valid([]byte(s)) {
		return false
	}
	return s == "true" || s == "false" || s == "null" || s[0] == '-' || (s[0] >= '0' && s[0] <= '9')
}

// jsonLexer follows the structure of JSON text given piece by piece, to
// tell where an action between the pieces stands. It does not validate:
// the rendered body is checked whole. Once it meets something that is not
// JSON it stops, and every later action is refused.
type jsonLexer struct {
	stack  []byte // open '{' and '['
	state  lexState
	keyStr bool // the string being read is an object key
	uni    int  // hex digits left in a \u escape
}

type lexState int

const (
	lexValue        lexState = iota // a value belongs here
	lexValueOrClose                 // just after '['
	lexKey                          // an object key belongs here (after ',')
	lexKeyOrClose                   // just after '{'
	lexColon                        // after a key
	lexAfter                        // after a value: ',' or a close
	lexLiteral                      // inside a number, true, false or null
	lexString                       // inside a string
	lexEscape                       // after '\' in a string
	lexUnicode                      // inside \uXXXX
	lexDone                         // the top-level value is complete
	lexBroken                       // not JSON
)

func (l *jsonLexer) afterValue() {
	if len(l.stack) == 0 {
		l.state = lexDone
	} else {
		l.state = lexAfter
	}
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func (l *jsonLexer) feed(text []byte) {
	for i := 0; i < len(text); i++ {
		c := text[i]
		switch l.state {
		case lexBroken:
			return
		case lexString:
			switch {
			case c == '\\':
				l.state = lexEscape
			case c == '"':
				if l.keyStr {
					l.state = lexColon
				} else {
					l.afterValue()
				}
			case c < 0x20:
				l.state = lexBroken
			}
			continue
		case lexEscape:
			switch {
			case c == 'u':
				l.state, l.uni = lexUnicode, 4
			case strings.IndexByte(`"\/bfnrt`, c) >= 0:
				l.state = lexString
			default:
				l.state = lexBroken
			}
			continue
		case lexUnicode:
			if !isHex(c) {
				l.state = lexBroken
				continue
			}
			if l.uni--; l.uni == 0 {
				l.state = lexString
			}
			continue
		case lexLiteral:
			if isLiteralByte(c) {
				continue
			}
			l.afterValue()
		}
		if isSpace(c) {
			continue
		}
		switch l.state {
		case lexValue, lexValueOrClose:
			switch {
			case c == '{':
				l.stack = append(l.stack, '{')
				l.state = lexKeyOrClose
			case c == '[':
				l.stack = append(l.stack, '[')
				l.state = lexValueOrClose
			case c == '"':
				l.state, l.keyStr = lexString, false
			case c == '-' || (c >= '0' && c <= '9') || c == 't' || c == 'f' || c == 'n':
				l.state = lexLiteral
			case c == ']' && l.state == lexValueOrClose:
				l.close()
			default:
				l.state = lexBroken
			}
		case lexKey, lexKeyOrClose:
			switch {
			case c == '"':
				l.state, l.keyStr = lexString, true
			case c == '}' && l.state == lexKeyOrClose:
				l.close()
			default:
				l.state = lexBroken
			}
		case lexColon:
			if c == ':' {
				l.state = lexValue
			} else {
				l.state = lexBroken
			}
		case lexAfter:
			top := l.stack[len(l.stack)-1]
			switch {
			case c == ',' && top == '{':
				l.state = lexKey
			case c == ',' && top == '[':
				l.state = lexValue
			case (c == '}' && top == '{') || (c == ']' && top == '['):
				l.close()
			default:
				l.state = lexBroken
			}
		default: // lexDone
			l.state = lexBroken
		}
	}
}

func (l *jsonLexer) close() {
	l.stack = l.stack[:len(l.stack)-1]
	l.afterValue()
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

func isLiteralByte(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '.' || c == '+' || c == '-' || c == 'E'
}

// action classifies an action at the current position, and moves past it.
// The error completes "ACTION at POSITION ...".
func (l *jsonLexer) action(jsonValue bool) (segKind, error) {
	switch l.state {
	case lexString:
		if l.keyStr {
			return 0, errors.New("is inside an object key: keys are written as they are, never templates (a key from data could add a field the workflow never wrote)")
		}
		if jsonValue {
			return 0, errors.New("is inside a string, where it would insert JSON text into the string; remove the quotes around it to insert the value itself")
		}
		return segInString, nil
	case lexValue, lexValueOrClose:
		l.afterValue()
		if jsonValue {
			return segJSON, nil
		}
		return segScalar, nil
	case lexLiteral:
		return 0, errors.New("joins the value written before it; put it where a whole value belongs, or inside a string")
	case lexEscape, lexUnicode:
		return 0, errors.New("follows a backslash inside a string: it would complete an escape sequence")
	case lexKey, lexKeyOrClose:
		return 0, errors.New("stands where an object key belongs: keys are written as they are, never templates")
	case lexColon, lexAfter, lexDone:
		return 0, errors.New("follows a complete value; a ',' or ':' is missing before it")
	}
	return 0, errors.New("follows text that is not JSON")
}
