package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// Durable timers are JetStream message schedules (ADR-51, nats-server
// 2.12+): a message on timer.set.<job>.<name> with a Nats-Schedule of
// "@at <RFC 3339, seconds>" waits in the timer stream; when it is due the
// server publishes its body on timer.due.<job> (the NATS server's clock
// decides) and an engine forwards it to the job's inbox. A schedule is
// stored like any message: one due while every engine was down fires when
// the server runs, once, and is forwarded when an engine runs.

// Headers of a timer's body: where its inbox message goes, with which
// dedup id (the server strips Nats-Msg-Id from what a schedule publishes).
const (
	headerTimerInbox = "Waymark-Timer-Inbox" // inbox subject kind: result or signal
	headerTimerMsgID = "Waymark-Timer-Msg-Id"
)

// TimerSubject is the subject of job's schedule name (one schedule per
// subject: setting it again replaces it).
func (n Names) TimerSubject(job, name string) string {
	return n.TimerPrefix + "set." + job + "." + name
}

// TimerDueSubject is where job's schedules fire.
func (n Names) TimerDueSubject(job string) string { return n.TimerPrefix + "due." + job }

// ScheduleTimer sets job's timer name to deliver, at at (rounded up to
// the second), the inbox message of kind (InboxResult or InboxSignal)
// with headers hdr (Waymark-* ones are forwarded; may be nil), body data
// and dedup id msgID. name is one subject token. Setting
// the same name again replaces the schedule. It returns the publish error
// (jetstream.ErrMsgSchedulesDisabled-like errors from a server older than
// 2.12).
func (s *Store) ScheduleTimer(ctx context.Context, job, name string, at time.Time, kind string, hdr map[string][]string, data []byte, msgID string) error {
	m := nats.NewMsg(s.Names.TimerSubject(job, name))
	m.Data = data
	for k, vs := range hdr {
		m.Header[k] = vs
	}
	m.Header.Set(headerTimerInbox, kind)
	m.Header.Set(headerTimerMsgID, msgID)
	if sec := at.Truncate(time.Second); sec.Before(at) {
		at = sec.Add(time.Second)
	}
	// The message id makes a second publication of the same timer (an
	// engine publishing a transition again) one schedule.
	_, err := s.JS.PublishMsg(ctx, m, jetstream.WithScheduleAt(at), jetstream.WithScheduleTarget(s.Names.TimerDueSubject(job)),
		jetstream.WithMsgID(msgID+"/timer/"+strconv.FormatInt(at.Unix(), 10)))
	if err != nil {
		return fmt.Errorf("schedule timer %s of job %s at %s: %w", name, job, at.UTC().Format(time.RFC3339), err)
	}
	return nil
}

// CancelTimers removes job's schedules not yet due (a job that ended).
// Timers that fire anyway are stale to the engine.
func (s *Store) CancelTimers(ctx context.Context, job string) error {
	st, err := s.JS.Stream(ctx, s.Names.TimerStream)
	if err != nil {
		return fmt.Errorf("cancel timers of job %s: %w", job, err)
	}
	if err := st.Purge(ctx, jetstream.WithPurgeSubject(s.Names.TimerPrefix+"set."+job+".*")); err != nil {
		return fmt.Errorf("cancel timers of job %s: %w", job, err)
	}
	return nil
}

// ForwardTimers forwards due timers to the jobs' inboxes until ctx ends:
// each fired message is published on its inbox subject under its dedup
// id, then acknowledged (at least once; the inbox's duplicate window and
// the engine's fencing make a second copy harmless). Engines run it; a
// consumer shared by all of them gives each timer to one.
func (s *Store) ForwardTimers(ctx context.Context) error {
	cons, err := s.JS.Consumer(ctx, s.Names.TimerStream, s.Names.TimerConsumer)
	if err != nil {
		return fmt.Errorf("open consumer %s: %w", s.Names.TimerConsumer, err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) { s.forwardTimer(ctx, m) })
	if err != nil {
		return fmt.Errorf("consume %s: %w", s.Names.TimerConsumer, err)
	}
	<-ctx.Done()
	cc.Drain()
	return nil
}

func (s *Store) forwardTimer(ctx context.Context, m jetstream.Msg) {
	job, ok := cutToken(m.Subject(), s.Names.TimerPrefix+"due.")
	kind := m.Headers().Get(headerTimerInbox)
	if !ok || (kind != InboxResult && kind != InboxSignal) {
		s.log.Error("dropping malformed timer", "subject", m.Subject(), "kind", kind)
		_ = m.Term()
		return
	}
	out := nats.NewMsg(s.Names.InboxSubject(kind, job))
	out.Data = m.Data()
	for k, vs := range m.Headers() {
		if len(k) > 7 && k[:7] == "Waymark" && k != headerTimerInbox && k != headerTimerMsgID {
			out.Header[k] = vs
		}
	}
	out.Header.Set(jetstream.MsgIDHeader, m.Headers().Get(headerTimerMsgID))
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := s.JS.PublishMsg(pctx, out); err != nil {
		if !errors.Is(err, context.Canceled) {
			s.log.Warn("forward timer: will try again", "job", job, "err", err)
		}
		_ = m.NakWithDelay(time.Second)
		return
	}
	_ = m.Ack()
}

func cutToken(subject, prefix string) (string, bool) {
	if len(subject) <= len(prefix) || subject[:len(prefix)] != prefix {
		return "", false
	}
	return subject[len(prefix):], true
}

// SendSignal publishes sig to its job's inbox under msgID (dedup within
// the duplicate window). It returns the publish error.
func (s *Store) SendSignal(ctx context.Context, sig schemas.Signal, msgID string) error {
	data, err := json.Marshal(sig)
	if err != nil {
		return err
	}
	m := nats.NewMsg(s.Names.InboxSubject(InboxSignal, sig.Job))
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, msgID)
	if _, err := s.JS.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("signal %s to job %s: %w", sig.Type, sig.Job, err)
	}
	return nil
}
