package steps

import (
	"encoding/json"
	"net/http"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

// injection is a string in state that tries to add a field to a body.
const injection = `x", "amount": 1, "admin": true, "y": "`

// bodyState holds the injection attempt and values of each JSON type.
var bodyState = func() string {
	b, _ := json.Marshal(map[string]any{"title": injection, "amount": 4999, "ratio": 0.25, "paid": true, "none": nil,
		"tags": []string{"a", "b"}, "customer": map[string]any{"id": "c-1", "vip": false}, "numstr": "12"})
	return string(b)
}()

// renderBody compiles with.body (given as JSON) and renders it over
// bodyState.
func renderBody(t *testing.T, withBody string, env *Env) ([]byte, error) {
	t.Helper()
	b, err := compileBody("s", json.RawMessage(withBody), env)
	if err != nil {
		return nil, err
	}
	def := &schemas.Definition{Name: "b", Version: 1, Steps: []schemas.Step{{ID: "s", Kind: schemas.KindHTTP}}}
	c := newCall(def, "s", bodyState)
	data, err := c.TemplateData()
	if err != nil {
		t.Fatal(err)
	}
	return b.render(c, env, data)
}

func TestStructuredBody(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body string
		want       any // decoded
	}{
		{name: "string leaves are strings, escaped", body: `{"title": "{{.state.title}}", "label": "Order: {{.state.title}}!"}`,
			want: map[string]any{"title": injection, "label": "Order: " + injection + "!"}},
		{name: "json alone is typed", body: `{"amount": "{{json .state.amount}}", "ratio": "{{json .state.ratio}}", "paid": "{{json .state.paid}}", "none": "{{json .state.none}}", "tags": "{{json .state.tags}}", "customer": "{{json .state.customer}}"}`,
			want: map[string]any{"amount": 4999.0, "ratio": 0.25, "paid": true, "none": nil, "tags": []any{"a", "b"}, "customer": map[string]any{"id": "c-1", "vip": false}}},
		{name: "piped into json", body: `{"amount": "{{.state.amount | json}}"}`, want: map[string]any{"amount": 4999.0}},
		{name: "json of an injection attempt is a string", body: `{"title": "{{json .state.title}}"}`, want: map[string]any{"title": injection}},
		{name: "a number as text stays text", body: `{"n": "{{.state.amount}}", "s": "{{.state.numstr}}"}`, want: map[string]any{"n": "4999", "s": "12"}},
		{name: "literals", body: `{"n": 5, "f": -1.5e3, "t": true, "z": null, "s": "plain", "e": "", "a": [], "o": {}}`,
			want: map[string]any{"n": 5.0, "f": -1500.0, "t": true, "z": nil, "s": "plain", "e": "", "a": []any{}, "o": map[string]any{}}},
		{name: "nested", body: `{"order": {"items": [{"name": "{{.state.title}}", "qty": 2}, "{{json .state.customer.id}}"]}}`,
			want: map[string]any{"order": map[string]any{"items": []any{map[string]any{"name": injection, "qty": 2.0}, "c-1"}}}},
		{name: "a top-level array", body: `["{{.state.title}}", "{{json .state.amount}}"]`, want: []any{injection, 4999.0}},
		{name: "control actions in a string leaf", body: `{"who": "{{if .state.paid}}paid{{else}}due{{end}} {{range .state.tags}}[{{.}}]{{end}}"}`,
			want: map[string]any{"who": "paid [a][b]"}},
		{name: "json nested in printf makes a string", body: `{"j": "{{printf \"%s\" (json .state.tags)}}"}`, want: map[string]any{"j": `["a","b"]`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			raw, err := renderBody(t, tt.body, nil)
			if err != nil {
				t.Fatalf("render: %v", err)
			}
			var got any
			if err := json.Unmarshal(raw, &got); err != nil {
				t.Fatalf("rendered body %s is not JSON: %v", raw, err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("body = %s, want %v", raw, tt.want)
			}
		})
	}
}

func TestBodyRefusesAmbiguousForms(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body string
		want       []string
	}{
		{name: "json with text around it", body: `{"order": {"amount": "{{json .state.amount}} cents"}}`,
			want: []string{"with.body.order.amount", "{{json .state.amount}} inserts a typed value only when it is the whole string", "'{{json .state.amount}}'"}},
		{name: "json with a space before it", body: `{"amount": " {{json .state.amount}}"}`, want: []string{"with.body.amount", "whole string"}},
		{name: "two json actions", body: `{"a": "{{json .state.amount}}{{json .state.paid}}"}`, want: []string{"with.body.a"}},
		{name: "json inside a branch", body: `{"a": "{{if .state.paid}}{{json .state.amount}}{{end}}"}`, want: []string{"with.body.a"}},
		{name: "json in an array item", body: `{"items": ["ok", "n={{json .state.amount}}"]}`, want: []string{"with.body.items[1]"}},
		{name: "a key with a template", body: `{"{{.state.title}}": 1}`, want: []string{"with.body", "object keys are written as they are"}},
		{name: "an odd key names the path", body: `{"my key": {"x": "{{json .a}}!"}}`, want: []string{`with.body["my key"].x`}},
		{name: "a duplicate key", body: `{"a": 1, "a": 2}`, want: []string{`key "a" appears twice`}},
		{name: "a broken template", body: `{"a": "{{.state"}`, want: []string{"template s.body.a"}},
		{name: "secret with a computed name", body: `{"a": "{{secret .state.title}}"}`, want: []string{"the name given to secret must be written out"}},
		{name: "secret with a bad name", body: `{"a": "{{secret \"../x\"}}"}`, want: []string{`secret name "../x"`}},
		{name: "secret piped", body: `{"a": "{{\"K\" | secret}}"}`, want: []string{`call secret as {{secret "NAME"}}`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := compileBody("s", json.RawMessage(tt.body), nil)
			if err == nil {
				t.Fatalf("compileBody(%s) = nil error", tt.body)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestStringBody(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body string
		want       any    // decoded, when it renders
		wantErr    string // at render
	}{
		{name: "inside a string the text is escaped", body: `{"title": "{{.state.title}}", "n": 1}`, want: map[string]any{"title": injection, "n": 1.0}},
		{name: "part of a string", body: `{"label": "Order \"{{.state.title}}\" {{.state.customer.id}}"}`, want: map[string]any{"label": `Order "` + injection + `" c-1`}},
		{name: "json where a value belongs", body: `{"title": {{json .state.title}}, "tags": {{json .state.tags}}}`, want: map[string]any{"title": injection, "tags": []any{"a", "b"}}},
		{name: "a number where a value belongs", body: `{"amount": {{.state.amount}}, "paid": {{.state.paid}}, "arr": [{{.state.ratio}}, 2]}`,
			want: map[string]any{"amount": 4999.0, "paid": true, "arr": []any{0.25, 2.0}}},
		{name: "a string where a value belongs fails at the call", body: `{"title": {{.state.title}}}`,
			wantErr: "{{.state.title}} at s.body:1:12 stands where a JSON value belongs, so it must print a number, true, false or null"},
		{name: "a string of JSON where a value belongs fails too", body: `{"n": {{.state.numstr}}, "o": {{.state.customer}}}`,
			wantErr: "{{.state.customer}}"},
		{name: "a constant body", body: `{"closed": true}`, want: map[string]any{"closed": true}},
		{name: "trim markers", body: "{\"a\": \"{{- .state.customer.id -}}\" }", want: map[string]any{"a": "c-1"}},
		{name: "comments", body: `{"a": 1 {{/* note */}}}`, want: map[string]any{"a": 1.0}},
		{name: "escapes around an action", body: `{"a": "\"\\{{.state.customer.id}}\u0041"}`, want: map[string]any{"a": `"\c-1A`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			text, _ := json.Marshal(tt.body)
			raw, err := renderBody(t, string(text), nil)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("render = %s, %v; want an error containing %q", raw, err, tt.wantErr)
				}
				if strings.Contains(err.Error(), "admin") || strings.Contains(err.Error(), "c-1") {
					t.Errorf("error %q quotes what the action printed", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("render: %v", err)
			}
			var got any
			if err := json.Unmarshal(raw, &got); err != nil {
				t.Fatalf("rendered body %s is not JSON: %v", raw, err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("body = %s, want %v", raw, tt.want)
			}
		})
	}
}

func TestStringBodyRefusedAtLoad(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body, want string
	}{
		{name: "in a key", body: `{"{{.state.k}}": 1}`, want: "{{.state.k}} at s.body:1:4 is inside an object key"},
		{name: "where a key belongs", body: `{"a": 1, {{json .state.k}}: 2}`, want: "stands where an object key belongs"},
		{name: "after a value", body: `{"a": "x" {{json .state.k}}}`, want: "follows a complete value"},
		{name: "joined to a number", body: `{"a": 1{{.state.n}}}`, want: "joins the value written before it"},
		{name: "after a backslash", body: `{"a": "x\{{.state.k}}"}`, want: "follows a backslash inside a string"},
		{name: "inside a unicode escape", body: `{"a": "\u00{{.state.k}}"}`, want: "follows a backslash"},
		{name: "json inside a string", body: `{"a": "{{json .state.k}}"}`, want: "is inside a string, where it would insert JSON text"},
		{name: "after the body", body: `{"a": 1} {{json .state.k}}`, want: "follows a complete value"},
		{name: "after text that is not JSON", body: `{'a': {{json .state.k}}}`, want: "follows text that is not JSON"},
		{name: "range", body: `[{{range .state.tags}}{{json .}},{{end}}]`, want: "a string body takes plain actions only"},
		{name: "if", body: `{"a": {{if .state.paid}}1{{else}}2{{end}}}`, want: "a string body takes plain actions only"},
		{name: "a variable", body: `{"a": {{$x := 1}}{{$x}}}`, want: "variables are not allowed in a string body"},
		{name: "define", body: `{{define "x"}}1{{end}}{"a": 1}`, want: "{{define}} and {{block}} are not allowed"},
		{name: "an unfinished body", body: `{"a": {{json .state.k}}`, want: "not one complete JSON value"},
		{name: "a constant that is not JSON", body: `{"a": }`, want: "with.body is not JSON"},
		{name: "secret in a key", body: `{"{{secret "KEY1"}}": 1}`, want: "inside an object key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			text, _ := json.Marshal(tt.body)
			_, err := compileBody("s", json.RawMessage(text), nil)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("compileBody(%q) = %v, want an error containing %q", tt.body, err, tt.want)
			}
			if !strings.HasPrefix(err.Error(), "with.body") && !strings.Contains(err.Error(), "template s.body") {
				t.Errorf("error %q does not name with.body", err)
			}
		})
	}
}

// TestHTTPBodyInjectionArrivesAsAString: a title in state that tries to
// add fields reaches the server as one string field, in both body forms.
func TestHTTPBodyInjectionArrivesAsAString(t *testing.T) {
	t.Parallel()
	def := parseDef(t, `
name: inject
version: 1
steps:
  - id: structured
    kind: http
    with:
      url: '{{service "tickets"}}/tickets'
      body:
        title: '{{.state.title}}'
        amount: '{{json .state.amount}}'
  - id: text
    kind: http
    with:
      url: '{{service "tickets"}}/tickets'
      body: '{"title": "{{.state.title}}", "amount": {{json .state.amount}}}'
`)
	for _, step := range []string{"structured", "text"} {
		t.Run(step, func(t *testing.T) {
			t.Parallel()
			b := setupHTTP(t, replyJSON(http.StatusCreated, `{"id": "T-1"}`))
			c := newCall(def, step, `{"title": "Crash\", \"amount\": 1, \"admin\": true, \"x\": \"", "amount": 4999}`)
			if _, err := mustPrepare(t, def, step, b.env).Run(t.Context(), c); err != nil {
				t.Fatalf("Run: %v", err)
			}
			reqs := b.requests()
			if len(reqs) != 1 {
				t.Fatalf("server got %d requests", len(reqs))
			}
			var got map[string]any
			if err := json.Unmarshal(reqs[0].Body, &got); err != nil {
				t.Fatalf("body %s: %v", reqs[0].Body, err)
			}
			want := map[string]any{"title": `Crash", "amount": 1, "admin": true, "x": "`, "amount": 4999.0}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("server got %s, want the title as one string and amount 4999", reqs[0].Body)
			}
		})
	}
}

// FuzzStringBody: whatever text a string body holds around an action in a
// string and one where a value belongs, and whatever string the data
// holds, a body that compiles renders JSON of the same shape as with
// harmless data: data never adds structure.
func FuzzStringBody(f *testing.F) {
	for _, s := range []struct{ body, data string }{
		{`{"a": "{{.state.s}}", "b": {{json .state.s}}}`, `x", "b": 1, "c": "`},
		{`["{{.state.s}}", {{json .state.s}}, {{.state.s}}]`, `1, 2`},
		{`{"a": "\\{{.state.s}}"}`, `"`},
		{`{"k": {"{{.state.s}}": 1}}`, `}`},
		{`{"a": {{.state.s}} }`, `true, "x": 1`},
	} {
		f.Add(s.body, s.data)
	}
	f.Fuzz(func(t *testing.T, text, data string) {
		raw, _ := json.Marshal(text)
		b, err := compileBody("f", raw, nil)
		if err != nil || b == nil {
			return
		}
		def := &schemas.Definition{Name: "f", Version: 1, Steps: []schemas.Step{{ID: "f", Kind: schemas.KindHTTP}}}
		render := func(s string) ([]byte, error) {
			state, _ := json.Marshal(map[string]any{"s": s})
			c := newCall(def, "f", string(state))
			d, err := c.TemplateData()
			if err != nil {
				t.Fatal(err)
			}
			return b.render(c, nil, d)
		}
		ref, err := render("1")
		if err != nil {
			return // the text itself does not make a body
		}
		got, err := render(data)
		if err != nil {
			return // refused at the call: nothing is sent
		}
		if !json.Valid(got) {
			t.Fatalf("body %q with data %q rendered %s, not JSON", text, data, got)
		}
		if shape(t, got) != shape(t, ref) {
			t.Fatalf("body %q: data %q changed its shape: %s, with harmless data %s", text, data, got, ref)
		}
	})
}

// shape is a JSON value's structure: keys and types, not values.
func shape(t *testing.T, raw []byte) string {
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	var walk func(any) string
	walk = func(v any) string {
		switch v := v.(type) {
		case map[string]any:
			keys := make([]string, 0, len(v))
			for k := range v {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			s := "{"
			for _, k := range keys {
				s += strconv.Quote(k) + ":" + walk(v[k]) + ","
			}
			return s + "}"
		case []any:
			s := "["
			for _, x := range v {
				s += walk(x) + ","
			}
			return s + "]"
		case string:
			return "s"
		}
		return "v" // a number, bool or null: a scalar where the template allows one
	}
	return walk(v)
}
