package schemas

import (
	"fmt"
	"strconv"
	"strings"
)

// StepSet is a set of step indexes (positions in a job's pinned
// definition), written as sorted, disjoint ranges: "0-9,12,15-20". The
// empty string is the empty set. A chain of a thousand steps done is
// "0-999", which is why checkpoints use it for steps that need no record
// of their own.
//
// Methods treat a malformed value as empty; Validate reports it.
type StepSet string

type stepSpan struct{ lo, hi int }

func (s StepSet) spans() ([]stepSpan, error) {
	if s == "" {
		return nil, nil
	}
	parts := strings.Split(string(s), ",")
	out := make([]stepSpan, 0, len(parts))
	last := -2
	for _, p := range parts {
		lo, hi, isRange := strings.Cut(p, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 || lo != strconv.Itoa(a) {
			return nil, fmt.Errorf("step set %q: %q is not a step index", string(s), lo)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || hi != strconv.Itoa(b) || b <= a {
				return nil, fmt.Errorf("step set %q: %q is not a range of step indexes", string(s), p)
			}
		}
		if a <= last+1 {
			return nil, fmt.Errorf("step set %q: ranges out of order or touching at %q", string(s), p)
		}
		out = append(out, stepSpan{a, b})
		last = b
	}
	return out, nil
}

func joinSpans(sp []stepSpan) StepSet {
	var b strings.Builder
	for i, x := range sp {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(x.lo))
		if x.hi > x.lo {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(x.hi))
		}
	}
	return StepSet(b.String())
}

// Validate returns an error naming what is malformed in s.
func (s StepSet) Validate() error {
	_, err := s.spans()
	return err
}

// Has reports whether step index i is in s.
func (s StepSet) Has(i int) bool {
	sp, _ := s.spans()
	for _, x := range sp {
		if i >= x.lo && i <= x.hi {
			return true
		}
	}
	return false
}

// Len is the number of step indexes in s.
func (s StepSet) Len() int {
	sp, _ := s.spans()
	n := 0
	for _, x := range sp {
		n += x.hi - x.lo + 1
	}
	return n
}

// With returns s with step index i added (i >= 0).
func (s StepSet) With(i int) StepSet {
	if i < 0 || s.Has(i) {
		return s
	}
	sp, _ := s.spans()
	out := make([]stepSpan, 0, len(sp)+1)
	inserted := false
	for _, x := range sp {
		if !inserted && i < x.lo {
			out = append(out, stepSpan{i, i})
			inserted = true
		}
		out = append(out, x)
	}
	if !inserted {
		out = append(out, stepSpan{i, i})
	}
	// Merge ranges that now touch.
	merged := out[:1]
	for _, x := range out[1:] {
		if last := &merged[len(merged)-1]; x.lo <= last.hi+1 {
			last.hi = max(last.hi, x.hi)
			continue
		}
		merged = append(merged, x)
	}
	return joinSpans(merged)
}

// Without returns s with step index i removed.
func (s StepSet) Without(i int) StepSet {
	if !s.Has(i) {
		return s
	}
	sp, _ := s.spans()
	out := make([]stepSpan, 0, len(sp)+1)
	for _, x := range sp {
		switch {
		case i < x.lo || i > x.hi:
			out = append(out, x)
		case x.lo == x.hi:
		case i == x.lo:
			out = append(out, stepSpan{x.lo + 1, x.hi})
		case i == x.hi:
			out = append(out, stepSpan{x.lo, x.hi - 1})
		default:
			out = append(out, stepSpan{x.lo, i - 1}, stepSpan{i + 1, x.hi})
		}
	}
	return joinSpans(out)
}
