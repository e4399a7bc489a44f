package kv

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
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
	// definitions and history are always files. Memory queues spare two
	// synced writes per step; a server restart loses what they held, and
	// engines then rebuild it from the checkpoints (see Store.QueuesIntact).
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
	case c.HistoryMaxAge < 0:
		return fmt.Errorf("kv config: history max age %v: want a positive duration, or 0 for no cap", c.HistoryMaxAge)
	}
	return nil
}

// Names are the concrete names derived from a Config.
type Names struct {
	CheckpointBucket  string // waymark_checkpoints
	EffectBucket      string // waymark_effects
	DefinitionBucket  string // waymark_definitions
	JobsBucket        string // waymark_jobs: the job index
	WorkStream        string // WAYMARK_WORK
	InboxStream       string // WAYMARK_INBOX
	HistoryStream     string // WAYMARK_HISTORY
	EpochStream       string // WAYMARK_QUEUE_EPOCH
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
		WorkStream:        up + "_WORK",
		InboxStream:       up + "_INBOX",
		HistoryStream:     up + "_HISTORY",
		EpochStream:       up + "_QUEUE_EPOCH",
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
	Jobs        *Jobs    // the job index
	History     *History // the history stream
	Queues      *Queues  // facts about the work and inbox queues
	log         *slog.Logger
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
	s.Definitions = newDefinitions(defs)
	hist, err := js.Stream(ctx, s.Names.HistoryStream)
	if err != nil {
		return nil, fmt.Errorf("open stream %s: %w", s.Names.HistoryStream, err)
	}
	s.History = &History{stream: hist, js: js, names: s.Names}
	s.Queues = &Queues{js: js, names: s.Names}
	return s, nil
}

// headerRoom is what a checkpoint bucket allows beyond MaxValueBytes: the
// server counts a message's headers (the expected revision of every write)
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
	cps, err = s.ensureBucket(ctx, jetstream.KeyValueConfig{
		Bucket:       n.CheckpointBucket,
		Description:  "Waymark job checkpoints: key = job id, value = checkpoint JSON, written by compare-and-swap on the revision",
		History:      1,
		MaxValueSize: withHeaderRoom(c.MaxValueBytes),
		Storage:      s.storage(),
		Replicas:     c.Replicas,
		Metadata:     meta,
	})
	if err != nil {
		return nil, nil, err
	}
	eff, err := s.ensureBucket(ctx, jetstream.KeyValueConfig{
		Bucket:       n.EffectBucket,
		Description:  "Waymark effect ledger: key = idempotency key, value = effect record (prepared, dispatched, confirmed, ambiguous, reconciled), written by compare-and-swap",
		History:      1,
		MaxValueSize: withHeaderRoom(c.MaxValueBytes),
		Storage:      s.storage(),
		Replicas:     c.Replicas,
		Metadata:     meta,
	})
	if err != nil {
		return nil, nil, err
	}
	s.Effects = &Effects{kv: eff, js: s.JS, maxBytes: int(c.MaxValueBytes)}
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
			Name:              n.EpochStream,
			Description:       "Waymark queue epoch: one marker, kept with the same storage as the queues so that losing them loses it too",
			Subjects:          []string{n.prefix + ".queue_epoch"},
			Retention:         jetstream.LimitsPolicy,
			MaxMsgsPerSubject: 1,
			Duplicates:        c.Duplicates,
			MaxMsgSize:        c.MaxMessageBytes,
		},
	}
	jobs, err := s.ensureBucket(ctx, jetstream.KeyValueConfig{
		Bucket:       n.JobsBucket,
		Description:  "Waymark job index: active.<workflow>.<job> while a job may still change, ended.<status>.<workflow>.<job> once it finished; listings and the reconciler read it instead of every checkpoint",
		History:      1,
		MaxValueSize: 16 << 10,
		Storage:      s.storage(),
		Replicas:     c.Replicas,
		Metadata:     meta,
	})
	if err != nil {
		return nil, nil, err
	}
	s.Jobs = &Jobs{kv: jobs, js: s.JS, names: n}
	queues, recorded, err := s.queueStorage(ctx, defs)
	if err != nil {
		return nil, nil, err
	}
	if err := s.migrateLayout(ctx, defs); err != nil {
		return nil, nil, err
	}
	for _, sc := range streams {
		sc.Storage = s.storage()
		if queues == QueueMemory && sc.Name != n.HistoryStream {
			sc.Storage = jetstream.MemoryStorage
		}
		sc.Replicas = c.Replicas
		sc.Metadata = meta
		if err := s.ensureStream(ctx, sc); err != nil {
			return nil, nil, err
		}
	}
	if recorded != queues {
		if _, err := defs.Put(ctx, queueStorageKey, []byte(queues)); err != nil {
			return nil, nil, fmt.Errorf("record queue storage: %w", err)
		}
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
	return cps, defs, nil
}

// EnsureWorkConsumer creates pool's work consumer if absent and returns it.
func (s *Store) EnsureWorkConsumer(ctx context.Context, pool string) (jetstream.Consumer, error) {
	n, c := s.Names, s.Config
	return s.ensureConsumer(ctx, n.WorkStream, jetstream.ConsumerConfig{
		Durable:       n.WorkConsumer(pool),
		Description:   "Waymark workers of pool " + pool,
		FilterSubject: n.WorkFilter(pool),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       c.WorkAckWait,
		MaxDeliver:    c.WorkMaxDeliver,
		MaxAckPending: c.MaxAckPending,
		Metadata:      map[string]string{"waymark_layout": LayoutVersion, "waymark_pool": pool},
	})
}

// EngineConsumer returns the engines' inbox consumer.
func (s *Store) EngineConsumer(ctx context.Context) (jetstream.Consumer, error) {
	c, err := s.JS.Consumer(ctx, s.Names.InboxStream, s.Names.EngineConsumer)
	if err != nil {
		return nil, fmt.Errorf("open consumer %s on %s: %w", s.Names.EngineConsumer, s.Names.InboxStream, err)
	}
	return c, nil
}

func (s *Store) ensureBucket(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	kv, err := s.JS.KeyValue(ctx, cfg.Bucket)
	if err == nil {
		st, err := kv.Status(ctx)
		if err != nil {
			return nil, fmt.Errorf("status of bucket %s: %w", cfg.Bucket, err)
		}
		if st.History() < 1 {
			return nil, fmt.Errorf("bucket %s: history %d: %w", cfg.Bucket, st.History(), ErrIncompatible)
		}
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("open bucket %s: %w", cfg.Bucket, err)
	}
	kv, err = s.JS.CreateKeyValue(ctx, cfg)
	if errors.Is(err, jetstream.ErrBucketExists) {
		return s.JS.KeyValue(ctx, cfg.Bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("create bucket %s: %w", cfg.Bucket, err)
	}
	s.log.Debug("created bucket", "bucket", cfg.Bucket)
	return kv, nil
}

func (s *Store) ensureStream(ctx context.Context, cfg jetstream.StreamConfig) error {
	st, err := s.JS.Stream(ctx, cfg.Name)
	if err == nil {
		have := st.CachedInfo().Config
		switch {
		case have.Retention != cfg.Retention:
			return fmt.Errorf("stream %s has retention %v, Waymark needs %v (delete it or choose another prefix): %w", cfg.Name, have.Retention, cfg.Retention, ErrIncompatible)
		case !slices.Equal(have.Subjects, cfg.Subjects):
			return fmt.Errorf("stream %s has subjects %v, Waymark needs %v: %w", cfg.Name, have.Subjects, cfg.Subjects, ErrIncompatible)
		case have.Storage != cfg.Storage:
			return fmt.Errorf("stream %s keeps its messages in %v storage, the config asks for %v (WAYMARK_QUEUE_STORAGE): delete the stream or keep its storage: %w", cfg.Name, have.Storage, cfg.Storage, ErrIncompatible)
		case have.Duplicates != cfg.Duplicates:
			s.log.Warn("stream duplicate window differs from config; keeping the stream's", "stream", cfg.Name, "have", have.Duplicates, "want", cfg.Duplicates)
		}
		return nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("open stream %s: %w", cfg.Name, err)
	}
	if _, err := s.JS.CreateStream(ctx, cfg); err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return fmt.Errorf("create stream %s: %w", cfg.Name, err)
	}
	s.log.Debug("created stream", "stream", cfg.Name)
	return nil
}

func (s *Store) ensureConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	c, err := s.JS.Consumer(ctx, stream, cfg.Durable)
	if err == nil {
		have := c.CachedInfo().Config
		if have.AckPolicy != jetstream.AckExplicitPolicy || have.FilterSubject != cfg.FilterSubject {
			return nil, fmt.Errorf("consumer %s on %s has ack policy %v and filter %q, Waymark needs explicit and %q: %w",
				cfg.Durable, stream, have.AckPolicy, have.FilterSubject, cfg.FilterSubject, ErrIncompatible)
		}
		if have.AckWait != cfg.AckWait || have.MaxDeliver != cfg.MaxDeliver {
			// Ack wait and max deliver are tuning, not layout: follow the config.
			have.AckWait, have.MaxDeliver = cfg.AckWait, cfg.MaxDeliver
			if c, err = s.JS.UpdateConsumer(ctx, stream, have); err != nil {
				return nil, fmt.Errorf("update consumer %s on %s: %w", cfg.Durable, stream, err)
			}
		}
		return c, nil
	}
	if !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, fmt.Errorf("open consumer %s on %s: %w", cfg.Durable, stream, err)
	}
	c, err = s.JS.CreateOrUpdateConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, fmt.Errorf("create consumer %s on %s: %w", cfg.Durable, stream, err)
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

// queueStorage resolves Config.QueueStorage: the setting, else the
// recorded choice, else QueueFile. It sets s.Config.QueueStorage and
// returns the recorded choice too ("" when none).
func (s *Store) queueStorage(ctx context.Context, defs jetstream.KeyValue) (resolved, recorded string, err error) {
	e, err := defs.Get(ctx, queueStorageKey)
	switch {
	case err == nil:
		recorded = string(e.Value())
	case !errors.Is(err, jetstream.ErrKeyNotFound):
		return "", "", fmt.Errorf("read queue storage: %w", err)
	}
	if s.Config.QueueStorage == "" {
		s.Config.QueueStorage = QueueFile
		if recorded == QueueFile || recorded == QueueMemory {
			s.Config.QueueStorage = recorded
		}
	}
	return s.Config.QueueStorage, recorded, nil
}

// The queue epoch tells whether the work and inbox queues still hold what
// they held: a marker message in a stream stored like the queues, and the
// same id stored durably in the definitions bucket. A server restart that
// lost memory queues loses the marker too.
const queueEpochKey = "meta.queue_epoch"

func (s *Store) epochSubject() string { return s.Names.prefix + ".queue_epoch" }

// QueuesIntact reports whether the queues still hold the epoch marker
// written by the last MarkQueues. False when they were lost (or never
// marked): engines must then dispatch every running job's current step
// again from its checkpoint.
func (s *Store) QueuesIntact(ctx context.Context) (bool, error) {
	want, err := s.Definitions.kv.Get(ctx, queueEpochKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read queue epoch: %w", err)
	}
	st, err := s.JS.Stream(ctx, s.Names.EpochStream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read queue epoch: %w", err)
	}
	m, err := st.GetLastMsgForSubject(ctx, s.epochSubject())
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read queue epoch: %w", err)
	}
	return string(m.Data) == string(want.Value()), nil
}

// MarkQueues writes a new epoch marker into the queues and records it.
func (s *Store) MarkQueues(ctx context.Context) error {
	id := nuid.Next()
	if _, err := s.JS.Publish(ctx, s.epochSubject(), []byte(id)); err != nil {
		return fmt.Errorf("mark queues: %w", err)
	}
	if _, err := s.Definitions.kv.Put(ctx, queueEpochKey, []byte(id)); err != nil {
		return fmt.Errorf("mark queues: %w", err)
	}
	return nil
}
