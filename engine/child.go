package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/engine/client"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Child jobs: a workflow step's dispatch is recorded like any other
// (intent before action); instead of a step message, the engine starts the
// child job under an id derived from the dispatch, which a crash cannot
// change, so a second start attaches to the first. The child's end comes
// back to the parent's inbox as the dispatch's result. The reconciler
// covers both crash windows from the parent's side: a child never created
// is created, an ended child whose result never came is sent again.

// startChild starts the child job of d, a dispatch of cp's workflow step
// (idempotent: an existing child is attached to).
func (e *Engine) startChild(ctx context.Context, cp *schemas.Checkpoint, d *schemas.Dispatch) error {
	def, err := e.store.Definitions.Get(ctx, cp.DefinitionHash)
	if err != nil {
		return fmt.Errorf("job %s: start child %s: %w", cp.JobID, d.Child, err)
	}
	s := def.Step(d.Step)
	if s == nil {
		return fmt.Errorf("job %s: start child %s: no step %q", cp.JobID, d.Child, d.Step)
	}
	var args json.RawMessage // an agent's tool call: the child's input
	if d.Item > 0 && s.Kind == schemas.KindAgent && cp.Fan != nil && cp.Fan.Agent != nil {
		call := cp.Fan.Agent.CallByItem(d.Item)
		if call == nil || s.ToolOf(call.Name) == nil {
			return fmt.Errorf("job %s: start child %s: no tool call %d", cp.JobID, d.Child, d.Item)
		}
		s, args = schemas.ToolStep(s, s.ToolOf(call.Name)), call.Input
	}
	cs, err := schemas.ChildOf(s)
	if err != nil {
		return e.failChild(ctx, cp, d, err.Error())
	}
	if ent, err := e.store.Checkpoints.Get(ctx, d.Child); err == nil {
		if c := ent.Checkpoint.Caller; c == nil || c.Job != cp.JobID || c.Step != d.Step {
			return e.failChild(ctx, cp, d, fmt.Sprintf("job id %s, which the child job would have, is taken by another job", d.Child))
		}
		if ent.Checkpoint.Status.Terminal() {
			// Started by an earlier attempt of this run, and ended.
			return e.notifyCaller(ctx, ent.Checkpoint, callerOf(cp, d))
		}
		return nil // started before; its end comes to the caller it names, or the reconciler's
	}
	if c := callerOf(cp, d); c.Depth > schemas.MaxChildDepth {
		return e.failChild(ctx, cp, d, fmt.Sprintf("it would nest %d child jobs deep; the limit is %d (does a workflow start itself through others?)", c.Depth, schemas.MaxChildDepth))
	}
	childDef, err := e.store.Definitions.Latest(ctx, cs.Workflow)
	if errors.Is(err, schemas.ErrNotFound) {
		return e.failChild(ctx, cp, d, fmt.Sprintf("workflow %q is not stored: give it to engine run or engine start with --child FILE", cs.Workflow))
	}
	if err != nil {
		return fmt.Errorf("job %s: start child %s: %w", cp.JobID, d.Child, err)
	}
	state := cp.State
	if schemas.HasRefs(state) {
		if state, err = e.store.Values.Resolve(ctx, cp.MsgPrefix(), state); err != nil {
			return fmt.Errorf("job %s: start child %s: read its input: %w", cp.JobID, d.Child, err)
		}
	}
	input := json.RawMessage(state)
	if args != nil {
		input = args
	} else if cs.Input != "" {
		v, _, err := cutPath(state, strings.Split(cs.Input, "."))
		if err != nil {
			return e.failChild(ctx, cp, d, fmt.Sprintf("with.input: state.%s: %v", cs.Input, err))
		}
		input = v
	}
	_, err = client.New(e.store).Start(ctx, childDef, input, client.StartOptions{JobID: d.Child, Caller: callerOf(cp, d)})
	switch {
	case err == nil:
		e.ctr.childrenStarted.Add(1)
		return nil
	case errors.Is(err, schemas.ErrConflict):
		return nil // started before, under the definition stored then
	case errors.Is(err, schemas.ErrInputInvalid), errors.Is(err, schemas.ErrTooLarge):
		return e.failChild(ctx, cp, d, "the child's input was refused: "+err.Error())
	}
	return fmt.Errorf("job %s: start child %s: %w", cp.JobID, d.Child, err)
}

func callerOf(cp *schemas.Checkpoint, d *schemas.Dispatch) *schemas.Caller {
	depth := 1
	if cp.Caller != nil {
		depth = cp.Caller.Depth + 1
	}
	return &schemas.Caller{Job: cp.JobID, Step: d.Step, Attempt: d.Attempt, MsgID: d.MsgID, Depth: depth, Item: d.Item}
}

// failChild answers d with a failure: its child could not be started.
func (e *Engine) failChild(ctx context.Context, cp *schemas.Checkpoint, d *schemas.Dispatch, why string) error {
	res := &schemas.StepResult{Job: cp.JobID, Step: d.Step, Attempt: d.Attempt, Item: d.Item,
		Error: &schemas.Error{Code: schemas.CodeStepFailed, Message: "child job " + d.Child + ": " + why}}
	return e.sendResult(ctx, res, d.MsgID)
}

// notifyCaller sends a child job's end to c, its parent's dispatch: its
// final state as the output of the workflow step, or its error.
func (e *Engine) notifyCaller(ctx context.Context, cp *schemas.Checkpoint, c *schemas.Caller) error {
	res := &schemas.StepResult{Job: c.Job, Step: c.Step, Attempt: c.Attempt, Item: c.Item}
	if cp.Status == schemas.JobFailed || cp.Status == schemas.JobCancelled {
		msg := "child job " + cp.JobID + " " + string(cp.Status)
		if cp.Error != nil {
			msg += ": " + cp.Error.Message
		}
		res.Error = &schemas.Error{Code: schemas.CodeStepFailed, Message: msg}
	} else {
		out := cp.State
		if schemas.HasRefs(out) {
			var err error
			if out, err = e.store.Values.Resolve(ctx, cp.MsgPrefix(), out); err != nil {
				return fmt.Errorf("child job %s: read its output: %w", cp.JobID, err)
			}
		}
		limit := int(e.store.Config.MaxMessageBytes) - schemas.StepMessageRoom
		if len(out) > limit && e.store.Values != nil {
			// Its large members go to the parent by reference: stored again
			// under the parent's name, so that the parent owns them.
			pent, err := e.store.Checkpoints.Get(ctx, c.Job)
			if err != nil {
				return fmt.Errorf("child job %s: read its parent %s: %w", cp.JobID, c.Job, err)
			}
			owner := pent.Checkpoint.MsgPrefix()
			if ext, err := schemas.ExternalizeMembers(out, e.store.Config.ValueThreshold, func(v []byte) (schemas.ValueRef, error) {
				return e.store.Values.Put(ctx, owner, v)
			}); err == nil {
				out = ext
			}
		}
		if len(out) > limit {
			res.Error = &schemas.Error{Code: schemas.CodeTooLarge, Message: fmt.Sprintf("child job %s completed with a state of %d bytes; a result carries at most %d, its members over the value threshold by reference", cp.JobID, len(out), limit)}
		} else {
			res.Output = out
		}
	}
	return e.sendResult(ctx, res, c.MsgID)
}

// sendResult publishes res to its job's inbox as the result of the
// dispatch whose message id is msgID (dedup id msgID + "/result").
func (e *Engine) sendResult(ctx context.Context, res *schemas.StepResult, msgID string) error {
	m := nats.NewMsg(e.store.Names.InboxSubject(kv.InboxResult, res.Job))
	data, err := schemas.EncodeStepResult(res, m.Header)
	if err != nil {
		return err
	}
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, msgID+"/result")
	if _, err := e.store.JS.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("send the result of %s to job %s: %w", msgID, res.Job, err)
	}
	return nil
}

// checkChild is the reconciler's look at a parent waiting on a child: a
// child that does not exist is started, one that ended has its end sent
// again (harmless when it was applied: the dedup id, then staleness).
func (e *Engine) checkChild(ctx context.Context, cp *schemas.Checkpoint, d *schemas.Dispatch, now time.Time) error {
	if now.Sub(d.DispatchedAt) < 2*PublishGrace {
		return nil // its engine may be starting it right now
	}
	ent, err := e.store.Checkpoints.Get(ctx, d.Child)
	switch {
	case errors.Is(err, schemas.ErrNotFound):
		e.log.Info("starting a child job its parent's engine did not start", "job", cp.JobID, "child", d.Child)
		return e.startChild(ctx, cp, d)
	case err != nil:
		return fmt.Errorf("reconcile job %s: read child %s: %w", cp.JobID, d.Child, err)
	case ent.Checkpoint.Status.Terminal():
		return e.notifyCaller(ctx, ent.Checkpoint, callerOf(cp, d))
	}
	return nil
}

// fireCron starts the job of a cron schedule's firing at at: id
// "<schedule>-<at, UTC, to the second>", of the definition of the
// schedule's workflow stored last, so that the same firing delivered
// again attaches to that job. A firing that cannot start a job (its
// workflow is gone, its input is refused) is logged and dropped; a
// passing fault is returned, for the firing to come again.
func (e *Engine) fireCron(ctx context.Context, name string, at time.Time, sc *kv.CronSchedule) error {
	id := name + "-" + at.UTC().Format("20060102T150405Z")
	def, err := e.store.Definitions.Latest(ctx, sc.Workflow)
	if errors.Is(err, schemas.ErrNotFound) {
		e.log.Error("cron schedule names a workflow that is not stored; firing dropped", "schedule", name, "workflow", sc.Workflow)
		return nil
	}
	if err != nil {
		return err
	}
	input := sc.Input
	if len(input) == 0 {
		input = json.RawMessage("{}")
	}
	res, err := client.New(e.store).Start(ctx, def, input, client.StartOptions{JobID: id, Vars: sc.Vars})
	switch {
	case errors.Is(err, schemas.ErrInputInvalid), errors.Is(err, schemas.ErrTooLarge), errors.Is(err, schemas.ErrConflict):
		e.log.Error("cron firing could not start its job; dropped", "schedule", name, "job", id, "err", err)
		return nil
	case err != nil:
		return err
	}
	if !res.Attached {
		e.ctr.cronStarted.Add(1)
		e.log.Info("cron schedule started a job", "schedule", name, "job", id)
	}
	return nil
}
