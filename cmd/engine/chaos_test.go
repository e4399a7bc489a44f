package main

// The chaos test: three engine processes and four worker processes share one
// nats-server while the test SIGKILLs them at random, and checks what
// DESIGN.md promises from the outside only: the checkpoints bucket, the
// history stream, the effect ledger, the providers' own counts, and each
// engine's /metrics and log. Nothing here reaches into the engine.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/demo"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// chaosKV is the layout of the chaos test, and chaosEnv what every one of
// its processes sees: leases and inbox ack waits of one second, so that the
// work a killed process held comes back within seconds.
var (
	chaosKV  = kv.Config{InboxAckWait: time.Second, WorkAckWait: time.Second}
	chaosEnv = []string{"WAYMARK_INBOX_ACK_WAIT=1s", "WAYMARK_WORK_ACK_WAIT=1s"}
)

// chaosConflictLine is what an engine logs (at debug level) for each
// checkpoint write that lost a compare-and-swap.
const chaosConflictLine = "checkpoint conflict"

// chaosProc is one engine or worker of the chaos test, started again after
// every kill. Each start is one incarnation, with its own output and the
// last counters read from its /metrics.
type chaosProc struct {
	name  string
	bin   string
	args  []string
	env   []string
	dir   string
	lives []*chaosLife
	kills int
}

type chaosLife struct {
	p       *proc
	metrics map[string]float64 // the last successful read of /metrics
}

var chaosAddrRE = regexp.MustCompile(`http://(127\.0\.0\.1:\d+)`)

func (cp *chaosProc) life() *chaosLife { return cp.lives[len(cp.lives)-1] }

func (cp *chaosProc) start() error {
	p := &proc{cmd: exec.Command(cp.bin, cp.args...), out: &syncBuffer{}, errOut: &syncBuffer{}, done: make(chan struct{})}
	p.cmd.Env = append(append(os.Environ(), chaosEnv...), cp.env...)
	p.cmd.Dir = cp.dir
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.errOut
	if err := p.cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", cp.name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	cp.lives = append(cp.lives, &chaosLife{p: p})
	return nil
}

// scrape reads the current incarnation's /metrics, whose address it
// printed at start; an incarnation that has not printed it yet (still
// starting) has counted nothing worth reading.
func (cp *chaosProc) scrape() {
	l := cp.life()
	m := chaosAddrRE.FindStringSubmatch(l.p.out.String())
	if m == nil {
		return
	}
	if got, err := chaosMetrics("http://" + m[1] + "/metrics"); err == nil {
		l.metrics = got
	}
}

// kill reads the counters, sends SIGKILL and waits for the process to be
// gone. It reports an error if the process had died by itself.
func (cp *chaosProc) kill() error {
	l := cp.life()
	select {
	case <-l.p.done:
		return fmt.Errorf("%s died by itself (%v):\n%s", cp.name, l.p.err, lastLines(l.p.errOut.String(), 20))
	default:
	}
	cp.scrape()
	_ = l.p.cmd.Process.Signal(syscall.SIGKILL)
	<-l.p.done
	cp.kills++
	return nil
}

// total sums a counter over every incarnation, as last read.
func (cp *chaosProc) total(name string) float64 {
	var n float64
	for _, l := range cp.lives {
		n += l.metrics[name]
	}
	return n
}

// logged counts the lines of every incarnation's log that contain s.
func (cp *chaosProc) logged(s string) int {
	n := 0
	for _, l := range cp.lives {
		n += strings.Count(l.p.errOut.String(), s)
	}
	return n
}

// chaosMetrics reads a Prometheus text page into name -> value (counters
// and gauges without labels, which is what Waymark exports).
func chaosMetrics(url string) (map[string]float64, error) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	out := map[string]float64{}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			switch {
			case m.GetCounter() != nil:
				out[name] += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[name] += m.GetGauge().GetValue()
			}
		}
	}
	return out, nil
}

// chaosWatch follows every write to the checkpoints bucket: for each job
// the revision each observed sequence number was written at, and the last
// checkpoint. A watch may miss a write that was overwritten before it was
// delivered (the bucket keeps one revision per key); it never invents one.
type chaosWatch struct {
	mu      sync.Mutex
	jobs    map[string]*chaosWatched
	errs    []string        // writes that break the rules, as they were seen
	suspect map[string]bool // the jobs of errs
}

type chaosWatched struct {
	seqRev  map[uint64]chaosWrite // checkpoint seq -> the write of it
	lastRev uint64
	last    *schemas.Checkpoint
}

// chaosWrite is one observed checkpoint write, as a failure message tells
// it.
type chaosWrite struct {
	rev    uint64
	status schemas.JobStatus
	cause  string // the inbox message that produced it
	writer string // the engine incarnation that wrote it
	resume int
}

func (w chaosWrite) String() string {
	return fmt.Sprintf("rev %d %s resume_count %d cause %q by %s", w.rev, w.status, w.resume, w.cause, w.writer)
}

func (w *chaosWatch) see(job string, rev uint64, cp *schemas.Checkpoint) {
	w.mu.Lock()
	defer w.mu.Unlock()
	j := w.jobs[job]
	if j == nil {
		j = &chaosWatched{seqRev: map[uint64]chaosWrite{}}
		w.jobs[job] = j
	}
	cur := chaosWrite{rev: rev, status: cp.Status, cause: cp.Cause, writer: cp.Writer, resume: cp.ResumeCount}
	nerrs := len(w.errs)
	defer func() {
		if len(w.errs) > nerrs {
			w.suspect[job] = true
		}
	}()
	if prev, ok := j.seqRev[cp.Seq]; ok && prev.rev != rev {
		w.errs = append(w.errs, fmt.Sprintf("job %s: checkpoint seq %d written twice (%v, then %v): the job was advanced twice from one state", job, cp.Seq, prev, cur))
	}
	if j.last != nil && rev > j.lastRev && cp.Seq <= j.last.Seq {
		w.errs = append(w.errs, fmt.Sprintf("job %s: revision %d has seq %d after revision %d had seq %d", job, rev, cp.Seq, j.lastRev, j.last.Seq))
	}
	if j.last != nil && j.last.Status.Terminal() && rev > j.lastRev {
		w.errs = append(w.errs, fmt.Sprintf("job %s: seq %d written (%v) after it was %s at seq %d (%v)", job, cp.Seq, cur, j.last.Status, j.last.Seq, j.seqRev[j.last.Seq]))
	}
	j.seqRev[cp.Seq] = cur
	if rev > j.lastRev {
		j.lastRev, j.last = rev, cp
	}
}

// isSuspect reports whether a write of job broke a rule.
func (w *chaosWatch) isSuspect(job string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.suspect[job]
}

// seqs lists the checkpoint seqs observed for job with their revisions.
func (w *chaosWatch) seqs(job string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	j := w.jobs[job]
	if j == nil {
		return "none"
	}
	seqs := slices.Sorted(maps.Keys(j.seqRev))
	var out []string
	for _, seq := range seqs {
		out = append(out, fmt.Sprintf("%d: %v", seq, j.seqRev[seq]))
	}
	return strings.Join(out, "; ")
}

// stopped counts the jobs of ids whose last observed checkpoint is stopped.
func (w *chaosWatch) stopped(ids []string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, id := range ids {
		if j := w.jobs[id]; j != nil && j.last.Status.Stopped() {
			n++
		}
	}
	return n
}

// unfinished describes the jobs of ids that have not stopped, for a
// failure message.
func (w *chaosWatch) unfinished(ids []string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, id := range ids {
		j := w.jobs[id]
		switch {
		case j == nil:
			out = append(out, id+" (no checkpoint seen)")
		case !j.last.Status.Stopped():
			cur := ""
			if c := j.last.Current; c != nil {
				cur = fmt.Sprintf(" at %s attempt %d", c.Step, c.Attempt)
			}
			out = append(out, fmt.Sprintf("%s (%s%s, seq %d, written %v ago)", id, j.last.Status, cur, j.last.Seq, time.Since(j.last.UpdatedAt).Round(time.Millisecond)))
		}
	}
	sort.Strings(out)
	if len(out) > 20 {
		out = append(out[:20], fmt.Sprintf("and %d more", len(out)-20))
	}
	return strings.Join(out, ", ")
}

func startChaosWatch(t *testing.T, store *kv.Store) *chaosWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	bucket, err := store.JS.KeyValue(ctx, store.Names.CheckpointBucket)
	if err != nil {
		t.Fatal(err)
	}
	kw, err := bucket.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		t.Fatal(err)
	}
	w := &chaosWatch{jobs: map[string]*chaosWatched{}, suspect: map[string]bool{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for e := range kw.Updates() {
			if e == nil {
				continue // the end of the initial values
			}
			cp, err := kv.DecodeCheckpoint(e.Key(), e.Value())
			if err != nil {
				w.mu.Lock()
				w.errs = append(w.errs, fmt.Sprintf("checkpoint %s revision %d: %v", e.Key(), e.Revision(), err))
				w.mu.Unlock()
				continue
			}
			w.see(e.Key(), e.Revision(), cp)
		}
	}()
	t.Cleanup(func() { _ = kw.Stop(); cancel(); <-done })
	return w
}

// chaosEvent is one copy of a history event as the stream holds it.
type chaosEvent struct {
	typ, step string
	seq       uint64
	body      string // type, time and data, to tell two copies of one id apart
}

// chaosHistory reads the whole history stream: for every job, the copies
// of each engine event by event id, and the job's worker (ledger) events.
func chaosHistory(t *testing.T, store *kv.Store) (engineEvents map[string]map[string][]chaosEvent, msgs int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cons, err := store.JS.OrderedConsumer(ctx, store.Names.HistoryStream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	engineEvents = map[string]map[string][]chaosEvent{}
	left := info.NumPending
	for left > 0 {
		// Ask for no more than is left: a fetch waits for its whole batch.
		batch, err := cons.Fetch(int(min(left, 1000)), jetstream.FetchMaxWait(5*time.Second))
		if err != nil && errors.Is(err, nats.ErrNoResponders) {
			// A cluster whose stream leader was just moved: the caller reads
			// again (it waits for what it needs).
			t.Logf("read history: %v; reading again", err)
			return map[string]map[string][]chaosEvent{}, 0
		}
		if err != nil {
			t.Fatalf("read history: %v", err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			msgs++
			evs, err := schemas.DecodeHistory(m.Data())
			if err != nil {
				t.Errorf("history message on %s does not decode: %v", m.Subject(), err)
				continue
			}
			for _, h := range evs {
				if h.Source != schemas.HistorySourceEngine {
					continue
				}
				body, _ := json.Marshal(struct {
					Type string              `json:"type"`
					Time time.Time           `json:"time"`
					Data schemas.HistoryData `json:"data"`
				}{h.Type, h.Time, h.Data})
				job := h.Subject
				if engineEvents[job] == nil {
					engineEvents[job] = map[string][]chaosEvent{}
				}
				engineEvents[job][h.ID] = append(engineEvents[job][h.ID], chaosEvent{typ: h.Type, step: h.Data.Step, seq: h.Data.Seq, body: string(body)})
			}
			if md, err := m.Metadata(); err == nil {
				left = md.NumPending
			}
		}
		if err := batch.Error(); err != nil && n == 0 {
			t.Fatalf("read history: %v", err)
		}
	}
	return engineEvents, msgs
}

// TestChaosEnginesAndWorkers runs 1,000 two-step jobs (an idempotent charge,
// a looked-up record, against the bundled payments and records providers)
// on three engine processes and four worker processes sharing one
// nats-server, while SIGKILLing one of them at random every 250-900ms (at
// most 15 kills, within the first 20s) and starting it again at once. Then:
//
//   - every job completes;
//   - no job is advanced twice: no checkpoint sequence number is written
//     twice, no job is written after it completed, each event id in the
//     history stream names one event, each step completes once per run,
//     the job starts and completes once; and each job's resume count is the
//     number of job.resumed events in its history, and no larger than the
//     kills;
//   - every effect happens once: the providers performed exactly one
//     effect per key, one charge and one record per order, and the ledger
//     holds each key confirmed;
//   - each event of the history is stored once in the stream (the history
//     is published once per transition, whichever engine made it).
//
// The CAS conflicts the engines met are read from each incarnation's
// /metrics before it is killed and at the end, and counted in their logs,
// and printed with the other recovery counters. WAYMARK_CHAOS_JOBS sets the
// number of jobs, WAYMARK_CHAOS_SEED replays a kill schedule.
func TestChaosEnginesAndWorkers(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("the chaos test runs 1,000 jobs through random kills; skipped with -short")
	}
	jobs, maxKills, killFor := 1000, 15, 20*time.Second
	if s := os.Getenv("WAYMARK_CHAOS_JOBS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("WAYMARK_CHAOS_JOBS=%q: want a positive number", s)
		}
		jobs = n
	}
	seed := seedFromEnv(t, "WAYMARK_CHAOS_SEED")
	rng := rand.New(rand.NewPCG(uint64(seed), 0xc4a05))
	t.Logf("chaos: %d jobs, 3 engines, 4 workers, up to %d kills in %v, seed %d (WAYMARK_CHAOS_SEED=%d replays the kill schedule)", jobs, maxKills, killFor, seed, seed)
	began := time.Now()

	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	store := srv.Store(t, chaosKV)
	cl := client.New(store)
	dir := t.TempDir()
	// A delay between the effect and its answer leaves kills a window in
	// which a worker dies with the effect performed and unrecorded.
	services := startDemos(t, dir, 100*time.Millisecond)
	natsURL := "--nats-url=" + srv.URL()
	var procs []*chaosProc
	for i := range 3 {
		procs = append(procs, &chaosProc{name: fmt.Sprintf("engine-%d", i+1), bin: testsupport.Binary(t, "engine"),
			args: []string{"serve", natsURL, "--http=127.0.0.1:0", "--workers=0"},
			// Debug is where an engine logs each compare-and-swap it lost.
			env: []string{"WAYMARK_LOG_LEVEL=debug"}, dir: t.TempDir()})
	}
	for i := range 4 {
		procs = append(procs, &chaosProc{name: fmt.Sprintf("worker-%d", i+1), bin: testsupport.Binary(t, "worker"),
			args: []string{natsURL, "--metrics=127.0.0.1:0",
				"--service=" + demo.NamePayments + "=" + services[demo.NamePayments].URL,
				"--service=" + demo.NameRecords + "=" + services[demo.NameRecords].URL},
			env: []string{"WAYMARK_LOG_LEVEL=warn"}, dir: t.TempDir()})
	}
	watch := startChaosWatch(t, store)
	for _, cp := range procs {
		if err := cp.start(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, cp := range procs {
			l := cp.life()
			_ = l.p.cmd.Process.Kill()
			<-l.p.done
			if t.Failed() {
				t.Logf("stderr of %s (incarnation %d of %d):\n%s", cp.name, len(cp.lives), len(cp.lives),
					lastLines(chaosDropLines(l.p.errOut.String(), chaosConflictLine), 30))
			}
		}
	})

	def := loadDef(t, "testdata/soak.yaml")
	ids := make([]string, jobs)
	for i := range ids {
		ids[i] = fmt.Sprintf("chaos-%04d", i+1)
	}
	// Jobs start over the first part of the kill window, from a few
	// clients at once, so that kills land on jobs at every stage.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	spread := 8 * time.Second
	startErr := make(chan error, 4)
	var starters sync.WaitGroup
	for s := range 4 {
		starters.Go(func() {
			for i := s; i < jobs; i += 4 {
				if wait := time.Until(began.Add(spread * time.Duration(i) / time.Duration(jobs))); wait > 0 {
					select {
					case <-time.After(wait): // pacing the workload
					case <-ctx.Done():
						return
					}
				}
				input := json.RawMessage(fmt.Sprintf(`{"order_id": %q, "amount_cents": %d}`, ids[i], 100+i))
				if _, err := cl.Start(ctx, def, input, client.StartOptions{JobID: ids[i]}); err != nil {
					startErr <- fmt.Errorf("start %s: %w", ids[i], err)
					return
				}
			}
		})
	}

	// Kills: while jobs are still running, at most maxKills within killFor.
	kills := 0
	killsEnd := time.Now().Add(killFor)
	for kills < maxKills && time.Now().Before(killsEnd) && watch.stopped(ids) < jobs {
		time.Sleep(time.Duration(250+rng.IntN(651)) * time.Millisecond) // the workload, not synchronisation
		cp := procs[rng.IntN(len(procs))]
		if err := cp.kill(); err != nil {
			t.Fatal(err)
		}
		kills++
		if err := cp.start(); err != nil {
			t.Fatal(err)
		}
	}
	lastKill := time.Now()
	starters.Wait()
	close(startErr)
	for err := range startErr {
		t.Fatal(err)
	}

	// Every job must stop by the recovery paths that take seconds (inbox
	// and work redelivery after a one-second ack wait); a job left to the
	// reconciler's lost-attempt deadline fails this.
	settle := 30 * time.Second
	for watch.stopped(ids) < jobs {
		if time.Since(lastKill) > settle {
			t.Fatalf("%d of %d jobs stopped within %v of the last kill; still running: %s", watch.stopped(ids), jobs, settle, watch.unfinished(ids))
		}
		time.Sleep(50 * time.Millisecond) // poll interval
	}
	settled := time.Since(lastKill)
	ran := time.Since(began)
	for _, cp := range procs {
		cp.scrape()
	}

	out := chaosVerify(t, store, watch, services, def, ids, kills)

	// The counters, summed over every incarnation as last read.
	sum := func(prefix, name string) int {
		var n float64
		for _, cp := range procs {
			if strings.HasPrefix(cp.name, prefix) {
				n += cp.total(name)
			}
		}
		return int(n)
	}
	conflicts := sum("engine", "waymark_engine_cas_conflicts_total")
	conflictLines := 0
	var perProc []string
	for _, cp := range procs {
		perProc = append(perProc, fmt.Sprintf("%s %d", cp.name, cp.kills))
		if strings.HasPrefix(cp.name, "engine") {
			conflictLines += cp.logged(chaosConflictLine)
		}
	}
	if conflictLines < conflicts {
		t.Errorf("the engines' logs hold %d compare-and-swap conflicts, fewer than the %d their /metrics counted", conflictLines, conflicts)
	}
	t.Logf("chaos: %d jobs completed of %d in %v (all stopped %v after the last kill); %d kills (%s)",
		out.completed, jobs, ran.Round(time.Millisecond), settled.Round(time.Millisecond), kills, strings.Join(perProc, ", "))
	t.Logf("chaos: CAS conflicts: %d in the engines' logs (every incarnation), %d on their /metrics (read before each kill and at the end)", conflictLines, conflicts)
	t.Logf("chaos: engines (as last read): %d transitions, %d steps dispatched, %d results applied, %d stale results dropped, %d resumes, %d inbox redeliveries, %d republished, %d attempts lost, %d handle errors, %d reconcile errors",
		sum("engine", "waymark_engine_transitions_total"), sum("engine", "waymark_engine_steps_dispatched_total"),
		sum("engine", "waymark_engine_results_applied_total"), sum("engine", "waymark_engine_stale_results_dropped_total"),
		sum("engine", "waymark_engine_resumes_total"), sum("engine", "waymark_engine_inbox_redeliveries_total"),
		sum("engine", "waymark_engine_republished_total"), sum("engine", "waymark_engine_attempts_lost_total"),
		sum("engine", "waymark_engine_handle_errors_total"), sum("engine", "waymark_engine_reconcile_errors_total"))
	t.Logf("chaos: workers (as last read): %d steps started, %d redeliveries, %d effects replayed from the ledger, %d stale attempts; providers: %d keys called again after a lost answer, %d duplicate effects",
		sum("worker", "waymark_worker_steps_started_total"), sum("worker", "waymark_worker_redeliveries_total"),
		sum("worker", "waymark_worker_replayed_effects_total"), sum("worker", "waymark_worker_stale_attempts_total"), out.calledAgain, out.duplicates)
	t.Logf("chaos: %s", out)
}

// chaosOutcome is what chaosVerify counted, for a test's report.
type chaosOutcome struct {
	completed       int // jobs
	resumes         int // over all jobs, from their checkpoints
	observed        int // checkpoint writes the watch saw
	historyMsgs     int
	storedAgain     int // extra copies of engine events in the history stream
	storedAgainJobs int
	duplicates      int // effects performed more than once, by key or by order
	calledAgain     int // keys called more often than they had effects
}

func (o chaosOutcome) String() string {
	return fmt.Sprintf("%d resumes over all jobs; %d checkpoint writes observed; history: %d messages, %d engine events stored more than once (%d jobs); providers: %d keys called again after a lost answer, %d duplicate effects",
		o.resumes, o.observed, o.historyMsgs, o.storedAgain, o.storedAgainJobs, o.calledAgain, o.duplicates)
}

// chaosVerify checks, once every job of ids has stopped, what DESIGN.md
// promises of a run of the soak workflow (testdata/soak.yaml) through
// crashes, from the outside only:
//
//   - every job completed;
//   - no job was advanced twice: the watch saw no checkpoint sequence
//     number written twice and no write after a job completed; each event
//     id in the history stream names one event; each step completed once
//     per run, and each job started and completed once; its last
//     transition in the history is its checkpoint's seq;
//   - resume counts are plausible: each job's is the number of
//     job.resumed events in its history, and at most maxResumes;
//   - every effect happened once: the providers performed exactly one
//     effect per key, one charge and one record per order, and the ledger
//     holds each key confirmed;
//   - each engine event is stored once in the history stream (the history
//     is published once per transition, whichever engine made it).
func chaosVerify(t *testing.T, store *kv.Store, watch *chaosWatch, services map[string]*demo.Running, def *schemas.Definition, ids []string, maxResumes int) chaosOutcome {
	t.Helper()
	var out chaosOutcome
	ctx := context.Background()
	jobs := len(ids)
	// The final record of every job, from the bucket itself.
	final := map[string]*schemas.Checkpoint{}
	for _, id := range ids {
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		e, err := store.Checkpoints.Get(rctx, id)
		rcancel()
		if err != nil {
			t.Fatalf("job %s: %v", id, err)
		}
		final[id] = e.Checkpoint
		out.resumes += e.Checkpoint.ResumeCount
		if e.Checkpoint.Status != schemas.JobCompleted {
			t.Errorf("job %s %s: %v", id, e.Checkpoint.Status, e.Checkpoint.Error)
		}
	}
	watch.mu.Lock()
	for _, e := range watch.errs {
		t.Error(e)
	}
	for _, j := range watch.jobs {
		out.observed += len(j.seqRev)
	}
	watch.mu.Unlock()

	// The history: every job's story told once. A job that completed
	// publishes its final events at once: wait for every job.completed.
	var events map[string]map[string][]chaosEvent
	testsupport.Eventually(t, 10*time.Second, func() bool {
		events, out.historyMsgs = chaosHistory(t, store)
		for _, id := range ids {
			if !slices.ContainsFunc(chaosDistinct(events[id]), func(e chaosEvent) bool { return e.typ == schemas.EventJobCompleted }) {
				return false
			}
		}
		return true
	}, "the history stream lacks the job.completed event of some jobs")
	for _, id := range ids {
		evs := events[id]
		again := 0
		for eid, copies := range evs {
			for _, c := range copies[1:] {
				if c.body != copies[0].body {
					t.Errorf("job %s: event id %s names two events: %s and %s (the job was advanced twice from one state)", id, eid, copies[0].body, c.body)
				}
			}
			again += len(copies) - 1
		}
		if again > 0 {
			out.storedAgain += again
			out.storedAgainJobs++
		}
		distinct := chaosDistinct(evs)
		count := map[string]int{}
		var maxSeq uint64
		for _, e := range distinct {
			count[e.typ]++
			if e.typ == schemas.EventStepCompleted {
				count["completed "+e.step]++
			}
			maxSeq = max(maxSeq, e.seq)
		}
		cp := final[id]
		for _, want := range []string{schemas.EventJobStarted, schemas.EventJobCompleted} {
			if count[want] != 1 {
				t.Errorf("job %s: %d %s events in its history; want 1", id, count[want], want)
			}
		}
		for i, s := range def.Steps {
			runs := 1
			if r := cp.Steps[s.ID]; r != nil {
				runs = r.Runs
			} else if !cp.Completed.Has(i) {
				runs = 0
			}
			if runs != 1 || count["completed "+s.ID] != runs {
				t.Errorf("job %s: step %s completed %d times in its history over %d runs; want once per run, one run", id, s.ID, count["completed "+s.ID], runs)
			}
		}
		if maxSeq != cp.Seq {
			t.Errorf("job %s: its history's last transition is seq %d, its checkpoint's seq %d; history: %s; checkpoint seqs written: %s",
				id, maxSeq, cp.Seq, chaosStory(distinct), watch.seqs(id))
		}
		if watch.isSuspect(id) {
			t.Logf("job %s, whose checkpoint writes broke a rule: history: %s; checkpoint writes: %s", id, chaosStory(distinct), watch.seqs(id))
		}
		if count[schemas.EventJobResumed] != cp.ResumeCount {
			t.Errorf("job %s: resume_count %d, but %d job.resumed events in its history: %s", id, cp.ResumeCount, count[schemas.EventJobResumed], chaosStory(distinct))
		}
		if cp.ResumeCount > maxResumes {
			t.Errorf("job %s: resume_count %d; want at most %d", id, cp.ResumeCount, maxResumes)
		}
	}

	// Effects: once per key at the providers, once per order, confirmed in
	// the ledger.
	for _, name := range []string{demo.NamePayments, demo.NameRecords} {
		st := services[name].Stats()
		for key, n := range st.Effects {
			if n > 1 {
				out.duplicates++
				t.Errorf("%s performed the effect of %s %d times", name, key, n)
			}
		}
		for key, n := range st.Calls {
			if n > st.Effects[key] {
				out.calledAgain++
			}
		}
		step := map[string]string{demo.NamePayments: "charge", demo.NameRecords: "record"}[name]
		for _, id := range ids {
			if n := st.Effects[id+"/"+step]; n != 1 {
				t.Errorf("%s: %d effects for job %s's key %s/%s; want exactly one", name, n, id, id, step)
			}
		}
	}
	perOrder := map[string]int{}
	var charges demo.ChargeList
	resilGetJSON(t, services[demo.NamePayments].URL+"/v1/charges", &charges)
	for _, c := range charges.Charges {
		perOrder["charge "+c.OrderID]++
	}
	var records demo.RecordList
	resilGetJSON(t, services[demo.NameRecords].URL+"/v1/records", &records)
	for _, r := range records.Records {
		var body struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(r.Body, &body); err != nil {
			t.Fatalf("record %s: %v", r.ID, err)
		}
		perOrder["record "+body.OrderID]++
	}
	for what, n := range perOrder {
		if n > 1 {
			out.duplicates++
			t.Errorf("order %s %d times", what, n)
		}
	}
	if len(charges.Charges) != jobs || len(records.Records) != jobs {
		t.Errorf("%d charges and %d records for %d jobs; want one of each per job", len(charges.Charges), len(records.Records), jobs)
	}
	ledger := map[string]schemas.EffectState{}
	lctx, lcancel := context.WithTimeout(ctx, 30*time.Second)
	if err := store.Effects.List(lctx, func(e kv.EffectEntry) bool { ledger[e.Record.Key] = e.Record.State; return true }); err != nil {
		t.Fatal(err)
	}
	lcancel()
	for _, id := range ids {
		for _, s := range def.Steps {
			if st := ledger[id+"/"+s.ID]; st != schemas.EffectConfirmed {
				t.Errorf("ledger: %s/%s is %q; want confirmed", id, s.ID, st)
			}
		}
	}

	out.completed = chaosCount(final, schemas.JobCompleted)
	if out.storedAgain > 0 {
		t.Errorf("%d history events of %d jobs are stored more than once in the history stream; want each event once per transition, whichever engine handled the job (issue 7)", out.storedAgain, out.storedAgainJobs)
	}
	return out
}

// chaosStory lists a job's events in seq order, for a failure message.
func chaosStory(evs []chaosEvent) string {
	evs = slices.Clone(evs)
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].seq < evs[j].seq })
	var out []string
	for _, e := range evs {
		out = append(out, fmt.Sprintf("%d %s %s", e.seq, strings.TrimPrefix(e.typ, "dev.waymark."), e.step))
	}
	return strings.Join(out, "; ")
}

// chaosDistinct returns one copy of each event id's event.
func chaosDistinct(evs map[string][]chaosEvent) []chaosEvent {
	out := make([]chaosEvent, 0, len(evs))
	for _, copies := range evs {
		out = append(out, copies[0])
	}
	return out
}

func chaosCount(final map[string]*schemas.Checkpoint, status schemas.JobStatus) int {
	n := 0
	for _, cp := range final {
		if cp.Status == status {
			n++
		}
	}
	return n
}

// chaosDropLines removes the lines containing s, to keep a failure's log
// tail about something else than the many conflicts at debug level.
func chaosDropLines(log, s string) string {
	var b strings.Builder
	for line := range strings.Lines(log) {
		if !strings.Contains(line, s) {
			b.WriteString(line)
		}
	}
	return b.String()
}

// TestRedeliveredLastResultLeavesCompletedJobAlone kills an engine right
// after it wrote the checkpoint that completes a job, before it
// acknowledged the result that completed it, as the chaos test's kills
// often do. Another engine then gets that result again (one inbox ack wait
// later): the job is terminal, so the result is stale and the job must be
// left as it is: no new checkpoint, no event after job.completed, the
// history's events stored once.
func TestRedeliveredLastResultLeavesCompletedJobAlone(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	count := newCounter(t)
	store := srv.Store(t, crashKV)
	bin := testsupport.Binary(t, "engine")
	natsURL := "--nats-url=" + srv.URL()
	spawn(t, nil, testsupport.Binary(t, "worker"), natsURL, "--service=count="+count.srv.URL)
	// The engine's fourth write completes the job (start, a, b, c).
	first := spawn(t, []string{"WAYMARK_FAILPOINTS=engine.after_checkpoint=crash@4"}, bin, "serve", natsURL, "--http=", "--workers=0")
	cl := client.New(store)
	def := loadDef(t, "testdata/three-calls.yaml")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := cl.Start(ctx, def, json.RawMessage(`{}`), client.StartOptions{JobID: "last"}); err != nil {
		t.Fatal(err)
	}
	first.waitKilled(t, 30*time.Second)
	done, err := store.Checkpoints.Get(ctx, "last")
	if err != nil {
		t.Fatal(err)
	}
	if done.Checkpoint.Status != schemas.JobCompleted {
		t.Fatalf("the engine died at its fourth write with the job %s (seq %d); want completed", done.Checkpoint.Status, done.Checkpoint.Seq)
	}
	spawn(t, nil, bin, "serve", natsURL, "--http=", "--workers=0")
	// The dead engine's unacknowledged result comes back and is handled.
	cons, err := store.JS.Consumer(ctx, store.Names.InboxStream, store.Names.EngineConsumer)
	if err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	}, "the inbox never settled")
	after, err := store.Checkpoints.Get(ctx, "last")
	if err != nil {
		t.Fatal(err)
	}
	events, _ := chaosHistory(t, store)
	story := chaosStory(chaosDistinct(events["last"]))
	if after.Revision != done.Revision {
		t.Errorf("the completed job was written again: seq %d (%s, resume_count %d) became seq %d (%s, resume_count %d); history: %s",
			done.Checkpoint.Seq, done.Checkpoint.Status, done.Checkpoint.ResumeCount, after.Checkpoint.Seq, after.Checkpoint.Status, after.Checkpoint.ResumeCount, story)
	}
	for id, copies := range events["last"] {
		if len(copies) > 1 {
			t.Errorf("event %s stored %d times in the history stream", id, len(copies))
		}
	}
	for _, p := range []string{"/a", "/b", "/c"} {
		if n := count.count(p); n != 1 {
			t.Errorf("%s called %d times, want exactly once", p, n)
		}
	}
	// The engine died between the terminal checkpoint and what follows it:
	// the next one (on the redelivered result, or its reconciler) published
	// the final history and moved the job's index entry to ended.
	if !slices.ContainsFunc(chaosDistinct(events["last"]), func(e chaosEvent) bool { return e.typ == schemas.EventJobCompleted }) {
		t.Errorf("the final history (job.completed) was never published: %s", story)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		_, err := store.Jobs.Get(ctx, kv.EndedKey(schemas.JobCompleted, after.Checkpoint.Workflow, "last"))
		return err == nil
	}, "the job's index entry never moved to ended")
	if _, err := store.Jobs.Get(ctx, kv.ActiveKey(after.Checkpoint.Workflow, "last")); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("the finished job is still indexed as active: %v", err)
	}
}

// seedFromEnv returns the kill schedule's seed: the value of the
// environment variable name when set (a replay), else the clock.
func seedFromEnv(t *testing.T, name string) int64 {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return time.Now().UnixNano()
	}
	seed, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, s, err)
	}
	return seed
}

// startDemos starts the payments and records demo services under dir,
// each answering delay after performing its effect; they stop when t ends.
func startDemos(t *testing.T, dir string, delay time.Duration) map[string]*demo.Running {
	t.Helper()
	services := map[string]*demo.Running{}
	for _, name := range []string{demo.NamePayments, demo.NameRecords} {
		r, err := demo.Start(context.Background(), name, demo.Options{Dir: filepath.Join(dir, name), Delay: delay})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Close() })
		services[name] = r
	}
	return services
}
