package kv

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
)

// Atomic batch publish headers (ADR-50, nats-server 2.12+).
const (
	batchIDHeader     = "Nats-Batch-Id"
	batchSeqHeader    = "Nats-Batch-Sequence"
	batchCommitHeader = "Nats-Batch-Commit"
)

// MaxGroupCommit is the most messages one group commit carries; the
// server's limit is 1,000 per atomic batch (ADR-50).
const MaxGroupCommit = 500

// minGroupCommit is the fewest messages sent as an atomic batch; fewer go
// one by one. On an R1 file stream the server stages a batch in a store
// of its own, made for the batch (nats-server 2.15: about 1.3 ms of CPU),
// which pays for itself only against several fsyncs (0.2-0.4 ms each on
// the development machine; measured 2,450 steps/s with 2, 2,625 with 8).
const minGroupCommit = 8

// groupCommitTimeout bounds the wait for one commit's acknowledgement;
// past it every message of the commit has an unknown outcome.
const groupCommitTimeout = 10 * time.Second

// GroupCommitCounts is what a group committer has done since the store
// was opened: atomic batches committed and the messages they carried,
// messages sent alone (nothing else was waiting), and batches the server
// refused as a whole (their messages were sent again one by one).
type GroupCommitCounts struct {
	Batches, Batched, Alone, Refused uint64
}

// groupCommit writes messages to one stream as atomic batches (ADR-50),
// one commit in flight at a time: whatever is queued while a commit is
// under way goes in the next. On a file stream under sync always the
// server flushes a batch to disk with one fsync before it acknowledges
// (nats-server PR 8539), so many writers share an fsync: group commit, as
// databases do it. A message alone is sent as a plain publish. A batch
// the server refuses as a whole (one expected revision no longer current,
// too many batches in flight) is sent again one message at a time, so
// only the message at fault fails. No goroutine outlives its queue: the
// loop that sends commits ends when nothing waits.
type groupCommit struct {
	js     jetstream.JetStream
	stream string

	mu      sync.Mutex
	queue   []*committed
	running bool

	batches, batched, alone, refused atomic.Uint64
}

// committed is one message given to a group commit, and its outcome once
// done is closed: the stream sequence it was stored at, or the error of
// its own publish, or an unknown outcome.
type committed struct {
	msg  *nats.Msg
	done chan struct{}
	seq  uint64
	dup  bool // stored before under its Nats-Msg-Id (sent alone only)
	err  error
	// unknown: the commit's acknowledgement never came; the message may
	// or may not be stored.
	unknown bool
	// ok and errc answer as a jetstream.PubAckFuture (Publish).
	ok   chan *jetstream.PubAck
	errc chan error
	name string // the stream, for the acknowledgement
}

// Ok, Err and Msg make a committed message a jetstream.PubAckFuture.
func (c *committed) Ok() <-chan *jetstream.PubAck { return c.ok }
func (c *committed) Err() <-chan error            { return c.errc }
func (c *committed) Msg() *nats.Msg               { return c.msg }

// settle closes done and answers the future.
func (c *committed) settle() {
	close(c.done)
	if c.err != nil {
		c.errc <- c.err
		return
	}
	c.ok <- &jetstream.PubAck{Stream: c.name, Sequence: c.seq, Duplicate: c.dup}
}

// add queues msg for the next commit.
func (g *groupCommit) add(msg *nats.Msg) *committed {
	c := &committed{msg: msg, done: make(chan struct{}), ok: make(chan *jetstream.PubAck, 1), errc: make(chan error, 1), name: g.stream}
	g.mu.Lock()
	g.queue = append(g.queue, c)
	start := !g.running
	g.running = true
	g.mu.Unlock()
	if start {
		go g.loop()
	}
	return c
}

// counts returns what the committer has done.
func (g *groupCommit) counts() GroupCommitCounts {
	return GroupCommitCounts{Batches: g.batches.Load(), Batched: g.batched.Load(), Alone: g.alone.Load(), Refused: g.refused.Load()}
}

// loop sends one commit after another until the queue is empty.
func (g *groupCommit) loop() {
	for {
		g.mu.Lock()
		n := min(len(g.queue), MaxGroupCommit)
		if n == 0 {
			g.running = false
			g.mu.Unlock()
			return
		}
		take := g.queue[:n:n]
		g.queue = g.queue[n:]
		if len(g.queue) == 0 {
			g.queue = nil
		}
		g.mu.Unlock()
		g.commit(take)
	}
}

// commit sends cs as one atomic batch (or alone) and settles each.
func (g *groupCommit) commit(cs []*committed) {
	defer func() {
		for _, c := range cs {
			c.settle()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), groupCommitTimeout)
	defer cancel()
	if len(cs) < minGroupCommit {
		g.alone.Add(uint64(len(cs)))
		g.sendAlone(ctx, cs)
		return
	}
	id := nuid.Next()
	nc := g.js.Conn()
	var sendErr error
	var commit jetstream.PubAckFuture
	for i, c := range cs {
		m := copyMsg(c.msg)
		m.Header.Set(batchIDHeader, id)
		m.Header.Set(batchSeqHeader, strconv.Itoa(i+1))
		if i < len(cs)-1 {
			// Messages of one connection reach the server in order; only
			// the commit is answered.
			if sendErr = nc.PublishMsg(m); sendErr != nil {
				break
			}
			continue
		}
		m.Header.Set(batchCommitHeader, "1")
		commit, sendErr = g.js.PublishMsgAsync(m)
	}
	if sendErr != nil {
		// Nothing was committed: the server drops a batch without its
		// commit after its timeout.
		g.sendAlone(ctx, cs)
		return
	}
	select {
	case ack := <-commit.Ok():
		// Stored one after another, in batch order (the stream is held
		// for the commit).
		g.batches.Add(1)
		g.batched.Add(uint64(len(cs)))
		for i, c := range cs {
			c.seq = ack.Sequence - uint64(len(cs)-1-i)
		}
	case err := <-commit.Err():
		var apiErr *jetstream.APIError
		if !errors.As(err, &apiErr) {
			g.unknown(cs, err)
			return
		}
		// Refused as a whole: nothing was stored.
		g.refused.Add(1)
		g.sendAlone(ctx, cs)
	case <-ctx.Done():
		g.unknown(cs, ctx.Err())
	}
}

// sendAlone publishes each message on its own, all in flight at once,
// and waits for every acknowledgement.
func (g *groupCommit) sendAlone(ctx context.Context, cs []*committed) {
	fs := make([]jetstream.PubAckFuture, len(cs))
	for i, c := range cs {
		if fs[i], c.err = g.js.PublishMsgAsync(c.msg); c.err != nil {
			fs[i] = nil
		}
	}
	for i, c := range cs {
		if fs[i] == nil {
			continue
		}
		select {
		case ack := <-fs[i].Ok():
			c.seq, c.dup = ack.Sequence, ack.Duplicate
		case err := <-fs[i].Err():
			c.err = err
		case <-ctx.Done():
			c.err, c.unknown = ctx.Err(), true
		}
	}
}

func (g *groupCommit) unknown(cs []*committed, err error) {
	for _, c := range cs {
		c.err, c.unknown = fmt.Errorf("group commit: %w", err), true
	}
}

// copyMsg returns m with its own header, for the batch's headers.
func copyMsg(m *nats.Msg) *nats.Msg {
	c := nats.NewMsg(m.Subject)
	c.Data = m.Data
	for k, vs := range m.Header {
		c.Header[k] = vs
	}
	return c
}
