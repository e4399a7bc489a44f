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
	return e.deadLetterStep(ctx, sm.Job, sm.Step, sm.Attempt, sm.Item, raw.Header.Get(jetstream.MsgIDHeader), sm.EffectKey, adv.StreamSeq, adv.Deliveries,
		fmt.Sprintf("delivered %d times, the maximum, and never finished (a worker died or stalled on it every time)", adv.Deliveries))
}

// deadLetterStep fails the attempt whose step message at seq will never be
// delivered again: it publishes a failed, non-retryable result for it,
// with the ledger state of its effect (so that a step whose call may have
// happened stops in needs_reconciliation instead of failing), then removes
// the message. Both steps may be repeated.
func (e *Engine) deadLetterStep(ctx context.Context, job, step string, attempt, item int, msgID, effectKey string, seq, deliveries uint64, why string) error {
	if msgID == "" {
		msgID = schemas.StepMsgID(job, step, attempt)
	}
	state, err := e.effectState(ctx, effectKey)
	if err != nil {
		return fmt.Errorf("dead letter of %s: %w", job, err)
	}
	e.ctr.deadLetters.Add(1)
	e.log.Warn("poison step: its message will not be delivered again", "job", job, "step", step, "attempt", attempt, "item", item,
		"deliveries", deliveries, "effect_state", state, "why", why)
	res := &schemas.StepResult{Job: job, Step: step, Attempt: attempt, Item: item, EffectKey: effectKey, EffectState: state, Error: &schemas.Error{
		Code:    schemas.CodeStepFailed,
		Message: fmt.Sprintf("poison step: %s; it will not be delivered again", why),
	}}
	m := nats.NewMsg(e.store.Names.InboxSubject(kv.InboxResult, job))
	if m.Data, err = schemas.EncodeStepResult(res, m.Header); err != nil {
		return err
	}
	m.Header.Set(jetstream.MsgIDHeader, msgID+"/result/dead-letter")
	if _, err := e.store.JS.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("report dead letter of %s: %w", job, err)
	}
	if err := e.store.Queues.RemoveStep(ctx, seq); err != nil {
		return fmt.Errorf("dead letter of %s: %w", job, err)
	}
	return nil
}
