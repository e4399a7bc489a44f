package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/waymark-dev/waymark/schemas"
)

// This file holds the transitions of parallel and map (for_each) steps:
// several dispatches of one job in flight at once, in cp.Fan. Like
// apply.go it does no I/O but reading what a job's state refers to (the
// list a map runs over, when it is stored by reference, and the chunks of
// a map's outputs) through fanEnv.

// chunkBytes is the size past which a map's outputs leave the checkpoint
// for a chunk in the value store.
const chunkBytes = 8 << 10

// fanEnv is what fan transitions read besides the checkpoint: the lists
// maps run over, decoded once per fan, and the value store. Shared by an
// engine's lanes.
type fanEnv struct {
	lists *lru.Cache[string, *fanList]
	// get reads a value by digest ("sha256:<hex>") stored for owner (a
	// job's message prefix); nil when the engine has no value store.
	get func(ctx context.Context, owner, digest string, size int) ([]byte, error)
	// threshold: state members longer than this many bytes are kept by
	// reference (0: never); maxState caps a job's state with references
	// counted as their values, in bytes (0: no cap).
	threshold int
	maxState  int64
}

// keepLarge replaces the top-level members of state longer than the
// threshold by references, staging their values in cp.Unsaved, and
// refuses a state whose logical size is over the job limit.
func (env *fanEnv) keepLarge(cp *schemas.Checkpoint, state json.RawMessage) (json.RawMessage, *schemas.Error) {
	if env.threshold > 0 && env.get != nil && len(state) > env.threshold {
		out, err := schemas.ExternalizeMembers(state, env.threshold, func(v []byte) (schemas.ValueRef, error) {
			cp.Unsaved = append(cp.Unsaved, v)
			return schemas.NewValueRef(v), nil
		})
		if err != nil {
			return nil, schemas.Errorf(schemas.CodeTooLarge, "keep large state values by reference: %v", err)
		}
		state = out
	}
	if env.maxState > 0 && schemas.HasRefs(state) {
		if n := int64(schemas.LogicalSize(state)); n > env.maxState {
			return nil, schemas.Errorf(schemas.CodeTooLarge, "state would be %d bytes with its values by reference; the job's limit is %d (WAYMARK_MAX_JOB_STATE)", n, env.maxState)
		}
	}
	return state, nil
}

// owns reports whether the value r names is stored for cp's job.
func (env *fanEnv) owns(cp *schemas.Checkpoint, r schemas.ValueRef) bool {
	if env.get == nil || !r.Valid() {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := env.get(ctx, cp.MsgPrefix(), r.Digest, r.Bytes)
	if err != nil && !errors.Is(err, schemas.ErrValueMissing) {
		panic(fanFault{err}) // a passing fault: the messages are handed back
	}
	return err == nil
}

// resolve returns state with its references replaced by their values, for
// conditions and schemas. A value that cannot be read is a passing fault:
// the messages are handed back (valueFault).
func (env *fanEnv) resolve(cp *schemas.Checkpoint, state json.RawMessage) json.RawMessage {
	if !schemas.HasRefs(state) {
		return state
	}
	staged := map[string][]byte{}
	for _, v := range cp.Unsaved {
		staged[schemas.NewValueRef(v).Digest] = v
	}
	out, err := schemas.ResolveRefs(state, func(r schemas.ValueRef) ([]byte, error) {
		if v, ok := staged[r.Digest]; ok {
			return v, nil
		}
		if env.get == nil {
			return nil, fmt.Errorf("value %s: this engine has no value store", r.Digest)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return env.get(ctx, cp.MsgPrefix(), r.Digest, r.Bytes)
	})
	if err != nil {
		panic(fanFault{err})
	}
	return out
}

func newFanEnv() *fanEnv {
	c, _ := lru.New[string, *fanList](256)
	return &fanEnv{lists: c}
}

// fanList is a map's list as the fan sees it: the items, their names, and
// the state the items' messages carry (without the list).
type fanList struct {
	items   []json.RawMessage
	names   []string
	reduced json.RawMessage
}

// list returns the list of cp's running map (cp.Fan), decoding it from
// the state on first use. Errors are step errors: the state has no list
// at the path, it is too long, or two items have the same key.
func (env *fanEnv) list(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, run int) (*fanList, *schemas.Error) {
	key := cp.MsgPrefix() + "/" + s.ID + "/" + strconv.Itoa(run)
	if l, ok := env.lists.Get(key); ok {
		return l, nil
	}
	l, err := env.decodeList(c, cp, s)
	if err != nil {
		return nil, err
	}
	env.lists.Add(key, l)
	return l, nil
}

var plainName = regexp.MustCompile(`^[A-Za-z0-9_=-]{1,64}$`)

func (env *fanEnv) decodeList(c *compiled, cp *schemas.Checkpoint, s *schemas.Step) (*fanList, *schemas.Error) {
	f := s.ForEach
	path := strings.Split(f.Items, ".")
	raw, reduced, err := cutPath(cp.State, path)
	if err != nil {
		return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: fmt.Sprintf("for_each.items: state.%s: %v", f.Items, err)}
	}
	if schemas.HasRefs(raw) {
		raw = env.resolve(cp, raw)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil || bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: fmt.Sprintf("for_each.items: state.%s is %s, not a list", f.Items, jsonKindOf(raw))}
	}
	if max := f.MaxItemsOf(); len(items) > max {
		return nil, &schemas.Error{Code: schemas.CodeTooLarge, Message: fmt.Sprintf("for_each.items: state.%s has %d items; the step takes at most %d (for_each.max_items)", f.Items, len(items), max)}
	}
	l := &fanList{items: items, reduced: reduced, names: make([]string, len(items))}
	idx := c.def.StepIndex(s.ID)
	tmpl := c.itemKeys[idx]
	seen := make(map[string]int, len(items))
	for i, it := range items {
		name := schemas.ItemName(i)
		if tmpl != nil {
			var doc any
			if err := json.Unmarshal(it, &doc); err != nil {
				return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: fmt.Sprintf("for_each.items: item %d: %v", i, err)}
			}
			var b strings.Builder
			if err := tmpl.Execute(&b, map[string]any{"item": doc, "index": i}); err != nil {
				return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: fmt.Sprintf("for_each.key of item %d: %v", i, err)}
			}
			name = b.String()
			if name == "" {
				return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: fmt.Sprintf("for_each.key of item %d rendered empty", i)}
			}
			if !plainName.MatchString(name) {
				sum := sha256.Sum256([]byte(name))
				name = "k-" + hex.EncodeToString(sum[:16])
			}
			if j, dup := seen[name]; dup {
				return nil, &schemas.Error{Code: schemas.CodeInputInvalid, Message: fmt.Sprintf("for_each.key: items %d and %d have the same key %q; keys must tell items apart", j, i, b.String())}
			}
			seen[name] = i
		}
		l.names[i] = name
	}
	return l, nil
}

// cutPath returns the value at path in the object doc, and doc without it.
func cutPath(doc []byte, path []string) (value, rest []byte, err error) {
	ms, err := members(doc)
	if err != nil {
		return nil, nil, fmt.Errorf("not an object")
	}
	for i, m := range ms {
		var k string
		if json.Unmarshal(m.key, &k) != nil || k != path[0] {
			continue
		}
		if len(path) == 1 {
			value = m.value
			rest = joinMembers(slices.Delete(slices.Clone(ms), i, i+1))
			return value, rest, nil
		}
		value, inner, err := cutPath(m.value, path[1:])
		if err != nil {
			return nil, nil, err
		}
		cp := slices.Clone(ms)
		cp[i] = member{key: m.key, value: inner}
		return value, joinMembers(cp), nil
	}
	return nil, nil, fmt.Errorf("no member %q", path[0])
}

func joinMembers(ms []member) []byte {
	out := []byte{'{'}
	for i, m := range ms {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, m.key...)
		out = append(out, ':')
		out = append(out, m.value...)
	}
	return append(out, '}')
}

func jsonKindOf(raw []byte) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "empty"
	}
	switch raw[0] {
	case '{':
		return "an object"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	case '[':
		return "a list"
	}
	return "a number"
}

// isFan reports whether s runs as a fan: a parallel or for_each step.
func isFan(s *schemas.Step) bool { return s.Kind == schemas.KindParallel || s.ForEach != nil }

// stepRecord returns step's record in cp, made (or brought back from
// Completed) when absent.
func stepRecord(c *compiled, cp *schemas.Checkpoint, step string) *schemas.StepRecord {
	rec := cp.Steps[step]
	if rec == nil {
		rec = &schemas.StepRecord{}
		if idx := c.def.StepIndex(step); cp.Completed.Has(idx) {
			rec = &schemas.StepRecord{Status: schemas.StepCompleted, Attempts: 1, Runs: 1, RunAttempt: 1}
			cp.Completed = cp.Completed.Without(idx)
		}
		cp.Steps[step] = rec
	}
	return rec
}

// startFan begins a run of a parallel or for_each step: every branch is
// dispatched, or the first items of the list up to the concurrency.
func startFan(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, now time.Time) []event {
	rec := stepRecord(c, cp, s.ID)
	rec.Runs++
	rec.RunAttempt = 1
	rec.Attempts++
	rec.Status = schemas.StepDispatched
	f := &schemas.Fan{Step: s.ID, Run: rec.Runs}
	ev := event{typ: schemas.EventStepDispatched, data: schemas.HistoryData{Job: cp.JobID, Step: s.ID, Attempt: rec.Attempts, Status: string(rec.Status)}}
	if s.Kind == schemas.KindParallel {
		f.Total = len(s.Branches)
		cp.Fan = f
		ev.data.Reason = fmt.Sprintf("parallel: %d branches", f.Total)
		evs := []event{ev}
		for _, b := range s.Branches {
			evs = append(evs, dispatch(c, cp, b, true, time.Time{}, now))
			if cp.Fan == nil { // a branch's key could not be made: the job failed
				return evs
			}
		}
		return evs
	}
	l, err := c.env.list(c, cp, s, rec.Runs)
	if err != nil {
		return append([]event{ev}, failFanStep(c, cp, s, err.At(cp.JobID, s.ID, rec.Attempts), now)...)
	}
	f.Total = len(l.items)
	cp.Fan = f
	listByReference(c, cp, s)
	ev.data.Reason = fmt.Sprintf("map over %d items, %d at a time", f.Total, s.ForEach.ConcurrencyOf())
	return append([]event{ev}, progressMap(c, cp, s, now)...)
}

// listInlineBytes is the size past which a map's list, a top-level state
// member, is kept by reference while the map runs, whatever the value
// threshold: every checkpoint of the map would carry it otherwise.
const listInlineBytes = 4 << 10

// listByReference moves the list of the map starting in cp out of the
// state into the value store (a reference in its place), when it is a
// top-level member over listInlineBytes; the items were decoded already.
func listByReference(c *compiled, cp *schemas.Checkpoint, s *schemas.Step) {
	if c.env.get == nil || strings.Contains(s.ForEach.Items, ".") {
		return
	}
	ms, err := members(cp.State)
	if err != nil {
		return
	}
	key, _ := json.Marshal(s.ForEach.Items)
	for _, m := range ms {
		if !sameKey(m.key, key) || len(m.value) <= listInlineBytes || schemas.HasRefs(m.value) {
			continue
		}
		v := slices.Clone(m.value)
		ns, err := setMembers(cp.State, []member{{key: key, value: schemas.NewValueRef(v).JSON()}})
		if err == nil {
			cp.Unsaved = append(cp.Unsaved, v)
			cp.State = ns
		}
		return
	}
}

// dispatchItem records an attempt of item index (from 0) of the running
// map in cp.Fan.Running.
func dispatchItem(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, index, attempt int, notBefore, now time.Time) event {
	f := cp.Fan
	l, _ := c.env.list(c, cp, s, f.Run) // decoded when the fan started
	name := schemas.ItemName(index)
	if l != nil && index < len(l.names) {
		name = l.names[index]
	}
	key := ""
	if c.def.EffectOf(s) != schemas.EffectPure {
		key = schemas.ItemIdempotencyKey(cp.KeyBaseFor(s.ID, f.Run), s.ID, f.Run, name)
	}
	d := &schemas.Dispatch{
		Step: s.ID, Attempt: attempt, RunAttempt: attempt, Item: index + 1,
		MsgID:        schemas.ItemMsgID(cp.MsgPrefix(), s.ID, f.Run, index+1, attempt),
		Pool:         c.def.PoolOf(s),
		DispatchedAt: now,
		EffectKey:    key,
	}
	status := schemas.StepDispatched
	if !notBefore.IsZero() && notBefore.After(now) {
		nb := notBefore
		d.NotBefore = &nb
		status = schemas.StepRetrying
	}
	f.Running = append(f.Running, d)
	if attempt == 1 {
		// An item's first dispatch is told by the map's step.dispatched
		// event and the item's own completion or failure: a map of 10,000
		// items writes 10,000 fewer events, and its checkpoints' outboxes
		// stay small.
		return event{}
	}
	return event{typ: schemas.EventStepDispatched, data: schemas.HistoryData{
		Job: cp.JobID, Step: s.ID, Attempt: attempt, Item: index + 1, Status: string(status), NotBefore: notBefore, EffectKey: key,
	}}
}

// progressMap dispatches items while the map has room (the job running,
// fewer than its concurrency in flight), moves outputs into a chunk once
// they grow, and completes the step once every item is done or failed.
func progressMap(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, now time.Time) []event {
	f := cp.Fan
	var evs []event
	if cp.Status != schemas.JobRunning {
		return nil
	}
	for conc := s.ForEach.ConcurrencyOf(); len(f.Running) < conc && f.Next < f.Total; f.Next++ {
		evs = append(evs, dispatchItem(c, cp, s, f.Next, 1, time.Time{}, now))
	}
	finishing := f.Done.Len()+len(f.Failed) == f.Total && len(f.Running) == 0 && len(f.Blocked) == 0
	pending := 0
	for _, o := range f.Outputs {
		pending += len(o.Output) + 16
	}
	if pending > chunkBytes && !finishing {
		data, _ := json.Marshal(f.Outputs)
		sum := sha256.Sum256(data)
		f.Chunks = append(f.Chunks, schemas.FanChunk{Digest: "sha256:" + hex.EncodeToString(sum[:]), Bytes: len(data), Items: len(f.Outputs)})
		cp.Unsaved = append(cp.Unsaved, data)
		f.Outputs = nil
	}
	if finishing {
		evs = append(evs, finishMap(c, cp, s, now)...)
	}
	return evs
}

// finishMap gathers the map's outputs in input order under the step's
// save_as and follows its transitions. Under on_item_error collect the
// value is {"results": [...], "errors": [{"index", "key", "error"}]},
// else the list of outputs.
func finishMap(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, now time.Time) []event {
	f := cp.Fan
	rec := stepRecord(c, cp, s.ID)
	outs := make([]json.RawMessage, f.Total)
	put := func(os []schemas.FanOutput) {
		for _, o := range os {
			if o.Index >= 0 && o.Index < len(outs) {
				outs[o.Index] = o.Output
			}
		}
	}
	for _, ch := range f.Chunks {
		data, err := c.env.chunk(cp, ch)
		if err != nil {
			// A passing fault of the value store must not fail the job: the
			// caller hands the message back (see fanFault).
			panic(fanFault{err})
		}
		var os []schemas.FanOutput
		if err := json.Unmarshal(data, &os); err != nil {
			return failFanStep(c, cp, s, &schemas.Error{Code: schemas.CodeQuarantined, Job: cp.JobID, Step: s.ID,
				Message: fmt.Sprintf("chunk %s of the map's outputs does not decode: %v", ch.Digest, err)}, now)
		}
		put(os)
	}
	put(f.Outputs)
	list := []byte{'['}
	for i, o := range outs {
		if i > 0 {
			list = append(list, ',')
		}
		if o == nil {
			o = json.RawMessage("null")
		}
		list = append(list, o...)
	}
	list = append(list, ']')
	out := json.RawMessage(list)
	if s.ForEach.Collects() {
		type itemError struct {
			Index int            `json:"index"`
			Key   string         `json:"key,omitempty"`
			Error *schemas.Error `json:"error"`
		}
		errs := make([]itemError, 0, len(f.Failed))
		for _, fl := range f.Failed {
			errs = append(errs, itemError{Index: fl.Index, Key: fl.Key, Error: fl.Error})
		}
		slices.SortFunc(errs, func(a, b itemError) int { return a.Index - b.Index })
		eb, _ := json.Marshal(errs)
		out = json.RawMessage(`{"results":` + string(list) + `,"errors":` + string(eb) + `}`)
	}
	failed := len(f.Failed)
	cp.Fan = nil
	return completeFan(c, cp, s, rec, out, fmt.Sprintf("map: %d items, %d failed", f.Total, failed), now)
}

// completeFan saves a fan step's output (under save_as, without checking
// it against output_schema, which is each item's or branch's) and follows
// the step's transitions.
func completeFan(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, rec *schemas.StepRecord, out json.RawMessage, reason string, now time.Time) []event {
	idx := c.def.StepIndex(s.ID)
	newState := cp.State
	if s.SaveAs != "" {
		key, _ := json.Marshal(s.SaveAs)
		ns, err := setMembers(cp.State, []member{{key: key, value: out}})
		if err != nil {
			return failFanStep(c, cp, s, schemas.Errorf(schemas.CodeOutputInvalid, "state is not a JSON object").At(cp.JobID, s.ID, rec.Attempts), now)
		}
		kept, serr := c.env.keepLarge(cp, ns)
		if serr != nil {
			return failFanStep(c, cp, s, serr.At(cp.JobID, s.ID, rec.Attempts), now)
		}
		newState = kept
	}
	var stateDoc, outDoc any
	if c.needsDoc[idx] {
		var err error
		if stateDoc, err = decodePlain(c.env.resolve(cp, newState)); err != nil {
			return failFanStep(c, cp, s, schemas.Errorf(schemas.CodeOutputInvalid, "decode state: %v", err).At(cp.JobID, s.ID, rec.Attempts), now)
		}
		if err := c.state.Validate(stateDoc); err != nil {
			return failFanStep(c, cp, s, schemas.Errorf(schemas.CodeOutputInvalid, "the step's outputs would make state invalid against state_schema: %v", err).At(cp.JobID, s.ID, rec.Attempts), now)
		}
		outDoc, _ = decodePlain(out)
	}
	cp.State = newState
	cp.Fan = nil
	rec.Status = schemas.StepCompleted
	rec.LastError = nil
	rec.ResultDigest = digest(out)
	evs := []event{{typ: schemas.EventStepCompleted, data: schemas.HistoryData{
		Job: cp.JobID, Step: s.ID, Attempt: rec.Attempts, Status: string(rec.Status), ResultDigest: rec.ResultDigest, Reason: reason,
	}}}
	return append(evs, follow(c, cp, idx, rec, stateDoc, outDoc, now, &evs[0])...)
}

// failFanStep fails a fan step (or a map whose list is bad) for good: the
// fan is dropped and the job follows on_error or fails.
func failFanStep(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, e *schemas.Error, now time.Time) []event {
	rec := stepRecord(c, cp, s.ID)
	rec.Status, rec.LastError = schemas.StepFailed, e
	cp.Fan = nil
	ev := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{Job: cp.JobID, Step: s.ID, Attempt: rec.Attempts, Error: e}}
	if s.OnError != "" {
		ev.data.Next = s.OnError
		return append([]event{ev}, dispatchOrStop(c, cp, s.OnError, true, time.Time{}, now)...)
	}
	return []event{ev, failJob(cp, e, now)}
}

// applyFanResult applies the result of one of the fan's dispatches (which
// resultMayApply matched).
func applyFanResult(c *compiled, cp *schemas.Checkpoint, res *schemas.StepResult, now time.Time) []event {
	f := cp.Fan
	fs := c.def.Step(f.Step)
	if f.Agent != nil {
		return applyAgentResult(c, cp, fs, res, now)
	}
	if res.Item != 0 {
		return applyItemResult(c, cp, fs, res, now)
	}
	return applyBranchResult(c, cp, fs, res, now)
}

func applyItemResult(c *compiled, cp *schemas.Checkpoint, s *schemas.Step, res *schemas.StepResult, now time.Time) []event {
	f := cp.Fan
	d := f.RunningOf(s.ID, res.Item)
	index := res.Item - 1
	idx := c.def.StepIndex(s.ID)
	name := schemas.ItemName(index)
	if l, _ := c.env.list(c, cp, s, f.Run); l != nil && index < len(l.names) {
		name = l.names[index]
	}
	e := res.Error
	if e != nil && (e.Code == schemas.CodeDefinitionMissing || e.Code == schemas.CodeWaiting) {
		// Not the item's failure: again, without using up an attempt.
		f.Remove(s.ID, res.Item)
		nb := time.Time{}
		if e.Code == schemas.CodeWaiting {
			nb = waitUntil(c, s, e, now)
		}
		ev := dispatchItem(c, cp, s, index, d.Attempt+1, nb, now)
		f.Running[len(f.Running)-1].RunAttempt = d.RunAttempt
		ev.data.Reason = e.Message + ": dispatched again"
		return []event{ev}
	}
	output := bytes.TrimSpace(res.Output)
	if e == nil {
		if len(output) == 0 {
			output = json.RawMessage("null")
		}
		if v := c.output[idx]; v != nil {
			doc, err := decodePlain(output)
			if err == nil {
				err = v.Validate(doc)
			}
			if err != nil {
				e = &schemas.Error{Code: schemas.CodeOutputInvalid, Retryable: true, Message: fmt.Sprintf("output of item %d does not match steps[%d].output_schema: %v", index, idx, err)}
			}
		} else if !json.Valid(output) {
			e = schemas.Errorf(schemas.CodeOutputInvalid, "output of item %d is not valid JSON", index)
		}
	}
	if e == nil {
		f.Remove(s.ID, res.Item)
		f.Done = f.Done.With(index)
		f.Outputs = append(f.Outputs, schemas.FanOutput{Index: index, Output: slices.Clip(output)})
		f.OutputBytes += int64(len(output))
		evs := []event{{typ: schemas.EventStepCompleted, data: schemas.HistoryData{
			Job: cp.JobID, Step: s.ID, Attempt: res.Attempt, Item: res.Item, Status: string(schemas.StepCompleted),
			DurationMs: res.DurationMs, ResultDigest: digest(output),
		}}}
		return append(evs, progressMap(c, cp, s, now)...)
	}
	e = e.At(cp.JobID, s.ID, res.Attempt)
	policy := c.def.RetryOf(s)
	retry := e.Retryable && d.RunAttempt < policy.MaxAttempts
	ev := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{
		Job: cp.JobID, Step: s.ID, Attempt: res.Attempt, Item: res.Item, Error: e, Retrying: retry, DurationMs: res.DurationMs,
		EffectKey: res.EffectKey, EffectState: string(res.EffectState),
	}}
	f.Remove(s.ID, res.Item)
	switch {
	case retry:
		next := now.Add(policy.Delay(d.RunAttempt + 1))
		ev.data.NotBefore = next
		return []event{ev, dispatchItem(c, cp, s, index, d.Attempt+1, next, now)}
	case outcomeUnknown(c, s, res):
		// The item's effect may have happened: the job waits for a person;
		// the other items in flight finish meanwhile, none is started.
		ev.data.Reason = "the item failed for good while its effect may have happened"
		b, bev := blockedOf(c, cp, d, s, stepRecord(c, cp, s.ID), res, e)
		blockInFan(cp, b)
		return []event{ev, bev}
	case s.ForEach.Collects():
		f.Failed = append(f.Failed, schemas.FanFail{Index: index, Key: name, Error: e})
		return append([]event{ev}, progressMap(c, cp, s, now)...)
	}
	fail := &schemas.Error{Code: e.Code, Job: cp.JobID, Step: s.ID, Attempt: res.Attempt,
		Message: fmt.Sprintf("item %d (%s) failed: %s", index, name, e.Message)}
	return append([]event{ev}, failFanStep(c, cp, s, fail, now)...)
}

func applyBranchResult(c *compiled, cp *schemas.Checkpoint, ps *schemas.Step, res *schemas.StepResult, now time.Time) []event {
	f := cp.Fan
	pos := slices.Index(ps.Branches, res.Step)
	idx := c.def.StepIndex(res.Step)
	bs := &c.def.Steps[idx]
	rec := cp.Steps[res.Step]
	rec.DurationMs = res.DurationMs
	d := f.RunningOf(res.Step, 0)
	e := res.Error
	if e != nil && (e.Code == schemas.CodeDefinitionMissing || e.Code == schemas.CodeWaiting) {
		f.Remove(res.Step, 0)
		nd, ev := redispatchOf(cp, d, now, e.Message+": dispatched again")
		if e.Code == schemas.CodeWaiting {
			nb := waitUntil(c, bs, e, now)
			nd.NotBefore = &nb
			rec.Status = schemas.StepRetrying
		}
		f.Running = append(f.Running, nd)
		return []event{ev}
	}
	var newState json.RawMessage
	if e == nil {
		var err *schemas.Error
		newState, _, _, err = mergeResult(c, cp, idx, res.Output)
		e = err
	}
	f.Remove(res.Step, 0)
	if e == nil {
		cp.State = newState
		rec.Status, rec.LastError, rec.ResultDigest = schemas.StepCompleted, nil, digest(res.Output)
		f.Done = f.Done.With(pos)
		evs := []event{{typ: schemas.EventStepCompleted, data: schemas.HistoryData{
			Job: cp.JobID, Step: res.Step, Attempt: res.Attempt, Status: string(rec.Status), DurationMs: res.DurationMs, ResultDigest: rec.ResultDigest,
		}}}
		return append(evs, progressParallel(c, cp, ps, now)...)
	}
	e = e.At(cp.JobID, res.Step, res.Attempt)
	if e.Code == schemas.CodeAmbiguous || (!retryable(c, bs, rec, e) && outcomeUnknown(c, bs, res)) {
		b, ev := blockedOf(c, cp, d, bs, rec, res, e)
		blockInFan(cp, b)
		return []event{{typ: schemas.EventStepFailed, data: schemas.HistoryData{Job: cp.JobID, Step: res.Step, Attempt: res.Attempt, Error: e,
			Reason: "the branch failed for good while its effect may have happened", EffectKey: res.EffectKey, EffectState: string(res.EffectState)}}, ev}
	}
	if retryable(c, bs, rec, e) {
		policy := c.def.RetryOf(bs)
		rec.LastError = e
		next := now.Add(policy.Delay(rec.RunAttempt + 1))
		ev := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{Job: cp.JobID, Step: res.Step, Attempt: res.Attempt, Error: e,
			Retrying: true, NotBefore: next, DurationMs: res.DurationMs, EffectKey: res.EffectKey, EffectState: string(res.EffectState)}}
		return append([]event{ev}, dispatchOrStop(c, cp, res.Step, false, next, now)...)
	}
	rec.Status, rec.LastError = schemas.StepFailed, e
	f.Failed = append(f.Failed, schemas.FanFail{Index: pos, Key: res.Step, Error: e})
	ev := event{typ: schemas.EventStepFailed, data: schemas.HistoryData{Job: cp.JobID, Step: res.Step, Attempt: res.Attempt, Error: e,
		DurationMs: res.DurationMs, EffectKey: res.EffectKey, EffectState: string(res.EffectState)}}
	return append([]event{ev}, progressParallel(c, cp, ps, now)...)
}

// retryable reports whether a failed attempt of s gets another under its
// retry policy.
func retryable(c *compiled, s *schemas.Step, rec *schemas.StepRecord, e *schemas.Error) bool {
	return e.Retryable && rec.RunAttempt < c.def.RetryOf(s).MaxAttempts
}

// progressParallel decides the join of the running parallel step once its
// branches allow: done when enough completed (the others cancelled, or
// waited for), failed when too many failed for the join to be met.
func progressParallel(c *compiled, cp *schemas.Checkpoint, ps *schemas.Step, now time.Time) []event {
	f := cp.Fan
	if cp.Status != schemas.JobRunning {
		return nil
	}
	needed := ps.Join.Needed(f.Total)
	done := f.Done.Len()
	var evs []event
	switch {
	case f.Decided:
		if len(f.Running) > 0 {
			return nil
		}
	case done >= needed:
		if ps.Join.Waits() && len(f.Running) > 0 {
			f.Decided = true
			return nil
		}
		evs = cancelBranches(c, cp, ps, now, "the join was decided")
	case f.Total-len(f.Failed) < needed:
		evs = cancelBranches(c, cp, ps, now, "the join can no longer be met")
		var why []string
		for _, fl := range f.Failed {
			why = append(why, fl.Key+": "+fl.Error.Message)
		}
		e := &schemas.Error{Code: schemas.CodeStepFailed, Job: cp.JobID, Step: ps.ID,
			Message: fmt.Sprintf("%d of %d branches failed and the join needs %d: %s", len(f.Failed), f.Total, needed, strings.Join(why, "; "))}
		return append(evs, failFanStep(c, cp, ps, e, now)...)
	default:
		return nil
	}
	out := map[string][]string{"completed": {}, "failed": {}, "cancelled": {}}
	for i, b := range ps.Branches {
		switch {
		case f.Done.Has(i):
			out["completed"] = append(out["completed"], b)
		case f.Cancelled.Has(i):
			out["cancelled"] = append(out["cancelled"], b)
		default:
			out["failed"] = append(out["failed"], b)
		}
	}
	ob, _ := json.Marshal(out)
	rec := stepRecord(c, cp, ps.ID)
	return append(evs, completeFan(c, cp, ps, rec, ob, fmt.Sprintf("parallel: %d of %d branches completed", done, f.Total), now)...)
}

// cancelBranches stops waiting for the branches still running: a late
// result of theirs is stale.
func cancelBranches(c *compiled, cp *schemas.Checkpoint, ps *schemas.Step, now time.Time, why string) []event {
	f := cp.Fan
	var evs []event
	for _, d := range f.Running {
		pos := slices.Index(ps.Branches, d.Step)
		f.Cancelled = f.Cancelled.With(pos)
		if rec := cp.Steps[d.Step]; rec != nil {
			rec.Status = schemas.StepCancelled
		}
		evs = append(evs, event{typ: schemas.EventStepCancelled, data: schemas.HistoryData{Job: cp.JobID, Step: d.Step, Attempt: d.Attempt, Status: string(schemas.StepCancelled), Reason: why, EffectKey: d.EffectKey}})
	}
	f.Running = nil
	return evs
}

// blockInFan records b, a fan item or branch whose effect may have
// happened, in the fan's Blocked list; the job needs reconciliation and
// names the first of them. The fan's other dispatches go on; nothing new
// starts until every one is resolved.
func blockInFan(cp *schemas.Checkpoint, b *schemas.Blocked) {
	cp.Fan.Blocked = append(cp.Fan.Blocked, *b)
	cp.Status = schemas.JobNeedsReconciliation
	if cp.Blocked == nil {
		cp.Blocked = b
	}
}

// resolveInFan takes the fan's blocked item or branch whose effect key is
// key out of its Blocked list: it is dispatched again (resumeFan). The job
// goes on running once none is left, else names the next.
func resolveInFan(cp *schemas.Checkpoint, key string) (*schemas.Blocked, bool) {
	f := cp.Fan
	for i := range f.Blocked {
		if f.Blocked[i].EffectKey == key {
			b := f.Blocked[i]
			f.Blocked = slices.Delete(f.Blocked, i, i+1)
			if len(f.Blocked) > 0 {
				next := f.Blocked[0]
				cp.Blocked = &next
			} else {
				cp.Blocked = nil
				cp.Status = schemas.JobRunning
			}
			return &b, true
		}
	}
	return nil, false
}

// resumeFan goes on with a fan whose blocked item or branch was resolved:
// it is dispatched again (its ledger record says what happened), and the
// map takes more items.
func resumeFan(c *compiled, cp *schemas.Checkpoint, b *schemas.Blocked, now time.Time) []event {
	fs := c.def.Step(cp.Fan.Step)
	if cp.Fan.Agent != nil {
		return resumeAgent(c, cp, b, now)
	}
	if b.Item != 0 {
		evs := []event{dispatchItem(c, cp, fs, b.Item-1, b.Attempt+1, time.Time{}, now)}
		if rec := cp.Steps[fs.ID]; rec != nil {
			rec.Status, rec.LastError = schemas.StepDispatched, nil
		}
		return append(evs, progressMap(c, cp, fs, now)...)
	}
	return dispatchOrStop(c, cp, b.Step, false, time.Time{}, now)
}

// fanFault is a passing fault met while deciding a fan transition (the
// value store did not answer): the messages are handed back.
type fanFault struct{ err error }

// chunk reads a chunk of map outputs.
func (env *fanEnv) chunk(cp *schemas.Checkpoint, ch schemas.FanChunk) ([]byte, error) {
	for _, v := range cp.Unsaved {
		// Made by this transition, not stored yet.
		if len(v) == ch.Bytes && schemas.NewValueRef(v).Digest == ch.Digest {
			return v, nil
		}
	}
	if env.get == nil {
		return nil, fmt.Errorf("chunk %s: this engine has no value store", ch.Digest)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return env.get(ctx, cp.MsgPrefix(), ch.Digest, ch.Bytes)
}

// newDispatches returns the dispatches of next that base does not have
// (by message id); every one of next's when base is nil.
func newDispatches(base, next *schemas.Checkpoint) []*schemas.Dispatch {
	ds := next.Dispatches()
	if base == nil || len(ds) == 0 {
		return slices.Clone(ds)
	}
	had := make(map[string]bool, len(base.Dispatches()))
	for _, h := range base.Dispatches() {
		had[h.MsgID] = true
	}
	var out []*schemas.Dispatch
	for _, d := range ds {
		if !had[d.MsgID] {
			out = append(out, d)
		}
	}
	return out
}

// saveValues stores the values cp's transition refers to (map output
// chunks, state members kept by reference), before cp is written.
func (e *Engine) saveValues(ctx context.Context, cp *schemas.Checkpoint) error {
	if len(cp.Unsaved) == 0 {
		return nil
	}
	if e.store.Values == nil {
		return fmt.Errorf("job %s: large values need the value store, which this store does not have", cp.JobID)
	}
	for _, data := range cp.Unsaved {
		if _, err := e.store.Values.Put(ctx, cp.MsgPrefix(), data); err != nil {
			return fmt.Errorf("job %s: store a value: %w", cp.JobID, err)
		}
	}
	cp.Unsaved = nil
	return nil
}

// itemMessage fills a map item's step message: the item, its name, and
// the state without the list.
func (e *Engine) itemMessage(cp *schemas.Checkpoint, d *schemas.Dispatch, sm *schemas.StepMessage) error {
	c, err := e.compiledFor(cp.DefinitionHash)
	if err != nil {
		return err
	}
	s := c.def.Step(d.Step)
	if s != nil && isAgent(s) && cp.Fan != nil && cp.Fan.Agent != nil {
		return toolCallMessage(cp, d, sm)
	}
	if s == nil || s.ForEach == nil || cp.Fan == nil {
		return fmt.Errorf("job %s: dispatch %s is of a map item, and %q is not a running for_each step", cp.JobID, d.MsgID, d.Step)
	}
	l, serr := c.env.list(c, cp, s, cp.Fan.Run)
	if serr != nil {
		return fmt.Errorf("job %s: %w", cp.JobID, serr)
	}
	i := d.Item - 1
	if i >= len(l.items) {
		return fmt.Errorf("job %s: item %d of a list of %d", cp.JobID, d.Item, len(l.items))
	}
	sm.Item, sm.ItemName, sm.ItemValue, sm.State = d.Item, l.names[i], l.items[i], l.reduced
	sm.IdempotencyKey = schemas.ItemIdempotencyKey(cp.KeyBaseFor(s.ID, cp.Fan.Run), s.ID, cp.Fan.Run, l.names[i])
	return nil
}

// compiledFor returns the compiled definition of hash.
func (e *Engine) compiledFor(hash string) (*compiled, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	def, err := e.store.Definitions.Get(ctx, hash)
	if err != nil {
		return nil, err
	}
	return e.compiled.get(def)
}

// dropFanValues deletes the values of a fan that base referred to and next,
// now written, does not: chunks of map outputs (the map finished, its
// outputs are in the state, or failed), an agent's transcript parts that
// were merged into one, and long tool results of a finished turn. Best
// effort: a value left by a crash here stays in the value store (it is
// small, and named after the job).
func (e *Engine) dropFanValues(ctx context.Context, base, next *schemas.Checkpoint) {
	if base.Fan == nil || e.store.Values == nil {
		return
	}
	var drop []schemas.ValueRef
	for _, ch := range base.Fan.Chunks {
		if next.Fan == nil || !slices.Contains(next.Fan.Chunks, ch) {
			drop = append(drop, schemas.ValueRef{Digest: ch.Digest, Bytes: ch.Bytes})
		}
	}
	if a := base.Fan.Agent; a != nil {
		// Transcript parts merged into one, or of a run that ended, unless
		// the job keeps them; long tool results of a finished turn.
		var kept []schemas.TranscriptPart
		if next.Fan != nil && next.Fan.Agent != nil {
			kept = next.Fan.Agent.Transcript
			for _, call := range next.Fan.Agent.Calls {
				if call.ContentRef != nil {
					kept = append(kept, *call.ContentRef)
				}
			}
		}
		old := slices.Clone(a.Transcript)
		for _, call := range a.Calls {
			if call.ContentRef != nil {
				old = append(old, *call.ContentRef)
			}
		}
		for _, p := range old {
			if !slices.Contains(kept, p) && !slices.ContainsFunc(next.Transcripts, func(k schemas.TranscriptPart) bool { return k.Digest == p.Digest }) {
				drop = append(drop, p.Ref())
			}
		}
	}
	if len(drop) == 0 {
		return
	}
	if err := e.store.Values.DeleteOwner(ctx, base.MsgPrefix(), drop); err != nil {
		e.log.Warn("could not delete the output chunks of a finished map", "job", base.JobID, "chunks", len(drop), "err", err)
	}
}
