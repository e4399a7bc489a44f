package cli

import (
	"io"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/workercli"
	"github.com/waymark-dev/waymark/steps"
)

// NewWorkerCommand returns the worker binary's command (see
// workercli.New, which holds it so that a worker links no engine). reg
// holds the kinds it performs (nil means the built-ins).
func NewWorkerCommand(stdout, stderr io.Writer, reg *steps.Registry) *cobra.Command {
	return workercli.New(stdout, stderr, reg)
}

// registerWorkerMetrics exposes a worker's counters (see
// workercli.RegisterMetrics).
func registerWorkerMetrics(reg prometheus.Registerer, w *steps.Worker) {
	workercli.RegisterMetrics(reg, w)
}
