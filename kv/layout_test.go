package kv_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
)

func TestNamesFor(t *testing.T) {
	t.Parallel()
	// The names the package documentation and the README promise.
	want := kv.NamesFor(kv.DefaultPrefix)
	for got, w := range map[string]string{
		want.CheckpointBucket:                        "waymark_checkpoints",
		want.DefinitionBucket:                        "waymark_definitions",
		want.WorkStream:                              "WAYMARK_WORK",
		want.InboxStream:                             "WAYMARK_INBOX",
		want.HistoryStream:                           "WAYMARK_HISTORY",
		want.EngineConsumer:                          "waymark-engine",
		want.JobsBucket:                              "waymark_jobs",
		want.EventBucket:                             "waymark_events",
		want.TriggerPrefix:                           "waymark.trigger.",
		want.WorkSubject("gpu", "job-1"):             "waymark.work.gpu.job-1",
		want.WorkFilter("gpu"):                       "waymark.work.gpu.*",
		want.EffectHistorySubject("job-1"):           "waymark.history.job-1.effects",
		want.WorkConsumer("gpu"):                     "waymark-work-gpu",
		want.InboxSubject(kv.InboxStart, "job-1"):    "waymark.inbox.start.job-1",
		want.InboxSubject(kv.InboxResult, "job-1"):   "waymark.inbox.result.job-1",
		want.HistorySubject("job-1"):                 "waymark.history.job-1",
		kv.NamesFor("acme_prod").WorkStream:          "ACME_PROD_WORK",
		kv.NamesFor("acme_prod").WorkConsumer("cpu"): "acme_prod-work-cpu",
	} {
		if got != w {
			t.Errorf("got %q, want %q", got, w)
		}
	}

	rows := []struct {
		subject, kind, job string
		ok                 bool
	}{
		{"waymark.inbox.start.job-1", "start", "job-1", true},
		{"waymark.inbox.result.j", "result", "j", true},
		{"waymark.inbox.result.", "", "", false},
		{"waymark.inbox.result", "", "", false},
		{"waymark.inbox.result.a.b", "", "", false},
		{"other.inbox.start.job-1", "", "", false},
		{"waymark.work.default", "", "", false},
	}
	for _, r := range rows {
		kind, job, ok := want.ParseInboxSubject(r.subject)
		if ok != r.ok || (ok && (kind != r.kind || job != r.job)) {
			t.Errorf("ParseInboxSubject(%q) = %q, %q, %v; want %q, %q, %v", r.subject, kind, job, ok, r.kind, r.job, r.ok)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	rows := []struct {
		name      string
		edit      func(*kv.Config)
		wantField string // "" when valid
	}{
		{name: "defaults", edit: func(*kv.Config) {}},
		{name: "three replicas", edit: func(c *kv.Config) { c.Replicas = 3 }},
		{name: "unlimited deliveries", edit: func(c *kv.Config) { c.WorkMaxDeliver = -1 }},
		{name: "unlimited ack pending", edit: func(c *kv.Config) { c.MaxAckPending = -1 }},
		{name: "upper-case prefix", edit: func(c *kv.Config) { c.Prefix = "Waymark" }, wantField: "prefix"},
		{name: "prefix with a dot", edit: func(c *kv.Config) { c.Prefix = "way.mark" }, wantField: "prefix"},
		{name: "prefix with a wildcard", edit: func(c *kv.Config) { c.Prefix = "way*" }, wantField: "prefix"},
		{name: "prefix starting with a digit", edit: func(c *kv.Config) { c.Prefix = "1waymark" }, wantField: "prefix"},
		{name: "prefix too long", edit: func(c *kv.Config) { c.Prefix = strings.Repeat("w", 33) }, wantField: "prefix"},
		{name: "two replicas", edit: func(c *kv.Config) { c.Replicas = 2 }, wantField: "replicas"},
		{name: "negative replicas", edit: func(c *kv.Config) { c.Replicas = -1 }, wantField: "replicas"},
		{name: "short duplicates window", edit: func(c *kv.Config) { c.Duplicates = 500 * time.Millisecond }, wantField: "duplicates window"},
		{name: "short inbox ack wait", edit: func(c *kv.Config) { c.InboxAckWait = 10 * time.Millisecond }, wantField: "inbox ack wait"},
		{name: "short work ack wait", edit: func(c *kv.Config) { c.WorkAckWait = 10 * time.Millisecond }, wantField: "work ack wait"},
		{name: "one delivery", edit: func(c *kv.Config) { c.WorkMaxDeliver = 1 }, wantField: "work max deliver"},
		{name: "negative deliveries", edit: func(c *kv.Config) { c.WorkMaxDeliver = -2 }, wantField: "work max deliver"},
		{name: "negative ack pending", edit: func(c *kv.Config) { c.MaxAckPending = -5 }, wantField: "max ack pending"},
		{name: "tiny values", edit: func(c *kv.Config) { c.MaxValueBytes = 100 }, wantField: "max value bytes"},
		{name: "tiny messages", edit: func(c *kv.Config) { c.MaxMessageBytes = 100 }, wantField: "max message bytes"},
		{name: "negative history age", edit: func(c *kv.Config) { c.HistoryMaxAge = -time.Hour }, wantField: "history max age"},
		{name: "history age below the server's minimum", edit: func(c *kv.Config) { c.HistoryMaxAge = time.Nanosecond }, wantField: "history max age 1ns: want 100ms or more,"},
		{name: "negative duplicates window", edit: func(c *kv.Config) { c.Duplicates = -time.Minute }, wantField: "duplicates window"},
		{name: "negative inbox ack wait", edit: func(c *kv.Config) { c.InboxAckWait = -time.Second }, wantField: "inbox ack wait"},
		{name: "negative work ack wait", edit: func(c *kv.Config) { c.WorkAckWait = -time.Second }, wantField: "work ack wait"},
		{name: "short job retention", edit: func(c *kv.Config) { c.JobRetention = time.Minute }},
		{name: "jobs kept forever", edit: func(c *kv.Config) { c.JobRetention = -1 }},
		{name: "events kept an hour", edit: func(c *kv.Config) { c.EventRetention = time.Hour }},
		{name: "events kept under a second", edit: func(c *kv.Config) { c.EventRetention = time.Millisecond }, wantField: "event retention"},
		{name: "negative event retention", edit: func(c *kv.Config) { c.EventRetention = -time.Hour }, wantField: "event retention"},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			c := kv.Config{}.WithDefaults()
			r.edit(&c)
			err := c.Validate()
			if r.wantField == "" {
				if err != nil {
					t.Fatalf("Validate = %v", err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), "kv config: "+r.wantField+" ") {
				t.Errorf("Validate = %v, want an error naming %q", err, r.wantField)
			}
		})
	}

	t.Run("zero value gets the documented defaults", func(t *testing.T) {
		t.Parallel()
		got := kv.Config{}.WithDefaults()
		want := kv.Config{
			Prefix: "waymark", Replicas: 1, Duplicates: 2 * time.Minute, InboxAckWait: 30 * time.Second,
			WorkAckWait: 30 * time.Second, WorkMaxDeliver: 20, MaxAckPending: 20000, MaxValueBytes: 1 << 20,
			MaxMessageBytes: 1 << 20, JobRetention: 30 * 24 * time.Hour, ValueThreshold: 64 << 10, MaxJobStateBytes: 64 << 20,
			EventRetention: 7 * 24 * time.Hour,
		}
		if got != want {
			t.Errorf("WithDefaults = %+v, want %+v", got, want)
		}
	})

	t.Run("negative durations name the default", func(t *testing.T) {
		t.Parallel()
		c := kv.Config{Duplicates: -time.Hour}.WithDefaults()
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), "-1h0m0s") || !strings.Contains(err.Error(), "0 means the default") {
			t.Errorf("Validate = %v, want the value and what 0 means", err)
		}
	})

	t.Run("Open refuses before touching the server", func(t *testing.T) {
		t.Parallel()
		srv := testsupport.StartServer(t, testsupport.ServerOptions{})
		js := newJS(t, srv)
		_, err := kv.Open(ctx(t), js, kv.Config{Replicas: 2}, nil)
		if err == nil || !strings.Contains(err.Error(), "replicas") {
			t.Fatalf("Open = %v, want the replicas error", err)
		}
		if names := streamNames(t, js); len(names) != 0 {
			t.Errorf("streams created anyway: %v", names)
		}
	})
}

// streamNames lists every stream on the server.
func streamNames(t *testing.T, js jetstream.JetStream) []string {
	t.Helper()
	var names []string
	l := js.StreamNames(ctx(t))
	for n := range l.Name() {
		names = append(names, n)
	}
	if err := l.Err(); err != nil {
		t.Fatal(err)
	}
	return names
}

// streamConfig returns the configuration of stream name.
func streamConfig(t *testing.T, js jetstream.JetStream, name string) jetstream.StreamConfig {
	t.Helper()
	s, err := js.Stream(ctx(t), name)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	return s.CachedInfo().Config
}

// streamInfo fetches fresh information on stream name.
func streamInfo(t *testing.T, js jetstream.JetStream, name string) *jetstream.StreamInfo {
	t.Helper()
	s, err := js.Stream(ctx(t), name)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	info, err := s.Info(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	return info
}

// consumerInfo returns what the server holds for a durable consumer.
func consumerInfo(t *testing.T, js jetstream.JetStream, stream, name string) *jetstream.ConsumerInfo {
	t.Helper()
	c, err := js.Consumer(ctx(t), stream, name)
	if err != nil {
		t.Fatalf("consumer %s on %s: %v", name, stream, err)
	}
	return c.CachedInfo()
}

func TestOpenCreatesLayout(t *testing.T) {
	t.Parallel()
	cfg := kv.Config{
		Prefix:          "wmtest",
		Duplicates:      90 * time.Second,
		InboxAckWait:    3 * time.Second,
		WorkAckWait:     4 * time.Second,
		WorkMaxDeliver:  7,
		MaxAckPending:   123,
		MaxValueBytes:   64 << 10,
		MaxMessageBytes: 32 << 10,
		HistoryMaxAge:   48 * time.Hour,
	}
	b := setup(t, cfg)
	n := b.store.Names
	if !reflect.DeepEqual(n, kv.NamesFor("wmtest")) {
		t.Errorf("Names = %+v, want NamesFor(wmtest)", n)
	}
	if n.WorkStream != "WMTEST_WORK" || n.CheckpointBucket != "wmtest_checkpoints" || n.EngineConsumer != "wmtest-engine" {
		t.Errorf("Names = %+v", n)
	}
	wantCfg := cfg.WithDefaults()
	wantCfg.QueueStorage = kv.QueueFile // resolved: a new deployment's queues are files
	if b.store.Config != wantCfg {
		t.Errorf("Store.Config = %+v, want %+v", b.store.Config, wantCfg)
	}

	streams := []struct {
		name      string
		subjects  []string
		retention jetstream.RetentionPolicy
		maxAge    time.Duration
	}{
		{n.WorkStream, []string{"wmtest.work.*.*"}, jetstream.WorkQueuePolicy, 0},
		{n.InboxStream, []string{"wmtest.inbox.*.*"}, jetstream.WorkQueuePolicy, 0},
		{n.HistoryStream, []string{"wmtest.history.*", "wmtest.history.*.effects"}, jetstream.LimitsPolicy, 48 * time.Hour},
		{n.EpochStream, []string{"wmtest.queue_epoch"}, jetstream.LimitsPolicy, 0},
		{n.TimerStream, []string{"wmtest.timer.set.*.*", "wmtest.timer.due.*", "wmtest.timer.cron.*", "wmtest.timer.fired.*"}, jetstream.WorkQueuePolicy, 0},
	}
	for _, s := range streams {
		c := streamConfig(t, b.js, s.name)
		if !reflect.DeepEqual(c.Subjects, s.subjects) || c.Retention != s.retention || c.MaxAge != s.maxAge ||
			c.Duplicates != 90*time.Second || c.MaxMsgSize != 32<<10 || c.Storage != jetstream.FileStorage || c.Replicas != 1 ||
			c.Metadata["waymark_layout"] != kv.LayoutVersion {
			t.Errorf("stream %s: %+v", s.name, c)
		}
	}
	// The checkpoint bucket leaves room for the headers of a write beyond
	// MaxValueBytes, which Encode enforces on the checkpoint itself.
	for bucket, maxValue := range map[string]int32{n.CheckpointBucket: 64<<10 + 1024, n.EffectBucket: 64<<10 + 1024, n.DefinitionBucket: 8 << 20} {
		c := streamConfig(t, b.js, "KV_"+bucket)
		if c.MaxMsgsPerSubject != 1 || c.MaxMsgSize != maxValue || c.Storage != jetstream.FileStorage {
			t.Errorf("bucket %s: history %d, max value %d, storage %v", bucket, c.MaxMsgsPerSubject, c.MaxMsgSize, c.Storage)
		}
	}
	if got := streamNames(t, b.js); len(got) != 14 {
		t.Errorf("streams = %v, want 5 streams, 8 buckets and the value bucket", got)
	}

	eng := consumerInfo(t, b.js, n.InboxStream, n.EngineConsumer).Config
	if eng.Durable != "wmtest-engine" || eng.AckPolicy != jetstream.AckExplicitPolicy || eng.AckWait != 3*time.Second ||
		eng.MaxDeliver != -1 || eng.MaxAckPending != 123 || eng.FilterSubject != "" {
		t.Errorf("engine consumer: %+v", eng)
	}
	if c, err := b.store.EngineConsumer(ctx(t)); err != nil || c.CachedInfo().Name != "wmtest-engine" {
		t.Errorf("EngineConsumer = %v, %v", c, err)
	}

	wc, err := b.store.EnsureWorkConsumer(ctx(t), "gpu")
	if err != nil {
		t.Fatal(err)
	}
	work := wc.CachedInfo().Config
	if work.Durable != "wmtest-work-gpu" || work.FilterSubject != "wmtest.work.gpu.*" || work.AckPolicy != jetstream.AckExplicitPolicy ||
		work.AckWait != 4*time.Second || work.MaxDeliver != 7 || work.MaxAckPending != 123 || work.Metadata["waymark_pool"] != "gpu" {
		t.Errorf("work consumer: %+v", work)
	}
	// A second pool's consumer shares the work-queue stream.
	if _, err := b.store.EnsureWorkConsumer(ctx(t), "cpu"); err != nil {
		t.Errorf("second pool: %v", err)
	}

	t.Run("second Open changes nothing", func(t *testing.T) {
		before := snapshot(t, b.js, n)
		if _, err := kv.Open(ctx(t), newJS(t, b.srv), cfg, nil); err != nil {
			t.Fatalf("second Open: %v", err)
		}
		if _, err := b.store.EnsureWorkConsumer(ctx(t), "gpu"); err != nil {
			t.Fatalf("second EnsureWorkConsumer: %v", err)
		}
		if after := snapshot(t, b.js, n); !reflect.DeepEqual(before, after) {
			t.Errorf("layout changed:\nbefore %+v\nafter  %+v", before, after)
		}
	})
}

// layout is what Open may not change on a second run.
type layout struct {
	Streams   map[string]jetstream.StreamConfig
	Created   map[string]time.Time
	Consumers map[string]jetstream.ConsumerConfig
}

// snapshot records the layout Open made under names n.
func snapshot(t *testing.T, js jetstream.JetStream, n kv.Names) layout {
	t.Helper()
	l := layout{Streams: map[string]jetstream.StreamConfig{}, Created: map[string]time.Time{}, Consumers: map[string]jetstream.ConsumerConfig{}}
	for _, name := range []string{n.WorkStream, n.InboxStream, n.HistoryStream, "KV_" + n.CheckpointBucket, "KV_" + n.DefinitionBucket} {
		s, err := js.Stream(ctx(t), name)
		if err != nil {
			t.Fatal(err)
		}
		l.Streams[name] = s.CachedInfo().Config
		l.Created[name] = s.CachedInfo().Created
	}
	for _, c := range []struct{ stream, name string }{{n.InboxStream, n.EngineConsumer}, {n.WorkStream, n.WorkConsumer("gpu")}} {
		info := consumerInfo(t, js, c.stream, c.name)
		l.Consumers[c.name] = info.Config
		l.Created[c.name] = info.Created
	}
	return l
}

func TestOpenMemory(t *testing.T) {
	t.Parallel()
	b := setup(t, kv.Config{Memory: true, Prefix: "mem"})
	for _, name := range []string{"MEM_WORK", "MEM_INBOX", "MEM_HISTORY", "KV_mem_checkpoints", "KV_mem_definitions"} {
		if c := streamConfig(t, b.js, name); c.Storage != jetstream.MemoryStorage {
			t.Errorf("%s: storage %v, want memory", name, c.Storage)
		}
	}
}

func TestOpenRefusesIncompatible(t *testing.T) {
	t.Parallel()
	n := kv.NamesFor(kv.DefaultPrefix)
	rows := []struct {
		name    string
		prepare func(context.Context, jetstream.JetStream) error
		stream  string // the stream that must survive with its message
		wantMsg string
	}{
		{
			name: "work stream with limits retention",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateStream(c, jetstream.StreamConfig{Name: n.WorkStream, Subjects: []string{"waymark.work.*"}, Retention: jetstream.LimitsPolicy})
				return err
			},
			stream: n.WorkStream, wantMsg: "stream WAYMARK_WORK has retention",
		},
		{
			name: "inbox stream with interest retention",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateStream(c, jetstream.StreamConfig{Name: n.InboxStream, Subjects: []string{"waymark.inbox.*.*"}, Retention: jetstream.InterestPolicy})
				return err
			},
			stream: n.InboxStream, wantMsg: "stream WAYMARK_INBOX has retention",
		},
		{
			name: "history stream as a work queue",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateStream(c, jetstream.StreamConfig{Name: n.HistoryStream, Subjects: []string{"waymark.history.*"}, Retention: jetstream.WorkQueuePolicy})
				return err
			},
			stream: n.HistoryStream, wantMsg: "stream WAYMARK_HISTORY has retention",
		},
		{
			name: "inbox stream with other subjects",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				_, err := js.CreateStream(c, jetstream.StreamConfig{Name: n.InboxStream, Subjects: []string{"waymark.inbox.>"}, Retention: jetstream.WorkQueuePolicy})
				return err
			},
			stream: n.InboxStream, wantMsg: "stream WAYMARK_INBOX has subjects",
		},
		{
			name: "engine consumer with a filter",
			prepare: func(c context.Context, js jetstream.JetStream) error {
				if _, err := js.CreateStream(c, jetstream.StreamConfig{Name: n.InboxStream, Subjects: []string{"waymark.inbox.*.*"}, Retention: jetstream.WorkQueuePolicy}); err != nil {
					return err
				}
				_, err := js.CreateConsumer(c, n.InboxStream, jetstream.ConsumerConfig{Durable: n.EngineConsumer, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: "waymark.inbox.start.*"})
				return err
			},
			stream: n.InboxStream, wantMsg: "consumer waymark-engine on WAYMARK_INBOX",
		},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			srv := testsupport.StartServer(t, testsupport.ServerOptions{})
			js := newJS(t, srv)
			if err := r.prepare(ctx(t), js); err != nil {
				t.Fatal(err)
			}
			subject := streamConfig(t, js, r.stream).Subjects[0]
			subject = strings.ReplaceAll(strings.ReplaceAll(subject, "*", "x"), ">", "x")
			if _, err := js.Publish(ctx(t), subject, []byte("precious")); err != nil {
				t.Fatal(err)
			}
			before := streamInfo(t, js, r.stream)

			_, err := kv.Open(ctx(t), js, kv.Config{}, nil)
			if !errors.Is(err, kv.ErrIncompatible) {
				t.Fatalf("Open = %v, want ErrIncompatible", err)
			}
			if !strings.Contains(err.Error(), r.wantMsg) {
				t.Errorf("error %q does not contain %q", err, r.wantMsg)
			}

			after := streamInfo(t, js, r.stream)
			if after.State.Msgs != before.State.Msgs || after.State.LastSeq != before.State.LastSeq || !after.Created.Equal(before.Created) {
				t.Errorf("stream %s: %d messages up to %d, created %v; before Open %d up to %d, created %v",
					r.stream, after.State.Msgs, after.State.LastSeq, after.Created, before.State.Msgs, before.State.LastSeq, before.Created)
			}
			if !reflect.DeepEqual(after.Config, before.Config) {
				t.Errorf("stream %s changed:\n%+v\n%+v", r.stream, before.Config, after.Config)
			}
		})
	}
}

func TestOpenContextDeadline(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	_, err := kv.Open(expired(t), newJS(t, srv), kv.Config{}, nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Open = %v, want context.DeadlineExceeded", err)
	}
}

func TestQueueEpochTellsWhetherQueuesWereLost(t *testing.T) {
	t.Parallel()
	for _, storage := range []string{kv.QueueFile, kv.QueueMemory} {
		t.Run(storage, func(t *testing.T) {
			t.Parallel()
			srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
			st := srv.Store(t, kv.Config{QueueStorage: storage})
			c := ctx(t)
			if ok, err := st.QueuesIntact(c); err != nil || ok {
				t.Fatalf("fresh layout: intact=%v %v, want not yet marked", ok, err)
			}
			if err := st.MarkQueues(c); err != nil {
				t.Fatal(err)
			}
			if ok, err := st.QueuesIntact(c); err != nil || !ok {
				t.Fatalf("after MarkQueues: intact=%v %v", ok, err)
			}
			srv.Restart(t)
			var lastOK bool
			var lastErr error
			testsupport.Eventually(t, 10*time.Second, func() bool {
				// A request sent before the client saw the restart is
				// lost: each read gets its own short deadline.
				rc, cancel := context.WithTimeout(c, time.Second)
				defer cancel()
				lastOK, lastErr = st.QueuesIntact(rc)
				return lastErr == nil && lastOK == (storage == kv.QueueFile)
			}, "after a restart, %s queues should read intact=%v; last read %v", storage, storage == kv.QueueFile, lastRead{&lastOK, &lastErr})
			if storage == kv.QueueMemory {
				if err := st.Reopen(c); err != nil {
					t.Fatalf("reopen after the memory queues were lost: %v", err)
				}
				if _, err := st.JS.Stream(c, st.Names.WorkStream); err != nil {
					t.Fatalf("work stream after Reopen: %v", err)
				}
			}
		})
	}
}

// lastRead prints the last QueuesIntact result when a wait fails.
type lastRead struct {
	ok  *bool
	err *error
}

func (l lastRead) String() string {
	if *l.err != nil {
		return (*l.err).Error()
	}
	if *l.ok {
		return "intact"
	}
	return "not intact"
}

// TestQueueStorageIsRecorded: a deployment made with memory queues is
// opened without the setting by a client (its queues are used as they
// are), recreates lost queues in memory after a restart, and refuses an
// explicit setting that disagrees with existing streams.
func TestQueueStorageIsRecorded(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	srv.Store(t, kv.Config{QueueStorage: kv.QueueMemory})
	c := ctx(t)

	client := srv.Store(t, kv.Config{})
	if client.Config.QueueStorage != kv.QueueMemory {
		t.Fatalf("a client without the setting resolved %q; want the recorded memory", client.Config.QueueStorage)
	}
	_, err := kv.Open(c, newJS(t, srv), kv.Config{QueueStorage: kv.QueueFile}, nil)
	if !errors.Is(err, kv.ErrIncompatible) || !strings.Contains(err.Error(), "WAYMARK_QUEUE_STORAGE") {
		t.Fatalf("explicit file over memory streams: %v; want ErrIncompatible naming WAYMARK_QUEUE_STORAGE", err)
	}

	srv.Restart(t) // the memory queues are gone
	after := srv.Store(t, kv.Config{})
	if after.Config.QueueStorage != kv.QueueMemory {
		t.Fatalf("after a restart, resolved %q; want memory", after.Config.QueueStorage)
	}
	rc, cancel := context.WithTimeout(c, 5*time.Second)
	defer cancel()
	st, err := after.JS.Stream(rc, after.Names.WorkStream)
	if err != nil {
		t.Fatal(err)
	}
	if got := st.CachedInfo().Config.Storage; got != jetstream.MemoryStorage {
		t.Errorf("work stream recreated with %v storage; want memory, as recorded", got)
	}
}
