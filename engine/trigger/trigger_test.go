package trigger_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/goccy/go-yaml"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/api"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/engine/trigger"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
	"github.com/waymark-dev/waymark/steps"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The embedded server's accept loop and stream loops end after the
		// test's cleanup returns.
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
	)
}

// clock is an engine clock the test moves forward (for retention sweeps).
type clock struct{ skew atomic.Int64 }

func (c *clock) Now() time.Time      { return time.Now().Add(time.Duration(c.skew.Load())) }
func (c *clock) add(d time.Duration) { c.skew.Add(int64(d)) }
func (c *clock) reset()              { c.skew.Store(0) }

// bundle is one test's world: a server, an engine and a worker running,
// the intake and the HTTP API in front of it.
type bundle struct {
	srv    *testsupport.Server
	store  *kv.Store
	client *client.Client
	engine *engine.Engine
	intake *trigger.Intake
	http   *httptest.Server
	clock  *clock
	stop   func()
}

type options struct {
	kv kv.Config
}

func setup(t *testing.T, o options) *bundle {
	t.Helper()
	b := &bundle{srv: testsupport.StartServer(t, testsupport.ServerOptions{}), clock: &clock{}}
	b.start(t, o)
	def, err := schemas.Load("testdata/orders.yaml", schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.store.Definitions.Put(context.Background(), def); err != nil {
		t.Fatal(err)
	}
	return b
}

// start brings up the engine, a worker, the intake and the HTTP API on
// b.srv (again after a restart).
func (b *bundle) start(t *testing.T, o options) {
	t.Helper()
	b.store = b.srv.Store(t, o.kv)
	b.client = client.New(b.store)
	var err error
	if b.engine, err = engine.New(engine.Config{Store: b.store, ReconcileInterval: -1, Now: b.clock.Now}); err != nil {
		t.Fatal(err)
	}
	w, err := steps.NewWorker(steps.WorkerConfig{Store: b.store})
	if err != nil {
		t.Fatal(err)
	}
	if b.intake, err = trigger.New(trigger.Config{Store: b.store, Client: b.client}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{b.engine.Run, w.Run} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(ctx); err != nil {
				t.Errorf("run: %v", err)
			}
		}()
	}
	b.http = httptest.NewServer((&api.API{Client: b.client, Events: b.intake}).Handler())
	var once sync.Once
	b.stop = func() { once.Do(func() { b.http.Close(); cancel(); wg.Wait() }) }
	t.Cleanup(b.stop)
}

// answer is a decoded intake answer, success or error.
type answer struct {
	status int
	trigger.Answer
	Results []trigger.Result `json:"results"`
	Error   *trigger.Refusal `json:"error"`
}

func (b *bundle) post(t *testing.T, headers map[string]string, body string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.http.URL+"/v1/events", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode}
	if err := json.Unmarshal(data, &a); err != nil {
		t.Fatalf("answer %d is not JSON: %v\n%s", resp.StatusCode, err, data)
	}
	return a
}

// binary returns the headers of a binary-mode order event.
func binary(id, source string) map[string]string {
	return map[string]string{"ce-specversion": "1.0", "ce-id": id, "ce-source": source,
		"ce-type": "com.example.order.created", "content-type": "application/json"}
}

const orderData = `{"order_id": "o-1", "amount": 10}`

// decodeJSON decodes an HTTP answer's body into v.
func decodeJSON(resp *http.Response, v any) error { return json.NewDecoder(resp.Body).Decode(v) }

// waitCompleted waits for job id to complete and returns its record.
func (b *bundle) waitCompleted(t *testing.T, id string) *client.JobView {
	t.Helper()
	var v *client.JobView
	testsupport.Eventually(t, 20*time.Second, func() bool {
		var err error
		v, err = b.client.Job(context.Background(), id)
		return err == nil && v.Status == schemas.JobCompleted
	}, "job %s never completed: %+v", id, v)
	return v
}

// inputOf is a completed orders job's input: its state without the
// output of its one step (saved as took).
func inputOf(v *client.JobView) map[string]any {
	var m map[string]any
	_ = json.Unmarshal(v.State, &m)
	delete(m, "took")
	delete(m, "greet")
	return m
}

// wantJobs waits until the job index lists n jobs of workflow orders (it
// follows the checkpoints: a job that just completed moves from its active
// entry to its ended one) and fails the test if it never does.
func (b *bundle) wantJobs(t *testing.T, n int) {
	t.Helper()
	var got []string
	testsupport.Eventually(t, 20*time.Second, func() bool { got = b.jobs(t); return len(got) == n }, "jobs %v, want %d", lazy{&got}, n)
}

// lazy prints a slice as it is when the message is formatted.
type lazy struct{ v *[]string }

func (l lazy) String() string { return fmt.Sprint(*l.v) }

// jobs lists the ids of workflow orders' jobs in the index.
func (b *bundle) jobs(t *testing.T) []string {
	t.Helper()
	page, err := b.client.List(context.Background(), client.ListFilter{Workflow: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, j := range page.Jobs {
		ids = append(ids, j.ID)
	}
	slices.Sort(ids)
	return ids
}

// conformanceCase is one case of testdata/events.yaml.
type conformanceCase struct {
	Name    string            `yaml:"name"`
	Headers map[string]string `yaml:"headers"`
	Body    string            `yaml:"body"`
	Want    struct {
		Status    int            `yaml:"status"`
		Code      string         `yaml:"code"`
		Attribute string         `yaml:"attribute"`
		Triggers  []string       `yaml:"triggers"`
		Input     map[string]any `yaml:"input"`
		Pointers  []string       `yaml:"pointers"`
	} `yaml:"want"`
}

// TestConformance posts every case of testdata/events.yaml (binary and
// structured mode, and the invalid cases of the CloudEvents conformance
// suite's shape) and checks the status, the code and attribute named, and
// for accepted events the jobs started with their mapped input.
func TestConformance(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("testdata/events.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var cases []conformanceCase
	if err := yaml.Unmarshal(data, &cases); err != nil {
		t.Fatal(err)
	}
	if len(cases) < 20 {
		t.Fatalf("only %d cases read", len(cases))
	}
	b := setup(t, options{})
	var wantStats trigger.Stats
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			a := b.post(t, c.Headers, c.Body)
			if a.status != c.Want.Status {
				t.Fatalf("status %d, want %d: %+v", a.status, c.Want.Status, a.Error)
			}
			switch {
			case a.status == http.StatusAccepted:
				wantStats.Accepted++
				var got []string
				for _, j := range a.Jobs {
					got = append(got, j.Trigger)
					if j.Duplicate {
						t.Errorf("job %s: duplicate on the first delivery", j.JobID)
					}
					if want := schemas.TriggerJobID(j.Workflow, j.Trigger, a.Event.Source, a.Event.ID); j.JobID != want {
						t.Errorf("job id %s, want %s", j.JobID, want)
					}
					v := b.waitCompleted(t, j.JobID)
					input := inputOf(v)
					wantIn, _ := json.Marshal(c.Want.Input)
					var want map[string]any
					_ = json.Unmarshal(wantIn, &want)
					if fmt.Sprint(input) != fmt.Sprint(want) {
						t.Errorf("job input %v, want %v", input, want)
					}
				}
				if !slices.Equal(got, c.Want.Triggers) {
					t.Errorf("triggers %v, want %v", got, c.Want.Triggers)
				}
			default:
				if a.Error == nil || string(a.Error.Code) != c.Want.Code {
					t.Fatalf("error %+v, want code %s", a.Error, c.Want.Code)
				}
				if c.Want.Attribute != "" && !strings.Contains(a.Error.Attribute, c.Want.Attribute) {
					t.Errorf("attribute %q, want %q (message %q)", a.Error.Attribute, c.Want.Attribute, a.Error.Message)
				}
				if c.Want.Attribute != "" && !strings.Contains(a.Error.Message, c.Want.Attribute) {
					t.Errorf("message %q does not name %s", a.Error.Message, c.Want.Attribute)
				}
				var ptrs []string
				for _, p := range a.Error.Problems {
					ptrs = append(ptrs, p.Path)
				}
				for _, p := range c.Want.Pointers {
					if !slices.Contains(ptrs, p) {
						t.Errorf("problems at %v, want one at %s", ptrs, p)
					}
				}
				switch c.Want.Code {
				case "no_trigger":
					wantStats.Unmatched++
					if len(a.Error.Triggers) != 2 || !strings.Contains(a.Error.Message, "orders/created") {
						t.Errorf("a no_trigger answer names the live triggers: %+v", a.Error)
					}
				case "input_invalid":
					wantStats.Refused++
				default:
					wantStats.Invalid++
				}
			}
		})
	}
	if got := b.intake.Stats(); got != wantStats {
		t.Errorf("stats %+v, want %+v", got, wantStats)
	}
	// Refused and unmatched events leave no record and no job.
	if _, err := b.store.Events.Get(context.Background(), "/shop/eu", "bad-10"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("a refused event was recorded: %v", err)
	}
}

// TestSameEventTwice: the same CloudEvent posted twice starts one job and
// both answers carry its id; the second says duplicate. The same event in
// structured mode is the same event; the same id from another source is a
// new one.
func TestSameEventTwice(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	first := b.post(t, binary("twice-1", "/shop/eu"), orderData)
	second := b.post(t, binary("twice-1", "/shop/eu"), orderData)
	for i, a := range []answer{first, second} {
		if a.status != http.StatusAccepted || len(a.Jobs) != 1 {
			t.Fatalf("answer %d: %d %+v %+v", i+1, a.status, a.Jobs, a.Error)
		}
	}
	if first.Jobs[0].JobID != second.Jobs[0].JobID || first.Jobs[0].Duplicate || !second.Jobs[0].Duplicate {
		t.Fatalf("answers %+v and %+v: want one job, the second a duplicate", first.Jobs, second.Jobs)
	}
	if first.Event != (trigger.EventRef{Source: "/shop/eu", ID: "twice-1"}) {
		t.Errorf("event %+v", first.Event)
	}
	structured := b.post(t, map[string]string{"content-type": "application/cloudevents+json"},
		`{"specversion":"1.0","id":"twice-1","source":"/shop/eu","type":"com.example.order.created","data":{"order_id":"o-1","amount":10}}`)
	if structured.status != http.StatusAccepted || structured.Jobs[0].JobID != first.Jobs[0].JobID || !structured.Jobs[0].Duplicate {
		t.Fatalf("structured delivery of the same event: %d %+v", structured.status, structured.Jobs)
	}
	other := b.post(t, binary("twice-1", "/shop/us"), orderData)
	if other.status != http.StatusAccepted || other.Jobs[0].JobID == first.Jobs[0].JobID || other.Jobs[0].Duplicate {
		t.Fatalf("same id from another source: %d %+v, want a new job", other.status, other.Jobs)
	}
	b.waitCompleted(t, first.Jobs[0].JobID)
	b.waitCompleted(t, other.Jobs[0].JobID)
	b.wantJobs(t, 2)
	if s := b.intake.Stats(); s.Accepted != 2 || s.Duplicate != 2 {
		t.Errorf("stats %+v, want 2 accepted and 2 duplicates", s)
	}
}

// TestDedupOutlivesJobAndRestart: the same event delivered again after its
// job finished and was swept, and after the server and engine restarted,
// answers the same job and starts nothing.
func TestDedupOutlivesJobAndRestart(t *testing.T) {
	t.Parallel()
	o := options{kv: kv.Config{JobRetention: time.Second}}
	b := setup(t, o)
	first := b.post(t, binary("late-1", "/shop/eu"), orderData)
	if first.status != http.StatusAccepted {
		t.Fatalf("first: %d %+v", first.status, first.Error)
	}
	job := first.Jobs[0].JobID
	b.waitCompleted(t, job)
	ctx := context.Background()
	// Sweep the finished job: a day later by the engine's clock.
	testsupport.Eventually(t, 20*time.Second, func() bool {
		b.clock.add(24 * time.Hour)
		if err := b.engine.SweepJobs(ctx); err != nil {
			t.Fatalf("sweep: %v", err)
		}
		_, err := b.client.Job(ctx, job)
		return errors.Is(err, schemas.ErrNotFound)
	}, "job %s was never swept", job)
	b.clock.reset()
	again := b.post(t, binary("late-1", "/shop/eu"), orderData)
	if again.status != http.StatusAccepted || again.Jobs[0].JobID != job || !again.Jobs[0].Duplicate {
		t.Fatalf("after the sweep: %d %+v, want job %s as a duplicate", again.status, again.Jobs, job)
	}
	if _, err := b.client.Job(ctx, job); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("the duplicate started the swept job again: %v", err)
	}

	// Restart the server (its files kept) and the engine.
	b.stop()
	b.srv.Restart(t)
	b.start(t, o)
	after := b.post(t, binary("late-1", "/shop/eu"), orderData)
	if after.status != http.StatusAccepted || after.Jobs[0].JobID != job || !after.Jobs[0].Duplicate {
		t.Fatalf("after a restart: %d %+v, want job %s as a duplicate", after.status, after.Jobs, job)
	}
	b.wantJobs(t, 0)
}

// TestCrashBeforeRecord: a delivery that started its job and died before
// recording the event leaves a job whose id the next delivery derives
// again: it attaches to it, records the event and starts nothing more.
func TestCrashBeforeRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	ctx := context.Background()
	def, err := b.store.Definitions.Latest(ctx, "orders")
	if err != nil {
		t.Fatal(err)
	}
	id := schemas.TriggerJobID("orders", "created", "/shop/eu", "crash-1")
	// What the first delivery did before it died: the job, no record.
	if _, err := b.client.Start(ctx, def, json.RawMessage(`{"order_id":"o-1","amount":10,"customer":"unknown"}`), client.StartOptions{JobID: id}); err != nil {
		t.Fatal(err)
	}
	a := b.post(t, binary("crash-1", "/shop/eu"), orderData)
	if a.status != http.StatusAccepted || a.Jobs[0].JobID != id || !a.Jobs[0].Duplicate {
		t.Fatalf("redelivery: %d %+v, want job %s as a duplicate", a.status, a.Jobs, id)
	}
	rec, err := b.store.Events.Get(ctx, "/shop/eu", "crash-1")
	if err != nil || len(rec.Jobs) != 1 || rec.Jobs[0].JobID != id {
		t.Fatalf("record %+v, %v", rec, err)
	}
	b.wantJobs(t, 1)
}

// TestConcurrentDeliveries: the same event delivered by many requests at
// once starts one job; every answer names it.
func TestConcurrentDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	const n = 8
	ids := make([]string, n)
	var fresh atomic.Int32
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := b.post(t, binary("race-1", "/shop/eu"), orderData)
			if a.status != http.StatusAccepted || len(a.Jobs) != 1 {
				t.Errorf("delivery %d: %d %+v", i, a.status, a.Error)
				return
			}
			ids[i] = a.Jobs[0].JobID
			if !a.Jobs[0].Duplicate {
				fresh.Add(1)
			}
		}()
	}
	wg.Wait()
	for _, id := range ids[1:] {
		if id != ids[0] {
			t.Fatalf("answers name jobs %v, want one", ids)
		}
	}
	b.wantJobs(t, 1)
	if fresh.Load() != 1 {
		t.Errorf("%d answers said they started the job, want exactly one (the others duplicates)", fresh.Load())
	}
}

// TestTextMustBeUnicode: an event whose data or attributes are not Unicode
// text is refused, naming the attribute, and starts nothing (decoding
// would swap the bad bytes for U+FFFD and start a job with other text).
func TestTextMustBeUnicode(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	for _, tc := range []struct {
		name    string
		headers map[string]string
		body    string
		attr    string
	}{
		{"data not UTF-8", binary("text-1", "/shop/eu"), "{\"order_id\": \"\xff\xfe\", \"amount\": 1}", "data"},
		{"data with a lone surrogate", binary("text-2", "/shop/eu"), `{"order_id": "\ud800", "amount": 1}`, "data"},
		{"id not UTF-8", binary("text-\xfe", "/shop/eu"), orderData, "id"},
		{"id too long", binary(strings.Repeat("x", trigger.MaxAttributeBytes+1), "/shop/eu"), orderData, "id"},
	} {
		a := b.post(t, tc.headers, tc.body)
		if a.status != http.StatusBadRequest || a.Error == nil || a.Error.Code != schemas.CodeEventInvalid || a.Error.Attribute != tc.attr {
			t.Errorf("%s: %d %+v, want 400 event_invalid naming %s", tc.name, a.status, a.Error, tc.attr)
		}
	}
	b.wantJobs(t, 0)
}

// TestBatch: a batch-mode request starts each event's jobs and answers one
// result per event; an unmatched event in it is answered 207 with its
// error; an invalid event refuses the batch before anything starts.
func TestBatch(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	batch := `[
	 {"specversion":"1.0","id":"b-1","source":"/shop/eu","type":"com.example.order.created","data":{"order_id":"o-1","amount":1}},
	 {"specversion":"1.0","id":"b-2","source":"/shop/eu","type":"com.example.order.created","data":{"order_id":"o-2","amount":2}}]`
	hdr := map[string]string{"content-type": "application/cloudevents-batch+json"}
	a := b.post(t, hdr, batch)
	if a.status != http.StatusAccepted || len(a.Results) != 2 || len(a.Results[0].Jobs) != 1 || len(a.Results[1].Jobs) != 1 {
		t.Fatalf("batch: %d %+v", a.status, a.Results)
	}
	mixed := b.post(t, hdr, `[
	 {"specversion":"1.0","id":"b-1","source":"/shop/eu","type":"com.example.order.created","data":{"order_id":"o-1","amount":1}},
	 {"specversion":"1.0","id":"b-3","source":"/elsewhere","type":"com.example.unknown"}]`)
	if mixed.status != http.StatusMultiStatus || !mixed.Results[0].Jobs[0].Duplicate || mixed.Results[1].Error == nil || mixed.Results[1].Error.Code != schemas.CodeNoTrigger {
		t.Fatalf("mixed batch: %d %+v", mixed.status, mixed.Results)
	}
	bad := b.post(t, hdr, `[
	 {"specversion":"1.0","id":"b-4","source":"/shop/eu","type":"com.example.order.created","data":{"order_id":"o-4","amount":4}},
	 {"specversion":"1.0","source":"/shop/eu","type":"com.example.order.created"}]`)
	if bad.status != http.StatusBadRequest || bad.Error.Attribute != "id" || !strings.Contains(bad.Error.Message, "batch event 1") {
		t.Fatalf("invalid batch: %d %+v", bad.status, bad.Error)
	}
	if _, err := b.store.Events.Get(context.Background(), "/shop/eu", "b-4"); !errors.Is(err, schemas.ErrNotFound) {
		t.Errorf("an event of a refused batch was taken: %v", err)
	}
}

// TestNATS: the intake answers NATS requests on <prefix>.trigger.> with
// the HTTP answer's JSON: the same event sent twice names one job, an
// invalid one is refused naming the attribute, and an unmatched one says
// no_trigger.
func TestNATS(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	sub, err := b.intake.Subscribe(b.srv.Conn(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	nc := b.srv.Conn(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ev := event.New()
	ev.SetID("nats-1")
	ev.SetSource("/shop/eu")
	ev.SetType("com.example.order.created")
	ev.SetSubject("carol o'brien €") // sent percent-encoded, read back as it was
	if err := ev.SetData("application/json", map[string]any{"order_id": "o-9", "amount": 9}); err != nil {
		t.Fatal(err)
	}
	first, err := trigger.Send(ctx, nc, "waymark", &ev)
	if err != nil {
		t.Fatal(err)
	}
	second, err := trigger.Send(ctx, nc, "waymark", &ev)
	if err != nil {
		t.Fatal(err)
	}
	if len(first.Jobs) != 1 || first.Jobs[0].JobID != second.Jobs[0].JobID || first.Jobs[0].Duplicate || !second.Jobs[0].Duplicate {
		t.Fatalf("answers %+v and %+v", first, second)
	}
	v := b.waitCompleted(t, first.Jobs[0].JobID)
	if in := inputOf(v); in["customer"] != "carol o'brien €" {
		t.Errorf("input %v, want the subject as customer", in)
	}
	// The same event over HTTP is a duplicate too.
	if a := b.post(t, binary("nats-1", "/shop/eu"), orderData); !a.Jobs[0].Duplicate || a.Jobs[0].JobID != first.Jobs[0].JobID {
		t.Errorf("HTTP delivery after NATS: %+v", a.Jobs)
	}

	// Header values are percent-encoded (NATS protocol binding 3.1.3.2).
	enc := nats.NewMsg("waymark.trigger.orders")
	for k, v := range map[string]string{"ce-specversion": "1.0", "ce-id": "nats-3", "ce-source": "/shop/eu",
		"ce-type": "com.example.order.created", "ce-subject": "dave%20smith%E2%82%AC", "content-type": "application/json"} {
		enc.Header.Set(k, v)
	}
	enc.Data = []byte(orderData)
	encReply, err := nc.RequestMsgWithContext(ctx, enc)
	if err != nil {
		t.Fatal(err)
	}
	var encAnswer trigger.Answer
	if err := json.Unmarshal(encReply.Data, &encAnswer); err != nil || len(encAnswer.Jobs) != 1 {
		t.Fatalf("percent-encoded event: %s %v", encReply.Data, err)
	}
	if in := inputOf(b.waitCompleted(t, encAnswer.Jobs[0].JobID)); in["customer"] != "dave smith€" {
		t.Errorf("input %v, want the decoded subject as customer", in)
	}

	// An invalid event, sent by hand: no ce-id.
	m := nats.NewMsg("waymark.trigger.orders")
	m.Header.Set("ce-specversion", "1.0")
	m.Header.Set("ce-source", "/shop/eu")
	m.Header.Set("ce-type", "com.example.order.created")
	reply, err := nc.RequestMsgWithContext(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	var body struct{ Error trigger.Refusal }
	_ = json.Unmarshal(reply.Data, &body)
	if reply.Header.Get("Nats-Service-Error-Code") != "400" || body.Error.Attribute != "id" {
		t.Fatalf("invalid event over NATS: %v %s", reply.Header, reply.Data)
	}
	// A message that is no CloudEvent at all.
	reply, err = nc.RequestWithContext(ctx, "waymark.trigger.x", []byte("hello"))
	if err != nil {
		t.Fatal(err)
	}
	if code := reply.Header.Get("Nats-Service-Error-Code"); code != "400" {
		t.Fatalf("plain message: %s %s", code, reply.Data)
	}
	// Unmatched.
	un := event.New()
	un.SetID("nats-2")
	un.SetSource("/elsewhere")
	un.SetType("com.example.nothing")
	_, err = trigger.Send(ctx, nc, "waymark", &un)
	var ref *trigger.Refusal
	if !errors.As(err, &ref) || !errors.Is(err, schemas.ErrNoTrigger) || !strings.Contains(ref.Message, `type "com.example.nothing"`) {
		t.Fatalf("unmatched over NATS: %v", err)
	}
	if s := b.intake.Stats(); s.Unmatched != 1 || s.Invalid != 2 || s.Accepted != 2 || s.Duplicate != 2 {
		t.Errorf("stats %+v", s)
	}
}

// TestNewDefinitionIsLive: a workflow stored after the intake read its
// table takes events at once (an unmatched event reloads the table), and
// the triggers of its latest version are the live ones.
func TestNewDefinitionIsLive(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	ctx := context.Background()
	if a := b.post(t, map[string]string{"ce-specversion": "1.0", "ce-id": "n-1", "ce-source": "/crm", "ce-type": "com.example.signup"}, ""); a.status != http.StatusUnprocessableEntity {
		t.Fatalf("before: %d %+v", a.status, a.Error)
	}
	src := `
name: signup
version: 1
steps: [{id: greet, kind: noop}]
triggers:
  - {name: new, type: com.example.signup, input: '{"who": event.source}'}
`
	def, err := schemas.Parse("signup.yaml", []byte(src), schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.store.Definitions.Put(ctx, def); err != nil {
		t.Fatal(err)
	}
	a := b.post(t, map[string]string{"ce-specversion": "1.0", "ce-id": "n-2", "ce-source": "/crm", "ce-type": "com.example.signup"}, "")
	if a.status != http.StatusAccepted || a.Jobs[0].Workflow != "signup" {
		t.Fatalf("after storing: %d %+v %+v", a.status, a.Jobs, a.Error)
	}
	v := b.waitCompleted(t, a.Jobs[0].JobID)
	if in := inputOf(v); fmt.Sprint(in) != "map[who:/crm]" {
		t.Errorf("input %v", in)
	}
	// Version 2 drops the trigger: it is no longer live.
	def2, err := schemas.Parse("signup.yaml", []byte(strings.Replace(strings.Replace(src, "version: 1", "version: 2", 1), "triggers:\n  - {name: new, type: com.example.signup, input: '{\"who\": event.source}'}\n", "", 1)), schemas.LoadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.store.Definitions.Put(ctx, def2); err != nil {
		t.Fatal(err)
	}
	rules, err := b.intake.Triggers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rules {
		if r.Workflow == "signup" {
			t.Fatalf("trigger of an older version still live: %+v", r)
		}
	}
	resp, err := http.Get(b.http.URL + "/v1/triggers")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var listed struct{ Triggers []trigger.Rule }
	if err := json.NewDecoder(resp.Body).Decode(&listed); err != nil || len(listed.Triggers) != 2 {
		t.Fatalf("GET /v1/triggers: %v %+v", err, listed)
	}
}

// TestEventRetention: the events bucket's TTL is the configured retention
// (7 days by default), and an engine opening the layout with another one
// sets it.
func TestEventRetention(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	st := srv.Store(t, kv.Config{})
	ctx := context.Background()
	ttl := func() time.Duration {
		s, err := st.JS.Stream(ctx, "KV_waymark_events")
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.Config.MaxAge
	}
	if got := ttl(); got != 7*24*time.Hour {
		t.Fatalf("default retention %v, want 168h", got)
	}
	srv.Store(t, kv.Config{EventRetention: time.Hour}) // not an engine: kept
	if got := ttl(); got != 7*24*time.Hour {
		t.Fatalf("retention %v after a non-engine open, want it kept", got)
	}
	srv.Store(t, kv.Config{EventRetention: time.Hour, TuneConsumers: true})
	if got := ttl(); got != time.Hour {
		t.Fatalf("retention %v after an engine open, want 1h", got)
	}
	// Shorter than the bucket's 2m duplicate window: the window shrinks
	// with it (the server refuses a window over the max age).
	srv.Store(t, kv.Config{EventRetention: 30 * time.Second, TuneConsumers: true})
	if got := ttl(); got != 30*time.Second {
		t.Fatalf("retention %v after an engine open, want 30s", got)
	}
	if err := (kv.Config{EventRetention: time.Millisecond}).WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), "event retention") {
		t.Fatalf("a retention under 1s: %v", err)
	}
}

// BenchmarkIntake measures events accepted per second over HTTP and over
// NATS (binary mode, 8 requests in flight per CPU), each a new
// event that starts a job (its index entry and pending checkpoint stored,
// its start request published) and writes its dedup record before it is
// answered; under sync=always every one of those writes is fsynced.
//
//	go test ./engine/trigger -run '^$' -bench Intake -benchtime 3000x
func BenchmarkIntake(b *testing.B) {
	for _, transport := range []string{"http", "nats"} {
		for _, sync := range []string{natsserver.SyncInterval, natsserver.SyncAlways} {
			b.Run(transport+"/sync="+sync, func(b *testing.B) { benchIntake(b, transport, sync) })
		}
	}
}

func benchIntake(b *testing.B, transport, sync string) {
	srv := testsupport.StartServer(b, testsupport.ServerOptions{Sync: sync})
	// What engine serve runs with on an embedded server: group commits
	// under sync always.
	st := srv.Store(b, kv.Config{GroupCommit: sync == natsserver.SyncAlways})
	def, err := schemas.Load("testdata/orders.yaml", schemas.LoadOptions{})
	if err != nil {
		b.Fatal(err)
	}
	if err := st.Definitions.Put(context.Background(), def); err != nil {
		b.Fatal(err)
	}
	in, err := trigger.New(trigger.Config{Store: st})
	if err != nil {
		b.Fatal(err)
	}
	hs := httptest.NewServer(in)
	defer hs.Close()
	subs, err := in.Subscribe(srv.Conn(b))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = subs.Unsubscribe() }()
	nc := srv.Conn(b)
	var n atomic.Int64
	b.SetParallelism(8)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := n.Add(1)
			if transport == "nats" {
				ev := event.New()
				ev.SetID(fmt.Sprintf("bench-%d", i))
				ev.SetSource("/shop/eu")
				ev.SetType("com.example.order.created")
				_ = ev.SetData("application/json", []byte(orderData))
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				_, err := trigger.Send(ctx, nc, "waymark", &ev)
				cancel()
				if err != nil {
					b.Error(err)
					return
				}
				continue
			}
			req, _ := http.NewRequest(http.MethodPost, hs.URL, bytes.NewReader([]byte(orderData)))
			for k, v := range binary(fmt.Sprintf("bench-%d", i), "/shop/eu") {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusAccepted {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}
