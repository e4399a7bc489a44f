package notify

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding/format"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"

	"github.com/waymark-dev/waymark/kv"
)

// Defaults of SinkConfig.
const (
	// DefaultSinkTimeout bounds one webhook request.
	DefaultSinkTimeout = 10 * time.Second
	// DefaultSinkMinBackoff is the delay before an event's second attempt.
	DefaultSinkMinBackoff = time.Second
	// DefaultSinkMaxBackoff caps the delay between two attempts.
	DefaultSinkMaxBackoff = 5 * time.Minute
	// DefaultSinkMaxAttempts is how many deliveries a history message gets
	// before the sink gives up on the event it is at.
	DefaultSinkMaxAttempts = 15
	// DefaultSinkMaxAge gives up on events stored longer ago than this.
	DefaultSinkMaxAge = 24 * time.Hour
	// DefaultSinkConcurrency is how many history messages one engine
	// delivers at once per sink.
	DefaultSinkConcurrency = 4
)

// SinkConsumer is the name of sink name's durable consumer on the history
// stream for prefix: <prefix>-sink-<name>.
func SinkConsumer(prefix, name string) string { return prefix + "-sink-" + name }

// SinkConfig configures a webhook Sink.
type SinkConfig struct {
	// Store is the deployment's store. Required.
	Store *kv.Store
	// Name names the sink and its consumer (SinkConsumer): 1 to 32
	// lower-case letters, digits, '-' and '_', starting with a letter or
	// digit. Required.
	Name string
	// URL receives a POST per event: http or https. Required.
	URL string
	// Secret signs every request (Standard Webhooks, "whsec_" and the
	// base64 of 24 to 64 random bytes). Required; never logged.
	Secret string
	// Types are the event types sent (ParseTypes); empty means
	// DefaultTypes.
	Types []string
	// Timeout bounds one request. Default DefaultSinkTimeout.
	Timeout time.Duration
	// MinBackoff is the delay before the second attempt of an event; each
	// later one doubles it, up to MaxBackoff. A Retry-After header (in
	// seconds) of an answer retried asks for a longer delay (up to MaxBackoff).
	// Defaults DefaultSinkMinBackoff and DefaultSinkMaxBackoff.
	MinBackoff, MaxBackoff time.Duration
	// MaxAttempts is how many deliveries of a history message the sink
	// makes before it gives up on the event it is at. Default
	// DefaultSinkMaxAttempts (about 34 minutes of retries with the default
	// backoff); -1 for no limit.
	MaxAttempts int
	// MaxAge gives up on an event whose history message was stored longer
	// ago than this. Default DefaultSinkMaxAge; -1 for no limit.
	MaxAge time.Duration
	// Concurrency is how many history messages this engine delivers at
	// once for the sink. Default DefaultSinkConcurrency.
	Concurrency int
	// AckWait is the consumer's ack wait when the sink creates it; it
	// must exceed Timeout. Default DefaultAckWait.
	AckWait time.Duration
	// Client sends the requests; nil means a client with Timeout that
	// does not follow redirects.
	Client *http.Client
	// Logger; nil means slog.Default().
	Logger *slog.Logger
}

var sinkNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,31}$`)

// WithDefaults returns c with every zero field set to its default.
func (c SinkConfig) WithDefaults() SinkConfig {
	if c.Timeout == 0 {
		c.Timeout = DefaultSinkTimeout
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = DefaultSinkMinBackoff
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = DefaultSinkMaxBackoff
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultSinkMaxAttempts
	}
	if c.MaxAge == 0 {
		c.MaxAge = DefaultSinkMaxAge
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultSinkConcurrency
	}
	if c.AckWait == 0 {
		c.AckWait = max(DefaultAckWait, 2*c.Timeout)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports the first bad field of c (after WithDefaults) but
// Store, naming the sink. It never quotes the secret, nor the URL's user
// info or query.
func (c SinkConfig) Validate() error {
	where := fmt.Sprintf("webhook %q", c.Name)
	u, uerr := url.Parse(c.URL)
	switch {
	case !sinkNameRE.MatchString(c.Name):
		return fmt.Errorf("%s: name: want 1-32 lower-case letters, digits, '-' or '_', starting with a letter or digit", where)
	case uerr != nil:
		return fmt.Errorf("%s: url: %w", where, uerr)
	case u.Scheme != "http" && u.Scheme != "https" || u.Host == "":
		return fmt.Errorf("%s: url %q: want http:// or https:// and a host", where, redactURL(u))
	case c.Timeout < 0, c.MinBackoff < 0, c.MaxBackoff < c.MinBackoff:
		return fmt.Errorf("%s: timeout %v, backoff %v..%v: want positive durations, min backoff at most max", where, c.Timeout, c.MinBackoff, c.MaxBackoff)
	case c.MaxAttempts < 1 && c.MaxAttempts != -1:
		return fmt.Errorf("%s: max attempts %d: want at least 1, or -1 for no limit", where, c.MaxAttempts)
	case c.MaxAge < 0 && c.MaxAge != -1:
		return fmt.Errorf("%s: max age %v: want positive, or -1 for no limit", where, c.MaxAge)
	case c.Concurrency < 1:
		return fmt.Errorf("%s: concurrency %d: want at least 1", where, c.Concurrency)
	case c.AckWait <= c.Timeout:
		return fmt.Errorf("%s: ack wait %v: want more than the request timeout %v", where, c.AckWait, c.Timeout)
	}
	if err := CheckSecret(c.Secret); err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	if _, err := ParseTypes(c.Types); err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	return nil
}

// CheckSecret reports whether secret is a Standard Webhooks signing
// secret: "whsec_" and the standard base64 of 24 to 64 bytes. Its error
// never quotes the secret.
func CheckSecret(secret string) error {
	rest, ok := strings.CutPrefix(strings.TrimSpace(secret), "whsec_")
	if !ok {
		return errors.New("secret: want whsec_ and base64 (Standard Webhooks)")
	}
	key, err := base64.StdEncoding.DecodeString(rest)
	if err != nil {
		return errors.New("secret: the part after whsec_ is not standard base64")
	}
	if len(key) < 24 || len(key) > 64 {
		return fmt.Errorf("secret: %d bytes after base64 decoding: want 24 to 64", len(key))
	}
	return nil
}

// redactURL is u without its user info and query, which may hold
// credentials: what logs and errors show of a sink's URL.
func redactURL(u *url.URL) string {
	if u == nil {
		return ""
	}
	r := *u
	r.User, r.RawQuery, r.Fragment = nil, "", ""
	return r.String()
}

// Sink delivers lifecycle events of the history stream to one HTTP
// endpoint, one POST per event in the CloudEvents structured content mode
// (Content-Type application/cloudevents+json, the body the event's JSON
// format as sdk-go marshals it), signed with the Standard Webhooks scheme:
// webhook-id is the CloudEvent id (the same on every retry: the receiver
// deduplicates on it), webhook-timestamp the attempt's Unix seconds, and
// webhook-signature "v1,<base64 HMAC-SHA256 of id.timestamp.body>".
//
// Each sink reads its own durable consumer (SinkConsumer), shared by every
// engine that runs the sink, so a slow or failing endpoint delays only
// its own events. A 2xx answer is delivery. 408, 429, any 5xx and errors
// without an answer are retried: the history message is delivered again
// after MinBackoff·2^(n-1), at most MaxBackoff (NakWithDelay), and the
// events of it already delivered by this engine are not sent again. Any
// other answer is a permanent failure: logged, counted, and the event is
// skipped. After MaxAttempts deliveries, or once the message is older
// than MaxAge, the sink gives up on the event (logged, counted); the
// events after it in the same history message then get one attempt each. A message
// with a skipped or given-up event is ended with TermWithReason, so
// JetStream publishes its MSG_TERMINATED advisory
// ($JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.<stream>.<consumer>): the
// dead-letter record. Safe for concurrent use.
type Sink struct {
	cfg   SinkConfig
	types typeSet
	wh    *standardwebhooks.Webhook
	log   *slog.Logger

	delivered, retried, failed, givenUp atomic.Uint64

	// progress: for a history message this engine delivered part of
	// (by stream sequence), how many of its events went through.
	mu       sync.Mutex
	progress map[uint64]int
}

// SinkStats are a Sink's counters since it started.
type SinkStats struct {
	Delivered uint64 `json:"delivered"` // events answered 2xx
	Retried   uint64 `json:"retried"`   // attempts that failed and are tried again
	Failed    uint64 `json:"failed"`    // events answered with a permanent failure (4xx other than 408, 429)
	GivenUp   uint64 `json:"given_up"`  // events given up after MaxAttempts or MaxAge
}

// NewSink checks cfg (SinkConfig.Validate, and that it has a Store) and
// returns a Sink; Run starts it.
func NewSink(cfg SinkConfig) (*Sink, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Store == nil {
		return nil, fmt.Errorf("webhook %q: config has no Store", cfg.Name)
	}
	cfg.Types, _ = ParseTypes(cfg.Types)
	wh, err := standardwebhooks.NewWebhook(strings.TrimSpace(cfg.Secret))
	if err != nil {
		return nil, fmt.Errorf("webhook %q: secret: not valid base64", cfg.Name)
	}
	if cfg.Client == nil {
		// A redirect is answered as it is (a 3xx: permanent), not followed:
		// the signed body goes only to the URL the operator gave.
		cfg.Client = &http.Client{Timeout: cfg.Timeout, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	u, _ := url.Parse(cfg.URL)
	return &Sink{cfg: cfg, types: newTypeSet(cfg.Types), wh: wh, progress: map[uint64]int{},
		log: cfg.Logger.With("component", "webhook", "sink", cfg.Name, "url", redactURL(u))}, nil
}

// Name returns the sink's name.
func (s *Sink) Name() string { return s.cfg.Name }

// Stats returns a snapshot of the sink's counters. Safe for concurrent use.
func (s *Sink) Stats() SinkStats {
	return SinkStats{Delivered: s.delivered.Load(), Retried: s.retried.Load(), Failed: s.failed.Load(), GivenUp: s.givenUp.Load()}
}

// Open makes sure the sink's consumer exists (creating it when absent:
// from then on the history stream's events are posted) and returns it;
// Run calls it. Safe to call more than once.
func (s *Sink) Open(ctx context.Context) (jetstream.Consumer, error) {
	st := s.cfg.Store
	return consumerFor(ctx, st, SinkConsumer(st.Config.Prefix, s.cfg.Name), "Waymark engines: lifecycle events posted to webhook "+s.cfg.Name,
		s.cfg.AckWait, 64*s.cfg.Concurrency, s.log)
}

// Run delivers until ctx is done, then returns nil once the deliveries in
// flight ended (a request cut short by ctx leaves its message to be
// delivered again at once, by this engine or another). It returns an
// error when the consumer cannot be opened or consumed.
func (s *Sink) Run(ctx context.Context) error {
	cons, err := s.Open(ctx)
	if err != nil {
		return err
	}
	name := SinkConsumer(s.cfg.Store.Config.Prefix, s.cfg.Name)
	sem := make(chan struct{}, s.cfg.Concurrency)
	var wg sync.WaitGroup
	cc, err := cons.Consume(func(m jetstream.Msg) {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			_ = m.Nak()
			return
		}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			s.handle(ctx, m)
		}()
	}, jetstream.PullMaxMessages(2*s.cfg.Concurrency),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if ctx.Err() == nil && !errors.Is(err, nats.ErrConnectionClosed) {
				s.log.Warn("consume history", "consumer", name, "err", err)
			}
		}))
	if err != nil {
		return fmt.Errorf("consume %s: %w", name, err)
	}
	<-ctx.Done()
	cc.Stop()
	wg.Wait()
	return nil
}

// outcome of one delivery.
type outcome int

const (
	delivered outcome = iota
	retry
	permanent
)

func (s *Sink) handle(ctx context.Context, m jetstream.Msg) {
	body := m.Data()
	if !s.types.mayHold(body) {
		_ = m.Ack()
		return
	}
	meta, err := m.Metadata()
	if err != nil {
		_ = m.Nak()
		return
	}
	evs, err := s.types.decodeBatch(body)
	if err != nil {
		s.log.Error("history message is not a CloudEvents batch; skipped", "subject", m.Subject(), "err", err)
		_ = m.TermWithReason("not a CloudEvents batch")
		return
	}
	seq := meta.Sequence.Stream
	s.mu.Lock()
	start := s.progress[seq]
	s.mu.Unlock()
	var ended []string // events skipped or given up, for the termination reason
	for i := start; i < len(evs); i++ {
		e := &evs[i]
		// The message may have waited for a slot, and each event of it can
		// take a request timeout: keep it ours meanwhile.
		_ = m.InProgress()
		res, status, wait, err := s.deliver(ctx, e)
		switch res {
		case delivered:
			s.delivered.Add(1)
			continue
		case permanent:
			s.failed.Add(1)
			s.log.Error("webhook refused the event for good; skipped", "id", e.ID(), "type", e.Type(), "status", status)
			ended = append(ended, e.ID()+": HTTP "+strconv.Itoa(status))
			continue
		}
		if ctx.Err() != nil {
			s.forget(seq)
			_ = m.Nak() // shutting down: another engine takes it now
			return
		}
		attempts := int(meta.NumDelivered)
		old := s.cfg.MaxAge > 0 && time.Since(meta.Timestamp) > s.cfg.MaxAge
		if (s.cfg.MaxAttempts > 0 && attempts >= s.cfg.MaxAttempts) || old {
			s.givenUp.Add(1)
			s.log.Error("webhook delivery given up", "id", e.ID(), "type", e.Type(), "attempts", attempts, "stored", meta.Timestamp, "status", status, "err", err)
			ended = append(ended, e.ID()+": given up after "+strconv.Itoa(attempts)+" attempts")
			continue
		}
		s.retried.Add(1)
		delay := max(s.backoff(attempts), min(wait, s.cfg.MaxBackoff))
		s.log.Warn("webhook delivery failed; retrying", "id", e.ID(), "attempt", attempts, "status", status, "err", err, "retry_in", delay)
		s.mu.Lock()
		if len(s.progress) >= maxProgress {
			// Messages other engines finished leave entries behind; losing
			// them only sends a few events again.
			clear(s.progress)
		}
		s.progress[seq] = i
		s.mu.Unlock()
		_ = m.NakWithDelay(delay)
		return
	}
	s.forget(seq)
	if len(ended) > 0 {
		_ = m.TermWithReason("webhook " + s.cfg.Name + ": " + strings.Join(ended, "; "))
		return
	}
	_ = m.Ack()
}

// maxProgress bounds Sink.progress.
const maxProgress = 10000

func (s *Sink) forget(seq uint64) {
	s.mu.Lock()
	delete(s.progress, seq)
	s.mu.Unlock()
}

// backoff is the delay after the attempts-th failed delivery.
func (s *Sink) backoff(attempts int) time.Duration {
	d := s.cfg.MinBackoff
	for i := 1; i < attempts && d < s.cfg.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, s.cfg.MaxBackoff)
}

// deliver posts e once. wait is what a Retry-After header asked for.
func (s *Sink) deliver(ctx context.Context, e *event.Event) (res outcome, status int, wait time.Duration, err error) {
	body, err := format.JSON.Marshal(e)
	if err != nil {
		return permanent, 0, 0, fmt.Errorf("event %s in structured mode: %w", e.ID(), err)
	}
	now := time.Now()
	sig, err := s.wh.Sign(e.ID(), now, body)
	if err != nil {
		return permanent, 0, 0, fmt.Errorf("sign event %s: %w", e.ID(), err)
	}
	rctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, s.cfg.URL, bytes.NewReader(body))
	if err != nil {
		return permanent, 0, 0, err
	}
	req.Header.Set("Content-Type", event.ApplicationCloudEventsJSON)
	req.Header.Set(standardwebhooks.HeaderWebhookID, e.ID())
	req.Header.Set(standardwebhooks.HeaderWebhookTimestamp, strconv.FormatInt(now.Unix(), 10))
	req.Header.Set(standardwebhooks.HeaderWebhookSignature, sig)
	resp, err := s.cfg.Client.Do(req)
	if err != nil {
		// Keep the URL (which may hold credentials) out of the error.
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		return retry, 0, 0, err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	switch c := resp.StatusCode; {
	case c >= 200 && c < 300:
		return delivered, c, 0, nil
	case c == http.StatusRequestTimeout || c == http.StatusTooManyRequests || c >= 500:
		if n, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && n > 0 {
			wait = time.Duration(n) * time.Second
		}
		return retry, c, wait, nil
	default:
		return permanent, c, 0, nil
	}
}
