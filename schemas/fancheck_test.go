package schemas_test

import (
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

// TestParseRefusesBadFans: each bad parallel or for_each step is refused
// at load, with the file, the line and the path of what is wrong.
func TestParseRefusesBadFans(t *testing.T) {
	t.Parallel()
	const head = "name: x\nversion: 1\nsteps:\n"
	par := func(rest string) string {
		return head + "  - id: p\n    kind: parallel\n" + rest
	}
	rows := []located{
		{
			name: "a branch that is not a step",
			src:  par("    branches: [a, ghost]\n  - {id: a, kind: noop, save_as: a}\n"),
			at:   "branches:", path: "/steps/0/branches/1", msg: `branch "ghost" is not a step of this workflow`,
		},
		{
			name: "two branches writing one path",
			src:  par("    branches: [a, b]\n  - {id: a, kind: noop, save_as: out}\n  - {id: b, kind: noop, save_as: out}\n"),
			at:   "branches:", path: "/steps/0/branches/1", msg: `branches "a" and "b" both write state.out`,
		},
		{
			name: "a branch without save_as",
			src:  par("    branches: [a]\n  - {id: a, kind: noop}\n"),
			at:   "branches:", path: "/steps/0/branches/0", msg: `branch "a" has no save_as`,
		},
		{
			name: "a branch reached from elsewhere",
			src:  par("    branches: [a]\n    next: [{to: a}]\n  - {id: a, kind: noop, save_as: a}\n"),
			at:   "branches:", path: "/steps/0/branches/0", msg: `branch "a" is also reached from steps[0].next[0].to`,
		},
		{
			name: "a branch with next",
			src:  par("    branches: [a]\n  - {id: a, kind: noop, save_as: a, next: [{end: true}]}\n"),
			at:   "branches:", path: "/steps/0/branches/0", msg: `branch "a" has next or on_error`,
		},
		{
			name: "a join on a step that is not parallel",
			src:  head + "  - id: a\n    kind: noop\n    join: {mode: first}\n",
			at:   "join:", path: "/steps/0/join", msg: "only a step of kind parallel has a join",
		},
		{
			name: "a join needing more branches than there are",
			src:  par("    branches: [a]\n    join: {mode: n, n: 2}\n  - {id: a, kind: noop, save_as: a}\n"),
			at:   "join:", path: "/steps/0/join/n", msg: "join mode n needs n between 1 and the 1 branches, not 2",
		},
		{
			name: "a map over a path the schema says is not a list",
			src: "name: x\nversion: 1\ninput_schema: {type: object, properties: {docs: {type: object}}}\nsteps:\n" +
				"  - id: m\n    kind: noop\n    save_as: out\n    for_each: {items: docs}\n",
			at: "for_each:", path: "/steps/0/for_each/items", msg: "state.docs is object by the workflow's schema, not a list",
		},
		{
			name: "a map item key that cannot tell items apart",
			src:  head + "  - id: m\n    kind: noop\n    save_as: out\n    for_each: {items: docs, key: \"{{.state.id}}\"}\n",
			at:   "for_each:", path: "/steps/0/for_each/key", msg: "reads neither .item nor .index, so every item would get the same key",
		},
		{
			name: "a map item key reading the state",
			src:  head + "  - id: m\n    kind: noop\n    save_as: out\n    for_each: {items: docs, key: \"{{.state.p}}-{{.index}}\"}\n",
			at:   "for_each:", path: "/steps/0/for_each/key", msg: "reads .state; a key sees only .item and .index",
		},
		{
			name: "a map without save_as",
			src:  head + "  - id: m\n    kind: noop\n    for_each: {items: docs}\n",
			at:   "- id: m", path: "/steps/0/save_as", msg: "a for_each step needs save_as",
		},
		{
			name: "a map of child jobs",
			src:  head + "  - id: m\n    kind: workflow\n    with: {workflow: other}\n    save_as: out\n    for_each: {items: docs}\n",
			at:   "for_each:", path: "/steps/0/for_each", msg: "a workflow step cannot be a map",
		},
		{
			name: "a map path that is not a path",
			src:  head + "  - id: m\n    kind: noop\n    save_as: out\n    for_each: {items: \"docs[0]\"}\n",
			at:   "items:", path: "/steps/0/for_each/items", msg: "",
		},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) { checkLocated(t, r) })
	}
	ok := head + "  - id: p\n    kind: parallel\n    branches: [a, b]\n    join: {mode: first}\n    next: [{to: m}]\n" +
		"  - {id: a, kind: noop, save_as: a}\n  - {id: b, kind: noop, save_as: b}\n" +
		"  - id: m\n    kind: noop\n    save_as: out\n    for_each: {items: a.docs, key: \"{{.item.id}}\", concurrency: 5, on_item_error: collect}\n"
	if _, err := schemas.Parse("ok.yaml", []byte(ok), schemas.LoadOptions{}); err != nil {
		t.Errorf("a good definition was refused: %v", err)
	}
}
