package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/api"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/engine/trigger"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/health"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

type serveFlags struct {
	listen   string
	http     string
	httpSec  httpSecFlags
	workers  int
	demo     bool
	embedded embeddedFlags
	steps    stepFlags
	events   eventFlags
}

func newServeCmd(g *globals) *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run a long-lived engine with an HTTP API (embedded nats-server unless --nats-url)",
		Long: `Serve runs the engine until SIGINT or SIGTERM. Without --nats-url it starts an
embedded nats-server whose client port (--listen, loopback by default) lets the
nats CLI, "engine start" and separate "worker" processes reach it. The HTTP API
(--http) starts, gets and lists jobs and serves Prometheus /metrics. The NATS
service "waymark" (nats micro ls) gets, cancels, pauses, resumes, retries,
approves and rejects jobs on <prefix>.api.job.*.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return serve(cmd.Context(), g, &f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.listen, "listen", envOr("WAYMARK_LISTEN", "127.0.0.1:4222"), "embedded server's NATS client address (env WAYMARK_LISTEN)")
	fl.StringVar(&f.http, "http", envOr("WAYMARK_HTTP", "127.0.0.1:8080"), "HTTP API address; empty disables it; beyond loopback it needs --http-token-file or --http-tlsca (env WAYMARK_HTTP)")
	f.httpSec.bind(cmd)
	fl.IntVar(&f.workers, "workers", steps.DefaultConcurrency, "steps the in-process worker runs at once; 0 runs no in-process worker")
	fl.BoolVar(&f.demo, "demo", false, "start the bundled demo services (tickets, payments, records, mail) for in-process workers")
	f.embedded.bind(cmd)
	f.steps.bind(cmd)
	fl.StringArrayVar(&f.steps.allowKinds, "allow-kind", nil, "a step kind only remote workers know, accepted in workflows posted to the API (repeatable)")
	f.events.bind(cmd, true)
	return cmd
}

func serve(ctx context.Context, g *globals, f *serveFlags) error {
	log, err := g.logger()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	env, err := f.steps.env()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	if err := f.embedded.validate(); err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	if err := f.embedded.chooseServer(g, log); err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	if f.workers < 0 {
		return &ExitError{Code: 2, Err: fmt.Errorf("--workers %d: want 0 or more", f.workers)}
	}
	events, err := f.events.plan()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	var sec *httpSecurity
	if f.http != "" {
		if sec, err = f.httpSec.load(f.http, log); err != nil {
			return &ExitError{Code: 2, Err: err}
		}
	}
	ctx, stopSignals := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	o := stackOptions{listen: f.listen, env: env, workers: f.workers, engines: 1, log: log,
		demoDir: filepath.Join(f.embedded.dataDir, "demo"), events: events}
	if f.demo {
		o.demoNames = demo.Names()
	}
	st, err := g.startStack(ctx, &f.embedded, o)
	if err != nil {
		return err
	}
	defer st.stop()

	out := g.stdout
	if st.srv != nil {
		enc := ""
		if f.embedded.key != "" {
			enc = ", encrypted at rest with " + f.embedded.cipher
		}
		fmt.Fprintf(out, "nats: %s (embedded, JetStream in %s, sync %s%s)\n", st.srv.ClientURL(), f.embedded.dataDir, f.embedded.sync, enc)
	} else {
		fmt.Fprintf(out, "nats: %s\n", g.natsURL())
	}
	for _, r := range st.services {
		fmt.Fprintf(out, "service %s: %s\n", r.Name, r.URL)
	}
	svc, err := api.StartService(st.nc, client.New(st.store), st.store.Config.Prefix, Version, log)
	if err != nil {
		return err
	}
	defer func() { _ = svc.Stop() }() // before the stack stops
	events.describe(out, st.store.Config.Prefix)
	fmt.Fprintf(out, "nats service: %s (engine control on %s.api.job.*)\n", api.ServiceName, st.store.Config.Prefix)
	fmt.Fprintf(out, "cloudevents: request/reply on %s> (binary mode)\n", st.store.Names.TriggerPrefix)
	var srv *http.Server
	if f.http != "" {
		ln, err := net.Listen("tcp", f.http)
		if err != nil {
			return fmt.Errorf("http API: listen on %s: %w", f.http, err)
		}
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		registerEngineMetrics(reg, st.engine)
		registerIntakeMetrics(reg, st.intake)
		for _, w := range st.workers {
			registerWorkerMetrics(reg, w)
		}
		registerNotifyMetrics(reg, st.notify)
		api := &api.API{Client: client.New(st.store), Logger: log, Checks: []schemas.CheckFunc{engine.Check, steps.Builtins().CheckAnyWorker(env, f.steps.allowKinds...)}}
		if st.intake != nil {
			api.Events = st.intake
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		n := st.store.Names
		(&health.Checker{Conn: st.nc, Streams: []string{n.InboxStream, n.WorkStream, n.HistoryStream, "KV_" + n.CheckpointBucket}}).Register(mux)
		mux.Handle("/", api.Handler())
		srv = &http.Server{Handler: sec.wrap(mux), ReadHeaderTimeout: 10 * time.Second, TLSConfig: sec.tlsConfig()}
		go func() {
			var serveErr error
			if srv.TLSConfig != nil {
				serveErr = srv.ServeTLS(ln, "", "") // the certificate is in TLSConfig
			} else {
				serveErr = srv.Serve(ln)
			}
			if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
				st.errs <- fmt.Errorf("http API: %w", serveErr)
			}
		}()
		stopReload := sec.reloadOnHUP(log)
		defer stopReload()
		fmt.Fprintf(out, "http: %s://%s (API under /v1, metrics at /metrics, probes at /healthz and /readyz; %s)\n", sec.scheme(), ln.Addr(), sec.describe())
	}
	fmt.Fprintln(out, "engine running; Ctrl-C stops it")
	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-st.errs:
	}
	if srv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = srv.Shutdown(sctx)
		cancel()
	}
	return runErr
}

// registerIntakeMetrics exposes the CloudEvents intake's counters as
// waymark_events_<counter>_total.
func registerIntakeMetrics(reg *prometheus.Registry, in *trigger.Intake) {
	if in == nil {
		return
	}
	counter := func(name, help string, get func(trigger.Stats) uint64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: "waymark", Subsystem: "events", Name: name + "_total", Help: help,
		}, func() float64 { return float64(get(in.Stats())) }))
	}
	counter("accepted", "CloudEvents that started jobs.", func(s trigger.Stats) uint64 { return s.Accepted })
	counter("duplicate", "CloudEvents delivered again: answered with the jobs they started before, nothing started.", func(s trigger.Stats) uint64 { return s.Duplicate })
	counter("unmatched", "Valid CloudEvents no live trigger took (answered no_trigger).", func(s trigger.Stats) uint64 { return s.Unmatched })
	counter("invalid", "Requests that were not valid CloudEvents (answered 400 or 415).", func(s trigger.Stats) uint64 { return s.Invalid })
	counter("refused", "CloudEvents whose mapped input the workflow refused (input schema, a failing expression).", func(s trigger.Stats) uint64 { return s.Refused })
}

// registerEngineMetrics exposes the engine's counters as Prometheus
// counters named waymark_engine_<counter>_total.
func registerEngineMetrics(reg *prometheus.Registry, e *engine.Engine) {
	if e == nil {
		return
	}
	counter := func(name, help string, get func(engine.Stats) uint64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: "waymark", Subsystem: "engine", Name: name + "_total", Help: help,
		}, func() float64 { return float64(get(e.Stats())) }))
	}
	counter("jobs_started", "Jobs created.", func(s engine.Stats) uint64 { return s.JobsStarted })
	counter("jobs_completed", "Jobs that completed.", func(s engine.Stats) uint64 { return s.JobsCompleted })
	counter("jobs_failed", "Jobs that failed.", func(s engine.Stats) uint64 { return s.JobsFailed })
	counter("jobs_rejected", "Start requests rejected for bad input.", func(s engine.Stats) uint64 { return s.JobsRejected })
	counter("transitions", "Checkpoint writes.", func(s engine.Stats) uint64 { return s.Transitions })
	counter("steps_dispatched", "Step messages published.", func(s engine.Stats) uint64 { return s.StepsDispatched })
	counter("results_applied", "Step results applied.", func(s engine.Stats) uint64 { return s.ResultsApplied })
	counter("stale_results_dropped", "Results for an attempt no longer current, dropped.", func(s engine.Stats) uint64 { return s.StaleDropped })
	counter("cas_conflicts", "Checkpoint writes that lost a compare-and-swap.", func(s engine.Stats) uint64 { return s.CASConflicts })
	counter("resumes", "Recoveries: a trigger or step delivered again after a process died or stalled.", func(s engine.Stats) uint64 { return s.Resumes })
	counter("inbox_redeliveries", "Inbox messages delivered more than once.", func(s engine.Stats) uint64 { return s.InboxRedelivered })
	counter("republished", "Dispatches published again after a handler died.", func(s engine.Stats) uint64 { return s.Republished })
	counter("attempts_lost", "Attempts the reconciler declared lost.", func(s engine.Stats) uint64 { return s.AttemptsLost })
	counter("reconcile_errors", "Reconciler passes that failed.", func(s engine.Stats) uint64 { return s.ReconcileErrors })
	counter("handle_errors", "Inbox messages left for redelivery after an error.", func(s engine.Stats) uint64 { return s.HandleErrors })
	counter("jobs_blocked", "Jobs stopped on an ambiguous effect (needs_reconciliation).", func(s engine.Stats) uint64 { return s.JobsBlocked })
	counter("effects_reconciled", "Ambiguous effects resolved by a person, setting their job going again.", func(s engine.Stats) uint64 { return s.EffectsResolved })
	counter("dead_letters", "Step messages that reached the work consumer's max deliveries (poison steps).", func(s engine.Stats) uint64 { return s.DeadLetters })
	counter("effects_swept", "Effect records removed with their job after its retention.", func(s engine.Stats) uint64 { return s.EffectsSwept })
	counter("jobs_swept", "Finished jobs removed after their retention (checkpoint, history, index entry, effect records).", func(s engine.Stats) uint64 { return s.JobsSwept })
	counter("history_republished", "Transitions whose events were published again before the next checkpoint, because this engine could not tell they were stored.", func(s engine.Stats) uint64 { return s.HistoryRepublished })
	counter("definition_blocked", "Jobs blocked because their pinned definition could not be loaded.", func(s engine.Stats) uint64 { return s.DefinitionBlocked })
	counter("definition_unblocked", "Blocked jobs that went on once their definition could be loaded again.", func(s engine.Stats) uint64 { return s.DefinitionUnblocked })
	counter("effects_marked_ambiguous", "Effects marked ambiguous because their step failed for good while the call may have happened.", func(s engine.Stats) uint64 { return s.MarkedAmbiguous })
	counter("panics", "Panics contained while deciding one job's transition.", func(s engine.Stats) uint64 { return s.Panics })
	counter("quarantined", "Times a job's messages were held back because its checkpoint cannot be trusted.", func(s engine.Stats) uint64 { return s.Quarantined })
	counter("flow_waits", "Dispatches recorded waiting for a flow limit (a concurrency slot or a rate window).", func(s engine.Stats) uint64 { return s.FlowWaits })
	counter("flow_handed_over", "Concurrency slots handed from a finished dispatch to a waiting one.", func(s engine.Stats) uint64 { return s.FlowHandedOver })
	counter("flow_leaked", "Concurrency slots a crash left behind, freed by the reconciler.", func(s engine.Stats) uint64 { return s.FlowLeaked })
	counter("storage_full", "Transitions that could not be written because JetStream's storage is full (kept, tried again).", func(s engine.Stats) uint64 { return s.StorageFull })
	counter("index_repaired", "Job index entries the reconciler fixed after a crash between two writes.", func(s engine.Stats) uint64 { return s.IndexRepaired })
	counter("requeued", "Steps dispatched again because the queues were lost (memory queues, server restart).", func(s engine.Stats) uint64 { return s.Requeued })
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "waymark", Subsystem: "engine", Name: "oldest_running_checkpoint_age_seconds",
		Help: "Time since the oldest running job's checkpoint was written, at the last reconcile pass (snapshot age).",
	}, func() float64 { return float64(e.Stats().OldestRunningAgeMs) / 1000 }))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "waymark", Subsystem: "engine", Name: "active_jobs",
		Help: "Jobs that may still change (the job index's active entries), at the last reconcile pass.",
	}, func() float64 { return float64(e.Stats().ActiveJobs) }))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "waymark", Subsystem: "engine", Name: "steps_waiting_for_workers",
		Help: "Running jobs whose step message waits in its pool's queue past its deadline, at the last reconcile pass.",
	}, func() float64 { return float64(e.Stats().StepsWaitingForWorkers) }))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "waymark", Subsystem: "engine", Name: "first_progress_seconds",
		Help: "Time from engine start to its first applied transition; 0 until then.",
	}, func() float64 { return float64(e.Stats().FirstProgressMs) / 1000 }))
}
