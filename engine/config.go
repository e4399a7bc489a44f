package engine

import (
	"fmt"
	"log/slog"
	"runtime"
	"time"

	"github.com/waymark-dev/waymark/internal/failpoint"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Defaults for Config.
const (
	DefaultBatchSize         = 256
	DefaultHistoryBatch      = 8
	DefaultCacheBytes        = 64 << 20
	DefaultReconcileInterval = 15 * time.Second
	DefaultSweepInterval     = time.Hour
	DefaultOrphanGrace       = 10 * time.Minute
	DefaultStallGrace        = 30 * time.Second
	DefaultPublishTimeout    = 10 * time.Second
)

// Config configures an Engine. The zero value of every field but Store
// takes the default its comment states.
type Config struct {
	// Store is the opened JetStream layout. Required.
	Store *kv.Store
	// Logger receives the engine's log; nil means slog.Default().
	Logger *slog.Logger
	// Lanes is how many batches of inbox messages are decided at once:
	// messages are partitioned into lanes by job id, and a lane handles its
	// messages in batches, one round of writes at a time. Default one lane
	// per two cores (GOMAXPROCS/2, at least 1): fewer, larger rounds share
	// fsyncs and publishes (measured on 2 cores: 1 lane 5,200 steps/s
	// under sync always against 4,300 with 4, and as fast under sync
	// interval).
	Lanes int
	// BatchSize caps the inbox messages one lane handles in one round of
	// writes and publishes. Default 256.
	BatchSize int
	// CacheBytes caps the checkpoints kept in memory, in bytes of their
	// encoding (the least recently used go first). The cache only saves
	// reads: every write is still a compare-and-swap, and what the engine
	// decides and writes is the same with an empty cache. Default 64 MiB
	// (about 25,000 jobs of 1 KiB state); negative keeps nothing.
	CacheBytes int
	// ReconcileInterval is how often the reconciler scans running jobs for
	// dispatches whose result never came. Default 15s; negative disables.
	ReconcileInterval time.Duration
	// HistoryBatch is how many transitions' events a job's checkpoint
	// carries (its outbox) before they are published to the history stream
	// together, as one message; a job that stops (completes, fails, needs a
	// person) publishes at once. Until then Client.History and Client.Wait
	// read them from the checkpoint. 1 publishes after every transition.
	// Every engine of a deployment may use its own: the checkpoint records
	// whether its outbox was published. Default 8.
	HistoryBatch int
	// SweepInterval is how often finished jobs past their retention
	// (kv.Config.JobRetention) are removed. Default 1h.
	SweepInterval time.Duration
	// OrphanGrace is how old an index entry without a checkpoint (a client
	// that died between the two writes that create a job) must be before
	// the reconciler removes it. Default 10m.
	OrphanGrace time.Duration
	// StallGrace is added to a step's timeout and twice the work ack wait
	// before the reconciler declares an attempt lost. Default 30s.
	StallGrace time.Duration
	// PublishTimeout bounds waiting for JetStream to acknowledge a batch of
	// writes or publishes. Default 10s.
	PublishTimeout time.Duration
	// Failpoints injects faults at named points (tests and crash drills);
	// nil injects nothing.
	Failpoints *failpoint.Set
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// SoleEngine says this engine is the only one serving its streams (the
	// embedded server, whose data directory only one process can open).
	// Then any job it takes over from an earlier engine process counts as
	// resumed, even when nothing was in flight, unless that process
	// stopped cleanly (it records so when Run returns); with several
	// engines only redelivered messages can tell a crash from a hand-over.
	SoleEngine bool
	// OnWrite, when set, is called after every checkpoint write that
	// succeeded, with the checkpoint written (do not modify it). It runs on
	// the engine's goroutines and must not block: for benchmarks and
	// observers that cannot afford a KV watch.
	OnWrite func(cp *schemas.Checkpoint)

	// beforeDecide, when set (tests), runs before each job's transition is
	// decided.
	beforeDecide func(job string)
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Lanes == 0 {
		c.Lanes = max(1, runtime.GOMAXPROCS(0)/2)
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.CacheBytes == 0 {
		c.CacheBytes = DefaultCacheBytes
	}
	if c.ReconcileInterval == 0 {
		c.ReconcileInterval = DefaultReconcileInterval
	}
	if c.HistoryBatch == 0 {
		c.HistoryBatch = DefaultHistoryBatch
	}
	if c.SweepInterval == 0 {
		c.SweepInterval = DefaultSweepInterval
	}
	if c.OrphanGrace == 0 {
		c.OrphanGrace = DefaultOrphanGrace
	}
	if c.StallGrace == 0 {
		c.StallGrace = DefaultStallGrace
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

func (c Config) validate() error {
	switch {
	case c.Store == nil:
		return fmt.Errorf("engine config: Store is required")
	case c.Lanes < 1 || c.Lanes > 4096:
		return fmt.Errorf("engine config: Lanes %d: want 1..4096", c.Lanes)
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("engine config: BatchSize %d: want 1..10000", c.BatchSize)
	case c.HistoryBatch < 1 || c.HistoryBatch > 256:
		return fmt.Errorf("engine config: HistoryBatch %d: want 1..256", c.HistoryBatch)
	case c.SweepInterval < 0:
		return fmt.Errorf("engine config: SweepInterval %v: want a positive duration (0 means the default, %v)", c.SweepInterval, DefaultSweepInterval)
	case c.OrphanGrace < 0:
		return fmt.Errorf("engine config: OrphanGrace %v: want a positive duration (0 means the default, %v)", c.OrphanGrace, DefaultOrphanGrace)
	case c.StallGrace < 0:
		return fmt.Errorf("engine config: StallGrace %v: want a positive duration (0 means the default, %v)", c.StallGrace, DefaultStallGrace)
	case c.PublishTimeout < 10*time.Millisecond:
		return fmt.Errorf("engine config: PublishTimeout %v: want at least 10ms", c.PublishTimeout)
	}
	return nil
}
