package demo

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Service names, as Names, New and Start spell them.
const (
	NameMail     = "mail"     // unsafe: every call sends (NewMail)
	NamePayments = "payments" // idempotent by Idempotency-Key (NewPayments)
	NameRecords  = "records"  // lookup: write once per key, ask by key (NewRecords)
	NameTickets  = "tickets"  // idempotent by Idempotency-Key (NewTickets)
	NameVendors  = "vendors"  // pure: a read-only catalog (NewVendors)
)

// Names lists the services in alphabetical order: "mail", "payments",
// "records", "tickets", "vendors".
func Names() []string {
	return []string{NameMail, NamePayments, NameRecords, NameTickets, NameVendors}
}

// callsFile is the name of the journal of calls in a service's directory.
const callsFile = "calls.jsonl"

// Stats counts, per key, the calls a service received and the effects it
// performed. An effect is one performed request: a batch of tickets counts
// once. Keys are Idempotency-Key values (tickets, payments), record keys
// (records), or for mail the Idempotency-Key, else the X-Waymark-Effect-Key,
// else "-". A request with no usable key counts under "-".
type Stats struct {
	// Calls counts requests to the effect endpoint (POST for tickets,
	// payments and mail, PUT for records), whatever their outcome,
	// including injected 503s. Reads are not counted.
	Calls map[string]int `json:"calls"`
	// Effects counts effects performed. Derived from the data file at open,
	// so it is exact across restarts.
	Effects map[string]int `json:"effects"`
}

// Faults are the run-time faults of a service, as GET and POST /v1/_faults
// exchange them.
type Faults struct {
	// FailNext is how many of the next API requests answer 503 before doing
	// anything but counting the call.
	FailNext int `json:"fail_next"`
	// DropNext is how many of the next requests that perform an effect have
	// their connection closed without an answer after the effect is
	// persisted (as if Options.DropAfterCommit said true).
	DropNext int `json:"drop_next"`
}

// Service is one of the demo services: an http.Handler whose effects are
// persisted under Options.Dir before it answers. Its routes are under /v1/
// (see the package documentation and the New* constructors); every service
// also serves
//
//	GET  /v1/_stats   Stats as JSON
//	GET  /v1/_faults  Faults as JSON
//	POST /v1/_faults  set Faults from a JSON body; answers the new Faults
//
// which are neither counted nor subject to faults. A Service starts no
// goroutine and is safe for concurrent use. After Close every request
// answers 503.
type Service struct {
	name string
	opts Options
	log  *slog.Logger
	kind kind

	mu       sync.Mutex
	closed   bool
	calls    *journal
	callN    map[string]int
	effectN  map[string]int
	inflight map[string]struct{} // keys claimed by a request being processed
	failNext int
	dropNext int
}

// kind is what one service adds to the shared machinery.
type kind interface {
	// open reads the kind's data file under dir and adds its effects to s.
	open(s *Service, dir string) error
	// effectKey reports whether r is a request to the effect endpoint, and
	// the key its call counts under.
	effectKey(r *http.Request) (key string, ok bool)
	// serve answers r (any path except /v1/_*).
	serve(w http.ResponseWriter, r *http.Request)
	// close closes the data file. Called with s.mu held.
	close() error
}

// New opens the service called name (one of Names) on opts.Dir. Errors:
// ErrUnknownService, an invalid Options field, a directory or file that
// cannot be opened, or ErrCorrupt naming the file and line.
func New(name string, opts Options) (*Service, error) {
	var k kind
	switch name {
	case NameMail:
		k = &mail{}
	case NamePayments:
		k = &payments{}
	case NameRecords:
		k = &records{}
	case NameTickets:
		k = &tickets{}
	case NameVendors:
		k = vendors{}
	default:
		return nil, fmt.Errorf("%w %q; known: %s", ErrUnknownService, name, strings.Join(Names(), ", "))
	}
	opts = opts.WithDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	_, statErr := os.Stat(opts.Dir)
	if err := os.MkdirAll(opts.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("demo %s: create directory: %w", name, err)
	}
	if errors.Is(statErr, fs.ErrNotExist) {
		// A new directory's entry must be durable before the files in it.
		if err := syncDir(filepath.Dir(filepath.Clean(opts.Dir))); err != nil {
			return nil, fmt.Errorf("demo %s: %w", name, err)
		}
	}
	s := &Service{
		name:     name,
		opts:     opts,
		log:      opts.Logger.With("service", name),
		kind:     k,
		callN:    map[string]int{},
		effectN:  map[string]int{},
		inflight: map[string]struct{}{},
		failNext: opts.FailNext,
	}
	if err := s.openCalls(); err != nil {
		return nil, fmt.Errorf("demo %s: %w", name, err)
	}
	if err := k.open(s, opts.Dir); err != nil {
		_ = s.calls.close()
		return nil, fmt.Errorf("demo %s: %w", name, err)
	}
	return s, nil
}

// callRecord is one line of calls.jsonl.
type callRecord struct {
	Key string    `json:"key"`
	At  time.Time `json:"at"`
}

func (s *Service) openCalls() error {
	path := filepath.Join(s.opts.Dir, callsFile)
	j, err := replayJournal(s, path, func(_ line, c callRecord) error {
		s.callN[c.Key]++
		return nil
	})
	s.calls = j
	return err
}

// repaired logs that open cut an unacknowledged tail off path.
func (s *Service) repaired(path, what string) {
	s.log.Warn("cut off an unacknowledged tail", "file", path, "what", what)
}

// Name returns the service's name, one of Names.
func (s *Service) Name() string { return s.name }

// Stats returns a copy of the counters. Safe to call at any time, also
// after Close.
func (s *Service) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Stats{Calls: maps.Clone(s.callN), Effects: maps.Clone(s.effectN)}
}

// FailNext makes the next n API requests answer 503 (CodeUnavailable)
// before doing anything but counting the call. It replaces any earlier
// count; 0 disarms it.
func (s *Service) FailNext(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failNext = max(n, 0)
}

// DropNext makes the next n requests that perform an effect lose their
// answer: the effect is persisted, then the connection is closed. It
// replaces any earlier count; 0 disarms it. Options.DropAfterCommit is
// consulted first and does not use up the count.
func (s *Service) DropNext(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropNext = max(n, 0)
}

// Close closes the service's files. Requests still running finish with 503
// and without effect if they had not yet committed. Idempotent.
func (s *Service) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	return errors.Join(s.kind.close(), s.calls.close())
}

// ServeHTTP answers one request; see Service and the New* constructors for
// the routes.
func (s *Service) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/v1/_stats":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			methodNotAllowed(w, "GET, HEAD")
			return
		}
		writeJSON(w, http.StatusOK, s.Stats())
		return
	case "/v1/_faults":
		s.serveFaults(w, r)
		return
	}
	if key, ok := s.kind.effectKey(r); ok {
		if err := s.countCall(key); err != nil {
			writeError(w, err)
			return
		}
	}
	if s.takeFailure() {
		writeError(w, errorf(http.StatusServiceUnavailable, CodeUnavailable, "injected failure (FailNext): nothing was done; retry"))
		return
	}
	s.kind.serve(w, r)
}

func (s *Service) serveFaults(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet, http.MethodHead:
	case http.MethodPost:
		data, herr := readBody(w, r)
		if herr != nil {
			writeError(w, herr)
			return
		}
		var f Faults
		if herr := decodeObject(data, &f); herr != nil {
			writeError(w, herr)
			return
		}
		if f.FailNext < 0 || f.DropNext < 0 {
			writeError(w, badRequest("fail_next and drop_next must be >= 0; got %d and %d", f.FailNext, f.DropNext))
			return
		}
		s.mu.Lock()
		s.failNext, s.dropNext = f.FailNext, f.DropNext
		s.mu.Unlock()
	default:
		methodNotAllowed(w, "GET, HEAD, POST")
		return
	}
	s.mu.Lock()
	f := Faults{FailNext: s.failNext, DropNext: s.dropNext}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, f)
}

func (s *Service) countCall(key string) *httpError {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errClosed()
	}
	if err := s.calls.append(callRecord{Key: key, At: s.opts.Now().UTC()}); err != nil {
		s.log.Error("count call", "key", key, "err", err)
		return errorf(http.StatusInternalServerError, CodeInternal, "record call: %v", err)
	}
	s.callN[key]++
	return nil
}

func (s *Service) takeFailure() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failNext > 0 {
		s.failNext--
		return true
	}
	return false
}

func (s *Service) takeDrop(key string) bool {
	if f := s.opts.DropAfterCommit; f != nil && f(key) {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dropNext > 0 {
		s.dropNext--
		return true
	}
	return false
}

func errClosed() *httpError {
	return errorf(http.StatusServiceUnavailable, CodeUnavailable, "service is closed: nothing was done")
}

// outcome is the answer to an effect request.
type outcome struct {
	status    int
	body      []byte
	replayed  bool // set Idempotent-Replayed: true
	performed bool // this request performed the effect
}

// effect is one request to an effect endpoint, validated.
type effect struct {
	key string
	// exclusive claims key while the request runs: another request with it
	// meanwhile gets 409.
	exclusive bool
	// decided, run with s.mu held before the key is claimed, answers a
	// request whose outcome is already known (a replay, a mismatch, an
	// existing record). Nil or false lets it proceed.
	decided func() (outcome, *httpError, bool)
	// commit, run with s.mu held, performs and persists the effect and
	// updates the kind's state. It must leave no trace when it fails.
	commit func() (outcome, error)
}

// run takes e through the idempotency gate, the hooks and the faults. It is
// the one place effects are performed.
func (s *Service) run(w http.ResponseWriter, r *http.Request, e effect) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		writeError(w, errClosed())
		return
	}
	if e.decided != nil {
		if out, herr, ok := e.decided(); ok {
			s.mu.Unlock()
			if herr != nil {
				writeError(w, herr)
				return
			}
			respond(w, out)
			return
		}
	}
	if e.exclusive {
		if _, busy := s.inflight[e.key]; busy {
			s.mu.Unlock()
			writeError(w, errorf(http.StatusConflict, CodeIdempotencyKeyInUse,
				"a request with key %q is still being processed; retry later with the same key", e.key))
			return
		}
		s.inflight[e.key] = struct{}{}
		defer func() {
			s.mu.Lock()
			delete(s.inflight, e.key)
			s.mu.Unlock()
		}()
	}
	s.mu.Unlock()

	if hook := s.opts.BeforeCommit; hook != nil {
		hook(e.key)
	}

	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		writeError(w, errClosed())
		return
	}
	out, err := e.commit()
	if err == nil && out.performed {
		s.effectN[e.key]++
	}
	s.mu.Unlock()
	if err != nil {
		s.log.Error("perform effect", "key", e.key, "err", err)
		writeError(w, errorf(http.StatusInternalServerError, CodeInternal, "persist effect for key %q: %v; nothing was done", e.key, err))
		return
	}
	if !out.performed {
		respond(w, out)
		return
	}
	s.log.Info("effect performed", "key", e.key, "status", out.status)
	if d := s.opts.Delay; d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return // the client is gone; the effect stands
		}
	}
	if s.takeDrop(e.key) {
		s.log.Info("dropping the connection after commit", "key", e.key)
		dropConnection(w)
		return
	}
	respond(w, out)
}

func respond(w http.ResponseWriter, out outcome) {
	if out.replayed {
		w.Header().Set(ReplayedHeader, "true")
	}
	writeBody(w, out.status, out.body)
}

// dropConnection closes the client's connection without an answer. Where
// the connection cannot be hijacked (HTTP/2, a recorder) it aborts the
// response with http.ErrAbortHandler, which net/http turns into a reset
// without logging.
func dropConnection(w http.ResponseWriter) {
	if hj, ok := w.(http.Hijacker); ok {
		if conn, _, err := hj.Hijack(); err == nil {
			_ = conn.Close()
			return
		}
	}
	panic(http.ErrAbortHandler)
}

func methodNotAllowed(w http.ResponseWriter, allow string) {
	w.Header().Set("Allow", allow)
	writeError(w, errorf(http.StatusMethodNotAllowed, CodeMethodNotAllowed, "method not allowed; allowed: %s", allow))
}

func notFound(w http.ResponseWriter, r *http.Request) {
	writeError(w, errorf(http.StatusNotFound, CodeNotFound, "no route %s %s", r.Method, r.URL.Path))
}

// requestBase is the URL prefix for URLs handed out in answer to r.
func (s *Service) requestBase(r *http.Request) string {
	if s.opts.BaseURL != "" {
		return s.opts.BaseURL
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	return scheme + "://" + r.Host
}

// stored is a committed answer kept for replay.
type stored struct {
	fp   string // fingerprint of the request that produced it
	body []byte // the answer's body, byte for byte
}

// replay is the decided step of the idempotent services: a stored key with
// the same fingerprint replays its answer with 200, another fingerprint is
// 422, an unknown key proceeds. Call it with s.mu held.
func replay(replays map[string]stored, key, fp string) func() (outcome, *httpError, bool) {
	return func() (outcome, *httpError, bool) {
		st, ok := replays[key]
		switch {
		case !ok:
			return outcome{}, nil, false
		case st.fp != fp:
			return outcome{}, errorf(http.StatusUnprocessableEntity, CodeIdempotencyKeyReused,
				"%s %q was already used with a different request body; nothing was done (a new request needs a new key)",
				IdempotencyKeyHeader, key), true
		}
		return outcome{status: http.StatusOK, body: st.body, replayed: true}, nil, true
	}
}

// pathID returns the unescaped last part of r's path after prefix, or ""
// when there is none or it does not unescape.
func pathID(r *http.Request, prefix string) string {
	rest, ok := strings.CutPrefix(r.URL.EscapedPath(), prefix)
	if !ok {
		return ""
	}
	id, err := url.PathUnescape(rest)
	if err != nil {
		return ""
	}
	return id
}

// serveItem answers GET or HEAD base{id} with the item lookup finds (run
// with s.mu held), 404 naming the noun when there is none, 405 for other
// methods.
func serveItem[T any](w http.ResponseWriter, r *http.Request, s *Service, base, noun string, lookup func(id string) (T, bool)) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		methodNotAllowed(w, "GET, HEAD")
		return
	}
	id := pathID(r, base)
	s.mu.Lock()
	item, ok := lookup(id)
	s.mu.Unlock()
	if !ok {
		writeError(w, errorf(http.StatusNotFound, CodeNotFound, "no %s %q", noun, id))
		return
	}
	writeJSON(w, http.StatusOK, item)
}
