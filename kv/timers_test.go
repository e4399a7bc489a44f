package kv_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// A timer set for one second from now arrives in the job's inbox, once,
// with its dedup id, only after it is due; a cancelled one never does.
func TestTimerIsForwardedToTheInboxWhenDue(t *testing.T) {
	b := setup(t, kv.Config{})
	c := ctx(t)
	sig, _ := json.Marshal(schemas.Signal{Job: "j1", Type: schemas.SignalApprovalExpired, Key: "gate/1"})
	set := time.Now()
	if err := b.store.ScheduleTimer(c, "j1", "approval-gate-1", set.Add(time.Second), kv.InboxSignal, nil, sig, "j1/expire/gate/1"); err != nil {
		t.Fatal(err)
	}
	// Set twice (an engine publishing a transition again): one timer.
	if err := b.store.ScheduleTimer(c, "j1", "approval-gate-1", set.Add(time.Second), kv.InboxSignal, nil, sig, "j1/expire/gate/1"); err != nil {
		t.Fatal(err)
	}
	if err := b.store.ScheduleTimer(c, "j2", "sleep", set.Add(time.Second), kv.InboxSignal, nil, sig, "j2/x"); err != nil {
		t.Fatal(err)
	}
	if err := b.store.CancelTimers(c, "j2"); err != nil {
		t.Fatal(err)
	}
	fctx, stop := context.WithCancel(c)
	done := make(chan error, 1)
	go func() {
		done <- b.store.ForwardTimers(fctx, func(context.Context, string, time.Time, *kv.CronSchedule) error { return nil })
	}()
	defer func() { stop(); <-done }()

	inbox, err := b.store.EngineConsumer(c)
	if err != nil {
		t.Fatal(err)
	}
	m, err := inbox.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		t.Fatalf("no timer arrived: %v", err)
	}
	if since := time.Since(set); since < 900*time.Millisecond {
		t.Errorf("the timer arrived %v after it was set, before it was due", since)
	}
	if m.Subject() != b.store.Names.InboxSubject(kv.InboxSignal, "j1") || m.Headers().Get(jetstream.MsgIDHeader) != "j1/expire/gate/1" || string(m.Data()) != string(sig) {
		t.Errorf("forwarded %s %v %s", m.Subject(), m.Headers(), m.Data())
	}
	if m, err := inbox.Next(jetstream.FetchMaxWait(2 * time.Second)); err == nil {
		t.Errorf("a second message arrived: %s %s", m.Subject(), m.Data())
	}
}
