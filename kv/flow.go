package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/waymark-dev/waymark/schemas"
)

// Flow is the flow-control bucket (<prefix>_flow) that engines share to
// hold workflow steps' concurrency and rate limits across processes
// (schemas.Concurrency, schemas.RateLimit). Its keys, every token made
// key-safe by the caller (schemas.FlowLimitID, schemas.FlowKeyDigest):
//
//	c.<limit>.<key digest>.<slot>                 a concurrency slot, 0..N-1; value FlowHolder
//	w.<limit>.<key digest>.<rank>.<since>.<id>    a dispatch waiting for a slot; value FlowHolder
//	q.<limit>.<key digest>                        "1": the limit and key may have waiters
//	r.<limit>.<key digest>                        the current rate window; value FlowWindow
//
// Acquiring a slot is a KV Create (atomic across engines); releasing is a
// delete on the revision read, or a hand-over to the first waiter (an
// update on that revision). rank is 999 minus the priority, three digits,
// and since a zero-padded Unix time in nanoseconds, so that the waiters of
// one limit sort by priority (higher first), then age. `nats kv ls
// waymark_flow` shows what holds and what waits.
type Flow struct {
	kv jetstream.KeyValue
}

// FlowHolder names the dispatch that holds (or waits for) a slot.
type FlowHolder struct {
	Job   string    `json:"job"`
	Step  string    `json:"step"`
	MsgID string    `json:"msg_id"`         // the dispatch's step message id
	Key   string    `json:"key,omitempty"`  // the limit's rendered key
	At    time.Time `json:"at"`             // when it took the slot (or began to wait)
	Prio  int       `json:"prio,omitempty"` // a waiter's priority
	// Max is a waiter's limit (its definition's N): it takes only slots
	// 0..Max-1, so that jobs of two versions that declare different limits
	// each keep theirs. 0: any slot (records written before it existed).
	Max int `json:"max,omitempty"`
	// Seq is the sequence of the checkpoint that records the slot, written
	// after the slot is taken: a checkpoint of the job at Seq or later that
	// does not name the slot means it was left behind. 0 for a slot handed
	// over (the waiter's checkpoint names it once it takes it).
	Seq uint64 `json:"seq,omitempty"`
}

// FlowSlot is a slot as listed: its key, holder and revision.
type FlowSlot struct {
	Key      string
	Holder   FlowHolder
	Revision uint64
	Created  time.Time // when the entry was written (acquired or handed over)
}

// FlowWindow is a rate window's count: the dispatches admitted in the
// fixed window [Start, Start+Period), the first 100 of them by message id.
type FlowWindow struct {
	Start  time.Time `json:"start"`
	Period int64     `json:"period_ms"`
	Count  int       `json:"count"`
	IDs    []string  `json:"ids,omitempty"`
}

const maxWindowIDs = 100

// SlotKey is the key of slot i of limit and key digest kd.
func SlotKey(limit, kd string, i int) string {
	return "c." + limit + "." + kd + "." + strconv.Itoa(i)
}

// waiterPrefix is the key prefix of limit and kd's waiters.
func waiterPrefix(limit, kd string) string { return "w." + limit + "." + kd + "." }

// WaiterKey is the key of a dispatch (message id digest id) waiting for
// limit and kd with priority prio since since.
func WaiterKey(limit, kd string, prio int, since time.Time, id string) string {
	return fmt.Sprintf("%s%03d.%019d.%s", waiterPrefix(limit, kd), 999-max(0, min(prio, 999)), since.UnixNano(), id)
}

// SlotOf returns the limit and key-digest part of a slot key ("c.<limit>.<kd>.<i>"), ok false
// when key is not a slot key.
func SlotOf(key string) (limit, kd string, ok bool) {
	limit, kd, _, ok = slotParts(key)
	return limit, kd, ok
}

// SlotIndex returns the i of a slot key "c.<limit>.<kd>.<i>", -1 when key
// is not one.
func SlotIndex(key string) int {
	_, _, i, ok := slotParts(key)
	if !ok {
		return -1
	}
	return i
}

func slotParts(key string) (limit, kd string, i int, ok bool) {
	parts := strings.Split(key, ".")
	if len(parts) != 4 || parts[0] != "c" {
		return "", "", 0, false
	}
	i, err := strconv.Atoi(parts[3])
	if err != nil || i < 0 {
		return "", "", 0, false
	}
	return parts[1], parts[2], i, true
}

// Acquire takes the first free slot of limit and kd among n (a Create on
// each in turn, starting at start mod n so that holders spread), for
// holder. It returns the slot key, or "" when all n are taken, and how
// many it found taken. Safe across engines: two Creates of one key never
// both succeed.
func (f *Flow) Acquire(ctx context.Context, limit, kd string, n, start int, holder FlowHolder) (string, int, error) {
	data, _ := json.Marshal(holder)
	taken := 0
	for j := 0; j < n; j++ {
		key := SlotKey(limit, kd, (start+j)%n)
		_, err := f.kv.Create(ctx, key, data)
		if err == nil {
			return key, taken, nil
		}
		if !isRevisionConflict(err) {
			return "", taken, fmt.Errorf("acquire flow slot %s: %w", key, err)
		}
		taken++
	}
	return "", taken, nil
}

// Refresh rewrites the Seq of the slot under key, which holder (job and
// message id) must still hold: a decision made again after a conflict
// records the slot at a later sequence. ok false when the slot is free or
// held by another (it must be taken again).
func (f *Flow) Refresh(ctx context.Context, key, job, msgID string, seq uint64) (bool, error) {
	s, err := f.Slot(ctx, key)
	if errors.Is(err, schemas.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if s.Holder.Job != job || s.Holder.MsgID != msgID {
		return false, nil
	}
	if s.Holder.Seq == seq {
		return true, nil
	}
	s.Holder.Seq = seq
	data, _ := json.Marshal(s.Holder)
	if _, err := f.kv.Update(ctx, key, data, s.Revision); err != nil {
		if isRevisionConflict(err) {
			return false, nil
		}
		return false, fmt.Errorf("refresh flow slot %s: %w", key, err)
	}
	return true, nil
}

// HeldBy returns the slot of limit and kd (among n) whose holder is
// job's dispatch msgID, "" when none: a slot handed to a waiter before its
// waiting record was stored. n reads.
func (f *Flow) HeldBy(ctx context.Context, limit, kd string, n int, job, msgID string) (string, error) {
	for i := 0; i < n; i++ {
		s, err := f.Slot(ctx, SlotKey(limit, kd, i))
		if errors.Is(err, schemas.ErrNotFound) {
			continue
		}
		if err != nil {
			return "", err
		}
		if s.Holder.Job == job && s.Holder.MsgID == msgID {
			return s.Key, nil
		}
	}
	return "", nil
}

// Waiting reports whether the waiter record under key is still there
// (false also when it cannot be read).
func (f *Flow) Waiting(ctx context.Context, key string) bool {
	_, err := f.kv.Get(ctx, key)
	return err == nil
}

// Slot reads the slot under key; schemas.ErrNotFound when it is free.
func (f *Flow) Slot(ctx context.Context, key string) (FlowSlot, error) {
	ent, err := f.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return FlowSlot{}, fmt.Errorf("flow slot %s: %w", key, schemas.ErrNotFound)
	}
	if err != nil {
		return FlowSlot{}, fmt.Errorf("read flow slot %s: %w", key, err)
	}
	s := FlowSlot{Key: key, Revision: ent.Revision(), Created: ent.Created()}
	_ = json.Unmarshal(ent.Value(), &s.Holder) // unreadable: a holder of no job, freed by the reconciler
	return s, nil
}

// flagKey is the key that says limit and kd may have waiters: written
// before a waiter's record, removed (on its revision) by a release that
// finds none, so that a release with nobody waiting reads one key instead
// of listing.
func flagKey(limit, kd string) string { return "q." + limit + "." + kd }

// Wait records holder as waiting under key (WaiterKey of limit and kd); a
// second record of the same key is a no-op.
func (f *Flow) Wait(ctx context.Context, limit, kd, key string, holder FlowHolder) error {
	if _, err := f.kv.Put(ctx, flagKey(limit, kd), []byte("1")); err != nil {
		return fmt.Errorf("record flow waiter %s: %w", key, err)
	}
	data, _ := json.Marshal(holder)
	if _, err := f.kv.Create(ctx, key, data); err != nil && !isRevisionConflict(err) {
		return fmt.Errorf("record flow waiter %s: %w", key, err)
	}
	return nil
}

// Unwait removes a waiter's record (it was admitted, or its job ended).
func (f *Flow) Unwait(ctx context.Context, key string) error {
	if err := f.kv.Delete(ctx, key); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("remove flow waiter %s: %w", key, err)
	}
	return nil
}

// FlowRelease is what releasing a slot did: To is the waiter it went to
// (nil: none waited); Handed says the slot itself was handed over (false:
// the slot was freed and To should try again, a waiter that came while it
// was being freed).
type FlowRelease struct {
	To     *FlowHolder
	Handed bool
}

// Release frees the slot under key if holderJob's dispatch still holds
// it: see ReleaseSlot. A slot held by another job, or free, is left alone.
func (f *Flow) Release(ctx context.Context, key, holderJob string) (FlowRelease, error) {
	s, err := f.Slot(ctx, key)
	if errors.Is(err, schemas.ErrNotFound) {
		return FlowRelease{}, nil
	}
	if err != nil {
		return FlowRelease{}, err
	}
	if s.Holder.Job != holderJob {
		return FlowRelease{}, nil
	}
	return f.ReleaseSlot(ctx, s)
}

// ReleaseSlot frees s, whoever holds it: it is handed over to the first
// waiter of its limit and key (an update on the revision read, whose
// record is then removed), or, when none waits, deleted on that revision.
// A waiter that recorded itself while the slot was being deleted is
// returned to be woken (Handed false). A lost race (the slot changed
// meanwhile) leaves it: whoever changed it owns it.
func (f *Flow) ReleaseSlot(ctx context.Context, s FlowSlot) (FlowRelease, error) {
	limit, kd, ok := SlotOf(s.Key)
	if !ok {
		return FlowRelease{}, fmt.Errorf("release flow slot %q: not a slot key", s.Key)
	}
	for try := 0; try < 4; try++ {
		flag, err := f.kv.Get(ctx, flagKey(limit, kd))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			break
		}
		if err != nil {
			return FlowRelease{}, fmt.Errorf("release flow slot %s: %w", s.Key, err)
		}
		h, others, err := f.claimWaiter(ctx, limit, kd, SlotIndex(s.Key))
		if err != nil {
			return FlowRelease{}, err
		}
		if h == nil && others {
			break // they wait for a slot of a smaller limit than this one's index: it is freed
		}
		if h == nil {
			// Nobody waits: take the flag down, unless a waiter put it up
			// again meanwhile (then look again).
			err := f.kv.Delete(ctx, flagKey(limit, kd), jetstream.LastRevision(flag.Revision()))
			if err == nil || errors.Is(err, jetstream.ErrKeyNotFound) {
				break
			}
			if !isRevisionConflict(err) {
				return FlowRelease{}, fmt.Errorf("release flow slot %s: %w", s.Key, err)
			}
			continue
		}
		h.At, h.Seq = time.Now().UTC(), 0
		data, _ := json.Marshal(h)
		if _, err := f.kv.Update(ctx, s.Key, data, s.Revision); err != nil {
			if isRevisionConflict(err) {
				// The slot changed under us; the waiter claimed must try
				// again on its own.
				return FlowRelease{To: h}, nil
			}
			return FlowRelease{To: h}, fmt.Errorf("hand flow slot %s to %s: %w", s.Key, h.MsgID, err)
		}
		return FlowRelease{To: h, Handed: true}, nil
	}
	if err := f.kv.Delete(ctx, s.Key, jetstream.LastRevision(s.Revision)); err != nil {
		if isRevisionConflict(err) || errors.Is(err, jetstream.ErrKeyNotFound) {
			return FlowRelease{}, nil
		}
		return FlowRelease{}, fmt.Errorf("release flow slot %s: %w", s.Key, err)
	}
	// A waiter that recorded itself after the look and tried the slot
	// before the delete would wait for nobody: wake it to try again.
	if _, err := f.kv.Get(ctx, flagKey(limit, kd)); err == nil {
		h, _, _, err := f.firstWaiter(ctx, limit, kd, false, -1)
		if err != nil || h == nil {
			return FlowRelease{}, err
		}
		return FlowRelease{To: h}, nil
	}
	return FlowRelease{}, nil
}

// claimWaiter takes the waiter of limit and kd first in line (highest
// priority, then oldest) that may take slot index idx out of the line,
// removing its record on the revision read, so that two releases never
// hand their slots to one waiter; nil when none waits. others reports
// waiters passed over because their limit is at most idx.
func (f *Flow) claimWaiter(ctx context.Context, limit, kd string, idx int) (h *FlowHolder, others bool, err error) {
	h, _, others, err = f.firstWaiter(ctx, limit, kd, true, idx)
	return h, others, err
}

// firstWaiter returns the waiter first in line whose limit admits slot
// index idx (-1: any) and its key; with claim, its record removed on the
// revision read (one removed meanwhile is passed over). nil when none;
// others reports waiters passed over for their limit.
func (f *Flow) firstWaiter(ctx context.Context, limit, kd string, claim bool, idx int) (*FlowHolder, string, bool, error) {
	waiters, err := f.keys(ctx, waiterPrefix(limit, kd)+">")
	if err != nil {
		return nil, "", false, err
	}
	slices.Sort(waiters)
	others := false
	for _, wk := range waiters {
		ent, err := f.kv.Get(ctx, wk)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue // admitted or gone meanwhile
		}
		if err != nil {
			return nil, "", others, fmt.Errorf("read flow waiter %s: %w", wk, err)
		}
		var h FlowHolder
		if json.Unmarshal(ent.Value(), &h) != nil {
			_ = f.Unwait(ctx, wk)
			continue
		}
		if idx >= 0 && h.Max > 0 && idx >= h.Max {
			others = true
			continue
		}
		if claim {
			if err := f.kv.Delete(ctx, wk, jetstream.LastRevision(ent.Revision())); err != nil {
				if isRevisionConflict(err) || errors.Is(err, jetstream.ErrKeyNotFound) {
					continue // another release claimed it
				}
				return nil, "", others, fmt.Errorf("claim flow waiter %s: %w", wk, err)
			}
		}
		return &h, wk, others, nil
	}
	return nil, "", others, nil
}

// Slots calls fn with every slot held, of every limit; fn returns false to
// stop. Its cost follows the slots in use, not the jobs that ever ran.
func (f *Flow) Slots(ctx context.Context, fn func(FlowSlot) bool) error {
	keys, err := f.keys(ctx, "c.>")
	if err != nil {
		return err
	}
	for _, k := range keys {
		s, err := f.Slot(ctx, k)
		if errors.Is(err, schemas.ErrNotFound) {
			continue
		}
		if err != nil {
			return err
		}
		if !fn(s) {
			return nil
		}
	}
	return nil
}

// Waiters calls fn with every waiter's key and record; fn returns false
// to stop.
func (f *Flow) Waiters(ctx context.Context, fn func(key string, h FlowHolder) bool) error {
	keys, err := f.keys(ctx, "w.>")
	if err != nil {
		return err
	}
	slices.Sort(keys)
	for _, k := range keys {
		ent, err := f.kv.Get(ctx, k)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			return fmt.Errorf("read flow waiter %s: %w", k, err)
		}
		var h FlowHolder
		_ = json.Unmarshal(ent.Value(), &h)
		if !fn(k, h) {
			return nil
		}
	}
	return nil
}

// keys lists the keys under filter; none is not an error.
func (f *Flow) keys(ctx context.Context, filter string) ([]string, error) {
	l, err := f.kv.ListKeysFiltered(ctx, filter)
	if err != nil {
		if errors.Is(err, jetstream.ErrNoKeysFound) {
			return nil, nil
		}
		return nil, fmt.Errorf("list flow keys %s: %w", filter, err)
	}
	defer func() { _ = l.Stop() }()
	var out []string
	for k := range l.Keys() {
		out = append(out, k)
	}
	return out, nil
}

// Count admits one dispatch (id, its message id) into the rate window of
// limit and kd that holds now: windows of period aligned on the Unix
// epoch, at most n dispatches in each. It returns whether it was admitted,
// the window (its count after admission, or the full count) and the
// window's end. An id counted in the window already is admitted again
// without counting (an engine deciding again after a conflict). Every
// write is a compare-and-swap; a lost race reads and tries again.
func (f *Flow) Count(ctx context.Context, limit, kd string, n int, period time.Duration, now time.Time, id string) (bool, FlowWindow, error) {
	key := "r." + limit + "." + kd
	start := now.Truncate(period).UTC()
	for try := 0; try < 16; try++ {
		ent, err := f.kv.Get(ctx, key)
		var w FlowWindow
		var rev uint64
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
		case err != nil:
			return false, w, fmt.Errorf("read rate window %s: %w", key, err)
		default:
			rev = ent.Revision()
			_ = json.Unmarshal(ent.Value(), &w)
		}
		if !w.Start.Equal(start) || w.Period != period.Milliseconds() {
			if w.Start.After(start) && w.Period == period.Milliseconds() {
				// Another engine's clock is ahead: count in its window.
				start = w.Start
			} else {
				w = FlowWindow{Start: start, Period: period.Milliseconds()}
			}
		}
		if slices.Contains(w.IDs, id) {
			return true, w, nil
		}
		if w.Count >= n {
			return false, w, nil
		}
		w.Count++
		if len(w.IDs) < maxWindowIDs {
			w.IDs = append(w.IDs, id)
		}
		data, _ := json.Marshal(w)
		if rev == 0 {
			_, err = f.kv.Create(ctx, key, data)
		} else {
			_, err = f.kv.Update(ctx, key, data, rev)
		}
		if err == nil {
			return true, w, nil
		}
		if !isRevisionConflict(err) {
			return false, w, fmt.Errorf("count in rate window %s: %w", key, err)
		}
	}
	return false, FlowWindow{}, fmt.Errorf("count in rate window %s: it kept changing", key)
}

// Window reads the current rate window of limit and kd (tests, status).
func (f *Flow) Window(ctx context.Context, limit, kd string) (FlowWindow, error) {
	var w FlowWindow
	ent, err := f.kv.Get(ctx, "r."+limit+"."+kd)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return w, fmt.Errorf("rate window %s.%s: %w", limit, kd, schemas.ErrNotFound)
	}
	if err != nil {
		return w, fmt.Errorf("read rate window %s.%s: %w", limit, kd, err)
	}
	err = json.Unmarshal(ent.Value(), &w)
	return w, err
}
