package cli

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/waymark-dev/waymark/engine/notify"
)

// eventFlags configure what an engine tells the world about its jobs: the
// lifecycle relay (engine serve and engine run) and webhook sinks (engine
// serve).
type eventFlags struct {
	events    bool
	eventsEnv string // WAYMARK_EVENTS as given, checked by plan
	types     string
	webhooks  []string // NAME=URL
	secrets   []string // NAME=FILE
	hookTypes []string // NAME=TYPE,TYPE
	fs        *pflag.FlagSet
}

// envFields splits an environment variable holding several NAME=VALUE
// items separated by white space.
func envFields(key string) []string { return strings.Fields(os.Getenv(key)) }

func (f *eventFlags) bind(cmd *cobra.Command, webhooks bool) {
	fl := cmd.Flags()
	f.fs = fl
	f.eventsEnv = os.Getenv("WAYMARK_EVENTS")
	fl.BoolVar(&f.events, "events", true, "publish lifecycle CloudEvents on <prefix>.events.<type>.<job>; --events=false turns it off (env WAYMARK_EVENTS)")
	fl.StringVar(&f.types, "event-types", envOr("WAYMARK_EVENT_TYPES", ""), "event types published, comma-separated (job.completed,...; all); default the lifecycle events (env WAYMARK_EVENT_TYPES)")
	if !webhooks {
		return
	}
	fl.StringArrayVar(&f.webhooks, "webhook", envFields("WAYMARK_WEBHOOKS"), "NAME=URL: post lifecycle events to URL, signed (repeatable; env WAYMARK_WEBHOOKS, space-separated)")
	fl.StringArrayVar(&f.secrets, "webhook-secret", envFields("WAYMARK_WEBHOOK_SECRETS"), "NAME=FILE: the webhook's Standard Webhooks secret (whsec_...) is in FILE (repeatable; env WAYMARK_WEBHOOK_SECRETS)")
	fl.StringArrayVar(&f.hookTypes, "webhook-types", envFields("WAYMARK_WEBHOOK_TYPES"), "NAME=TYPE,TYPE: event types posted to the webhook (default the lifecycle events; repeatable; env WAYMARK_WEBHOOK_TYPES)")
}

// eventPlan is what the flags ask for, checked before anything starts.
type eventPlan struct {
	relayTypes []string // nil: no relay
	sinks      []notify.SinkConfig
}

// plan checks the flags: every webhook has a name, an http(s) URL and a
// readable secret, every type is known. Errors name the flag and the
// webhook, never a secret.
func (f *eventFlags) plan() (*eventPlan, error) {
	p := &eventPlan{}
	on := f.events
	if !f.fs.Changed("events") && f.eventsEnv != "" {
		v, err := strconv.ParseBool(f.eventsEnv)
		if err != nil {
			return nil, fmt.Errorf("WAYMARK_EVENTS %q: want true or false", f.eventsEnv)
		}
		on = v
	}
	types, err := notify.ParseTypes(splitList(f.types))
	if err != nil {
		return nil, fmt.Errorf("--event-types: %w", err)
	}
	if on {
		p.relayTypes = types
	}
	index := map[string]int{}
	for _, w := range f.webhooks {
		name, u, ok := strings.Cut(w, "=")
		if !ok || name == "" || u == "" {
			return nil, fmt.Errorf("--webhook %q: want NAME=URL", redactArg(w))
		}
		if _, dup := index[name]; dup {
			return nil, fmt.Errorf("--webhook %s: given twice", name)
		}
		index[name] = len(p.sinks)
		p.sinks = append(p.sinks, notify.SinkConfig{Name: name, URL: u})
	}
	byName := func(name string) *notify.SinkConfig {
		if i, ok := index[name]; ok {
			return &p.sinks[i]
		}
		return nil
	}
	for _, s := range f.secrets {
		name, file, ok := strings.Cut(s, "=")
		if !ok || name == "" || file == "" {
			return nil, fmt.Errorf("--webhook-secret %q: want NAME=FILE", s)
		}
		c := byName(name)
		if c == nil {
			return nil, fmt.Errorf("--webhook-secret %s: no --webhook %s=URL", name, name)
		}
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("--webhook-secret %s: %w", name, err)
		}
		c.Secret = strings.TrimSpace(string(b))
		if err := notify.CheckSecret(c.Secret); err != nil {
			return nil, fmt.Errorf("--webhook-secret %s=%s: %w", name, file, err)
		}
	}
	for _, s := range f.hookTypes {
		name, list, ok := strings.Cut(s, "=")
		if !ok || name == "" {
			return nil, fmt.Errorf("--webhook-types %q: want NAME=TYPE,TYPE", s)
		}
		c := byName(name)
		if c == nil {
			return nil, fmt.Errorf("--webhook-types %s: no --webhook %s=URL", name, name)
		}
		if c.Types, err = notify.ParseTypes(splitList(list)); err != nil {
			return nil, fmt.Errorf("--webhook-types %s: %w", name, err)
		}
	}
	for i := range p.sinks {
		c := &p.sinks[i]
		if c.Secret == "" {
			return nil, fmt.Errorf("--webhook %s: no --webhook-secret %s=FILE (a Standard Webhooks secret, whsec_ and base64; every request is signed)", c.Name, c.Name)
		}
		if err := c.WithDefaults().Validate(); err != nil {
			return nil, fmt.Errorf("--%w", err)
		}
	}
	return p, nil
}

func splitList(s string) []string {
	if strings.TrimSpace(s) == "" {
		return nil
	}
	return strings.Split(s, ",")
}

// redactArg shows a NAME=URL argument without the URL's user info and
// query.
func redactArg(s string) string {
	name, raw, _ := strings.Cut(s, "=")
	if u, err := url.Parse(raw); err == nil && (u.User != nil || u.RawQuery != "") {
		u.User, u.RawQuery = nil, ""
		return name + "=" + u.String()
	}
	return s
}

// notifiers are a stack's running relay and sinks.
type notifiers struct {
	relay *notify.Relay
	sinks []*notify.Sink
}

// start makes the relay and sinks p asks for over s's store, with their
// consumers (so that the jobs started next have all their events sent),
// and runs them with s's other goroutines.
func (p *eventPlan) start(ctx context.Context, s *stack, log *slog.Logger) (*notifiers, error) {
	n := &notifiers{}
	if p.relayTypes != nil {
		r, err := notify.NewRelay(notify.RelayConfig{Store: s.store, Types: p.relayTypes, Logger: log})
		if err != nil {
			return nil, err
		}
		if _, err := r.Open(ctx); err != nil {
			return nil, err
		}
		n.relay = r
		s.goRun(ctx, r.Run)
	}
	for _, c := range p.sinks {
		c.Store, c.Logger = s.store, log
		sk, err := notify.NewSink(c)
		if err != nil {
			return nil, err
		}
		if _, err := sk.Open(ctx); err != nil {
			return nil, err
		}
		n.sinks = append(n.sinks, sk)
		s.goRun(ctx, sk.Run)
	}
	return n, nil
}

// describe prints what p does, one line each.
func (p *eventPlan) describe(w io.Writer, prefix string) {
	if p.relayTypes != nil {
		short := make([]string, len(p.relayTypes))
		for i, t := range p.relayTypes {
			short[i] = strings.TrimPrefix(t, notify.TypePrefix)
		}
		fmt.Fprintf(w, "events: %s on %s.events.<type>.<job> (consumer %s)\n", strings.Join(short, ", "), prefix, notify.RelayConsumer(prefix))
	}
	for _, c := range p.sinks {
		u, _ := url.Parse(c.URL)
		u.User, u.RawQuery = nil, ""
		fmt.Fprintf(w, "webhook %s: %s (consumer %s)\n", c.Name, u, notify.SinkConsumer(prefix, c.Name))
	}
}

// registerNotifyMetrics exposes the relay's and sinks' counters:
// waymark_events_published_total, waymark_events_errors_total and
// waymark_webhook_{delivered,retried,failed,given_up}_total{sink="NAME"}.
func registerNotifyMetrics(reg prometheus.Registerer, n *notifiers) {
	if n == nil {
		return
	}
	if r := n.relay; r != nil {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "waymark", Subsystem: "events", Name: "published_total",
			Help: "Lifecycle events published as CloudEvents on NATS subjects."}, func() float64 { return float64(r.Stats().Published) }))
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "waymark", Subsystem: "events", Name: "errors_total",
			Help: "History messages the relay left for redelivery, or skipped as undecodable, after an error."}, func() float64 { return float64(r.Stats().Errors) }))
	}
	for _, s := range n.sinks {
		for _, c := range []struct {
			name, help string
			get        func(notify.SinkStats) uint64
		}{
			{"delivered_total", "Events a webhook answered with 2xx.", func(st notify.SinkStats) uint64 { return st.Delivered }},
			{"retried_total", "Webhook attempts that failed (408, 429, 5xx, no answer) and are tried again.", func(st notify.SinkStats) uint64 { return st.Retried }},
			{"failed_total", "Events a webhook refused for good (4xx other than 408 and 429); not tried again.", func(st notify.SinkStats) uint64 { return st.Failed }},
			{"given_up_total", "Events given up after the sink's max attempts or max age.", func(st notify.SinkStats) uint64 { return st.GivenUp }},
		} {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "waymark", Subsystem: "webhook", Name: c.name, Help: c.help,
				ConstLabels: prometheus.Labels{"sink": s.Name()}}, func() float64 { return float64(c.get(s.Stats())) }))
		}
	}
}
