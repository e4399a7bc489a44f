package health

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
)

func get(t *testing.T, url string) (int, Status) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("%s: body is not JSON: %v", url, err)
	}
	return resp.StatusCode, st
}

func TestReadyzFollowsTheServer(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{TCP: true})
	st := srv.Store(t, kv.Config{})
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	n := st.Names
	c := &Checker{Conn: nc, Streams: []string{n.InboxStream, n.WorkStream, "KV_" + n.CheckpointBucket}, Timeout: 500 * time.Millisecond}
	mux := http.NewServeMux()
	c.Register(mux)
	hs := httptest.NewServer(mux)
	defer hs.Close()

	if code, body := get(t, hs.URL+"/readyz"); code != 200 || body.Status != "ok" || body.Streams[n.InboxStream] != "ok" {
		t.Fatalf("readyz on a running server: %d %+v", code, body)
	}
	srv.Stop()
	var last Status
	testsupport.Eventually(t, 10*time.Second, func() bool {
		code, body := get(t, hs.URL+"/readyz")
		last = body
		return code == http.StatusServiceUnavailable && body.Status == "unavailable" && strings.Contains(body.Reason, "not connected")
	}, "readyz did not go 503 after the server stopped: %+v", &last)
	// Alive while reconnecting: restarting the process would not help.
	if code, body := get(t, hs.URL+"/healthz"); code != 200 {
		t.Fatalf("healthz while reconnecting: %d %+v", code, body)
	}
	srv.Restart(t)
	testsupport.Eventually(t, 20*time.Second, func() bool {
		code, body := get(t, hs.URL+"/readyz")
		last = body
		return code == 200 && body.Status == "ok"
	}, "readyz did not come back after the server returned: %+v", &last)
	nc.Close()
	if code, body := get(t, hs.URL+"/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body.Reason, "closed") {
		t.Fatalf("healthz on a closed connection: %d %+v", code, body)
	}
}

func TestReadyzNamesAMissingStream(t *testing.T) {
	t.Parallel()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	nc := srv.Conn(t)
	c := &Checker{Conn: nc, Streams: []string{"WAYMARK_NOPE"}}
	rec := httptest.NewRecorder()
	c.Readyz(rec, httptest.NewRequest("GET", "/readyz", nil))
	var body Status
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(body.Reason, "WAYMARK_NOPE") || body.Streams["WAYMARK_NOPE"] == "ok" {
		t.Fatalf("readyz without the stream: %d %+v", rec.Code, body)
	}
}
