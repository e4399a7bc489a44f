package cenats_test

import (
	"context"
	"testing"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine/cenats"
)

func TestBinaryMessagePercentEncodes(t *testing.T) {
	t.Parallel()
	e := event.New()
	e.SetID("a b\"c%d€")
	e.SetSource("/s")
	e.SetType("t")
	m, err := cenats.BinaryMessage(context.Background(), "x", &e)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Header.Get("ce-id"); got != "a%20b%22c%25d%E2%82%AC" {
		t.Errorf("ce-id %q", got)
	}
	if got := m.Header.Get(jetstream.MsgIDHeader); got != e.ID() {
		t.Errorf("Nats-Msg-Id %q", got)
	}
	if got := cenats.Decode(m.Header.Get("ce-id")); got != e.ID() {
		t.Errorf("Decode(%q) = %q, want %q", m.Header.Get("ce-id"), got, e.ID())
	}
}

func TestDecodeKeepsWhatIsNotAnEscape(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"plain": "plain", "100%": "100%", "%zz": "%zz", "a%2": "a%2", "%41%62": "Ab"} {
		if got := cenats.Decode(in); got != want {
			t.Errorf("Decode(%q) = %q, want %q", in, got, want)
		}
	}
}
