package schemas_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/waymark-dev/waymark/schemas"
)

const triggerBase = `name: orders
version: 1
steps:
  - id: take
    kind: noop
triggers:
`

// TestTriggerLoaderErrors: bad trigger rules are refused by the loader
// with the line and column of the field at fault.
func TestTriggerLoaderErrors(t *testing.T) {
	t.Parallel()
	rows := []located{
		{name: "filter does not compile", src: triggerBase + "  - name: a\n    type: x\n    filter: event.type ==\n",
			at: "filter:", col: true, path: "/triggers/0/filter", msg: "filter does not compile"},
		{name: "filter names an unknown variable", src: triggerBase + "  - name: a\n    type: x\n    filter: evnt.type == \"x\"\n",
			at: "filter:", col: true, path: "/triggers/0/filter", msg: "unknown name evnt"},
		{name: "filter is not a boolean", src: triggerBase + "  - name: a\n    type: x\n    filter: '\"text\"'\n",
			at: "filter:", path: "/triggers/0/filter", msg: "filter does not compile"},
		{name: "input member does not compile", src: triggerBase + "  - name: a\n    type: x\n    input:\n      order: event.data.(\n",
			at: "order:", col: true, path: "/triggers/0/input/order", msg: "input.order does not compile"},
		{name: "whole input does not compile", src: triggerBase + "  - name: a\n    type: x\n    input: 'event.data +'\n",
			at: "input:", path: "/triggers/0/input", msg: "input does not compile"},
		{name: "duplicate name", src: triggerBase + "  - name: a\n    type: x\n  - name: a\n    type: y\n",
			at: "name: a\n    type: y", path: "/triggers/1/name", msg: "duplicate trigger name"},
		{name: "star inside a pattern", src: triggerBase + "  - name: a\n    type: com.*.created\n",
			at: "type: com", path: "/triggers/0/type", msg: "'*' may only end a pattern"},
		{name: "no type", src: triggerBase + "  - name: a\n    source: /s\n",
			at: "name: a", path: "/triggers/0", msg: "type"},
		{name: "unknown field", src: triggerBase + "  - name: a\n    type: x\n    when: true\n",
			at: "when:", path: "/triggers/0/when", msg: `unknown field "when"`},
		{name: "bad name", src: triggerBase + "  - name: 9lives\n    type: x\n",
			at: "name: 9lives", path: "/triggers/0/name", msg: "pattern"},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			checkLocated(t, r)
		})
	}
}

// TestTriggerMatchMapAndID: patterns, filters, the two input forms and the
// job id derived from the event.
func TestTriggerMatchMapAndID(t *testing.T) {
	t.Parallel()
	src := triggerBase + `  - name: created
    type: com.example.order.*
    source: /shop/*
    subject: eu
    filter: event.data.amount >= vars.min
    input: {order: event.data.id, big: event.data.amount > 100, channel: event.extensions.channel}
  - name: whole
    type: com.example.ping
vars: {min: "0"}
`
	def, err := schemas.Parse("w.yaml", []byte(strings.Replace(src, "vars.min", "float(vars.min)", 1)), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := schemas.CompileTrigger(def.Triggers[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct {
		typ, source, subject string
		want                 bool
	}{
		{"com.example.order.created", "/shop/eu", "eu", true},
		{"com.example.order.", "/shop/", "eu", true},
		{"com.example.orders", "/shop/eu", "eu", false},
		{"com.example.order.created", "/warehouse", "eu", false},
		{"com.example.order.created", "/shop/eu", "us", false},
		{"com.example.order.created", "/shop/eu", "", false},
	} {
		if got := c.Matches(m.typ, m.source, m.subject); got != m.want {
			t.Errorf("Matches(%q, %q, %q) = %v, want %v", m.typ, m.source, m.subject, got, m.want)
		}
	}
	env := schemas.TriggerEnv{Event: map[string]any{"data": map[string]any{"id": "o-1", "amount": 150.0}, "extensions": map[string]any{"channel": "web"}}, Vars: def.Vars}
	if ok, err := c.Accepts(env); !ok || err != nil {
		t.Fatalf("Accepts = %v, %v", ok, err)
	}
	in, err := c.Map(env)
	if err != nil || string(in) != `{"big":true,"channel":"web","order":"o-1"}` {
		t.Fatalf("Map = %s, %v", in, err)
	}
	whole, err := schemas.CompileTrigger(def.Triggers[1])
	if err != nil {
		t.Fatal(err)
	}
	if in, err := whole.Map(schemas.TriggerEnv{Event: map[string]any{"data": "text"}}); !errors.Is(err, schemas.ErrInputInvalid) || !strings.Contains(err.Error(), "must be a JSON object") {
		t.Fatalf("Map of text data = %s, %v; want input_invalid", in, err)
	}
	if in, err := whole.Map(schemas.TriggerEnv{Event: map[string]any{}}); err != nil || string(in) != "{}" {
		t.Fatalf("Map without data = %s, %v; want {}", in, err)
	}
	if _, err := c.Accepts(schemas.TriggerEnv{Event: map[string]any{"data": "text"}, Vars: def.Vars}); !errors.Is(err, schemas.ErrInputInvalid) {
		t.Fatalf("a filter failing on the event: %v, want input_invalid", err)
	}
	a, b := schemas.TriggerJobID("orders", "created", "/shop", "1"), schemas.TriggerJobID("orders", "created", "/shop", "1")
	if a != b || !strings.HasPrefix(a, "orders-created-") || len(a) != len("orders-created-")+16 {
		t.Fatalf("TriggerJobID = %q and %q", a, b)
	}
	if schemas.TriggerJobID("orders", "created", "/other", "1") == a || schemas.TriggerJobID("orders", "created", "/shop1", "") == schemas.TriggerJobID("orders", "created", "/shop", "1") {
		t.Fatal("TriggerJobID: distinct events share an id")
	}
	long := schemas.TriggerJobID(strings.Repeat("w", 64), strings.Repeat("t", 64), "/s", "1")
	if len(long) > 128 {
		t.Fatalf("TriggerJobID is %d characters", len(long))
	}
	if schemas.EventKey("/s", "1") == schemas.EventKey("/s1", "") {
		t.Fatal("EventKey: distinct events share a key")
	}
	// Triggers survive the round trip through the stored form.
	again, err := schemas.DecodeDefinition(def.Canonical())
	if err != nil || len(again.Triggers) != 2 || again.Hash != def.Hash {
		t.Fatalf("decode: %v %+v", err, again)
	}
	raw, _ := json.Marshal(again.Triggers[0])
	if !strings.Contains(string(raw), `"filter":"event.data.amount \u003e= float(vars.min)"`) {
		t.Errorf("stored trigger %s", raw)
	}
}
