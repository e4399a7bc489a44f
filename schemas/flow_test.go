package schemas_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// flowSrc is a workflow with every flow setting.
const flowSrc = `name: orders
version: 1
pools:
  payments:
    rate_limit: {limit: 10, period: 1s}
    priority: 7
steps:
  - id: charge
    kind: noop
    pool: payments
    concurrency: {limit: 2, key: "{{.state.customer}}"}
    rate_limit: {limit: 5, period: 1m, key: "{{.state.customer}}"}
  - id: notify
    kind: noop
    priority: 50
`

func TestParseFlowSettings(t *testing.T) {
	t.Parallel()
	def, err := schemas.Parse("orders.yaml", []byte(flowSrc), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	charge, notify := def.Step("charge"), def.Step("notify")
	if c := charge.Concurrency; c == nil || c.Limit != 2 || c.Key != "{{.state.customer}}" {
		t.Errorf("charge concurrency = %+v", c)
	}
	if r := charge.RateLimit; r == nil || r.Limit != 5 || time.Duration(r.Period) != time.Minute {
		t.Errorf("charge rate_limit = %+v", r)
	}
	if p := def.Pools["payments"]; p.RateLimit == nil || p.RateLimit.Limit != 10 || p.Priority != 7 {
		t.Errorf("pool payments = %+v", p)
	}
	if got := def.PriorityOf(charge); got != 7 {
		t.Errorf("priority of charge = %d, want its pool's 7", got)
	}
	if got := def.PriorityOf(notify); got != 50 {
		t.Errorf("priority of notify = %d, want its own 50", got)
	}
	if !def.HasFlow() {
		t.Error("HasFlow = false")
	}
	plain, err := schemas.Parse("p.yaml", []byte("name: p\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n"), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if plain.HasFlow() {
		t.Error("HasFlow = true for a workflow without limits")
	}
	// The settings are part of the definition's content: another limit is
	// another definition.
	other, err := schemas.Parse("orders.yaml", []byte(strings.Replace(flowSrc, "limit: 2", "limit: 3", 1)), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if other.Hash == def.Hash {
		t.Error("a changed concurrency limit kept the definition's hash")
	}
}

func TestParseFlowRefused(t *testing.T) {
	t.Parallel()
	head := "name: x\nversion: 1\n"
	step := func(extra string) string {
		return head + "steps:\n  - id: a\n    kind: noop\n" + extra
	}
	rows := []located{
		{name: "concurrency limit 0", src: step("    concurrency: {limit: 0}\n"),
			at: "limit: 0", col: true, path: "/steps/0/concurrency/limit", msg: "must be >= 1"},
		{name: "concurrency without limit", src: step("    concurrency:\n      key: \"{{.state.c}}\"\n"),
			at: "concurrency:", col: true, path: "/steps/0/concurrency", msg: "missing properties: 'limit'"},
		{name: "concurrency over the bound", src: step("    concurrency: {limit: 5000}\n"),
			at: "limit: 5000", col: true, path: "/steps/0/concurrency/limit", msg: "must be <= 1000"},
		{name: "bad concurrency key template", src: step("    concurrency:\n      limit: 2\n      key: \"{{.state.c\"\n"),
			at: "key:", col: true, path: "/steps/0/concurrency/key", msg: "concurrency.key"},
		{name: "rate period not a duration", src: step("    rate_limit: {limit: 3, period: fortnight}\n"),
			at: "period: fortnight", col: true, path: "/steps/0/rate_limit/period", msg: "does not match pattern"},
		{name: "rate period too short", src: step("    rate_limit:\n      limit: 3\n      period: 10ms\n"),
			at: "period:", col: true, path: "/steps/0/rate_limit/period", msg: "shorter than 1s"},
		{name: "rate limit 0", src: step("    rate_limit: {limit: 0, period: 1s}\n"),
			at: "limit: 0", col: true, path: "/steps/0/rate_limit/limit", msg: "must be >= 1"},
		{name: "rate without period", src: step("    rate_limit: {limit: 3}\n"),
			at: "rate_limit:", col: true, path: "/steps/0/rate_limit", msg: "missing properties: 'period'"},
		{name: "priority out of range", src: step("    priority: 101\n"),
			at: "priority:", col: true, path: "/steps/0/priority", msg: "must be <= 100"},
		{name: "unknown pool key", src: head + "pools:\n  fast:\n    rate_limit: {limit: 3, period: 1s}\n    weight: 2\nsteps:\n  - id: a\n    kind: noop\n",
			at: "weight:", col: true, path: "/pools/fast/weight", msg: `unknown field "weight"`},
		{name: "bad pool name", src: head + "pools:\n  Fast:\n    priority: 2\nsteps:\n  - id: a\n    kind: noop\n",
			at: "Fast:", col: true, path: "/pools/Fast", msg: "does not match pattern"},
		{name: "keyed pool rate limit", src: head + "pools:\n  fast:\n    rate_limit:\n      limit: 3\n      period: 1s\n      key: \"{{.job}}\"\nsteps:\n  - id: a\n    kind: noop\n",
			at: "key:", col: true, path: "/pools/fast/rate_limit/key", msg: "a pool's rate limit has no key"},
		{name: "concurrency on an engine step", src: head + "steps:\n  - id: a\n    kind: sleep\n    with: {duration: 1s}\n    concurrency: {limit: 1}\n",
			at: "concurrency:", col: true, path: "/steps/0/concurrency", msg: "the engine performs it"},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			checkLocated(t, r)
		})
	}
}

func TestRenderFlowKey(t *testing.T) {
	t.Parallel()
	tmpl, err := schemas.ParseFlowKey("charge", "concurrency.key", "{{.state.customer}}")
	if err != nil {
		t.Fatal(err)
	}
	got, err := schemas.RenderFlowKey(tmpl, "j1", json.RawMessage(`{"customer":"acme"}`), nil)
	if err != nil || got != "acme" {
		t.Fatalf("RenderFlowKey = %q, %v", got, err)
	}
	if _, err := schemas.RenderFlowKey(tmpl, "j1", json.RawMessage(`{}`), nil); err == nil {
		t.Error("a missing state member rendered")
	}
	if a, b := schemas.FlowKeyDigest("acme"), schemas.FlowKeyDigest("acme2"); a == b || len(a) != 16 || schemas.FlowKeyDigest("") != "_" {
		t.Errorf("FlowKeyDigest: %q %q", a, b)
	}
	if a, b := schemas.FlowLimitID("w.x", "s"), schemas.FlowLimitID("w_x", "s"); a == b || strings.ContainsAny(a, ".*> ") {
		t.Errorf("FlowLimitID: %q %q", a, b)
	}
}
