package cliflags

import (
	"testing"
	"time"
)

func TestReconnectDelayBacksOff(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		attempt int
		want    time.Duration // before jitter
	}{
		{1, 250 * time.Millisecond}, {2, 500 * time.Millisecond}, {3, time.Second}, {4, 2 * time.Second},
		{5, 4 * time.Second}, {6, 5 * time.Second}, {40, 5 * time.Second}, {0, 5 * time.Second}, {-3, 5 * time.Second},
	} {
		for range 50 {
			got := ReconnectDelay(tc.attempt)
			if got > tc.want || got < tc.want*4/5 {
				t.Fatalf("ReconnectDelay(%d) = %v, want within [%v, %v]", tc.attempt, got, tc.want*4/5, tc.want)
			}
		}
	}
}
