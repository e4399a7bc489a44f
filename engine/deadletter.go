package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// A step message that reaches the work consumer's MaxDeliver (a worker
// died on it every time: a poison step) is no longer delivered. The server
// announces it with an advisory (NATS ADR-15, JetStream advisories); the
// engine turns it into a failed, non-retryable result for that attempt, so
// the step fails (or follows on_error) with the reason, and removes the
// message: a dead letter does not sit in the pool. Advisories are not
// stored; one missed while no engine runs is caught later by the
// reconciler, which declares the attempt lost.

const maxDeliveriesAdvisory = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"

type deliveryExceeded struct {
	Stream     string `json:"stream"`
	Consumer   string `json:"consumer"`
	StreamSeq  uint64 `json:"stream_seq"`
	Deliveries uint64 `json:"deliveries"`
}

// watchDeadLetters subscribes to the work stream's max-deliveries
// advisories, shared by all engines (a queue group), until ctx ends.
func (e *Engine) watchDeadLetters(ctx context.Context) (stop func(), err error) {
	nc := e.store.JS.Conn()
	subject := maxDeliveriesAdvisory + "." + e.store.Names.WorkStream + ".*"
	work := make(chan *nats.Msg, 256)
	sub, err := nc.ChanQueueSubscribe(subject, e.store.Names.EngineConsumer, work)
	if err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", subject, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case m := <-work:
				var adv deliveryExceeded
				if err := json.Unmarshal(m.Data, &adv); err != nil {
					e.log.Warn("unreadable max-deliveries advisory", "err", err)
					continue
				}
				if err := e.deadLetter(ctx, adv); err != nil && ctx.Err() == nil {
					e.log.Error("dead letter not handled; the reconciler will declare the attempt lost", "stream_seq", adv.StreamSeq, "err", err)
				}
			}
		}
	}()
	return func() { _ = sub.Unsubscribe(); <-done }, nil
}

func (e *Engine) deadLetter(ctx context.Context, adv deliveryExceeded) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	stream, err := e.store.JS.Stream(ctx, e.store.Names.WorkStream)
	if err != nil {
		return err
	}
	raw, err := stream.GetMsg(ctx, adv.StreamSeq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil // acknowledged or removed meanwhile
	}
	if err != nil {
		return fmt.Errorf("read dead letter %d: %w", adv.StreamSeq, err)
	}
	sm, err := schemas.DecodeStepMessage(raw.Header, raw.Data)
	if err != nil {
		e.log.Error("removing an unreadable dead letter", "stream_seq", adv.StreamSeq, "err", err)
		return stream.DeleteMsg(ctx, adv.StreamSeq)
	}
	e.ctr.deadLetters.Add(1)
	e.log.Warn("poison step: its message was delivered the maximum number of times without a result",
		"job", sm.Job, "step", sm.Step, "attempt", sm.Attempt, "deliveries", adv.Deliveries)
	res := &schemas.StepResult{Job: sm.Job, Step: sm.Step, Attempt: sm.Attempt, Error: &schemas.Error{
		Code:    schemas.CodeStepFailed,
		Message: fmt.Sprintf("poison step: delivered %d times and never finished (a worker died or stalled on it every time); it will not be delivered again", adv.Deliveries),
	}}
	m := nats.NewMsg(e.store.Names.InboxSubject(kv.InboxResult, sm.Job))
	if m.Data, err = schemas.EncodeStepResult(res, m.Header); err != nil {
		return err
	}
	m.Header.Set(jetstream.MsgIDHeader, schemas.ResultMsgID(sm.Job, sm.Step, sm.Attempt)+"/dead-letter")
	if _, err := e.store.JS.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("report dead letter of %s: %w", sm.Job, err)
	}
	if err := stream.DeleteMsg(ctx, adv.StreamSeq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("remove dead letter %d: %w", adv.StreamSeq, err)
	}
	return nil
}
