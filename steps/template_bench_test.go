package steps

import (
	"encoding/json"
	"strings"
	"testing"
)

// BenchmarkRenderPrompt measures rendering the quickstart-sized prompt
// over a decoded state of eight reports.
func BenchmarkRenderPrompt(b *testing.B) {
	tpl, err := parseTemplate("bench.prompt", `Triage the {{len .state.reports}} reports below.
{{range .state.reports}}
Report {{.id}}:
{{untrusted (printf "%s\n\n%s" .title .body)}}
{{end}}`, &Env{})
	if err != nil {
		b.Fatal(err)
	}
	var reports []any
	for i := 0; i < 8; i++ {
		reports = append(reports, map[string]any{"id": "BR-" + strings.Repeat("1", i+1), "title": "A title", "body": strings.Repeat("words ", 60)})
	}
	data := map[string]any{"state": map[string]any{"reports": reports}}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := render(tpl, data); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkStateMap measures decoding a 1 KiB state for templates.
func BenchmarkStateMap(b *testing.B) {
	state := json.RawMessage(`{"payload": "` + strings.Repeat("x", 1000) + `", "n": 3}`)
	b.ReportAllocs()
	for b.Loop() {
		c := &Call{State: state}
		if _, err := c.StateMap(); err != nil {
			b.Fatal(err)
		}
	}
}
