package health

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// nats-server's accept loop and stream loops outlive Shutdown by a
		// moment; they belong to the test server, not to this package.
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*Server).acceptConnections"),
		goleak.IgnoreAnyFunction("github.com/nats-io/nats-server/v2/server.(*stream).internalLoop"),
		// http.Get's idle keep-alive connections to the test servers.
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
	)
}
