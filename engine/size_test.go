package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// TestCheckpointSizeDoesNotGrowWithStepsDone runs a 10-step and a
// 1,000-step chain on the same 1 KiB state: the longer job's final
// checkpoint must stay under twice the shorter's (issue 4's target), since
// history lives in the history stream and steps done are kept as ranges.
func TestCheckpointSizeDoesNotGrowWithStepsDone(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(*schemas.StepMessage) (json.RawMessage, *schemas.Error) { return json.RawMessage(`{}`), nil })
	input := fmt.Sprintf(`{"payload": %q}`, strings.Repeat("x", 1024))
	sizes := map[int]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, n := range []int{10, 1000} {
		def := b.define(testsupport.NoopChain(fmt.Sprintf("chain%d", n), n))
		id := b.start(def, input, fmt.Sprintf("chain-%d", n))
		wg.Add(1)
		go func() {
			defer wg.Done()
			v := b.wait(id)
			if v.Status != schemas.JobCompleted {
				t.Errorf("%s: %s %v", id, v.Status, v.Error)
				return
			}
			for _, s := range v.Steps {
				if s.Status != schemas.StepCompleted || s.Attempts != 1 {
					t.Errorf("%s step %s: %s after %d attempts in the view", id, s.ID, s.Status, s.Attempts)
					return
				}
			}
			ent, err := b.store.Checkpoints.Get(context.Background(), id)
			if err != nil {
				t.Error(err)
				return
			}
			data, err := b.store.Checkpoints.Encode(ent.Checkpoint)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			sizes[n] = len(data)
			mu.Unlock()
		}()
	}
	wg.Wait()
	t.Logf("final checkpoint: 10 steps %d bytes, 1000 steps %d bytes", sizes[10], sizes[1000])
	if sizes[1000] >= 2*sizes[10] {
		t.Errorf("1000-step checkpoint %d bytes, 10-step %d: want under 2x", sizes[1000], sizes[10])
	}
}

const loopWorkflow = `
name: loop
version: 1
steps:
  - id: a
    kind: noop
    next: [{to: b}]
  - id: b
    kind: noop
    next:
      - {to: a, when: "output.again"}
`

// TestLoopGetsItsStepRecordBack: a step done without incident is folded
// into the checkpoint's ranges; entering it again restores its record, so
// runs and attempts go on counting and every dispatch keeps its own id.
func TestLoopGetsItsStepRecordBack(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	var mu sync.Mutex
	seen := map[string]int{}
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		mu.Lock()
		defer mu.Unlock()
		seen[fmt.Sprintf("%s@%d", sm.Step, sm.Attempt)]++
		if sm.Step == "b" && seen["b@1"] == 1 && sm.Attempt == 1 {
			return json.RawMessage(`{"again": true}`), nil
		}
		return json.RawMessage(`{"again": false}`), nil
	})
	def := b.define(loopWorkflow)
	v := b.wait(b.start(def, `{}`, "loop-1"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("%s: %v", v.Status, v.Error)
	}
	for _, id := range []string{"a", "b"} {
		if s := stepOf(v, id); s.Status != schemas.StepCompleted || s.Runs != 2 || s.Attempts != 2 {
			t.Errorf("step %s: %s, %d runs, %d attempts; want completed after 2 runs of 1 attempt", id, s.Status, s.Runs, s.Attempts)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	want := map[string]int{"a@1": 1, "b@1": 1, "a@2": 1, "b@2": 1}
	if fmt.Sprint(seen) != fmt.Sprint(want) {
		t.Errorf("dispatches %v, want %v: each run its own attempt number", seen, want)
	}
}
