package schemas

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestStateDeltaRoundTrip: a delta applied to its base gives the next
// state's members; a long member is set by reference.
func TestStateDeltaRoundTrip(t *testing.T) {
	t.Parallel()
	long := `"` + strings.Repeat("x", MaxDeltaMember+10) + `"`
	var stored [][]byte
	put := func(v []byte) ValueRef { stored = append(stored, v); return NewValueRef(v) }
	for _, tc := range []struct{ base, next string }{
		{`{}`, `{"a":1}`},
		{`{"a":1,"b":{"c":[1,2]}}`, `{"a":2,"b":{"c":[1,2]},"d":"x"}`},
		{`{"a":1,"b":2}`, `{"b":2}`},
		{`{"a":1}`, `{"a":1}`},
		{`{"a":1}`, `{"a":` + long + `}`},
	} {
		d, err := DiffState(json.RawMessage(tc.base), json.RawMessage(tc.next), put)
		if err != nil {
			t.Fatal(err)
		}
		if tc.base == tc.next {
			if d != nil {
				t.Errorf("%s → %s: delta %s, want none", tc.base, tc.next, d)
			}
			continue
		}
		got, err := ApplyDelta(json.RawMessage(tc.base), d)
		if err != nil {
			t.Fatal(err)
		}
		var g, w map[string]any
		_ = json.Unmarshal(got, &g)
		_ = json.Unmarshal([]byte(tc.next), &w)
		if strings.Contains(tc.next, long) {
			ref, ok := ParseValueRef(mustMember(t, got, "a"))
			if !ok || len(stored) != 1 || !ref.Matches(stored[0]) {
				t.Errorf("long member: %s (stored %d)", got, len(stored))
			}
			continue
		}
		if gb, _ := json.Marshal(g); string(gb) != mustCompact(t, tc.next) {
			t.Errorf("%s + %s = %s, want %s", tc.base, d, got, tc.next)
		}
	}
}

func mustMember(t *testing.T, obj json.RawMessage, name string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(obj, &m); err != nil {
		t.Fatal(err)
	}
	return m[name]
}

func mustCompact(t *testing.T, s string) string {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(v)
	return string(b)
}
