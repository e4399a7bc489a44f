package engine

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// benchJob is a running job of a ten-step chain with a 1 KiB state, at
// step s3, and a definition whose step s3 has a condition and a state
// schema (the costly path of the eligibility decision).
func benchJob(b *testing.B, conditions bool) (*compiled, *schemas.Checkpoint) {
	b.Helper()
	var y strings.Builder
	y.WriteString("name: bench\nversion: 1\n")
	if conditions {
		y.WriteString("state_schema: {type: object, required: [payload], properties: {payload: {type: string}, n: {type: number}}}\n")
	}
	y.WriteString("steps:\n")
	for i := 1; i <= 10; i++ {
		y.WriteString("  - id: s" + itoa(i) + "\n    kind: noop\n")
		if i < 10 {
			if conditions {
				y.WriteString("    next: [{to: s1, when: 'state.n > 100'}, {to: s" + itoa(i+1) + "}]\n")
			} else {
				y.WriteString("    next: [{to: s" + itoa(i+1) + "}]\n")
			}
		}
	}
	def, err := schemas.Parse("bench.yaml", []byte(y.String()), schemas.LoadOptions{Checks: []schemas.CheckFunc{Check}})
	if err != nil {
		b.Fatal(err)
	}
	c, err := compile(def)
	if err != nil {
		b.Fatal(err)
	}
	now := time.Now()
	cp, _, err := newJob(c, &schemas.StartRequest{JobID: "job-1", DefinitionHash: def.Hash,
		Input: json.RawMessage(`{"n": 1, "payload": "` + strings.Repeat("x", 1024) + `"}`)}, "start", now)
	if err != nil {
		b.Fatal(err)
	}
	return c, cp
}

func itoa(n int) string { return strconv.Itoa(n) }

// BenchmarkApplyResult measures the eligibility decision: apply one step's
// result to a checkpoint and pick the next step.
func BenchmarkApplyResult(b *testing.B) {
	for _, tc := range []struct {
		name       string
		conditions bool
		output     string
	}{
		{"chain/empty-output", false, `{}`},
		{"chain/merge-output", false, `{"score": 0.9}`},
		{"conditions+state-schema", true, `{"n": 2}`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			c, base := benchJob(b, tc.conditions)
			res := &schemas.StepResult{Job: "job-1", Step: "s1", Attempt: 1, Output: json.RawMessage(tc.output)}
			now := time.Now()
			b.ReportAllocs()
			for b.Loop() {
				cp := cloneCheckpoint(base)
				if out, _ := applyResult(c, cp, res, now); out != outcomeApplied {
					b.Fatal("not applied")
				}
			}
		})
	}
}
