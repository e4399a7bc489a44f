package engine

import (
	"sync"
	"sync/atomic"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/waymark-dev/waymark/schemas"
)

// cached is a checkpoint as this engine last read or wrote it.
type cached struct {
	cp   *schemas.Checkpoint
	rev  uint64
	size int // bytes of its encoding
	// published is the highest checkpoint sequence whose history events
	// are known to be stored: this engine's own publication was
	// acknowledged, or the history stream's last message said so.
	published atomic.Uint64
	// flushing, when not nil, is closed (by doneFlushing) once this
	// engine's publication of cp's events has been acknowledged or has
	// failed (see published).
	flushing chan struct{}
	once     sync.Once
}

// knownPublished reports whether nothing of cp's outbox is in doubt: it
// was not to be published (cp.Flush is false: the next checkpoint carries
// it), or it is known to be stored.
func (c *cached) knownPublished() bool { return !c.cp.Flush || c.published.Load() >= c.cp.Seq }

// doneFlushing closes flushing, once.
func (c *cached) doneFlushing() {
	if c.flushing != nil {
		c.once.Do(func() { close(c.flushing) })
	}
}

// checkpointCache holds checkpoints by job, least recently used first out,
// within a budget of bytes. Safe for concurrent use.
type checkpointCache struct {
	mu     sync.Mutex
	lru    *simplelru.LRU[string, *cached]
	bytes  int
	budget int
}

func newCheckpointCache(budget int) *checkpointCache {
	c := &checkpointCache{budget: budget}
	// The entry count is bounded by the byte budget; the LRU's own bound is
	// only a backstop.
	c.lru, _ = simplelru.NewLRU[string, *cached](1<<30, func(_ string, v *cached) { c.bytes -= v.size })
	return c
}

func (c *checkpointCache) get(job string) (*cached, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Get(job)
}

func (c *checkpointCache) peek(job string) (*cached, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Peek(job)
}

func (c *checkpointCache) add(job string, v *cached) {
	if c.budget <= 0 || v.size > c.budget {
		c.remove(job)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.lru.Peek(job); ok {
		c.bytes -= old.size // Add replaces in place, without the eviction callback
	}
	c.lru.Add(job, v)
	c.bytes += v.size
	for c.bytes > c.budget {
		if _, _, ok := c.lru.RemoveOldest(); !ok {
			break
		}
	}
}

func (c *checkpointCache) remove(job string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lru.Remove(job)
}

func (c *checkpointCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len()
}
