package engine

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/schemas"
)

// TestCancelStopsAJob: a running job cancelled while a step is in flight
// ends cancelled, with who and why and what was in flight; the step's late
// result is dropped and nothing more is dispatched; cancelling it again,
// or cancelling a completed job, changes nothing.
func TestCancelStopsAJob(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define(parallelThree)
	id := b.start(def, `{}`, "cancel-1")
	var hs []held
	for range 3 {
		hs = append(hs, next(t, ch))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := b.client.Cancel(ctx, id, client.CancelRequest{By: "ops@example.com", Reason: "wrong customer"})
	if err != nil {
		t.Fatal(err)
	}
	if v.Status != schemas.JobCancelled || v.Error == nil || v.Error.Code != schemas.CodeCancelled || v.Error.Message != "by ops@example.com: wrong customer" {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
	for _, h := range hs {
		h.reply(json.RawMessage(`{}`), nil) // late: dropped
	}
	select {
	case h := <-ch:
		t.Fatalf("step %s dispatched after the cancel", h.sm.Step)
	case <-time.After(300 * time.Millisecond):
	}
	evs, err := b.client.History(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	var cancelled *schemas.HistoryEvent
	for i := range evs {
		if evs[i].Type == schemas.EventJobCancelled {
			cancelled = &evs[i]
		}
		if evs[i].Type == schemas.EventStepCompleted {
			t.Errorf("a result was applied after the cancel: %+v", evs[i].Data)
		}
	}
	if cancelled == nil || cancelled.Data.By != "ops@example.com" || !strings.Contains(cancelled.Data.Reason, "in flight: a, b, c") {
		t.Fatalf("job.cancelled event %+v", cancelled)
	}
	again, err := b.client.Cancel(ctx, id, client.CancelRequest{By: "someone else"})
	if err != nil || again.Status != schemas.JobCancelled || again.Error.Message != v.Error.Message {
		t.Fatalf("cancelled again: %+v %v", again, err)
	}
	if _, err := b.client.Cancel(ctx, id, client.CancelRequest{}); err == nil || !strings.Contains(err.Error(), "say who cancels it") {
		t.Fatalf("cancel without by: %v", err)
	}
	if _, err := b.client.Cancel(ctx, "no-such-job", client.CancelRequest{By: "x"}); err == nil {
		t.Fatal("cancel of an unknown job did not fail")
	}

	doneID := b.start(b.define(agentLessChain), `{}`, "cancel-done")
	for range 2 {
		b.nextOf(doneID, ch).reply(json.RawMessage(`{}`), nil)
	}
	done := b.wait(doneID)
	if done.Status != schemas.JobCompleted {
		t.Fatalf("status %s", done.Status)
	}
	after, err := b.client.Cancel(ctx, "cancel-done", client.CancelRequest{By: "ops"})
	if err != nil || after.Status != schemas.JobCompleted {
		t.Fatalf("cancel of a completed job: %+v %v", after, err)
	}
}

const agentLessChain = `
name: chain2
version: 1
steps:
  - {id: one, kind: noop, next: [{to: two}]}
  - {id: two, kind: noop}
`

// TestCancelCancelsChildren: cancelling a parent whose workflow step's
// child job runs cancels the child too.
func TestCancelCancelsChildren(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	b.storeDef(kidWorkflow)
	id := b.start(b.define(parentWorkflow), `{"req": {"n": 1}}`, "cancel-parent")
	h := next(t, ch) // the child's first step
	child := schemas.ChildJobID(id, "call", 1)
	if h.sm.Job != child {
		t.Fatalf("first step message of job %s, want the child %s", h.sm.Job, child)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := b.client.Cancel(ctx, id, client.CancelRequest{By: "ops"}); err != nil {
		t.Fatal(err)
	}
	cv := b.wait(child)
	if cv.Status != schemas.JobCancelled || cv.Error == nil || !strings.Contains(cv.Error.Message, "parent job "+id) {
		t.Fatalf("child: status %s error %+v", cv.Status, cv.Error)
	}
}

// TestCancelAJobWaitingForAPerson: a job stopped in needs_reconciliation
// (an unsafe step's outcome unknown) can be cancelled; the effect's key is
// named as in flight.
func TestCancelAJobWaitingForAPerson(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	def := b.define("name: unsafe1\nversion: 1\nsteps:\n  - {id: send, kind: noop, effect: unsafe, retry: {max_attempts: 1}}\n")
	id := b.start(def, `{}`, "cancel-blocked")
	h := next(t, ch)
	// The ledger's record, as a worker cut off after its call leaves it.
	at := time.Now().UTC()
	if _, err := b.store.Effects.Create(context.Background(), &schemas.EffectRecord{Key: h.sm.EffectKey, Job: id, Step: "send", Class: schemas.EffectUnsafe,
		State: schemas.EffectAmbiguous, Attempt: h.sm.Attempt, PreparedAt: at, UpdatedAt: at}); err != nil {
		t.Fatal(err)
	}
	h.send(&schemas.StepResult{Job: id, Step: "send", Attempt: h.sm.Attempt, EffectKey: h.sm.EffectKey,
		EffectState: schemas.EffectDispatched, Error: &schemas.Error{Code: schemas.CodeTimeout, Message: "no answer"}})
	if v := b.wait(id); v.Status != schemas.JobNeedsReconciliation {
		t.Fatalf("status %s, want needs_reconciliation", v.Status)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := b.client.Cancel(ctx, id, client.CancelRequest{By: "ops", Reason: "customer gone"})
	if err != nil || v.Status != schemas.JobCancelled || v.Blocked != nil {
		t.Fatalf("cancel: %+v %v", v, err)
	}
	evs, err := b.client.History(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range evs {
		found = found || (e.Type == schemas.EventJobCancelled && strings.Contains(e.Data.Reason, "send (effect "+h.sm.EffectKey+", its outcome unknown)"))
	}
	if !found {
		t.Errorf("no job.cancelled event names the effect waiting for a person: %+v", evs)
	}
	// What became of the effect can still be recorded; nothing resumes.
	res, err := b.client.ResolveEffect(ctx, h.sm.EffectKey, schemas.EffectResolution{Happened: true, By: "ops", Note: "the mail went out"})
	if err != nil || res.State != schemas.EffectReconciled || len(res.Resumed) != 0 {
		t.Fatalf("resolve after the cancel: %+v %v", res, err)
	}
	if v, _ := b.client.Job(ctx, id); v.Status != schemas.JobCancelled {
		t.Fatalf("the resolution moved the cancelled job to %s", v.Status)
	}
}

// TestCancelRemovesQueuedSteps: a cancelled job's step message that no
// worker has taken yet is removed from the work stream, so none starts
// it later.
func TestCancelRemovesQueuedSteps(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	def := b.define("name: idle\nversion: 1\nsteps:\n  - {id: wait, kind: noop, pool: nobody}\n")
	id := b.start(def, `{}`, "cancel-queued")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	testsupport.Eventually(t, 10*time.Second, func() bool {
		_, queued, err := b.store.Queues.StepQueued(ctx, "nobody", id)
		return err == nil && queued
	}, "the step message was never queued")
	if v, err := b.client.Cancel(ctx, id, client.CancelRequest{By: "ops"}); err != nil || v.Status != schemas.JobCancelled {
		t.Fatalf("cancel: %+v %v", v, err)
	}
	testsupport.Eventually(t, 10*time.Second, func() bool {
		_, queued, err := b.store.Queues.StepQueued(ctx, "nobody", id)
		return err == nil && !queued
	}, "the cancelled job's step message is still queued")
	for _, bad := range []client.CancelRequest{{By: "evil\x1b[31m"}, {By: "x", Reason: "a\nb"}, {By: "bad \xff byte"}} {
		if _, err := b.client.Cancel(ctx, id, bad); err == nil || schemas.AsError(err).Code != schemas.CodeInputInvalid {
			t.Errorf("cancel with %q / %q: %v, want input_invalid", bad.By, bad.Reason, err)
		}
	}
}

// TestCancelWhileAnUnsafeCallIsInFlight: a job cancelled while its unsafe
// step's call is out ends cancelled at once, naming the call's effect key
// in what was in flight; the call's late answer is dropped and nothing
// follows it.
func TestCancelWhileAnUnsafeCallIsInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ch := b.manualWorker()
	id := b.start(b.define(`
name: mailer
version: 1
steps:
  - {id: send, kind: noop, effect: unsafe, next: [{to: after}]}
  - {id: after, kind: noop}
`), `{}`, "cancel-unsafe")
	h := b.nextOf(id, ch)
	if h.sm.EffectKey == "" {
		t.Fatal("the unsafe step has no effect key")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := b.client.Cancel(ctx, id, client.CancelRequest{By: "ops", Reason: "wrong recipient"})
	if err != nil || v.Status != schemas.JobCancelled {
		t.Fatalf("cancel: %+v %v", v, err)
	}
	evs, err := b.client.History(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range evs {
		if e.Type == schemas.EventJobCancelled && strings.Contains(e.Data.Reason, "in flight: send (effect "+h.sm.EffectKey+")") {
			found = true
		}
	}
	if !found {
		t.Fatalf("job.cancelled does not name the call in flight: %+v", evs)
	}
	h.reply(json.RawMessage(`{"sent": true}`), nil) // the call's late answer
	select {
	case h := <-ch:
		t.Fatalf("step %s dispatched after the cancel", h.sm.Step)
	case <-time.After(300 * time.Millisecond):
	}
	if after, _ := b.client.Job(ctx, id); after.Status != schemas.JobCancelled {
		t.Fatalf("status after the late answer: %s", after.Status)
	}
}
