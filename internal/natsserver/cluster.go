package natsserver

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// ClusterNodeOptions returns the options of an n-node JetStream cluster
// named name on loopback: node i is "n<i+1>", keeps its files under
// dir/n<i+1>, listens for clients on a port of its own choosing and for
// routes on a port picked now, and routes to every node (JetStream
// clustering refuses to start without configured routes). syncAlways
// fsyncs every write before its acknowledgement. Errors: no free port.
func ClusterNodeOptions(name, dir string, n int, syncAlways bool) ([]*server.Options, error) {
	routePorts := make([]int, n)
	for i := range routePorts {
		p, err := freePort()
		if err != nil {
			return nil, err
		}
		routePorts[i] = p
	}
	routes := make([]string, n)
	for i, p := range routePorts {
		routes[i] = fmt.Sprintf("nats-route://127.0.0.1:%d", p)
	}
	opts := make([]*server.Options, n)
	for i := range n {
		node := fmt.Sprintf("n%d", i+1)
		opts[i] = &server.Options{
			ServerName:         node,
			Host:               "127.0.0.1",
			Port:               server.RANDOM_PORT,
			NoSigs:             true,
			NoLog:              true,
			MaxPayload:         8 << 20,
			JetStream:          true,
			StoreDir:           filepath.Join(dir, node),
			JetStreamMaxMemory: 256 << 20,
			JetStreamMaxStore:  1 << 30,
			SyncAlways:         syncAlways,
			Cluster:            server.ClusterOpts{Name: name, Host: "127.0.0.1", Port: routePorts[i]},
			Routes:             server.RoutesFromStr(strings.Join(routes, ",")),
		}
	}
	return opts, nil
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// Cluster is a running loopback cluster from StartCluster, for
// measurements (tests have testsupport.Cluster, which stops and restarts
// nodes).
type Cluster struct {
	servers []*server.Server
}

// StartCluster starts an n-node loopback JetStream cluster with its files
// under dir and waits (at most 30s) until it has a JetStream metadata
// leader. Errors name the node at fault.
func StartCluster(dir string, n int, syncAlways bool) (*Cluster, error) {
	opts, err := ClusterNodeOptions("waymark-bench", dir, n, syncAlways)
	if err != nil {
		return nil, err
	}
	c := &Cluster{}
	for _, o := range opts {
		s, err := server.NewServer(o)
		if err != nil {
			c.Stop()
			return nil, fmt.Errorf("cluster node %s: %w", o.ServerName, err)
		}
		s.Start()
		c.servers = append(c.servers, s)
	}
	for _, s := range c.servers {
		if !s.ReadyForConnections(20 * time.Second) {
			c.Stop()
			return nil, fmt.Errorf("cluster node %s: not accepting connections after 20s", s.Name())
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, s := range c.servers {
			if s.JetStreamIsLeader() {
				return c, nil
			}
		}
		if time.Now().After(deadline) {
			c.Stop()
			return nil, errors.New("cluster: no JetStream metadata leader after 30s")
		}
		time.Sleep(50 * time.Millisecond) // polling the servers' state; nothing to wait on
	}
}

// URLs returns every node's client URL, comma-separated.
func (c *Cluster) URLs() string {
	var urls []string
	for _, s := range c.servers {
		urls = append(urls, s.ClientURL())
	}
	return strings.Join(urls, ",")
}

// InMsgs is the client messages every node received.
func (c *Cluster) InMsgs() int64 {
	var n int64
	for _, s := range c.servers {
		if vz, err := s.Varz(nil); err == nil {
			n += vz.InMsgs
		}
	}
	return n
}

// Stop shuts every node down and waits for it.
func (c *Cluster) Stop() {
	for _, s := range c.servers {
		s.Shutdown()
	}
	for _, s := range c.servers {
		s.WaitForShutdown()
	}
}
