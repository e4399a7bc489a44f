package client

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/waymark-dev/waymark/schemas"
)

// Snapshot is a job as it stood at one checkpoint sequence, rebuilt from
// its history: the input of job.started, then each transition's state
// delta (schemas.StateDelta), and the steps as the events left them.
// Nothing is stored per transition for it but the deltas.
type Snapshot struct {
	Job    string            `json:"job"`
	Seq    uint64            `json:"seq"`
	At     time.Time         `json:"at"` // when that transition was written
	Status schemas.JobStatus `json:"status"`
	State  json.RawMessage   `json:"state"`
	// Steps are the steps reached by then, with where each stood.
	Steps map[string]schemas.StepStatus `json:"steps"`
	// Runs counts each step's runs that had ended (completed or failed for
	// good) by then.
	Runs map[string]int `json:"runs"`
	// Next is the step the job was at (dispatched, retrying, waiting for
	// a person or a signal): where a rewind or a fork goes on; empty when
	// it was at none (it had ended), or at several (a parallel, map or
	// agent step), which Why says.
	Next string `json:"next,omitempty"`
	Why  string `json:"why,omitempty"`
	// LastSeq is the job's latest sequence.
	LastSeq uint64 `json:"last_seq"`
	// EffectsAfter are the effects confirmed (or reconciled as happened)
	// after Seq: what running the job on from Seq again would meet in the
	// ledger.
	EffectsAfter []EffectAfter `json:"effects_after,omitempty"`
}

// EffectAfter is an effect the ledger settled after a snapshot's sequence.
type EffectAfter struct {
	Key        string `json:"key"`
	Step       string `json:"step"`
	State      string `json:"state"`
	ExternalID string `json:"external_id,omitempty"`
}

// StateAt rebuilds job id at sequence seq from its history. Errors:
// schemas.ErrNotFound; CodeInputInvalid for a seq the job never reached
// (the message names its last).
func (c *Client) StateAt(ctx context.Context, id string, seq uint64) (*Snapshot, error) {
	ent, err := c.store.Checkpoints.Get(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("job %s at seq %d: %w", id, seq, err)
	}
	last := ent.Checkpoint.Seq
	if seq < 1 || seq > last {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "job %s has sequences 1 to %d, not %d", id, last, seq)
	}
	evs, err := c.History(ctx, id)
	if err != nil {
		return nil, err
	}
	sort.SliceStable(evs, func(i, j int) bool {
		si, sj := evs[i].Data.Seq, evs[j].Data.Seq
		if si == 0 || sj == 0 {
			return false // ledger events keep their place by time
		}
		return si < sj
	})
	s := &Snapshot{Job: id, Seq: seq, LastSeq: last, Status: schemas.JobPending, State: json.RawMessage("{}"),
		Steps: map[string]schemas.StepStatus{}, Runs: map[string]int{}}
	type flight struct {
		step    string
		sub     bool // a map item, a branch's parent, an agent turn or call
		waiting bool
	}
	inFlight := map[string]flight{}
	var ledger []schemas.HistoryEvent
	s.At = ent.Checkpoint.CreatedAt // seq 1: the job as its client created it, with its input
	for _, h := range evs {
		if h.Type == schemas.EventJobStarted && len(h.Data.Input) > 0 {
			s.State = h.Data.Input
			break
		}
	}
	for _, h := range evs {
		d := h.Data
		if d.Seq == 0 {
			if h.Type == schemas.EventEffectConfirmed || (h.Type == schemas.EventEffectReconciled && d.EffectState == string(schemas.EffectReconciled)) {
				ledger = append(ledger, h)
			}
			continue
		}
		if d.Seq > seq {
			continue
		}
		s.At = h.Time
		if h.Type == schemas.EventJobStarted && len(d.Input) > 0 {
			s.State = d.Input
		}
		if len(d.State) > 0 {
			next, err := schemas.ApplyDelta(s.State, d.State)
			if err != nil {
				return nil, fmt.Errorf("job %s at seq %d: %w", id, d.Seq, err)
			}
			s.State = next
		}
		key := fmt.Sprintf("%s#%d#%d", d.Step, d.Item, d.Turn)
		sub := d.Item > 0 || d.Turn > 0 || d.Tool != ""
		switch h.Type {
		case schemas.EventJobStarted:
			s.Status = schemas.JobRunning
		case schemas.EventStepDispatched:
			s.Steps[d.Step] = schemas.StepStatus(d.Status)
			inFlight[key] = flight{step: d.Step, sub: sub}
		case schemas.EventApprovalRequested:
			if d.Tool == "" {
				s.Steps[d.Step] = schemas.StepWaiting
				inFlight[key] = flight{step: d.Step, waiting: true}
				s.Status = schemas.JobWaitingApproval
			}
		case schemas.EventApprovalDecided:
			if s.Status == schemas.JobWaitingApproval {
				s.Status = schemas.JobRunning
			}
		case schemas.EventStepCompleted:
			delete(inFlight, key)
			if !sub {
				s.Steps[d.Step] = schemas.StepCompleted
				s.Runs[d.Step]++
			}
		case schemas.EventStepFailed:
			if !d.Retrying {
				delete(inFlight, key)
				if !sub {
					s.Steps[d.Step] = schemas.StepFailed
					s.Runs[d.Step]++
				}
			}
		case schemas.EventStepCancelled:
			delete(inFlight, key)
			s.Steps[d.Step] = schemas.StepCancelled
		case schemas.EventJobCompleted, schemas.EventJobFailed, schemas.EventJobCancelled:
			s.Status = schemas.JobStatus(d.Status)
			if d.Status == "" {
				s.Status = map[string]schemas.JobStatus{schemas.EventJobCompleted: schemas.JobCompleted, schemas.EventJobFailed: schemas.JobFailed,
					schemas.EventJobCancelled: schemas.JobCancelled}[h.Type]
			}
			clear(inFlight)
		case schemas.EventJobRetried:
			for k, n := range s.Runs {
				s.Runs[k] = max(0, n-1)
				if s.Runs[k] == 0 {
					s.Steps[k] = schemas.StepPending
				}
			}
			s.Status = schemas.JobRunning
		case schemas.EventJobRewound:
			s.Runs = map[string]int{}
			for k, n := range d.Runs {
				s.Runs[k] = n
			}
			for k := range s.Steps {
				s.Steps[k] = schemas.StepPending
				if s.Runs[k] > 0 {
					s.Steps[k] = schemas.StepCompleted
				}
			}
			s.Status = schemas.JobRunning
			clear(inFlight)
		}
		if d.Next != "" && d.NextAttempt > 0 && h.Type != schemas.EventStepDispatched {
			// The transition dispatched the next step (its event folded
			// into this one).
			s.Steps[d.Next] = schemas.StepDispatched
			inFlight[d.Next+"#0#0"] = flight{step: d.Next}
		}
	}
	// Effects settled after the transition at seq was written (the step in
	// flight then among them), each once, as it stands last.
	byKey := map[string]int{}
	for _, h := range ledger {
		if !h.Time.After(s.At) {
			continue
		}
		e := EffectAfter{Key: h.Data.EffectKey, Step: h.Data.Step, State: h.Data.EffectState, ExternalID: h.Data.ExternalID}
		if i, ok := byKey[e.Key]; ok {
			s.EffectsAfter[i] = e
			continue
		}
		byKey[e.Key] = len(s.EffectsAfter)
		s.EffectsAfter = append(s.EffectsAfter, e)
	}
	var at []string
	for _, f := range inFlight {
		if !slices.Contains(at, f.step) {
			at = append(at, f.step)
		}
		if f.sub {
			s.Why = "a parallel, map or agent step was in flight"
		}
	}
	sort.Strings(at)
	switch {
	case s.Why != "":
		s.Why += " at seq " + fmt.Sprint(seq) + " (" + strings.Join(at, ", ") + "): pick a sequence before or after it"
	case len(at) == 1:
		s.Next = at[0]
	case len(at) > 1:
		s.Why = "several steps were in flight (" + strings.Join(at, ", ") + ")"
	case s.Status.Terminal():
		s.Why = "the job had " + string(s.Status) + " by then"
	default:
		s.Why = "no step was in flight at that sequence"
	}
	return s, nil
}

// rewindable reports whether a rewind applies to cp: it completed or
// failed, waits for approval, or is paused.
func rewindable(cp *schemas.Checkpoint) bool {
	switch {
	case cp.Status == schemas.JobCompleted, cp.Status == schemas.JobFailed, cp.Status == schemas.JobWaitingApproval:
		return true
	}
	return cp.Paused != nil && !cp.Status.Terminal()
}

// RewindResult is what a rewind did: the job's record after it and the
// snapshot it went back to (Snapshot.EffectsAfter: the effects confirmed
// after that point, which are answered from the ledger when the job meets
// them again, not performed).
type RewindResult struct {
	Job      *JobView  `json:"job"`
	Snapshot *Snapshot `json:"snapshot"`
}

// Rewind sets job id back to sequence to and lets it go on from the step
// it was at then: its state then, each step's runs then, so that a step
// it runs again reuses the idempotency key of that run. The job must
// have completed or failed, wait for approval, or be paused (pause it
// first: its steps in flight are dropped). Errors: schemas.ErrNotFound;
// ErrNotApplicable for a job in another state; CodeInputInvalid for a
// sequence it never reached or one at which it was at no single step
// (the message says why); ErrControlPending.
func (c *Client) Rewind(ctx context.Context, id string, to uint64, r ControlRequest) (*RewindResult, error) {
	if err := checkWho("rewind", id, r); err != nil {
		return nil, err
	}
	cp, err := c.load(ctx, "rewind", id)
	if err != nil {
		return nil, err
	}
	if !rewindable(cp) {
		return nil, fmt.Errorf("rewind job %s: it is %s; rewind a job that completed, failed, waits for approval or is paused (engine pause %s first): %w", id, cp.Status, id, ErrNotApplicable)
	}
	snap, err := c.StateAt(ctx, id, to)
	if err != nil {
		return nil, err
	}
	if snap.Next == "" {
		return nil, schemas.Errorf(schemas.CodeInputInvalid, "rewind job %s to seq %d: %s", id, to, snap.Why)
	}
	var rev uint64
	if cp.Status.Terminal() {
		if rev, err = c.reactivate(ctx, cp); err != nil {
			return nil, fmt.Errorf("rewind job %s: %w", id, err)
		}
	}
	reason := r.Reason
	if n := len(snap.EffectsAfter); n > 0 {
		var keys []string
		for _, e := range snap.EffectsAfter {
			keys = append(keys, e.Key)
		}
		if reason != "" {
			reason += "; "
		}
		reason += fmt.Sprintf("%d effects confirmed after seq %d are answered from the ledger, not performed again: %s", n, to, strings.Join(keys, ", "))
	}
	sig := schemas.Signal{Job: id, Type: schemas.SignalRewind, By: r.By, Reason: reason, From: snap.Next, Seq: to, State: snap.State, Runs: snap.Runs, IndexRev: rev}
	v, err := c.control(ctx, "rewind", cp, sig, func(n *schemas.Checkpoint) bool { return !rewindable(n) })
	if err != nil {
		return nil, err
	}
	return &RewindResult{Job: v, Snapshot: snap}, nil
}

// ForkRequest says how to fork a job: the new job's id (empty: a fresh
// one), who forks it, and state changes, each a dotted state path and the
// JSON value it takes.
type ForkRequest struct {
	JobID string                     `json:"job_id,omitempty"`
	By    string                     `json:"by"`
	Set   map[string]json.RawMessage `json:"set,omitempty"`
}

// Fork starts a new job from job id as it stood at sequence from: the
// same pinned definition and vars, the state then (with r.Set applied),
// starting at the step the parent was at. The parent is not changed,
// and goes on if it runs. A run of a step that the parent had reached when
// the fork was taken (the step the fork starts at among them) takes the
// parent's idempotency key, so that an effect the parent confirmed is
// answered from the ledger and never made twice; later runs take the
// fork's own keys. "Reached" is at sequence from: the runs ended by then
// and the one in flight then. Errors: schemas.ErrNotFound;
// CodeInputInvalid for a sequence the parent never reached or one at which
// it was at no single step, a bad path, a state that breaks the state
// schema, or a state holding values by reference (not supported yet).
func (c *Client) Fork(ctx context.Context, id string, from uint64, r ForkRequest) (StartResult, error) {
	if err := checkWho("fork", id, ControlRequest{By: r.By}); err != nil {
		return StartResult{}, err
	}
	cp, err := c.load(ctx, "fork", id)
	if err != nil {
		return StartResult{}, err
	}
	snap, err := c.StateAt(ctx, id, from)
	if err != nil {
		return StartResult{}, err
	}
	if snap.Next == "" {
		return StartResult{}, schemas.Errorf(schemas.CodeInputInvalid, "fork job %s at seq %d: %s", id, from, snap.Why)
	}
	state := snap.State
	for _, path := range sortedPaths(r.Set) {
		if state, err = setPath(state, path, r.Set[path]); err != nil {
			return StartResult{}, schemas.Errorf(schemas.CodeInputInvalid, "fork job %s: set %s: %v", id, path, err)
		}
	}
	if schemas.HasRefs(state) {
		return StartResult{}, schemas.Errorf(schemas.CodeInputInvalid, "fork job %s at seq %d: its state then holds values by reference (large values), which a fork cannot take yet", id, from)
	}
	def, err := c.store.Definitions.Get(ctx, cp.DefinitionHash)
	if err != nil {
		return StartResult{}, fmt.Errorf("fork job %s: its definition %s: %w", id, short(cp.DefinitionHash), err)
	}
	jobID := r.JobID
	if jobID == "" {
		jobID = fmt.Sprintf("%s-fork-%d-%d", id, from, c.now().UnixMilli()%1e6)
	}
	// The runs the parent had reached at from: those that had ended, and
	// the one in flight then (it may have ended since: never twice).
	parentRuns := maps.Clone(snap.Runs)
	if parentRuns == nil {
		parentRuns = map[string]int{}
	}
	parentRuns[snap.Next]++
	origin := &schemas.ForkOrigin{Parent: id, Seq: from, From: snap.Next, Runs: snap.Runs, ParentRuns: parentRuns, KeyBase: cp.KeyBase()}
	for _, a := range cp.Approvals {
		if a.Status == schemas.ApprovalApproved && a.DecidedAt != nil && !a.DecidedAt.After(snap.At) {
			origin.Approvals = append(origin.Approvals, a) // its scope keeps bounding the fork
		}
	}
	return c.Start(ctx, def, state, StartOptions{JobID: jobID, Vars: cp.Vars, Fork: origin})
}

func sortedPaths(m map[string]json.RawMessage) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// setPath returns doc (a JSON object) with the value at dotted path set to
// v (JSON), making the objects on the way.
func setPath(doc json.RawMessage, path string, v json.RawMessage) (json.RawMessage, error) {
	parts := strings.Split(path, ".")
	for _, p := range parts {
		if p == "" {
			return nil, fmt.Errorf("path %q: an empty member name", path)
		}
	}
	var val any
	if err := json.Unmarshal(v, &val); err != nil {
		return nil, fmt.Errorf("value is not JSON: %v", err)
	}
	var root map[string]any
	if err := json.Unmarshal(doc, &root); err != nil {
		return nil, fmt.Errorf("state: %v", err)
	}
	cur := root
	for i, p := range parts[:len(parts)-1] {
		next, ok := cur[p].(map[string]any)
		if !ok {
			if _, exists := cur[p]; exists {
				return nil, fmt.Errorf("state.%s is not an object", strings.Join(parts[:i+1], "."))
			}
			next = map[string]any{}
			cur[p] = next
		}
		cur = next
	}
	cur[parts[len(parts)-1]] = val
	return schemas.Marshal(root)
}
