package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
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
// the engine's fencing make a second copy harmless). A cron schedule's
// firing is handed to fire (its name, when it fired, the schedule), and
// acknowledged once fire returns nil. Engines run it; a consumer shared
// by all of them gives each timer to one.
func (s *Store) ForwardTimers(ctx context.Context, fire func(ctx context.Context, name string, at time.Time, sc *CronSchedule) error) error {
	cons, err := s.JS.Consumer(ctx, s.Names.TimerStream, s.Names.TimerConsumer)
	if err != nil {
		return fmt.Errorf("open consumer %s: %w", s.Names.TimerConsumer, err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		if name, ok := cutToken(m.Subject(), s.Names.TimerPrefix+"fired."); ok {
			s.fireCron(ctx, m, name, fire)
			return
		}
		s.forwardTimer(ctx, m)
	})
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

func (s *Store) fireCron(ctx context.Context, m jetstream.Msg, name string, fire func(context.Context, string, time.Time, *CronSchedule) error) {
	var sc CronSchedule
	if err := json.Unmarshal(m.Data(), &sc); err != nil {
		s.log.Error("dropping malformed cron firing", "schedule", name, "err", err)
		_ = m.Term()
		return
	}
	at := time.Now()
	if md, err := m.Metadata(); err == nil {
		at = md.Timestamp
	}
	if err := fire(ctx, name, at.UTC().Truncate(time.Second), &sc); err != nil {
		if ctx.Err() == nil {
			s.log.Warn("cron firing: will try again", "schedule", name, "err", err)
		}
		_ = m.NakWithDelay(5 * time.Second)
		return
	}
	_ = m.Ack()
}

// CronSchedule is a cron schedule's body: what each firing starts.
type CronSchedule struct {
	Name     string            `json:"name"`
	Workflow string            `json:"workflow"` // the definition of this name stored last when it fires
	Input    json.RawMessage   `json:"input,omitempty"`
	Vars     map[string]string `json:"vars,omitempty"`
	Cron     string            `json:"cron"`                // as given: 6 fields (seconds first) or @hourly, @daily, ...
	TimeZone string            `json:"time_zone,omitempty"` // IANA name; empty: UTC
	By       string            `json:"by,omitempty"`
	Created  time.Time         `json:"created"`
}

// CheckCronName reports whether name can name a cron schedule: 1 to 64
// letters, digits, '_' and '-' (one subject token). Errors:
// schemas.ErrInputInvalid.
func CheckCronName(name string) error {
	if schemas.CheckSignalName(name) != nil {
		return schemas.Errorf(schemas.CodeInputInvalid, "schedule name %q: want 1 to 64 letters, digits, '_' and '-'", name)
	}
	return nil
}

// CronSubject is the subject of cron schedule name.
func (n Names) CronSubject(name string) string { return n.TimerPrefix + "cron." + name }

// PutCron stores (or replaces) cron schedule sc: a repeating JetStream
// message schedule whose every firing is sent to the engines (rolling up
// one no engine took yet: firings missed while every engine was down make
// one job, not one each). Errors: the server's, which names a cron
// expression or time zone it does not take.
func (s *Store) PutCron(ctx context.Context, sc *CronSchedule) error {
	if err := CheckCronName(sc.Name); err != nil {
		return err
	}
	if strings.HasPrefix(sc.Cron, "@at ") {
		return schemas.Errorf(schemas.CodeInputInvalid, "cron schedule %s: %q fires once; a schedule repeats (6 cron fields, @hourly, ..., or @every 5m)", sc.Name, sc.Cron)
	}
	data, err := json.Marshal(sc)
	if err != nil {
		return err
	}
	m := nats.NewMsg(s.Names.CronSubject(sc.Name))
	m.Data = data
	m.Header.Set("Nats-Schedule-Rollup", "sub")
	if sc.TimeZone != "" {
		m.Header.Set("Nats-Schedule-Time-Zone", sc.TimeZone)
	}
	if _, err := s.JS.PublishMsg(ctx, m, jetstream.WithScheduleCron(sc.Cron), jetstream.WithScheduleTarget(s.Names.TimerPrefix+"fired."+sc.Name)); err != nil {
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.Code == 400 {
			return schemas.Errorf(schemas.CodeInputInvalid, "cron schedule %s: the server refused %q%s: %s (want 6 fields, seconds first, such as \"0 30 9 * * 1-5\", @hourly, @daily, @weekly, @monthly, @yearly, or @every 5m: at least 1s)",
				sc.Name, sc.Cron, map[bool]string{true: " in zone " + sc.TimeZone, false: ""}[sc.TimeZone != ""], apiErr.Description)
		}
		return fmt.Errorf("store cron schedule %s (%s): %w", sc.Name, sc.Cron, err)
	}
	return nil
}

// Crons lists the cron schedules stored, by name.
func (s *Store) Crons(ctx context.Context) ([]*CronSchedule, error) {
	st, err := s.JS.Stream(ctx, s.Names.TimerStream)
	if err != nil {
		return nil, fmt.Errorf("list cron schedules: %w", err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(s.Names.TimerPrefix+"cron.*"))
	if err != nil {
		return nil, fmt.Errorf("list cron schedules: %w", err)
	}
	var out []*CronSchedule
	for subj := range info.State.Subjects {
		m, err := st.GetLastMsgForSubject(ctx, subj)
		if err != nil {
			continue // removed meanwhile
		}
		var sc CronSchedule
		if json.Unmarshal(m.Data, &sc) == nil {
			out = append(out, &sc)
		}
	}
	slices.SortFunc(out, func(a, b *CronSchedule) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// RemoveCron removes cron schedule name; firings already sent still start
// their jobs. Errors: schemas.ErrNotFound for no such schedule.
func (s *Store) RemoveCron(ctx context.Context, name string) error {
	if err := CheckCronName(name); err != nil {
		return err
	}
	st, err := s.JS.Stream(ctx, s.Names.TimerStream)
	if err != nil {
		return fmt.Errorf("remove cron schedule %s: %w", name, err)
	}
	if _, err := st.GetLastMsgForSubject(ctx, s.Names.CronSubject(name)); errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("remove cron schedule %s: there is no schedule of that name (engine schedule list): %w", name, schemas.ErrNotFound)
	}
	if err := st.Purge(ctx, jetstream.WithPurgeSubject(s.Names.CronSubject(name))); err != nil {
		return fmt.Errorf("remove cron schedule %s: %w", name, err)
	}
	return nil
}

// cutToken is subject after prefix, when it starts so and more follows.
func cutToken(subject, prefix string) (string, bool) {
	rest, ok := strings.CutPrefix(subject, prefix)
	return rest, ok && rest != ""
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
