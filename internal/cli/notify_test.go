package cli

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
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

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

func writeSecret(t *testing.T, secret string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "ops.secret")
	if err := os.WriteFile(p, []byte(secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestServeSendsLifecycleEvents runs engine serve with a webhook and a
// job of two steps: the webhook gets the job's lifecycle events signed
// with its secret, a NATS subscriber gets them on the job's subjects in
// binary mode, and /metrics counts them.
func TestServeSendsLifecycleEvents(t *testing.T) {
	t.Parallel()
	secret := "whsec_" + base64.StdEncoding.EncodeToString([]byte("a webhook secret of 32 bytes....."))
	var mu sync.Mutex
	type hit struct {
		header http.Header
		body   []byte
	}
	var hits []hit
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		hits = append(hits, hit{r.Header.Clone(), b})
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	defer hook.Close()

	var serveOut, serveLog syncBuf
	cmd := NewEngineCommand(&serveOut, &serveLog)
	cmd.SetArgs([]string{"serve", "--data-dir", t.TempDir(), "--sync", "interval", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
		"--webhook", "ops=" + hook.URL + "/waymark", "--webhook-secret", "ops=" + writeSecret(t, secret)})
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- cmd.ExecuteContext(ctx) }()
	defer func() {
		stop()
		select {
		case err := <-served:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("serve did not stop within 30s")
		}
	}()
	var natsURL, httpURL string
	addrs := regexp.MustCompile(`(?m)^nats: (nats://\S+).*\n(?:.*\n)*?http: (http://\S+)`)
	testsupport.Eventually(t, 30*time.Second, func() bool {
		m := addrs.FindStringSubmatch(serveOut.String())
		if m != nil {
			natsURL, httpURL = m[1], m[2]
		}
		return m != nil
	}, "serve did not print its addresses: %s %s", &serveOut, &serveLog)
	for _, line := range []string{"events: job.started, step.completed, approval.requested, effect.ambiguous, job.completed, job.failed, job.cancelled on waymark.events.<type>.<job> (consumer waymark-events-out)",
		"webhook ops: " + hook.URL + "/waymark (consumer waymark-sink-ops)"} {
		if !strings.Contains(serveOut.String(), line) {
			t.Errorf("serve output lacks %q:\n%s", line, &serveOut)
		}
	}
	if strings.Contains(serveOut.String()+serveLog.String(), strings.TrimPrefix(secret, "whsec_")) {
		t.Error("serve printed the webhook secret")
	}

	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	// The consumers deliver what is stored after they exist.
	testsupport.Eventually(t, 10*time.Second, func() bool {
		_, e1 := js.Consumer(context.Background(), "WAYMARK_HISTORY", "waymark-events-out")
		_, e2 := js.Consumer(context.Background(), "WAYMARK_HISTORY", "waymark-sink-ops")
		return e1 == nil && e2 == nil
	}, "history consumers never appeared")
	msgs := make(chan *nats.Msg, 16)
	sub, err := nc.ChanSubscribe("waymark.events.>", msgs)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = nc.Flush()

	post := func(path, body string) []byte {
		t.Helper()
		resp, err := http.Post(httpURL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("POST %s: %v", path, err)
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		if resp.StatusCode/100 != 2 {
			t.Fatalf("POST %s: %d %s", path, resp.StatusCode, out)
		}
		return out
	}
	post("/v1/workflows", "name: notified\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n    next: [{to: b}]\n  - id: b\n    kind: noop\n")
	var started struct {
		JobID string `json:"job_id"`
	}
	if err := json.Unmarshal(post("/v1/jobs", `{"workflow": "notified", "job_id": "N1", "input": {}}`), &started); err != nil || started.JobID != "N1" {
		t.Fatalf("start: %v %+v", err, started)
	}
	wantTypes := []string{schemas.EventJobStarted, schemas.EventStepCompleted, schemas.EventStepCompleted, schemas.EventJobCompleted}

	// On NATS, in order (one engine), binary mode.
	for i, typ := range wantTypes {
		select {
		case m := <-msgs:
			short := strings.TrimPrefix(typ, "dev.waymark.")
			if m.Subject != "waymark.events."+short+".N1" || m.Header.Get("ce-type") != typ || m.Header.Get("ce-subject") != "N1" ||
				m.Header.Get("ce-specversion") != "1.0" || !strings.HasPrefix(m.Header.Get("ce-id"), "N1/") || m.Header.Get("Nats-Msg-Id") != m.Header.Get("ce-id") {
				t.Errorf("NATS event %d: %s %v, want %s", i, m.Subject, m.Header, typ)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("NATS event %d (%s) never came; log:\n%s", i, typ, &serveLog)
		}
	}

	// To the webhook, signed.
	testsupport.Eventually(t, 30*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(hits) >= len(wantTypes)
	}, "webhook got %d requests, want %d; log:\n%s", len(hits), len(wantTypes), &serveLog)
	wh, _ := standardwebhooks.NewWebhook(secret)
	wrong, _ := standardwebhooks.NewWebhook("whsec_" + base64.StdEncoding.EncodeToString([]byte("not the secret, 32 bytes long...")))
	mu.Lock()
	var gotTypes, ids []string
	for _, h := range hits {
		if err := wh.Verify(h.body, h.header); err != nil {
			t.Errorf("%s does not verify: %v", h.header.Get("webhook-id"), err)
		}
		if err := wrong.Verify(h.body, h.header); !errors.Is(err, standardwebhooks.ErrNoMatchingSignature) {
			t.Errorf("%s verifies with another secret: %v", h.header.Get("webhook-id"), err)
		}
		var ev schemas.HistoryEvent
		if err := json.Unmarshal(h.body, &ev); err != nil || ev.ID != h.header.Get("webhook-id") || ev.Subject != "N1" {
			t.Errorf("body %s (%v) for webhook-id %s", h.body, err, h.header.Get("webhook-id"))
		}
		gotTypes = append(gotTypes, ev.Type)
		ids = append(ids, ev.ID)
	}
	mu.Unlock()
	slices.Sort(gotTypes)
	want := slices.Clone(wantTypes)
	slices.Sort(want)
	if !slices.Equal(gotTypes, want) {
		t.Errorf("webhook got types %v, want %v", gotTypes, want)
	}
	if len(slices.Compact(slices.Sorted(slices.Values(ids)))) != len(ids) {
		t.Errorf("webhook ids %v: want each event once", ids)
	}

	// What the engine stored in the history stream (its outbox messages,
	// several transitions each) reads through sdk-go and marshals back to
	// the same bytes, event by event.
	hist, err := js.Stream(context.Background(), "WAYMARK_HISTORY")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for seq := uint64(1); ; {
		m, err := hist.GetMsg(context.Background(), seq, jetstream.WithGetMsgSubject("waymark.history.N1"))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		seq = m.Sequence + 1
		if f := format.Lookup(m.Header.Get("Content-Type")); f != format.JSONBatch {
			t.Errorf("history message %d: Content-Type %q is not sdk-go's batch format", m.Sequence, m.Header.Get("Content-Type"))
		}
		var raws []json.RawMessage
		if err := json.Unmarshal(m.Data, &raws); err != nil {
			t.Fatal(err)
		}
		for _, raw := range raws {
			var e event.Event
			if err := format.JSON.Unmarshal(raw, &e); err != nil || e.Validate() != nil {
				t.Fatalf("history event %s: %v", raw, err)
			}
			if again, _ := format.JSON.Marshal(&e); !bytes.Equal(again, raw) {
				t.Errorf("history event differs from sdk-go's marshalling\nstored: %s\nsdk-go: %s", raw, again)
			}
			checked++
		}
	}
	if checked < len(wantTypes) {
		t.Errorf("checked %d history events, want at least %d", checked, len(wantTypes))
	}

	testsupport.Eventually(t, 10*time.Second, func() bool {
		resp, err := http.Get(httpURL + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return strings.Contains(string(b), `waymark_webhook_delivered_total{sink="ops"} 4`) && strings.Contains(string(b), "waymark_events_published_total 4")
	}, "metrics never counted the 4 events")
}

func TestEventFlagErrors(t *testing.T) {
	t.Parallel()
	good := writeSecret(t, "whsec_"+base64.StdEncoding.EncodeToString([]byte("0123456789abcdef01234567")))
	bad := writeSecret(t, "whsec_s3cr3t-not-base64")
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--webhook", "ops=http://127.0.0.1:9/hook"}, "--webhook ops: no --webhook-secret ops=FILE"},
		{[]string{"serve", "--webhook", "ops"}, `--webhook "ops": want NAME=URL`},
		{[]string{"serve", "--webhook", "ops=http://a", "--webhook", "ops=http://b", "--webhook-secret", "ops=" + good}, "--webhook ops: given twice"},
		{[]string{"serve", "--webhook", "ops=ftp://user:pw@host/x?token=t", "--webhook-secret", "ops=" + good}, `url "ftp://host/x": want http:// or https://`},
		{[]string{"serve", "--webhook", "Ops=http://a", "--webhook-secret", "Ops=" + good}, `webhook "Ops": name`},
		{[]string{"serve", "--webhook", "ops=http://a", "--webhook-secret", "ops=/no/such/file"}, "--webhook-secret ops: open /no/such/file"},
		{[]string{"serve", "--webhook", "ops=http://a", "--webhook-secret", "ops=" + bad}, "is not standard base64"},
		{[]string{"serve", "--webhook-secret", "ops=" + good}, "--webhook-secret ops: no --webhook ops=URL"},
		{[]string{"serve", "--webhook", "ops=http://a", "--webhook-secret", "ops=" + good, "--webhook-types", "ops=job.done"}, `--webhook-types ops: event type "job.done"`},
		{[]string{"serve", "--event-types", "job.started,nope"}, `--event-types: event type "nope"`},
		{[]string{"run", writeWorkflow(t, "name: n\nversion: 1\nsteps:\n  - id: a\n    kind: noop\n"), "--event-types", "nope"}, `--event-types: event type "nope"`},
	} {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			t.Parallel()
			_, errOut, code := execute(t, append(tt.args, "--data-dir", t.TempDir())...)
			if code != 2 || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d stderr %q, want 2 and %q", code, errOut, tt.want)
			}
			for _, leak := range []string{"s3cr3t", "pw@", "token=t"} {
				if strings.Contains(errOut, leak) {
					t.Errorf("stderr %q shows a secret", errOut)
				}
			}
		})
	}
}
