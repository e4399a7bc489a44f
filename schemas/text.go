package schemas

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/goccy/go-yaml"
	"github.com/goccy/go-yaml/ast"
	"github.com/goccy/go-yaml/parser"
	"github.com/goccy/go-yaml/token"
)

// TextError says where a JSON document holds a string that is not Unicode
// text: bytes that are not UTF-8, or a \u escape of a UTF-16 surrogate
// (U+D800 to U+DFFF) without its other half. Decoders (encoding/json among
// them) replace either with U+FFFD without a word, so what a job would keep
// is not what was sent, and a raw copy passed on unchanged breaks the next
// reader. RFC 8259 requires UTF-8 between systems (section 8.1) and leaves
// lone surrogates' behaviour unpredictable (section 8.2); Waymark refuses
// both, at the first place found.
type TextError struct {
	// Path is the JSON Pointer (RFC 6901) of the string at fault: a value,
	// or the member whose name is at fault (Key). Names in the path are
	// decoded with U+FFFD for what could not be.
	Path string `json:"path"`
	// Offset is the byte offset of the bad sequence in the document.
	Offset int `json:"offset"`
	// Key is true when the bad text is in a member's name, not its value.
	Key bool `json:"key,omitempty"`
	// Reason says what is wrong: "invalid UTF-8 byte 0xff", or
	// `\ud800 is one half of a UTF-16 surrogate pair, without the other`.
	Reason string `json:"reason"`
}

// Error gives "at /path: reason (byte N); ...".
func (e *TextError) Error() string {
	at := e.Path
	if at == "" {
		at = "/"
	}
	what := e.Reason
	if e.Key {
		what = "the member name holds " + what
	}
	return fmt.Sprintf("at %s: %s (byte %d); text must be UTF-8 without lone surrogates", at, what, e.Offset)
}

// Problem returns e as a loader Problem (path and message).
func (e *TextError) Problem() Problem {
	what := e.Reason
	if e.Key {
		what = "the member name holds " + what
	}
	return Problem{Path: e.Path, Message: what + "; text must be UTF-8 without lone surrogates"}
}

// CheckJSONText reports the first string (value or member name) of the
// JSON document data that is not Unicode text: invalid UTF-8, or a \u
// escape of a lone surrogate. It returns nil for clean text, else a
// *Error of CodeInputInvalid (errors.Is(err, ErrInputInvalid)) whose
// cause is a *TextError carrying the path and byte offset. Data that is
// not JSON at all is CodeInputInvalid too, without a TextError: callers
// that want a syntax error's position decode first. Clean documents cost
// one pass of utf8.Valid and a search for `\u`; only a suspect one is
// walked.
func CheckJSONText(data []byte) error {
	if utf8.Valid(data) && !hasSurrogateEscape(data) {
		return nil
	}
	if !json.Valid(data) {
		return Errorf(CodeInputInvalid, "not valid JSON")
	}
	if te := findBadText(data); te != nil {
		return (&Error{Code: CodeInputInvalid, Message: te.Error()}).WithCause(te)
	}
	return nil // a false alarm: `\\ud800` is a backslash and text
}

// CheckStringsText reports the first name or value of m (such as a job's
// vars), in name order, that is not UTF-8: a *Error of CodeInputInvalid
// whose cause is a *TextError at prefix + "/" + name (prefix is a JSON
// Pointer such as "/vars", or ""), with Offset the byte offset in the name
// or value. A Go string cannot hold a lone surrogate, only its UTF-8-like
// encoding, which is invalid UTF-8 and reported as such.
func CheckStringsText(prefix string, m map[string]string) error {
	for _, k := range sortedKeys(m) {
		for _, s := range []struct {
			text string
			key  bool
		}{{k, true}, {m[k], false}} {
			if off, b, ok := firstInvalidUTF8(s.text); !ok {
				te := &TextError{Path: prefix + "/" + escapePointer(strings.ToValidUTF8(k, "\uFFFD")), Offset: off, Key: s.key,
					Reason: fmt.Sprintf("invalid UTF-8 byte 0x%02x", b)}
				return (&Error{Code: CodeInputInvalid, Message: te.Error()}).WithCause(te)
			}
		}
	}
	return nil
}

// firstInvalidUTF8 returns the offset and value of s's first byte that
// does not start a UTF-8 sequence, and false; or true when s is UTF-8.
func firstInvalidUTF8(s string) (int, byte, bool) {
	if utf8.ValidString(s) {
		return 0, 0, true
	}
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			return i, s[i], false
		}
		i += size
	}
	return 0, 0, true
}

// hasSurrogateEscape reports whether data holds `\u` or `\U` followed by
// the hex digits of a surrogate (D800 to DFFF, \U with four zeros first),
// wherever it is: a quick filter, so `\\ud800` counts too.
func hasSurrogateEscape(data []byte) bool {
	for i := 0; ; {
		j := bytes.IndexByte(data[i:], '\\')
		if j < 0 {
			return false
		}
		i += j + 1
		if i < len(data) {
			if _, ok := surrogateEscape(data[i-1:]); ok {
				return true
			}
		}
	}
}

// surrogateEscape reads the escape at the start of b (`\uXXXX`, or YAML's
// `\UXXXXXXXX`) and returns its code point and whether it is a surrogate.
func surrogateEscape(b []byte) (rune, bool) {
	n := 0
	switch {
	case len(b) >= 6 && b[0] == '\\' && b[1] == 'u':
		n = 4
	case len(b) >= 10 && b[0] == '\\' && b[1] == 'U':
		n = 8
	default:
		return 0, false
	}
	v, err := strconv.ParseUint(string(b[2:2+n]), 16, 32)
	if err != nil {
		return 0, false
	}
	return rune(v), v >= 0xD800 && v <= 0xDFFF
}

// pathFrame is one open object or array of findBadText's walk.
type pathFrame struct {
	obj   bool
	index int    // array: the current element, -1 before the first
	key   string // object: the current member's name
}

func framesPointer(stack []pathFrame) string {
	var b strings.Builder
	for _, f := range stack {
		b.WriteByte('/')
		if f.obj {
			b.WriteString(escapePointer(f.key))
		} else {
			b.WriteString(strconv.Itoa(f.index))
		}
	}
	return b.String()
}

// findBadText walks data, which must be valid JSON, and returns the first
// string that is not Unicode text, or nil.
func findBadText(data []byte) *TextError {
	var stack []pathFrame
	wantKey := false // in an object, before a member's name
	startValue := func() {
		if n := len(stack); n > 0 && !stack[n-1].obj {
			stack[n-1].index++
		}
	}
	for i := 0; i < len(data); {
		switch c := data[i]; c {
		case '{':
			startValue()
			stack = append(stack, pathFrame{obj: true})
			wantKey = true
			i++
		case '[':
			startValue()
			stack = append(stack, pathFrame{index: -1})
			i++
		case '}', ']':
			if len(stack) > 0 {
				stack = stack[:len(stack)-1]
			}
			i++
		case ',':
			wantKey = len(stack) > 0 && stack[len(stack)-1].obj
			i++
		case '"':
			isKey := wantKey && len(stack) > 0 && stack[len(stack)-1].obj
			end, bad, reason := scanJSONString(data, i)
			if isKey {
				var name string
				_ = json.Unmarshal(data[i:end], &name) // lossy, for the path only
				stack[len(stack)-1].key = name
				wantKey = false
			} else {
				startValue()
			}
			if bad >= 0 {
				return &TextError{Path: framesPointer(stack), Offset: bad, Key: isKey, Reason: reason}
			}
			i = end
		case ' ', '\t', '\r', '\n', ':':
			i++
		default: // a number, true, false or null
			startValue()
			for i < len(data) && !strings.ContainsRune(" \t\r\n,:]}", rune(data[i])) {
				i++
			}
		}
	}
	return nil
}

// scanJSONString scans the string whose opening quote is data[i]. It
// returns the offset just past the closing quote and the offset of the
// first bad sequence (-1 for none) with what is wrong.
func scanJSONString(data []byte, i int) (end, bad int, reason string) {
	bad = -1
	for j := i + 1; j < len(data); {
		c := data[j]
		switch {
		case c == '"':
			return j + 1, bad, reason
		case c == '\\':
			if j+1 < len(data) && data[j+1] == 'u' {
				if r, ok := surrogateEscape(data[j:]); ok {
					if r <= 0xDBFF { // a high half: the low half must follow
						if lo, ok := surrogateEscape(data[j+6:]); ok && lo >= 0xDC00 && data[j+7] == 'u' {
							j += 12
							continue
						}
					}
					if bad < 0 {
						bad, reason = j, fmt.Sprintf(`%s is one half of a UTF-16 surrogate pair, without the other`, data[j:j+6])
					}
				}
				j += 6
				continue
			}
			j += 2
		case c < utf8.RuneSelf:
			j++
		default:
			r, size := utf8.DecodeRune(data[j:])
			if r == utf8.RuneError && size == 1 && bad < 0 {
				bad, reason = j, fmt.Sprintf("invalid UTF-8 byte 0x%02x", c)
			}
			j += size
		}
	}
	return len(data), bad, reason
}

// lineColumn returns the 1-based line and column (in runes) of byte off
// of data.
func lineColumn(data []byte, off int) (int, int) {
	off = min(max(off, 0), len(data))
	lineStart := bytes.LastIndexByte(data[:off], '\n') + 1
	return 1 + bytes.Count(data[:off], []byte("\n")), 1 + utf8.RuneCount(data[lineStart:off])
}

// definitionTextProblem finds the first text in a workflow file that is not
// Unicode: invalid UTF-8 anywhere, or an escape of a lone surrogate in a
// JSON string or a YAML double-quoted scalar (YAML 1.2 section 5.7; in
// plain and single-quoted scalars `\ud800` is six characters of text).
// YAML decoders put U+FFFD in their place, which would change the
// definition, its hash and every prompt built from it without a word.
func definitionTextProblem(data []byte, isJSON bool) (LocatedProblem, bool) {
	if utf8.Valid(data) && !hasSurrogateEscape(data) {
		return LocatedProblem{}, false
	}
	if isJSON {
		te := findBadText(data) // the caller checked the syntax
		if te == nil {
			return LocatedProblem{}, false
		}
		line, col := lineColumn(data, te.Offset)
		return LocatedProblem{Problem: te.Problem(), Line: line, Column: col}, true
	}
	te := yamlBadText(data)
	if te == nil {
		return LocatedProblem{}, false
	}
	line, col := lineColumn(data, te.Offset)
	return LocatedProblem{Problem: te.Problem(), Line: line, Column: col}, true
}

// yamlBadText returns the first bad text of a YAML file, with the path of
// the node that holds it when the file parses.
func yamlBadText(data []byte) *TextError {
	var found *TextError
	if off, b, ok := firstInvalidUTF8(string(data)); !ok {
		found = &TextError{Offset: off, Reason: fmt.Sprintf("invalid UTF-8 byte 0x%02x", b)}
	}
	// The parser refuses a high surrogate without its pair, at the escape;
	// make each such escape a U+FFFD of the same length, keeping every
	// position, until the file parses (or fails for another reason).
	neutral, cloned := data, false
	var file *ast.File
	for range 64 {
		f, err := parser.ParseBytes(neutral, 0)
		if err == nil {
			file = f
			break
		}
		var ye yaml.Error
		if !errors.As(err, &ye) || !strings.Contains(ye.GetMessage(), "surrogate") || ye.GetToken() == nil || ye.GetToken().Position == nil {
			break
		}
		pos := ye.GetToken().Position
		off := offsetOf(neutral, pos.Line, pos.Column)
		r, ok := surrogateEscape(neutral[min(off, len(neutral)):])
		if !ok {
			break
		}
		if found == nil || off < found.Offset {
			found = &TextError{Offset: off, Reason: surrogateReason(neutral[off:], r)}
		}
		if !cloned {
			neutral, cloned = bytes.Clone(data), true
		}
		digits := neutral[off+2 : off+2+escapeDigits(neutral[off:])]
		copy(digits, "0000FFFD"[8-len(digits):])
	}
	if file != nil {
		// Lone low halves, and \U escapes, parse to U+FFFD: look at the
		// raw text of every double-quoted scalar.
		ast.Walk(visitFunc(func(n ast.Node) {
			s, ok := n.(*ast.StringNode)
			if !ok || s.GetToken() == nil || s.GetToken().Type != token.DoubleQuoteType || s.GetToken().Position == nil {
				return
			}
			pos := s.GetToken().Position
			start := offsetOf(data, pos.Line, pos.Column)
			if start >= len(data) || data[start] != '"' {
				return
			}
			if off, reason := yamlQuotedBadEscape(data, start); off >= 0 && (found == nil || off < found.Offset) {
				found = &TextError{Offset: off, Reason: reason}
			}
		}), file.Docs[0].Body)
	}
	if found != nil && file != nil && len(file.Docs) > 0 {
		line, col := lineColumn(data, found.Offset)
		found.Path = pathAt(file.Docs[0].Body, line, col)
	}
	return found
}

func escapeDigits(b []byte) int {
	if len(b) > 1 && b[1] == 'U' {
		return 8
	}
	return 4
}

func surrogateReason(b []byte, r rune) string {
	return fmt.Sprintf(`%s is one half of a UTF-16 surrogate pair, without the other`, b[:2+escapeDigits(b)])
}

// yamlQuotedBadEscape scans the double-quoted scalar opening at data[start]
// for an escape of a lone surrogate and returns its offset and reason, or
// -1.
func yamlQuotedBadEscape(data []byte, start int) (int, string) {
	for j := start + 1; j < len(data); {
		switch data[j] {
		case '"':
			return -1, ""
		case '\\':
			if r, ok := surrogateEscape(data[j:]); ok {
				if data[j+1] == 'u' && r <= 0xDBFF {
					if lo, ok := surrogateEscape(data[j+6:]); ok && data[j+7] == 'u' && lo >= 0xDC00 {
						j += 12
						continue
					}
				}
				return j, surrogateReason(data[j:], r)
			}
			j += 2
		default:
			j++
		}
	}
	return -1, ""
}

// offsetOf returns the byte offset of a 1-based line and column (in
// runes), or len(data) when they are past it.
func offsetOf(data []byte, line, col int) int {
	off := 0
	for l := 1; l < line; l++ {
		i := bytes.IndexByte(data[off:], '\n')
		if i < 0 {
			return len(data)
		}
		off += i + 1
	}
	for c := 1; c < col && off < len(data) && data[off] != '\n'; c++ {
		_, size := utf8.DecodeRune(data[off:])
		off += size
	}
	return off
}

type visitFunc func(ast.Node)

func (v visitFunc) Visit(n ast.Node) ast.Visitor { v(n); return v }

// pathAt returns the JSON Pointer of the deepest node of the YAML tree
// that starts at or before line:col: the value holding that position, or
// the member whose key does.
func pathAt(n ast.Node, line, col int) string {
	before := func(p token.Position) bool {
		return p.Line > 0 && (p.Line < line || p.Line == line && p.Column <= col)
	}
	path := ""
	for range 1000 { // a bound, not a limit any real file reaches
		switch m := unwrapNode(n).(type) {
		case *ast.MappingNode:
			var pick *ast.MappingValueNode
			for _, mv := range m.Values {
				if before(tokenPosition(mv.Key.GetToken())) {
					pick = mv
				}
			}
			if pick == nil {
				return path
			}
			n = pick
		case *ast.MappingValueNode:
			key := ""
			var k ast.Node = m.Key
			if mk, ok := k.(*ast.MappingKeyNode); ok {
				k = mk.Value
			}
			if sc, ok := unwrapNode(k).(ast.ScalarNode); ok {
				key = fmt.Sprint(sc.GetValue())
			}
			path += "/" + escapePointer(key)
			if m.Value == nil || !before(nodePosition(m.Value)) {
				return path // the position is in the key
			}
			n = m.Value
		case *ast.SequenceNode:
			pick := -1
			for i, v := range m.Values {
				if before(nodePosition(v)) {
					pick = i
				}
			}
			if pick < 0 {
				return path
			}
			path += "/" + strconv.Itoa(pick)
			n = m.Values[pick]
		default:
			return path
		}
	}
	return path
}
