package steps

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// This file scrubs credentials from what leaves a worker (DESIGN.md,
// growth rules: "every text that leaves a worker is scrubbed of the values
// it resolved"). Each call collects what it must hide:
//
//   - secret values it resolved ({{secret}}, api_key_secret, a model key),
//     scrubbed from the call's error and from its output;
//   - the values of credential headers it sent (Authorization, Cookie,
//     X-Api-Key ...), scrubbed from its error.
//
// A value is looked for as it is and in the forms a server or an encoder
// may give it: JSON- and Go-escaped, percent-encoded, and, for values of
// 12 bytes or more, base64 (standard and URL alphabets, at any alignment)
// and hex. A JSON output is scrubbed inside its decoded strings and
// numbers, so it stays valid JSON whatever escapes the server used.

// Redacted is what a scrubbed credential becomes in a text; a secret
// becomes "[redacted:NAME]", naming the secret but never its value.
const Redacted = "[redacted]"

// Scrubbing thresholds.
const (
	minCredentialBytes = 6  // shorter header values are not worth mangling texts for
	minEncodedBytes    = 12 // values this long are also looked for base64- and hex-encoded
	minNeedleBytes     = 4  // no form shorter than this is replaced
)

// scrubber holds what one call must hide. Safe for concurrent use.
type scrubber struct {
	mu      sync.Mutex
	secrets map[string]string // value -> replacement
	creds   map[string]bool
	all     *strings.Replacer // secrets and credentials, for errors; nil: rebuild
	out     *strings.Replacer // secrets only, for outputs; nil: rebuild
}

// scrubber returns the call's scrubber, creating it on first use.
func (c *Call) scrubber() *scrubber {
	c.scrubMu.Lock()
	defer c.scrubMu.Unlock()
	if c.scrub == nil {
		c.scrub = &scrubber{}
	}
	return c.scrub
}

// addSecret makes value, the secret name's, disappear from the call's
// error and output.
func (s *scrubber) addSecret(name, value string) {
	if len(value) < minNeedleBytes {
		return // lookupSecret refuses such values; a model key may be anything
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.secrets == nil {
		s.secrets = map[string]string{}
	}
	if _, ok := s.secrets[value]; !ok {
		s.secrets[value] = "[redacted:" + name + "]"
		s.all, s.out = nil, nil
	}
}

// addCredential makes value, a credential header's, disappear from the
// call's error. For "Scheme token" values (Authorization: Bearer, Basic)
// the token alone is hidden too.
func (s *scrubber) addCredential(value string) {
	value = strings.TrimSpace(value)
	vals := []string{value}
	if _, token, ok := strings.Cut(value, " "); ok {
		vals = append(vals, strings.TrimSpace(token))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range vals {
		if len(v) < minCredentialBytes || s.creds[v] {
			continue
		}
		if s.creds == nil {
			s.creds = map[string]bool{}
		}
		s.creds[v] = true
		s.all = nil
	}
}

// empty reports whether there is nothing to hide.
func (s *scrubber) empty() bool {
	if s == nil {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.secrets) == 0 && len(s.creds) == 0
}

// replacers returns the error and output replacers, building them after a
// change.
func (s *scrubber) replacers() (all, out *strings.Replacer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.all == nil || s.out == nil {
		secretForms := map[string]string{}
		for v, rep := range s.secrets {
			for _, f := range valueForms(v) {
				secretForms[f] = rep
			}
		}
		allForms := map[string]string{}
		for v := range s.creds {
			for _, f := range valueForms(v) {
				allForms[f] = Redacted
			}
		}
		for f, rep := range secretForms {
			allForms[f] = rep
		}
		s.all, s.out = newReplacer(allForms), newReplacer(secretForms)
	}
	return s.all, s.out
}

// newReplacer replaces every form with its replacement, longest forms
// first, so a value is hidden whole even when another is part of it.
func newReplacer(forms map[string]string) *strings.Replacer {
	olds := make([]string, 0, len(forms))
	for f := range forms {
		olds = append(olds, f)
	}
	sort.Slice(olds, func(i, j int) bool {
		if len(olds[i]) != len(olds[j]) {
			return len(olds[i]) > len(olds[j])
		}
		return olds[i] < olds[j]
	})
	pairs := make([]string, 0, 2*len(olds))
	for _, o := range olds {
		pairs = append(pairs, o, forms[o])
	}
	return strings.NewReplacer(pairs...)
}

// valueForms returns the spellings of v to look for.
func valueForms(v string) []string {
	forms := []string{v}
	add := func(f string) {
		if len(f) >= minNeedleBytes {
			forms = append(forms, f)
		}
	}
	// JSON escapes, as encoding/json writes them (with and without HTML
	// escaping) and with "/" escaped, as some servers write it.
	for _, html := range []bool{false, true} {
		var b bytes.Buffer
		enc := json.NewEncoder(&b)
		enc.SetEscapeHTML(html)
		_ = enc.Encode(v)
		j := strings.TrimSuffix(b.String(), "\n")
		j = j[1 : len(j)-1]
		add(j)
		add(strings.ReplaceAll(j, "/", `\/`))
	}
	q := strconv.Quote(v)
	add(q[1 : len(q)-1])
	add(url.QueryEscape(v))
	add(url.PathEscape(v))
	if len(v) >= minEncodedBytes {
		for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding} {
			for _, f := range base64Cores(enc, v) {
				if len(f) >= 8 {
					forms = append(forms, f)
				}
			}
		}
		h := hex.EncodeToString([]byte(v))
		forms = append(forms, h, strings.ToUpper(h))
	}
	return forms
}

// base64Cores returns, for each of the three alignments v can have inside
// a longer encoded text, the part of the encoding that v's bytes alone
// decide: whatever surrounds v, an encoding of a text holding v holds one
// of these.
func base64Cores(enc *base64.Encoding, v string) []string {
	var out []string
	for lead := 0; lead < 3; lead++ {
		skip := (3 - lead) % 3 // bytes of v that share a group with what precedes it
		body := []byte(v)[skip:]
		full := len(body) / 3 * 3 // whole groups of v's bytes
		if full == 0 {
			continue
		}
		out = append(out, enc.EncodeToString(body[:full]))
	}
	return out
}

// text scrubs s of the call's secrets and credentials: for errors and logs.
func (s *scrubber) text(str string) string {
	if s.empty() {
		return str
	}
	all, _ := s.replacers()
	return all.Replace(str)
}

// outputText scrubs s of the call's secrets only: for outputs.
func (s *scrubber) outputText(str string) string {
	if s.empty() {
		return str
	}
	_, out := s.replacers()
	return out.Replace(str)
}

// json scrubs a JSON value of the call's secrets, inside its strings (and
// object keys) after decoding them, so any escape a server used is seen
// through; a number that spells a secret becomes the string "[redacted]".
// The result is valid JSON when raw is; raw is returned as is when nothing
// changes. creds also scrubs credential values (for error bodies).
func (s *scrubber) json(raw []byte, creds bool) []byte {
	if s.empty() {
		return raw
	}
	all, out := s.replacers()
	rep := out
	if creds {
		rep = all
	}
	if bytes.IndexByte(raw, '\\') < 0 && rep.Replace(string(raw)) == string(raw) {
		return raw // no escapes, so no string decodes to something not already seen
	}
	var b bytes.Buffer
	b.Grow(len(raw))
	for i := 0; i < len(raw); {
		c := raw[i]
		switch {
		case c == '"':
			j := stringEnd(raw, i)
			lit := raw[i:j]
			var str string
			if json.Unmarshal(lit, &str) == nil {
				if clean := rep.Replace(str); clean != str {
					b.Write(encodeJSONString(clean))
					i = j
					continue
				}
			}
			b.Write(lit)
			i = j
		case c == '-' || (c >= '0' && c <= '9'):
			j := i
			for j < len(raw) && strings.IndexByte("+-.0123456789eE", raw[j]) >= 0 {
				j++
			}
			if num := string(raw[i:j]); rep.Replace(num) != num {
				b.WriteString(`"` + Redacted + `"`)
			} else {
				b.WriteString(num)
			}
			i = j
		default:
			b.WriteByte(c)
			i++
		}
	}
	return b.Bytes()
}

// stringEnd returns the index just past the JSON string literal starting
// at raw[i] (a '"'), or len(raw) when it does not end.
func stringEnd(raw []byte, i int) int {
	for j := i + 1; j < len(raw); j++ {
		switch raw[j] {
		case '\\':
			j++
		case '"':
			return j + 1
		}
	}
	return len(raw)
}

// encodeJSONString encodes s as a JSON string, without HTML escaping.
func encodeJSONString(s string) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s)
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// err scrubs err's message of the call's secrets and credentials, keeping
// how it failed (code, retryable, not performed). err is returned as it is
// when there is nothing to hide in it.
func (s *scrubber) err(err error) error {
	if err == nil || s.empty() {
		return err
	}
	msg := err.Error()
	if s.text(msg) == msg {
		return err
	}
	e := toError(err)
	clean := *e.WithCause(nil)
	clean.Message = s.text(clean.Message)
	return &stepError{err: &clean, retryable: clean.Retryable, notPerformed: notPerformed(err)}
}

// scrubResult scrubs what a Runner returned of the values the call
// resolved: the worker calls it on every attempt's output and error before
// they are recorded, published or logged.
func (c *Call) scrubResult(out any, err error) (any, error) {
	if c == nil {
		return out, err
	}
	c.scrubMu.Lock()
	s := c.scrub
	c.scrubMu.Unlock()
	if s.empty() {
		return out, err
	}
	err = s.err(err)
	if out == nil {
		return nil, err
	}
	o, isOutcome := out.(*Outcome)
	raw, encErr := encodeOutput(out)
	if encErr != nil {
		return out, err // the worker reports the encoding error; there is no text to leak
	}
	clean := json.RawMessage(s.json(raw, false))
	if isOutcome {
		return &Outcome{Output: clean, ExternalID: s.outputText(o.ExternalID)}, err
	}
	if bytes.Equal(clean, raw) {
		return out, err
	}
	return clean, err
}
