// Command engine is Waymark's engine and CLI: run a job on an embedded
// server, serve an engine with an HTTP API, start and inspect jobs.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/waymark-dev/waymark/internal/cli"
)

func main() {
	cmd := cli.NewEngineCommand(os.Stdout, os.Stderr)
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		os.Exit(exitCode(err))
	}
}

func exitCode(err error) int {
	fmt.Fprintln(os.Stderr, "error:", err)
	var ee *cli.ExitError
	if errors.As(err, &ee) {
		return ee.Code
	}
	return 1
}
