// Package workercli is the worker command: flags, settings, metrics and
// exit codes shared by cmd/worker, custom workers built with workercmd,
// and `engine worker`. It imports neither the engine nor nats-server, so
// a worker binary links neither (internal/linkcheck checks it).
package workercli

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/internal/cliflags"
	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/internal/health"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/steps"
)

// New returns the worker command. reg holds the kinds it performs (nil
// means the built-ins); a custom worker passes its own registry. Usage
// errors come back as *cliflags.ExitError with code 2.
//
// The worker waits for its NATS server: one that is not reachable yet (or
// goes away later) is retried with backoff, each retry logged at warn
// with the URL and the next delay (cliflags.ConnectWaiting).
func New(stdout, stderr io.Writer, reg *steps.Registry) *cobra.Command {
	g := &cliflags.Globals{Stdout: stdout, Stderr: stderr}
	var pool, metricsAddr string
	var concurrency int
	var drain time.Duration
	var sf cliflags.StepFlags
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a Waymark worker: pull step messages of a pool and perform them",
		Long: `A worker performs steps of one pool (model, http, noop and any kinds its binary
registers). Any number of workers may serve a pool, on any machines that reach
the NATS server. A worker that dies mid-step loses nothing: the step message is
delivered to another worker after its lease (the work ack wait) runs out. A
worker started before its server is reachable waits for it, retrying with
backoff and logging each retry.`,
		Args:          cliflags.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.Logger()
			if err != nil {
				return &cliflags.ExitError{Code: 2, Err: err}
			}
			env, err := sf.Env()
			if err != nil {
				return &cliflags.ExitError{Code: 2, Err: err}
			}
			if concurrency < 1 {
				return &cliflags.ExitError{Code: 2, Err: fmt.Errorf("--concurrency %d: want 1 or more", concurrency)}
			}
			if drain <= 0 {
				return &cliflags.ExitError{Code: 2, Err: fmt.Errorf("--drain-timeout %v: want a positive duration such as 10s or 2m", drain)}
			}
			if !poolRE.MatchString(pool) {
				return &cliflags.ExitError{Code: 2, Err: fmt.Errorf("--pool %q: want lower-case letters, digits, '-' and '_', starting with a letter (at most 32)", pool)}
			}
			fp, err := failpoint.FromEnv()
			if err != nil {
				return &cliflags.ExitError{Code: 2, Err: err}
			}
			if _, err := cliflags.KVConfig(kv.Config{}, g.Prefix, g.Flags); err != nil {
				return err // a bad setting is refused before waiting for any server
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			nc, err := g.ConnectWaiting(ctx, "waymark-worker", log)
			if err != nil {
				if ctx.Err() != nil {
					return nil // stopped while waiting for the server: a clean stop
				}
				return err
			}
			defer nc.Close()
			st, err := cliflags.OpenStoreWaiting(ctx, nc, kv.Config{}, g.Prefix, g.Flags, log)
			if err != nil {
				if ctx.Err() != nil {
					return nil // stopped while waiting for the layout: a clean stop
				}
				return err
			}
			w, err := steps.NewWorker(steps.WorkerConfig{Store: st, Registry: reg, Env: env, Pool: pool,
				Concurrency: concurrency, DrainTimeout: drain, Logger: log, Failpoints: fp})
			if err != nil {
				return &cliflags.ExitError{Code: 2, Err: err}
			}
			if metricsAddr != "" {
				n := st.Names
				probes := &health.Checker{Conn: nc, Streams: []string{n.WorkStream, "KV_" + n.CheckpointBucket, "KV_" + n.EffectBucket}}
				stop, addr, err := serveMetrics(metricsAddr, w, probes)
				if err != nil {
					return err
				}
				defer stop()
				fmt.Fprintf(g.Stdout, "metrics: http://%s/metrics (probes at /healthz and /readyz)\n", addr)
			}
			fmt.Fprintf(g.Stdout, "worker serving pool %q on %s (concurrency %d)\n", pool, nc.ConnectedUrlRedacted(), concurrency)
			return w.Run(ctx)
		},
	}
	g.Bind(cmd)
	fl := cmd.Flags()
	fl.StringVar(&pool, "pool", cliflags.EnvOr("WAYMARK_POOL", "default"), "worker pool to serve (env WAYMARK_POOL)")
	fl.IntVar(&concurrency, "concurrency", steps.DefaultConcurrency, "steps run at once")
	fl.DurationVar(&drain, "drain-timeout", steps.DefaultDrainTimeout, "on SIGTERM or ^C, how long steps in hand may run on before they are cancelled and handed back (match your orchestrator's grace period)")
	fl.StringVar(&metricsAddr, "metrics", cliflags.EnvOr("WAYMARK_WORKER_METRICS", ""), "serve Prometheus /metrics and the probes /healthz and /readyz on this address, e.g. 127.0.0.1:9090 (env WAYMARK_WORKER_METRICS)")
	sf.Bind(cmd)
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &cliflags.ExitError{Code: 2, Err: err} })
	return cmd
}

// serveMetrics serves a worker's counters on addr until stop, and the
// liveness and readiness probes (internal/health).
func serveMetrics(addr string, w *steps.Worker, probes *health.Checker) (stop func(), bound string, err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("--metrics: listen on %s: %w", addr, err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	RegisterMetrics(reg, w)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	probes.Register(mux)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return func() { _ = srv.Close() }, ln.Addr().String(), nil
}

var poolRE = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,31}$`)

// RegisterMetrics exposes a worker's counters on reg as Prometheus
// counters named waymark_worker_<counter>_total.
func RegisterMetrics(reg prometheus.Registerer, w *steps.Worker) {
	counter := func(name, help string, get func(steps.WorkerStats) uint64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: "waymark", Subsystem: "worker", Name: name + "_total", Help: help,
		}, func() float64 { return float64(get(w.Stats())) }))
	}
	counter("steps_started", "Step attempts started.", func(s steps.WorkerStats) uint64 { return s.Started })
	counter("steps_succeeded", "Step attempts that succeeded.", func(s steps.WorkerStats) uint64 { return s.Succeeded })
	counter("steps_failed", "Step attempts that failed.", func(s steps.WorkerStats) uint64 { return s.Failed })
	counter("redeliveries", "Step messages delivered again after a worker died or stalled.", func(s steps.WorkerStats) uint64 { return s.Redeliveries })
	counter("results_published", "Results published to the engine.", func(s steps.WorkerStats) uint64 { return s.Published })
	counter("heartbeats", "Lease extensions sent while steps ran.", func(s steps.WorkerStats) uint64 { return s.Heartbeats })
	counter("replayed_pure_steps", "Pure steps run again because their message was delivered again.", func(s steps.WorkerStats) uint64 { return s.ReplayedPure })
	counter("replayed_effects", "Effectful attempts answered from the ledger without calling out (the effect had happened).", func(s steps.WorkerStats) uint64 { return s.ReplayedEffects })
	counter("ambiguous_effects", "Effects declared ambiguous (unsafe, outcome unknown).", func(s steps.WorkerStats) uint64 { return s.AmbiguousEffects })
	counter("effects_settled_late", "Ambiguous effects reconciled as happened because the worker's own call returned after all.", func(s steps.WorkerStats) uint64 { return s.SettledLate })
	counter("storage_full", "Writes refused because JetStream's storage is full (the attempt is tried again).", func(s steps.WorkerStats) uint64 { return s.StorageFull })
	counter("overtaken", "Deliveries dropped without a report: a later delivery of the same step message owned the effect (a lease that ran out under a stalled worker).", func(s steps.WorkerStats) uint64 { return s.Overtaken })
	counter("stale_attempts", "Attempts dropped because the engine had moved on (fencing).", func(s steps.WorkerStats) uint64 { return s.Stale })
}
