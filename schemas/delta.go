package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// A state delta is what one transition changed in a job's state (a JSON
// object), carried by the transition's first history event (HistoryData
// State) so that the state at any sequence can be rebuilt from the
// history: {"set": {member: value, ...}, "unset": [member, ...]}. A value
// longer than MaxDeltaMember bytes is kept in the value store and set as
// a reference (ValueRef), as large state members are.

// MaxDeltaMember is the longest member value a delta carries inline, in
// bytes.
const MaxDeltaMember = 1 << 10

// StateDelta is the JSON form of a state delta.
type StateDelta struct {
	Set   map[string]json.RawMessage `json:"set,omitempty"`
	Unset []string                   `json:"unset,omitempty"`
}

// DiffState returns the delta from base to next, both JSON objects, or
// nil when they are equal; put stores a value longer than MaxDeltaMember
// and returns its reference. Errors: a state that is not an object.
func DiffState(base, next json.RawMessage, put func([]byte) ValueRef) (json.RawMessage, error) {
	if bytes.Equal(base, next) {
		return nil, nil
	}
	bm, err := objectMembers(base)
	if err != nil {
		return nil, fmt.Errorf("state delta: base: %w", err)
	}
	nm, err := objectMembers(next)
	if err != nil {
		return nil, fmt.Errorf("state delta: next: %w", err)
	}
	had := make(map[string][]byte, len(bm))
	for _, m := range bm {
		had[m.name] = m.value
	}
	d := StateDelta{}
	seen := make(map[string]bool, len(nm))
	for _, m := range nm {
		seen[m.name] = true
		if old, ok := had[m.name]; ok && bytes.Equal(old, m.value) {
			continue
		}
		v := m.value
		if len(v) > MaxDeltaMember {
			if _, isRef := ParseValueRef(v); !isRef {
				var c bytes.Buffer
				if json.Compact(&c, v) == nil {
					v = c.Bytes()
				}
				v = put(v).JSON()
			}
		}
		if d.Set == nil {
			d.Set = map[string]json.RawMessage{}
		}
		d.Set[m.name] = v
	}
	for _, m := range bm {
		if !seen[m.name] {
			d.Unset = append(d.Unset, m.name)
		}
	}
	if d.Set == nil && d.Unset == nil {
		return nil, nil // the same members, spelled differently
	}
	return Marshal(d)
}

// ApplyDelta returns state with delta applied: members set (in the
// delta's order after those kept) and unset. Errors: a state or delta
// that does not decode.
func ApplyDelta(state, delta json.RawMessage) (json.RawMessage, error) {
	var d StateDelta
	if err := json.Unmarshal(delta, &d); err != nil {
		return nil, fmt.Errorf("apply state delta: %w", err)
	}
	ms, err := objectMembers(state)
	if err != nil {
		return nil, fmt.Errorf("apply state delta: %w", err)
	}
	drop := map[string]bool{}
	for _, k := range d.Unset {
		drop[k] = true
	}
	var b bytes.Buffer
	b.WriteByte('{')
	first := true
	write := func(k string, v []byte) {
		if !first {
			b.WriteByte(',')
		}
		first = false
		kb, _ := Marshal(k)
		b.Write(kb)
		b.WriteByte(':')
		b.Write(v)
	}
	for _, m := range ms {
		if drop[m.name] {
			continue
		}
		if v, ok := d.Set[m.name]; ok {
			write(m.name, v)
			delete(d.Set, m.name)
			continue
		}
		write(m.name, m.value)
	}
	for _, k := range sortedKeys(d.Set) {
		write(k, d.Set[k])
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

type namedMember struct {
	name  string
	value []byte
}

// objectMembers returns the top-level members of obj, in order.
func objectMembers(obj json.RawMessage) ([]namedMember, error) {
	s := scanner{b: obj}
	ms, _, err := s.members(s.ws(0))
	if err != nil {
		return nil, err
	}
	out := make([]namedMember, 0, len(ms))
	for _, m := range ms {
		var name string
		key := obj[m.kStart:m.kEnd]
		if err := json.Unmarshal(key, &name); err != nil {
			return nil, fmt.Errorf("member name %s: %w", key, err)
		}
		out = append(out, namedMember{name: name, value: obj[m.vStart:m.vEnd]})
	}
	return out, nil
}
