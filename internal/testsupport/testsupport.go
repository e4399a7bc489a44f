// Package testsupport holds what Waymark's tests share: a real embedded
// nats-server per test, condition polling instead of sleeps, and the
// engine binary built once for tests that kill real processes.
package testsupport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/kv"
)

// Server is an embedded nats-server owned by one test.
type Server struct {
	*natsserver.Server
	Dir    string // data directory, kept across Restart
	Listen string // client address; "" for in-process only
	cfg    natsserver.Config
}

// ServerOptions adjust StartServer.
type ServerOptions struct {
	// TCP gives the server a loopback port, for child processes.
	TCP bool
	// Sync is the JetStream sync policy; default interval (tests that are
	// not about power loss need not pay for fsync).
	Sync string
}

// StartServer starts a JetStream server with file storage in a temporary
// directory and shuts it down when the test ends.
func StartServer(t testing.TB, o ServerOptions) *Server {
	t.Helper()
	s := &Server{Dir: t.TempDir()}
	if o.Sync == "" {
		o.Sync = natsserver.SyncInterval
	}
	s.cfg = natsserver.Config{DataDir: s.Dir, Sync: o.Sync}
	if o.TCP {
		s.cfg.Listen = "127.0.0.1:0"
	}
	s.start(t)
	t.Cleanup(func() { s.Stop() })
	return s
}

func (s *Server) start(t testing.TB) {
	t.Helper()
	srv, err := natsserver.Start(s.cfg)
	if err != nil {
		t.Fatalf("start nats-server: %v", err)
	}
	s.Server = srv
	if s.cfg.Listen != "" {
		s.Listen = srv.Addr().String()
		s.cfg.Listen = s.Listen // a restart keeps the port
	}
}

// URL is the client URL (TCP servers only).
func (s *Server) URL() string { return "nats://" + s.Listen }

// Stop shuts the server down; safe to call twice.
func (s *Server) Stop() {
	if s.Server == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s.Server.Stop(ctx)
}

// Restart stops the server and starts it again on the same data directory
// and port: what survives is what JetStream wrote to its files.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	s.start(t)
}

// Conn opens a client connection closed when the test ends.
func (s *Server) Conn(t testing.TB) *nats.Conn {
	t.Helper()
	nc, err := s.Connect(t.Name(), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Store opens the Waymark layout on a new connection.
func (s *Server) Store(t testing.TB, cfg kv.Config) *kv.Store {
	t.Helper()
	return OpenStore(t, s.Conn(t), cfg)
}

// OpenStore opens the Waymark layout over nc, failing t on error.
func OpenStore(t testing.TB, nc *nats.Conn, cfg kv.Config) *kv.Store {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := kv.Open(ctx, js, cfg, nil)
	if err != nil {
		t.Fatalf("open store on %s: %v", nc.ConnectedUrlRedacted(), err)
	}
	return st
}

// Eventually polls cond every 10ms until it holds or timeout passes, then
// fails the test with msg. It never sleeps longer than one poll.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", timeout, fmt.Sprintf(format, args...))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// Binary returns the path of a binary built from the module's cmd/NAME,
// building every binary once per test process.
func Binary(t testing.TB, name string) string {
	t.Helper()
	buildOnce.Do(func() {
		removeStaleBinaries()
		buildDir = filepath.Join(os.TempDir(), "waymark-bin-"+strconv.Itoa(os.Getpid()))
		if buildErr = os.MkdirAll(buildDir, 0o755); buildErr != nil {
			return
		}
		root := ModuleRoot()
		for _, n := range []string{"engine", "worker"} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(buildDir, n), "./cmd/"+n)
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build ./cmd/%s: %v\n%s", n, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(buildDir, name)
}

// removeStaleBinaries removes the build directories of test processes
// that are gone: a test binary cannot remove its own when it is killed
// (a timeout, ^C), and each holds about 190 MB.
func removeStaleBinaries() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "waymark-bin-*"))
	for _, d := range dirs {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "waymark-bin-"))
		if err != nil || pid <= 0 || !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			continue // not a process id, or its process lives
		}
		if fi, err := os.Stat(d); err != nil || time.Since(fi.ModTime()) < time.Hour {
			continue // perhaps another naming's live directory
		}
		os.RemoveAll(d)
	}
}

// ModuleRoot returns the repository's root directory.
func ModuleRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// NoopChain returns the YAML of workflow name: n noop steps s1..sn, each
// leading to the next.
func NoopChain(name string, n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "name: %s\nversion: 1\nsteps:\n", name)
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&b, "  - id: s%d\n    kind: noop\n", i)
		if i < n {
			fmt.Fprintf(&b, "    next: [{to: s%d}]\n", i+1)
		}
	}
	return b.String()
}

// SyncBuffer is a bytes.Buffer that a child process's output, a logger
// and a test's pollers may use at once. The zero value is ready.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
