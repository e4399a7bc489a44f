package steps_test

import (
	"context"
	"fmt"

	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

func ExampleParseReplyJSON() {
	out, err := steps.ParseReplyJSON("```json\n{\"label\": \"bug\", \"score\": 0.9}\n```")
	fmt.Println(string(out), err)
	_, err = steps.ParseReplyJSON(`{"label": "bug"} Hope this helps!`)
	fmt.Println(err)
	// Output:
	// {"label":"bug","score":0.9} <nil>
	// text after the JSON value
}

func ExampleRegistry_Check() {
	reg := steps.Builtins()
	_ = reg.Register("enrich", steps.Func(func(ctx context.Context, c *steps.Call) (any, error) {
		return map[string]any{"score": 0.9}, nil
	}))
	def, err := schemas.Parse("wf.yaml", []byte(`
name: wf
version: 1
steps:
  - {id: enrich, kind: enrich}
  - {id: score, kind: scorer}
`), schemas.LoadOptions{})
	if err != nil {
		panic(err)
	}
	for _, p := range reg.Check(nil)(def) {
		fmt.Println(p.Path, p.Message)
	}
	// Output:
	// /steps/1/kind unknown step kind "scorer" (known: agent, enrich, http, mcp, model, noop, store); if workers of your own binary register it, allow it with --allow-kind scorer
}
