package notify_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding/format"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"go.uber.org/goleak"

	"github.com/waymark-dev/waymark/engine/notify"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The embedded server's accept loop and stream loops end after the
		// test's cleanup has returned.
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
		// httptest servers' idle keep-alive connections close asynchronously.
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}

var testSecret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))

// world is one test's server and store.
type world struct {
	t     *testing.T
	srv   *testsupport.Server
	store *kv.Store
}

func setup(t *testing.T) *world {
	t.Helper()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	return &world{t: t, srv: srv, store: srv.Store(t, kv.Config{})}
}

// run starts fn until the test ends (or stop is called) and reports its
// error to the test.
func (w *world) run(fn func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := fn(ctx); err != nil {
			w.t.Errorf("run: %v", err)
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	w.t.Cleanup(stop)
	return stop
}

// waitConsumer waits until the durable consumer name exists on the
// history stream: it delivers only messages stored after it was made.
func (w *world) waitConsumer(name string) {
	w.t.Helper()
	testsupport.Eventually(w.t, 10*time.Second, func() bool {
		_, err := w.store.JS.Consumer(context.Background(), w.store.Names.HistoryStream, name)
		return err == nil
	}, "consumer %s never appeared", name)
}

// quiet drops the log lines of deliveries the tests make fail on purpose.
var quiet = slog.New(slog.DiscardHandler)

var t0 = time.Date(2026, 12, 1, 23, 0, 0, 0, time.UTC)

// publishTransition appends one transition's events of job to the history
// stream, as an engine does (the same encoder, subject and headers).
func (w *world) publishTransition(job string, seq uint64, evs ...schemas.Event) {
	w.t.Helper()
	for i := range evs {
		evs[i].Data.Job, evs[i].Data.Seq = job, seq
		if evs[i].Time.IsZero() {
			evs[i].Time = t0
		}
	}
	m := nats.NewMsg(w.store.Names.HistorySubject(job))
	m.Data = schemas.AppendHistoryBatch(nil, schemas.HistorySourceEngine, job, seq, evs)
	m.Header.Set("Content-Type", schemas.HistoryContentType)
	m.Header.Set(kv.HeaderSeq, "1")
	if _, err := w.store.JS.PublishMsg(context.Background(), m); err != nil {
		w.t.Fatal(err)
	}
}

// aJob publishes a whole job's history: started, a step dispatched and
// completed, an approval requested, an effect ambiguous, completed.
func (w *world) aJob(job string) {
	w.t.Helper()
	w.publishTransition(job, 1, schemas.Event{Type: schemas.EventJobStarted, Data: schemas.HistoryData{Status: "running", Input: json.RawMessage(`{"n":1}`)}},
		schemas.Event{Type: schemas.EventStepDispatched, Data: schemas.HistoryData{Step: "a", Attempt: 1}})
	w.publishTransition(job, 2, schemas.Event{Type: schemas.EventStepCompleted, Data: schemas.HistoryData{Step: "a", Attempt: 1, Next: "b", NextAttempt: 1}})
	w.publishTransition(job, 3, schemas.Event{Type: schemas.EventApprovalRequested, Data: schemas.HistoryData{Step: "b",
		Approval: &schemas.Approval{ID: "b/1", Gate: "b", Run: 1, Status: schemas.ApprovalPending, RequestedAt: t0}}})
	rec := &schemas.EffectRecord{Job: job, Step: "b", Attempt: 1, Key: job + "/b", State: schemas.EffectAmbiguous}
	if err := w.store.AppendEffectEvent(context.Background(), job, "/waymark/worker/w1", schemas.EventEffectAmbiguous, rec, 7, t0); err != nil {
		w.t.Fatal(err)
	}
	w.publishTransition(job, 4, schemas.Event{Type: schemas.EventJobCompleted, Data: schemas.HistoryData{Status: "completed"}})
}

func TestRelayPublishesBinaryCloudEvents(t *testing.T) {
	t.Parallel()
	w := setup(t)
	nc := w.srv.Conn(t)
	got := make(chan *nats.Msg, 64)
	sub, err := nc.ChanSubscribe("waymark.events.*.*.J1", got)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	r, err := notify.NewRelay(notify.RelayConfig{Store: w.store, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	w.run(r.Run)
	w.waitConsumer("waymark-events-out")
	w.aJob("J1")
	w.aJob("J2") // another job's events: not on J1's subjects

	want := []struct{ subject, id, typ, source string }{
		{"waymark.events.job.started.J1", "J1/1/0", schemas.EventJobStarted, schemas.HistorySourceEngine},
		{"waymark.events.step.completed.J1", "J1/2/0", schemas.EventStepCompleted, schemas.HistorySourceEngine},
		{"waymark.events.approval.requested.J1", "J1/3/0", schemas.EventApprovalRequested, schemas.HistorySourceEngine},
		{"waymark.events.effect.ambiguous.J1", "J1/effect/7", schemas.EventEffectAmbiguous, "/waymark/worker/w1"},
		{"waymark.events.job.completed.J1", "J1/4/0", schemas.EventJobCompleted, schemas.HistorySourceEngine},
	}
	for i, wt := range want {
		var m *nats.Msg
		select {
		case m = <-got:
		case <-time.After(10 * time.Second):
			t.Fatalf("event %d (%s) never came", i, wt.subject)
		}
		h := m.Header
		if m.Subject != wt.subject || h.Get("ce-id") != wt.id || h.Get("ce-type") != wt.typ || h.Get("ce-source") != wt.source ||
			h.Get("ce-specversion") != "1.0" || h.Get("ce-subject") != "J1" || h.Get("ce-datacontenttype") != "application/json" ||
			h.Get("ce-time") != "2026-12-01T23:00:00Z" || h.Get(jetstream.MsgIDHeader) != wt.id {
			t.Errorf("event %d: %s %v; want %+v", i, m.Subject, h, wt)
		}
		if ct := h.Get("Content-Type"); strings.HasPrefix(ct, "application/cloudevents") {
			t.Errorf("event %d: Content-Type %q marks structured mode", i, ct)
		}
		// The body is the event's data.
		var d schemas.HistoryData
		if err := json.Unmarshal(m.Data, &d); err != nil || d.Job != "J1" {
			t.Errorf("event %d: data %s: %v", i, m.Data, err)
		}
		// What the headers and body say is a valid CloudEvent for sdk-go.
		e := event.New()
		e.SetID(h.Get("ce-id"))
		e.SetSource(h.Get("ce-source"))
		e.SetType(h.Get("ce-type"))
		e.SetSubject(h.Get("ce-subject"))
		if err := e.SetData(h.Get("ce-datacontenttype"), m.Data); err != nil || e.Validate() != nil {
			t.Errorf("event %d is not a valid CloudEvent: %v %v", i, err, e.Validate())
		}
	}
	select {
	case m := <-got:
		t.Errorf("unexpected event %s %s (step.dispatched is not relayed by default)", m.Subject, m.Header.Get("ce-id"))
	case <-time.After(200 * time.Millisecond):
	}
	testsupport.Eventually(t, 5*time.Second, func() bool { return r.Stats().Published == 10 }, "published %d events, want 10 (5 per job)", r.Stats().Published)
}

func TestRelayTypesAndRestart(t *testing.T) {
	t.Parallel()
	w := setup(t)
	nc := w.srv.Conn(t)
	got := make(chan *nats.Msg, 64)
	sub, err := nc.ChanSubscribe("waymark.events.>", got)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = nc.Flush()
	newRelay := func() *notify.Relay {
		r, err := notify.NewRelay(notify.RelayConfig{Store: w.srv.Store(t, kv.Config{}), Types: []string{"job.completed", "dev.waymark.step.dispatched"}, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	stop := w.run(newRelay().Run)
	w.waitConsumer("waymark-events-out")
	w.aJob("J1")
	ids := func(n int) []string {
		t.Helper()
		var out []string
		for range n {
			select {
			case m := <-got:
				out = append(out, m.Subject+" "+m.Header.Get("ce-id"))
			case <-time.After(10 * time.Second):
				t.Fatalf("got %v, want %d events", out, n)
			}
		}
		return out
	}
	if g := ids(2); !slices.Equal(g, []string{"waymark.events.step.dispatched.J1 J1/1/1", "waymark.events.job.completed.J1 J1/4/0"}) {
		t.Errorf("got %v", g)
	}
	// Stopped, the relay's durable consumer keeps its place: what is
	// written meanwhile goes out when an engine runs the relay again.
	stop()
	w.aJob("J2")
	w.run(newRelay().Run)
	if g := ids(2); !slices.Equal(g, []string{"waymark.events.step.dispatched.J2 J2/1/1", "waymark.events.job.completed.J2 J2/4/0"}) {
		t.Errorf("after restart got %v", g)
	}
}

// TestRelaySkipsWhatIsNotABatch: a history message that is not a
// CloudEvents batch is counted and ended, and the events after it go out.
func TestRelaySkipsWhatIsNotABatch(t *testing.T) {
	t.Parallel()
	w := setup(t)
	nc := w.srv.Conn(t)
	got := make(chan *nats.Msg, 8)
	sub, err := nc.ChanSubscribe("waymark.events.>", got)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = nc.Flush()
	r, err := notify.NewRelay(notify.RelayConfig{Store: w.store, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	w.run(r.Run)
	w.waitConsumer("waymark-events-out")
	for _, body := range []string{`{"type":"dev.waymark.job.completed"}`, `["dev.waymark.job.completed", 1]`} {
		if _, err := w.store.JS.Publish(context.Background(), w.store.Names.HistorySubject("J0"), []byte(body)); err != nil {
			t.Fatal(err)
		}
	}
	w.publishTransition("J1", 1, schemas.Event{Type: schemas.EventJobCompleted})
	select {
	case m := <-got:
		if m.Header.Get("ce-id") != "J1/1/0" {
			t.Errorf("got %s %v", m.Subject, m.Header)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the event after the bad messages never came")
	}
	testsupport.Eventually(t, 5*time.Second, func() bool { return r.Stats().Errors == 2 }, "errors %d, want 2", r.Stats().Errors)
}

// request is one request a test endpoint received.
type request struct {
	header http.Header
	body   []byte
}

// endpoint is an HTTP test server that answers with answer(n, r), n the
// number of requests it had for the same webhook-id before, and records
// every request.
type endpoint struct {
	*httptest.Server
	mu   sync.Mutex
	reqs []request
	seen map[string]int
}

func newEndpoint(t *testing.T, answer func(n int, r *http.Request) int) *endpoint {
	e := &endpoint{seen: map[string]int{}}
	e.Server = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		id := r.Header.Get("webhook-id")
		e.mu.Lock()
		n := e.seen[id]
		e.seen[id]++
		e.reqs = append(e.reqs, request{r.Header.Clone(), body})
		e.mu.Unlock()
		rw.WriteHeader(answer(n, r))
	}))
	t.Cleanup(e.Close)
	return e
}

func (e *endpoint) requests() []request {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.reqs)
}

func (e *endpoint) ids() []string {
	var out []string
	for _, r := range e.requests() {
		out = append(out, r.header.Get("webhook-id"))
	}
	return out
}

func ok(int, *http.Request) int { return http.StatusOK }

func (w *world) sink(cfg notify.SinkConfig) *notify.Sink {
	w.t.Helper()
	if cfg.Store == nil {
		cfg.Store = w.store
	}
	if cfg.Secret == "" {
		cfg.Secret = testSecret
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 20 * time.Millisecond
	}
	s, err := notify.NewSink(cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	return s
}

func TestSinkDeliversSignedLifecycleEvents(t *testing.T) {
	t.Parallel()
	w := setup(t)
	ep := newEndpoint(t, ok)
	s := w.sink(notify.SinkConfig{Name: "ops", URL: ep.URL + "/hook?token=abc"})
	w.run(s.Run)
	w.waitConsumer("waymark-sink-ops")
	w.aJob("J1")
	want := []string{"J1/1/0", "J1/2/0", "J1/3/0", "J1/effect/7", "J1/4/0"}
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(ep.requests()) >= len(want) }, "endpoint got %v, want %v", ep.ids(), want)
	if got := sorted(ep.ids()); !slices.Equal(got, sorted(want)) {
		t.Fatalf("webhook ids %v, want %v", got, want)
	}
	good, _ := standardwebhooks.NewWebhook(testSecret)
	wrong, _ := standardwebhooks.NewWebhook("whsec_" + base64.StdEncoding.EncodeToString([]byte("another secret of 24+ bytes")))
	for _, r := range ep.requests() {
		id := r.header.Get("webhook-id")
		if err := good.Verify(r.body, r.header); err != nil {
			t.Errorf("%s: signature does not verify with the secret: %v", id, err)
		}
		if err := wrong.Verify(r.body, r.header); !errors.Is(err, standardwebhooks.ErrNoMatchingSignature) {
			t.Errorf("%s: a wrong secret verifies (%v)", id, err)
		}
		tampered := append([]byte(nil), r.body...)
		tampered[len(tampered)-2] = ' '
		if err := good.Verify(tampered, r.header); err == nil {
			t.Errorf("%s: a changed body verifies", id)
		}
		if ct := r.header.Get("Content-Type"); ct != "application/cloudevents+json" {
			t.Errorf("%s: Content-Type %q, want structured mode", id, ct)
		}
		var e event.Event
		if err := format.JSON.Unmarshal(r.body, &e); err != nil || e.Validate() != nil {
			t.Errorf("%s: body is not a valid structured CloudEvent: %v %s", id, err, r.body)
		}
		if e.ID() != id || e.Subject() != "J1" {
			t.Errorf("body's event %s (subject %s), webhook-id %s", e.ID(), e.Subject(), id)
		}
	}
	if st := s.Stats(); st.Delivered != 5 || st.Retried+st.Failed+st.GivenUp != 0 {
		t.Errorf("stats %+v, want 5 delivered and nothing else", st)
	}
}

func TestSinkRetriesWithTheSameID(t *testing.T) {
	t.Parallel()
	w := setup(t)
	ep := newEndpoint(t, func(n int, _ *http.Request) int {
		if n < 2 {
			return http.StatusInternalServerError
		}
		return http.StatusOK
	})
	s := w.sink(notify.SinkConfig{Name: "flaky", URL: ep.URL, Types: []string{"job.completed"}})
	w.run(s.Run)
	w.waitConsumer("waymark-sink-flaky")
	w.publishTransition("J1", 1, schemas.Event{Type: schemas.EventJobStarted}, schemas.Event{Type: schemas.EventJobCompleted})
	testsupport.Eventually(t, 10*time.Second, func() bool { return s.Stats().Delivered == 1 }, "never delivered: %+v, %v", s.Stats(), ep.ids())
	if got := ep.ids(); !slices.Equal(got, []string{"J1/1/1", "J1/1/1", "J1/1/1"}) {
		t.Errorf("requests %v, want the one event three times with one id", got)
	}
	if st := s.Stats(); st.Retried != 2 || st.Failed != 0 || st.GivenUp != 0 {
		t.Errorf("stats %+v, want 2 retries", st)
	}
}

// TestSinkPermanentFailuresAndGivingUp: a 404 is not tried again and the
// events after it still go; an endpoint that keeps failing is given up
// after MaxAttempts; both end the history message for the sink.
func TestSinkPermanentFailuresAndGivingUp(t *testing.T) {
	t.Parallel()
	w := setup(t)
	refuse := newEndpoint(t, func(_ int, r *http.Request) int {
		if strings.Contains(r.Header.Get("webhook-id"), "/1/") {
			return http.StatusNotFound
		}
		return http.StatusOK
	})
	down := newEndpoint(t, func(int, *http.Request) int { return http.StatusServiceUnavailable })
	s1 := w.sink(notify.SinkConfig{Name: "refuse", URL: refuse.URL})
	s2 := w.sink(notify.SinkConfig{Name: "down", URL: down.URL, MaxAttempts: 3, Types: []string{"job.started"}})
	w.run(s1.Run)
	w.run(s2.Run)
	w.waitConsumer("waymark-sink-refuse")
	w.waitConsumer("waymark-sink-down")
	w.publishTransition("J1", 1, schemas.Event{Type: schemas.EventJobStarted})
	w.publishTransition("J1", 2, schemas.Event{Type: schemas.EventJobCompleted})
	testsupport.Eventually(t, 10*time.Second, func() bool { return s1.Stats().Delivered == 1 && s2.Stats().GivenUp == 1 },
		"refuse %+v %v, down %+v %v", s1.Stats(), refuse.ids(), s2.Stats(), down.ids())
	if got := sorted(refuse.ids()); !slices.Equal(got, []string{"J1/1/0", "J1/2/0"}) {
		t.Errorf("refusing endpoint got %v, want each event once", got)
	}
	if st := s1.Stats(); st.Failed != 1 || st.Retried != 0 {
		t.Errorf("refuse stats %+v, want 1 failed, no retry", st)
	}
	if got := down.ids(); !slices.Equal(got, []string{"J1/1/0", "J1/1/0", "J1/1/0"}) {
		t.Errorf("failing endpoint got %v, want 3 attempts", got)
	}
	for _, name := range []string{"waymark-sink-refuse", "waymark-sink-down"} {
		testsupport.Eventually(t, 5*time.Second, func() bool {
			c, err := w.store.JS.Consumer(context.Background(), w.store.Names.HistoryStream, name)
			if err != nil {
				return false
			}
			info, err := c.Info(context.Background())
			return err == nil && info.NumAckPending == 0 && info.NumPending == 0 && info.NumRedelivered == 0
		}, "consumer %s still holds messages", name)
	}
}

// TestSinkDoesNotFollowRedirects: a 3xx is a permanent failure; the
// signed body never goes to where it points.
func TestSinkDoesNotFollowRedirects(t *testing.T) {
	t.Parallel()
	w := setup(t)
	elsewhere := newEndpoint(t, ok)
	redirect := newEndpoint(t, func(int, *http.Request) int { return http.StatusOK })
	redirect.Config.Handler = http.RedirectHandler(elsewhere.URL, http.StatusTemporaryRedirect)
	s := w.sink(notify.SinkConfig{Name: "moved", URL: redirect.URL, Types: []string{"job.started"}})
	w.run(s.Run)
	w.waitConsumer("waymark-sink-moved")
	w.publishTransition("J1", 1, schemas.Event{Type: schemas.EventJobStarted})
	testsupport.Eventually(t, 10*time.Second, func() bool { return s.Stats().Failed == 1 }, "stats %+v", s.Stats())
	if n := len(elsewhere.requests()); n != 0 {
		t.Errorf("the redirect was followed: %d requests elsewhere", n)
	}
}

// TestSlowSinkDelaysOnlyItself: a sink whose endpoint hangs does not hold
// up another sink's deliveries.
func TestSlowSinkDelaysOnlyItself(t *testing.T) {
	t.Parallel()
	w := setup(t)
	release := make(chan struct{})
	slow := newEndpoint(t, func(int, *http.Request) int { <-release; return http.StatusOK })
	defer close(release)
	fast := newEndpoint(t, ok)
	w.run(w.sink(notify.SinkConfig{Name: "slow", URL: slow.URL, Concurrency: 1}).Run)
	w.run(w.sink(notify.SinkConfig{Name: "fast", URL: fast.URL}).Run)
	w.waitConsumer("waymark-sink-slow")
	w.waitConsumer("waymark-sink-fast")
	w.aJob("J1")
	testsupport.Eventually(t, 10*time.Second, func() bool { return len(fast.requests()) == 5 }, "fast sink got %v", fast.ids())
	if n := len(slow.requests()); n != 1 {
		t.Errorf("slow sink got %d requests while hanging, want 1", n)
	}
}

// TestSinkRedeliversAfterAnEngineDies: the engine holding a delivery dies
// (its connection gone, no acknowledgement, no nak); another engine's sink
// on the same consumer gets the message after the ack wait and sends the
// event again with the same id; every event arrives.
func TestSinkRedeliversAfterAnEngineDies(t *testing.T) {
	t.Parallel()
	w := setup(t)
	hold := make(chan struct{})
	var once sync.Once
	ep := newEndpoint(t, func(n int, r *http.Request) int {
		if r.Header.Get("webhook-id") == "J1/2/0" && n == 0 {
			once.Do(func() { close(hold) })
			<-r.Context().Done() // hang until the dying engine's request is cut
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	})
	ackWait := 2 * time.Second
	nc1 := w.srv.Conn(t)
	first := w.sink(notify.SinkConfig{Store: testsupport.OpenStore(t, nc1, kv.Config{}), Name: "ops", URL: ep.URL, Timeout: time.Second, AckWait: ackWait, Concurrency: 1})
	stopFirst := w.run(first.Run)
	w.waitConsumer("waymark-sink-ops")
	w.aJob("J1")
	select {
	case <-hold:
	case <-time.After(10 * time.Second):
		t.Fatalf("the second event never reached the endpoint: %v", ep.ids())
	}
	nc1.Close() // the engine dies: nothing more reaches the server from it
	stopFirst()
	second := w.sink(notify.SinkConfig{Name: "ops", URL: ep.URL})
	w.run(second.Run)
	want := []string{"J1/1/0", "J1/2/0", "J1/3/0", "J1/effect/7", "J1/4/0"}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		got := ep.ids()
		for _, id := range want {
			if !slices.Contains(got, id) {
				return false
			}
		}
		return second.Stats().Delivered >= 4
	}, "after the restart the endpoint got %v, want all of %v", lazyIDs{ep}, want)
	n := 0
	for _, id := range ep.ids() {
		if id == "J1/2/0" {
			n++
		}
	}
	if n < 2 {
		t.Errorf("J1/2/0 sent %d times, want again after the engine died (same id)", n)
	}
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

type lazyIDs struct{ e *endpoint }

func (l lazyIDs) String() string { return strings.Join(l.e.ids(), " ") }

func TestSinkConfigErrors(t *testing.T) {
	t.Parallel()
	st := &kv.Store{}
	for name, tc := range map[string]struct {
		cfg  notify.SinkConfig
		want string
	}{
		"bad name":      {notify.SinkConfig{Store: st, Name: "Ops!", URL: "http://x", Secret: testSecret}, `webhook "Ops!": name`},
		"no scheme":     {notify.SinkConfig{Store: st, Name: "ops", URL: "x.example/hook", Secret: testSecret}, `want http:// or https://`},
		"ftp":           {notify.SinkConfig{Store: st, Name: "ops", URL: "ftp://u:pw@x/hook?token=t", Secret: testSecret}, `url "ftp://x/hook"`},
		"no secret":     {notify.SinkConfig{Store: st, Name: "ops", URL: "http://x"}, "secret: want whsec_"},
		"short secret":  {notify.SinkConfig{Store: st, Name: "ops", URL: "http://x", Secret: "whsec_c2hvcnQ="}, "5 bytes"},
		"not base64":    {notify.SinkConfig{Store: st, Name: "ops", URL: "http://x", Secret: "whsec_!!notbase64!!"}, "not standard base64"},
		"bad type":      {notify.SinkConfig{Store: st, Name: "ops", URL: "http://x", Secret: testSecret, Types: []string{"job.done"}}, `event type "job.done"`},
		"ack wait":      {notify.SinkConfig{Store: st, Name: "ops", URL: "http://x", Secret: testSecret, Timeout: time.Minute, AckWait: time.Second}, "ack wait 1s"},
		"max attempts":  {notify.SinkConfig{Store: st, Name: "ops", URL: "http://x", Secret: testSecret, MaxAttempts: -2}, "max attempts -2"},
		"no store":      {notify.SinkConfig{Name: "ops", URL: "http://x", Secret: testSecret}, "no Store"},
		"backoff order": {notify.SinkConfig{Store: st, Name: "ops", URL: "http://x", Secret: testSecret, MinBackoff: time.Hour, MaxBackoff: time.Second}, "min backoff at most max"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := notify.NewSink(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to say %q", err, tc.want)
			}
			for _, leak := range []string{"!!notbase64!!", "c2hvcnQ=", strings.TrimPrefix(testSecret, "whsec_"), "pw", "token=t"} {
				if strings.Contains(err.Error(), leak) {
					t.Errorf("error %q shows a secret or credential", err)
				}
			}
		})
	}
}

func TestParseTypes(t *testing.T) {
	t.Parallel()
	got, err := notify.ParseTypes(nil)
	if err != nil || !slices.Equal(got, notify.DefaultTypes) {
		t.Errorf("default: %v %v", got, err)
	}
	got, err = notify.ParseTypes([]string{"job.failed", " dev.waymark.step.failed "})
	if err != nil || !slices.Equal(got, []string{schemas.EventJobFailed, schemas.EventStepFailed}) {
		t.Errorf("got %v %v", got, err)
	}
	if got, err := notify.ParseTypes([]string{"all"}); err != nil || len(got) != len(notify.KnownTypes) {
		t.Errorf("all: %v %v", got, err)
	}
	if notify.Subject("waymark", schemas.EventJobCompleted, "J1") != "waymark.events.job.completed.J1" {
		t.Error(notify.Subject("waymark", schemas.EventJobCompleted, "J1"))
	}
}
