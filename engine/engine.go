package engine

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Engine applies inbox messages (job starts, step results, signals) to
// checkpoints and dispatches the steps that become eligible. It keeps no
// state between messages that correctness depends on: its checkpoint cache
// only saves reads, and every write is a compare-and-swap. Any number of
// engines may share one inbox consumer. See the package documentation for
// the message flow.
type Engine struct {
	cfg      Config
	store    *kv.Store
	log      *slog.Logger
	compiled *compiledCache
	cache    *checkpointCache
	ctr      counters
	fp       *failpoint.Set
	// incarnation names this engine process's life, so that it counts one
	// resume per job however many of the job's messages a crash left.
	incarnation string
	// quiet rate-limits repeated warnings about one job (a job blocked on
	// its definition, a quarantined checkpoint).
	quiet *quietLog

	// cleanStops holds the incarnations of earlier engine processes that
	// stopped cleanly (SoleEngine): taking a job over from one is no
	// recovery. Set before the lanes start, read only.
	cleanStops map[string]bool

	// beforeWrite, when set (tests), runs after a transition is decided
	// and before its checkpoint write is sent.
	beforeWrite func(job string)
	// dropChildStart, when set (tests), says whether to skip starting a
	// child job after its dispatch was written, as a crash there would.
	dropChildStart func(child string) bool
	// skipFlowRelease, when set (tests), skips releasing flow slots after
	// a write, as a crash between the two would.
	skipFlowRelease bool
	// flowGrace is FlowGrace (tests shorten it).
	flowGrace time.Duration
}

// New returns an Engine. Errors name the bad Config field.
func New(cfg Config) (*Engine, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	env := newFanEnv()
	if vs := cfg.Store.Values; vs != nil {
		env.get = func(ctx context.Context, owner, digest string, size int) ([]byte, error) {
			return vs.Get(ctx, owner, schemas.ValueRef{Digest: digest, Bytes: size})
		}
		env.threshold, env.maxState = cfg.Store.Config.ValueThreshold, cfg.Store.Config.MaxJobStateBytes
	}
	return &Engine{
		cfg:         cfg,
		store:       cfg.Store,
		log:         cfg.Logger.With("component", "engine"),
		compiled:    newCompiledCache(256, env),
		cache:       newCheckpointCache(cfg.CacheBytes),
		fp:          cfg.Failpoints,
		incarnation: nuid.Next(),
		quiet:       newQuietLog(time.Minute),
		flowGrace:   FlowGrace,
	}, nil
}

// Run consumes the inbox until ctx ends, then stops taking messages,
// finishes the batches in hand (bounded by PublishTimeout) and returns
// nil. Messages not acknowledged by then are redelivered to another engine
// or to the next Run. Errors: the inbox consumer could not be opened.
func (e *Engine) Run(ctx context.Context) error {
	e.ctr.started.Store(e.cfg.Now().UnixNano())
	if e.cfg.SoleEngine {
		e.takeOver(ctx)
	}
	cons, err := e.store.EngineConsumer(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	// Queues that were lost (memory queues after a server restart) are
	// recreated before anything else; what they held is dispatched again
	// from the checkpoints, some of it at once, some once it is safe.
	var lostAt time.Time
	var requeueAgain <-chan time.Time // set while steps wait for their turn
	requeue := func() {
		requeueAgain = nil
		if lostAt.IsZero() {
			return
		}
		waiting, err := e.Requeue(ctx, lostAt)
		switch {
		case err != nil:
			e.ctr.reconcileErrors.Add(1)
			e.log.Warn("requeue after lost queues incomplete; will try again", "err", err)
			requeueAgain = time.After(time.Second)
		case waiting > 0:
			e.log.Debug("lookup and unsafe steps wait for their first attempt to end before they are dispatched again", "jobs", waiting)
			requeueAgain = time.After(time.Second)
		default:
			lostAt = time.Time{}
		}
	}
	if e.recoverQueues(ctx) {
		lostAt = e.cfg.Now()
		requeue()
	}
	lanes := make([]chan jetstream.Msg, e.cfg.Lanes)
	var wg, lanesDone sync.WaitGroup
	// Batches in hand when ctx ends are finished under work, which a stop
	// cancels only if they outlast PublishTimeout: a clean stop leaves
	// no write with an unknown outcome behind.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	for i := range lanes {
		lanes[i] = make(chan jetstream.Msg, e.cfg.BatchSize)
		lanesDone.Add(1)
		go func(ch chan jetstream.Msg) {
			defer lanesDone.Done()
			e.lane(work, ch)
		}(lanes[i])
	}
	names := e.store.Names
	lost := make(chan struct{}, 1) // the inbox consumer is gone (its stream was lost)
	signalLost := func() {
		select {
		case lost <- struct{}{}:
		default:
		}
	}
	// A reconnection may follow a server restart: check the queues then.
	var reconnected chan nats.Status
	if nc := e.store.JS.Conn(); nc != nil {
		reconnected = nc.StatusChanged(nats.CONNECTED)
		defer nc.RemoveStatusListener(reconnected)
	}
	consume := func(cons jetstream.Consumer) (jetstream.ConsumeContext, error) {
		return cons.Consume(func(m jetstream.Msg) {
			_, job, _ := names.ParseInboxSubject(m.Subject())
			h := fnv.New32a()
			_, _ = h.Write([]byte(job))
			lanes[h.Sum32()%uint32(len(lanes))] <- m
		},
			jetstream.PullMaxMessages(e.cfg.BatchSize*2),
			jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
				if ctx.Err() != nil || errors.Is(err, nats.ErrConnectionClosed) {
					return
				}
				if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrNoHeartbeat) ||
					errors.Is(err, nats.ErrNoResponders) {
					signalLost()
				}
				e.log.Warn("inbox consumer", "err", err)
			}))
	}
	cc, err := consume(cons)
	if err != nil {
		for _, ch := range lanes {
			close(ch)
		}
		lanesDone.Wait()
		return fmt.Errorf("consume inbox: %w", err)
	}
	stopDead, err := e.watchDeadLetters(ctx)
	if err != nil {
		e.log.Warn("poison steps will only be caught by the reconciler", "err", err)
		stopDead = func() {}
	}
	defer stopDead()
	if e.cfg.ReconcileInterval > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.reconcileLoop(ctx, signalLost)
		}()
	}
	// Due timers (sleeps, approval expiries) go from the timer stream to
	// the jobs' inboxes.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			if err := e.store.ForwardTimers(ctx, e.fireCron); err != nil {
				e.log.Warn("timer forwarding stopped; trying again in 5s", "err", err)
				select {
				case <-ctx.Done():
				case <-time.After(5 * time.Second):
				}
			}
		}
	}()
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
		case <-requeueAgain:
			requeue()
		case <-reconnected:
			signalLost()
		case <-lost:
			// Make sure the layout exists, rebuild lost queues, and consume
			// again from a consumer that exists.
			if !e.recoverQueues(ctx) {
				requeue() // steps still waiting for their turn
				continue
			}
			lostAt = e.cfg.Now()
			requeue()
			if c, err := e.store.EngineConsumer(ctx); err == nil {
				if next, err := consume(c); err == nil {
					cc.Stop()
					<-cc.Closed()
					cc = next
				}
			}
		}
	}
	// Messages the client holds go through the lanes too: a stopped
	// consumer would leave them to the ack wait.
	cc.Drain()
	<-cc.Closed()
	for _, ch := range lanes {
		close(ch)
	}
	drained := make(chan struct{})
	go func() { lanesDone.Wait(); close(drained) }()
	t := time.NewTimer(e.cfg.PublishTimeout)
	select {
	case <-drained:
	case <-t.C:
		cancelWork()
		<-drained
	}
	t.Stop()
	wg.Wait()
	if e.cfg.SoleEngine {
		// Every batch in hand is settled: the next process takes nothing
		// over from this one that a crash left.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		if err := e.store.RecordCleanStop(sctx, e.incarnation); err != nil {
			e.log.Warn("could not record this clean stop; the next engine counts the jobs it takes over as resumed", "err", err)
		}
	}
	return nil
}

// takeOver prepares the sole engine of a deployment (SoleEngine) to go on
// from the process before it: it reads which earlier processes stopped
// cleanly (taking a job over from one is no recovery), and takes back the
// inbox messages the consumer still counts as delivered to one, which
// would otherwise wait out the inbox ack wait: no one else has them.
// Failures are logged; both only cost a count or a delay.
func (e *Engine) takeOver(ctx context.Context) {
	stops, err := e.store.CleanStops(ctx)
	if err != nil {
		e.log.Warn("cannot read which engines stopped cleanly; jobs taken over from them count as resumed", "err", err)
	}
	e.cleanStops = make(map[string]bool, len(stops))
	for _, s := range stops {
		e.cleanStops[s] = true
	}
	if n, err := e.store.ReleaseEngineDeliveries(ctx); err != nil {
		e.log.Warn("cannot take back the inbox messages an earlier process held; they come back after the inbox ack wait", "err", err)
	} else if n > 0 {
		e.log.Info("took back the inbox messages an earlier engine process held", "messages", n)
	}
}

// recoverQueues checks the queue epoch and, when the queues were lost,
// recreates the layout and marks the queues anew. It reports whether they
// were lost; the caller dispatches again what they held (Requeue). Errors
// are logged and retried at the next check.
func (e *Engine) recoverQueues(ctx context.Context) bool {
	intact, marked, err := e.store.QueueState(ctx)
	if err != nil {
		e.log.Warn("cannot check the queues; will try again", "err", err)
		return false
	}
	if intact {
		return false
	}
	if err := e.store.Reopen(ctx); err != nil {
		e.log.Warn("cannot recreate the layout; will try again", "err", err)
		return false
	}
	if err := e.store.MarkQueues(ctx); err != nil {
		e.log.Warn("cannot mark the queues; will try again", "err", err)
		return false
	}
	if marked {
		e.log.Info("the queues were lost; running jobs are dispatched again from their checkpoints")
	} else {
		e.log.Debug("the queues are marked for the first time")
	}
	return true
}

// definition loads and compiles the definition with the given hash into
// p.def. A definition that is not stored, or does not decode, is
// errDefinitionMissing (the job blocks until it is stored again); other
// errors are passing faults.
func (e *Engine) definition(ctx context.Context, p *plan, hash string) error {
	if p.def != nil && p.def.def.Hash == hash {
		return nil
	}
	def, err := e.store.Definitions.Get(ctx, hash)
	if err == nil {
		p.def, err = e.compiled.get(def)
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, schemas.ErrNotFound), errors.Is(err, schemas.ErrDefinitionInvalid):
		err = &definitionMissing{hash: hash, cause: err}
	}
	p.err = fmt.Errorf("job %s: %w", p.job, err)
	return err
}

// definitionMissing: a job's pinned definition cannot be loaded.
type definitionMissing struct {
	hash  string
	cause error
}

func (d *definitionMissing) Error() string {
	if errors.Is(d.cause, schemas.ErrNotFound) {
		return fmt.Sprintf("definition %s not found", d.hash)
	}
	return fmt.Sprintf("definition %s cannot be read: %v", d.hash, d.cause)
}

func (d *definitionMissing) Unwrap() error { return d.cause }
