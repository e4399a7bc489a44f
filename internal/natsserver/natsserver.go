// Package natsserver runs the embedded nats-server that makes Waymark one
// binary on a laptop: JetStream with file storage under a data directory,
// a client port on loopback, its log routed into slog.
package natsserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Sync policies for JetStream writes.
const (
	// SyncAlways fsyncs every write before it is acknowledged: an
	// acknowledged write survives power loss. The embedded default.
	SyncAlways = "always"
	// SyncInterval fsyncs every Config.SyncInterval: an acknowledged write
	// survives a crash of any process (it is in the kernel's page cache),
	// but power loss can lose the last interval's writes.
	SyncInterval = "interval"
)

// Config configures the embedded server.
type Config struct {
	// DataDir holds JetStream's files (under DataDir/jetstream). Required
	// unless Memory is set.
	DataDir string
	// Listen is the client address, host:port. Empty means no TCP listener
	// (in-process connections only); port 0 picks a free port.
	Listen string
	// Sync is SyncAlways (default) or SyncInterval.
	Sync string
	// SyncInterval is the fsync period under SyncInterval. Default 1s.
	SyncInterval time.Duration
	// MaxStore caps JetStream's file storage, in bytes (ParseSize reads
	// "512MiB", "10GB"). A write that would store more is refused: the
	// publish fails with "insufficient resources" (error code 10023),
	// nothing already stored is dropped, and writes succeed again once
	// space is freed. 0 means the server's own default, 75% of the disk
	// space free when it starts; negative is an error.
	MaxStore int64
	// Memory keeps JetStream in memory (tests): nothing survives a restart.
	Memory bool
	// EncryptionKey turns on JetStream's encryption at rest: stream, KV
	// and object store files, and consumer state, under DataDir are
	// encrypted with keys derived from it (the server's own encryption,
	// JetStreamKey). At least MinKeyBytes. "" means no encryption. A data
	// directory written encrypted refuses a start without its key
	// (ErrKeyRequired) or with another (ErrWrongKey); a plain directory
	// given a key is encrypted in place by the server as it starts.
	EncryptionKey string
	// EncryptionCipher is CipherChaCha (default) or CipherAES. A change of
	// cipher is applied by the server as it loads each stream.
	EncryptionCipher string
	// Logger receives the server's log; nil discards it.
	Logger *slog.Logger
	// Debug forwards the server's debug lines too.
	Debug bool
}

// ParseSize reads a storage size: bytes as a number, or with a unit, where
// kB, MB, GB, TB are powers of 1000 and KiB, MiB, GiB, TiB powers of 1024
// ("512MiB", "10GB", "1.5 GiB"; case and spaces do not matter). "" and
// "0" give 0. Errors quote the value and say what is wanted.
func ParseSize(s string) (int64, error) {
	if strings.TrimSpace(s) == "" {
		return 0, nil
	}
	n, err := humanize.ParseBytes(s)
	if err != nil || n > math.MaxInt64 {
		return 0, fmt.Errorf("size %q: want bytes, or a number with a unit such as 512MiB or 10GB", s)
	}
	return int64(n), nil
}

// ErrDataDirInUse is returned by Start when another process holds the
// data directory: two servers on one directory would corrupt each other's
// files.
var ErrDataDirInUse = errors.New("data directory in use")

// Server is a running embedded nats-server.
type Server struct {
	*server.Server
	cfg    Config
	memDir string   // removed at Stop when Memory is set
	lock   *os.File // holds the data directory's lock until Stop
}

// lockDataDir takes an exclusive lock on dir/waymark.lock (flock), held for
// the process's life or until released, and records the holder's pid.
func lockDataDir(dir string) (*os.File, error) {
	path := filepath.Join(dir, "waymark.lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock data directory %s: %w", dir, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(path)
		f.Close()
		who := strings.TrimSpace(string(holder))
		if who == "" {
			who = "unknown"
		}
		return nil, fmt.Errorf("data directory %s is used by another Waymark process (pid %s): stop it, or give this one another --data-dir: %w", dir, who, ErrDataDirInUse)
	}
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return f, nil
}

// Start starts the server and waits until it accepts connections (at most
// 30s). Errors name the data directory or address at fault.
func Start(cfg Config) (*Server, error) {
	if cfg.Sync == "" {
		cfg.Sync = SyncAlways
	}
	if cfg.Sync != SyncAlways && cfg.Sync != SyncInterval {
		return nil, fmt.Errorf("sync policy %q: want %q or %q", cfg.Sync, SyncAlways, SyncInterval)
	}
	if cfg.SyncInterval == 0 {
		cfg.SyncInterval = time.Second
	}
	if cfg.SyncInterval < 0 {
		return nil, fmt.Errorf("sync interval %v: want a positive duration", cfg.SyncInterval)
	}
	if cfg.MaxStore < 0 {
		return nil, fmt.Errorf("max store %d: want a size in bytes, or 0 for the server's default", cfg.MaxStore)
	}
	opts := &server.Options{
		ServerName:         "waymark-embedded",
		JetStream:          true,
		NoSigs:             true,
		NoLog:              cfg.Logger == nil,
		MaxPayload:         8 << 20,
		JetStreamMaxMemory: -1,
		JetStreamMaxStore:  -1,
	}
	if cfg.MaxStore > 0 {
		opts.JetStreamMaxStore = cfg.MaxStore
	}
	if cfg.Sync == SyncAlways {
		opts.SyncAlways = true
	} else {
		opts.SyncInterval = cfg.SyncInterval
	}
	if cfg.Memory {
		dir, err := os.MkdirTemp("", "waymark-mem-")
		if err != nil {
			return nil, fmt.Errorf("embedded nats-server: %w", err)
		}
		opts.StoreDir = dir
	}
	var lock *os.File
	if !cfg.Memory {
		if cfg.DataDir == "" {
			return nil, errors.New("embedded nats-server: no data directory")
		}
		dir := filepath.Join(cfg.DataDir, "jetstream")
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("embedded nats-server: create data directory %s: %w", dir, err)
		}
		var err error
		if lock, err = lockDataDir(cfg.DataDir); err != nil {
			return nil, err
		}
		opts.StoreDir = dir
	}
	release := func() {
		if lock != nil {
			lock.Close()
		}
	}
	commitEncryption := func() error { return nil }
	if !cfg.Memory {
		var err error
		if commitEncryption, err = prepareEncryption(cfg, opts); err != nil {
			release()
			return nil, fmt.Errorf("embedded nats-server: %w", err)
		}
	} else if cfg.EncryptionKey != "" {
		return nil, errors.New("embedded nats-server: encryption needs a data directory (not Memory)")
	}
	if cfg.Listen == "" {
		opts.DontListen = true
	} else {
		host, port, err := net.SplitHostPort(cfg.Listen)
		if err != nil {
			release()
			return nil, fmt.Errorf("embedded nats-server: listen address %q: %w", cfg.Listen, err)
		}
		p, err := strconv.Atoi(port)
		if err != nil {
			release()
			return nil, fmt.Errorf("embedded nats-server: listen port %q: %w", port, err)
		}
		if p == 0 {
			p = server.RANDOM_PORT
		} else if ln, err := net.Listen("tcp", cfg.Listen); err != nil {
			release()
			return nil, fmt.Errorf("embedded nats-server: cannot listen on %s (is another server using it? pick another with --listen): %w", cfg.Listen, err)
		} else {
			ln.Close()
		}
		opts.Host, opts.Port = host, p
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		release()
		return nil, fmt.Errorf("embedded nats-server: %w", err)
	}
	if cfg.Logger != nil {
		ns.SetLoggerV2(&slogAdapter{log: cfg.Logger.With("component", "nats-server")}, cfg.Debug, false, false)
	}
	ns.Start()
	if !ns.ReadyForConnections(30 * time.Second) {
		ns.Shutdown()
		release()
		return nil, fmt.Errorf("embedded nats-server: not ready after 30s (data directory %s)", opts.StoreDir)
	}
	if err := commitEncryption(); err != nil {
		ns.Shutdown()
		release()
		return nil, fmt.Errorf("embedded nats-server: %w", err)
	}
	srv := &Server{Server: ns, cfg: cfg, lock: lock}
	if cfg.Memory {
		srv.memDir = opts.StoreDir
	}
	return srv, nil
}

// Connect opens a client connection: in-process when the server has no
// listener, else over TCP. name labels the connection in monitoring.
func (s *Server) Connect(name string, extra ...nats.Option) (*nats.Conn, error) {
	opts := append([]nats.Option{nats.Name(name), nats.MaxReconnects(-1)}, extra...)
	if s.cfg.Listen == "" {
		opts = append(opts, nats.InProcessServer(s.Server))
		return nats.Connect("", opts...)
	}
	return nats.Connect(s.ClientURL(), opts...)
}

// JetStream opens a connection (see Connect) and its JetStream context.
// The caller closes the connection.
func (s *Server) JetStream(name string, extra ...nats.Option) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := s.Connect(name, extra...)
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// Stop shuts the server down and waits for it, bounded by ctx.
func (s *Server) Stop(ctx context.Context) {
	done := make(chan struct{})
	go func() {
		s.Shutdown()
		s.WaitForShutdown()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
	}
	if s.memDir != "" {
		_ = os.RemoveAll(s.memDir)
	}
	if s.lock != nil {
		s.lock.Close()
		s.lock = nil
	}
}

type slogAdapter struct{ log *slog.Logger }

func (a *slogAdapter) Noticef(f string, v ...any) { a.log.Info(fmt.Sprintf(f, v...)) }

// Warnf: the server's warnings (a stream's index rebuilt after an unclean
// stop, say) are routine for an embedded server; they go out at info level.
func (a *slogAdapter) Warnf(f string, v ...any)  { a.log.Info(fmt.Sprintf(f, v...)) }
func (a *slogAdapter) Fatalf(f string, v ...any) { a.log.Error(fmt.Sprintf(f, v...)) }
func (a *slogAdapter) Errorf(f string, v ...any) { a.log.Error(fmt.Sprintf(f, v...)) }
func (a *slogAdapter) Debugf(f string, v ...any) { a.log.Debug(fmt.Sprintf(f, v...)) }
func (a *slogAdapter) Tracef(f string, v ...any) { a.log.Debug(fmt.Sprintf(f, v...)) }
