package providers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// recorderName is the Provider of the *Error a recorder returns itself.
const recorderName = "recorder"

// cassetteLocks holds one mutex per cassette file (by absolute path), so
// recorders sharing a file in one process do not lose each other's writes.
var cassetteLocks sync.Map // string -> *sync.Mutex

type recorder struct {
	live Provider
	path string
	mu   *sync.Mutex
	bad  *Error // from the constructor; every call returns it
}

// NewRecorder returns a Provider that calls live and records each
// successful reply into the cassette file at path, for NewReplay to
// answer later. The file is created (with its directory) when missing. A
// reply (with its tool calls) is appended to the interaction with the
// same step, turn and PromptHash, or starts a new interaction with the
// request's turn (omitted when 0) and model; so replaying attempt n
// returns the n-th reply recorded for that prompt or conversation turn.
// Delete the file to record afresh.
//
// The request is passed to live as it is, Request.OnText included, so a
// streamed call streams through the recorder; the cassette holds the
// final reply only, and replays in pieces as NewReplay says.
//
// Failed live calls are returned as they are and not recorded. A request
// without a Step, an unreadable or invalid existing cassette, or a failed
// write returns a non-retryable *Error with Provider "recorder"; when the
// write fails, the live call has already been made. Each write replaces
// the file atomically (a temporary file renamed over it). Safe for
// concurrent use within one process, also by several recorders on one
// path; separate processes must not record to the same file at once.
func NewRecorder(live Provider, path string) Provider {
	r := &recorder{live: live}
	abs, err := filepath.Abs(path)
	switch {
	case live == nil:
		r.bad = nonRetryable(recorderName, nil, "no live provider to record from")
	case path == "":
		r.bad = nonRetryable(recorderName, nil, "empty cassette path")
	case err != nil:
		r.bad = nonRetryable(recorderName, err, "cassette path %q: %v", path, err)
	}
	if r.bad != nil {
		return r
	}
	mu, _ := cassetteLocks.LoadOrStore(abs, &sync.Mutex{})
	r.path, r.mu = abs, mu.(*sync.Mutex)
	return r
}

func (r *recorder) Complete(ctx context.Context, req Request) (Reply, error) {
	if r.bad != nil {
		return Reply{}, r.bad
	}
	if req.Step == "" {
		return Reply{}, nonRetryable(recorderName, nil, "request has no step id, and a cassette answers by step")
	}
	reply, err := r.live.Complete(ctx, req)
	if err != nil {
		return reply, err
	}
	if err := r.record(req, reply); err != nil {
		return Reply{}, nonRetryable(recorderName, err, "record step %q to %s: %v", req.Step, r.path, err)
	}
	return reply, nil
}

// record merges one reply into the cassette file.
func (r *recorder) record(req Request, reply Reply) error {
	r.mu.Lock()
	defer r.mu.Unlock()

	c := &Cassette{Version: CassetteVersion}
	data, err := os.ReadFile(r.path)
	switch {
	case err == nil:
		if c, err = ParseCassette(data); err != nil {
			return fmt.Errorf("existing cassette: %w", err)
		}
	case !errors.Is(err, fs.ErrNotExist):
		return err
	}

	hash := PromptHash(req)
	merged := false
	for i := range c.Interactions {
		in := &c.Interactions[i]
		if in.Step == req.Step && in.Turn == req.Turn && strings.EqualFold(in.PromptSHA256, hash) {
			in.Replies = append(in.Replies, reply)
			merged = true
			break
		}
	}
	if !merged {
		c.Interactions = append(c.Interactions, Interaction{Step: req.Step, Turn: req.Turn, PromptSHA256: hash, Model: req.Model, Replies: []Reply{reply}})
	}

	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	// Cassettes are read and edited by people; keep <, > and & as they are.
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(c); err != nil {
		return fmt.Errorf("encode cassette: %w", err)
	}
	return writeFileAtomic(r.path, buf.Bytes())
}

// writeFileAtomic replaces path with data so that a reader sees the old
// file or the new one, never a torn write.
func writeFileAtomic(path string, data []byte) (err error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.Write(data); err != nil {
		return err
	}
	if err = tmp.Sync(); err != nil {
		return err
	}
	if err = tmp.Chmod(0o644); err != nil {
		return err
	}
	if err = tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
