package engine

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// TestCheckTypesConditions loads workflows whose conditions read state,
// output and vars against declared schemas: a condition that is not a
// boolean, or reads a member a closed schema cannot have, is refused at
// load with its line (it used to fail the job mid-run, after the step's
// side effects); one whose type the schemas leave open gets a warning.
func TestCheckTypesConditions(t *testing.T) {
	t.Parallel()
	const head = `name: w
version: 1
vars: {region: eu}
state_schema:
  type: object
  required: [count, name]
  additionalProperties: false
  properties:
    count: {type: integer}
    name: {type: string}
    tags: {type: array, items: {type: string}}
    meta: {type: object}
    triage: {type: object}
steps:
  - id: classify
    kind: noop
    save_as: triage
    output_schema:
      type: object
      required: [tickets]
      additionalProperties: false
      properties:
        tickets: {type: array, items: {type: object, required: [id], properties: {id: {type: string}}}}
        ok: {type: boolean}
    next:
      - {to: done, when: %q}
  - id: done
    kind: noop
`
	rows := []struct {
		name, when string
		err, warn  string // substrings; "" for none
	}{
		{name: "number comparison", when: "state.count > 2"},
		{name: "boolean of a string", when: "state.name == 'x' && len(state.tags) > 0"},
		{name: "produced member", when: "len(state.triage.tickets) > 0 && state.triage.tickets[0].id != ''"},
		{name: "output member", when: "output.ok"},
		{name: "declared var", when: "vars.region == 'eu' && step == 'classify' && attempt < 3"},
		{name: "membership", when: "'name' in state"},
		{name: "a number is not a boolean", when: "state.count", err: "expected bool, but got float64"},
		{name: "a string is not a boolean", when: "state.name", err: "expected bool, but got string"},
		{name: "a member the closed state cannot have", when: "state.cnt > 2", err: "unknown field cnt"},
		{name: "a member the output cannot have", when: "output.tikets != nil", err: "unknown field tikets"},
		{name: "a member of a produced output it cannot have", when: "state.triage.nope == 1", err: "unknown field nope"},
		{name: "an undeclared var", when: "vars.zone == 'x'", err: "unknown field zone"},
		{name: "an open member", when: "state.meta.flag", warn: "cannot check that this condition gives a boolean"},
		{name: "an open member compared", when: "state.meta.flag == true"},
		{name: "syntax", when: "state.count >", err: "condition does not compile"},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			src := strings.Replace(head, "%q", `"`+strings.ReplaceAll(r.when, `"`, `\"`)+`"`, 1)
			def, err := schemas.Parse("w.yaml", []byte(src), schemas.LoadOptions{Checks: []schemas.CheckFunc{Check}})
			if r.err != "" {
				var de *schemas.DefinitionError
				if !errors.As(err, &de) || len(de.Problems) != 1 {
					t.Fatalf("got %v, want one problem", err)
				}
				p := de.Problems[0]
				if p.Path != "/steps/0/next/0/when" || p.Line != 26 || !strings.Contains(p.Message, r.err) {
					t.Errorf("problem %+v, want %q at /steps/0/next/0/when, line 26", p, r.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			var warns []string
			for _, w := range def.Warnings() {
				warns = append(warns, w.Format("w.yaml"))
			}
			switch {
			case r.warn == "" && len(warns) > 0:
				t.Errorf("unexpected warnings: %v", warns)
			case r.warn != "" && (len(warns) != 1 || !strings.Contains(warns[0], r.warn) || !strings.Contains(warns[0], "w.yaml:26:")):
				t.Errorf("warnings %v, want one at line 26 saying %q", warns, r.warn)
			}
		})
	}
}

// TestCheckWithoutStateSchema types the state from the input schema when
// no state_schema is given, and from what steps save (every step saves
// its output under a name here: a merged output of unknown shape would
// leave the state open).
func TestCheckWithoutStateSchema(t *testing.T) {
	t.Parallel()
	const src = `name: w
version: 1
input_schema:
  type: object
  required: [amount]
  additionalProperties: false
  properties: {amount: {type: integer}}
steps:
  - id: charge
    kind: noop
    save_as: charge
    next: [{to: b, when: %s}]
  - id: b
    kind: noop
    save_as: b
`
	for when, want := range map[string]string{
		"state.amount > 10":     "",
		"state.amount":          "expected bool",
		"state.amont > 10":      "unknown field amont",
		"state.charge.id != ''": "",
		"state.charge.approved": "warning",
		"state.charge != nil":   "",
	} {
		def, err := schemas.Parse("w.yaml", []byte(strings.Replace(src, "%s", `"`+when+`"`, 1)), schemas.LoadOptions{Checks: []schemas.CheckFunc{Check}})
		switch {
		case want == "" && (err != nil || len(def.Warnings()) > 0):
			t.Errorf("%s: %v %v, want accepted", when, err, def)
		case want == "warning" && (err != nil || len(def.Warnings()) != 1):
			t.Errorf("%s: %v, want one warning", when, err)
		case want != "" && want != "warning" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("%s: %v, want %q", when, err, want)
		}
	}
}

// TestCheckAcceptsTheExamples: the shipped examples load without a
// problem or a warning about their conditions.
func TestCheckAcceptsTheExamples(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"examples/quickstart/workflow.yaml", "examples/effects/workflow.yaml", "examples/research/workflow.yaml", "examples/research/file-report.yaml"} {
		path := filepath.Join(testsupport.ModuleRoot(), p)
		if _, err := os.Stat(path); err != nil {
			t.Fatal(err)
		}
		def, err := schemas.Load(path, schemas.LoadOptions{Checks: []schemas.CheckFunc{Check}})
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if w := def.Warnings(); len(w) > 0 {
			t.Errorf("%s: warnings %v", p, w)
		}
	}
}
