// Command worker runs a Waymark worker with the built-in step kinds. A
// worker with custom kinds is a small program of its own; see package
// steps.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/waymark-dev/waymark/internal/cli"
)

func main() {
	cmd := cli.NewWorkerCommand(os.Stdout, os.Stderr, nil)
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		var ee *cli.ExitError
		if errors.As(err, &ee) {
			os.Exit(ee.Code)
		}
		os.Exit(1)
	}
}
