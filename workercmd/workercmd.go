// Package workercmd is the worker binary as a library: a program that
// registers its own step kinds and hands the registry to Main gets the
// same flags, environment, metrics and exit codes as cmd/worker.
//
//	func main() {
//		reg := steps.Builtins()
//		reg.Register("enrich", steps.Func(enrich))
//		workercmd.Main(reg)
//	}
package workercmd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/cliflags"
	"github.com/waymark-dev/waymark/internal/workercli"
	"github.com/waymark-dev/waymark/steps"
)

// New returns the worker command (cobra) performing the kinds in reg (nil:
// the built-ins), writing to stdout and stderr. Run it with
// ExecuteContext; a usage error comes back as an error whose exit code
// ExitCode reports.
func New(stdout, stderr io.Writer, reg *steps.Registry) *cobra.Command {
	return workercli.New(stdout, stderr, reg)
}

// ExitCode is the process exit code for an error returned by the command:
// 2 for usage errors (bad flags or settings), 1 otherwise, 0 for nil.
func ExitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *cliflags.ExitError
	if errors.As(err, &ee) {
		return ee.Code
	}
	return 1
}

// Main runs the worker command with the process's arguments and exits:
// 0 when it stopped cleanly (SIGINT, SIGTERM), 2 on a usage error, 1 on
// any other error, which it prints to stderr.
func Main(reg *steps.Registry) {
	err := New(os.Stdout, os.Stderr, reg).ExecuteContext(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
	}
	os.Exit(ExitCode(err))
}
