package workercmd_test

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/waymark-dev/waymark/steps"
	"github.com/waymark-dev/waymark/workercmd"
)

// A worker with a kind of its own: the README's example, compiled.
func Example() {
	reg := steps.Builtins()
	reg.Register("enrich", steps.Func(func(ctx context.Context, c *steps.Call) (any, error) {
		state, err := c.StateMap()
		if err != nil {
			return nil, err
		}
		if state["email"] == nil {
			return nil, steps.NonRetryable(errors.New("no email"))
		}
		return map[string]any{"score": 0.9}, nil
	}))
	cmd := workercmd.New(os.Stdout, os.Stderr, reg)
	cmd.SetArgs([]string{"--concurrency", "-1"})
	err := cmd.ExecuteContext(context.Background())
	fmt.Println("exit", workercmd.ExitCode(err))
	// Output: exit 2
}
