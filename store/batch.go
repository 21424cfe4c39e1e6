package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// leaseBatcher pipelines heartbeats: callers queue their lease call and one goroutine sends
// whatever is queued as one pipeline. It never waits for a batch to fill, so a lone heartbeat costs
// one round trip as before; under load (thousands a second) many share one, which saves a write
// and a read on both sides per heartbeat and lets Redis read them together.
//
// A hung Redis must not hold every heartbeat behind one stuck pipeline: each pipeline is bounded by
// the store's call timeout; one that fails for want of Redis fails at once everything queued behind
// it (it would meet the same Redis); no caller waits longer than one timeout for its answer, queued
// or in flight; and calls whose callers gave up are not sent, so a Redis that comes back is not met
// with a backlog nobody waits for. (One pipeline in flight batches best: measured on two cores, four
// concurrent senders cut throughput by about a third.)
type leaseBatcher struct {
	rdb     redis.UniversalClient
	timeout time.Duration // < 0: unbounded
	queue   chan *leaseCall
	// stop ends run; done is closed when it has. The queue is never closed, so a call racing
	// Close cannot send on a closed channel.
	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
}

// ErrClosed is the answer of a Store after Close.
var ErrClosed = errors.New("store: closed (the broker is shutting down)")

type leaseCall struct {
	ctx  context.Context
	keys []string
	args []any
	res  []string
	err  error
	done chan struct{}
	gone atomic.Bool // the caller stopped waiting
}

// maxLeaseBatch bounds one pipeline.
const maxLeaseBatch = 256

func newLeaseBatcher(rdb redis.UniversalClient, timeout time.Duration) *leaseBatcher {
	b := &leaseBatcher{rdb: rdb, timeout: timeout, queue: make(chan *leaseCall, 4096), stop: make(chan struct{}), done: make(chan struct{})}
	// One sender per CPU's worth of work is not needed: the pipeline is the parallelism.
	go b.run()
	return b
}

// close stops the sender after the batch it is sending; calls still queued, and later ones, fail
// with ErrClosed.
func (b *leaseBatcher) close() {
	b.stopOnce.Do(func() { close(b.stop) })
	<-b.done
}

func (b *leaseBatcher) do(ctx context.Context, keys []string, args []any) ([]string, error) {
	c := &leaseCall{ctx: ctx, keys: keys, args: args, done: make(chan struct{})}
	var late <-chan time.Time
	if b.timeout > 0 {
		t := time.NewTimer(b.timeout)
		defer t.Stop()
		late = t.C
	}
	select {
	case b.queue <- c:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-late:
		return nil, b.tooLate()
	case <-b.done:
		return nil, ErrClosed
	}
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		c.gone.Store(true)
		return nil, ctx.Err()
	case <-late:
		// If it was sent already it may still land: a lease renewed although the caller heard
		// 503, which its retry would have done anyway.
		c.gone.Store(true)
		return nil, b.tooLate()
	case <-b.done:
		// run has ended: it either answered c before (c.done is closed) or never will.
		select {
		case <-c.done:
			return c.res, c.err
		default:
			return nil, ErrClosed
		}
	}
}

func (b *leaseBatcher) run() {
	defer close(b.done)
	batch := make([]*leaseCall, 0, maxLeaseBatch)
	for {
		var c *leaseCall
		select {
		case c = <-b.queue:
		case <-b.stop:
			return
		}
		batch = append(batch[:0], c)
	fill:
		for len(batch) < maxLeaseBatch {
			select {
			case c := <-b.queue:
				batch = append(batch, c)
			default:
				break fill
			}
		}
		b.send(batch)
	}
}

func (b *leaseBatcher) send(all []*leaseCall) {
	batch := all[:0]
	for _, c := range all {
		if c.gone.Load() {
			close(c.done)
			continue
		}
		batch = append(batch, c)
	}
	if len(batch) == 0 {
		return
	}
	ctx := context.Background()
	pipe := b.rdb.Pipeline()
	cmds := make([]*redis.Cmd, len(batch))
	for i, c := range batch {
		cmds[i] = leaseScript.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	if _, err := pipe.Exec(ctx); Unavailable(err) {
		b.failQueued(err)
	}
	// A Redis that lost its script cache (restarted, failed over, SCRIPT FLUSH) answers NOSCRIPT,
	// on a Cluster for the calls of one node only: send those again with the script itself, which
	// caches it again.
	var again redis.Pipeliner
	for i, c := range batch {
		if redis.HasErrorPrefix(cmds[i].Err(), "NOSCRIPT") {
			if again == nil {
				again = b.rdb.Pipeline()
			}
			cmds[i] = leaseScript.Eval(ctx, again, c.keys, c.args...)
		}
	}
	if again != nil {
		again.Exec(ctx)
	}
	for i, c := range batch {
		c.res, c.err = cmds[i].StringSlice()
		if c.err == nil && len(c.res) == 0 {
			c.err = errors.New("store: empty lease answer")
		}
		close(c.done)
	}
}

// failQueued answers err to every call queued now: they were waiting behind a pipeline that found
// Redis away.
func (b *leaseBatcher) failQueued(err error) {
	for {
		select {
		case c := <-b.queue:
			c.err = err
			close(c.done)
		default:
			return
		}
	}
}

func (b *leaseBatcher) tooLate() error {
	return fmt.Errorf("%w: no answer within %s", ErrUnavailable, b.timeout)
}
