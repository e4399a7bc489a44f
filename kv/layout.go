package kv

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/waymark-dev/waymark/schemas"
)

// Defaults for Config. Each is the value a zero field takes.
const (
	DefaultPrefix          = "waymark"
	DefaultDuplicates      = 2 * time.Minute
	DefaultInboxAckWait    = 30 * time.Second
	DefaultWorkAckWait     = 30 * time.Second
	DefaultWorkMaxDeliver  = 20
	DefaultMaxValueBytes   = 1 << 20
	DefaultMaxAckPending   = 20000
	DefaultJobRetention    = 30 * 24 * time.Hour
	DefaultReplicas        = 1
	DefaultMaxMessageBytes = 1 << 20
	DefaultValueThreshold  = 64 << 10
	DefaultMaxJobState     = 64 << 20
	// DefaultEventRetention is how long the events bucket remembers a
	// CloudEvent that started jobs (its dedup record).
	DefaultEventRetention = 7 * 24 * time.Hour
)

// Queue storages.
const (
	QueueFile   = "file"
	QueueMemory = "memory"
)

// Inbox subject kinds: the third token of an inbox subject.
const (
	InboxStart  = "start"
	InboxResult = "result"
	InboxSignal = "signal" // a person's decision (an effect resolved)
)

// Config names and sizes every JetStream resource Waymark uses. Engines and
// workers that share a deployment must share a Config (at least its
// Prefix); the zero value gives the documented defaults.
type Config struct {
	// Prefix starts every name: lower-case in buckets, consumers and
	// subjects, upper-case in streams. Default "waymark".
	Prefix string `json:"prefix,omitempty"`
	// Replicas of every stream and bucket (1, 3 or 5). Default 1.
	Replicas int `json:"replicas,omitempty"`
	// Memory stores everything in memory instead of files. For tests only:
	// nothing survives a server restart.
	Memory bool `json:"memory,omitempty"`
	// QueueStorage is where the work and inbox streams keep their messages:
	// QueueFile or QueueMemory; empty means what the deployment already
	// uses (recorded in the definitions bucket when its queues were first
	// made), or QueueFile for a new one. Checkpoints, the effect ledger,
	// definitions and history are always files, synced as the server is
	// told. Memory queues spare every synced queue write (four per step:
	// step message, result, and the two removals); a server restart loses
	// all they held, and engines dispatch it again from the checkpoints
	// (see Store.QueuesIntact and engine.Engine.Requeue).
	QueueStorage string `json:"queue_storage,omitempty"`
	// Duplicates is the dedup window of the work, inbox and history
	// streams. Default 2m. Dedup beyond it rests on checkpoints and the
	// effect ledger (DESIGN.md invariant 5).
	Duplicates time.Duration `json:"duplicates,omitempty"`
	// InboxAckWait bounds how long an engine may hold an inbox message
	// before another engine gets it: the recovery latency after an engine
	// dies mid-transition. Default 30s.
	InboxAckWait time.Duration `json:"inbox_ack_wait,omitempty"`
	// WorkAckWait is a worker's lease on a step message; workers extend it
	// with heartbeats while a step runs. Default 30s.
	WorkAckWait time.Duration `json:"work_ack_wait,omitempty"`
	// WorkMaxDeliver caps deliveries of one step message (a worker that dies
	// on it every time). Default 20.
	WorkMaxDeliver int `json:"work_max_deliver,omitempty"`
	// MaxAckPending caps unacknowledged messages per consumer. Default 20000.
	MaxAckPending int `json:"max_ack_pending,omitempty"`
	// MaxValueBytes caps one checkpoint or definition. Default 1 MiB.
	MaxValueBytes int32 `json:"max_value_bytes,omitempty"`
	// MaxMessageBytes caps one step message or result. Default 1 MiB.
	MaxMessageBytes int32 `json:"max_message_bytes,omitempty"`
	// HistoryMaxAge caps how long the history stream keeps an event,
	// whatever its job does. Default 0: no cap; a job's history is
	// removed with the job (JobRetention).
	HistoryMaxAge time.Duration `json:"history_max_age,omitempty"`
	// JobRetention is how long a finished job (completed or failed) is
	// kept; then engines remove its checkpoint, its history, its index
	// entry and the effect records no live job needs. Default 30 days;
	// negative keeps finished jobs forever. Nothing of a job that has not
	// finished is ever removed.
	JobRetention time.Duration `json:"job_retention,omitempty"`
	// TuneConsumers lets this process change the tuning of existing
	// shared consumers (ack wait, max deliver, max ack pending, backoff)
	// to this Config's values: the engine consumer and every pool's work
	// consumer, each change logged at info with the old and new value.
	// Engines set it (engine run, engine serve); workers and the CLI
	// leave it false, so that a process started with other settings never
	// rewrites what the others rely on: it logs the difference at warn and
	// works with the consumer as it is (a worker refuses a work consumer
	// whose ack wait is shorter than its own, see EnsureWorkConsumer).
	// Consumers that are absent are created with this Config either way.
	TuneConsumers bool `json:"tune_consumers,omitempty"`
	// GroupCommit sends this process's checkpoint writes as atomic
	// batches (ADR-50), one commit in flight at a time, whatever was
	// written meanwhile in the next: one fsync for many writes where the
	// server fsyncs every write (sync always on an R1 file stream). Open
	// turns on allow_atomic on the checkpoint bucket's stream; a server
	// that refuses it (older than 2.12) gets writes one by one. It costs
	// more than it saves where writes are not fsynced one by one (the
	// server creates a staging store per batch), so the default is off
	// and the CLI turns it on for an embedded server under sync always.
	GroupCommit bool `json:"group_commit,omitempty"`
	// ValueThreshold, in bytes: a top-level member of a job's state whose
	// compact JSON value is longer is kept in the value store (Values) and
	// the checkpoint holds a reference to it (schemas.ValueRef). Default
	// 64 KiB, or a quarter of MaxMessageBytes when that is less (but at
	// least 1024); it must be at least 1024 and below half of
	// MaxMessageBytes (so MaxMessageBytes above 2048).
	ValueThreshold int `json:"value_threshold,omitempty"`
	// MaxJobStateBytes caps a job's logical state size, in bytes: its
	// state with every reference counted as the value it names
	// (schemas.LogicalSize). Default 64 MiB; at least ValueThreshold.
	MaxJobStateBytes int64 `json:"max_job_state_bytes,omitempty"`
	// EventRetention is the TTL of the events bucket: how long the dedup
	// record of a CloudEvent that started jobs (its source and id, the
	// jobs it started) is kept, so that the same event delivered again
	// within it answers those jobs and starts nothing. Default 7 days
	// (env WAYMARK_EVENT_RETENTION); at least 1s. Past it, a delivery of
	// the same event attaches to its job as long as the job is kept
	// (JobRetention), its id being derived from the event.
	EventRetention time.Duration `json:"event_retention,omitempty"`
}

var prefixRE = regexp.MustCompile(`^[a-z][a-z0-9_]{0,31}$`)

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.Replicas == 0 {
		c.Replicas = DefaultReplicas
	}
	if c.Duplicates == 0 {
		c.Duplicates = DefaultDuplicates
	}
	if c.InboxAckWait == 0 {
		c.InboxAckWait = DefaultInboxAckWait
	}
	if c.WorkAckWait == 0 {
		c.WorkAckWait = DefaultWorkAckWait
	}
	if c.WorkMaxDeliver == 0 {
		c.WorkMaxDeliver = DefaultWorkMaxDeliver
	}
	if c.MaxAckPending == 0 {
		c.MaxAckPending = DefaultMaxAckPending
	}
	if c.MaxValueBytes == 0 {
		c.MaxValueBytes = DefaultMaxValueBytes
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if c.JobRetention == 0 {
		c.JobRetention = DefaultJobRetention
	}
	if c.ValueThreshold == 0 {
		// A quarter of a smaller message limit, so that a Config that
		// only lowers MaxMessageBytes stays valid.
		c.ValueThreshold = max(min(DefaultValueThreshold, int(c.MaxMessageBytes/4)), 1024)
	}
	if c.MaxJobStateBytes == 0 {
		c.MaxJobStateBytes = DefaultMaxJobState
	}
	if c.EventRetention == 0 {
		c.EventRetention = DefaultEventRetention
	}
	return c
}

// Validate reports the first bad field of c (after WithDefaults).
func (c Config) Validate() error {
	switch {
	case !prefixRE.MatchString(c.Prefix):
		return fmt.Errorf("kv config: prefix %q: want lower-case letters, digits and '_', starting with a letter, at most 32", c.Prefix)
	case c.QueueStorage != "" && c.QueueStorage != QueueFile && c.QueueStorage != QueueMemory:
		return fmt.Errorf("kv config: queue storage %q: want %q or %q", c.QueueStorage, QueueFile, QueueMemory)
	case c.Replicas != 1 && c.Replicas != 3 && c.Replicas != 5:
		return fmt.Errorf("kv config: replicas %d: want 1, 3 or 5", c.Replicas)
	case c.Duplicates < time.Second:
		return fmt.Errorf("kv config: duplicates window %v: want at least 1s (0 means the default, %v)", c.Duplicates, DefaultDuplicates)
	case c.InboxAckWait < 100*time.Millisecond:
		return fmt.Errorf("kv config: inbox ack wait %v: want at least 100ms (0 means the default, %v)", c.InboxAckWait, DefaultInboxAckWait)
	case c.WorkAckWait < 100*time.Millisecond:
		return fmt.Errorf("kv config: work ack wait %v: want at least 100ms (0 means the default, %v)", c.WorkAckWait, DefaultWorkAckWait)
	case c.WorkMaxDeliver < 2 && c.WorkMaxDeliver != -1:
		return fmt.Errorf("kv config: work max deliver %d: want at least 2, or -1 for no limit", c.WorkMaxDeliver)
	case c.MaxAckPending < 1 && c.MaxAckPending != -1:
		return fmt.Errorf("kv config: max ack pending %d: want at least 1, or -1 for no limit", c.MaxAckPending)
	case c.MaxValueBytes < 1024:
		return fmt.Errorf("kv config: max value bytes %d: want at least 1024", c.MaxValueBytes)
	case c.MaxMessageBytes < 1024:
		return fmt.Errorf("kv config: max message bytes %d: want at least 1024", c.MaxMessageBytes)
	case c.HistoryMaxAge < 0 || (c.HistoryMaxAge > 0 && c.HistoryMaxAge < 100*time.Millisecond):
		// JetStream refuses a stream max age under 100ms.
		return fmt.Errorf("kv config: history max age %v: want 100ms or more, or 0 for no cap", c.HistoryMaxAge)
	case c.ValueThreshold < 1024:
		return fmt.Errorf("kv config: value threshold %d: want at least 1024 bytes (0 means the default, %d)", c.ValueThreshold, DefaultValueThreshold)
	case int64(c.ValueThreshold) >= int64(c.MaxMessageBytes)/2:
		return fmt.Errorf("kv config: value threshold %d: want below half the max message bytes (%d), so that a step message or result holding members up to the threshold fits", c.ValueThreshold, c.MaxMessageBytes)
	case c.EventRetention < time.Second:
		return fmt.Errorf("kv config: event retention %v: want at least 1s (0 means the default, %v)", c.EventRetention, DefaultEventRetention)
	case c.MaxJobStateBytes < int64(c.ValueThreshold):
		return fmt.Errorf("kv config: max job state %d bytes: want at least the value threshold (%d) (0 means the default, %d)", c.MaxJobStateBytes, c.ValueThreshold, DefaultMaxJobState)
	}
	return nil
}

// Names are the concrete names derived from a Config.
type Names struct {
	CheckpointBucket  string // waymark_checkpoints
	EffectBucket      string // waymark_effects
	DefinitionBucket  string // waymark_definitions
	JobsBucket        string // waymark_jobs: the job index
	LimitsBucket      string // waymark_limits: providers' rate limits, shared by workers
	FlowBucket        string // waymark_flow: workflow steps' concurrency slots, waiters and rate windows, shared by engines
	StoreBucket       string // waymark_store: the session store, read and written across jobs
	ValueBucket       string // waymark_values: object store of large state values
	EventBucket       string // waymark_events: dedup records of CloudEvents that started jobs
	TriggerPrefix     string // waymark.trigger.: CloudEvents intake over NATS (request/reply)
	WorkStream        string // WAYMARK_WORK
	InboxStream       string // WAYMARK_INBOX
	HistoryStream     string // WAYMARK_HISTORY
	EpochStream       string // WAYMARK_QUEUE_EPOCH
	TimerStream       string // WAYMARK_TIMERS: durable timers (message schedules)
	TimerPrefix       string // waymark.timer.
	TimerConsumer     string // waymark-timers: engines forward due timers to the inbox
	EngineConsumer    string // waymark-engine
	WorkSubjectPrefix string // waymark.work.
	InboxPrefix       string // waymark.inbox.
	HistoryPrefix     string // waymark.history.
	prefix            string
}

// NamesFor derives names from prefix (already validated).
func NamesFor(prefix string) Names {
	up := strings.ToUpper(prefix)
	return Names{
		CheckpointBucket:  prefix + "_checkpoints",
		DefinitionBucket:  prefix + "_definitions",
		EffectBucket:      prefix + "_effects",
		JobsBucket:        prefix + "_jobs",
		LimitsBucket:      prefix + "_limits",
		FlowBucket:        prefix + "_flow",
		StoreBucket:       prefix + "_store",
		ValueBucket:       prefix + "_values",
		EventBucket:       prefix + "_events",
		TriggerPrefix:     prefix + ".trigger.",
		WorkStream:        up + "_WORK",
		InboxStream:       up + "_INBOX",
		HistoryStream:     up + "_HISTORY",
		EpochStream:       up + "_QUEUE_EPOCH",
		TimerStream:       up + "_TIMERS",
		TimerPrefix:       prefix + ".timer.",
		TimerConsumer:     prefix + "-timers",
		EngineConsumer:    prefix + "-engine",
		WorkSubjectPrefix: prefix + ".work.",
		InboxPrefix:       prefix + ".inbox.",
		HistoryPrefix:     prefix + ".history.",
		prefix:            prefix,
	}
}

// WorkSubject is the subject of job's step messages in pool: one subject
// per job, so that whether a job's step message is still queued is a
// question the stream can answer (a last-message-for-subject lookup).
func (n Names) WorkSubject(pool, job string) string {
	return n.WorkSubjectPrefix + pool + "." + job
}

// WorkFilter is the filter of pool's work consumer: every job's step
// messages in the pool.
func (n Names) WorkFilter(pool string) string { return n.WorkSubjectPrefix + pool + ".*" }

// WorkConsumer is the durable consumer shared by pool's workers.
func (n Names) WorkConsumer(pool string) string { return n.prefix + "-work-" + pool }

// InboxSubject is where messages of kind (InboxStart, InboxResult) for job go.
func (n Names) InboxSubject(kind, job string) string { return n.InboxPrefix + kind + "." + job }

// StreamSubject is the core NATS subject (no stream stores it) on which
// workers publish the text of job's agent turns as it is made:
// "<prefix>.stream.<job>", one message per piece, its headers naming the
// step (Waymark-Step), turn (Waymark-Agent-Turn) and attempt. It is for
// watching only: the durable record is the turn's result.
func (n Names) StreamSubject(job string) string { return n.prefix + ".stream." + job }

// HistorySubject is the subject of job's transitions on the history
// stream: one message per checkpoint sequence, written by engines.
func (n Names) HistorySubject(job string) string { return n.HistoryPrefix + job }

// EffectHistorySubject is the subject of job's effect ledger events on the
// history stream, written by workers and by whoever resolves an effect.
func (n Names) EffectHistorySubject(job string) string { return n.HistoryPrefix + job + ".effects" }

// HistoryFilters are the subjects that hold job's whole history.
func (n Names) HistoryFilters(job string) []string {
	return []string{n.HistorySubject(job), n.EffectHistorySubject(job)}
}

// ParseInboxSubject returns the kind and job of an inbox subject.
func (n Names) ParseInboxSubject(subject string) (kind, job string, ok bool) {
	rest, found := strings.CutPrefix(subject, n.InboxPrefix)
	if !found {
		return "", "", false
	}
	kind, job, ok = strings.Cut(rest, ".")
	return kind, job, ok && job != "" && !strings.Contains(job, ".")
}

// ErrIncompatible is returned by Ensure when a stream, bucket or consumer
// exists with settings Waymark cannot work with. It is never fixed by
// deleting data: an operator decides.
var ErrIncompatible = errors.New("incompatible JetStream resource")

// Store bundles the typed stores and names over one JetStream context.
type Store struct {
	JS          jetstream.JetStream
	Config      Config
	Names       Names
	Checkpoints *Checkpoints
	Definitions *Definitions
	Effects     *Effects
	Jobs        *Jobs         // the job index
	History     *History      // the history stream
	Queues      *Queues       // facts about the work and inbox queues
	Values      *Values       // large state values by reference
	Limits      *Limits       // providers' rate limits, shared by workers
	Flow        *Flow         // workflow steps' flow limits, shared by engines
	Session     *SessionStore // the session store (store steps, engine store)
	Events      *Events       // dedup records of CloudEvents that started jobs
	log         *slog.Logger
	// backfill: the job index was made by this Open, over a deployment
	// that may already hold checkpoints (an upgrade from layout 1).
	backfill bool

	// testEpochHook, when set (tests), runs at each stage of MarkQueues.
	testEpochHook func(stage string)
	// workCommit, inboxCommit: group committers of the work and inbox
	// streams (Config.GroupCommit, file queues); nil: publishes go alone.
	workCommit, inboxCommit *groupCommit
}

// PublishAsync publishes m (a step message or an inbox message) without
// waiting: through the stream's group commit under Config.GroupCommit
// (one fsync shared by the messages published meanwhile), else as
// jetstream.JetStream.PublishMsgAsync. The future answers as that one's:
// a stream sequence, Duplicate when the Nats-Msg-Id was stored before, or
// the server's error.
func (s *Store) PublishAsync(m *nats.Msg) (jetstream.PubAckFuture, error) {
	switch {
	case s.workCommit != nil && strings.HasPrefix(m.Subject, s.Names.WorkSubjectPrefix):
		return s.workCommit.add(m), nil
	case s.inboxCommit != nil && strings.HasPrefix(m.Subject, s.Names.InboxPrefix):
		return s.inboxCommit.add(m), nil
	}
	return s.JS.PublishMsgAsync(m)
}

// KeepsFinishedJobs reports whether finished jobs are kept forever
// (a negative JobRetention).
func (c Config) KeepsFinishedJobs() bool { return c.JobRetention < 0 }

// Open creates every stream and bucket that is absent and checks the ones
// that exist (see Ensure), then returns the stores. log may be nil.
func Open(ctx context.Context, js jetstream.JetStream, cfg Config, log *slog.Logger) (*Store, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	s := &Store{JS: js, Config: cfg, Names: NamesFor(cfg.Prefix), log: log}
	cps, defs, err := s.ensure(ctx)
	if err != nil {
		return nil, err
	}
	s.Checkpoints = &Checkpoints{kv: cps, js: js, maxBytes: int(cfg.MaxValueBytes)}
	if s.Values, err = s.ensureValues(ctx); err != nil {
		return nil, err
	}
	if cfg.GroupCommit {
		atomic, err := s.allowAtomic(ctx, "KV_"+s.Names.CheckpointBucket)
		if err != nil {
			return nil, err
		}
		if atomic {
			s.Checkpoints.group = &groupCommit{js: js, stream: "KV_" + s.Names.CheckpointBucket}
		}
		// Queue messages of file queues are fsynced one by one too; memory
		// queues have no fsync to share.
		if s.Config.QueueStorage == QueueFile {
			for _, q := range []struct {
				stream string
				gc     **groupCommit
			}{{s.Names.WorkStream, &s.workCommit}, {s.Names.InboxStream, &s.inboxCommit}} {
				ok, err := s.allowAtomic(ctx, q.stream)
				if err != nil {
					return nil, err
				}
				if ok {
					*q.gc = &groupCommit{js: js, stream: q.stream}
				}
			}
		}
	}
	s.Definitions = newDefinitions(defs)
	hist, err := js.Stream(ctx, s.Names.HistoryStream)
	if err != nil {
		return nil, fmt.Errorf("open stream %s: %w", s.Names.HistoryStream, err)
	}
	s.History = &History{stream: hist, js: js, names: s.Names}
	s.Queues = &Queues{js: js, names: s.Names}
	if s.backfill {
		if err := s.indexExisting(ctx); err != nil {
			return nil, err
		}
	}
	if err := s.tuneWorkConsumers(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// allowAtomic turns on atomic batch publishes (ADR-50) on stream, so that
// an engine commits a batch of checkpoints with one write, and reports
// whether the server took the setting (nats-server 2.12+; an older one
// drops the field it does not know, and writes go one by one). The
// setting only allows something: no process relies on its absence.
func (s *Store) allowAtomic(ctx context.Context, stream string) (bool, error) {
	st, err := s.JS.Stream(ctx, stream)
	if err != nil {
		return false, fmt.Errorf("open stream %s: %w", stream, err)
	}
	cfg := st.CachedInfo().Config
	if cfg.AllowAtomicPublish {
		return true, nil
	}
	cfg.AllowAtomicPublish = true
	info, err := s.JS.UpdateStream(ctx, cfg)
	if err != nil {
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) {
			s.log.Info("checkpoints are written one by one: the server refused atomic batches", "stream", stream, "err", err)
			return false, nil
		}
		return false, fmt.Errorf("allow atomic batches on stream %s: %w", stream, err)
	}
	return info.CachedInfo().Config.AllowAtomicPublish, nil
}

// headerRoom is what a checkpoint bucket allows beyond MaxValueBytes: the
// server counts a message's headers (the expected revision of every write)

// recordBucket is the configuration of a bucket of small records that
// keeps one revision a key (history 1), as Waymark's buckets do: name,
// description, the largest value in bytes, the layout's storage, replicas
// and metadata.
func (s *Store) recordBucket(name, description string, maxValue int32, meta map[string]string) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{
		Bucket:       name,
		Description:  description,
		History:      1,
		MaxValueSize: maxValue,
		Storage:      s.storage(),
		Replicas:     s.Config.Replicas,
		Metadata:     meta,
	}
}

// against the limit, and MaxValueBytes caps the checkpoint itself.
const headerRoom = 1024

func withHeaderRoom(n int32) int32 {
	if n > math.MaxInt32-headerRoom {
		return n
	}
	return n + headerRoom
}

func (s *Store) storage() jetstream.StorageType {
	if s.Config.Memory {
		return jetstream.MemoryStorage
	}
	return jetstream.FileStorage
}

func (s *Store) ensure(ctx context.Context) (cps, defs jetstream.KeyValue, err error) {
	n, c := s.Names, s.Config
	meta := map[string]string{"waymark_layout": LayoutVersion}
	cps, err = s.ensureBucket(ctx, s.recordBucket(n.CheckpointBucket, "Waymark job checkpoints: key = job id, value = checkpoint JSON, written by compare-and-swap on the revision", withHeaderRoom(c.MaxValueBytes), meta))
	if err != nil {
		return nil, nil, err
	}
	eff, err := s.ensureBucket(ctx, s.recordBucket(n.EffectBucket, "Waymark effect ledger: key = idempotency key, value = effect record (prepared, dispatched, confirmed, ambiguous, reconciled), written by compare-and-swap", withHeaderRoom(c.MaxValueBytes), meta))
	if err != nil {
		return nil, nil, err
	}
	if s.Effects == nil { // Open; Reopen keeps the stores it made (they name their buckets)
		s.Effects = &Effects{kv: eff, js: s.JS, maxBytes: int(c.MaxValueBytes)}
	}
	defs, err = s.ensureBucket(ctx, jetstream.KeyValueConfig{
		Bucket:       n.DefinitionBucket,
		Description:  "Waymark workflow definitions: key = sha256 of the canonical JSON; name.<workflow> = latest hash",
		History:      1,
		MaxValueSize: max(c.MaxValueBytes, 8<<20),
		Storage:      s.storage(),
		Replicas:     c.Replicas,
		Metadata:     meta,
	})
	if err != nil {
		return nil, nil, err
	}
	streams := []jetstream.StreamConfig{
		{
			Name:        n.WorkStream,
			Description: "Waymark step messages, subject per worker pool and job; removed when a worker acknowledges",
			Subjects:    []string{n.WorkSubjectPrefix + "*.*"},
			Retention:   jetstream.WorkQueuePolicy,
			Duplicates:  c.Duplicates,
			MaxMsgSize:  c.MaxMessageBytes,
			AllowDirect: true,
		},
		{
			Name:        n.InboxStream,
			Description: "Waymark engine inbox: job starts and step results; removed when an engine has applied them",
			Subjects:    []string{n.InboxPrefix + "*.*"},
			Retention:   jetstream.WorkQueuePolicy,
			Duplicates:  c.Duplicates,
			MaxMsgSize:  c.MaxMessageBytes,
			AllowDirect: true,
		},
		{
			Name:        n.HistoryStream,
			Description: "Waymark job history: CloudEvents batches, one message per transition on waymark.history.<job>, ledger events on waymark.history.<job>.effects",
			Subjects:    []string{n.HistoryPrefix + "*", n.HistoryPrefix + "*.effects"},
			Retention:   jetstream.LimitsPolicy,
			Duplicates:  c.Duplicates,
			MaxAge:      c.HistoryMaxAge,
			MaxMsgSize:  c.MaxMessageBytes,
			AllowDirect: true,
		},
		{
			// A schedule waits on timer.set.<job>.<name> until due; the
			// server then publishes its body on timer.due.<job>, which an
			// engine forwards to the job's inbox (ADR-51 message schedules,
			// nats-server 2.12+).
			Name:              n.TimerStream,
			Description:       "Waymark durable timers: schedules on waymark.timer.set.<job>.<name>, fired on waymark.timer.due.<job> and forwarded by engines to the job's inbox; cron schedules on waymark.timer.cron.<name>, fired on waymark.timer.fired.<name>, each firing a job",
			Subjects:          []string{n.TimerPrefix + "set.*.*", n.TimerPrefix + "due.*", n.TimerPrefix + "cron.*", n.TimerPrefix + "fired.*"},
			Retention:         jetstream.WorkQueuePolicy,
			AllowMsgSchedules: true,
			AllowRollup:       true, // a cron firing rolls up the one before it that no engine took yet
			Duplicates:        c.Duplicates,
			MaxMsgSize:        c.MaxMessageBytes,
			AllowDirect:       true,
		},
		{
			Name:              n.EpochStream,
			Description:       "Waymark queue epoch: one marker, kept with the same storage as the queues so that losing them loses it too",
			Subjects:          []string{n.prefix + ".queue_epoch"},
			Retention:         jetstream.LimitsPolicy,
			MaxMsgsPerSubject: 1,
			Duplicates:        c.Duplicates,
			MaxMsgSize:        c.MaxMessageBytes,
		},
	}
	if s.Jobs == nil { // Open: Reopen (which engines may call at once) leaves it
		_, err = s.JS.KeyValue(ctx, n.JobsBucket)
		s.backfill = errors.Is(err, jetstream.ErrBucketNotFound)
	}
	jobs, err := s.ensureBucket(ctx, s.recordBucket(n.JobsBucket, "Waymark job index: active.<workflow>.<job> while a job may still change, ended.<status>.<workflow>.<job> once it finished; listings and the reconciler read it instead of every checkpoint", 16<<10, meta))
	if err != nil {
		return nil, nil, err
	}
	if s.Jobs == nil {
		s.Jobs = &Jobs{kv: jobs, js: s.JS, names: n}
	}
	limits, err := s.ensureBucket(ctx, s.recordBucket(n.LimitsBucket, "Waymark rate limits: key <provider>.<key digest>, the time before which no worker calls that provider with that key (a 429 or 529's Retry-After)", 1<<10, meta))
	if err != nil {
		return nil, nil, err
	}
	if s.Limits == nil {
		s.Limits = &Limits{kv: limits}
	}
	flow, err := s.ensureBucket(ctx, s.recordBucket(n.FlowBucket, "Waymark flow control: c.<limit>.<key digest>.<slot> = the dispatch holding a concurrency slot; w.<limit>.<key digest>.<rank>.<since>.<id> = a dispatch waiting for one; r.<limit>.<key digest> = the current rate window's count", 16<<10, meta))
	if err != nil {
		return nil, nil, err
	}
	if s.Flow == nil {
		s.Flow = &Flow{kv: flow}
	}
	session, err := s.ensureBucket(ctx, s.recordBucket(n.StoreBucket, "Waymark session store: key <namespace>.<key>, a JSON value that store steps, agent tools and engine store read and write across jobs, by revision (compare-and-swap)", 64<<10, meta))
	if err != nil {
		return nil, nil, err
	}
	if s.Session == nil {
		s.Session = &SessionStore{kv: session}
	}
	events, err := s.ensureEventBucket(ctx)
	if err != nil {
		return nil, nil, err
	}
	if s.Events == nil {
		s.Events = &Events{kv: events}
	}
	queues, recorded, err := s.queueStorage(ctx, defs)
	if err != nil {
		return nil, nil, err
	}
	if err := s.migrateLayout(ctx, defs); err != nil {
		return nil, nil, err
	}
	for _, sc := range streams {
		sc.Storage = s.storage()
		if queues == QueueMemory && sc.Name != n.HistoryStream && sc.Name != n.TimerStream {
			sc.Storage = jetstream.MemoryStorage
		}
		if c.GroupCommit && queues == QueueFile && (sc.Name == n.WorkStream || sc.Name == n.InboxStream) {
			sc.AllowAtomicPublish = true // a stream made again (memory queues lost) keeps group commits
		}
		sc.Replicas = c.Replicas
		sc.Metadata = meta
		if err := s.ensureStream(ctx, sc); err != nil {
			return nil, nil, err
		}
	}
	if err := s.recordQueueStorage(ctx, defs, queues, recorded); err != nil {
		return nil, nil, err
	}
	if _, err := s.ensureConsumer(ctx, n.InboxStream, jetstream.ConsumerConfig{
		Durable:       n.EngineConsumer,
		Description:   "Waymark engines: starts and results to apply",
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       c.InboxAckWait,
		MaxDeliver:    -1,
		MaxAckPending: c.MaxAckPending,
		Metadata:      meta,
	}); err != nil {
		return nil, nil, err
	}
	if _, err := s.ensureConsumer(ctx, n.TimerStream, jetstream.ConsumerConfig{
		Durable:        n.TimerConsumer,
		Description:    "Waymark engines: due timers to forward to the jobs' inboxes, cron firings to start jobs of",
		FilterSubjects: []string{n.TimerPrefix + "due.*", n.TimerPrefix + "fired.*"},
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        c.InboxAckWait,
		MaxDeliver:     -1,
		MaxAckPending:  c.MaxAckPending,
		Metadata:       meta,
	}); err != nil {
		return nil, nil, err
	}
	return cps, defs, nil
}

// EnsureWorkConsumer creates pool's work consumer if absent and returns it.
// An existing one is checked as Open checks the engine consumer (its
// tuning changed only under Config.TuneConsumers); without TuneConsumers,
// an ack wait shorter than Config.WorkAckWait is ErrIncompatible, because
// a worker times its heartbeats by WorkAckWait and the step's lease could
// run out between two of them.
func (s *Store) EnsureWorkConsumer(ctx context.Context, pool string) (jetstream.Consumer, error) {
	n, c := s.Names, s.Config
	return s.ensureConsumerFor(ctx, n.WorkStream, jetstream.ConsumerConfig{
		Durable:       n.WorkConsumer(pool),
		Description:   "Waymark workers of pool " + pool,
		FilterSubject: n.WorkFilter(pool),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       c.WorkAckWait,
		MaxDeliver:    c.WorkMaxDeliver,
		MaxAckPending: c.MaxAckPending,
		Metadata:      map[string]string{"waymark_layout": LayoutVersion, "waymark_pool": pool},
	}, true)
}

// EngineConsumer returns the engines' inbox consumer.
func (s *Store) EngineConsumer(ctx context.Context) (jetstream.Consumer, error) {
	c, err := s.JS.Consumer(ctx, s.Names.InboxStream, s.Names.EngineConsumer)
	if err != nil {
		return nil, fmt.Errorf("open consumer %s on %s: %w", s.Names.EngineConsumer, s.Names.InboxStream, err)
	}
	return c, nil
}

// ReleaseEngineDeliveries makes available again at once the inbox messages the engine
// consumer counts as delivered and not acknowledged, by making the consumer
// again (the messages stay in the work-queue stream; a new consumer
// delivers them from the start). It is for the sole engine of a deployment
// (an embedded server, whose data directory one process holds): the
// process they were delivered to is gone, and the server would otherwise
// wait out their ack wait, which it keeps across its own restart. It
// returns how many were held. Never call it with other engines running:
// their messages in hand would be delivered twice (harmless, but wasted).
func (s *Store) ReleaseEngineDeliveries(ctx context.Context) (int, error) {
	c, err := s.JS.Consumer(ctx, s.Names.InboxStream, s.Names.EngineConsumer)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read consumer %s: %w", s.Names.EngineConsumer, err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("read consumer %s: %w", s.Names.EngineConsumer, err)
	}
	if info.NumAckPending == 0 {
		return 0, nil
	}
	if err := s.JS.DeleteConsumer(ctx, s.Names.InboxStream, s.Names.EngineConsumer); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return 0, fmt.Errorf("release consumer %s: %w", s.Names.EngineConsumer, err)
	}
	if err := s.Reopen(ctx); err != nil {
		return 0, fmt.Errorf("release consumer %s: %w", s.Names.EngineConsumer, err)
	}
	return info.NumAckPending, nil
}

// The start-up checks. Every setting Waymark relies on is compared with
// what an existing stream, bucket or consumer has. A difference Waymark
// cannot work with (data would expire, be dropped silently, or land where
// no one reads it) stops Open with ErrIncompatible, naming the resource,
// the setting, what it has and what is needed; a tolerable one is logged
// at warn and the resource is kept as it is. The README's Data layout
// section has the table.

// mismatch is one setting of an existing resource that differs from what
// Waymark would create.
type mismatch struct {
	setting    string // as the nats CLI names it: "max age", "discard"
	have, want string
	fatal      bool   // Waymark cannot work with have
	why        string // what follows from have
}

// judge logs the tolerable mismatches of resource (e.g. "stream
// WAYMARK_WORK") at warn and returns ErrIncompatible naming every fatal
// one.
func (s *Store) judge(resource string, ms []mismatch) error {
	var fatal []string
	for _, m := range ms {
		if m.fatal {
			fatal = append(fatal, fmt.Sprintf("has %s %s, Waymark needs %s: %s", m.setting, m.have, m.want, m.why))
			continue
		}
		s.log.Warn("JetStream resource differs from this process's settings; keeping it as it is",
			"resource", resource, "setting", m.setting, "have", m.have, "want", m.want, "effect", m.why)
	}
	if len(fatal) == 0 {
		return nil
	}
	return fmt.Errorf("%s %s (fix it with the nats CLI, delete it, or choose another prefix): %w",
		resource, strings.Join(fatal, "; "), ErrIncompatible)
}

func retentionName(r jetstream.RetentionPolicy) string {
	switch r {
	case jetstream.LimitsPolicy:
		return "limits"
	case jetstream.InterestPolicy:
		return "interest"
	case jetstream.WorkQueuePolicy:
		return "workqueue"
	}
	return r.String()
}

func storageName(t jetstream.StorageType) string {
	switch t {
	case jetstream.FileStorage:
		return "file"
	case jetstream.MemoryStorage:
		return "memory"
	}
	return t.String()
}

func discardName(d jetstream.DiscardPolicy) string {
	switch d {
	case jetstream.DiscardOld:
		return "old"
	case jetstream.DiscardNew:
		return "new"
	}
	return d.String()
}

// ageName prints a max age or TTL, where 0 means none.
func ageName(d time.Duration) string {
	if d == 0 {
		return "0 (none)"
	}
	return d.String()
}

// hasLimit reports whether a stream has a count or size limit beyond
// which its discard policy acts.
func hasLimit(c jetstream.StreamConfig) bool {
	return c.MaxMsgs > 0 || c.MaxBytes > 0 || (c.MaxMsgsPerSubject > 0 && c.DiscardNewPerSubject)
}

func (s *Store) ensureBucket(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	kv, err := s.JS.KeyValue(ctx, cfg.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = s.JS.CreateKeyValue(ctx, cfg)
		if err == nil {
			s.log.Debug("created bucket", "bucket", cfg.Bucket)
			return kv, nil
		}
		if !errors.Is(err, jetstream.ErrBucketExists) {
			return nil, fmt.Errorf("create bucket %s: %w", cfg.Bucket, err)
		}
		// Another process created it first, perhaps with other settings:
		// check it like any existing bucket.
		kv, err = s.JS.KeyValue(ctx, cfg.Bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("open bucket %s: %w", cfg.Bucket, err)
	}
	st, err := s.JS.Stream(ctx, "KV_"+cfg.Bucket)
	if err != nil {
		return nil, fmt.Errorf("settings of bucket %s: %w", cfg.Bucket, err)
	}
	if err := s.judge("bucket "+cfg.Bucket, bucketMismatches(cfg, st.CachedInfo().Config)); err != nil {
		return nil, err
	}
	return kv, nil
}

// bucketMismatches compares an existing bucket's stream with want.
func bucketMismatches(want jetstream.KeyValueConfig, have jetstream.StreamConfig) []mismatch {
	var ms []mismatch
	if have.MaxMsgsPerSubject < 1 {
		ms = append(ms, mismatch{"history", strconv.FormatInt(have.MaxMsgsPerSubject, 10), strconv.Itoa(int(want.History)), true,
			"a bucket without a history limit keeps every revision of every key"})
	} else if have.MaxMsgsPerSubject != int64(want.History) {
		ms = append(ms, mismatch{"history", strconv.FormatInt(have.MaxMsgsPerSubject, 10), strconv.Itoa(int(want.History)), false,
			"older revisions are kept too: more storage, nothing else"})
	}
	if have.MaxAge != want.TTL {
		ms = append(ms, mismatch{"ttl", ageName(have.MaxAge), ageName(want.TTL), true,
			"entries would expire: checkpoints of jobs, effect records (their dedup) and pinned definitions would vanish"})
	}
	if have.Storage != want.Storage {
		ms = append(ms, mismatch{"storage", storageName(have.Storage), storageName(want.Storage), true,
			"this process is configured for the other storage (memory loses everything in a server restart)"})
	}
	if have.Discard == jetstream.DiscardOld && hasLimit(have) {
		ms = append(ms, mismatch{"discard", discardName(have.Discard), "new (with a size or count limit)", true,
			"a full bucket would drop its oldest keys without telling anyone"})
	}
	if !have.AllowRollup {
		ms = append(ms, mismatch{"rollup", "false", "true", true, "keys cannot be purged (retention sweeps)"})
	}
	if have.Sealed {
		ms = append(ms, mismatch{"sealed", "true", "false", true, "nothing can be written"})
	}
	if have.MaxMsgSize > 0 && have.MaxMsgSize < want.MaxValueSize {
		ms = append(ms, mismatch{"max value size", strconv.Itoa(int(have.MaxMsgSize)), strconv.Itoa(int(want.MaxValueSize)), false,
			"larger values are refused as too large"})
	}
	if have.Replicas != want.Replicas {
		ms = append(ms, mismatch{"replicas", strconv.Itoa(have.Replicas), strconv.Itoa(want.Replicas), false,
			"kept as they are (WAYMARK_REPLICAS applies to new resources)"})
	}
	return ms
}

func (s *Store) ensureStream(ctx context.Context, cfg jetstream.StreamConfig) error {
	st, err := s.JS.Stream(ctx, cfg.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		_, err = s.JS.CreateStream(ctx, cfg)
		if err == nil {
			s.log.Debug("created stream", "stream", cfg.Name)
			return nil
		}
		if !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return fmt.Errorf("create stream %s: %w", cfg.Name, err)
		}
		// Another process created it first, perhaps with other settings
		// (another queue storage): check it like any existing stream.
		st, err = s.JS.Stream(ctx, cfg.Name)
	}
	if err != nil {
		return fmt.Errorf("open stream %s: %w", cfg.Name, err)
	}
	return s.judge("stream "+cfg.Name, s.streamMismatches(cfg, st.CachedInfo().Config))
}

// streamMismatches compares an existing stream with want.
func (s *Store) streamMismatches(want, have jetstream.StreamConfig) []mismatch {
	n := s.Names
	queue := want.Name == n.WorkStream || want.Name == n.InboxStream
	what := map[string]string{n.WorkStream: "step messages", n.InboxStream: "starts and results", n.HistoryStream: "history events", n.EpochStream: "the queue epoch marker"}[want.Name]
	var ms []mismatch
	if have.Retention != want.Retention {
		ms = append(ms, mismatch{"retention", retentionName(have.Retention), retentionName(want.Retention), true,
			"messages would be kept or removed on other terms than Waymark's"})
	}
	if !slices.Equal(have.Subjects, want.Subjects) {
		ms = append(ms, mismatch{"subjects", fmt.Sprint(have.Subjects), fmt.Sprint(want.Subjects), true,
			"messages would land where no one reads them, or be refused"})
	}
	if have.Storage != want.Storage {
		why := "this process is configured for the other storage"
		if want.Name != n.HistoryStream {
			why = "the config asks for the other (WAYMARK_QUEUE_STORAGE): delete the stream or keep its storage"
		}
		ms = append(ms, mismatch{"storage", storageName(have.Storage), storageName(want.Storage), true, why})
	}
	if have.PersistMode != want.PersistMode {
		ms = append(ms, mismatch{"persist mode", have.PersistMode.String(), want.PersistMode.String(), true,
			"asynchronous writes would acknowledge messages a server crash loses without a trace (and leave the consumers out of step with the stream); a stream's persist mode cannot change: delete the stream"})
	}
	switch {
	case want.MaxAge == 0 && have.MaxAge != 0 && want.Name != n.HistoryStream:
		why := what + " would expire before they are handled"
		if want.Name == n.EpochStream {
			why = "an expired marker reads as lost queues, and every running job's step is dispatched again"
		}
		ms = append(ms, mismatch{"max age", ageName(have.MaxAge), ageName(0), true, why})
	case have.MaxAge != want.MaxAge:
		ms = append(ms, mismatch{"max age", ageName(have.MaxAge), ageName(want.MaxAge), false,
			"history is kept for the stream's max age (WAYMARK_HISTORY_MAX_AGE applies to new streams)"})
	}
	switch {
	case queue && have.Discard == jetstream.DiscardOld && hasLimit(have):
		ms = append(ms, mismatch{"discard", discardName(have.Discard), "new (with a size or count limit)", true,
			"a full queue would drop its oldest " + what + " without telling anyone"})
	case want.Name == n.EpochStream && have.Discard == jetstream.DiscardNew && hasLimit(have):
		ms = append(ms, mismatch{"discard", discardName(have.Discard), "old", true,
			"the next queue epoch marker would be refused"})
	case want.Name == n.HistoryStream && have.Discard == jetstream.DiscardNew && hasLimit(have):
		ms = append(ms, mismatch{"discard", discardName(have.Discard), "old", false,
			"history publishes are refused once the stream is full"})
	}
	if have.Sealed {
		ms = append(ms, mismatch{"sealed", "true", "false", true, "nothing can be written"})
	}
	if have.Duplicates != want.Duplicates {
		ms = append(ms, mismatch{"duplicate window", have.Duplicates.String(), want.Duplicates.String(), false,
			"publishes are deduplicated over the stream's window; dedup beyond it rests on checkpoints and the effect ledger"})
	}
	if have.MaxMsgSize > 0 && have.MaxMsgSize < want.MaxMsgSize {
		ms = append(ms, mismatch{"max message size", strconv.Itoa(int(have.MaxMsgSize)), strconv.Itoa(int(want.MaxMsgSize)), false,
			"larger messages are refused as too large"})
	}
	if have.Replicas != want.Replicas {
		ms = append(ms, mismatch{"replicas", strconv.Itoa(have.Replicas), strconv.Itoa(want.Replicas), false,
			"kept as they are (WAYMARK_REPLICAS applies to new resources)"})
	}
	return ms
}

func (s *Store) ensureConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return s.ensureConsumerFor(ctx, stream, cfg, false)
}

// ensureConsumerFor creates the durable consumer cfg when absent and
// checks it when present. leases says this process pulls from it and
// times its heartbeats by cfg.AckWait (a worker on its pool's consumer).
//
// Tuning (ack wait, max deliver, max ack pending) is changed only by a
// process with Config.TuneConsumers (an engine), logged at info with the
// old and new values. Any other process keeps the consumer's tuning and
// logs the difference at warn, except that a worker refuses a lease
// shorter than the one it times its heartbeats by.
func (s *Store) ensureConsumerFor(ctx context.Context, stream string, cfg jetstream.ConsumerConfig, leases bool) (jetstream.Consumer, error) {
	c, err := s.JS.Consumer(ctx, stream, cfg.Durable)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		// CreateConsumer, not CreateOrUpdate: a consumer another process
		// made meanwhile is checked below, never overwritten.
		c, err = s.JS.CreateConsumer(ctx, stream, cfg)
		if err == nil {
			s.log.Debug("created consumer", "stream", stream, "consumer", cfg.Durable)
			return c, nil
		}
		if !errors.Is(err, jetstream.ErrConsumerExists) {
			return nil, fmt.Errorf("create consumer %s on %s: %w", cfg.Durable, stream, err)
		}
		c, err = s.JS.Consumer(ctx, stream, cfg.Durable)
	}
	resource := "consumer " + cfg.Durable + " on " + stream
	if errors.Is(err, jetstream.ErrNotPullConsumer) {
		return nil, s.judge(resource, []mismatch{{"deliver subject", "set (a push consumer)", `"" (a pull consumer)`, true,
			"a push consumer cannot be pulled from"}})
	}
	if err != nil {
		return nil, fmt.Errorf("open consumer %s on %s: %w", cfg.Durable, stream, err)
	}
	have := c.CachedInfo().Config
	var layout []mismatch
	if have.AckPolicy != jetstream.AckExplicitPolicy {
		layout = append(layout, mismatch{"ack policy", strings.ToLower(strings.TrimPrefix(have.AckPolicy.String(), "Ack")), "explicit", true,
			"messages would be taken as handled before they are"})
	}
	if have.FilterSubject != cfg.FilterSubject || !slices.Equal(have.FilterSubjects, cfg.FilterSubjects) {
		filter, want := fmt.Sprintf("%q", have.FilterSubject), fmt.Sprintf("%q", cfg.FilterSubject)
		if len(have.FilterSubjects) > 0 {
			filter = fmt.Sprint(have.FilterSubjects)
		}
		if len(cfg.FilterSubjects) > 0 {
			want = fmt.Sprint(cfg.FilterSubjects)
		}
		layout = append(layout, mismatch{"filter subject", filter, want, true,
			"it would deliver other messages than the ones this consumer is for"})
	}
	if have.DeliverSubject != "" {
		layout = append(layout, mismatch{"deliver subject", fmt.Sprintf("%q", have.DeliverSubject), `"" (a pull consumer)`, true,
			"a push consumer cannot be pulled from"})
	}
	if err := s.judge(resource, layout); err != nil {
		return nil, err
	}

	var tuning []mismatch
	if have.AckWait != cfg.AckWait {
		m := mismatch{"ack wait", have.AckWait.String(), cfg.AckWait.String(), false,
			"messages are redelivered after the consumer's ack wait"}
		if leases && have.AckWait < cfg.AckWait && !s.Config.TuneConsumers {
			m.fatal = true
			m.why = "this worker times its heartbeats by its own, longer, lease (WAYMARK_WORK_ACK_WAIT), so a step's lease could run out while it runs: give the worker the consumer's value, or have an engine with the new value change the consumer"
		}
		tuning = append(tuning, m)
	}
	if have.MaxDeliver != cfg.MaxDeliver {
		tuning = append(tuning, mismatch{"max deliver", strconv.Itoa(have.MaxDeliver), strconv.Itoa(cfg.MaxDeliver), false,
			"messages are delivered up to the consumer's max deliver"})
	}
	if have.MaxAckPending != cfg.MaxAckPending {
		tuning = append(tuning, mismatch{"max ack pending", strconv.Itoa(have.MaxAckPending), strconv.Itoa(cfg.MaxAckPending), false,
			"the consumer's cap on unacknowledged messages applies"})
	}
	if len(have.BackOff) > 0 {
		tuning = append(tuning, mismatch{"backoff", fmt.Sprint(have.BackOff), "none", false,
			"redeliveries follow the consumer's backoff instead of its ack wait"})
	}
	if len(tuning) == 0 {
		return c, nil
	}
	if !s.Config.TuneConsumers {
		if err := s.judge(resource, tuning); err != nil {
			return nil, err
		}
		return c, nil
	}
	upd := have
	upd.AckWait, upd.MaxDeliver, upd.MaxAckPending, upd.BackOff = cfg.AckWait, cfg.MaxDeliver, cfg.MaxAckPending, nil
	c, err = s.JS.UpdateConsumer(ctx, stream, upd)
	if err != nil {
		return nil, fmt.Errorf("update %s: %w", resource, err)
	}
	for _, m := range tuning {
		s.log.Info("changed a shared consumer's setting to this engine's", "resource", resource, "setting", m.setting, "old", m.have, "new", m.want)
	}
	return c, nil
}

// LayoutVersion is the version of the JetStream layout this build makes,
// recorded in the "waymark_layout" metadata of every resource. Layout 2
// gave step messages a subject per job and ledger events a history
// subject of their own, and added the job index.
const LayoutVersion = "2"

// migrateLayout brings a layout-1 deployment to layout 2. The work stream
// of layout 1 has one subject per pool; it cannot be changed in place
// without stranding the messages it holds, so it is deleted and the queue
// epoch forgotten: engines then recreate it and dispatch every running
// job's current step again from its checkpoint, as after memory queues
// were lost (side effects stay fenced by the ledger). The history stream
// only gains a subject.
func (s *Store) migrateLayout(ctx context.Context, defs jetstream.KeyValue) error {
	n := s.Names
	if st, err := s.JS.Stream(ctx, n.WorkStream); err == nil {
		cfg := st.CachedInfo().Config
		if layout1(cfg) && cfg.Retention == jetstream.WorkQueuePolicy && slices.Equal(cfg.Subjects, []string{n.WorkSubjectPrefix + "*"}) {
			s.log.Warn("migrating the work stream to layout 2 (a subject per job): it is recreated, and running jobs are dispatched again from their checkpoints",
				"stream", n.WorkStream, "messages", st.CachedInfo().State.Msgs)
			if err := s.JS.DeleteStream(ctx, n.WorkStream); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				return fmt.Errorf("migrate stream %s: %w", n.WorkStream, err)
			}
			if err := defs.Purge(ctx, queueEpochKey); err != nil {
				return fmt.Errorf("migrate stream %s: forget the queue epoch: %w", n.WorkStream, err)
			}
		}
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("open stream %s: %w", n.WorkStream, err)
	}
	if st, err := s.JS.Stream(ctx, n.HistoryStream); err == nil {
		cfg := st.CachedInfo().Config
		if layout1(cfg) && cfg.Retention == jetstream.LimitsPolicy && slices.Equal(cfg.Subjects, []string{n.HistoryPrefix + "*"}) {
			cfg.Subjects = append(cfg.Subjects, n.HistoryPrefix+"*.effects")
			cfg.AllowDirect = true
			if _, err := s.JS.UpdateStream(ctx, cfg); err != nil {
				return fmt.Errorf("migrate stream %s: add subject %s: %w", n.HistoryStream, cfg.Subjects[1], err)
			}
			s.log.Info("history stream migrated to layout 2: ledger events get a subject of their own", "stream", n.HistoryStream)
		}
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("open stream %s: %w", n.HistoryStream, err)
	}
	return nil
}

// tuneWorkConsumers brings the tuning of every existing work consumer
// (one per pool) to this Config's values, as ensureConsumerFor does for
// the engine consumer: engines only (Config.TuneConsumers), so that the
// lease the reconciler assumes (WorkAckWait) is the one in force.
func (s *Store) tuneWorkConsumers(ctx context.Context) error {
	if !s.Config.TuneConsumers {
		return nil
	}
	st, err := s.JS.Stream(ctx, s.Names.WorkStream)
	if err != nil {
		return fmt.Errorf("open stream %s: %w", s.Names.WorkStream, err)
	}
	var pools []string
	l := st.ListConsumers(ctx)
	for info := range l.Info() {
		if pool := info.Config.Metadata["waymark_pool"]; pool != "" && info.Name == s.Names.WorkConsumer(pool) {
			pools = append(pools, pool)
		}
	}
	if err := l.Err(); err != nil {
		return fmt.Errorf("list consumers of %s: %w", s.Names.WorkStream, err)
	}
	for _, pool := range pools {
		if _, err := s.EnsureWorkConsumer(ctx, pool); err != nil {
			return err
		}
	}
	return nil
}

// indexExisting gives every checkpoint stored before the job index existed
// its index entry (an upgrade from layout 1): active for a job that can
// still change, ended for a finished one. It reads every checkpoint once;
// entries that exist already are left as they are, so it may run again.
func (s *Store) indexExisting(ctx context.Context) error {
	n := 0
	var firstErr error
	err := s.Checkpoints.List(ctx, func(job string, e Entry, err error) bool {
		if err != nil {
			return true // quarantined: a person sees to it
		}
		cp := e.Checkpoint
		if cp.Status.Terminal() {
			err = s.Jobs.End(ctx, cp, 0)
		} else if _, err = s.Jobs.CreateActive(ctx, cp); errors.Is(err, schemas.ErrConflict) {
			err = nil
		}
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("index job %s: %w", job, err)
		}
		n++
		return true
	})
	if err == nil {
		err = firstErr
	}
	if err != nil {
		return fmt.Errorf("build the job index from the checkpoints: %w", err)
	}
	if n > 0 {
		s.log.Info("built the job index from the checkpoints stored before it existed", "jobs", n)
	}
	return nil
}

// layout1 reports whether cfg is a stream Waymark made with layout 1.
func layout1(cfg jetstream.StreamConfig) bool { return cfg.Metadata["waymark_layout"] == "1" }

// Reopen creates again whatever streams, buckets and consumers are
// missing, as Open does: after a server restart, memory queues are gone.
func (s *Store) Reopen(ctx context.Context) error {
	_, _, err := s.ensure(ctx)
	return err
}

// queueStorageKey records, in the definitions bucket, the queue storage a
// deployment chose, so that a process started without the setting uses
// it too (and recreates lost memory queues in memory).
const queueStorageKey = "meta.queue_storage"

// queueRecord is the recorded queue storage and the revision it was read
// at (0 when none is recorded).
type queueRecord struct {
	value string
	rev   uint64
}

// queueStorage resolves Config.QueueStorage: the setting, else the
// recorded choice, else what the work stream is made of, else QueueFile.
// It sets s.Config.QueueStorage and returns the recorded choice too (value
// "" when none).
func (s *Store) queueStorage(ctx context.Context, defs jetstream.KeyValue) (resolved string, recorded queueRecord, err error) {
	e, err := defs.Get(ctx, queueStorageKey)
	switch {
	case err == nil:
		recorded = queueRecord{value: string(e.Value()), rev: e.Revision()}
	case !errors.Is(err, jetstream.ErrKeyNotFound):
		return "", queueRecord{}, fmt.Errorf("read queue storage: %w", err)
	}
	if s.Config.QueueStorage == "" {
		switch recorded.value {
		case QueueFile, QueueMemory:
			s.Config.QueueStorage = recorded.value
		default:
			if s.Config.QueueStorage, err = s.existingQueues(ctx); err != nil {
				return "", queueRecord{}, err
			}
		}
	}
	return s.Config.QueueStorage, recorded, nil
}

// existingQueues names the storage of the work stream (else the inbox) as it is, for a
// deployment that recorded none; a new one gets QueueFile.
func (s *Store) existingQueues(ctx context.Context) (string, error) {
	var st jetstream.Stream
	var err error
	for _, name := range []string{s.Names.WorkStream, s.Names.InboxStream} {
		if st, err = s.JS.Stream(ctx, name); !errors.Is(err, jetstream.ErrStreamNotFound) {
			break
		}
	}
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return QueueFile, nil
	case err != nil:
		return "", fmt.Errorf("read queue storage: %w", err)
	}
	cfg := st.CachedInfo().Config
	if cfg.Storage == jetstream.MemoryStorage && !s.Config.Memory {
		return QueueMemory, nil
	}
	return QueueFile, nil
}

// recordQueueStorage records queues (the storage the queue streams were
// just checked to have) when the record says otherwise: a create when
// none is recorded, else a compare-and-swap on the revision read, so two
// processes never overwrite each other's record. A process that loses the
// race reads the record again; one that disagrees with the streams this
// process checked means another process made them differently
// meanwhile, which is ErrIncompatible.
func (s *Store) recordQueueStorage(ctx context.Context, defs jetstream.KeyValue, queues string, recorded queueRecord) error {
	for recorded.value != queues {
		var err error
		if recorded.rev == 0 {
			_, err = defs.Create(ctx, queueStorageKey, []byte(queues))
		} else {
			_, err = defs.Update(ctx, queueStorageKey, []byte(queues), recorded.rev)
		}
		if err == nil {
			return nil
		}
		if !isRevisionConflict(err) {
			return fmt.Errorf("record queue storage %s: %w", queues, err)
		}
		e, gerr := defs.Get(ctx, queueStorageKey)
		switch {
		case errors.Is(gerr, jetstream.ErrKeyNotFound):
			recorded = queueRecord{}
		case gerr != nil:
			return fmt.Errorf("record queue storage %s: %w", queues, gerr)
		default:
			recorded = queueRecord{value: string(e.Value()), rev: e.Revision()}
			if recorded.value != queues {
				return fmt.Errorf("queue storage: another process recorded %q while this one made or checked %s queues (WAYMARK_QUEUE_STORAGE differs between processes): %w",
					recorded.value, queues, ErrIncompatible)
			}
		}
	}
	return nil
}

// The queue epoch tells whether the work and inbox queues still hold what
// they held: a marker message in a stream stored like the queues, and the
// same id stored durably in the definitions bucket. A server restart that
// lost memory queues loses the marker too.
//
// The marker message is the truth and the record follows it. MarkQueues
// publishes a new marker with a compare-and-swap on the marker stream
// (Nats-Expected-Last-Subject-Sequence: the marker it read), so of two
// engines racing to mark the queues one publishes and the other gets
// schemas.ErrConflict. The winner then copies the stream's last marker
// into the record with a compare-and-swap on the record's revision,
// reading the record before the stream and retrying until both agree.
// Because every record write copies a stream read made after the record
// read it swaps on, the last successful one copies the last marker: the
// two cannot disagree once all markers are written. A process that dies
// between the publish and the record leaves them disagreeing, which reads
// as lost queues, and the next check marks them again.
const queueEpochKey = "meta.queue_epoch"

func (s *Store) epochSubject() string { return s.Names.prefix + ".queue_epoch" }

// QueuesIntact reports whether the queues still hold the epoch marker
// written by the last MarkQueues. False when they were lost (or never
// marked): engines must then dispatch every running job's current step
// again from its checkpoint.
func (s *Store) QueuesIntact(ctx context.Context) (bool, error) {
	intact, _, err := s.QueueState(ctx)
	return intact, err
}

// QueueState is QueuesIntact, and whether the queues were ever marked (a
// new deployment's are not: nothing was lost).
func (s *Store) QueueState(ctx context.Context) (intact, marked bool, err error) {
	want, err := s.Definitions.kv.Get(ctx, queueEpochKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return false, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("read queue epoch: %w", err)
	}
	marker, _, err := s.lastEpochMarker(ctx)
	if err != nil {
		return false, true, fmt.Errorf("read queue epoch: %w", err)
	}
	return marker != "" && marker == string(want.Value()), true, nil
}

// lastEpochMarker returns the last marker message and its stream sequence
// ("" and 0 when there is none, or no stream).
func (s *Store) lastEpochMarker(ctx context.Context) (string, uint64, error) {
	st, err := s.JS.Stream(ctx, s.Names.EpochStream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return "", 0, nil
	}
	if err != nil {
		return "", 0, err
	}
	m, err := st.GetLastMsgForSubject(ctx, s.epochSubject())
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return "", 0, nil
	}
	if err != nil {
		return "", 0, err
	}
	return string(m.Data), m.Sequence, nil
}

// MarkQueues writes a new epoch marker into the queues and records it
// (see queueEpochKey for the protocol). Errors: schemas.ErrConflict when
// another process marked the queues between this one's read and its
// publish: its marker stands, and it is that process that dispatches
// again what the queues held. Any other error leaves the queues unmarked
// or the record behind the marker, which QueuesIntact reports as lost.
func (s *Store) MarkQueues(ctx context.Context) error {
	_, seq, err := s.lastEpochMarker(ctx)
	if err != nil {
		return fmt.Errorf("mark queues: read the last marker: %w", err)
	}
	s.epochHook("read")
	id := nuid.Next()
	m := nats.NewMsg(s.epochSubject())
	m.Data = []byte(id)
	m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(seq, 10))
	if _, err := s.JS.PublishMsg(ctx, m); err != nil {
		if isRevisionConflict(err) {
			return schemas.Errorf(schemas.CodeConflict, "mark queues: another process marked them first").WithCause(err)
		}
		return fmt.Errorf("mark queues: publish marker %s: %w", id, err)
	}
	s.epochHook("published")
	for {
		var rev uint64
		var have string
		e, err := s.Definitions.kv.Get(ctx, queueEpochKey)
		switch {
		case err == nil:
			rev, have = e.Revision(), string(e.Value())
		case !errors.Is(err, jetstream.ErrKeyNotFound):
			return fmt.Errorf("mark queues: read the record: %w", err)
		}
		marker, _, err := s.lastEpochMarker(ctx)
		if err != nil {
			return fmt.Errorf("mark queues: read the last marker: %w", err)
		}
		if marker == "" {
			return fmt.Errorf("mark queues: marker %s is gone (the queues were lost again)", id)
		}
		if marker == have {
			return nil
		}
		if rev == 0 {
			_, err = s.Definitions.kv.Create(ctx, queueEpochKey, []byte(marker))
		} else {
			_, err = s.Definitions.kv.Update(ctx, queueEpochKey, []byte(marker), rev)
		}
		if err != nil && !isRevisionConflict(err) {
			return fmt.Errorf("mark queues: record marker %s: %w", marker, err)
		}
		// Written, or another writer got there first: read both again.
	}
}

// epochHook runs Store.testEpochHook, when a test set one, at a stage of
// MarkQueues ("read": the last marker was read; "published": the new
// marker is stored, the record not yet written).
func (s *Store) epochHook(stage string) {
	if s.testEpochHook != nil {
		s.testEpochHook(stage)
	}
}

// jsErrCodeInsufficientResources is the JetStream API error code of a write
// refused because the server's storage (or the account's) is full.
const jsErrCodeInsufficientResources = 10023

// IsStorageFull reports whether err is a write refused because JetStream's
// storage is full (error code 10023, "insufficient resources"): nothing
// was stored, and the write succeeds again once space is freed.
func IsStorageFull(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeInsufficientResources {
		return true
	}
	return err != nil && strings.Contains(err.Error(), "insufficient resources")
}
