package demo

import (
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"time"
)

// Options configures one service. The zero value is invalid: Dir is
// required. Function fields are hooks for in-process tests; the plain fields
// can also come from a command line.
type Options struct {
	// Dir holds the service's files (its data file and calls.jsonl). It is
	// created (0o755) when absent. Required. Give each service its own
	// directory: two services in one directory would mix their call counts.
	Dir string

	// BaseURL prefixes the URLs the service hands out (a ticket's url), with
	// no trailing slash, such as "http://127.0.0.1:8080". Empty means derived
	// from each request: http://HOST, where HOST is the request's Host header.
	// A URL is stored with what it names, so a replay after a restart on
	// another port still returns the URL of the first answer.
	BaseURL string

	// Delay holds the answer to every request that performed an effect this
	// long after the effect was persisted, to simulate a provider whose
	// response arrives after the caller's timeout. Replays and errors are not
	// delayed. It ends early, with no answer, when the client goes away.
	// Zero means no delay; negative is invalid.
	Delay time.Duration

	// FailNext makes the first FailNext API requests answer 503 with code
	// CodeUnavailable before doing anything but counting the call. Zero means
	// none; negative is invalid. Service.FailNext re-arms it at run time.
	FailNext int

	// DropAfterCommit, when set, is asked with the effect key after each
	// effect is persisted (and after Delay); true makes the service hijack the
	// TCP connection and close it without answering: a lost response to a
	// request that did happen. It runs on the request's goroutine and must be
	// safe for concurrent use. Nil never drops (but see Service.DropNext).
	//
	// Beware of Go's own client: http.Transport silently resends a request
	// that carries an Idempotency-Key header (and a rewindable body) when a
	// reused keep-alive connection closes before the answer. The caller then
	// sees the second answer, not the loss. Use a fresh connection to observe
	// the drop.
	DropAfterCommit func(key string) bool

	// BeforeCommit, when set, runs with the effect key after the request was
	// validated and its key claimed (for the idempotent services and records:
	// a second request with the key now gets 409), just before the effect is
	// performed. The request waits for it to return. Tests use it to hold a
	// request in flight without timing. Nil means no hook.
	BeforeCommit func(key string)

	// Now is the clock for created_at and sent_at. Nil means time.Now.
	Now func() time.Time

	// Logger receives one line per effect and per repaired data file. Nil
	// discards.
	Logger *slog.Logger
}

// WithDefaults returns a copy of o with every unset defaulted field filled in
// (Now, Logger) and a trailing slash trimmed from BaseURL.
func (o Options) WithDefaults() Options {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	o.BaseURL = strings.TrimRight(o.BaseURL, "/")
	return o
}

// validate names the first bad field.
func (o Options) validate() error {
	if o.Dir == "" {
		return fmt.Errorf("demo options: Dir is required")
	}
	if o.Delay < 0 {
		return fmt.Errorf("demo options: Delay is %v; want >= 0", o.Delay)
	}
	if o.FailNext < 0 {
		return fmt.Errorf("demo options: FailNext is %d; want >= 0", o.FailNext)
	}
	if o.BaseURL != "" {
		u, err := url.Parse(o.BaseURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("demo options: BaseURL %q: want an absolute http or https URL", o.BaseURL)
		}
	}
	return nil
}
