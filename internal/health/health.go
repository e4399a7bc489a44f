// Package health answers the liveness and readiness probes of a Waymark
// process (engine or worker) over HTTP, from its NATS connection:
//
//	GET /healthz  200 while the process runs and its connection is not
//	              closed (a connection that is reconnecting is still
//	              alive: restarting the process would not help)
//	GET /readyz   200 when the connection is up and every stream the
//	              process needs answers a STREAM.INFO within the timeout;
//	              503 with a JSON reason otherwise
//
// Both answer JSON: {"status":"ok"} or {"status":"unavailable",
// "reason":"...", "streams":{...}}. Kubernetes' liveness and readiness
// probes are the model. It imports neither the engine nor nats-server,
// so workers link it (internal/linkcheck).
package health

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DefaultTimeout bounds one readiness check (all its stream lookups).
const DefaultTimeout = 2 * time.Second

// Checker answers the probes for one connection. It is safe for
// concurrent use; each readiness probe asks the server afresh (no cache:
// a probe must see the server as it is).
type Checker struct {
	// Conn is the process's NATS connection. Required.
	Conn *nats.Conn
	// Streams are the JetStream streams (a KV bucket's is KV_<bucket>)
	// that must answer for the process to be ready. Empty checks the
	// connection only.
	Streams []string
	// Timeout bounds one readiness probe. Default DefaultTimeout.
	Timeout time.Duration
}

// Status is the JSON body of both probes.
type Status struct {
	Status  string            `json:"status"`            // "ok" or "unavailable"
	Reason  string            `json:"reason,omitempty"`  // why unavailable
	NATS    string            `json:"nats,omitempty"`    // connection state: connected, reconnecting, closed, ...
	Streams map[string]string `json:"streams,omitempty"` // stream name -> "ok" or its error (readyz)
}

// Register adds GET /healthz and GET /readyz to mux.
func (c *Checker) Register(mux *http.ServeMux) {
	mux.HandleFunc("GET /healthz", c.Healthz)
	mux.HandleFunc("GET /readyz", c.Readyz)
}

// Healthz is the liveness probe: 503 only when the connection is closed
// for good (nats.go gave up, or the process is shutting down).
func (c *Checker) Healthz(w http.ResponseWriter, _ *http.Request) {
	st := Status{Status: "ok", NATS: c.Conn.Status().String()}
	code := http.StatusOK
	if c.Conn.IsClosed() {
		st.Status, st.Reason, code = "unavailable", "the NATS connection is closed", http.StatusServiceUnavailable
	}
	write(w, code, st)
}

// Readyz is the readiness probe (see the package comment).
func (c *Checker) Readyz(w http.ResponseWriter, r *http.Request) {
	st := c.Check(r.Context())
	code := http.StatusOK
	if st.Status != "ok" {
		code = http.StatusServiceUnavailable
	}
	write(w, code, st)
}

// Check runs the readiness check, bounded by Timeout and ctx.
func (c *Checker) Check(ctx context.Context) Status {
	st := Status{Status: "ok", NATS: c.Conn.Status().String()}
	if !c.Conn.IsConnected() {
		st.Status, st.Reason = "unavailable", fmt.Sprintf("not connected to NATS (%s)", st.NATS)
		return st
	}
	if len(c.Streams) == 0 {
		return st
	}
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	js, err := jetstream.New(c.Conn)
	if err != nil {
		st.Status, st.Reason = "unavailable", fmt.Sprintf("jetstream: %v", err)
		return st
	}
	st.Streams = map[string]string{}
	var failed []string
	for _, name := range c.Streams {
		if _, err := js.Stream(ctx, name); err != nil {
			st.Streams[name] = err.Error()
			failed = append(failed, name)
			continue
		}
		st.Streams[name] = "ok"
	}
	if len(failed) > 0 {
		sort.Strings(failed)
		st.Status, st.Reason = "unavailable", fmt.Sprintf("streams do not answer: %v", failed)
	}
	return st
}

func write(w http.ResponseWriter, code int, st Status) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(st)
}
