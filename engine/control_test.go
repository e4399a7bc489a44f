package engine

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

const gatedCharge = `
name: gated
version: 1
input_schema: {type: object, required: [customer, amount], properties: {customer: {type: string}, amount: {type: number}}}
steps:
  - id: quote
    kind: noop
    save_as: quote
    next: [{to: approve}]
  - id: approve
    kind: approval
    save_as: approval
    with:
      action: "charge {{.state.amount}} EUR to {{.state.customer}}"
      approvers: [alice]
      expires_in: 1h
    next: [{to: charge}]
  - id: charge
    kind: noop
    effect: idempotent
    save_as: charge
`

func ctx30(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// TestApprovalGate: the job stops in waiting_approval with the rendered
// action, its digest and expiry; a decision by someone not named, for
// another gate, or for another digest is refused and changes nothing;
// the approval lets the job go on, with the decision in state and
// history; the same approval again answers "already decided".
func TestApprovalGate(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(gatedCharge), `{"customer": "C1", "amount": 40}`, "gate-1")
	b.nextOf(id, ch).reply(json.RawMessage(`{"price": 40}`), nil)
	v := b.wait(id)
	if v.Status != schemas.JobWaitingApproval || len(v.Approvals) != 1 {
		t.Fatalf("status %s approvals %+v", v.Status, v.Approvals)
	}
	a := v.Approvals[0]
	if a.Gate != "approve" || a.ID != "approve/1" || a.Status != schemas.ApprovalPending || a.Action != "charge 40 EUR to C1" ||
		len(a.Digest) != 64 || a.ExpiresAt == nil || a.ExpiresAt.Sub(a.RequestedAt) != time.Hour {
		t.Fatalf("approval %+v", a)
	}
	c := ctx30(t)
	for _, tc := range []struct {
		gate string
		r    client.ControlRequest
		want error
	}{
		{"approve", client.ControlRequest{By: "bob"}, client.ErrNotApprover},
		{"charge", client.ControlRequest{By: "alice"}, client.ErrNoSuchGate},
		{"approve", client.ControlRequest{By: "alice", Digest: strings.Repeat("0", 64)}, client.ErrDigestMismatch},
	} {
		if _, err := b.client.Approve(c, id, tc.gate, tc.r); !errors.Is(err, tc.want) {
			t.Errorf("approve %s by %s: %v, want %v", tc.gate, tc.r.By, err, tc.want)
		}
	}
	if v, _ := b.client.Job(c, id); v.Status != schemas.JobWaitingApproval || v.Approvals[0].Status != schemas.ApprovalPending {
		t.Fatalf("a refused decision changed the job: %s %+v", v.Status, v.Approvals[0])
	}
	got, err := b.client.Approve(c, id, "approve", client.ControlRequest{By: "alice", Reason: "quote checked", Digest: a.Digest})
	if err != nil {
		t.Fatal(err)
	}
	if got.Approvals[0].Status != schemas.ApprovalApproved || got.Approvals[0].DecidedBy != "alice" || got.Approvals[0].Reason != "quote checked" {
		t.Fatalf("decided %+v", got.Approvals[0])
	}
	h := b.nextOf(id, ch)
	if h.sm.Step != "charge" {
		t.Fatalf("dispatched %s after the approval", h.sm.Step)
	}
	var st struct {
		Approval schemas.ApprovalOutput `json:"approval"`
	}
	if err := json.Unmarshal(h.sm.State, &st); err != nil || !st.Approval.Approved || st.Approval.By != "alice" || st.Approval.Digest != a.Digest {
		t.Fatalf("state the charge sees: %s (%v)", h.sm.State, err)
	}
	if _, err := b.client.Approve(c, id, "approve", client.ControlRequest{By: "alice"}); !errors.Is(err, client.ErrAlreadyDecided) {
		t.Fatalf("second approval: %v", err)
	}
	h.reply(json.RawMessage(`{"charged": true}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s %+v", v.Status, v.Error)
	}
	evs, err := b.client.History(c, id)
	if err != nil {
		t.Fatal(err)
	}
	var requested, decided int
	for _, e := range evs {
		switch e.Type {
		case schemas.EventApprovalRequested:
			requested++
		case schemas.EventApprovalDecided:
			decided++
			if e.Data.Approval == nil || e.Data.Approval.Status != schemas.ApprovalApproved || e.Data.By != "alice" {
				t.Errorf("decided event %+v", e.Data)
			}
		}
	}
	if requested != 1 || decided != 1 {
		t.Errorf("approval events: %d requested, %d decided", requested, decided)
	}
}

// TestApprovalRejected: a rejection fails the gate's step with code
// approval_rejected and the job with it (no on_error), with who and why.
func TestApprovalRejected(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(gatedCharge), `{"customer": "C1", "amount": 400}`, "gate-reject")
	b.nextOf(id, ch).reply(json.RawMessage(`{}`), nil)
	b.wait(id)
	v, err := b.client.Reject(ctx30(t), id, "approve", client.ControlRequest{By: "alice", Reason: "too much"})
	if err != nil {
		t.Fatal(err)
	}
	v = b.wait(id)
	if v.Status != schemas.JobFailed || v.Error == nil || v.Error.Code != schemas.CodeApprovalRejected || !strings.Contains(v.Error.Message, "rejected by alice: too much") {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
}

// TestApprovalExpiresOnItsTimer: a gate nobody decides expires on its
// durable timer: the job follows the step's on_error (here to a step that
// records it); a decision after that answers "already decided".
func TestApprovalExpiresOnItsTimer(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(`
name: expiring
version: 1
steps:
  - id: approve
    kind: approval
    with: {action: "ship it", expires_in: 1s}
    on_error: expired
    next: [{to: ship}]
  - {id: ship, kind: noop}
  - {id: expired, kind: noop, save_as: expired}
`)
	id := b.start(def, `{}`, "gate-expire")
	h := b.nextOf(id, ch)
	if h.sm.Step != "expired" {
		t.Fatalf("dispatched %s", h.sm.Step)
	}
	v, err := b.client.Job(ctx30(t), id)
	if err != nil {
		t.Fatal(err)
	}
	a := v.Approvals[0]
	if a.Status != schemas.ApprovalExpired || a.DecidedAt == nil || a.DecidedAt.Before(*a.ExpiresAt) {
		t.Fatalf("approval %+v", a)
	}
	if s := stepOf(v, "approve"); s.Status != schemas.StepFailed || s.LastError == nil || s.LastError.Code != schemas.CodeApprovalExpired {
		t.Fatalf("gate step %+v", s)
	}
	if _, err := b.client.Approve(ctx30(t), id, "approve", client.ControlRequest{By: "late"}); !errors.Is(err, client.ErrAlreadyDecided) {
		t.Fatalf("approval after the expiry: %v", err)
	}
	h.reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s", v.Status)
	}
}

// TestApprovalRacingItsExpiry: an approval that reaches the engine after
// the gate's expiry by the engine's clock, before the expiry timer did,
// is refused: the gate expires then, and the caller is told.
func TestApprovalRacingItsExpiry(t *testing.T) {
	t.Parallel()
	var skew atomic.Int64
	b := setup(t, setupOptions{engine: Config{Now: func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }}})
	b.manualWorker()
	id := b.start(b.define(`
name: racing
version: 1
steps:
  - {id: approve, kind: approval, with: {expires_in: 1h}}
`), `{}`, "gate-race")
	if v := b.wait(id); v.Status != schemas.JobWaitingApproval {
		t.Fatalf("status %s", v.Status)
	}
	skew.Store(int64(2 * time.Hour)) // the engine's clock is past the expiry; the timer is not due
	v, err := b.client.Approve(ctx30(t), id, "approve", client.ControlRequest{By: "alice"})
	if !errors.Is(err, client.ErrApprovalExpired) || v == nil {
		t.Fatalf("approval after the expiry: %v", err)
	}
	if v := b.wait(id); v.Status != schemas.JobFailed || v.Error.Code != schemas.CodeApprovalExpired || v.Approvals[0].Status != schemas.ApprovalExpired {
		t.Fatalf("status %s error %+v approval %+v", v.Status, v.Error, v.Approvals[0])
	}
}

// TestRequiresApprovalGuardsAStep: a step with requires_approval is not
// dispatched until approved; the gate's action names the step's effect key
// and the approved run's first attempt carries that key.
func TestRequiresApprovalGuardsAStep(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(`
name: guarded
version: 1
steps:
  - id: send
    kind: noop
    effect: unsafe
    requires_approval: {approvers: [ops]}
`), `{}`, "guarded-1")
	v := b.wait(id)
	if v.Status != schemas.JobWaitingApproval || len(v.Approvals) != 1 || !strings.Contains(v.Approvals[0].Action, "run step send (effect ") {
		t.Fatalf("status %s approvals %+v", v.Status, v.Approvals)
	}
	select {
	case h := <-ch:
		t.Fatalf("step %s dispatched before its approval", h.sm.Step)
	default:
	}
	if _, err := b.client.Approve(ctx30(t), id, "send", client.ControlRequest{By: "ops"}); err != nil {
		t.Fatal(err)
	}
	h := b.nextOf(id, ch)
	if h.sm.Step != "send" || h.sm.RunAttempt != 1 || !strings.Contains(v.Approvals[0].Action, h.sm.EffectKey) {
		t.Fatalf("dispatched %s run attempt %d key %s", h.sm.Step, h.sm.RunAttempt, h.sm.EffectKey)
	}
	h.reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s", v.Status)
	}
}

// TestPauseHoldsDispatchesUntilResume: a paused job's running step
// finishes and its result applies; the next step is recorded held and
// sent only on resume.
func TestPauseHoldsDispatchesUntilResume(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(agentLessChain), `{}`, "pause-1")
	h := b.nextOf(id, ch)
	c := ctx30(t)
	v, err := b.client.Pause(c, id, client.ControlRequest{By: "ops", Reason: "vendor outage"})
	if err != nil {
		t.Fatal(err)
	}
	if v.Paused == nil || v.Paused.By != "ops" {
		t.Fatalf("paused %+v", v.Paused)
	}
	if _, err := b.client.Pause(c, id, client.ControlRequest{By: "ops"}); !errors.Is(err, client.ErrNotApplicable) {
		t.Fatalf("second pause: %v", err)
	}
	h.reply(json.RawMessage(`{}`), nil)
	var held *schemas.Dispatch
	err = b.store.Checkpoints.Watch(c, id, func(e kv.Entry, err error) bool {
		if err == nil && e.Checkpoint.Current != nil && e.Checkpoint.Current.Step == "two" {
			held = e.Checkpoint.Current
			return false
		}
		return true
	})
	if err != nil || held == nil || !held.Held {
		t.Fatalf("step two after the pause: %+v %v", held, err)
	}
	select {
	case h := <-ch:
		t.Fatalf("step %s sent while paused", h.sm.Step)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := b.client.Resume(c, id, client.ControlRequest{By: "ops"}); err != nil {
		t.Fatal(err)
	}
	h = b.nextOf(id, ch)
	if h.sm.Step != "two" {
		t.Fatalf("sent %s on resume", h.sm.Step)
	}
	h.reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted || v.Paused != nil {
		t.Fatalf("status %s paused %+v", v.Status, v.Paused)
	}
}

// TestRetryGoesOnFromTheFailedStep: a failed job retried goes on from the
// failed step under a new attempt with the same effect key; retried from
// an earlier step, that step's effect key is its first run's too, so a
// confirmed effect would answer from the ledger.
func TestRetryGoesOnFromTheFailedStep(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(`
name: retried
version: 1
defaults: {retry: {max_attempts: 1}}
steps:
  - {id: charge, kind: noop, effect: idempotent, save_as: charge, next: [{to: mail}]}
  - {id: mail, kind: noop, effect: idempotent, save_as: mail}
`), `{}`, "retry-1")
	first := b.nextOf(id, ch)
	first.reply(json.RawMessage(`{"ok": 1}`), nil)
	mail := b.nextOf(id, ch)
	mail.reply(nil, &schemas.Error{Code: schemas.CodeProvider, Message: "mail server down"})
	if v := b.wait(id); v.Status != schemas.JobFailed {
		t.Fatalf("status %s", v.Status)
	}
	c := ctx30(t)
	if _, err := b.client.Retry(c, id, client.ControlRequest{By: "ops", From: "nope"}); err == nil || !strings.Contains(err.Error(), `from "nope" is not a step`) {
		t.Fatalf("retry from an unknown step: %v", err)
	}
	v, err := b.client.Retry(c, id, client.ControlRequest{By: "ops", Reason: "mail server back"})
	if err != nil {
		t.Fatal(err)
	}
	if v.Status != schemas.JobRunning || v.Retries != 1 || v.Error != nil {
		t.Fatalf("after retry: status %s retries %d error %+v", v.Status, v.Retries, v.Error)
	}
	again := b.nextOf(id, ch)
	if again.sm.Step != "mail" || again.sm.EffectKey != mail.sm.EffectKey || again.sm.Attempt <= mail.sm.Attempt || again.sm.RunAttempt != 1 {
		t.Fatalf("retried %s attempt %d/%d key %s (was %d, %s)", again.sm.Step, again.sm.Attempt, again.sm.RunAttempt, again.sm.EffectKey, mail.sm.Attempt, mail.sm.EffectKey)
	}
	again.reply(nil, &schemas.Error{Code: schemas.CodeProvider, Message: "down again"})
	if v := b.wait(id); v.Status != schemas.JobFailed {
		t.Fatalf("status %s", v.Status)
	}
	if _, err := b.client.Retry(c, id, client.ControlRequest{By: "ops", From: "charge"}); err != nil {
		t.Fatal(err)
	}
	h := b.nextOf(id, ch)
	if h.sm.Step != "charge" || h.sm.EffectKey != first.sm.EffectKey {
		t.Fatalf("retried from charge: %s key %s, first %s", h.sm.Step, h.sm.EffectKey, first.sm.EffectKey)
	}
	h.reply(json.RawMessage(`{"ok": 1}`), nil)
	h = b.nextOf(id, ch)
	if h.sm.EffectKey != mail.sm.EffectKey {
		t.Fatalf("mail key %s, was %s", h.sm.EffectKey, mail.sm.EffectKey)
	}
	h.reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted || v.Retries != 2 {
		t.Fatalf("status %s retries %d", v.Status, v.Retries)
	}
	if _, err := b.client.Retry(c, id, client.ControlRequest{By: "ops"}); !errors.Is(err, client.ErrNotApplicable) {
		t.Fatalf("retry of a completed job: %v", err)
	}
	// Listed once, as completed; its failed ends are not listed.
	testsupport.Eventually(t, 10*time.Second, func() bool {
		page, err := b.client.List(c, client.ListFilter{Status: schemas.JobCompleted})
		return err == nil && len(page.Jobs) == 1
	}, "the retried job is not listed as completed")
	if page, err := b.client.List(c, client.ListFilter{}); err != nil || len(page.Jobs) != 1 {
		t.Fatalf("jobs listed: %+v %v", page, err)
	}
}

// TestSleepStepWaitsForItsTimer: a sleep step completes when its durable
// timer fires, not before.
func TestSleepStepWaitsForItsTimer(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	id := b.start(b.define(`
name: sleeper
version: 1
steps:
  - {id: nap, kind: sleep, with: {for: 1s}, save_as: nap}
`), `{}`, "sleep-1")
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s", v.Status)
	}
	if v.CompletedAt.Sub(v.CreatedAt) < time.Second {
		t.Fatalf("completed %v after its start, before its timer", v.CompletedAt.Sub(v.CreatedAt))
	}
	if string(v.State) != `{"nap":{"slept_ms":1000}}` {
		t.Fatalf("state %s", v.State)
	}
}

// TestTimerDueWhileTheEngineWasDown: a sleep whose timer comes due while
// no engine runs fires once the server has it, waits in the timer stream,
// and is applied once by the next engine: the job completes with one
// completion of its sleep.
func TestTimerDueWhileTheEngineWasDown(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	def := b.define(`
name: napper
version: 1
steps:
  - {id: nap, kind: sleep, with: {for: 1s}, next: [{to: after}]}
  - {id: after, kind: noop}
`)
	b.worker(echo)
	e, err := New(Config{Store: b.store, ReconcileInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	id := b.start(def, `{}`, "nap-down")
	c := ctx30(t)
	err = b.store.Checkpoints.Watch(c, id, func(ent kv.Entry, err error) bool {
		return err != nil || ent.Checkpoint.Current == nil || ent.Checkpoint.Current.Due == nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// The timer fires with no engine running: its message waits on the
	// timer stream's due subject.
	st, err := b.store.JS.Stream(c, b.store.Names.TimerStream)
	if err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		_, err := st.GetLastMsgForSubject(c, b.store.Names.TimerDueSubject(id))
		return err == nil
	}, "the timer never fired")
	if v, _ := b.client.Job(c, id); v.Status != schemas.JobRunning {
		t.Fatalf("status %s before an engine ran again", v.Status)
	}
	b.runEngine(Config{})
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s %+v", v.Status, v.Error)
	}
	evs, err := b.client.History(c, id)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, ev := range evs {
		if ev.Type == schemas.EventStepCompleted && ev.Data.Step == "nap" {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("nap completed %d times", n)
	}
}

const waitForPayment = `
name: payment-wait
version: 1
steps:
  - id: prepare
    kind: noop
    next: [{to: paid}]
  - id: paid
    kind: wait
    save_as: payment
    with:
      signal: paid
      schema: {type: object, required: [amount], properties: {amount: {type: number}}}
      when: data.amount >= 10
    next: [{to: ship}]
  - {id: ship, kind: noop}
`

// TestWaitStepTakesASignal: a signal sent before the job reaches its wait
// step is kept and taken when it does; data breaking the schema, a name
// no wait step has and a signal the condition refuses are told apart; the
// same signal id twice is one signal.
func TestWaitStepTakesASignal(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(waitForPayment), `{}`, "wait-1")
	h := b.nextOf(id, ch) // prepare, in flight
	c := ctx30(t)
	if _, _, err := b.client.Signal(c, id, client.SignalRequest{Name: "paid", By: "psp", Data: json.RawMessage(`{"amount": "ten"}`)}); err == nil || !strings.Contains(err.Error(), "does not satisfy the schema of wait step paid") {
		t.Fatalf("bad data: %v", err)
	}
	if _, _, err := b.client.Signal(c, id, client.SignalRequest{Name: "refunded", By: "psp"}); !errors.Is(err, client.ErrNoSuchSignal) || !strings.Contains(err.Error(), "it waits for: paid") {
		t.Fatalf("unknown signal: %v", err)
	}
	// Too small for the condition: kept, never taken; the next is taken.
	if _, rs, err := b.client.Signal(c, id, client.SignalRequest{Name: "paid", By: "psp", ID: "small", Data: json.RawMessage(`{"amount": 5}`)}); err != nil || rs.Taken != "" {
		t.Fatalf("small: %+v %v", rs, err)
	}
	_, rs, err := b.client.Signal(c, id, client.SignalRequest{Name: "paid", By: "psp", ID: "p-1", Data: json.RawMessage(`{"amount": 12.5}`)})
	if err != nil || rs.Taken != "" {
		t.Fatalf("early signal: %+v %v (want kept: the job is not at its wait step)", rs, err)
	}
	if _, rs, err := b.client.Signal(c, id, client.SignalRequest{Name: "paid", By: "psp", ID: "p-1", Data: json.RawMessage(`{"amount": 99}`)}); err != nil || string(rs.Data) != `{"amount":12.5}` {
		t.Fatalf("the same id again: %+v %v", rs, err)
	}
	h.reply(json.RawMessage(`{}`), nil)
	h = b.nextOf(id, ch)
	if h.sm.Step != "ship" {
		t.Fatalf("dispatched %s", h.sm.Step)
	}
	var st struct {
		Payment schemas.SignalOutput `json:"payment"`
	}
	if err := json.Unmarshal(h.sm.State, &st); err != nil || st.Payment.ID != "p-1" || string(st.Payment.Data) != `{"amount":12.5}` || st.Payment.By != "psp" {
		t.Fatalf("state %s %v", h.sm.State, err)
	}
	h.reply(json.RawMessage(`{}`), nil)
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s", v.Status)
	}
	cp, _ := b.store.Checkpoints.Get(c, id)
	var taken, kept int
	for _, r := range cp.Checkpoint.Signals {
		if r.Taken == "paid" {
			taken++
		} else if r.ID == "small" {
			kept++
		}
	}
	if taken != 1 || kept != 1 || len(cp.Checkpoint.Signals) != 2 {
		t.Fatalf("signals %+v", cp.Checkpoint.Signals)
	}
}

// TestWaitTimesOut: a wait step with a timeout fails with code timeout
// when no signal comes, and the job follows its on_error.
func TestWaitTimesOut(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	id := b.start(b.define(`
name: wait-timeout
version: 1
steps:
  - {id: paid, kind: wait, with: {signal: paid, timeout: 1s}, on_error: chase}
  - {id: chase, kind: noop, save_as: chase}
`), `{}`, "wait-timeout")
	v := b.wait(id)
	if v.Status != schemas.JobCompleted || !strings.Contains(string(v.State), "chase") {
		t.Fatalf("status %s state %s", v.Status, v.State)
	}
	if s := stepOf(v, "paid"); s.Status != schemas.StepFailed || s.LastError == nil || s.LastError.Code != schemas.CodeTimeout || !strings.Contains(s.LastError.Message, "no signal paid came within 1s") {
		t.Fatalf("wait step %+v", s)
	}
}

// TestSignalWithStart: a signal with start creates the job when it does
// not exist and delivers the signal; a second call with the same job id
// and signal id (a retried webhook) attaches and answers with the signal
// as received, delivering nothing new; a new signal to the ended job is
// refused.
func TestSignalWithStart(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	def := b.define(`
name: on-signal
version: 1
steps:
  - {id: go, kind: wait, with: {signal: go}, save_as: got}
`)
	c := ctx30(t)
	req := client.SignalRequest{Name: "go", By: "webhook", ID: "evt-1", Data: json.RawMessage(`{"n": 1}`)}
	res, _, rs, err := b.client.SignalWithStart(c, def, json.RawMessage(`{}`), client.StartOptions{JobID: "sws-1"}, req)
	if err != nil || res.Attached || rs == nil {
		t.Fatalf("first: %+v %+v %v", res, rs, err)
	}
	if v := b.wait("sws-1"); v.Status != schemas.JobCompleted || !strings.Contains(string(v.State), `"id":"evt-1"`) {
		t.Fatalf("status %s state %s", v.Status, v.State)
	}
	res, _, rs, err = b.client.SignalWithStart(c, def, json.RawMessage(`{}`), client.StartOptions{JobID: "sws-1"}, req)
	if !res.Attached || err != nil || rs.Outcome != "received before" || rs.Taken != "go" {
		t.Fatalf("second (a retried webhook): %+v %+v %v", res, rs, err)
	}
	if _, _, err := b.client.Signal(c, "sws-1", client.SignalRequest{Name: "go", By: "webhook", ID: "evt-2"}); !errors.Is(err, client.ErrNotApplicable) {
		t.Fatalf("a new signal to the ended job: %v", err)
	}
}

// TestRewindAcrossAConfirmedEffect: a failed job rewound to the sequence
// at which its charge step was dispatched goes on from there with the
// state it had then; the charge runs again under its first run's
// idempotency key (the ledger answers a confirmed charge, it is not made
// twice), and StateAt rebuilds each sequence from the history.
func TestRewindAcrossAConfirmedEffect(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(`
name: rewound
version: 1
defaults: {retry: {max_attempts: 1}}
steps:
  - {id: quote, kind: noop, save_as: quote, next: [{to: charge}]}
  - {id: charge, kind: noop, effect: idempotent, save_as: charge, next: [{to: mail}]}
  - {id: mail, kind: noop, effect: idempotent, save_as: mail}
`), `{"order": "A-1"}`, "rewind-1")
	b.nextOf(id, ch).reply(json.RawMessage(`{"price": 40}`), nil)
	charge := b.nextOf(id, ch)
	charge.reply(json.RawMessage(`{"id": "ch_1"}`), nil)
	b.nextOf(id, ch).reply(nil, &schemas.Error{Code: schemas.CodeProvider, Message: "mail down"})
	if v := b.wait(id); v.Status != schemas.JobFailed {
		t.Fatalf("status %s", v.Status)
	}
	c := ctx30(t)
	evs, err := b.client.History(c, id)
	if err != nil {
		t.Fatal(err)
	}
	var at uint64
	for _, e := range evs {
		if e.Type == schemas.EventStepDispatched && e.Data.Step == "charge" {
			at = e.Data.Seq
		}
		if e.Type == schemas.EventStepCompleted && e.Data.Step == "quote" && e.Data.Next == "charge" {
			at = e.Data.Seq
		}
	}
	snap, err := b.client.StateAt(c, id, at)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Next != "charge" || string(snap.State) != `{"order":"A-1","quote":{"price":40}}` || snap.Runs["quote"] != 1 || snap.Runs["charge"] != 0 {
		t.Fatalf("snapshot at seq %d: %+v state %s", at, snap, snap.State)
	}
	last, err := b.client.StateAt(c, id, snap.LastSeq)
	if err != nil || last.Status != schemas.JobFailed || !strings.Contains(string(last.State), `"charge":{"id":"ch_1"}`) {
		t.Fatalf("snapshot at the last seq: %+v %v", last, err)
	}
	if _, err := b.client.StateAt(c, id, snap.LastSeq+1); err == nil {
		t.Fatal("a snapshot past the last sequence")
	}
	if _, err := b.client.Rewind(c, id, snap.LastSeq, client.ControlRequest{By: "ops"}); err == nil || !strings.Contains(err.Error(), "the job had failed by then") {
		t.Fatalf("rewind to the end: %v", err)
	}
	res, err := b.client.Rewind(c, id, at, client.ControlRequest{By: "ops", Reason: "charge the right card"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Job.Status != schemas.JobRunning || string(res.Job.State) != string(snap.State) {
		t.Fatalf("after the rewind: %s %s", res.Job.Status, res.Job.State)
	}
	again := b.nextOf(id, ch)
	if again.sm.Step != "charge" || again.sm.EffectKey != charge.sm.EffectKey || again.sm.Attempt <= charge.sm.Attempt {
		t.Fatalf("after the rewind came %s attempt %d key %s (the charge was attempt %d key %s)", again.sm.Step, again.sm.Attempt, again.sm.EffectKey, charge.sm.Attempt, charge.sm.EffectKey)
	}
	again.reply(json.RawMessage(`{"id": "ch_1"}`), nil)
	b.nextOf(id, ch).reply(json.RawMessage(`{"sent": true}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s %+v", v.Status, v.Error)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		page, err := b.client.List(c, client.ListFilter{})
		return err == nil && len(page.Jobs) == 1 && page.Jobs[0].Status == schemas.JobCompleted
	}, "the rewound job is not listed once, as completed")
}

// TestConcurrentPausesOneWins: of several pauses sent at once, one is
// applied and told so; the others are told which came first.
func TestConcurrentPausesOneWins(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(agentLessChain), `{}`, "pause-race")
	b.nextOf(id, ch)
	c := ctx30(t)
	errs := make(chan error, 5)
	for i := range 5 {
		go func() {
			_, err := b.client.Pause(c, id, client.ControlRequest{By: "ops-" + strconv.Itoa(i)})
			errs <- err
		}()
	}
	won := 0
	for range 5 {
		err := <-errs
		switch {
		case err == nil:
			won++
		case errors.Is(err, client.ErrNotApplicable) && (strings.Contains(err.Error(), "came first") || strings.Contains(err.Error(), "paused already")):
		default:
			t.Errorf("pause: %v", err)
		}
	}
	if won != 1 {
		t.Fatalf("%d pauses were told they applied, want 1", won)
	}
}

// TestApprovalActionShowsControlCharacters: text from state cannot hide
// what an approval asks for behind terminal escapes.
func TestApprovalActionShowsControlCharacters(t *testing.T) {
	t.Parallel()
	if got := printable("refund 999 to bob\x1b[1G\x1b[Kapproval: refund 5\r"); got != `refund 999 to bob\u001b[1G\u001b[Kapproval: refund 5\u000d` {
		t.Fatalf("printable: %q", got)
	}
}

// TestForkWhileTheParentRuns: a fork taken at the sequence at which its
// parent's charge was in flight starts at the charge, with the state then
// and its changes; its charge takes the parent's key (the parent had
// reached it: the ledger would answer the parent's charge, never make a
// second), its later steps keys of their own; the parent is not changed
// and goes on.
func TestForkWhileTheParentRuns(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(`
name: forked
version: 1
steps:
  - {id: quote, kind: noop, save_as: quote, next: [{to: charge}]}
  - {id: charge, kind: noop, effect: idempotent, save_as: charge, next: [{to: mail}]}
  - {id: mail, kind: noop, effect: idempotent, save_as: mail}
`), `{"order": "A-1"}`, "parent-1")
	b.nextOf(id, ch).reply(json.RawMessage(`{"price": 40}`), nil)
	charge := b.nextOf(id, ch)
	c := ctx30(t)
	before, _ := b.store.Checkpoints.Get(c, id)
	at := before.Checkpoint.Seq
	if _, err := b.client.Fork(c, id, at, client.ForkRequest{By: "ops", JobID: "fork-1", Set: map[string]json.RawMessage{"quote.price": json.RawMessage(`50`)}}); err != nil {
		t.Fatal(err)
	}
	fc := b.nextOf("fork-1", ch)
	if fc.sm.Job != "fork-1" || fc.sm.Step != "charge" || fc.sm.EffectKey != charge.sm.EffectKey || !strings.Contains(string(fc.sm.State), `"price":50`) {
		t.Fatalf("fork's first dispatch: job %s step %s key %s (parent's %s) state %s", fc.sm.Job, fc.sm.Step, fc.sm.EffectKey, charge.sm.EffectKey, fc.sm.State)
	}
	after, _ := b.store.Checkpoints.Get(c, id)
	if after.Revision != before.Revision {
		t.Fatalf("the fork changed its parent: revision %d → %d", before.Revision, after.Revision)
	}
	fc.reply(json.RawMessage(`{"id": "ch_1"}`), nil)
	fm := b.nextOf("fork-1", ch)
	charge.reply(json.RawMessage(`{"id": "ch_1"}`), nil)
	pm := b.nextOf(id, ch)
	if fm.sm.Step != "mail" || pm.sm.Step != "mail" || fm.sm.EffectKey == pm.sm.EffectKey {
		t.Fatalf("mail keys: fork %s %s, parent %s %s", fm.sm.Step, fm.sm.EffectKey, pm.sm.Step, pm.sm.EffectKey)
	}
	fm.reply(json.RawMessage(`{}`), nil)
	pm.reply(json.RawMessage(`{}`), nil)
	fv, pv := b.wait("fork-1"), b.wait(id)
	if fv.Status != schemas.JobCompleted || pv.Status != schemas.JobCompleted || fv.Fork == nil || fv.Fork.Parent != id || fv.Fork.Seq != at || fv.Parent != id {
		t.Fatalf("fork %s %+v, parent %s", fv.Status, fv.Fork, pv.Status)
	}
	if !strings.Contains(string(pv.State), `"price": 40`) {
		t.Fatalf("parent state %s", pv.State)
	}
	if _, err := b.client.Fork(c, id, pv.Seq, client.ForkRequest{By: "ops"}); err == nil || !strings.Contains(err.Error(), "completed by then") {
		t.Fatalf("fork at the end: %v", err)
	}
}

// TestCronScheduleAcrossARestart: a cron schedule starts a job per
// firing; the firings while no engine runs roll up into one job, started
// once an engine runs again; a removed schedule fires no more.
func TestCronScheduleAcrossARestart(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	b.worker(echo)
	def := b.define("name: tick\nversion: 1\nsteps:\n  - {id: a, kind: noop}\n")
	c := ctx30(t)
	if err := b.store.Definitions.Put(c, def); err != nil {
		t.Fatal(err)
	}
	if err := b.store.PutCron(c, &kv.CronSchedule{Name: "every-second", Workflow: "tick", Cron: "* * * * * *", Input: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := b.store.PutCron(c, &kv.CronSchedule{Name: "bad", Workflow: "tick", Cron: "not a cron"}); err == nil {
		t.Fatal("a bad cron expression was stored")
	}
	jobs := func() []string {
		page, err := b.client.List(c, client.ListFilter{Workflow: "tick", Limit: 1000})
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, j := range page.Jobs {
			ids = append(ids, j.ID)
		}
		return ids
	}
	e, err := New(Config{Store: b.store, ReconcileInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	testsupport.Eventually(t, 20*time.Second, func() bool { return len(jobs()) >= 2 }, "the schedule started no jobs")
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	stoppedAt := time.Now()
	st, err := b.store.JS.Stream(c, b.store.Names.TimerStream)
	if err != nil {
		t.Fatal(err)
	}
	fired := func() uint64 {
		m, err := st.GetLastMsgForSubject(c, b.store.Names.TimerPrefix+"fired.every-second")
		if err != nil {
			return 0
		}
		return m.Sequence
	}
	// Two firings seen while no engine runs: the second rolled the first up.
	seen := map[uint64]bool{}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		if q := fired(); q != 0 {
			seen[q] = true
		}
		return len(seen) >= 2
	}, "the schedule did not fire twice while the engine was down")
	if err := b.store.RemoveCron(c, "every-second"); err != nil {
		t.Fatal(err)
	}
	if err := b.store.RemoveCron(c, "every-second"); !errors.Is(err, schemas.ErrNotFound) {
		t.Fatalf("removed twice: %v", err)
	}
	before := len(jobs())
	b.runEngine(Config{})
	cons, err := b.store.JS.Consumer(c, b.store.Names.TimerStream, b.store.Names.TimerConsumer)
	if err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 20*time.Second, func() bool {
		info, err := cons.Info(c)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && len(jobs()) > before
	}, "no job came of the firings while the engine was down")
	var after int
	for _, id := range jobs() {
		ts, err := time.Parse("20060102T150405Z", strings.TrimPrefix(id, "every-second-"))
		if err == nil && !ts.Before(stoppedAt.Truncate(time.Second).Add(time.Second)) {
			after++
		}
	}
	if after != 1 {
		t.Fatalf("%d jobs of firings after the engine stopped, want 1 (rolled up): %v", after, jobs())
	}
}

// TestExpiredOutputRunsAgainBeforeItIsUsed: a quote valid for a minute,
// then an approval decided after it expired: the quote runs again before
// the charge that reads it is dispatched; one decided in time goes on.
func TestExpiredOutputRunsAgainBeforeItIsUsed(t *testing.T) {
	t.Parallel()
	var skew atomic.Int64
	b := setup(t, setupOptions{engine: Config{Now: func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }}})
	ch := b.manualWorker()
	def := b.define(`
name: fresh
version: 1
steps:
  - {id: quote, kind: noop, save_as: quote, valid_for: 1m, next: [{to: approve}]}
  - {id: approve, kind: approval, next: [{to: charge}]}
  - {id: charge, kind: noop, effect: idempotent}
`)
	// Decided in time: the charge follows the approval.
	inTime := b.start(def, `{}`, "fresh-0")
	b.nextOf(inTime, ch).reply(json.RawMessage(`{"price": 40}`), nil)
	b.wait(inTime)
	if _, err := b.client.Approve(ctx30(t), inTime, "approve", client.ControlRequest{By: "alice"}); err != nil {
		t.Fatal(err)
	}
	if h := b.nextOf(inTime, ch); h.sm.Step != "charge" {
		t.Fatalf("approved in time, then %s", h.sm.Step)
	} else {
		h.reply(json.RawMessage(`{}`), nil)
	}
	id := b.start(def, `{}`, "fresh-1")
	first := b.nextOf(id, ch)
	first.reply(json.RawMessage(`{"price": 40}`), nil)
	if v := b.wait(id); v.Status != schemas.JobWaitingApproval {
		t.Fatalf("status %s", v.Status)
	}
	skew.Store(int64(2 * time.Minute)) // the quote has expired by the engine's clock
	if _, err := b.client.Approve(ctx30(t), id, "approve", client.ControlRequest{By: "alice"}); err != nil {
		t.Fatal(err)
	}
	again := b.nextOf(id, ch)
	if again.sm.Step != "quote" || again.sm.EffectKey != "" {
		t.Fatalf("after the approval came %s", again.sm.Step)
	}
	again.reply(json.RawMessage(`{"price": 42}`), nil)
	charge := b.nextOf(id, ch)
	if charge.sm.Step != "charge" || !strings.Contains(string(charge.sm.State), `"price": 42`) {
		t.Fatalf("then %s with state %s", charge.sm.Step, charge.sm.State)
	}
	charge.reply(json.RawMessage(`{}`), nil)
	if v := b.wait(id); v.Status != schemas.JobCompleted {
		t.Fatalf("status %s", v.Status)
	}
}

// TestMigrateABlockedJob: a job whose pinned definition is gone stays
// blocked; a migration whose state breaks the new state schema is refused
// with the JSON pointer at fault and changes nothing; one with a patch
// that fixes the state moves the job to the new definition, recorded in
// its history, and the job goes on from where it was.
func TestMigrateABlockedJob(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{noEngine: true})
	ch := b.manualWorker()
	v1 := b.define(`
name: moving
version: 1
steps:
  - {id: a, kind: noop, save_as: a, next: [{to: b}]}
  - {id: b, kind: noop}
`)
	c := ctx30(t)
	id := b.start(v1, `{"order": "A-1"}`, "migrate-1")
	defs, err := b.store.JS.KeyValue(c, b.store.Names.DefinitionBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := defs.Purge(c, v1.Hash); err != nil {
		t.Fatal(err)
	}
	b.runEngine(Config{Store: b.srv.Store(t, kv.Config{InboxAckWait: 2 * time.Second, WorkAckWait: 2 * time.Second})})
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err := b.client.Job(c, id)
		return err == nil && v.Status == schemas.JobBlocked
	}, "the job never blocked")
	v2 := b.define(`
name: moving
version: 2
state_schema: {type: object, required: [order, currency], properties: {currency: {enum: [eur, usd]}}}
steps:
  - {id: a, kind: noop, save_as: a, next: [{to: b}]}
  - {id: b, kind: noop, save_as: b}
`)
	if err := b.store.Definitions.Put(c, v2); err != nil {
		t.Fatal(err)
	}
	_, err = b.client.Migrate(c, id, client.MigrateRequest{To: "moving@2", By: "ops", Patch: json.RawMessage(`[{"op": "add", "path": "/currency", "value": "gbp"}]`)})
	if !errors.Is(err, client.ErrMigration) || !strings.Contains(err.Error(), "at /currency") {
		t.Fatalf("a migration breaking the schema: %v", err)
	}
	if v, _ := b.client.Job(c, id); v.Status != schemas.JobBlocked || v.DefinitionHash != v1.Hash {
		t.Fatalf("a refused migration changed the job: %s %s", v.Status, v.DefinitionHash)
	}
	if _, err := b.client.Migrate(c, id, client.MigrateRequest{To: "moving@3", By: "ops"}); err == nil || !strings.Contains(err.Error(), "stored last is v2") {
		t.Fatalf("a version not stored: %v", err)
	}
	v, err := b.client.Migrate(c, id, client.MigrateRequest{To: v2.Hash, By: "ops", Reason: "v1 was deleted", Patch: json.RawMessage(`[{"op": "add", "path": "/currency", "value": "eur"}]`)})
	if err != nil {
		t.Fatal(err)
	}
	if v.DefinitionHash != v2.Hash || v.Version != 2 || !strings.Contains(string(v.State), `"currency":"eur"`) {
		t.Fatalf("migrated: %s v%d %s", v.DefinitionHash, v.Version, v.State)
	}
	h := b.nextOf(id, ch)
	if h.sm.Step != "a" || h.sm.DefinitionHash != v2.Hash {
		t.Fatalf("after the migration: %s under %s", h.sm.Step, h.sm.DefinitionHash)
	}
	h.reply(json.RawMessage(`{}`), nil)
	b.nextOf(id, ch).reply(json.RawMessage(`{}`), nil)
	if done := b.wait(id); done.Status != schemas.JobCompleted {
		t.Fatalf("status %s %+v", done.Status, done.Error)
	}
	evs, _ := b.client.History(c, id)
	if !slices.ContainsFunc(evs, func(e schemas.HistoryEvent) bool {
		return e.Type == schemas.EventJobMigrated && e.Data.By == "ops" && strings.Contains(e.Data.Reason, "v1 was deleted")
	}) {
		t.Fatal("no job.migrated event")
	}
}

// TestJobDeadline: a job past its deadline fails with code timeout on its
// durable timer, naming what was in flight; the late result of its step is
// dropped and nothing more is dispatched.
func TestJobDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(`
name: deadlined
version: 1
deadline: 1s
steps:
  - {id: slow, kind: noop, next: [{to: after}]}
  - {id: after, kind: noop}
`), `{}`, "deadline-1")
	h := b.nextOf(id, ch)
	v := b.wait(id)
	if v.Status != schemas.JobFailed || v.Error == nil || v.Error.Code != schemas.CodeTimeout || !strings.Contains(v.Error.Message, "the job's deadline (1s from its start) passed") ||
		!strings.Contains(v.Error.Message, "in flight: slow") {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
	h.reply(json.RawMessage(`{}`), nil) // late: dropped
	select {
	case h := <-ch:
		t.Fatalf("step %s dispatched after the deadline", h.sm.Step)
	case <-time.After(300 * time.Millisecond):
	}
}

// TestConcurrentMigrationsOneWins: two migrations of one job sent at once:
// one is applied and told so, the other is told which came first and
// changes nothing; the job's open gate opens again under the new
// definition (a new gate, the old one discarded).
func TestConcurrentMigrationsOneWins(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.manualWorker()
	v1 := b.define("name: racing-mig\nversion: 1\nsteps:\n  - {id: gate, kind: approval, with: {action: 'pay {{.state.amount}}'}}\n")
	id := b.start(v1, `{"amount": 5}`, "mig-race")
	if v := b.wait(id); v.Status != schemas.JobWaitingApproval {
		t.Fatalf("status %s", v.Status)
	}
	v2 := b.define("name: racing-mig\nversion: 2\nsteps:\n  - {id: gate, kind: approval, with: {action: 'pay {{.state.amount}} {{.state.currency}}'}}\n")
	c := ctx30(t)
	if err := b.store.Definitions.Put(c, v2); err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		v   *client.JobView
		err error
	}
	// With no engine running, both are made from the same checkpoint (one
	// made after the other was applied would apply too) and wait in the
	// inbox; then an engine takes them in turn.
	b.cancel()
	<-b.done
	outs := make(chan outcome, 2)
	for _, cur := range []string{"eur", "usd"} {
		go func() {
			v, err := b.client.Migrate(c, id, client.MigrateRequest{To: v2.Hash, By: "ops-" + cur, Patch: json.RawMessage(`[{"op": "add", "path": "/currency", "value": "` + cur + `"}]`)})
			outs <- outcome{v, err}
		}()
	}
	inbox, err := b.store.JS.Stream(c, b.store.Names.InboxStream)
	if err != nil {
		t.Fatal(err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		info, err := inbox.Info(c, jetstream.WithSubjectFilter(b.store.Names.InboxSubject(kv.InboxSignal, id)))
		return err == nil && len(info.State.Subjects) == 1 && info.State.Subjects[b.store.Names.InboxSubject(kv.InboxSignal, id)] == 2
	}, "the two migrations are not both in the inbox")
	b.runEngine(Config{})
	won, lost := 0, 0
	for range 2 {
		o := <-outs
		switch {
		case o.err == nil:
			won++
		case errors.Is(o.err, client.ErrNotApplicable) && strings.Contains(o.err.Error(), "came first"):
			lost++
		default:
			t.Errorf("migrate: %v", o.err)
		}
	}
	if won != 1 || lost != 1 {
		t.Fatalf("%d migrations applied, %d told another came first", won, lost)
	}
	v, _ := b.client.Job(c, id)
	evs, _ := b.client.History(c, id)
	migrated := 0
	for _, e := range evs {
		if e.Type == schemas.EventJobMigrated {
			migrated++
		}
	}
	if migrated != 1 || v.DefinitionHash != v2.Hash || len(v.Approvals) != 2 || v.Approvals[0].Status != schemas.ApprovalExpired ||
		v.Approvals[1].Status != schemas.ApprovalPending || !strings.HasPrefix(v.Approvals[1].Action, "pay 5 ") {
		t.Fatalf("%d migrations recorded; definition %s; gates %+v", migrated, v.DefinitionHash, v.Approvals)
	}
}

// TestForkKeepsTheParentsScopedApproval: a fork taken after its parent's
// scoped approval carries it: the fork's charge goes with the scope.
func TestForkKeepsTheParentsScopedApproval(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(`
name: scoped-fork
version: 1
steps:
  - id: approve
    kind: approval
    with: {action: 'up to 40', scope: {steps: [charge], when: 'request.body.amount <= 40'}}
    next: [{to: charge}]
  - {id: charge, kind: http, with: {url: 'http://127.0.0.1:1/charge', body: {amount: '{{json .state.amount}}'}}}
`), `{"amount": 40}`, "scoped-parent")
	b.wait(id)
	c := ctx30(t)
	if _, err := b.client.Approve(c, id, "approve", client.ControlRequest{By: "alice"}); err != nil {
		t.Fatal(err)
	}
	pc := b.nextOf(id, ch)
	if pc.sm.Scope != "request.body.amount <= 40" {
		t.Fatalf("parent's charge scope %q", pc.sm.Scope)
	}
	ent, _ := b.store.Checkpoints.Get(c, id)
	if _, err := b.client.Fork(c, id, ent.Checkpoint.Seq, client.ForkRequest{By: "ops", JobID: "scoped-fork-1", Set: map[string]json.RawMessage{"amount": json.RawMessage(`999999`)}}); err != nil {
		t.Fatal(err)
	}
	fc := b.nextOf("scoped-fork-1", ch)
	if fc.sm.Step != "charge" || fc.sm.Scope != pc.sm.Scope {
		t.Fatalf("the fork's %s goes with scope %q, want the parent's %q", fc.sm.Step, fc.sm.Scope, pc.sm.Scope)
	}
}
