// Package cenats is the CloudEvents NATS protocol binding's binary
// content mode as Waymark speaks it, both ways: BinaryMessage writes an
// event as a NATS message (the lifecycle relay, engine events send), and
// Decode reads a header value back. Each context attribute travels in a
// header ce-<attribute>, its value percent-encoded (CloudEvents NATS
// protocol binding, section 3.1.3); the data is the body.
package cenats

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/cloudevents/sdk-go/v2/types"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// BinaryMessage returns e as a NATS message in the CloudEvents binary
// content mode (CloudEvents NATS protocol binding, section 3.1): each
// context attribute in a header named ce-<attribute> (datacontenttype
// too), its value the attribute's canonical string percent-encoded as
// section 3.1.3.2 says, and the data as the body. Nats-Msg-Id is the event
// id, so that a stream capturing the subject drops a redelivery within
// its duplicate window. It uses sdk-go's binding.Write.
func BinaryMessage(ctx context.Context, subject string, e *event.Event) (*nats.Msg, error) {
	m := nats.NewMsg(subject)
	if _, err := binding.Write(ctx, (*binding.EventMessage)(e), nil, (*natsBinaryWriter)(m)); err != nil {
		return nil, fmt.Errorf("event %s as a NATS message: %w", e.ID(), err)
	}
	m.Header.Set(jetstream.MsgIDHeader, e.ID())
	return m, nil
}

// natsBinaryWriter is sdk-go's binding.BinaryWriter onto a NATS message.
type natsBinaryWriter nats.Msg

// HeaderPrefix starts the header of each CloudEvents attribute in binary
// mode (CloudEvents NATS protocol binding, 3.1.3.1).
const HeaderPrefix = "ce-"

func (w *natsBinaryWriter) Start(context.Context) error { return nil }
func (w *natsBinaryWriter) End(context.Context) error   { return nil }

func (w *natsBinaryWriter) SetAttribute(a spec.Attribute, v any) error {
	return w.SetExtension(a.Name(), v)
}

func (w *natsBinaryWriter) SetExtension(name string, v any) error {
	if v == nil {
		return nil
	}
	s, err := types.Format(v)
	if err != nil {
		return fmt.Errorf("attribute %s: %w", name, err)
	}
	w.Header.Set(HeaderPrefix+name, percentEncode(s))
	return nil
}

func (w *natsBinaryWriter) SetData(r io.Reader) error {
	if b, ok := r.(*bytes.Buffer); ok {
		w.Data = b.Bytes()
		return nil
	}
	b, err := io.ReadAll(r)
	w.Data = b
	return err
}

// percentEncode encodes space, '"', '%' and every byte outside printable
// ASCII as %XY (CloudEvents NATS protocol binding, 3.1.3.2).
func percentEncode(s string) string {
	clean := true
	for i := 0; i < len(s) && clean; i++ {
		clean = !needsEncoding(s[i])
	}
	if clean {
		return s
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if c := s[i]; needsEncoding(c) {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&0xf])
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}

func needsEncoding(c byte) bool { return c <= ' ' || c > '~' || c == '"' || c == '%' }

// Decode undoes percentEncode: each %XY of two hex digits becomes its
// byte; anything else (a lone '%') is kept as it is.
func Decode(s string) string {
	if !strings.Contains(s, "%") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '%' && i+2 < len(s) {
			if hi, lo := unhex(s[i+1]), unhex(s[i+2]); hi >= 0 && lo >= 0 {
				b.WriteByte(byte(hi<<4 | lo))
				i += 2
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}
