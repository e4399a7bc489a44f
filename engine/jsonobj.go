package engine

import (
	"bytes"
	"encoding/json"
	"errors"
)

// State updates work on the JSON text: a step's output is spliced into the
// state's top-level object without decoding the rest of it, so a step that
// adds one small key to a large state costs one pass over the bytes, not a
// decode and an encode. Inputs must be valid JSON (the engine validates
// outputs before they get here, and the state is only ever built here or
// from a validated input).

var errNotObject = errors.New("not a JSON object")

// member is one top-level member of an object: the raw key (with quotes)
// and the raw value.
type member struct {
	key, value []byte
}

// members returns the top-level members of a JSON object, in order.
func members(obj []byte) ([]member, error) {
	i := skipWS(obj, 0)
	if i >= len(obj) || obj[i] != '{' {
		return nil, errNotObject
	}
	i = skipWS(obj, i+1)
	var out []member
	if i < len(obj) && obj[i] == '}' {
		return out, nil
	}
	for i < len(obj) {
		if obj[i] != '"' {
			return nil, errNotObject
		}
		kEnd, err := skipString(obj, i)
		if err != nil {
			return nil, err
		}
		key := obj[i:kEnd]
		i = skipWS(obj, kEnd)
		if i >= len(obj) || obj[i] != ':' {
			return nil, errNotObject
		}
		i = skipWS(obj, i+1)
		vEnd, err := skipValue(obj, i)
		if err != nil {
			return nil, err
		}
		out = append(out, member{key: key, value: obj[i:vEnd]})
		i = skipWS(obj, vEnd)
		if i < len(obj) && obj[i] == ',' {
			i = skipWS(obj, i+1)
			continue
		}
		if i < len(obj) && obj[i] == '}' {
			return out, nil
		}
		return nil, errNotObject
	}
	return nil, errNotObject
}

// setMembers returns state with each of set's members replacing the member
// of the same key, or appended when absent. Keys compare by their decoded
// value.
func setMembers(state []byte, set []member) ([]byte, error) {
	cur, err := members(state)
	if err != nil {
		return nil, err
	}
	replaced := make([]bool, len(set))
	out := make([]byte, 0, len(state)+64)
	out = append(out, '{')
	first := true
	add := func(k, v []byte) {
		if !first {
			out = append(out, ',')
		}
		first = false
		out = append(out, k...)
		out = append(out, ':')
		out = append(out, v...)
	}
	for _, m := range cur {
		v := m.value
		for j, s := range set {
			if sameKey(m.key, s.key) {
				v, replaced[j] = s.value, true
			}
		}
		add(m.key, v)
	}
	for j, s := range set {
		if replaced[j] {
			continue
		}
		dup := false // a key given twice in set: the last wins, once
		for k := j + 1; k < len(set); k++ {
			dup = dup || sameKey(s.key, set[k].key)
		}
		if !dup {
			add(s.key, s.value)
		}
	}
	return append(out, '}'), nil
}

func sameKey(a, b []byte) bool {
	if bytes.Equal(a, b) {
		return true
	}
	if bytes.IndexByte(a, '\\') < 0 && bytes.IndexByte(b, '\\') < 0 {
		return false
	}
	var x, y string
	return json.Unmarshal(a, &x) == nil && json.Unmarshal(b, &y) == nil && x == y
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\r' || b[i] == '\t') {
		i++
	}
	return i
}

// skipString returns the index after the string starting at b[i] == '"'.
func skipString(b []byte, i int) (int, error) {
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			j++
		case '"':
			return j + 1, nil
		}
	}
	return 0, errNotObject
}

// skipValue returns the index after the JSON value starting at b[i].
func skipValue(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errNotObject
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, err := skipString(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, errNotObject
	}
	j := i // number, true, false, null
	for j < len(b) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ' ' && b[j] != '\n' && b[j] != '\r' && b[j] != '\t' {
		j++
	}
	if j == i {
		return 0, errNotObject
	}
	return j, nil
}
