package bench

import (
	"context"
	"testing"
	"time"
)

// TestRunOnCluster runs a small round of Waymark and of the floor on a
// loopback cluster of three nodes (Config.Cluster): every job finishes and
// the figures are those of real work.
func TestRunOnCluster(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := Run(ctx, Config{Jobs: 10, Steps: 3, Concurrency: 5, Cluster: 3, Floor: true, Engine: true, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if r.StepsPerS <= 0 || r.FloorStepsPerS <= 0 || r.JSWritesPerStep <= 0 || r.FloorJSWritesPerStep <= 0 || r.Replicas != 3 {
		t.Fatalf("result %+v: want steps and stored writes measured for both", r)
	}
}

// TestRunMap runs a small map (200 items, 20 at a time) and its chain
// baseline: every job completes, every item is counted as a step, the
// baseline has the same total steps, and the largest checkpoint written
// during the run is reported (at least the final one).
func TestRunMap(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := Run(ctx, Config{Shape: ShapeMap, Items: 200, ItemConcurrency: 20, Engine: true, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("map %.0f steps/s, chain %.0f, ratio %.2f; largest checkpoint %d bytes, final %d", r.StepsPerS, r.ChainStepsPerS, r.MapChainRatio, r.MaxCheckpointBytes, r.CheckpointBytes)
	if r.JobsCompleted != 1 || r.StepsCounted != 200 {
		t.Errorf("map: %d jobs completed, %d steps counted; want 1 and 200", r.JobsCompleted, r.StepsCounted)
	}
	b := r.Baseline
	if b == nil || b.Config.Shape != ShapeChain || b.Config.Jobs != 20 || b.Config.Steps != 10 || b.Config.Concurrency != 20 {
		t.Fatalf("baseline %+v: want 20 chain jobs of 10 steps, 20 in flight", b)
	}
	if b.JobsCompleted != 20 || b.StepsCounted != 200 {
		t.Errorf("baseline: %d jobs completed, %d steps counted; want 20 and 200", b.JobsCompleted, b.StepsCounted)
	}
	if r.StepsPerS <= 0 || r.ChainStepsPerS != b.StepsPerS || r.MapChainRatio <= 0 {
		t.Errorf("steps/s: map %v, chain %v, ratio %v", r.StepsPerS, r.ChainStepsPerS, r.MapChainRatio)
	}
	if r.CheckpointBytes <= 0 || r.MaxCheckpointBytes < r.CheckpointBytes {
		t.Errorf("checkpoints: largest final %d bytes, largest at any time %d; want both measured", r.CheckpointBytes, r.MaxCheckpointBytes)
	}
}

// TestRunParallel runs a few jobs of a parallel step of four branches and
// a step after it: every job completes with five steps counted, and job
// latencies and checkpoint sizes are reported.
func TestRunParallel(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := Run(ctx, Config{Shape: ShapeParallel, Branches: 4, Jobs: 6, Concurrency: 3, Engine: true, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if r.JobsCompleted != 6 || r.StepsCounted != 6*5 {
		t.Errorf("%d jobs completed, %d steps counted; want 6 and 30", r.JobsCompleted, r.StepsCounted)
	}
	if r.StepsPerS <= 0 || r.JobP50Ms <= 0 || r.JobP99Ms < r.JobP50Ms {
		t.Errorf("steps/s %v, job p50 %v ms, p99 %v ms", r.StepsPerS, r.JobP50Ms, r.JobP99Ms)
	}
	if r.CheckpointBytes <= 0 || r.MaxCheckpointBytes < r.CheckpointBytes || r.Baseline != nil {
		t.Errorf("checkpoints: final %d, at any time %d; baseline %v (want none)", r.CheckpointBytes, r.MaxCheckpointBytes, r.Baseline)
	}
}

// TestConfigRefusesShapeMisuse: the shapes' settings are checked, and
// those of another shape refused.
func TestConfigRefusesShapeMisuse(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]Config{
		"items with chain":     {Items: 10},
		"branches with map":    {Shape: ShapeMap, Branches: 2},
		"item concurrency 0":   {Shape: ShapeMap, ItemConcurrency: -1},
		"item concurrency big": {Shape: ShapeMap, ItemConcurrency: 1001},
		"65 branches":          {Shape: ShapeParallel, Branches: 65},
		"floor with parallel":  {Shape: ShapeParallel, Floor: true},
		"unknown shape":        {Shape: "star"},
	} {
		c.Engine = true
		if err := c.WithDefaults().validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestRunLargeState: a state of 1 MiB in 8 values runs (the values kept by
// reference), and its checkpoints stay small.
func TestRunLargeState(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := Run(ctx, Config{Jobs: 3, Concurrency: 1, Steps: 3, Payload: 1 << 20, StateValues: 8, Engine: true, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if r.JobsCompleted != 3 || r.MaxCheckpointBytes > 16<<10 {
		t.Errorf("%d jobs completed, largest checkpoint %d bytes; want 3, and references, not values, in the checkpoint", r.JobsCompleted, r.MaxCheckpointBytes)
	}
}
