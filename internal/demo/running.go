package demo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"
)

// shutdownGrace is how long Running.Close waits for requests in progress
// before it cuts their connections.
const shutdownGrace = 5 * time.Second

// Running is a service listening on a loopback port, as Start returns it.
// Safe for concurrent use.
type Running struct {
	// URL is the service's base URL, "http://127.0.0.1:PORT", with no
	// trailing slash.
	URL string
	// Service is the handler being served.
	Service *Service

	srv       *http.Server
	served    chan struct{} // closed when Serve has returned
	closeOnce sync.Once
	closeErr  error

	mu   sync.Mutex
	stop func() bool // stops the context watch; nil until Start has set it
}

// Start opens the service called name (as New does) and serves it on
// 127.0.0.1 on a free port. It returns once the port is listening. The
// service runs until Close, or until ctx ends, which closes it as Close
// does. Errors are New's, or the listener's.
func Start(ctx context.Context, name string, opts Options) (*Running, error) {
	svc, err := New(name, opts)
	if err != nil {
		return nil, err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		_ = svc.Close()
		return nil, fmt.Errorf("demo %s: listen: %w", name, err)
	}
	r := &Running{
		URL:     "http://" + ln.Addr().String(),
		Service: svc,
		srv: &http.Server{
			Handler:           svc,
			ReadHeaderTimeout: 10 * time.Second,
			ErrorLog:          slog.NewLogLogger(svc.log.Handler(), slog.LevelWarn),
		},
		served: make(chan struct{}),
	}
	go func() {
		defer close(r.served)
		_ = r.srv.Serve(ln) // returns ErrServerClosed after Shutdown or Close
	}()
	stop := context.AfterFunc(ctx, func() { _ = r.Close() })
	r.mu.Lock()
	r.stop = stop
	r.mu.Unlock()
	return r, nil
}

// Stats returns the service's counters; see Service.Stats.
func (r *Running) Stats() Stats { return r.Service.Stats() }

// Close stops listening, waits up to 5s for requests in progress (then cuts
// their connections), and closes the service. Idempotent: later calls
// return the first call's error.
func (r *Running) Close() error {
	r.closeOnce.Do(func() {
		r.mu.Lock()
		if r.stop != nil {
			r.stop()
		}
		r.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		err := r.srv.Shutdown(ctx)
		if errors.Is(err, context.DeadlineExceeded) {
			err = r.srv.Close()
		}
		<-r.served
		r.closeErr = errors.Join(err, r.Service.Close())
	})
	return r.closeErr
}
