package client

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/waymark-dev/waymark/kv"
	"github.com/waymark-dev/waymark/schemas"
)

// Errors of the control and approval calls that callers tell apart (the
// HTTP API maps them to 409, 403 and 202).
var (
	// ErrControlPending: the request was sent and no engine recorded it
	// before the context ended; it waits in the job's inbox.
	ErrControlPending = errors.New("the request waits in the job's inbox")
	// ErrNotApplicable: the job is not in a state the request applies to
	// (pause of an ended job, retry of a job that did not fail, resume of
	// a job not paused).
	ErrNotApplicable = errors.New("not applicable to the job as it stands")
	// ErrAlreadyDecided: the gate was decided before (approved, rejected
	// or expired); nothing changed.
	ErrAlreadyDecided = errors.New("already decided")
	// ErrNoSuchGate: the job has no gate of that name open (nor decided).
	ErrNoSuchGate = errors.New("no such gate")
	// ErrDigestMismatch: the digest given is not the open gate's: the
	// action changed since it was seen, and needs a new look.
	ErrDigestMismatch = errors.New("the action changed: digest mismatch")
	// ErrNotApprover: the gate names its approvers and by is not one.
	ErrNotApprover = errors.New("not an approver of this gate")
	// ErrApprovalExpired: the gate expired (by the engine's clock) before
	// the decision was applied; the job followed the expiry path.
	ErrApprovalExpired = errors.New("the approval expired")
)

// ControlRequest says who acts on a job and why: By is required; both are
// at most 1,000 bytes of text on one line.
type ControlRequest struct {
	By     string `json:"by"`
	Reason string `json:"reason,omitempty"`
	// From is where a retry goes on: a step id of the job's definition;
	// empty: the step that failed.
	From string `json:"from,omitempty"`
	// Digest is the action an approve or reject decides, as the caller
	// saw it (engine status lists it); empty: the open gate's.
	Digest string `json:"digest,omitempty"`
}

// checkWho checks r's by and reason for op on job id.
func checkWho(op, id string, r ControlRequest) error {
	if err := ValidateJobID(id); err != nil {
		return err
	}
	switch {
	case strings.TrimSpace(r.By) == "":
		verb := map[string]string{"retry": "retries", "approve": "approves", "reject": "rejects"}[op]
		if verb == "" {
			verb = op + "s"
		}
		return schemas.Errorf(schemas.CodeInputInvalid, "%s job %s: say who %s it (by)", op, id, verb)
	case len(r.By) > 1000 || len(r.Reason) > 1000:
		return schemas.Errorf(schemas.CodeInputInvalid, "%s job %s: by and reason are at most 1,000 bytes of UTF-8", op, id)
	}
	if err := schemas.CheckStringsText("", map[string]string{"by": r.By, "reason": r.Reason}); err != nil {
		return err
	}
	for name, v := range map[string]string{"by": r.By, "reason": r.Reason} {
		if i := strings.IndexFunc(v, unicode.IsControl); i >= 0 {
			return schemas.Errorf(schemas.CodeInputInvalid, "%s job %s: %s holds a control character at byte %d: write it as plain text on one line", op, id, name, i)
		}
	}
	return nil
}

// send publishes sig under msgID and waits (until ctx ends) for a
// checkpoint of job id for which done holds; it returns that checkpoint's
// view. ErrControlPending when no engine recorded it in time.
func (c *Client) send(ctx context.Context, op string, sig schemas.Signal, msgID string, done func(*schemas.Checkpoint) bool) (*JobView, error) {
	if err := c.store.SendSignal(ctx, sig, msgID); err != nil {
		return nil, fmt.Errorf("%s job %s: %w", op, sig.Job, err)
	}
	final, err := c.await(ctx, op, sig.Job, done, ErrControlPending)
	if err != nil {
		return nil, err
	}
	def, _ := c.store.Definitions.Get(ctx, final.DefinitionHash)
	return c.view(ctx, final, def), nil
}

// await waits (until ctx ends) for a checkpoint of job for which done
// holds and returns it; pending (wrapped with ctx's error) when none came.
func (c *Client) await(ctx context.Context, op, job string, done func(*schemas.Checkpoint) bool, pending error) (*schemas.Checkpoint, error) {
	var final *schemas.Checkpoint
	err := c.store.Checkpoints.Watch(ctx, job, func(e kv.Entry, err error) bool {
		if err == nil && done(e.Checkpoint) {
			final = e.Checkpoint
			return false
		}
		return true
	})
	if final == nil {
		if err == nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("%s job %s: wait for the engine: %w: %w", op, job, pending, err)
	}
	return final, nil
}

// newRequestID is a random id for a request (16 hex digits).
func newRequestID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// control sends sig, a control request for job cp, under an id of its own
// and waits until the engine applied it (the checkpoint's LastControl
// names it), or until other holds: another request came first, and the
// job is no longer one sig applies to (ErrNotApplicable, naming that
// request).
func (c *Client) control(ctx context.Context, op string, cp *schemas.Checkpoint, sig schemas.Signal, other func(*schemas.Checkpoint) bool) (*JobView, error) {
	sig.ID = newRequestID()
	mine := false
	var first *schemas.ControlRecord
	v, err := c.send(ctx, op, sig, cp.MsgPrefix()+"/control/"+sig.ID, func(n *schemas.Checkpoint) bool {
		if n.LastControl != nil && n.LastControl.ID == sig.ID {
			mine = true
			return true
		}
		if other(n) {
			first = n.LastControl
			return true
		}
		return false
	})
	switch {
	case err != nil || mine:
		return v, err
	case first != nil && first.ID != "":
		return v, fmt.Errorf("%s job %s: a %s by %s came first (at %s); nothing more changed: %w", op, sig.Job, first.Type, first.By, first.At.UTC().Format(time.RFC3339), ErrNotApplicable)
	}
	return v, fmt.Errorf("%s job %s: it is %s now; nothing more changed: %w", op, sig.Job, v.Status, ErrNotApplicable)
}

// load reads job id's checkpoint for op.
func (c *Client) load(ctx context.Context, op, id string) (*schemas.Checkpoint, error) {
	ent, err := c.store.Checkpoints.Get(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("%s job %s: %w", op, id, err)
	}
	return ent.Checkpoint, nil
}

// Pause holds job id: the steps running finish and their results apply,
// nothing new is dispatched (it is recorded, held) until Resume. It waits
// for the engine to record it and returns the job's record. Errors:
// schemas.ErrNotFound; ErrNotApplicable for an ended job or one paused
// already; ErrControlPending; CodeInputInvalid for a bad by or reason.
func (c *Client) Pause(ctx context.Context, id string, r ControlRequest) (*JobView, error) {
	if err := checkWho("pause", id, r); err != nil {
		return nil, err
	}
	cp, err := c.load(ctx, "pause", id)
	if err != nil {
		return nil, err
	}
	switch {
	case cp.Status.Terminal():
		return nil, fmt.Errorf("pause job %s: it %s: %w", id, cp.Status, ErrNotApplicable)
	case cp.Paused != nil:
		return nil, fmt.Errorf("pause job %s: paused already by %s at %s: %w", id, cp.Paused.By, cp.Paused.At.UTC().Format(time.RFC3339), ErrNotApplicable)
	}
	sig := schemas.Signal{Job: id, Type: schemas.SignalPause, By: r.By, Reason: r.Reason}
	return c.control(ctx, "pause", cp, sig, func(n *schemas.Checkpoint) bool { return n.Paused != nil || n.Status.Terminal() })
}

// Resume lifts a pause: the dispatches held go out. Errors as Pause's;
// ErrNotApplicable for a job that is not paused.
func (c *Client) Resume(ctx context.Context, id string, r ControlRequest) (*JobView, error) {
	if err := checkWho("resume", id, r); err != nil {
		return nil, err
	}
	cp, err := c.load(ctx, "resume", id)
	if err != nil {
		return nil, err
	}
	if cp.Paused == nil || cp.Status.Terminal() {
		return nil, fmt.Errorf("resume job %s: it is %s, not paused: %w", id, cp.Status, ErrNotApplicable)
	}
	sig := schemas.Signal{Job: id, Type: schemas.SignalResume, By: r.By, Reason: r.Reason}
	return c.control(ctx, "resume", cp, sig, func(n *schemas.Checkpoint) bool { return n.Paused == nil || n.Status.Terminal() })
}

// Retry reopens failed job id at r.From, or at the step that failed, under
// new attempts: each step it reaches again runs under its last run's
// idempotency key, so effects already confirmed are answered from the
// ledger, not performed again. The job's index entry is made active again
// before the signal. It waits until the engine recorded the retry and
// returns the record. Errors: schemas.ErrNotFound; ErrNotApplicable for a
// job that did not fail; CodeInputInvalid for a From the job's definition
// does not have; ErrControlPending.
func (c *Client) Retry(ctx context.Context, id string, r ControlRequest) (*JobView, error) {
	if err := checkWho("retry", id, r); err != nil {
		return nil, err
	}
	cp, err := c.load(ctx, "retry", id)
	if err != nil {
		return nil, err
	}
	if cp.Status != schemas.JobFailed {
		return nil, fmt.Errorf("retry job %s: it is %s; only a failed job is retried: %w", id, cp.Status, ErrNotApplicable)
	}
	def, err := c.store.Definitions.Get(ctx, cp.DefinitionHash)
	if err != nil {
		return nil, fmt.Errorf("retry job %s: its definition %s: %w", id, short(cp.DefinitionHash), err)
	}
	from := r.From
	if from == "" && cp.Error != nil {
		from = cp.Error.Step
	}
	if from == "" {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "retry job %s: it failed outside a step (%s); say where it goes on with from", id, cp.Error.Message)
	}
	if def.Step(from) == nil {
		var ids []string
		for _, s := range def.Steps {
			ids = append(ids, s.ID)
		}
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "retry job %s: from %q is not a step of workflow %s (steps: %s)", id, from, def.Name, strings.Join(ids, ", "))
	}
	rev, err := c.reactivate(ctx, cp)
	if err != nil {
		return nil, fmt.Errorf("retry job %s: %w", id, err)
	}
	sig := schemas.Signal{Job: id, Type: schemas.SignalRetry, By: r.By, Reason: r.Reason, From: from, IndexRev: rev, Seq: cp.Seq}
	return c.control(ctx, "retry", cp, sig, func(n *schemas.Checkpoint) bool {
		return n.Retries > cp.Retries || n.Seq > cp.Seq && n.Status != schemas.JobFailed
	})
}

// isDigest reports whether s is 64 lower-case hex digits (an approval's
// digest).
func isDigest(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// reactivate makes ended job cp's active index entry again (the engine
// removes its ended entry once it reopened the job) and returns its
// revision, which the reopened job's message ids take.
func (c *Client) reactivate(ctx context.Context, cp *schemas.Checkpoint) (uint64, error) {
	for try := 0; ; try++ {
		rev, err := c.store.Jobs.CreateActive(ctx, cp)
		if errors.Is(err, schemas.ErrConflict) {
			ie, gerr := c.store.Jobs.Get(ctx, kv.ActiveKey(cp.Workflow, cp.JobID))
			if errors.Is(gerr, schemas.ErrNotFound) && try < 3 {
				continue // removed meanwhile, by the end of the run another reopen began
			}
			if gerr != nil {
				return 0, fmt.Errorf("index entry: %w", gerr)
			}
			return ie.Revision, nil
		}
		if err != nil {
			return 0, fmt.Errorf("index entry: %w", err)
		}
		return rev, nil
	}
}

// Approve approves job id's open gate (its step id) for r.By: the gate's
// step goes on (an approval step completes with an ApprovalOutput; a step
// with requires_approval starts its run). Errors, nothing changed by any:
// schemas.ErrNotFound; ErrNoSuchGate; ErrAlreadyDecided for a gate
// decided before; ErrDigestMismatch when r.Digest is not the gate's;
// ErrNotApprover; ErrApprovalExpired (with the record: the job followed
// the expiry path); ErrControlPending.
func (c *Client) Approve(ctx context.Context, id, gate string, r ControlRequest) (*JobView, error) {
	return c.decide(ctx, "approve", schemas.SignalApprove, id, gate, r)
}

// Reject rejects job id's open gate: the gate's step fails with code
// approval_rejected (its on_error follows, or the job fails). Errors as
// Approve's.
func (c *Client) Reject(ctx context.Context, id, gate string, r ControlRequest) (*JobView, error) {
	return c.decide(ctx, "reject", schemas.SignalReject, id, gate, r)
}

func (c *Client) decide(ctx context.Context, op, typ, id, gate string, r ControlRequest) (*JobView, error) {
	if err := checkWho(op, id, r); err != nil {
		return nil, err
	}
	cp, err := c.load(ctx, op, id)
	if err != nil {
		return nil, err
	}
	var a *schemas.Approval
	var open []string
	for _, g := range cp.Approvals {
		if g.ID == gate {
			a = g
			open = nil
			break
		}
		if g.Gate == gate {
			a = g // the latest run's
			if g.Status == schemas.ApprovalPending {
				open = append(open, g.ID)
			}
		}
	}
	if len(open) > 1 {
		return nil, fmt.Errorf("%s job %s: gate %s has %d open approvals (one per tool call); name one by its id: %s: %w", op, id, gate, len(open), strings.Join(open, ", "), ErrNoSuchGate)
	}
	if len(open) == 1 {
		a = cp.ApprovalByID(open[0])
	}
	if a == nil {
		open := []string{}
		for _, g := range cp.Approvals {
			if g.Status == schemas.ApprovalPending {
				open = append(open, g.Gate)
			}
		}
		if len(open) == 0 {
			return nil, fmt.Errorf("%s job %s: it has no gate %q and none is open (it is %s): %w", op, id, gate, cp.Status, ErrNoSuchGate)
		}
		return nil, fmt.Errorf("%s job %s: it has no gate %q; open: %s: %w", op, id, gate, strings.Join(open, ", "), ErrNoSuchGate)
	}
	if a.Status == schemas.ApprovalPending && cp.Status.Terminal() {
		return nil, fmt.Errorf("%s job %s: it %s; gate %s can no longer be decided: %w", op, id, cp.Status, a.ID, ErrNotApplicable)
	}
	if a.Status != schemas.ApprovalPending {
		who := ""
		if a.DecidedBy != "" {
			who = " by " + a.DecidedBy
		}
		when := ""
		if a.DecidedAt != nil {
			when = " at " + a.DecidedAt.UTC().Format(time.RFC3339)
		}
		return nil, fmt.Errorf("%s job %s: gate %s was %s%s%s; nothing changed: %w", op, id, a.ID, a.Status, who, when, ErrAlreadyDecided)
	}
	if r.Digest != "" && !isDigest(r.Digest) {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "%s job %s: digest %q is not a digest: want the 64 lower-case hex digits engine status lists", op, id, r.Digest)
	}
	if r.Digest != "" && r.Digest != a.Digest {
		return nil, fmt.Errorf("%s job %s: gate %s now asks to approve digest %s, not %s (the action changed): look again with engine status: %w", op, id, a.ID, a.Digest, r.Digest, ErrDigestMismatch)
	}
	if len(a.Approvers) > 0 && !slices.Contains(a.Approvers, r.By) {
		return nil, fmt.Errorf("%s job %s: gate %s may be decided by %s, not %s: %w", op, id, a.ID, strings.Join(a.Approvers, ", "), r.By, ErrNotApprover)
	}
	sig := schemas.Signal{Job: id, Type: typ, Gate: a.Gate, Key: a.ID, Digest: a.Digest, By: r.By, Reason: r.Reason}
	gateID := a.ID
	v, err := c.send(ctx, op, sig, cp.MsgPrefix()+"/decide/"+gateID, func(n *schemas.Checkpoint) bool {
		g := n.ApprovalByID(gateID)
		return g == nil || g.Status != schemas.ApprovalPending || n.Status.Terminal()
	})
	if err != nil {
		return nil, err
	}
	for _, g := range v.Approvals {
		if g.ID != gateID {
			continue
		}
		switch {
		case g.Status == schemas.ApprovalExpired:
			return v, fmt.Errorf("%s job %s: gate %s %s: %w", op, id, gateID, g.Reason, ErrApprovalExpired)
		case g.Status == schemas.ApprovalPending:
			return v, fmt.Errorf("%s job %s: it %s before the decision was applied: %w", op, id, v.Status, ErrNotApplicable)
		case g.DecidedBy != r.By || (typ == schemas.SignalApprove) != (g.Status == schemas.ApprovalApproved):
			return v, fmt.Errorf("%s job %s: gate %s was %s%s first: %w", op, id, gateID, g.Status, map[bool]string{true: " by " + g.DecidedBy, false: ""}[g.DecidedBy != ""], ErrAlreadyDecided)
		}
	}
	return v, nil
}

// ErrNoSuchSignal: the job's workflow has no wait step for the signal's
// name.
var ErrNoSuchSignal = errors.New("no wait step for this signal")

// SignalRequest is a named signal for a job's wait steps. Name is 1 to 64
// letters, digits, '_' and '-'; Data any JSON value (at most 64 KiB; null
// when absent); ID names this signal, so that sending it again is one
// signal (default: a new id); By as for ControlRequest.
type SignalRequest struct {
	Name string          `json:"name"`
	Data json.RawMessage `json:"data,omitempty"`
	By   string          `json:"by"`
	ID   string          `json:"id,omitempty"`
}

// MaxSignalBytes caps a signal's data.
const MaxSignalBytes = 64 << 10

// Signal sends r to job id and waits until the engine recorded it: taken
// by the wait step the job is at, or kept for a later one (a signal that
// comes first is not lost). It returns the job's record and the signal
// as recorded. Errors: schemas.ErrNotFound; ErrNotApplicable for an ended
// job; ErrNoSuchSignal; CodeInputInvalid for a bad name, data that is not
// JSON or breaks the schema of the wait steps for the name (the message
// says where), a signal the engine refused (its reason); ErrControlPending.
func (c *Client) Signal(ctx context.Context, id string, r SignalRequest) (*JobView, *schemas.ReceivedSignal, error) {
	r, doc, err := prepareSignal(id, r)
	if err != nil {
		return nil, nil, err
	}
	cp, err := c.load(ctx, "signal", id)
	if err != nil {
		return nil, nil, err
	}
	if prev := receivedBefore(cp, r.ID); prev != nil {
		// The same id again (a retried webhook): one signal; nothing changes,
		// even after a rewind or retry sent the job back before it.
		def, _ := c.store.Definitions.Get(ctx, cp.DefinitionHash)
		seen := *prev
		seen.Outcome = "received before"
		return c.view(ctx, cp, def), &seen, nil
	}
	if cp.Status.Terminal() {
		return nil, nil, fmt.Errorf("signal job %s: it %s: %w", id, cp.Status, ErrNotApplicable)
	}
	def, err := c.store.Definitions.Get(ctx, cp.DefinitionHash)
	if err != nil {
		return nil, nil, fmt.Errorf("signal job %s: its definition %s: %w", id, short(cp.DefinitionHash), err)
	}
	if err := checkSignalFor(def, id, r, doc); err != nil {
		return nil, nil, err
	}
	sig := schemas.Signal{Job: id, Type: schemas.SignalUser, Name: r.Name, ID: r.ID, Data: r.Data, By: r.By}
	sigID := r.ID
	var got *schemas.ReceivedSignal
	v, err := c.send(ctx, "signal", sig, cp.MsgPrefix()+"/signal/"+sigID, func(n *schemas.Checkpoint) bool {
		if l := n.LastSignal; l != nil && l.ID == sigID {
			got = l
			for _, rs := range n.Signals {
				if rs.ID == sigID {
					kept := *rs
					kept.Outcome = l.Outcome
					got = &kept
				}
			}
			return true
		}
		if receivedBefore(n, sigID) != nil {
			got = receivedBefore(n, sigID) // a later signal was recorded last
			return true
		}
		return n.Status.Terminal()
	})
	if err != nil {
		return nil, nil, err
	}
	switch {
	case got == nil:
		return v, nil, fmt.Errorf("signal job %s: it %s before the signal was recorded: %w", id, v.Status, ErrNotApplicable)
	case got.Refused != "":
		return v, got, schemas.Errorf(schemas.CodeInputInvalid, "signal job %s: refused by %s", id, got.Refused)
	case got.Outcome == "dropped":
		return v, got, fmt.Errorf("signal job %s: dropped: %d signals wait for a wait step to take them already: %w", id, schemas.MaxKeptSignals, ErrNotApplicable)
	}
	return v, got, nil
}

// receivedBefore returns cp's record of the signal with id, or nil.
func receivedBefore(cp *schemas.Checkpoint, id string) *schemas.ReceivedSignal {
	for _, rs := range cp.Signals {
		if rs.ID == id {
			return rs
		}
	}
	if l := cp.LastSignal; l != nil && l.ID == id {
		return l
	}
	return nil
}

// prepareSignal checks r for job id (by, name, id, data) and completes
// it: a new id when none, data null when absent; it returns the decoded
// data.
func prepareSignal(id string, r SignalRequest) (SignalRequest, any, error) {
	if err := checkWho("signal", id, ControlRequest{By: r.By}); err != nil {
		return r, nil, err
	}
	if err := schemas.CheckSignalName(r.Name); err != nil {
		return r, nil, schemas.Errorf(schemas.CodeInputInvalid, "signal job %s: %v", id, err)
	}
	if r.ID == "" {
		r.ID = newRequestID()
	} else if err := schemas.CheckSignalName(r.ID); err != nil {
		return r, nil, schemas.Errorf(schemas.CodeInputInvalid, "signal job %s: id %q: want 1 to 64 letters, digits, '_' and '-'", id, r.ID)
	}
	data := bytes.TrimSpace(r.Data)
	if len(data) == 0 {
		data = []byte("null")
	}
	if len(data) > MaxSignalBytes {
		return r, nil, schemas.Errorf(schemas.CodeInputInvalid, "signal job %s: data is %d bytes; the limit is %d", id, len(data), MaxSignalBytes)
	}
	if err := schemas.CheckJSONText(data); err != nil {
		return r, nil, schemas.Errorf(schemas.CodeInputInvalid, "signal job %s: data: %v", id, err)
	}
	var doc any
	if err := json.Unmarshal(data, &doc); err != nil {
		return r, nil, schemas.Errorf(schemas.CodeInputInvalid, "signal job %s: data is not JSON: %v", id, err)
	}
	r.Data = data
	return r, doc, nil
}

// checkSignalFor checks signal r (data decoded as doc) against def: a
// wait step must wait for its name, and its data satisfy their schemas.
func checkSignalFor(def *schemas.Definition, id string, r SignalRequest, doc any) error {
	var names []string
	found := false
	for i := range def.Steps {
		s := &def.Steps[i]
		if s.Kind != schemas.KindWait {
			continue
		}
		w, err := schemas.WaitOf(s)
		if err != nil {
			continue
		}
		names = append(names, w.Signal)
		if w.Signal != r.Name {
			continue
		}
		found = true
		v, err := schemas.CompileSchema(fmt.Sprintf("steps[%d].with.schema", i), w.Schema)
		if err != nil || v == nil {
			continue
		}
		if err := v.Validate(doc); err != nil {
			return schemas.Errorf(schemas.CodeInputInvalid, "signal job %s: %s's data does not satisfy the schema of wait step %s: %s", id, r.Name, s.ID, schemas.AsError(err).Message)
		}
	}
	if !found {
		waits := "none"
		if len(names) > 0 {
			waits = strings.Join(names, ", ")
		}
		return fmt.Errorf("signal job %s: workflow %s has no wait step for signal %q (it waits for: %s): %w", id, def.Name, r.Name, waits, ErrNoSuchSignal)
	}
	return nil
}

// SignalWithStart starts job opts.JobID of def with input when it does
// not exist (attaches when it does, as Start), then sends it r. Errors:
// Start's and Signal's.
func (c *Client) SignalWithStart(ctx context.Context, def *schemas.Definition, input json.RawMessage, opts StartOptions, r SignalRequest) (StartResult, *JobView, *schemas.ReceivedSignal, error) {
	if opts.JobID == "" {
		return StartResult{}, nil, nil, schemas.Errorf(schemas.CodeInputInvalid, "signal with start: give the job id, so that a second call finds the same job")
	}
	r, doc, err := prepareSignal(opts.JobID, r)
	if err != nil {
		return StartResult{}, nil, nil, err
	}
	if err := checkSignalFor(def, opts.JobID, r, doc); err != nil {
		return StartResult{}, nil, nil, err // before the job exists: a bad signal starts nothing
	}
	res, err := c.Start(ctx, def, input, opts)
	if err != nil {
		return res, nil, nil, err
	}
	v, rs, err := c.Signal(ctx, res.JobID, r)
	return res, v, rs, err
}
