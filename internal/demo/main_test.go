package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// bundle is one running service and a client for it.
type bundle struct {
	t      *testing.T
	name   string
	opts   Options
	run    *Running
	client *http.Client
}

// setup starts service name on a fresh directory (unless opts.Dir is set)
// with a client that opens a new connection per request, so that a dropped
// connection is seen as one (see Options.DropAfterCommit).
func setup(t *testing.T, name string, opts Options) *bundle {
	t.Helper()
	if opts.Dir == "" {
		opts.Dir = t.TempDir()
	}
	tr := &http.Transport{DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	b := &bundle{t: t, name: name, opts: opts, client: &http.Client{Transport: tr}}
	b.start()
	return b
}

func (b *bundle) start() {
	b.t.Helper()
	run, err := Start(context.Background(), b.name, b.opts)
	if err != nil {
		b.t.Fatalf("Start(%s): %v", b.name, err)
	}
	b.run = run
	b.t.Cleanup(func() {
		if err := run.Close(); err != nil {
			b.t.Errorf("Close(%s): %v", b.name, err)
		}
	})
}

// restart closes the service and starts it again on the same directory, as
// a restarted host process would.
func (b *bundle) restart() {
	b.t.Helper()
	if err := b.run.Close(); err != nil {
		b.t.Fatalf("Close(%s): %v", b.name, err)
	}
	b.start()
}

// response is what a test looks at.
type response struct {
	status int
	header http.Header
	body   []byte
}

// send makes one request; header holds name, value pairs. A transport
// error is returned, not fatal.
func (b *bundle) send(method, path, body string, header ...string) (response, error) {
	b.t.Helper()
	return sendWith(b.t.Context(), b.client, b.run.URL, method, path, body, header...)
}

func sendWith(ctx context.Context, c *http.Client, base, method, path, body string, header ...string) (response, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, base+path, rd)
	if err != nil {
		return response{}, err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: resp.StatusCode, header: resp.Header, body: data}, nil
}

// must is send that fails the test on a transport error.
func (b *bundle) must(method, path, body string, header ...string) response {
	b.t.Helper()
	r, err := b.send(method, path, body, header...)
	if err != nil {
		b.t.Fatalf("%s %s: %v", method, path, err)
	}
	return r
}

func (r response) want(t *testing.T, status int) response {
	t.Helper()
	if r.status != status {
		t.Fatalf("status = %d, want %d; body %s", r.status, status, r.body)
	}
	return r
}

// wantError checks an error response's status, code and that its message
// contains msg.
func (r response) wantError(t *testing.T, status int, code, msg string) {
	t.Helper()
	r.want(t, status)
	var e ErrorResponse
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("error body %s: %v", r.body, err)
	}
	if e.Error.Code != code || !strings.Contains(e.Error.Message, msg) {
		t.Fatalf("error = %+v, want code %q and a message containing %q", e.Error, code, msg)
	}
}

func decode[T any](t *testing.T, data []byte) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatalf("decode %T from %s: %v", v, data, err)
	}
	return v
}

// stats reads GET /v1/_stats, which is what an out-of-process crash test
// sees.
func (b *bundle) stats() Stats {
	b.t.Helper()
	return decode[Stats](b.t, b.must("GET", "/v1/_stats", "").want(b.t, http.StatusOK).body)
}

func (b *bundle) wantCounts(key string, calls, effects int) {
	b.t.Helper()
	s := b.stats()
	if s.Calls[key] != calls || s.Effects[key] != effects {
		b.t.Fatalf("stats for key %q: calls %d, effects %d; want %d and %d (all: %+v)",
			key, s.Calls[key], s.Effects[key], calls, effects, s)
	}
}

// checkFor polls cond until it holds or the deadline passes
// (nats-server's checkFor).
func checkFor(t *testing.T, total time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(total)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met after %v: %v", total, err)
		}
		<-tick.C
	}
}

// effectRequest is the effect request of each service, so one test can
// run against all four.
type effectRequest struct {
	method, path, body string
}

func (e effectRequest) send(b *bundle, key string) (response, error) {
	b.t.Helper()
	h := IdempotencyKeyHeader
	if b.name == NameRecords {
		return b.send(e.method, e.path+key, e.body)
	}
	return b.send(e.method, e.path, e.body, h, key)
}

var effectRequests = map[string]effectRequest{
	NameTickets:  {"POST", "/v1/tickets/batch", `{"tickets": [{"report_id": "r-1", "title": "Disk full", "severity": "high"}]}`},
	NamePayments: {"POST", "/v1/charges", `{"amount_cents": 1250, "currency": "usd", "order_id": "o-1"}`},
	NameRecords:  {"PUT", "/v1/records/", `{"status": "done"}`},
	NameMail:     {"POST", "/v1/send", `{"to": "ops@example.com", "subject": "Report ready", "body": "See WM-1001."}`},
}

// firstID is the id the first effect of each service gets, and secondID
// the next.
var firstID = map[string]string{NameTickets: "WM-1001", NamePayments: "ch_000001", NameRecords: "rec_000001", NameMail: "msg_000001"}
var secondID = map[string]string{NameTickets: "WM-1002", NamePayments: "ch_000002", NameRecords: "rec_000002", NameMail: "msg_000002"}

func lines(t *testing.T, data []byte) [][]byte {
	t.Helper()
	return bytes.Split(bytes.TrimSuffix(data, []byte("\n")), []byte("\n"))
}
