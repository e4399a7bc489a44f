package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"

	"github.com/waymark-dev/waymark/engine"
	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/engine/notify"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// TestWebhookDeliveryOutlivesAnEngineKill: an engine is killed (SIGKILL)
// while its webhook request for a job's last event is in flight; another
// engine started afterwards sends that event again, with the same
// webhook-id and a valid signature, and every lifecycle event of the job
// reaches the endpoint.
func TestWebhookDeliveryOutlivesAnEngineKill(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	store := srv.Store(t, crashKV)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	// The sink's consumer made beforehand with a short ack wait, so that
	// the dead engine's delivery comes back within the test; the engines
	// use it as they find it.
	if _, err := store.JS.CreateConsumer(ctx, store.Names.HistoryStream, jetstream.ConsumerConfig{
		Durable: notify.SinkConsumer("waymark", "ops"), DeliverPolicy: jetstream.DeliverNewPolicy,
		AckPolicy: jetstream.AckExplicitPolicy, AckWait: 3 * time.Second, MaxDeliver: -1,
	}); err != nil {
		t.Fatal(err)
	}

	secret := "whsec_" + base64.StdEncoding.EncodeToString([]byte("crash-test webhook secret, 32 b."))
	secretFile := filepath.Join(t.TempDir(), "ops.secret")
	if err := os.WriteFile(secretFile, []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	type hit struct {
		id, typ string
		header  http.Header
		body    []byte
	}
	var mu sync.Mutex
	var hits []hit
	inFlight := make(chan struct{})
	var once sync.Once
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var ev struct {
			Type string `json:"type"`
		}
		_ = json.Unmarshal(body, &ev)
		mu.Lock()
		first := !slices.ContainsFunc(hits, func(h hit) bool { return h.typ == ev.Type })
		hits = append(hits, hit{r.Header.Get("webhook-id"), ev.Type, r.Header.Clone(), body})
		mu.Unlock()
		if ev.Type == schemas.EventJobCompleted && first {
			once.Do(func() { close(inFlight) })
			<-r.Context().Done() // held until the engine that sent it dies
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer hook.Close()

	bin := testsupport.Binary(t, "engine")
	args := []string{"serve", "--nats-url=" + srv.URL(), "--http=", "--workers=0", "--events=false",
		"--webhook", "ops=" + hook.URL, "--webhook-secret", "ops=" + secretFile}
	spawn(t, nil, testsupport.Binary(t, "worker"), "--nats-url="+srv.URL())
	first := spawn(t, nil, bin, args...)

	def, err := schemas.Parse("n.yaml", []byte(testsupport.NoopChain("notified", 2)), schemas.LoadOptions{Checks: []schemas.CheckFunc{engine.Check}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.New(store).Start(ctx, def, json.RawMessage(`{}`), client.StartOptions{JobID: "K1"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inFlight:
	case <-time.After(60 * time.Second):
		t.Fatalf("job.completed never reached the webhook; engine output:\n%s", first.errOut.String())
	}
	if err := first.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-first.done
	spawn(t, nil, bin, args...)

	want := []string{schemas.EventJobStarted, schemas.EventStepCompleted, schemas.EventStepCompleted, schemas.EventJobCompleted}
	testsupport.Eventually(t, 60*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, h := range hits {
			if h.typ == schemas.EventJobCompleted {
				n++
			}
		}
		return n >= 2
	}, "job.completed was not sent again after the engine died")
	mu.Lock()
	defer mu.Unlock()
	wh, _ := standardwebhooks.NewWebhook(secret)
	var completedIDs []string
	byID := map[string]string{}
	for _, h := range hits {
		if err := wh.Verify(h.body, h.header); err != nil {
			t.Errorf("%s (%s): %v", h.id, h.typ, err)
		}
		byID[h.id] = h.typ
		if h.typ == schemas.EventJobCompleted {
			completedIDs = append(completedIDs, h.id)
		}
	}
	if len(slices.Compact(slices.Clone(completedIDs))) != 1 || !strings.HasPrefix(completedIDs[0], "K1/") {
		t.Errorf("job.completed sent with ids %v, want one id every time", completedIDs)
	}
	var types []string
	for _, typ := range byID {
		types = append(types, typ)
	}
	slices.Sort(types)
	sortedWant := slices.Clone(want)
	slices.Sort(sortedWant)
	if !slices.Equal(types, sortedWant) {
		t.Errorf("distinct events received %v, want %v", byID, want)
	}
}
