package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
)

// TestBenchScaleRuns runs engine bench scale small: it must start an engine
// process, hold the jobs, kill it, and see a new engine complete them all.
// Figures are printed, not asserted (targets live in the bench, not tests).
func TestBenchScaleRuns(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, testsupport.Binary(t, "engine"), "bench", "scale", "--jobs", "5,40", "--settle", "100ms", "-o", "json").Output()
	if err != nil {
		t.Fatalf("bench scale: %v\n%s", err, out)
	}
	var res struct {
		Points []struct {
			Jobs int    `json:"jobs"`
			RSS  uint64 `json:"engine_rss_bytes"`
			Heap uint64 `json:"engine_heap_inuse_bytes"`
		} `json:"points"`
		RestartJobs     int     `json:"restart_jobs"`
		FirstProgressMs float64 `json:"first_progress_ms"`
		DrainMs         float64 `json:"drain_ms"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	t.Logf("%s", out)
	if len(res.Points) != 2 || res.Points[0].Jobs != 5 || res.Points[1].Jobs != 40 {
		t.Fatalf("points %+v, want 5 and 40 jobs", res.Points)
	}
	for _, p := range res.Points {
		if p.RSS == 0 || p.Heap == 0 {
			t.Errorf("%d jobs: RSS %d, heap %d; want both read from the engine process", p.Jobs, p.RSS, p.Heap)
		}
	}
	if res.RestartJobs != 40 || res.FirstProgressMs <= 0 || res.DrainMs < res.FirstProgressMs {
		t.Errorf("restart: %d jobs, first progress %v ms, drain %v ms", res.RestartJobs, res.FirstProgressMs, res.DrainMs)
	}
}

// TestBenchRefusesBadShapeFlags: the map and parallel shapes' flags out of
// range, or given with another shape, exit 2 naming the flag, before
// anything is measured.
func TestBenchRefusesBadShapeFlags(t *testing.T) {
	t.Parallel()
	bin := testsupport.Binary(t, "engine")
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"--shape", "map", "--items", "0"}, "--items"},
		{[]string{"--shape", "map", "--item-concurrency", "0"}, "--item-concurrency"},
		{[]string{"--shape", "map", "--item-concurrency", "1001"}, "--item-concurrency"},
		{[]string{"--shape", "parallel", "--branches", "0"}, "--branches"},
		{[]string{"--shape", "parallel", "--branches", "65"}, "--branches"},
		{[]string{"--items", "100"}, "--items"},
		{[]string{"--shape", "chain", "--items", "100"}, "--items"},
		{[]string{"--shape", "chain", "--branches", "4"}, "--branches"},
		{[]string{"--shape", "parallel", "--item-concurrency", "4"}, "--item-concurrency"},
		{[]string{"--shape", "map", "--steps", "5"}, "--steps"},
		{[]string{"--shape", "map", "--floor-only"}, "--floor-only"},
		{[]string{"--shape", "star"}, "--shape"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(ctx, bin, append([]string{"bench"}, tc.args...)...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		cancel()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(stderr.String(), tc.flag) {
			t.Errorf("bench %s: %v, stderr %q, stdout %q; want exit 2 naming %s", strings.Join(tc.args, " "), err, stderr.String(), out, tc.flag)
		}
	}
}
