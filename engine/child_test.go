package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/waymark-dev/waymark/internal/testsupport"
	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

const kidWorkflow = `
name: kid
version: 1
input_schema: {type: object, required: [n], properties: {n: {type: integer}}}
steps:
  - {id: k1, kind: noop, save_as: k1, next: [{to: k2}]}
  - {id: k2, kind: noop, save_as: k2}
`

const parentWorkflow = `
name: parent
version: 1
steps:
  - id: call
    kind: workflow
    with: {workflow: kid, input: req}
    save_as: result
    on_error: rescue
    next: [{to: after}]
  - {id: after, kind: noop, save_as: after}
  - {id: rescue, kind: noop, save_as: rescued}
`

// TestChildJobRunsAndReturnsItsOutput: a workflow step starts its child
// under a derived id, with the child's definition pinned and the input
// taken from state; the child's final state is the step's output; status
// shows parent and children. A child that fails fails the step (on_error
// runs); an input the child's schema refuses fails it without a child.
func TestChildJobRunsAndReturnsItsOutput(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	kid := b.storeDef(kidWorkflow)
	parent := b.define(parentWorkflow)
	v := b.wait(b.start(parent, `{"req": {"n": 7}}`, "p-1"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	child := schemas.ChildJobID("p-1", "call", 1)
	if len(v.Children) != 1 || v.Children[0] != child {
		t.Errorf("children %v, want [%s]", v.Children, child)
	}
	var st struct {
		Result struct {
			N  int             `json:"n"`
			K2 json.RawMessage `json:"k2"`
		} `json:"result"`
		After json.RawMessage `json:"after"`
	}
	if err := json.Unmarshal(v.State, &st); err != nil || st.Result.N != 7 || st.Result.K2 == nil || st.After == nil {
		t.Fatalf("parent state %s (%v)", v.State, err)
	}
	cv, err := b.client.Job(context.Background(), child)
	if err != nil {
		t.Fatal(err)
	}
	if cv.Status != schemas.JobCompleted || cv.ParentJob != "p-1" || cv.ParentStep != "call" || cv.DefinitionHash != kid.Hash {
		t.Errorf("child: status %s parent %s/%s definition %s", cv.Status, cv.ParentJob, cv.ParentStep, cv.DefinitionHash)
	}

	// The child's input fails its schema: the step fails, no child runs.
	v = b.wait(b.start(parent, `{"req": {"n": "seven"}}`, "p-bad"))
	if s := stepOf(v, "call"); v.Status != schemas.JobCompleted || s.Status != schemas.StepFailed || !strings.Contains(s.LastError.Message, "the child's input was refused") {
		t.Errorf("bad input: status %s, step %+v", v.Status, s)
	}
	if _, ok := decodeState(t, v.State)["rescued"]; !ok {
		t.Errorf("on_error did not run: %s", v.State)
	}
}

// TestChildFailureFailsTheStep: a child that fails for good fails the
// workflow step with the child's reason.
func TestChildFailureFailsTheStep(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "k2" {
			return nil, &schemas.Error{Code: schemas.CodeStepFailed, Message: "k2 broke"}
		}
		return json.RawMessage(`{}`), nil
	})
	b.storeDef(kidWorkflow)
	parent := b.define(strings.Replace(parentWorkflow, "    on_error: rescue\n", "", 1))
	v := b.wait(b.start(parent, `{"req": {"n": 1}}`, "p-2"))
	if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, "failed: k2 broke") {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
}

// TestReconcilerStartsALostChildOnce: the engine dies (here: skips the
// start) between writing the workflow step's dispatch and starting the
// child; the reconciler starts it, once, and the parent completes. A
// child whose end never reached its parent is told again.
func TestReconcilerStartsALostChildOnce(t *testing.T) {
	t.Parallel()
	var offset atomic.Int64
	b := setup(t, setupOptions{kv: kv.Config{}, engine: Config{Now: func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }}})
	var dropped atomic.Int64
	b.engine.dropChildStart = func(string) bool { return dropped.Add(1) == 1 }
	b.worker(echo)
	b.storeDef(kidWorkflow)
	parent := b.define(parentWorkflow)
	id := b.start(parent, `{"req": {"n": 2}}`, "p-3")
	child := schemas.ChildJobID(id, "call", 1)
	testsupport.Eventually(t, 10*time.Second, func() bool { return dropped.Load() == 1 }, "the child start was never reached")
	if _, err := b.client.Job(context.Background(), child); err == nil {
		t.Fatal("the child exists although its start was dropped")
	}
	offset.Store(int64(time.Minute))
	if err := b.engine.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	v := b.wait(id)
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s, error %+v", v.Status, v.Error)
	}
	if n := b.engine.Stats().ChildrenStarted; n != 1 {
		t.Errorf("children started: %d, want 1", n)
	}
	// Told again: the parent is done, so the repeat changes nothing.
	if err := b.engine.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := b.engine.Stats().ChildrenStarted; n != 1 {
		t.Errorf("children started after another pass: %d, want 1", n)
	}
}

// storeDef defines yaml and stores it, as engine run --child does.
func (b *bundle) storeDef(yaml string) *schemas.Definition {
	b.t.Helper()
	def := b.define(yaml)
	if err := b.store.Definitions.Put(context.Background(), def); err != nil {
		b.t.Fatal(err)
	}
	return def
}

// TestChildJobAsAParallelBranch: a branch of a parallel step may be a
// workflow step: the child runs beside the other branch and its final
// state is the branch's output.
func TestChildJobAsAParallelBranch(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	b.storeDef(kidWorkflow)
	def := b.define(`
name: both
version: 1
steps:
  - {id: fan, kind: parallel, branches: [kid, local]}
  - {id: kid, kind: workflow, with: {workflow: kid, input: req}, save_as: kid}
  - {id: local, kind: noop, save_as: local}
`)
	v := b.wait(b.start(def, `{"req": {"n": 3}}`, "both-1"))
	st := decodeState(t, v.State)
	kid, _ := st["kid"].(map[string]any)
	if v.Status != schemas.JobCompleted || kid["n"] != float64(3) || st["local"] == nil {
		t.Fatalf("status %s state %s", v.Status, v.State)
	}
}

// TestReconcilerStartsALostBranchChild: the child job of a parallel branch
// whose start was lost is started by the reconciler, and the join
// completes.
func TestReconcilerStartsALostBranchChild(t *testing.T) {
	t.Parallel()
	var offset atomic.Int64
	b := setup(t, setupOptions{engine: Config{Now: func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }}})
	var dropped atomic.Int64
	b.engine.dropChildStart = func(string) bool { return dropped.Add(1) == 1 }
	b.worker(echo)
	b.storeDef(kidWorkflow)
	def := b.define(`
name: both
version: 1
steps:
  - {id: fan, kind: parallel, branches: [kid, local]}
  - {id: kid, kind: workflow, with: {workflow: kid, input: req}, save_as: kid}
  - {id: local, kind: noop, save_as: local}
`)
	id := b.start(def, `{"req": {"n": 4}}`, "both-lost")
	testsupport.Eventually(t, 10*time.Second, func() bool { return dropped.Load() == 1 }, "the child start was never reached")
	offset.Store(int64(time.Minute))
	if err := b.engine.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if v := b.wait(id); v.Status != schemas.JobCompleted || b.engine.Stats().ChildrenStarted != 1 {
		t.Fatalf("status %s, children started %d", v.Status, b.engine.Stats().ChildrenStarted)
	}
}

// TestChildJobsNestAtMostEightDeep: two workflows that start each other
// stop at the depth limit: the deepest step fails, and each parent fails
// with its child.
func TestChildJobsNestAtMostEightDeep(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(echo)
	ping := b.storeDef("name: ping\nversion: 1\nsteps:\n  - {id: call, kind: workflow, with: {workflow: pong}, save_as: r}\n")
	b.storeDef("name: pong\nversion: 1\nsteps:\n  - {id: call, kind: workflow, with: {workflow: ping}, save_as: r}\n")
	v := b.wait(b.start(ping, `{}`, "cycle"))
	if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, "it would nest 9 child jobs deep; the limit is 8") {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
	if n := b.engine.Stats().ChildrenStarted; n != schemas.MaxChildDepth {
		t.Errorf("children started: %d, want %d", n, schemas.MaxChildDepth)
	}
}

// TestParentShowsAChildWaitingForAPerson: a child that stops in
// needs_reconciliation is shown on its parent's record, with the effect.
func TestParentShowsAChildWaitingForAPerson(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		return nil, &schemas.Error{Code: schemas.CodeAmbiguous, Message: "the provider did not say"}
	})
	b.storeDef("name: mailer\nversion: 1\nsteps:\n  - {id: send, kind: noop, effect: unsafe, save_as: sent}\n")
	parent := b.define("name: boss\nversion: 1\nsteps:\n  - {id: call, kind: workflow, with: {workflow: mailer}, save_as: r}\n")
	id := b.start(parent, `{}`, "boss-1")
	testsupport.Eventually(t, 10*time.Second, func() bool {
		v, err := b.client.Job(context.Background(), id)
		return err == nil && v.WaitingChild != nil
	}, "the parent never showed its waiting child")
	v, _ := b.client.Job(context.Background(), id)
	if w := v.WaitingChild; v.Status != schemas.JobRunning || w.Status != schemas.JobNeedsReconciliation || w.Blocked == nil || w.Blocked.Step != "send" {
		t.Fatalf("parent %s, waiting child %+v", v.Status, w)
	}
}

// TestChildWithALargeStateReturnsItByReference: a child whose final state
// is over the message limit hands its large members to its parent by
// reference; a worker's output naming a value the job does not have is
// refused.
func TestChildWithALargeStateReturnsItByReference(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	b.worker(func(sm *schemas.StepMessage) (json.RawMessage, *schemas.Error) {
		if sm.Step == "forge" {
			return json.RawMessage(schemas.NewValueRef([]byte(`"elsewhere"`)).JSON()), nil
		}
		return json.RawMessage(`{}`), nil
	})
	b.storeDef("name: holder\nversion: 1\nsteps:\n  - {id: k, kind: noop, save_as: k}\n")
	parent := b.define("name: big\nversion: 1\nsteps:\n  - {id: call, kind: workflow, with: {workflow: holder, input: payload}, save_as: r}\n")
	ys := make([]string, 0, 3)
	for i := range 3 {
		ys = append(ys, fmt.Sprintf(`"y%d": %q`, i, strings.Repeat(strconv.Itoa(i), 500<<10)))
	}
	v := b.wait(b.start(parent, `{"payload": {`+strings.Join(ys, ",")+`}}`, "big-1"))
	if v.Status != schemas.JobCompleted {
		t.Fatalf("status %s error %+v", v.Status, v.Error)
	}
	r, _ := decodeState(t, v.State)["r"].(map[string]any)
	if s, _ := r["y2"].(string); len(s) != 500<<10 {
		t.Fatalf("the child's large member came back as %.60v", r["y2"])
	}
	forge := b.define("name: forge\nversion: 1\nsteps:\n  - {id: forge, kind: noop, save_as: f}\n")
	v = b.wait(b.start(forge, `{}`, "forge-1"))
	if v.Status != schemas.JobFailed || v.Error == nil || !strings.Contains(v.Error.Message, "a value job forge-1 does not have") {
		t.Fatalf("forged reference: status %s error %+v", v.Status, v.Error)
	}
}
