package schemas_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

func TestCheckJSONText(t *testing.T) {
	t.Parallel()
	clean := []struct{ name, doc string }{
		{"ascii", `{"a": "b", "n": [1, 2.5e3, true, null]}`},
		{"utf-8", `{"name": "Zoë 日本 😀"}`},
		{"surrogate pair", `{"face": "\ud83d\ude00", "upper": "\uD83D\uDE00"}`},
		{"replacement character sent on purpose", `{"r": "\ufffd and �"}`},
		{"escaped backslash before u", `{"path": "C:\\ud800\\x"}`},
		{"empty", `{}`},
		{"scalar", `"x"`},
	}
	for _, c := range clean {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			if err := schemas.CheckJSONText([]byte(c.doc)); err != nil {
				t.Fatalf("CheckJSONText(%s) = %v, want nil", c.doc, err)
			}
		})
	}
	bad := []struct {
		name, doc string
		path      string
		key       bool
		at        string // the bad sequence begins at the first occurrence of this text
		reason    string
	}{
		{name: "lone high surrogate", doc: `{"name": "x\ud800y"}`, path: "/name", at: `\ud800`, reason: `\ud800 is one half`},
		{name: "lone low surrogate", doc: `{"a": ["ok", {"b": "\uDC00"}]}`, path: "/a/1/b", at: `\uDC00`, reason: "surrogate pair"},
		{name: "high then not low", doc: `{"a": "\ud800\u0041"}`, path: "/a", at: `\ud800`, reason: `\ud800`},
		{name: "two highs", doc: `{"a": "\ud800\ud800"}`, path: "/a", at: `\ud800`, reason: `\ud800`},
		{name: "high at the end", doc: `["\ud83d"]`, path: "/0", at: `\ud83d`, reason: `\ud83d`},
		{name: "invalid byte", doc: "{\"a\": {\"b\": [1, \"x\xffy\"]}}", path: "/a/b/1", at: "\xff", reason: "invalid UTF-8 byte 0xff"},
		{name: "encoded surrogate (CESU-8)", doc: "{\"a\": \"\xed\xa0\x80\"}", path: "/a", at: "\xed", reason: "0xed"},
		{name: "truncated sequence", doc: "{\"a\": \"\xe6\x97\"}", path: "/a", at: "\xe6", reason: "0xe6"},
		{name: "in a member name", doc: "{\"ok\": 1, \"b\xffd\": 2}", path: "/b\uFFFDd", key: true, at: "\xff", reason: "0xff"},
		{name: "escape in a member name", doc: `{"k\udc00": 2}`, path: "/k\uFFFD", key: true, at: `\udc00`, reason: `\udc00`},
		{name: "name with pointer characters", doc: `{"a/b~c": "\ud800"}`, path: "/a~1b~0c", at: `\ud800`, reason: "surrogate"},
		{name: "top-level string", doc: "\"\xc0\"", path: "", at: "\xc0", reason: "0xc0"},
		{name: "after nested values", doc: `{"a": [[], {}, [1, {"x": [true]}]], "b": "\udfff"}`, path: "/b", at: `\udfff`, reason: "surrogate"},
		{name: "array index after objects", doc: `[{"a": 1}, {"b": [2]}, "\ud800"]`, path: "/2", at: `\ud800`, reason: "surrogate"},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			err := schemas.CheckJSONText([]byte(c.doc))
			if !errors.Is(err, schemas.ErrInputInvalid) {
				t.Fatalf("CheckJSONText(%q) = %v, want ErrInputInvalid", c.doc, err)
			}
			var te *schemas.TextError
			if !errors.As(err, &te) {
				t.Fatalf("no *TextError in %v", err)
			}
			if te.Path != c.path || te.Key != c.key {
				t.Errorf("path %q key %v, want %q key %v", te.Path, te.Key, c.path, c.key)
			}
			if want := strings.Index(c.doc, c.at); te.Offset != want {
				t.Errorf("offset %d, want %d", te.Offset, want)
			}
			if !strings.Contains(te.Reason, c.reason) {
				t.Errorf("reason %q lacks %q", te.Reason, c.reason)
			}
			at := c.path
			if at == "" {
				at = "/"
			}
			if !strings.Contains(err.Error(), "at "+at+": ") {
				t.Errorf("message %q does not name the path %q", err, at)
			}
		})
	}
	t.Run("not JSON", func(t *testing.T) {
		t.Parallel()
		err := schemas.CheckJSONText([]byte("{\"a\": \"\xff"))
		var te *schemas.TextError
		if !errors.Is(err, schemas.ErrInputInvalid) || errors.As(err, &te) {
			t.Fatalf("got %v, want ErrInputInvalid without a TextError", err)
		}
	})
}

func TestCheckStringsText(t *testing.T) {
	t.Parallel()
	if err := schemas.CheckStringsText("/vars", map[string]string{"region": "eu", "name": "Zoë"}); err != nil {
		t.Fatal(err)
	}
	err := schemas.CheckStringsText("/vars", map[string]string{"region": "eu", "greeting": "h\xffi"})
	var te *schemas.TextError
	if !errors.Is(err, schemas.ErrInputInvalid) || !errors.As(err, &te) {
		t.Fatalf("got %v, want ErrInputInvalid with a TextError", err)
	}
	if te.Path != "/vars/greeting" || te.Offset != 1 || te.Key {
		t.Errorf("got %+v, want /vars/greeting at 1", te)
	}
	err = schemas.CheckStringsText("", map[string]string{"g\xfe": "x"})
	if !errors.As(err, &te) || !te.Key || te.Path != "/g\uFFFD" {
		t.Errorf("bad name: got %v (%+v)", err, te)
	}
}

func TestParseRefusesTextThatIsNotUnicode(t *testing.T) {
	t.Parallel()
	const head = "name: x\nversion: 1\n"
	rows := []located{
		{
			name: "invalid UTF-8 in a YAML prompt",
			src:  head + "steps:\n  - id: a\n    kind: noop\n    description: \"caf\xe9\"\n",
			at:   "\xe9", col: true, path: "/steps/0/description", msg: "invalid UTF-8 byte 0xe9",
		},
		{
			name: "invalid UTF-8 in a plain scalar",
			src:  head + "description: one \xff two\nsteps:\n  - id: a\n    kind: noop\n",
			at:   "\xff", col: true, path: "/description", msg: "0xff",
		},
		{
			name: "invalid UTF-8 in a block scalar",
			src:  head + "steps:\n  - id: a\n    kind: noop\n    description: |\n      first line\n      bad \xc3 here\n",
			at:   "\xc3", col: true, path: "/steps/0/description", msg: "0xc3",
		},
		{
			name: "invalid UTF-8 in a key",
			src:  head + "steps:\n  - id: a\n    kind: noop\n    with: {output: {\"k\xff\": 1}}\n",
			at:   "\xff", col: true, path: "/steps/0/with/output/k\uFFFD", msg: "0xff",
		},
		{
			name: "lone high surrogate in a double-quoted scalar",
			src:  head + "steps:\n  - id: a\n    kind: noop\n    description: \"say \\ud800 now\"\n",
			at:   `\ud800`, col: true, path: "/steps/0/description", msg: `\ud800 is one half of a UTF-16 surrogate pair`,
		},
		{
			name: "high surrogate followed by another escape",
			src:  head + "vars: {a: \"ok\", b: \"\\ud83d\\u0041\"}\nsteps:\n  - id: a\n    kind: noop\n",
			at:   `\ud83d`, col: true, path: "/vars/b", msg: `\ud83d`,
		},
		{
			name: "lone low surrogate",
			src:  head + "steps:\n  - id: a\n    kind: noop\n    with: {output: {x: [\"fine\", \"\\uDC00\"]}}\n",
			at:   `\uDC00`, col: true, path: "/steps/0/with/output/x/1", msg: `\uDC00`,
		},
		{
			name: "long escape of a surrogate",
			src:  head + "description: \"\\U0000D800\"\nsteps:\n  - id: a\n    kind: noop\n",
			at:   `\U0000D800`, col: true, path: "/description", msg: `\U0000D800`,
		},
		{
			name: "JSON file",
			file: "workflow.json",
			src:  "{\n  \"name\": \"x\",\n  \"version\": 1,\n  \"steps\": [{\"id\": \"a\", \"kind\": \"noop\", \"description\": \"\\udead\"}]\n}\n",
			at:   `\udead`, col: true, path: "/steps/0/description", msg: `\udead`,
		},
		{
			name: "JSON file with a bad byte",
			file: "workflow.json",
			src:  "{\"name\": \"x\", \"version\": 1, \"steps\": [{\"id\": \"a\", \"kind\": \"noop\", \"with\": {\"output\": {\"\xfe\": 1}}}]}\n",
			at:   "\xfe", col: true, path: "/steps/0/with/output/\uFFFD", msg: "the member name holds invalid UTF-8 byte 0xfe",
		},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			checkLocated(t, r)
		})
	}

	for name, src := range map[string]string{
		"surrogate pair":             head + "description: \"\\ud83d\\ude00 \\U0001F600\"\nsteps:\n  - id: a\n    kind: noop\n",
		"single-quoted escape text":  head + "description: 'C:\\ud800'\nsteps:\n  - id: a\n    kind: noop\n",
		"plain escape text":          head + "description: a \\udc00 b\nsteps:\n  - id: a\n    kind: noop\n",
		"block escape text":          head + "description: |\n  \\ud800\nsteps:\n  - id: a\n    kind: noop\n",
		"escaped backslash":          head + "description: \"\\\\ud800\"\nsteps:\n  - id: a\n    kind: noop\n",
		"replacement character":      head + "description: \"\\ufffd �\"\nsteps:\n  - id: a\n    kind: noop\n",
		"JSON with an escaped slash": `{"name": "x", "version": 1, "description": "\\ud800", "steps": [{"id": "a", "kind": "noop"}]}`,
	} {
		t.Run("accepts "+name, func(t *testing.T) {
			t.Parallel()
			if _, err := schemas.Parse("workflow.yaml", []byte(src), schemas.LoadOptions{}); err != nil {
				t.Fatalf("Parse refused clean text: %v", err)
			}
		})
	}
}

func TestParseRefusesAssetsThatAreNotUnicode(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for name, data := range map[string]string{"prompt.txt": "ok\nbad \xff\n", "data.json": `{"a": "\ud800"}`} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for asset, want := range map[string]string{"prompt.txt": "prompt.txt:2:5: invalid UTF-8 byte 0xff", "data.json": `at /a: \ud800 is one half`} {
		src := "name: x\nversion: 1\nassets: {p: " + asset + "}\nsteps:\n  - id: a\n    kind: noop\n"
		_, err := schemas.Parse("workflow.yaml", []byte(src), schemas.LoadOptions{BaseDir: dir})
		var de *schemas.DefinitionError
		if !errors.As(err, &de) || len(de.Problems) != 1 || de.Problems[0].Path != "/assets/p" || !strings.Contains(de.Problems[0].Message, want) {
			t.Errorf("asset %s: got %v, want a problem at /assets/p saying %q", asset, err, want)
		}
	}
}

// FuzzCheckJSONText compares CheckJSONText with encoding/json, which puts
// U+FFFD in place of every bad sequence it decodes: a document is clean
// exactly when decoding it yields no more U+FFFD than it spells (as UTF-8
// or as \ufffd). A refusal must point at a path of the document and at a
// bad sequence. `go test` runs the seeds; fuzz with
//
//	go test ./schemas -run '^$' -fuzz FuzzCheckJSONText -fuzztime 30s
func FuzzCheckJSONText(f *testing.F) {
	for _, s := range []string{
		`{"a": "b"}`, `{"a": "\ud800"}`, `["\udc00", "\ud83d\ude00"]`, "{\"a\xff\": 1}", `"\\ud800"`,
		`{"a": [1, {"b": "\ufffd"}], "c": "\uD83D\uDE00\uD83D"}`, "[\"\xed\xa0\x80\"]", `{"x": {"y": {"z": ["", "\u0000"]}}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		err := schemas.CheckJSONText(data)
		if !json.Valid(data) {
			if err == nil && !bytes.Equal(data, bytes.ToValidUTF8(data, nil)) {
				t.Fatalf("invalid UTF-8 in invalid JSON passed: %q", data)
			}
			return
		}
		decoded, spelt := replacementCounts(t, data)
		var te *schemas.TextError
		switch {
		case err == nil && decoded != spelt:
			t.Fatalf("CheckJSONText passed %q, which decodes with %d U+FFFD for %d spelt", data, decoded, spelt)
		case err != nil && !errors.As(err, &te):
			t.Fatalf("CheckJSONText(%q) = %v without a TextError", data, err)
		case err != nil && decoded == spelt:
			t.Fatalf("CheckJSONText refused %q (%v), which decodes losslessly", data, err)
		case err != nil:
			if te.Offset < 0 || te.Offset >= len(data) || (data[te.Offset] != '\\' && data[te.Offset] < 0x80) {
				t.Fatalf("offset %d of %q does not start a bad sequence", te.Offset, data)
			}
			if !pointerExists(data, te.Path) {
				t.Fatalf("path %q is not in %q", te.Path, data)
			}
		}
	})
}

// replacementCounts returns how many U+FFFD encoding/json decodes from
// data's strings and member names, and how many data spells itself.
func replacementCounts(t *testing.T, data []byte) (decoded, spelt int) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("decode valid JSON %q: %v", data, err)
		}
		if s, ok := tok.(string); ok {
			decoded += strings.Count(s, "\uFFFD")
		}
	}
	spelt = bytes.Count(data, []byte("\uFFFD"))
	for i := 0; i < len(data); i++ {
		if data[i] != '\\' || i+1 >= len(data) {
			continue
		}
		if data[i+1] == 'u' && i+5 < len(data) && strings.EqualFold(string(data[i+2:i+6]), "fffd") {
			spelt++
		}
		i++ // skip the escaped character
	}
	return decoded, spelt
}

// pointerExists reports whether the JSON Pointer ptr names a value of data.
func pointerExists(data []byte, ptr string) bool {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if dec.Decode(&v) != nil {
		return false
	}
	if ptr == "" {
		return true
	}
	for _, tok := range strings.Split(ptr[1:], "/") {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		switch c := v.(type) {
		case map[string]any:
			var ok bool
			if v, ok = c[tok]; !ok {
				return false
			}
		case []any:
			i, err := strconv.Atoi(tok)
			if err != nil || i < 0 || i >= len(c) {
				return false
			}
			v = c[i]
		default:
			return false
		}
	}
	return true
}

func ExampleCheckJSONText() {
	err := schemas.CheckJSONText([]byte(`{"order": {"note": "thanks \ud83d"}}`))
	var te *schemas.TextError
	if errors.As(err, &te) {
		fmt.Println(te.Path, te.Offset)
		fmt.Println(te.Reason)
	}
	// Output:
	// /order/note 27
	// \ud83d is one half of a UTF-16 surrogate pair, without the other
}
