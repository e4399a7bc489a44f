package testsupport

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
)

// Cluster is a JetStream cluster of in-process nats-servers on loopback,
// owned by one test: each node has its own client and route ports (picked
// at random at the first start and kept across restarts) and its own file
// storage under the test's temporary directory. It is what a replicated
// deployment looks like to the client: streams and buckets with Replicas 3
// keep working while one node is down, and a stream's leader moves when
// its server goes away. Safe for concurrent use.
type Cluster struct {
	// Name is the cluster's name (every node's Cluster.Name).
	Name  string
	mu    sync.Mutex
	nodes []*ClusterNode
}

// ClusterNode is one server of a Cluster.
type ClusterNode struct {
	// Name is the server's name, as stream info's Cluster.Leader and
	// Replicas report it: "n1", "n2", ...
	Name string
	// Dir holds the node's JetStream files, kept across Restart.
	Dir  string
	opts *server.Options
	srv  *server.Server // nil while stopped
}

// StartCluster starts an n-node JetStream cluster (n is 3 or more for
// replicated streams to survive a node) and waits until it has a
// metadata leader and every node is current with it. The cluster shuts
// down when the test ends.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("StartCluster(%d): want at least one node", n)
	}
	c := &Cluster{Name: "waymark-test"}
	opts, err := natsserver.ClusterNodeOptions(c.Name, t.TempDir(), n, false)
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	for _, o := range opts {
		c.nodes = append(c.nodes, &ClusterNode{Name: o.ServerName, Dir: o.StoreDir, opts: o})
	}
	// Start every node before waiting for any: a node waits for its
	// routes, and the metadata group needs a quorum to elect a leader.
	for _, node := range c.nodes {
		if err := c.startNode(node); err != nil {
			c.Shutdown()
			t.Fatalf("start cluster: %v", err)
		}
	}
	t.Cleanup(c.Shutdown)
	c.WaitReady(t, 30*time.Second)
	return c
}

func (c *Cluster) startNode(node *ClusterNode) error {
	opts := *node.opts // NewServer keeps and edits what it is given
	srv, err := server.NewServer(&opts)
	if err != nil {
		return fmt.Errorf("node %s: %w", node.Name, err)
	}
	srv.Start()
	if !srv.ReadyForConnections(20 * time.Second) {
		srv.Shutdown()
		return fmt.Errorf("node %s: not accepting connections after 20s", node.Name)
	}
	if node.opts.Port == server.RANDOM_PORT {
		// A restart comes back on the same client port, so that clients
		// holding the cluster's URLs find it again.
		node.opts.Port = srv.Addr().(*net.TCPAddr).Port
	}
	c.mu.Lock()
	node.srv = srv
	c.mu.Unlock()
	return nil
}

// Nodes returns the cluster's nodes in start order.
func (c *Cluster) Nodes() []*ClusterNode {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*ClusterNode(nil), c.nodes...)
}

// Node returns the node called name (a server name as stream info reports
// it), or nil.
func (c *Cluster) Node(name string) *ClusterNode {
	for _, n := range c.Nodes() {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// Server returns the node's running server, or nil while it is stopped.
func (c *Cluster) Server(node *ClusterNode) *server.Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	return node.srv
}

// URLs returns every node's client URL, comma-separated, as nats.Connect
// takes them: a client reconnects to another node when its own goes away.
func (c *Cluster) URLs() string {
	var urls []string
	for _, n := range c.Nodes() {
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", n.opts.Port))
	}
	return strings.Join(urls, ",")
}

// Stop shuts node down (a clean shutdown: the server hands the leadership
// of the streams it leads to another replica before it goes) and waits
// until it is gone. Stopping a stopped node does nothing.
func (c *Cluster) Stop(node *ClusterNode) {
	c.mu.Lock()
	srv := node.srv
	node.srv = nil
	c.mu.Unlock()
	if srv == nil {
		return
	}
	srv.Shutdown()
	srv.WaitForShutdown()
}

// Restart starts a stopped node again on its ports and data directory and
// waits until the cluster is ready again (see WaitReady). What the node
// still holds is what JetStream wrote to its files; the rest it catches
// up from the other replicas.
func (c *Cluster) Restart(t testing.TB, node *ClusterNode) {
	t.Helper()
	if c.Server(node) != nil {
		t.Fatalf("restart node %s: it is running", node.Name)
	}
	if err := c.startNode(node); err != nil {
		t.Fatalf("restart: %v", err)
	}
	c.WaitReady(t, 30*time.Second)
}

// Shutdown stops every node; safe to call twice.
func (c *Cluster) Shutdown() {
	for _, n := range c.Nodes() {
		c.Stop(n)
	}
}

// WaitReady waits up to timeout until the cluster has a JetStream
// metadata leader and every running node is current with it, then fails
// the test.
func (c *Cluster) WaitReady(t testing.TB, timeout time.Duration) {
	t.Helper()
	Eventually(t, timeout, func() bool {
		var leader *server.Server
		running := 0
		for _, n := range c.Nodes() {
			srv := c.Server(n)
			if srv == nil {
				continue
			}
			running++
			if !srv.JetStreamIsCurrent() {
				return false
			}
			if srv.JetStreamIsLeader() {
				if leader != nil {
					return false
				}
				leader = srv
			}
		}
		if leader == nil {
			return false
		}
		// The leader must see every other running node online and caught
		// up, or placing a replicated stream fails with "peer offline".
		jsz, err := leader.Jsz(nil)
		if err != nil || jsz.Meta == nil {
			return false
		}
		online := 0
		for _, p := range jsz.Meta.Replicas {
			if p.Current && !p.Offline {
				online++
			}
		}
		return online >= running-1
	}, "cluster %s: no JetStream metadata leader that sees every running node current", c.Name)
}

// Conn opens a client connection to the cluster (every node's URL, with
// reconnects forever) closed when the test ends.
func (c *Cluster) Conn(t testing.TB) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(c.URLs(), nats.Name(t.Name()), nats.MaxReconnects(-1),
		nats.ReconnectWait(50*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		t.Fatalf("connect to cluster %s: %v", c.Name, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Store opens the Waymark layout on a new connection to the cluster (set
// cfg.Replicas for replicated streams and buckets).
func (c *Cluster) Store(t testing.TB, cfg kv.Config) *kv.Store {
	t.Helper()
	return OpenStore(t, c.Conn(t), cfg)
}

// StreamLeader returns the node that leads stream (as its stream info's
// Cluster.Leader names it), waiting up to timeout for the stream to have a
// leader and every replica on a running node current; then it fails the
// test.
func (c *Cluster) StreamLeader(t testing.TB, js jetstream.JetStream, stream string, timeout time.Duration) *ClusterNode {
	t.Helper()
	var leader *ClusterNode
	var last error
	Eventually(t, timeout, func() bool {
		leader, last = c.streamLeader(js, stream)
		return last == nil
	}, "stream %s: no leader with current replicas (last: %v)", stream, lazyErr{&last})
	return leader
}

func (c *Cluster) streamLeader(js jetstream.JetStream, stream string) (*ClusterNode, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return nil, errors.New("no leader")
	}
	for _, r := range info.Cluster.Replicas {
		if n := c.Node(r.Name); n != nil && c.Server(n) == nil {
			continue // stopped on purpose
		}
		if !r.Current || r.Offline {
			return nil, fmt.Errorf("replica %s is not current", r.Name)
		}
	}
	node := c.Node(info.Cluster.Leader)
	if node == nil {
		return nil, fmt.Errorf("leader %q is not a node of cluster %s", info.Cluster.Leader, c.Name)
	}
	return node, nil
}

// lazyErr prints an error variable when a wait fails, not when it starts.
type lazyErr struct{ err *error }

func (l lazyErr) String() string { return fmt.Sprint(*l.err) }

// WaitStreamsCurrent waits up to timeout until every stream on the
// cluster has a leader and every replica on a running node is current,
// then fails the test. Call it after Restart and before stopping another
// node: a replica still catching up does not count towards a quorum, so
// stopping a second node before it is current would stop the stream.
func (c *Cluster) WaitStreamsCurrent(t testing.TB, js jetstream.JetStream, timeout time.Duration) {
	t.Helper()
	var last error
	Eventually(t, timeout, func() bool {
		last = c.streamsCurrent(js)
		return last == nil
	}, "cluster %s: streams not current (last: %v)", c.Name, lazyErr{&last})
}

func (c *Cluster) streamsCurrent(js jetstream.JetStream) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		if _, err := c.streamLeader(js, name); err != nil {
			return fmt.Errorf("stream %s: %w", name, err)
		}
	}
	return names.Err()
}
