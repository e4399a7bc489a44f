package engine

import (
	"sync"
	"time"
)

// quietLog says whether a message about a key may be logged again: at
// most once per interval per key, so that a job stuck on the same problem
// does not flood the log on every redelivery. Safe for concurrent use.
type quietLog struct {
	mu       sync.Mutex
	every    time.Duration
	last     map[string]time.Time
	lastTrim time.Time
}

func newQuietLog(every time.Duration) *quietLog {
	return &quietLog{every: every, last: map[string]time.Time{}}
}

// allow reports whether key may be logged now, and records it if so.
func (q *quietLog) allow(key string, now time.Time) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if now.Sub(q.lastTrim) > q.every {
		for k, t := range q.last {
			if now.Sub(t) > q.every {
				delete(q.last, k)
			}
		}
		q.lastTrim = now
	}
	if t, ok := q.last[key]; ok && now.Sub(t) < q.every {
		return false
	}
	q.last[key] = now
	return true
}
