package cli

import (
	"fmt"
	"net"
	"net/http"
	"regexp"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/steps"
)

// NewWorkerCommand returns the worker binary's command. reg holds the
// kinds it performs (nil means the built-ins); a custom worker passes its
// own registry.
func NewWorkerCommand(stdout, stderr interface {
	Write([]byte) (int, error)
}, reg *steps.Registry) *cobra.Command {
	g := &globals{stdout: stdout, stderr: stderr}
	var pool, metricsAddr string
	var concurrency int
	var sf stepFlags
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a Waymark worker: pull step messages of a pool and perform them",
		Long: `A worker performs steps of one pool (model, http, noop and any kinds its binary
registers). Any number of workers may serve a pool, on any machines that reach
the NATS server. A worker that dies mid-step loses nothing: the step message is
delivered to another worker after its lease (the work ack wait) runs out.`,
		Args:          noArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.logger()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			env, err := sf.env()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if concurrency < 1 {
				return &ExitError{Code: 2, Err: fmt.Errorf("--concurrency %d: want 1 or more", concurrency)}
			}
			if !poolRE.MatchString(pool) {
				return &ExitError{Code: 2, Err: fmt.Errorf("--pool %q: want lower-case letters, digits, '-' and '_', starting with a letter (at most 32)", pool)}
			}
			fp, err := failpoint.FromEnv()
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			nc, err := g.connect("waymark-worker")
			if err != nil {
				return err
			}
			defer nc.Close()
			st, err := g.openStore(ctx, nc, kv.Config{}, log)
			if err != nil {
				return err
			}
			w, err := steps.NewWorker(steps.WorkerConfig{Store: st, Registry: reg, Env: env, Pool: pool,
				Concurrency: concurrency, Logger: log, Failpoints: fp})
			if err != nil {
				return &ExitError{Code: 2, Err: err}
			}
			if metricsAddr != "" {
				stop, addr, err := serveWorkerMetrics(metricsAddr, w)
				if err != nil {
					return err
				}
				defer stop()
				fmt.Fprintf(g.stdout, "metrics: http://%s/metrics\n", addr)
			}
			fmt.Fprintf(g.stdout, "worker serving pool %q on %s (concurrency %d)\n", pool, nc.ConnectedUrlRedacted(), concurrency)
			return w.Run(ctx)
		},
	}
	g.bind(cmd)
	fl := cmd.Flags()
	fl.StringVar(&pool, "pool", envOr("WAYMARK_POOL", "default"), "worker pool to serve (env WAYMARK_POOL)")
	fl.IntVar(&concurrency, "concurrency", steps.DefaultConcurrency, "steps run at once")
	fl.StringVar(&metricsAddr, "metrics", envOr("WAYMARK_WORKER_METRICS", ""), "serve Prometheus /metrics on this address, e.g. 127.0.0.1:9090 (env WAYMARK_WORKER_METRICS)")
	sf.bind(cmd)
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	return cmd
}

// serveWorkerMetrics serves a worker's counters on addr until stop.
func serveWorkerMetrics(addr string, w *steps.Worker) (stop func(), bound string, err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("--metrics: listen on %s: %w", addr, err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	registerWorkerMetrics(reg, w)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return func() { _ = srv.Close() }, ln.Addr().String(), nil
}

var poolRE = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,31}$`)
