package schemas

import (
	"encoding/json"
	"strings"
	"testing"
)

// BenchmarkValidate measures a state schema check of a 1 KiB state, from
// bytes (decode included) and from an already decoded value.
func BenchmarkValidate(b *testing.B) {
	v, err := CompileSchema("state", json.RawMessage(`{
		"type": "object", "required": ["payload", "items"],
		"properties": {
			"payload": {"type": "string", "maxLength": 4096},
			"items": {"type": "array", "items": {"type": "object", "required": ["id", "severity"],
				"properties": {"id": {"type": "string", "pattern": "^[A-Z]+-[0-9]+$"}, "severity": {"enum": ["low", "high"]}}}}
		}}`))
	if err != nil {
		b.Fatal(err)
	}
	doc := []byte(`{"payload": "` + strings.Repeat("x", 900) + `", "items": [{"id": "BR-1", "severity": "low"}, {"id": "BR-2", "severity": "high"}]}`)
	b.Run("json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := v.ValidateJSON(doc); err != nil {
				b.Fatal(err)
			}
		}
	})
	var decoded any
	_ = json.Unmarshal(doc, &decoded)
	b.Run("decoded", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := v.Validate(decoded); err != nil {
				b.Fatal(err)
			}
		}
	})
}
