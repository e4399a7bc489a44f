package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// HeaderSeq is the header of a transition message on the history stream
// that carries the checkpoint sequence whose events it holds.
const HeaderSeq = "Waymark-Seq"

// History reads and trims the history stream. Transitions of a job are
// published by engines, one message per checkpoint sequence, in sequence
// order, on the job's transition subject; ledger events on its effects
// subject. Safe for concurrent use.
type History struct {
	stream jetstream.Stream
	js     jetstream.JetStream
	names  Names
}

// LastSeq returns the checkpoint sequence of job's last transition message
// on the history stream, 0 when there is none. It is what an engine that
// did not publish a job's last events itself reads to know whether they
// are stored (a direct get of the subject's last message, answered by any
// replica: a replica behind the leader can only make the answer older,
// which costs a duplicate publish that the stream's dedup window drops).
func (h *History) LastSeq(ctx context.Context, job string) (uint64, error) {
	m, err := h.stream.GetLastMsgForSubject(ctx, h.names.HistorySubject(job))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read last history message of %s: %w", job, err)
	}
	if s := m.Header.Get(HeaderSeq); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("last history message of %s: %s %q: %w", job, HeaderSeq, s, err)
		}
		return n, nil
	}
	return 0, nil // written by layout 1, which batched transitions: treat as unknown
}

// Purge removes job's whole history (retention sweeps).
func (h *History) Purge(ctx context.Context, job string) error {
	for _, subj := range h.names.HistoryFilters(job) {
		if err := h.stream.Purge(ctx, jetstream.WithPurgeSubject(subj)); err != nil {
			return fmt.Errorf("purge history of %s (%s): %w", job, subj, err)
		}
	}
	return nil
}

// Queues answers questions about the work and inbox streams that decide,
// from facts rather than from timing, whether a dispatch is lost: is a
// job's step message still queued, is its result waiting to be applied.
// Reads are direct gets of a subject's last message. Safe for concurrent use.
type Queues struct {
	js    jetstream.JetStream
	names Names

	mu      sync.Mutex
	streams map[string]jetstream.Stream // handles, looked up once
}

// QueuedStep is a step message found in the work stream.
type QueuedStep struct {
	Seq     uint64    // stream sequence
	Attempt int       // its Waymark-Attempt
	Stored  time.Time // when the stream stored it
}

// StepQueued returns job's last step message in pool, if the work stream
// holds one (queued, or delivered and not yet acknowledged).
func (q *Queues) StepQueued(ctx context.Context, pool, job string) (QueuedStep, bool, error) {
	m, err := q.lastFor(ctx, q.names.WorkStream, q.names.WorkSubject(pool, job))
	if err != nil || m == nil {
		return QueuedStep{}, false, err
	}
	n, _ := strconv.Atoi(m.Header.Get(schemas.HeaderAttempt))
	return QueuedStep{Seq: m.Sequence, Attempt: n, Stored: m.Time}, true, nil
}

// ResultWaiting reports whether the inbox holds a result of job's step
// attempt that no engine has applied yet.
func (q *Queues) ResultWaiting(ctx context.Context, job, step string, attempt int) (bool, error) {
	m, err := q.lastFor(ctx, q.names.InboxStream, q.names.InboxSubject(InboxResult, job))
	if err != nil || m == nil {
		return false, err
	}
	return m.Header.Get(schemas.HeaderStep) == step && m.Header.Get(schemas.HeaderAttempt) == strconv.Itoa(attempt), nil
}

// ResultPending reports whether the inbox holds the result of job's
// dispatch (step, attempt, and map item or tool call, 0 for none) that no
// engine has applied yet: a worker given the dispatch again need not run
// it. It reads the job's results waiting in the inbox one by one (the
// inbox is a work queue: a consumer could not share it), so it is meant
// for a few.
func (q *Queues) ResultPending(ctx context.Context, job, step string, attempt, item int) (bool, error) {
	st, err := q.stream(ctx, q.names.InboxStream)
	if err != nil {
		return false, fmt.Errorf("read results of %s: %w", job, err)
	}
	subj := q.names.InboxSubject(InboxResult, job)
	want, wantItem := strconv.Itoa(attempt), ""
	if item > 0 {
		wantItem = strconv.Itoa(item)
	}
	for seq := uint64(1); ; {
		m, err := st.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subj))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("read results of %s: %w", job, err)
		}
		if m.Header.Get(schemas.HeaderStep) == step && m.Header.Get(schemas.HeaderAttempt) == want && m.Header.Get(schemas.HeaderItem) == wantItem {
			return true, nil
		}
		seq = m.Sequence + 1
	}
}

// InboxPending reports whether the inbox holds any message for job (a
// start, a result or a signal) that no engine has finished with: the
// engine that takes it decides what the job does next.
func (q *Queues) InboxPending(ctx context.Context, job string) (bool, error) {
	m, err := q.lastFor(ctx, q.names.InboxStream, q.names.InboxPrefix+"*."+job)
	return m != nil, err
}

// RemoveJobSteps deletes job's step messages in pool from the work stream
// (its subject there): those not yet taken and those held for a retry
// delay. A message a worker holds is gone for it too: its
// acknowledgement finds nothing. For a job that ended (cancelled).
func (q *Queues) RemoveJobSteps(ctx context.Context, pool, job string) error {
	st, err := q.stream(ctx, q.names.WorkStream)
	if err != nil {
		return fmt.Errorf("remove step messages of %s: %w", job, err)
	}
	if err := st.Purge(ctx, jetstream.WithPurgeSubject(q.names.WorkSubject(pool, job))); err != nil {
		return fmt.Errorf("remove step messages of %s: %w", job, err)
	}
	return nil
}

// RemoveStep deletes the step message at seq from the work stream (a
// dead letter); one already gone is not an error.
func (q *Queues) RemoveStep(ctx context.Context, seq uint64) error {
	st, err := q.stream(ctx, q.names.WorkStream)
	if err != nil {
		return fmt.Errorf("remove step message %d: %w", seq, err)
	}
	if err := st.DeleteMsg(ctx, seq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("remove step message %d: %w", seq, err)
	}
	return nil
}

func (q *Queues) lastFor(ctx context.Context, stream, subject string) (*jetstream.RawStreamMsg, error) {
	st, err := q.stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", subject, err)
	}
	m, err := st.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", subject, err)
	}
	return m, nil
}

// stream returns a handle on the named stream, looked up once: a handle
// names the stream, so it stays good when the stream is recreated.
func (q *Queues) stream(ctx context.Context, name string) (jetstream.Stream, error) {
	q.mu.Lock()
	st, ok := q.streams[name]
	q.mu.Unlock()
	if ok {
		return st, nil
	}
	st, err := q.js.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	if q.streams == nil {
		q.streams = map[string]jetstream.Stream{}
	}
	q.streams[name] = st
	q.mu.Unlock()
	return st, nil
}

// SignalResolved tells job, through its inbox, that the effect under key
// was settled at ledger revision rev by by. The message id
// <job>/resolve/<rev> makes a repeated call one signal (JetStream's
// duplicate window). It returns the publish error.
func (s *Store) SignalResolved(ctx context.Context, job, key string, rev uint64, by string) error {
	sig, err := json.Marshal(schemas.Signal{Job: job, Type: schemas.SignalEffectResolved, Key: key, By: by})
	if err != nil {
		return err
	}
	m := nats.NewMsg(s.Names.InboxSubject(InboxSignal, job))
	m.Data = sig
	m.Header.Set(jetstream.MsgIDHeader, job+"/resolve/"+strconv.FormatUint(rev, 10))
	_, err = s.JS.PublishMsg(ctx, m)
	return err
}

// SignalCancel asks, through job's inbox, that job be cancelled by by
// (who) for reason. The message id <job>/cancel makes repeats within the
// duplicate window one signal; a later one finds the job ended and is
// dropped. It returns the publish error.
func (s *Store) SignalCancel(ctx context.Context, job, by, reason string) error {
	return s.SendSignal(ctx, schemas.Signal{Job: job, Type: schemas.SignalCancel, By: by, Reason: reason}, job+"/cancel")
}

// AppendEffectEvent appends the ledger transition typ of rec (ledger
// revision rev) to the history of job, as a CloudEvent from source at now.
// job is usually rec.Job; a shared key's resolution is told to each job
// that waits on it. The message id <job>/effect/<rev>/<typ> makes a
// repeat one event. It returns the publish error.
func (s *Store) AppendEffectEvent(ctx context.Context, job, source, typ string, rec *schemas.EffectRecord, rev uint64, now time.Time) error {
	m := nats.NewMsg(s.Names.EffectHistorySubject(job))
	m.Data = schemas.AppendEffectEvent(nil, source, typ, rec, rev, now)
	m.Header.Set(jetstream.MsgIDHeader, job+"/effect/"+strconv.FormatUint(rev, 10)+"/"+typ)
	m.Header.Set("Content-Type", schemas.HistoryContentType)
	_, err := s.JS.PublishMsg(ctx, m)
	return err
}
