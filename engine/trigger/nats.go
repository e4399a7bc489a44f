package trigger

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/format"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"

	"github.com/waymark-dev/waymark/engine/cenats"
	"github.com/waymark-dev/waymark/schemas"
)

// QueueGroup is the queue group of the NATS intake subscription: the
// engines of a deployment share the events.
const QueueGroup = "waymark-trigger"

// natsSpecs reads binary-mode attributes from "ce-" headers (the
// CloudEvents NATS protocol binding's header names).
var natsSpecs = spec.WithPrefix("ce-")

// natsMessage is a NATS message as a sdk-go binding.Message: binary mode
// when it carries ce-specversion (headers compared case-insensitively;
// Content-Type is datacontenttype, the payload is the data), structured
// mode when its Content-Type is a CloudEvents format. The upstream NATS
// binding modules are not served here; this is the small adapter the
// binding package expects.
type natsMessage struct {
	hdr     map[string]string // lower-case names, first values
	data    []byte
	version spec.Version
	format  format.Format
}

var _ binding.MessageMetadataReader = (*natsMessage)(nil)

func newNATSMessage(m *nats.Msg) *natsMessage {
	nm := &natsMessage{hdr: map[string]string{}, data: m.Data}
	for k, v := range m.Header {
		if len(v) == 0 {
			continue
		}
		k = strings.ToLower(k)
		if strings.HasPrefix(k, cenats.HeaderPrefix) {
			nm.hdr[k] = cenats.Decode(v[0]) // percent-encoded (NATS protocol binding, 3.1.3.2)
		} else {
			nm.hdr[k] = v[0]
		}
	}
	if v, ok := nm.hdr["ce-specversion"]; ok {
		nm.version = natsSpecs.Version(v)
	} else {
		nm.format = format.Lookup(nm.hdr["content-type"])
	}
	return nm
}

// ReadEncoding implements binding.MessageReader.
func (m *natsMessage) ReadEncoding() binding.Encoding {
	switch {
	case m.version != nil:
		return binding.EncodingBinary
	case m.format == format.JSONBatch:
		return binding.EncodingBatch
	case m.format != nil:
		return binding.EncodingStructured
	}
	return binding.EncodingUnknown
}

// ReadStructured implements binding.MessageReader.
func (m *natsMessage) ReadStructured(ctx context.Context, w binding.StructuredWriter) error {
	if m.format == nil || m.format == format.JSONBatch {
		return binding.ErrNotStructured
	}
	return w.SetStructuredEvent(ctx, m.format, bytes.NewReader(m.data))
}

// ReadBinary implements binding.MessageReader.
func (m *natsMessage) ReadBinary(ctx context.Context, w binding.BinaryWriter) error {
	if m.version == nil {
		return binding.ErrNotBinary
	}
	for k, v := range m.hdr {
		if k == "content-type" {
			if err := w.SetAttribute(m.version.AttributeFromKind(spec.DataContentType), v); err != nil {
				return err
			}
			continue
		}
		name, ok := strings.CutPrefix(k, "ce-")
		if !ok {
			continue
		}
		var err error
		if attr := m.version.Attribute(k); attr != nil {
			err = w.SetAttribute(attr, v)
		} else {
			err = w.SetExtension(name, v)
		}
		if err != nil {
			return err
		}
	}
	if len(m.data) > 0 {
		return w.SetData(bytes.NewReader(m.data))
	}
	return nil
}

// GetAttribute implements binding.MessageMetadataReader.
func (m *natsMessage) GetAttribute(k spec.Kind) (spec.Attribute, any) {
	if m.version == nil {
		return nil, nil
	}
	attr := m.version.AttributeFromKind(k)
	if attr == nil {
		return nil, nil
	}
	name := attr.PrefixedName()
	if k == spec.DataContentType {
		name = "content-type"
	}
	if v, ok := m.hdr[name]; ok {
		return attr, v
	}
	return attr, nil
}

// GetExtension implements binding.MessageMetadataReader.
func (m *natsMessage) GetExtension(name string) any {
	if v, ok := m.hdr["ce-"+strings.ToLower(name)]; ok {
		return v
	}
	return nil
}

// Finish implements binding.Message.
func (m *natsMessage) Finish(error) error { return nil }

// Subscribe serves CloudEvents requests on "<prefix>.trigger.>" in the
// queue group QueueGroup: each request is one event in binary mode (ce-
// headers, the payload is the data) or structured mode (Content-Type
// application/cloudevents+json). The reply is the HTTP answer's JSON: an
// Answer, or {"error": Refusal} with the headers Nats-Service-Error-Code
// (the HTTP status, as for the engine's NATS service) and
// Nats-Service-Error. A message without a reply subject is handled all
// the same (its outcome is only logged). Config.NATSConcurrency
// requests are handled at once, each queue subscription one at a time.
// Stop serving with the returned Subscriptions' Drain or Unsubscribe (or
// the connection's Drain, which waits for the requests in hand).
func (in *Intake) Subscribe(nc *nats.Conn) (Subscriptions, error) {
	subject := in.store.Names.TriggerPrefix + ">"
	subs := make(Subscriptions, 0, in.natsConcurrency)
	for range in.natsConcurrency {
		sub, err := nc.QueueSubscribe(subject, QueueGroup, in.handleNATS)
		if err != nil {
			_ = subs.Unsubscribe()
			return nil, fmt.Errorf("subscribe to %s: %w", subject, err)
		}
		subs = append(subs, sub)
	}
	// The server knows of the subscriptions once the flush returns: a
	// request sent after Subscribe finds a responder.
	if err := nc.Flush(); err != nil {
		_ = subs.Unsubscribe()
		return nil, fmt.Errorf("subscribe to %s: %w", subject, err)
	}
	return subs, nil
}

// Subscriptions are the NATS subscriptions of one Subscribe.
type Subscriptions []*nats.Subscription

// Unsubscribe ends every subscription at once; a request in hand still
// completes. It returns the first error.
func (s Subscriptions) Unsubscribe() error {
	var first error
	for _, sub := range s {
		if err := sub.Unsubscribe(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// Drain drains every subscription (nats.Subscription.Drain): no new
// requests, those received are handled. It does not wait. It returns the
// first error.
func (s Subscriptions) Drain() error {
	var first error
	for _, sub := range s {
		if err := sub.Drain(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (in *Intake) handleNATS(m *nats.Msg) {
	ctx, cancel := context.WithTimeout(context.Background(), in.timeout)
	defer cancel()
	a, err := in.acceptNATS(ctx, m)
	reply := nats.NewMsg(m.Reply)
	if err != nil {
		status := Status(err)
		if status >= 500 || m.Reply == "" {
			in.log.Warn("events intake (nats)", "subject", m.Subject, "status", status, "err", err)
		}
		reply.Header.Set("Nats-Service-Error-Code", strconv.Itoa(status))
		reply.Header.Set("Nats-Service-Error", oneLineMsg(err.Error()))
		reply.Data, _ = json.Marshal(errorBody(err))
	} else {
		reply.Data, _ = json.Marshal(a)
	}
	if m.Reply == "" {
		return
	}
	if err := m.RespondMsg(reply); err != nil {
		in.log.Warn("events intake (nats): reply not sent", "subject", m.Subject, "err", err)
	}
}

func (in *Intake) acceptNATS(ctx context.Context, m *nats.Msg) (*Answer, error) {
	if len(m.Data) > MaxEventBytes {
		in.invalid.Add(1)
		return nil, &Refusal{Code: schemas.CodeTooLarge, Message: fmt.Sprintf("the message is %d bytes; the limit is %d", len(m.Data), MaxEventBytes)}
	}
	msg := newNATSMessage(m)
	switch msg.ReadEncoding() {
	case binding.EncodingBinary, binding.EncodingStructured:
	case binding.EncodingBatch:
		in.invalid.Add(1)
		return nil, &Refusal{Code: schemas.CodeUnsupportedMedia, Message: "batch mode is for HTTP (POST /v1/events); send one event per NATS request"}
	default:
		in.invalid.Add(1)
		h := make(map[string][]string, len(msg.hdr))
		for k, v := range msg.hdr {
			h[k] = []string{v}
		}
		ref := unknownEncoding(canonical(h))
		if ref.Code == schemas.CodeUnsupportedMedia || strings.Contains(ref.Message, "no Content-Type") {
			ref.Message = "not a CloudEvent: a NATS request carries the event in binary mode (ce-specversion, ce-id, ce-source, ce-type headers; the payload is the data)" +
				" or structured mode (Content-Type application/cloudevents+json)"
		}
		return nil, ref
	}
	ev, err := binding.ToEvent(ctx, msg)
	if err != nil {
		in.invalid.Add(1)
		return nil, readError(err)
	}
	return in.Accept(ctx, ev)
}

// canonical gives lower-case header names their HTTP form, for
// unknownEncoding.
func canonical(h map[string][]string) map[string][]string {
	out := make(map[string][]string, len(h))
	for k, v := range h {
		parts := strings.Split(k, "-")
		for i, p := range parts {
			if p != "" {
				parts[i] = strings.ToUpper(p[:1]) + p[1:]
			}
		}
		out[strings.Join(parts, "-")] = v
	}
	return out
}

func oneLineMsg(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > 1000 {
		s = s[:1000]
	}
	return s
}

// Send sends ev to the intake over NATS as a request in binary mode (ce-
// headers, the data as the payload) on "<prefix>.trigger.<tail>", where
// tail is ev's type when that is a valid subject tail (else "event"), and
// waits for the answer until ctx ends. Errors: a *Refusal as the intake
// answered it; nats.ErrNoResponders when no engine serves the intake;
// context.DeadlineExceeded when none answered in time (the event may or
// may not have been taken: send it again, which is safe).
func Send(ctx context.Context, nc *nats.Conn, prefix string, ev *event.Event) (*Answer, error) {
	if err := ev.Validate(); err != nil {
		return nil, invalidEvent(err)
	}
	m, err := cenats.BinaryMessage(ctx, prefix+".trigger."+subjectTail(ev.Type()), ev)
	if err != nil {
		return nil, err
	}
	reply, err := nc.RequestMsgWithContext(ctx, m)
	if err != nil {
		return nil, fmt.Errorf("send event %q from %q on %s: %w", ev.ID(), ev.Source(), m.Subject, err)
	}
	if reply.Header.Get("Nats-Service-Error-Code") != "" {
		var body struct {
			Error *Refusal `json:"error"`
		}
		if err := json.Unmarshal(reply.Data, &body); err != nil || body.Error == nil {
			return nil, fmt.Errorf("send event %q from %q: %s %s", ev.ID(), ev.Source(), reply.Header.Get("Nats-Service-Error-Code"), reply.Header.Get("Nats-Service-Error"))
		}
		if body.Error.Code == "internal" {
			return nil, fmt.Errorf("send event %q from %q: the engine failed: %s", ev.ID(), ev.Source(), body.Error.Message)
		}
		return nil, body.Error
	}
	var a Answer
	if err := json.Unmarshal(reply.Data, &a); err != nil {
		return nil, fmt.Errorf("send event %q from %q: the answer is not JSON: %w", ev.ID(), ev.Source(), err)
	}
	return &a, nil
}

// subjectTail is typ when it is a valid tail of a subject (dot-separated
// tokens of letters, digits, '-' and '_'), else "event".
func subjectTail(typ string) string {
	for _, tok := range strings.Split(typ, ".") {
		if tok == "" {
			return "event"
		}
		for _, r := range tok {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
				return "event"
			}
		}
	}
	return typ
}
