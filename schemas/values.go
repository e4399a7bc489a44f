package schemas

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
)

// Large values by reference. A job's state is a JSON object; a top-level
// member whose value is large is kept out of the checkpoint, in a value
// store (kv.Values), and the state holds a reference in its place:
//
//	{"report": {"$waymark_value": "sha256:9f86…08", "bytes": 310271}, "n": 3}
//	            └──────────── ValueRef.JSON() ─────────────────────┘
//
// The functions here work on the JSON text and do no I/O: the caller
// passes the store's put and get. They keep the bytes they do not replace
// as they are, so member order and spelling survive a round trip.

// ValueRefMember is the member name that marks a reference. It is matched
// as written, without escapes, as ValueRef.JSON writes it.
const ValueRefMember = "$waymark_value"

// valueRefMarker is what HasRefs looks for: the member name with its quotes.
var valueRefMarker = []byte(`"` + ValueRefMember + `"`)

// digestPrefix starts every ValueRef digest.
const digestPrefix = "sha256:"

// Error codes of the value store, part of the Error taxonomy (see the Code
// constants in errors.go).
const (
	// CodeValueMissing: a reference names a value the value store does not
	// hold (removed with its job, or never stored).
	CodeValueMissing Code = "value_missing"
	// CodeValueCorrupt: the value store holds an object for a reference
	// whose length or SHA-256 differs from the reference's.
	CodeValueCorrupt Code = "value_corrupt"
)

// Sentinels of the value store, matched with errors.Is.
var (
	// ErrValueMissing matches the error of a reference whose value cannot
	// be found; the message names the digest (and, from kv.Values, the
	// object).
	ErrValueMissing = &Error{Code: CodeValueMissing}
	// ErrValueCorrupt matches the error of a stored value that does not
	// match its reference; the message names the object.
	ErrValueCorrupt = &Error{Code: CodeValueCorrupt}
)

// ValueRef names a value kept in the value store. Its JSON form is the
// object {"$waymark_value": "sha256:<64 lower-case hex>", "bytes": N}, with
// exactly these two members.
type ValueRef struct {
	// Digest is "sha256:" followed by the 64 lower-case hex digits of the
	// SHA-256 of the value.
	Digest string
	// Bytes is the length of the value, compact JSON, in bytes.
	Bytes int
}

// NewValueRef returns the reference of value (compact JSON): its SHA-256
// and its length.
func NewValueRef(value []byte) ValueRef {
	sum := sha256.Sum256(value)
	return ValueRef{Digest: digestPrefix + hex.EncodeToString(sum[:]), Bytes: len(value)}
}

// Valid reports whether r's digest is "sha256:" and 64 lower-case hex
// digits and its Bytes is not negative.
func (r ValueRef) Valid() bool {
	return r.Bytes >= 0 && validDigest(r.Digest)
}

// Hex returns the 64 hex digits of r's digest ("" when r is not Valid).
func (r ValueRef) Hex() string {
	if !validDigest(r.Digest) {
		return ""
	}
	return r.Digest[len(digestPrefix):]
}

// Matches reports whether value is the value r names: same length, same
// SHA-256.
func (r ValueRef) Matches(value []byte) bool {
	return len(value) == r.Bytes && NewValueRef(value).Digest == r.Digest
}

// JSON returns r's JSON form, compact:
// {"$waymark_value":"sha256:…","bytes":N}.
func (r ValueRef) JSON() []byte {
	b := make([]byte, 0, 48+len(r.Digest))
	b = append(b, `{"`+ValueRefMember+`":`...)
	b = strconv.AppendQuote(b, r.Digest)
	b = append(b, `,"bytes":`...)
	b = strconv.AppendInt(b, int64(r.Bytes), 10)
	return append(b, '}')
}

func validDigest(d string) bool {
	if len(d) != len(digestPrefix)+64 || d[:len(digestPrefix)] != digestPrefix {
		return false
	}
	for _, c := range []byte(d[len(digestPrefix):]) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// ParseValueRef reports whether raw (surrounding whitespace allowed) is a
// reference and returns it. Only an object with exactly the two members
// "$waymark_value" (a valid digest: "sha256:" and 64 lower-case hex
// digits, as a string without escapes) and "bytes" (a non-negative
// integer), in either order, is a reference; member names are compared as
// written. Any other value, an object with a "$waymark_value" member among
// others included, is not one and gives false.
func ParseValueRef(raw json.RawMessage) (ValueRef, bool) {
	s := scanner{b: raw}
	i := s.ws(0)
	ref, end, ok := s.ref(i)
	if !ok || s.ws(end) != len(raw) {
		return ValueRef{}, false
	}
	return ref, true
}

// HasRefs reports whether doc may hold a reference: whether its bytes
// contain the quoted member name "$waymark_value". It decodes nothing;
// false is certain, true means "look closer" (a user's string or an object
// with more members can contain the name too: see FindRefs).
func HasRefs(doc json.RawMessage) bool { return bytes.Contains(doc, valueRefMarker) }

// FindRefs returns every reference in doc, at any depth, in document
// order (a reference that occurs twice is listed twice). A doc without
// the marker (HasRefs false) is not decoded. Errors: doc is not valid
// JSON.
func FindRefs(doc json.RawMessage) ([]ValueRef, error) {
	if !HasRefs(doc) {
		return nil, nil
	}
	spans, err := refSpans(doc)
	if err != nil {
		return nil, err
	}
	refs := make([]ValueRef, len(spans))
	for i, sp := range spans {
		refs[i] = sp.ref
	}
	return refs, nil
}

// LogicalSize returns the size of doc, in bytes, as if every reference in
// it (at any depth) were replaced by its value: len(doc), less each
// reference's own length, plus its Bytes. A doc that is not valid JSON
// counts as len(doc).
func LogicalSize(doc json.RawMessage) int {
	if !HasRefs(doc) {
		return len(doc)
	}
	spans, err := refSpans(doc)
	if err != nil {
		return len(doc)
	}
	n := len(doc)
	for _, sp := range spans {
		n += sp.ref.Bytes - (sp.end - sp.start)
	}
	return n
}

// ExternalizeMembers returns state with every top-level member whose
// value, compacted, is longer than threshold bytes replaced by its
// reference: put stores the compact value and returns its reference
// (kv.Values.Put). Members that already are references, and the members
// at or under the threshold, are kept byte for byte; member order is
// kept. When no member is replaced, state itself is returned.
//
// A state that is not an object is returned unchanged when it is at most
// threshold bytes long (compacted), and is an error matching ErrTooLarge
// otherwise. Other errors: state is not valid JSON; a member over the
// threshold holds a reference inside it (a stored value never holds
// references: resolve it first); put's error, wrapped with the member's
// name (values put before it stay stored, and a retry puts them again,
// which kv.Values makes a no-op); put returns a reference that does not
// match the value it was given.
func ExternalizeMembers(state json.RawMessage, threshold int, put func(value []byte) (ValueRef, error)) (json.RawMessage, error) {
	s := scanner{b: state}
	i := s.ws(0)
	if i >= len(state) || state[i] != '{' {
		if !json.Valid(state) {
			return nil, fmt.Errorf("externalize values: state is not valid JSON")
		}
		var c bytes.Buffer
		_ = json.Compact(&c, state)
		if c.Len() <= threshold {
			return state, nil
		}
		return nil, Errorf(CodeTooLarge, "externalize values: state is not an object and is %d bytes, over the value threshold of %d: only an object's members are stored by reference", c.Len(), threshold)
	}
	ms, end, err := s.members(i)
	if err != nil {
		return nil, fmt.Errorf("externalize values: state: %w", err)
	}
	if s.ws(end) != len(state) {
		return nil, fmt.Errorf("externalize values: state: %w", s.errAt(s.ws(end)))
	}
	var out []byte // nil until a member is replaced
	var c bytes.Buffer
	for k, m := range ms {
		val := state[m.vStart:m.vEnd]
		var repl []byte
		// Compacting never lengthens a value: one at most threshold bytes
		// long as written stays where it is.
		if _, isRef := ParseValueRef(val); len(val) > threshold && !isRef {
			name := state[m.kStart:m.kEnd]
			c.Reset()
			if err := json.Compact(&c, val); err != nil {
				return nil, fmt.Errorf("externalize values: member %s: %w", name, err)
			}
			if c.Len() > threshold {
				value := bytes.Clone(c.Bytes())
				if HasRefs(value) {
					inner, err := refSpans(value)
					if err != nil {
						return nil, fmt.Errorf("externalize values: member %s: %w", name, err)
					}
					if len(inner) > 0 {
						return nil, fmt.Errorf("externalize values: member %s holds a reference (%s) inside it: resolve it before storing the member by reference",
							name, inner[0].ref.Digest)
					}
				}
				ref, err := put(value)
				if err != nil {
					return nil, fmt.Errorf("externalize values: member %s: %w", name, err)
				}
				if !ref.Matches(value) {
					return nil, fmt.Errorf("externalize values: member %s: put returned %s of %d bytes, not the reference of the %d bytes it was given",
						name, ref.Digest, ref.Bytes, len(value))
				}
				repl = ref.JSON()
			}
		}
		if repl == nil && out == nil {
			continue
		}
		if out == nil {
			out = make([]byte, 0, len(state))
			out = append(out, '{')
			for _, p := range ms[:k] {
				out = appendMember(out, state, p, nil)
			}
		}
		out = appendMember(out, state, m, repl)
	}
	if out == nil {
		return state, nil
	}
	return append(out, '}'), nil
}

// appendMember appends "key":value (value replaced by repl unless nil) to
// out, after a comma unless it is the object's first.
func appendMember(out, doc []byte, m member, repl []byte) []byte {
	if out[len(out)-1] != '{' {
		out = append(out, ',')
	}
	out = append(out, doc[m.kStart:m.kEnd]...)
	out = append(out, ':')
	if repl != nil {
		return append(out, repl...)
	}
	return append(out, doc[m.vStart:m.vEnd]...)
}

// ResolveRefs returns doc with every reference in it, at any depth,
// replaced by the value get returns for it; everything else is kept byte
// for byte. A referenced value itself never holds references (ExternalizeMembers
// refuses to store one that does), so the values get returns are
// spliced in as they are, not searched again. Fast path: a doc whose
// bytes do not contain "$waymark_value" (HasRefs false) is returned as it
// is, without decoding. get is called once per distinct digest.
//
// Errors: doc is not valid JSON; get's error, wrapped with the digest
// (kv.Values.Get returns one matching ErrValueMissing for a value that is
// gone); get returns a value whose length is not the reference's Bytes
// (matching ErrValueCorrupt).
func ResolveRefs(doc json.RawMessage, get func(ValueRef) ([]byte, error)) (json.RawMessage, error) {
	if !HasRefs(doc) {
		return doc, nil
	}
	spans, err := refSpans(doc)
	if err != nil {
		return nil, fmt.Errorf("resolve values: %w", err)
	}
	if len(spans) == 0 {
		return doc, nil
	}
	size := len(doc)
	for _, sp := range spans {
		size += sp.ref.Bytes - (sp.end - sp.start)
	}
	out := make([]byte, 0, max(size, 0))
	got := make(map[string][]byte, len(spans))
	last := 0
	for _, sp := range spans {
		v, ok := got[sp.ref.Digest]
		if !ok {
			if v, err = get(sp.ref); err != nil {
				return nil, fmt.Errorf("resolve value %s: %w", sp.ref.Digest, err)
			}
			if len(v) != sp.ref.Bytes {
				return nil, Errorf(CodeValueCorrupt, "resolve value %s: got %d bytes, the reference says %d", sp.ref.Digest, len(v), sp.ref.Bytes)
			}
			got[sp.ref.Digest] = v
		}
		out = append(out, doc[last:sp.start]...)
		out = append(out, v...)
		last = sp.end
	}
	return append(out, doc[last:]...), nil
}

// refSpan is where a reference sits in a document: doc[start:end].
type refSpan struct {
	start, end int
	ref        ValueRef
}

// refSpans returns the references of doc in document order. doc must be
// one JSON value, surrounding whitespace allowed.
func refSpans(doc []byte) ([]refSpan, error) {
	s := scanner{b: doc, collect: true}
	end, err := s.value(s.ws(0), 0)
	if err != nil {
		return nil, err
	}
	if s.ws(end) != len(doc) {
		return nil, s.errAt(s.ws(end))
	}
	return s.spans, nil
}

// maxDepth bounds nesting, as encoding/json does.
const maxDepth = 10000

// scanner walks JSON text without decoding it. It checks structure
// (brackets, strings, separators) and leaves literals and numbers to
// their scalar scan: inputs are JSON that was validated before (a state,
// a step's output), and what it cannot walk is reported, never guessed.
type scanner struct {
	b       []byte
	collect bool // record references in spans
	spans   []refSpan
}

// member is one object member: b[kStart:kEnd] is the quoted name,
// b[vStart:vEnd] the value.
type member struct {
	kStart, kEnd, vStart, vEnd int
}

func (s *scanner) errAt(i int) error {
	if i >= len(s.b) {
		return fmt.Errorf("malformed JSON: unexpected end at offset %d", i)
	}
	return fmt.Errorf("malformed JSON: unexpected %q at offset %d", s.b[i], i)
}

func (s *scanner) ws(i int) int {
	for i < len(s.b) && (s.b[i] == ' ' || s.b[i] == '\n' || s.b[i] == '\r' || s.b[i] == '\t') {
		i++
	}
	return i
}

// str returns the index after the string that starts at b[i] == '"'.
func (s *scanner) str(i int) (int, error) {
	for j := i + 1; j < len(s.b); j++ {
		switch c := s.b[j]; {
		case c == '\\':
			j++
		case c == '"':
			return j + 1, nil
		case c < 0x20:
			return 0, s.errAt(j)
		}
	}
	return 0, s.errAt(len(s.b))
}

// value returns the index after the value at b[i], recording references
// when s.collect is set.
func (s *scanner) value(i, depth int) (int, error) {
	if i >= len(s.b) {
		return 0, s.errAt(i)
	}
	switch s.b[i] {
	case '"':
		return s.str(i)
	case '{':
		if depth >= maxDepth {
			return 0, fmt.Errorf("malformed JSON: nested deeper than %d at offset %d", maxDepth, i)
		}
		if ref, end, ok := s.ref(i); ok {
			if s.collect {
				s.spans = append(s.spans, refSpan{start: i, end: end, ref: ref})
			}
			return end, nil
		}
		_, end, err := s.walkMembers(i, depth, false)
		return end, err
	case '[':
		if depth >= maxDepth {
			return 0, fmt.Errorf("malformed JSON: nested deeper than %d at offset %d", maxDepth, i)
		}
		j := s.ws(i + 1)
		if j < len(s.b) && s.b[j] == ']' {
			return j + 1, nil
		}
		for {
			end, err := s.value(j, depth+1)
			if err != nil {
				return 0, err
			}
			j = s.ws(end)
			if j < len(s.b) && s.b[j] == ',' {
				j = s.ws(j + 1)
				continue
			}
			if j < len(s.b) && s.b[j] == ']' {
				return j + 1, nil
			}
			return 0, s.errAt(j)
		}
	}
	j := i // a number, true, false or null
	for j < len(s.b) && (s.b[j] == '-' || s.b[j] == '+' || s.b[j] == '.' ||
		(s.b[j] >= '0' && s.b[j] <= '9') || (s.b[j] >= 'a' && s.b[j] <= 'z') || (s.b[j] >= 'A' && s.b[j] <= 'Z')) {
		j++
	}
	if j == i {
		return 0, s.errAt(i)
	}
	return j, nil
}

// members returns the members of the object at b[i] == '{' and the index
// after it, walking (and recording references in) the values.
func (s *scanner) members(i int) ([]member, int, error) {
	return s.walkMembers(i, 0, true)
}

func (s *scanner) walkMembers(i, depth int, keep bool) ([]member, int, error) {
	var ms []member
	j := s.ws(i + 1)
	if j < len(s.b) && s.b[j] == '}' {
		return ms, j + 1, nil
	}
	for {
		if j >= len(s.b) || s.b[j] != '"' {
			return nil, 0, s.errAt(j)
		}
		kEnd, err := s.str(j)
		if err != nil {
			return nil, 0, err
		}
		c := s.ws(kEnd)
		if c >= len(s.b) || s.b[c] != ':' {
			return nil, 0, s.errAt(c)
		}
		v := s.ws(c + 1)
		vEnd, err := s.value(v, depth+1)
		if err != nil {
			return nil, 0, err
		}
		if keep {
			ms = append(ms, member{kStart: j, kEnd: kEnd, vStart: v, vEnd: vEnd})
		}
		j = s.ws(vEnd)
		if j < len(s.b) && s.b[j] == ',' {
			j = s.ws(j + 1)
			continue
		}
		if j < len(s.b) && s.b[j] == '}' {
			return ms, j + 1, nil
		}
		return nil, 0, s.errAt(j)
	}
}

// ref reports whether the value at b[i] is a reference, and the index
// after it. It reads no further than the reference's length: anything
// that is not exactly the two members is not one, and is left to value.
func (s *scanner) ref(i int) (ValueRef, int, bool) {
	if i >= len(s.b) || s.b[i] != '{' {
		return ValueRef{}, 0, false
	}
	var ref ValueRef
	var haveDigest, haveBytes bool
	j := i + 1
	for n := 0; n < 2; n++ {
		j = s.ws(j)
		if j >= len(s.b) || s.b[j] != '"' {
			return ValueRef{}, 0, false
		}
		kEnd, err := s.str(j)
		if err != nil {
			return ValueRef{}, 0, false
		}
		key := s.b[j:kEnd]
		j = s.ws(kEnd)
		if j >= len(s.b) || s.b[j] != ':' {
			return ValueRef{}, 0, false
		}
		j = s.ws(j + 1)
		switch {
		case !haveDigest && bytes.Equal(key, valueRefMarker):
			if j >= len(s.b) || s.b[j] != '"' {
				return ValueRef{}, 0, false
			}
			end, err := s.str(j)
			if err != nil || !validDigest(string(s.b[j+1:end-1])) {
				return ValueRef{}, 0, false
			}
			ref.Digest, haveDigest, j = string(s.b[j+1:end-1]), true, end
		case !haveBytes && string(key) == `"bytes"`:
			k := j
			for k < len(s.b) && s.b[k] >= '0' && s.b[k] <= '9' {
				k++
			}
			if k == j || (s.b[j] == '0' && k > j+1) || k-j > 15 {
				return ValueRef{}, 0, false
			}
			n, err := strconv.Atoi(string(s.b[j:k]))
			if err != nil {
				return ValueRef{}, 0, false
			}
			ref.Bytes, haveBytes, j = n, true, k
		default:
			return ValueRef{}, 0, false
		}
		j = s.ws(j)
		if n == 0 {
			if j >= len(s.b) || s.b[j] != ',' {
				return ValueRef{}, 0, false
			}
			j++
		}
	}
	if j >= len(s.b) || s.b[j] != '}' {
		return ValueRef{}, 0, false
	}
	return ref, j + 1, true
}
