package notify

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	jsoniter "github.com/json-iterator/go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// TypePrefix starts every Waymark event type; subjects and flags name a
// type without it ("job.completed").
const TypePrefix = "dev.waymark."

// DefaultTypes are the lifecycle events a Relay and a Sink send unless
// told otherwise: a job started, a step completed, a job waits for
// approval, an effect's outcome is unknown, a job completed, failed or was
// cancelled.
var DefaultTypes = []string{
	schemas.EventJobStarted, schemas.EventStepCompleted, schemas.EventApprovalRequested,
	schemas.EventEffectAmbiguous, schemas.EventJobCompleted, schemas.EventJobFailed, schemas.EventJobCancelled,
}

// KnownTypes are every event type the history stream holds.
var KnownTypes = []string{
	schemas.EventJobStarted, schemas.EventJobResumed, schemas.EventJobBlocked, schemas.EventJobUnblocked,
	schemas.EventJobCompleted, schemas.EventJobFailed, schemas.EventJobCancelled, schemas.EventJobPaused,
	schemas.EventJobUnpaused, schemas.EventJobRetried, schemas.EventJobMigrated, schemas.EventJobRewound,
	schemas.EventApprovalRequested, schemas.EventApprovalDecided, schemas.EventSignalReceived,
	schemas.EventStepDispatched, schemas.EventStepCompleted, schemas.EventStepFailed, schemas.EventStepBlocked,
	schemas.EventStepUnblocked, schemas.EventStepCancelled, schemas.EventAgentTurn,
	schemas.EventEffectPrepared, schemas.EventEffectDispatched, schemas.EventEffectConfirmed,
	schemas.EventEffectAmbiguous, schemas.EventEffectReconciled, schemas.EventEffectReplayed,
}

// ParseTypes turns a list of event types, each with or without TypePrefix
// ("job.completed" or "dev.waymark.job.completed"), or the single word
// "all", into full type names. An empty list gives DefaultTypes. A type
// Waymark does not write is an error naming it.
func ParseTypes(list []string) ([]string, error) {
	var out []string
	for _, t := range list {
		t = strings.TrimSpace(t)
		switch {
		case t == "":
			continue
		case t == "all":
			out = append(out, KnownTypes...)
			continue
		case !strings.HasPrefix(t, TypePrefix):
			t = TypePrefix + t
		}
		known := false
		for _, k := range KnownTypes {
			known = known || k == t
		}
		if !known {
			return nil, fmt.Errorf("event type %q: not one Waymark writes (known: %s, or all)", strings.TrimPrefix(t, TypePrefix), shortTypes())
		}
		out = append(out, t)
	}
	if len(out) == 0 {
		return DefaultTypes, nil
	}
	return out, nil
}

func shortTypes() string {
	s := make([]string, len(KnownTypes))
	for i, t := range KnownTypes {
		s[i] = strings.TrimPrefix(t, TypePrefix)
	}
	return strings.Join(s, ", ")
}

// Subject is the NATS subject a Relay publishes an event of type typ for
// job on: <prefix>.events.<type without "dev.waymark.">.<job>, e.g.
// waymark.events.job.completed.J1; waymark.events.*.*.J1 is all of one
// job's events, waymark.events.job.> every job-level one.
func Subject(prefix, typ, job string) string {
	return prefix + ".events." + strings.TrimPrefix(typ, TypePrefix) + "." + job
}

// typeSet is a set of full type names, with what a history message must
// contain to hold one of them (the type as a JSON string), so that
// messages and events holding none are skipped without decoding.
type typeSet struct {
	types   map[string]bool
	markers [][]byte
}

func newTypeSet(types []string) typeSet {
	s := typeSet{types: map[string]bool{}}
	for _, t := range types {
		if !s.types[t] {
			s.types[t] = true
			s.markers = append(s.markers, []byte(`"`+t+`"`))
		}
	}
	return s
}

// mayHold reports whether body may hold an event of the set.
func (s typeSet) mayHold(body []byte) bool {
	for _, m := range s.markers {
		if bytes.Contains(body, m) {
			return true
		}
	}
	return false
}

// decodeBatch reads a history message (a CloudEvents JSON batch) into
// sdk-go events, keeping those of the set. It walks the array with the
// JSON iterator sdk-go reads events with, and decodes only the events
// whose bytes may be of the set (most of a busy job's are dispatches).
func (s typeSet) decodeBatch(body []byte) ([]event.Event, error) {
	iter := jsoniter.ConfigFastest.BorrowIterator(body)
	defer jsoniter.ConfigFastest.ReturnIterator(iter)
	var out []event.Event
	for iter.ReadArray() {
		raw := iter.SkipAndReturnBytes()
		if iter.Error != nil {
			break
		}
		if !s.mayHold(raw) {
			continue
		}
		var e event.Event
		if err := e.UnmarshalJSON(raw); err != nil {
			return nil, fmt.Errorf("decode history message as a CloudEvents batch: event %d: %w", len(out), err)
		}
		if s.types[e.Type()] {
			out = append(out, e)
		}
	}
	if iter.Error != nil && iter.Error != io.EOF {
		return nil, fmt.Errorf("decode history message as a CloudEvents batch: %w", iter.Error)
	}
	return out, nil
}

// consumerFor returns the durable consumer name on the history stream,
// creating it when absent: explicit acks, deliveries without limit (the
// user of the consumer decides when to give up), new messages only.
// One that exists is used as it is.
func consumerFor(ctx context.Context, st *kv.Store, name, description string, ackWait time.Duration, maxAckPending int, log *slog.Logger) (jetstream.Consumer, error) {
	stream := st.Names.HistoryStream
	c, err := st.JS.Consumer(ctx, stream, name)
	if err == nil {
		return c, nil
	}
	if !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, fmt.Errorf("open consumer %s on %s: %w", name, stream, err)
	}
	c, err = st.JS.CreateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:       name,
		Description:   description,
		DeliverPolicy: jetstream.DeliverNewPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1,
		MaxAckPending: maxAckPending,
		Replicas:      st.Config.Replicas,
		Metadata:      map[string]string{"waymark_layout": kv.LayoutVersion},
	})
	if err != nil {
		return nil, fmt.Errorf("create consumer %s on %s: %w", name, stream, err)
	}
	log.Info("created history consumer: events stored from now on go out", "consumer", name, "stream", stream)
	return c, nil
}
