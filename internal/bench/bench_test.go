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
