package steps

import (
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

// awkward is a secret with every character an encoder likes to escape.
const awkward = `p@ss/w"rd<&>+=\tail-0123456789`

// encodings returns the forms of v a server or an encoder may produce, by
// name, each inside some surrounding text.
func encodings(v string) map[string]string {
	j, _ := json.Marshal(v) // HTML-escaped
	var plainJSON strings.Builder
	enc := json.NewEncoder(&plainJSON)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
	pj := strings.TrimSpace(plainJSON.String())
	forms := map[string]string{
		"plain":         v,
		"json":          string(j[1 : len(j)-1]),
		"json no html":  pj[1 : len(pj)-1],
		"json slashes":  strings.ReplaceAll(pj[1:len(pj)-1], "/", `\/`),
		"go quoted":     strconv.Quote(v)[1 : len(strconv.Quote(v))-1],
		"query escaped": url.QueryEscape(v),
		"path escaped":  url.PathEscape(v),
		"hex":           hex.EncodeToString([]byte(v)),
		"HEX":           strings.ToUpper(hex.EncodeToString([]byte(v))),
	}
	for _, e := range []struct {
		name string
		enc  *base64.Encoding
	}{{"base64", base64.StdEncoding}, {"base64url", base64.URLEncoding}, {"base64 raw", base64.RawStdEncoding}} {
		for lead := 0; lead < 3; lead++ {
			forms[e.name+" at "+strconv.Itoa(lead)] = e.enc.EncodeToString([]byte(strings.Repeat("x", lead) + v + "yz"))
		}
	}
	return forms
}

// leaks reports which forms of v text still holds.
func leaks(text, v string) []string {
	var out []string
	for name, f := range encodings(v) {
		core := f
		if strings.HasPrefix(name, "base64") {
			// A scrubbed encoding keeps the bytes around the value; what
			// must be gone is every run of the value's own groups.
			for _, c := range base64Cores(base64.StdEncoding, v) {
				if strings.Contains(text, c) {
					out = append(out, name)
				}
			}
			for _, c := range base64Cores(base64.URLEncoding, v) {
				if strings.Contains(text, c) {
					out = append(out, name)
				}
			}
			continue
		}
		if strings.Contains(text, core) {
			out = append(out, name)
		}
	}
	return out
}

func TestScrubTextFindsEveryForm(t *testing.T) {
	t.Parallel()
	for _, v := range []string{awkward, "sk-ant-api03-AbCdEfGhIjKlMnOp"} {
		s := &scrubber{}
		s.addSecret("key", v)
		for name, f := range encodings(v) {
			text := "before " + f + " after"
			got := s.text(text)
			if l := leaks(got, v); len(l) > 0 {
				t.Errorf("%s form of %q: scrubbed %q still holds %v", name, v, got, l)
			}
			if !strings.HasPrefix(got, "before ") || !strings.HasSuffix(got, " after") {
				t.Errorf("%s form: scrubbed %q lost the text around the value", name, got)
			}
		}
	}
}

func TestScrubTextLeavesOtherTextAlone(t *testing.T) {
	t.Parallel()
	s := &scrubber{}
	s.addSecret("key", "sk-live-1234567890")
	s.addCredential("Bearer tok_abcdef")
	for _, in := range []string{"", "status 401: unauthorized", `{"error": "no such key"}`, "sk-live-123 is not it", "Bearer someone-else"} {
		if got := s.text(in); got != in {
			t.Errorf("text(%q) = %q, want it unchanged", in, got)
		}
	}
	if got := s.text("401: Bearer tok_abcdef rejected, tok_abcdef again"); got != "401: [redacted] rejected, [redacted] again" {
		t.Errorf("credential: %q", got)
	}
	if got := s.text("key sk-live-1234567890!"); got != "key [redacted:key]!" {
		t.Errorf("secret: %q", got)
	}
	var none *scrubber
	if got := none.text("x sk-live-1234567890"); got != "x sk-live-1234567890" {
		t.Errorf("a nil scrubber changed the text: %q", got)
	}
}

func TestScrubJSONStaysValid(t *testing.T) {
	t.Parallel()
	const v = "tok/9<&>AbCdEfGh-123"
	s := &scrubber{}
	s.addSecret("api", v)
	s.addSecret("pin", "98765432")
	s.addCredential("literal-header-credential")
	tests := []struct {
		name, in, want string
	}{
		{name: "nothing to hide is returned as it is", in: `{"a": 1,  "b": [true, null, "x"]}`, want: `{"a": 1,  "b": [true, null, "x"]}`},
		{name: "plain", in: `{"echo": "Bearer ` + v + `"}`, want: `{"echo": "Bearer [redacted:api]"}`},
		{name: "HTML-escaped", in: `{"echo": "tok/9\u003c\u0026\u003eAbCdEfGh-123"}`, want: `{"echo": "[redacted:api]"}`},
		{name: "slash-escaped", in: `{"echo": "tok\/9<&>AbCdEfGh-123"}`, want: `{"echo": "[redacted:api]"}`},
		{name: "every letter escaped", in: `{"echo": "` + unicodeEscaped(v) + `"}`, want: `{"echo": "[redacted:api]"}`},
		{name: "in a key", in: `{"` + v + `": 1}`, want: `{"[redacted:api]": 1}`},
		{name: "as a number", in: `{"pin": 98765432, "n": 7}`, want: `{"pin": "[redacted]", "n": 7}`},
		{name: "in a base64 string", in: `{"b": "` + base64.StdEncoding.EncodeToString([]byte("Bearer "+v)) + `"}`},
		{name: "credentials stay in outputs", in: `{"h": "literal-header-credential"}`, want: `{"h": "literal-header-credential"}`},
		{name: "a quote inside a value", in: `{"q": "say \"` + v + `\""}`, want: `{"q": "say \"[redacted:api]\""}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := string(s.json([]byte(tt.in), false))
			if !json.Valid([]byte(got)) {
				t.Fatalf("json(%s) = %s, not JSON", tt.in, got)
			}
			if tt.want != "" && got != tt.want {
				t.Errorf("json(%s) = %s, want %s", tt.in, got, tt.want)
			}
			var decoded any
			_ = json.Unmarshal([]byte(got), &decoded)
			flat, _ := json.Marshal(decoded)
			if l := leaks(string(flat), v); len(l) > 0 {
				t.Errorf("json(%s) = %s still holds %v", tt.in, got, l)
			}
		})
	}
	if got := string(s.json([]byte(`{"h": "literal-header-credential"}`), true)); got != `{"h": "[redacted]"}` {
		t.Errorf("json with credentials = %s", got)
	}
}

func unicodeEscaped(s string) string {
	var b strings.Builder
	for _, r := range s {
		b.WriteString(`\u` + strconv.FormatInt(int64(r)+0x10000, 16)[1:])
	}
	return b.String()
}

func TestScrubErrorKeepsHowItFailed(t *testing.T) {
	t.Parallel()
	s := &scrubber{}
	s.addSecret("api", "sk-test-abcdef123")
	base := &schemas.Error{Code: schemas.CodeProvider, Retryable: true, Message: "POST http://x: status 500: echo sk-test-abcdef123"}
	tests := []struct {
		name          string
		err           error
		wantCode      schemas.Code
		wantRetryable bool
		wantNotPerf   bool
	}{
		{name: "provider error", err: base, wantCode: schemas.CodeProvider, wantRetryable: true},
		{name: "not performed", err: NotPerformed(base), wantCode: schemas.CodeProvider, wantRetryable: true, wantNotPerf: true},
		{name: "non-retryable", err: NonRetryable(errors.New("bad sk-test-abcdef123")), wantCode: schemas.CodeStepFailed},
		{name: "plain", err: errors.New("bad sk-test-abcdef123"), wantCode: schemas.CodeStepFailed, wantRetryable: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := s.err(tt.err)
			e := toError(got)
			if strings.Contains(got.Error(), "sk-test-abcdef123") || strings.Contains(e.Message, "sk-test-abcdef123") {
				t.Errorf("scrubbed error %q still holds the secret", got)
			}
			if !strings.Contains(e.Message, "[redacted:api]") {
				t.Errorf("message %q does not say what was redacted", e.Message)
			}
			if e.Code != tt.wantCode || e.Retryable != tt.wantRetryable || notPerformed(got) != tt.wantNotPerf {
				t.Errorf("scrubbed error: code %s retryable %v not performed %v; want %s %v %v", e.Code, e.Retryable, notPerformed(got), tt.wantCode, tt.wantRetryable, tt.wantNotPerf)
			}
		})
	}
	clean := errors.New("nothing secret")
	if got := s.err(clean); got != clean {
		t.Errorf("an error with nothing to hide was rebuilt: %v", got)
	}
}

func TestScrubResultOutcome(t *testing.T) {
	t.Parallel()
	c := &Call{}
	c.scrubber().addSecret("api", "sk-test-abcdef123")
	out, err := c.scrubResult(&Outcome{Output: map[string]any{"k": "sk-test-abcdef123"}, ExternalID: "ext-sk-test-abcdef123"}, nil)
	o, ok := out.(*Outcome)
	if err != nil || !ok {
		t.Fatalf("scrubResult = %T, %v; want an *Outcome", out, err)
	}
	raw, _ := encodeOutput(o)
	if string(raw) != `{"k":"[redacted:api]"}` || o.ExternalID != "ext-[redacted:api]" {
		t.Errorf("outcome = %s, %q", raw, o.ExternalID)
	}
	// Nothing resolved: the output is returned as it is.
	same := map[string]any{"k": 1}
	if got, _ := (&Call{}).scrubResult(same, nil); got.(map[string]any)["k"] != 1 {
		t.Errorf("scrubResult changed an output with nothing to hide")
	}
}
