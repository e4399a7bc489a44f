package workercmd

import (
	"bytes"
	"context"
	"testing"
)

// TestUsageErrorsExitTwo: an unknown flag or a bad value is a usage error
// (exit 2), as with the engine command, before anything connects.
func TestUsageErrorsExitTwo(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"--bogus"}, {"--concurrency", "0"}, {"--drain-timeout", "0s"}, {"--drain-timeout", "soon"}} {
		var out, errb bytes.Buffer
		cmd := New(&out, &errb, nil)
		cmd.SetArgs(args)
		err := cmd.ExecuteContext(context.Background())
		if code := ExitCode(err); code != 2 {
			t.Errorf("worker %v: exit %d (%v), want 2", args, code, err)
		}
	}
}
