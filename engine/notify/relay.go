package notify

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine/cenats"
	"github.com/waymark-dev/waymark/kv"
)

// Defaults of RelayConfig and SinkConfig.
const (
	// DefaultAckWait is how long a consumer waits for an engine to finish
	// with a history message before another engine gets it: the delay
	// before events an engine took and died with go out again.
	DefaultAckWait = 30 * time.Second
	// DefaultRelayPending caps the history messages the relay consumer
	// has delivered and not yet acknowledged, over all engines.
	DefaultRelayPending = 1000
)

// RelayConsumer is the name of the relay's durable consumer on the
// history stream for prefix: <prefix>-events-out.
func RelayConsumer(prefix string) string { return prefix + "-events-out" }

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Store is the deployment's store (its history stream and connection).
	// Required.
	Store *kv.Store
	// Types are the event types relayed, full names
	// (ParseTypes); nil or empty means DefaultTypes.
	Types []string
	// AckWait is the consumer's ack wait when the relay creates it.
	// Default DefaultAckWait; an existing consumer keeps its own.
	AckWait time.Duration
	// Logger; nil means slog.Default().
	Logger *slog.Logger
}

// Relay republishes lifecycle events of the history stream as single
// CloudEvents in binary mode (BinaryMessage) on Subject(prefix, type,
// job), by core NATS publishes: subscribers that are not connected miss
// them, as with any core subject; capture waymark.events.> in a stream of
// your own for durability (each message's Nats-Msg-Id is the event id, so
// the stream's duplicate window drops redeliveries). Any number of
// engines run a Relay on the one consumer RelayConsumer(prefix); each
// history message goes to one of them and is acknowledged after its events
// were published on the same connection (which delivers in order, so the
// server has routed them before it sees the ack). An engine that dies in
// between leaves the message to be delivered again after the ack wait,
// with the same event ids: at least once. Safe for concurrent use.
type Relay struct {
	cfg       RelayConfig
	types     typeSet
	log       *slog.Logger
	published atomic.Uint64
	errs      atomic.Uint64
}

// RelayStats are a Relay's counters since it started.
type RelayStats struct {
	Published uint64 `json:"published"` // events published
	Errors    uint64 `json:"errors"`    // history messages left for redelivery, or undecodable, after an error
}

// WithDefaults returns c with every zero field set to its default.
func (c RelayConfig) WithDefaults() RelayConfig {
	if c.AckWait == 0 {
		c.AckWait = DefaultAckWait
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports the first bad field of c (after WithDefaults).
func (c RelayConfig) Validate() error {
	if c.Store == nil {
		return errors.New("notify relay: config has no Store")
	}
	if c.AckWait < time.Second {
		return fmt.Errorf("notify relay: ack wait %v: want at least 1s", c.AckWait)
	}
	if _, err := ParseTypes(c.Types); err != nil {
		return fmt.Errorf("notify relay: %w", err)
	}
	return nil
}

// NewRelay checks cfg (RelayConfig.Validate) and returns a Relay; Run
// starts it.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Types, _ = ParseTypes(cfg.Types)
	return &Relay{cfg: cfg, types: newTypeSet(cfg.Types), log: cfg.Logger.With("component", "events-out")}, nil
}

// Stats returns a snapshot of the relay's counters. Safe for concurrent use.
func (r *Relay) Stats() RelayStats {
	return RelayStats{Published: r.published.Load(), Errors: r.errs.Load()}
}

// Types returns the event types the relay publishes.
func (r *Relay) Types() []string { return r.cfg.Types }

// Open makes sure the relay's consumer exists (creating it when absent:
// from then on the history stream's events are relayed, by whichever
// engine runs the relay) and returns it; Run calls it. Calling it before
// jobs start, as engine serve and engine run do, sends their first events
// too on a deployment's first start. Safe to call more than once.
func (r *Relay) Open(ctx context.Context) (jetstream.Consumer, error) {
	st := r.cfg.Store
	return consumerFor(ctx, st, RelayConsumer(st.Config.Prefix), "Waymark engines: lifecycle events republished as CloudEvents on "+st.Config.Prefix+".events.>",
		r.cfg.AckWait, DefaultRelayPending, r.log)
}

// Run relays until ctx is done, then returns nil once the messages it
// holds are finished (acknowledged, or left for redelivery). It returns an
// error when the consumer cannot be opened or consumed.
func (r *Relay) Run(ctx context.Context) error {
	cons, err := r.Open(ctx)
	if err != nil {
		return err
	}
	st := r.cfg.Store
	name := RelayConsumer(st.Config.Prefix)
	nc := st.JS.Conn()
	prefix := st.Config.Prefix
	cc, err := cons.Consume(func(m jetstream.Msg) { r.handle(ctx, nc, prefix, m) },
		jetstream.PullMaxMessages(256),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if ctx.Err() == nil && !errors.Is(err, nats.ErrConnectionClosed) {
				r.log.Warn("consume history", "consumer", name, "err", err)
			}
		}))
	if err != nil {
		return fmt.Errorf("consume %s: %w", name, err)
	}
	<-ctx.Done()
	cc.Drain()
	select {
	case <-cc.Closed():
	case <-time.After(5 * time.Second):
	}
	return nil
}

func (r *Relay) handle(ctx context.Context, nc *nats.Conn, prefix string, m jetstream.Msg) {
	body := m.Data()
	if !r.types.mayHold(body) {
		_ = m.Ack()
		return
	}
	evs, err := r.types.decodeBatch(body)
	if err != nil {
		// Not a CloudEvents batch: nothing later will make it one.
		r.errs.Add(1)
		r.log.Error("history message is not a CloudEvents batch; skipped", "subject", m.Subject(), "err", err)
		_ = m.TermWithReason("not a CloudEvents batch")
		return
	}
	for i := range evs {
		e := &evs[i]
		out, err := cenats.BinaryMessage(ctx, Subject(prefix, e.Type(), e.Subject()), e)
		if err == nil {
			err = nc.PublishMsg(out)
		}
		if err != nil {
			r.errs.Add(1)
			if ctx.Err() == nil {
				r.log.Warn("publish lifecycle event; the history message is delivered again", "id", e.ID(), "err", err)
			}
			_ = m.NakWithDelay(time.Second)
			return
		}
		r.published.Add(1)
	}
	_ = m.Ack()
}
