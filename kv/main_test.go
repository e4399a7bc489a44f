package kv_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
	)
}

// bundle is one test's world: its own server, a JetStream context for
// looking behind the store's back, and the store under test.
type bundle struct {
	srv   *testsupport.Server
	js    jetstream.JetStream
	store *kv.Store
}

// setup starts a server and opens the layout with cfg on it.
func setup(t *testing.T, cfg kv.Config) *bundle {
	t.Helper()
	srv := testsupport.StartServer(t, testsupport.ServerOptions{})
	return &bundle{srv: srv, js: newJS(t, srv), store: srv.Store(t, cfg)}
}

// newJS returns a JetStream context on a fresh connection to srv.
func newJS(t *testing.T, srv *testsupport.Server) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(srv.Conn(t))
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// ctx returns a context that ends with the test or after 30s.
func ctx(t *testing.T) context.Context {
	t.Helper()
	c, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// expired returns a context whose deadline has passed.
func expired(t *testing.T) context.Context {
	t.Helper()
	c, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	t.Cleanup(cancel)
	return c
}

// checkpoint returns a minimal valid checkpoint of job at seq.
func checkpoint(job string, seq uint64) *schemas.Checkpoint {
	now := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	return &schemas.Checkpoint{
		Schema:         schemas.CheckpointSchema,
		JobID:          job,
		Workflow:       "greeter",
		Version:        1,
		DefinitionHash: "9bc4a6941a6df22f4cd338771dd63d3530476de91d4054997b994d91608794f4",
		Seq:            seq,
		Status:         schemas.JobRunning,
		State:          []byte(`{"count":1}`),
		Steps:          map[string]*schemas.StepRecord{"greet": {Status: schemas.StepDispatched, Attempts: 1, Runs: 1, RunAttempt: 1}},
		CreatedAt:      now,
		UpdatedAt:      now.Add(time.Duration(seq) * time.Second),
	}
}
