package main

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(mcpStdioEnv) != "" {
		serveMCPStdio() // this binary started as an MCP server by an engine under test
		return
	}
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
