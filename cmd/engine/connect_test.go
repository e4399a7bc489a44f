package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/cli"
	"github.com/waymark-dev/waymark/internal/natsserver"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// freeAddr returns a loopback address no one listens on (yet).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// engineCLI runs the engine CLI in this process against natsURL and
// returns its output and the exit code the binary would return.
func engineCLI(t *testing.T, ctx context.Context, natsURL string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	cmd := cli.NewEngineCommand(&out, &errOut)
	cmd.SetArgs(append(args, "--nats-url", natsURL))
	if err := cmd.ExecuteContext(ctx); err != nil {
		code = 1
		var ee *cli.ExitError
		if errors.As(err, &ee) {
			code = ee.Code
		}
		errOut.WriteString("error: " + err.Error() + "\n")
	}
	return out.String(), errOut.String(), code
}

// writeWorkflow writes a workflow file into a temporary directory.
func writeWorkflow(t *testing.T, src string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "workflow.yaml")
	if err := os.WriteFile(path, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// storeOn opens the layout on the server at url over a new connection.
func storeOn(t *testing.T, srv *natsserver.Server) *kv.Store {
	t.Helper()
	nc, js, err := srv.JetStream(t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := kv.Open(ctx, js, crashKV, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// waitStatus polls job's checkpoint until it has status.
func waitStatus(t *testing.T, st *kv.Store, job string, status schemas.JobStatus, timeout time.Duration) *schemas.Checkpoint {
	t.Helper()
	var last *schemas.Checkpoint
	var lastErr error
	testsupport.Eventually(t, timeout, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		e, err := st.Checkpoints.Get(ctx, job)
		last, lastErr = e.Checkpoint, err
		return err == nil && last.Status == status
	}, "job %s never reached %s (last: %v)", job, status, lazyStatus{&last, &lastErr})
	return last
}

type lazyStatus struct {
	cp  **schemas.Checkpoint
	err *error
}

func (l lazyStatus) String() string {
	if *l.err != nil {
		return (*l.err).Error()
	}
	if *l.cp == nil {
		return "none"
	}
	return string((*l.cp).Status)
}

const noopFlow = `name: noop-flow
version: 1
steps:
  - id: only
    kind: noop
    with: {output: {done: true}}
    save_as: only
`

// TestLongRunningProcessesWaitForTheServer: a worker and `engine serve
// --nats-url` started before their server is reachable keep retrying with
// backoff, say so in their logs with the URL and the next delay, and
// serve a job once the server comes up on the port they wait for.
func TestLongRunningProcessesWaitForTheServer(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	url := "nats://" + addr
	worker := spawn(t, nil, testsupport.Binary(t, "worker"), "--nats-url", url)
	eng := spawn(t, nil, testsupport.Binary(t, "engine"), "serve", "--nats-url", url, "--http=", "--workers=0")
	for name, p := range map[string]*proc{"worker": worker, "engine serve": eng} {
		testsupport.Eventually(t, 20*time.Second, func() bool {
			log := p.errOut.String()
			// The first line, then at least one retry with its attempt number.
			return strings.Contains(log, `msg="NATS server not reachable; waiting for it, retrying with backoff" url=`+url) &&
				strings.Contains(log, `msg="NATS server not reachable; retrying" url=`+url+" attempt=1 retry_in=")
		}, "%s does not log its retries with the URL and the next delay:\n%s", name, lazy(p.errOut.String))
		select {
		case <-p.done:
			t.Fatalf("%s exited while the server was down: %v\n%s", name, p.err, p.errOut.String())
		default:
		}
	}

	srv, err := natsserver.Start(natsserver.Config{DataDir: t.TempDir(), Listen: addr, Sync: natsserver.SyncInterval})
	if err != nil {
		t.Fatalf("start the server on %s: %v", addr, err)
	}
	t.Cleanup(func() { srv.Stop(context.Background()) })
	for name, p := range map[string]*proc{"worker": worker, "engine": eng} {
		testsupport.Eventually(t, 20*time.Second, func() bool {
			return strings.Contains(p.errOut.String(), `msg="connected to NATS"`)
		}, "%s never connected:\n%s", name, lazy(p.errOut.String))
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		return strings.Contains(worker.out.String(), "worker serving pool")
	}, "the worker never started serving:\n%s", lazy(worker.errOut.String))

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if out, errOut, code := engineCLI(t, ctx, url, "start", writeWorkflow(t, noopFlow), "--job-id", "late-server"); code != 0 {
		t.Fatalf("engine start: exit %d\n%s%s", code, out, errOut)
	}
	cp := waitStatus(t, storeOn(t, srv), "late-server", schemas.JobCompleted, 30*time.Second)
	if !strings.Contains(string(cp.State), `"done":true`) {
		t.Errorf("final state %s lacks the step's output", cp.State)
	}
}

// lazy defers reading a log until a failure message needs it.
type lazy func() string

func (f lazy) String() string { return f() }

// TestOneShotCommandsFailFast: status against a server that is not there
// fails at once, saying where it looked and what to check.
func TestOneShotCommandsFailFast(t *testing.T) {
	t.Parallel()
	url := "nats://" + freeAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	_, errOut, code := engineCLI(t, ctx, url, "status", "some-job")
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("status took %v to give up", took)
	}
	if code != 1 || !strings.Contains(errOut, "connect to NATS at "+url) || !strings.Contains(errOut, "--nats-url") {
		t.Errorf("status: exit %d, stderr %q; want 1 and a message naming the URL and --nats-url", code, errOut)
	}
}

// TestWorkerStopsWhileWaiting: a worker asked to stop while it waits for
// its server exits 0 at once.
func TestWorkerStopsWhileWaiting(t *testing.T) {
	t.Parallel()
	url := "nats://" + freeAddr(t)
	w := spawn(t, nil, testsupport.Binary(t, "worker"), "--nats-url", url)
	testsupport.Eventually(t, 20*time.Second, func() bool {
		return strings.Contains(w.errOut.String(), "NATS server not reachable")
	}, "the worker never said it was waiting:\n%s", lazy(w.errOut.String))
	if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.done:
	case <-time.After(10 * time.Second):
		t.Fatal("worker still running 10s after SIGTERM")
	}
	if w.err != nil {
		t.Errorf("worker exited with %v after SIGTERM while waiting; want 0", w.err)
	}
}
