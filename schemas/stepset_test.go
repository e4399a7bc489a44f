package schemas

import (
	"math/rand/v2"
	"testing"
)

func TestStepSetMatchesAMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 200; round++ {
		var s StepSet
		want := map[int]bool{}
		for op := 0; op < 60; op++ {
			i := rng.IntN(40)
			if rng.IntN(3) == 0 {
				s = s.Without(i)
				delete(want, i)
			} else {
				s = s.With(i)
				want[i] = true
			}
			if err := s.Validate(); err != nil {
				t.Fatalf("after op %d: %v", op, err)
			}
			if s.Len() != len(want) {
				t.Fatalf("%q: Len %d, want %d", s, s.Len(), len(want))
			}
			for j := 0; j < 40; j++ {
				if s.Has(j) != want[j] {
					t.Fatalf("%q: Has(%d) = %v, want %v", s, j, s.Has(j), want[j])
				}
			}
		}
	}
}

func TestStepSetEncoding(t *testing.T) {
	var s StepSet
	for i := 0; i < 1000; i++ {
		s = s.With(i)
	}
	if s != "0-999" {
		t.Errorf("a chain of 1000 steps done = %q, want \"0-999\"", s)
	}
	if got := s.Without(500).Without(0); got != "1-499,501-999" {
		t.Errorf("Without = %q", got)
	}
	if got := StepSet("").With(3).With(1).With(2); got != "1-3" {
		t.Errorf("With out of order = %q, want 1-3", got)
	}
}

func TestStepSetRejectsMalformed(t *testing.T) {
	for _, bad := range []StepSet{"x", "1-", "-1", "3-1", "1-1", "01", "2,1", "1,2", "1-3,3-5", "1-3,4", " 1", "1,,2", "+1"} {
		if err := bad.Validate(); err == nil {
			t.Errorf("%q: valid, want an error", bad)
		}
		if bad.Has(1) || bad.Len() != 0 {
			t.Errorf("%q: a malformed set must read as empty", bad)
		}
	}
	for _, good := range []StepSet{"", "0", "1-3", "0,2,4-9", "1-3,5"} {
		if err := good.Validate(); err != nil {
			t.Errorf("%q: %v", good, err)
		}
	}
}
