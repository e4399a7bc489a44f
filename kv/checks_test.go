package kv_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
)

// kvStream is a bucket's backing stream as the KV API makes it, with
// whatever edit a row needs (settings the KV API does not expose).
func kvStream(bucket string, edit func(*jetstream.StreamConfig)) func(context.Context, jetstream.JetStream) error {
	return func(c context.Context, js jetstream.JetStream) error {
		sc := jetstream.StreamConfig{
			Name: "KV_" + bucket, Subjects: []string{"$KV." + bucket + ".>"}, MaxMsgsPerSubject: 1,
			AllowRollup: true, DenyDelete: true, AllowDirect: true, Discard: jetstream.DiscardNew, Storage: jetstream.FileStorage,
		}
		edit(&sc)
		_, err := js.CreateStream(c, sc)
		return err
	}
}

// stream makes one of Waymark's streams as Open would, then applies edit.
func stream(name, subject string, retention jetstream.RetentionPolicy, edit func(*jetstream.StreamConfig)) func(context.Context, jetstream.JetStream) error {
	return func(c context.Context, js jetstream.JetStream) error {
		sc := jetstream.StreamConfig{Name: name, Subjects: []string{subject}, Retention: retention, Duplicates: kv.DefaultDuplicates, MaxMsgSize: kv.DefaultMaxMessageBytes,
			Metadata: map[string]string{"waymark_layout": kv.LayoutVersion}}
		if name == "WAYMARK_HISTORY" {
			sc.Subjects = append(sc.Subjects, subject+".effects")
		}
		if name == "WAYMARK_QUEUE_EPOCH" {
			sc.MaxMsgsPerSubject = 1
		}
		edit(&sc)
		_, err := js.CreateStream(c, sc)
		return err
	}
}

// engineConsumer makes the inbox stream and an engine consumer with edit.
func engineConsumer(edit func(*jetstream.ConsumerConfig)) func(context.Context, jetstream.JetStream) error {
	return func(c context.Context, js jetstream.JetStream) error {
		if err := stream("WAYMARK_INBOX", "waymark.inbox.*.*", jetstream.WorkQueuePolicy, func(*jetstream.StreamConfig) {})(c, js); err != nil {
			return err
		}
		cc := jetstream.ConsumerConfig{Durable: "waymark-engine", AckPolicy: jetstream.AckExplicitPolicy, AckWait: kv.DefaultInboxAckWait,
			MaxDeliver: -1, MaxAckPending: kv.DefaultMaxAckPending}
		edit(&cc)
		_, err := js.CreateConsumer(c, "WAYMARK_INBOX", cc)
		return err
	}
}

// TestOpenChecksEverySetting creates each resource by hand with a setting
// that differs from Waymark's, then opens the layout: a difference
// Waymark cannot work with stops Open with ErrIncompatible naming the
// resource, the setting, what it has and what it needs; a tolerable one
// is logged at warn. Either way the resource is left as it was.
func TestOpenChecksEverySetting(t *testing.T) {
	t.Parallel()
	const work, inbox, history, epoch = "WAYMARK_WORK", "WAYMARK_INBOX", "WAYMARK_HISTORY", "WAYMARK_QUEUE_EPOCH"
	rows := []struct {
		name     string
		prepare  func(context.Context, jetstream.JetStream) error
		resource string // stream name, or KV_<bucket>; "" for a consumer
		fatal    bool
		want     []string // in the error (fatal) or the warning
	}{
		// Buckets.
		{name: "checkpoint bucket with a ttl", fatal: true, resource: "KV_waymark_checkpoints",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateKeyValue(c, jetstream.KeyValueConfig{Bucket: "waymark_checkpoints", TTL: time.Hour})
				return err
			},
			want: []string{"bucket waymark_checkpoints", "ttl 1h0m0s", "needs 0 (none)", "vanish"}},
		{name: "effect bucket in memory", fatal: true, resource: "KV_waymark_effects",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateKeyValue(c, jetstream.KeyValueConfig{Bucket: "waymark_effects", Storage: jetstream.MemoryStorage})
				return err
			},
			want: []string{"bucket waymark_effects", "storage memory", "needs file"}},
		{name: "definition bucket that drops old keys when full", fatal: true, resource: "KV_waymark_definitions",
			prepare: kvStream("waymark_definitions", func(sc *jetstream.StreamConfig) { sc.Discard, sc.MaxBytes = jetstream.DiscardOld, 1<<20 }),
			want:    []string{"bucket waymark_definitions", "discard old", "needs new", "drop its oldest keys"}},
		{name: "checkpoint bucket without rollups", fatal: true, resource: "KV_waymark_checkpoints",
			prepare: kvStream("waymark_checkpoints", func(sc *jetstream.StreamConfig) { sc.AllowRollup = false }),
			want:    []string{"bucket waymark_checkpoints", "rollup false", "needs true", "purged"}},
		{name: "checkpoint bucket keeping history", resource: "KV_waymark_checkpoints",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateKeyValue(c, jetstream.KeyValueConfig{Bucket: "waymark_checkpoints", History: 5})
				return err
			},
			want: []string{`resource="bucket waymark_checkpoints"`, `setting=history`, "have=5", "want=1"}},
		{name: "effect bucket with small values", resource: "KV_waymark_effects",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateKeyValue(c, jetstream.KeyValueConfig{Bucket: "waymark_effects", MaxValueSize: 4096})
				return err
			},
			want: []string{`resource="bucket waymark_effects"`, `setting="max value size"`, "have=4096"}},
		{name: "bucket with a size limit that refuses writes", resource: "KV_waymark_effects",
			prepare: kvStream("waymark_effects", func(sc *jetstream.StreamConfig) { sc.MaxBytes = 64 << 20 })},

		// Streams.
		{name: "work stream with a max age", fatal: true, resource: work,
			prepare: stream(work, "waymark.work.*.*", jetstream.WorkQueuePolicy, func(sc *jetstream.StreamConfig) { sc.MaxAge = time.Hour }),
			want:    []string{"stream WAYMARK_WORK", "max age 1h0m0s", "needs 0 (none)", "step messages would expire"}},
		{name: "inbox that drops old messages when full", fatal: true, resource: inbox,
			prepare: stream(inbox, "waymark.inbox.*.*", jetstream.WorkQueuePolicy, func(sc *jetstream.StreamConfig) { sc.MaxMsgs = 1000 }),
			want:    []string{"stream WAYMARK_INBOX", "discard old", "needs new", "drop its oldest starts and results"}},
		{name: "inbox that refuses writes when full", resource: inbox,
			prepare: stream(inbox, "waymark.inbox.*.*", jetstream.WorkQueuePolicy, func(sc *jetstream.StreamConfig) { sc.MaxMsgs, sc.Discard = 1000, jetstream.DiscardNew })},
		{name: "epoch stream that refuses the next marker", fatal: true, resource: epoch,
			prepare: stream(epoch, "waymark.queue_epoch", jetstream.LimitsPolicy, func(sc *jetstream.StreamConfig) { sc.MaxMsgs, sc.Discard = 1, jetstream.DiscardNew }),
			want:    []string{"stream WAYMARK_QUEUE_EPOCH", "discard new", "needs old", "marker would be refused"}},
		{name: "epoch stream with a max age", fatal: true, resource: epoch,
			prepare: stream(epoch, "waymark.queue_epoch", jetstream.LimitsPolicy, func(sc *jetstream.StreamConfig) { sc.MaxAge = 5 * time.Minute }),
			want:    []string{"stream WAYMARK_QUEUE_EPOCH", "max age 5m0s", "lost queues"}},
		{name: "history stream in memory", fatal: true, resource: history,
			prepare: stream(history, "waymark.history.*", jetstream.LimitsPolicy, func(sc *jetstream.StreamConfig) { sc.Storage = jetstream.MemoryStorage }),
			want:    []string{"stream WAYMARK_HISTORY", "storage memory", "needs file"}},
		{name: "work stream with interest retention", fatal: true, resource: work,
			prepare: stream(work, "waymark.work.*.*", jetstream.WorkQueuePolicy, func(sc *jetstream.StreamConfig) { sc.Retention = jetstream.InterestPolicy }),
			want:    []string{"stream WAYMARK_WORK", "retention interest", "needs workqueue"}},
		{name: "work stream with two subjects", fatal: true, resource: work,
			prepare: stream(work, "waymark.work.*.*", jetstream.WorkQueuePolicy, func(sc *jetstream.StreamConfig) { sc.Subjects = append(sc.Subjects, "other.>") }),
			want:    []string{"stream WAYMARK_WORK", "subjects [waymark.work.*.* other.>]", "needs [waymark.work.*.*]"}},
		{name: "history kept for another age", resource: history,
			prepare: stream(history, "waymark.history.*", jetstream.LimitsPolicy, func(sc *jetstream.StreamConfig) { sc.MaxAge = 24 * time.Hour }),
			want:    []string{`resource="stream WAYMARK_HISTORY"`, `setting="max age"`, "have=24h0m0s", `want="0 (none)"`}},
		{name: "history that refuses writes when full", resource: history,
			prepare: stream(history, "waymark.history.*", jetstream.LimitsPolicy, func(sc *jetstream.StreamConfig) { sc.MaxBytes, sc.Discard = 1<<30, jetstream.DiscardNew }),
			want:    []string{`resource="stream WAYMARK_HISTORY"`, "setting=discard", "have=new"}},
		{name: "work stream with another duplicate window", resource: work,
			prepare: stream(work, "waymark.work.*.*", jetstream.WorkQueuePolicy, func(sc *jetstream.StreamConfig) { sc.Duplicates = time.Minute }),
			want:    []string{`resource="stream WAYMARK_WORK"`, `setting="duplicate window"`, "have=1m0s", "want=2m0s"}},
		{name: "inbox with smaller messages", resource: inbox,
			prepare: stream(inbox, "waymark.inbox.*.*", jetstream.WorkQueuePolicy, func(sc *jetstream.StreamConfig) { sc.MaxMsgSize = 2048 }),
			want:    []string{`resource="stream WAYMARK_INBOX"`, `setting="max message size"`, "have=2048"}},

		// The engine consumer (Open makes it; a worker's store is not
		// allowed to tune it).
		// (A work-queue stream refuses consumers with another ack policy
		// itself, so that check cannot be met on these streams.)
		{name: "engine consumer that pushes", fatal: true, resource: inbox,
			prepare: engineConsumer(func(cc *jetstream.ConsumerConfig) { cc.DeliverSubject = "deliver.here" }),
			want:    []string{"consumer waymark-engine on WAYMARK_INBOX", "deliver subject set (a push consumer)", "pull consumer"}},
		{name: "engine consumer with filters", fatal: true, resource: inbox,
			prepare: engineConsumer(func(cc *jetstream.ConsumerConfig) {
				cc.FilterSubjects = []string{"waymark.inbox.start.*", "waymark.inbox.result.*"}
			}),
			want: []string{"consumer waymark-engine on WAYMARK_INBOX", "filter subject [waymark.inbox.start.* waymark.inbox.result.*]", `needs ""`}},
		{name: "engine consumer with another ack wait", resource: inbox,
			prepare: engineConsumer(func(cc *jetstream.ConsumerConfig) { cc.AckWait = 5 * time.Second }),
			want:    []string{`resource="consumer waymark-engine on WAYMARK_INBOX"`, `setting="ack wait"`, "have=5s", "want=30s"}},
		{name: "engine consumer with a delivery limit", resource: inbox,
			prepare: engineConsumer(func(cc *jetstream.ConsumerConfig) { cc.MaxDeliver = 5 }),
			want:    []string{`resource="consumer waymark-engine on WAYMARK_INBOX"`, `setting="max deliver"`, "have=5", "want=-1"}},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			srv := testsupport.StartServer(t, testsupport.ServerOptions{})
			js := newJS(t, srv)
			if err := r.prepare(ctx(t), js); err != nil {
				t.Fatalf("prepare: %v", err)
			}
			before := streamConfig(t, js, r.resource)
			var engineBefore *jetstream.ConsumerInfo
			if r.resource == inbox {
				if c, err := js.Consumer(ctx(t), inbox, "waymark-engine"); err == nil {
					engineBefore = c.CachedInfo()
				}
			}
			var logs bytes.Buffer
			log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
			_, err := kv.Open(ctx(t), js, kv.Config{}, log)
			switch {
			case r.fatal && !errors.Is(err, kv.ErrIncompatible):
				t.Fatalf("Open = %v, want ErrIncompatible", err)
			case r.fatal:
				for _, w := range r.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not contain %q", err, w)
					}
				}
			case err != nil:
				t.Fatalf("Open = %v, want it to work with the resource as it is", err)
			default:
				if len(r.want) == 0 && logs.Len() > 0 {
					t.Errorf("warned about a tolerable setting that needs no word:\n%s", logs.String())
				}
				for _, w := range r.want {
					if !strings.Contains(logs.String(), w) {
						t.Errorf("no %q in the warnings:\n%s", w, logs.String())
					}
				}
				if len(r.want) > 0 && !strings.Contains(logs.String(), "level=WARN") {
					t.Errorf("not logged at warn:\n%s", logs.String())
				}
			}
			if after := streamConfig(t, js, r.resource); !reflect.DeepEqual(after, before) {
				t.Errorf("%s changed:\nbefore %+v\nafter  %+v", r.resource, before, after)
			}
			if engineBefore != nil {
				after := consumerInfo(t, js, inbox, "waymark-engine")
				if !reflect.DeepEqual(after.Config, engineBefore.Config) {
					t.Errorf("engine consumer changed by a process that may not tune it:\nbefore %+v\nafter  %+v", engineBefore.Config, after.Config)
				}
			}
		})
	}
}

// TestConsumerTuning: only a store with TuneConsumers (an engine) changes
// an existing consumer's ack wait, max deliver or max ack pending, logging
// old and new values at info; a worker keeps the consumer's, warns, and
// refuses a lease shorter than the one it times its heartbeats by.
func TestConsumerTuning(t *testing.T) {
	t.Parallel()
	n := kv.NamesFor(kv.DefaultPrefix)
	// setup makes the layout and pool gpu's work consumer with a 10s lease
	// and 3 deliveries, as a worker configured that way would.
	setup := func(t *testing.T) (*testsupport.Server, jetstream.JetStream) {
		t.Helper()
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		st := srv.Store(t, kv.Config{WorkAckWait: 10 * time.Second, WorkMaxDeliver: 3, InboxAckWait: 5 * time.Second})
		if _, err := st.EnsureWorkConsumer(ctx(t), "gpu"); err != nil {
			t.Fatal(err)
		}
		return srv, newJS(t, srv)
	}
	logger := func() (*slog.Logger, *bytes.Buffer) {
		var b bytes.Buffer
		return slog.New(slog.NewTextHandler(&b, &slog.HandlerOptions{Level: slog.LevelInfo})), &b
	}

	t.Run("a worker with a longer lease refuses a shorter one", func(t *testing.T) {
		t.Parallel()
		srv, js := setup(t)
		st := srv.Store(t, kv.Config{WorkAckWait: 30 * time.Second, WorkMaxDeliver: 3})
		_, err := st.EnsureWorkConsumer(ctx(t), "gpu")
		if !errors.Is(err, kv.ErrIncompatible) {
			t.Fatalf("EnsureWorkConsumer = %v, want ErrIncompatible", err)
		}
		for _, w := range []string{"consumer waymark-work-gpu on WAYMARK_WORK", "ack wait 10s", "needs 30s", "WAYMARK_WORK_ACK_WAIT"} {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("error %q does not contain %q", err, w)
			}
		}
		if c := consumerInfo(t, js, n.WorkStream, n.WorkConsumer("gpu")).Config; c.AckWait != 10*time.Second {
			t.Errorf("ack wait changed to %v", c.AckWait)
		}
	})

	t.Run("a worker keeps a longer lease and other deliveries, warning", func(t *testing.T) {
		t.Parallel()
		srv, js := setup(t)
		log, logs := logger()
		st, err := kv.Open(ctx(t), newJS(t, srv), kv.Config{WorkAckWait: 5 * time.Second, WorkMaxDeliver: 9}, log)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.EnsureWorkConsumer(ctx(t), "gpu"); err != nil {
			t.Fatalf("EnsureWorkConsumer = %v", err)
		}
		if c := consumerInfo(t, js, n.WorkStream, n.WorkConsumer("gpu")).Config; c.AckWait != 10*time.Second || c.MaxDeliver != 3 {
			t.Errorf("work consumer changed by a worker: ack wait %v, max deliver %d", c.AckWait, c.MaxDeliver)
		}
		if c := consumerInfo(t, js, n.InboxStream, n.EngineConsumer).Config; c.AckWait != 5*time.Second {
			t.Errorf("engine consumer changed by a worker: ack wait %v", c.AckWait)
		}
		for _, w := range []string{`level=WARN`, `resource="consumer waymark-work-gpu on WAYMARK_WORK"`, `setting="max deliver" have=3 want=9`, `setting="ack wait" have=10s want=5s`} {
			if !strings.Contains(logs.String(), w) {
				t.Errorf("no %q in:\n%s", w, logs.String())
			}
		}
	})

	t.Run("an engine tunes every shared consumer and says so", func(t *testing.T) {
		t.Parallel()
		srv, js := setup(t)
		log, logs := logger()
		cfg := kv.Config{TuneConsumers: true, WorkAckWait: 20 * time.Second, WorkMaxDeliver: 7, InboxAckWait: 8 * time.Second, MaxAckPending: 500}
		if _, err := kv.Open(ctx(t), newJS(t, srv), cfg, log); err != nil {
			t.Fatal(err)
		}
		if c := consumerInfo(t, js, n.WorkStream, n.WorkConsumer("gpu")).Config; c.AckWait != 20*time.Second || c.MaxDeliver != 7 || c.MaxAckPending != 500 {
			t.Errorf("work consumer: ack wait %v, max deliver %d, max ack pending %d; want the engine's", c.AckWait, c.MaxDeliver, c.MaxAckPending)
		}
		if c := consumerInfo(t, js, n.InboxStream, n.EngineConsumer).Config; c.AckWait != 8*time.Second || c.MaxAckPending != 500 {
			t.Errorf("engine consumer: ack wait %v, max ack pending %d; want the engine's", c.AckWait, c.MaxAckPending)
		}
		for _, w := range []string{
			`level=INFO msg="changed a shared consumer's setting to this engine's" resource="consumer waymark-work-gpu on WAYMARK_WORK" setting="ack wait" old=10s new=20s`,
			`resource="consumer waymark-work-gpu on WAYMARK_WORK" setting="max deliver" old=3 new=7`,
			`resource="consumer waymark-engine on WAYMARK_INBOX" setting="ack wait" old=5s new=8s`,
		} {
			if !strings.Contains(logs.String(), w) {
				t.Errorf("no %q in:\n%s", w, logs.String())
			}
		}
		if strings.Contains(logs.String(), "level=WARN") {
			t.Errorf("an engine tuning consumers warned:\n%s", logs.String())
		}
		// A second engine with the same settings changes nothing more.
		log2, logs2 := logger()
		if _, err := kv.Open(ctx(t), newJS(t, srv), cfg, log2); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(logs2.String(), "changed") {
			t.Errorf("second engine changed again:\n%s", logs2.String())
		}
	})
}
