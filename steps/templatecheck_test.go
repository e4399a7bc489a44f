package steps

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"text/template"

	"github.com/waymark-dev/waymark/schemas"
)

func TestTemplateReads(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, text string
		want       []string
	}{
		{"fields", `{{.state.a.b}} {{.vars.region}} {{.job}}`, []string{".state.a.b", ".vars.region", ".job"}},
		{"pipelines and calls", `{{.state.a | json}} {{index .state.items 0}} {{printf "%s" (lower .state.name)}}`, []string{".state.a", ".state.items", ".state.name"}},
		{"with", `{{with .state.order}}{{.id}}{{else}}{{.state.x}}{{end}}`, []string{".state.order", ".state.order.id", ".state.x"}},
		{"range", `{{range .state.items}}{{.sku}} {{$.state.n}}{{end}}`, []string{".state.items", ".state.items[]", ".state.items[].sku", ".state.n"}},
		{"range variables", `{{range $i, $e := .state.items}}{{$e.sku}}{{$i}}{{end}}`, []string{".state.items", ".state.items[]", ".state.items[].sku"}},
		{"variables", `{{$o := .state.order}}{{$o.id}}{{$x := len .state.items}}{{$x}}`, []string{".state.order", ".state.order.id", ".state.items"}},
		{"if", `{{if .state.ok}}{{.state.a}}{{end}}`, []string{".state.ok", ".state.a"}},
		{"define and template", `{{define "sub"}}{{.id}}{{end}}{{template "sub" .state.order}}`, []string{".state.order", ".state.order.id"}},
		{"chain", `{{(.state.order).id}}`, []string{".state.order", ".state.order.id"}},
		{"function results are not followed", `{{(index .state.items 0).sku}}`, []string{".state.items"}},
		{"recursion stops", `{{define "r"}}{{.a}}{{template "r" .b}}{{end}}{{template "r" .state}}`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tm, err := template.New("t").Funcs(templateFuncs(nil)).Parse(tc.text)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, r := range TemplateReads(tm) {
				got = append(got, r.String())
			}
			if tc.want == nil {
				if len(got) == 0 {
					t.Errorf("no reads")
				}
				return
			}
			if strings.Join(got, " ") != strings.Join(tc.want, " ") {
				t.Errorf("reads %v, want %v", got, tc.want)
			}
		})
	}
	if TemplateReads(nil) != nil || TemplateReads(template.New("empty")) != nil {
		t.Error("reads of an unparsed template")
	}
}

// TestCheckTemplatesAgainstTheState loads workflows whose templates read
// state fields through the real loader: a field the closed state schema
// cannot have is refused with its file line and template line (it used to
// fail the step at run time, with missingkey=error), open ones and
// optional ones are warnings.
func TestCheckTemplatesAgainstTheState(t *testing.T) {
	t.Parallel()
	const head = `name: w
version: 1
vars: {region: eu}
state_schema:
  type: object
  required: [order, items]
  additionalProperties: false
  properties:
    order: {type: object, required: [id], additionalProperties: false, properties: {id: {type: string}, note: {type: string}}}
    items: {type: array, items: {type: object, required: [sku], properties: {sku: {type: string}}}}
    name: {type: string}
    extra: {type: object}
    saved: {type: object}
steps:
  - id: save
    kind: noop
    save_as: saved
    output_schema: {type: object, required: [ref], additionalProperties: false, properties: {ref: {type: string}}}
  - id: call
    kind: http
    with:
      url: "http://example.test/{{.state.order.id}}"
      headers:
        X-Thing: |
          first line
          %s
`
	rows := []struct {
		name, text string
		errs       []string
		warns      []string
	}{
		{name: "declared and required", text: `{{.state.order.id}} {{range .state.items}}{{.sku}}{{end}} {{.vars.region}} {{.job}} {{.state.saved.ref}} {{len .state.items}}`},
		{name: "undeclared member of the state", text: `{{.state.ordr.id}}`, errs: []string{`template line 2 reads .state.ordr: it cannot exist: the schema declares no property "ordr"`}},
		{name: "undeclared nested member", text: `{{with .state.order}}{{.total}}{{end}}`, errs: []string{`reads .state.order.total: it cannot exist`}},
		{name: "member of a saved output", text: `{{.state.saved.nope}}`, errs: []string{"reads .state.saved.nope: it cannot exist"}},
		{name: "undeclared var", text: `{{.vars.zone}}`, errs: []string{`the workflow declares no var "zone"`}},
		{name: "unknown data", text: `{{.input.x}}`, errs: []string{"reads .input: templates see .state, .vars, .job"}},
		{name: "member of a string", text: `{{.job.id}}`, errs: []string{"reads .job.id: it cannot exist: the value is of type string"}},
		{name: "range over a string", text: `{{range .state.order.id}}{{end}}`, errs: []string{"template ranges over .state.order.id, which is of type string"}},
		{name: "open member", text: `{{.state.extra.flag}} {{range .state.items}}{{.colour}}{{end}}`, warns: []string{".state.extra.flag, .state.items[].colour cannot be checked at load", ".state.extra may be absent"}},
		{name: "optional member", text: `{{.state.name}} {{.state.order.note}}`, warns: []string{".state.name, .state.order.note may be absent"}},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			src := strings.Replace(head, "%s", r.text, 1)
			def, err := schemas.Parse("w.yaml", []byte(src), schemas.LoadOptions{Checks: []schemas.CheckFunc{Builtins().CheckAnyWorker(nil)}})
			var de *schemas.DefinitionError
			if len(r.errs) > 0 {
				if !errors.As(err, &de) || len(de.Problems) != len(r.errs) {
					t.Fatalf("got %v, want %d problems", err, len(r.errs))
				}
				for i, want := range r.errs {
					p := de.Problems[i]
					if p.Path != "/steps/1/with/headers/X-Thing" || p.Line != 24 || !strings.Contains(p.Message, want) {
						t.Errorf("problem %+v, want %q at /steps/1/with/headers/X-Thing, line 24", p, want)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			ws := def.Warnings()
			if len(ws) != len(r.warns) {
				t.Fatalf("warnings %+v, want %d", ws, len(r.warns))
			}
			for i, want := range r.warns {
				if !ws[i].Warning || ws[i].Path != "/steps/1/with/headers/X-Thing" || !strings.Contains(ws[i].Message, want) {
					t.Errorf("warning %+v, want %q", ws[i], want)
				}
			}
		})
	}
}

// TestCheckTemplatesSeesTheStepsInputSchema: a step's input_schema narrows
// the state its templates see, and idempotency keys are templates too.
func TestCheckTemplatesSeesTheStepsInputSchema(t *testing.T) {
	t.Parallel()
	const src = `name: w
version: 1
steps:
  - id: ask
    kind: model
    idempotency_key: "order-{{.state.order_id}}-{{.state.nope}}"
    input_schema: {type: object, required: [order_id, text], additionalProperties: false, properties: {order_id: {type: string}, text: {type: string}}}
    with: {provider: replay, prompt: "{{.state.text}} {{.state.txt}}"}
`
	_, err := schemas.Parse("w.yaml", []byte(src), schemas.LoadOptions{Checks: []schemas.CheckFunc{Builtins().CheckAnyWorker(nil)}})
	var de *schemas.DefinitionError
	if !errors.As(err, &de) {
		t.Fatalf("got %v", err)
	}
	var got []string
	for _, p := range de.Problems {
		got = append(got, p.Path+" "+p.Message)
	}
	text := strings.Join(got, "\n")
	for _, want := range []string{"/steps/0/idempotency_key template line 1 reads .state.nope", "/steps/0/with/prompt template line 1 reads .state.txt"} {
		if !strings.Contains(text, want) {
			t.Errorf("problems lack %q:\n%s", want, text)
		}
	}
	if strings.Contains(text, ".state.order_id") || strings.Contains(text, ".state.text:") {
		t.Errorf("problems name declared fields:\n%s", text)
	}
}

func TestCollectTemplates(t *testing.T) {
	t.Parallel()
	with := map[string]any{
		"url":     "{{.state.u}}",
		"method":  "{{not a template here}}",
		"headers": map[string]any{"A": "{{.state.a}}", "B": "plain"},
		"body":    map[string]any{"order": map[string]any{"id": "{{.state.id}}"}, "list": []any{"{{.state.l}}", 1}},
	}
	var got []string
	collectTemplates(with, "", templatePaths[schemas.KindHTTP], func(ptr, text string) { got = append(got, ptr) })
	if want := "/body/list/0 /body/order/id /headers/A /url"; strings.Join(got, " ") != want {
		t.Errorf("templates at %v, want %s", got, want)
	}
}

// TestCheckAnyWorker: validation cannot know whether the workers that run
// a model step call the provider or replay a cassette. A step one of them
// can run is accepted, with a warning naming the other; one neither can
// run is refused with both reasons.
func TestCheckAnyWorker(t *testing.T) {
	t.Parallel()
	const src = `name: w
version: 1
assets: {cassette: cassette.json}
steps:
  - id: local
    kind: model
    with: {provider: openai, model: llama3, base_url: "http://localhost:11434/v1", prompt: hi}
  - id: replayed
    kind: model
    with: {provider: anthropic, cassette: cassette, prompt: hi}
  - id: both
    kind: model
    with: {provider: anthropic, model: claude-sonnet-4-5, cassette: cassette, prompt: hi}
  - id: neither
    kind: model
    with: {provider: anthropic, prompt: hi}
  - id: replay-only
    kind: model
    with: {provider: replay, prompt: hi}
`
	def := parseDef(t, src)
	got := Builtins().CheckAnyWorker(&Env{})(def)
	want := []struct {
		path     string
		warning  bool
		contains string
	}{
		{"/steps/0/with", true, "workers that replay (--model-mode replay, or auto without the provider's API key) cannot run this step: provider replay mode needs a cassette"},
		{"/steps/1/with", true, "workers that call the provider (--model-mode live, or auto with the API key) cannot run this step: with.model is required"},
		{"/steps/3/with", false, "no worker can run this step: calling the provider, with.model is required for provider anthropic; replaying, provider replay mode needs a cassette"},
		{"/steps/4/with", false, "provider replay needs a cassette"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %+v, want %d problems", got, len(want))
	}
	for i, w := range want {
		if got[i].Path != w.path || got[i].Warning != w.warning || !strings.Contains(got[i].Message, w.contains) {
			t.Errorf("problem %d = %+v, want %s warning=%v %q", i, got[i], w.path, w.warning, w.contains)
		}
	}
	// The same live-only step, checked for this process's replaying
	// workers (engine run --model-mode replay), is an error.
	if ps := Builtins().Check(&Env{ModelMode: ModelReplay})(def); len(ps) == 0 || ps[0].Path != "/steps/0/with" || ps[0].Warning {
		t.Errorf("Check in replay mode: %+v, want an error for the live-only step", ps)
	}
}

func ExampleTemplateReads() {
	t := template.Must(template.New("prompt").Parse(`Order {{.state.order.id}}:
{{range .state.items}}- {{.sku}} x{{.qty}}
{{end}}`))
	for _, r := range TemplateReads(t) {
		fmt.Println(r)
	}
	// Output:
	// .state.order.id
	// .state.items
	// .state.items[]
	// .state.items[].sku
	// .state.items[].qty
}
