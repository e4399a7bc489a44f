package main

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
