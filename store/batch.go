package store

import (
	"context"
	"errors"

	"github.com/redis/go-redis/v9"
)

// leaseBatcher pipelines heartbeats: callers queue their lease call and one goroutine sends
// whatever is queued as one pipeline. It never waits for a batch to fill, so a lone heartbeat costs
// one round trip as before; under load (thousands a second) many share one, which saves a write
// and a read on both sides per heartbeat and lets Redis read them together.
type leaseBatcher struct {
	rdb   redis.UniversalClient
	queue chan *leaseCall
}

type leaseCall struct {
	ctx  context.Context
	keys []string
	args []any
	res  []string
	err  error
	done chan struct{}
}

// maxLeaseBatch bounds one pipeline.
const maxLeaseBatch = 256

func newLeaseBatcher(rdb redis.UniversalClient) *leaseBatcher {
	b := &leaseBatcher{rdb: rdb, queue: make(chan *leaseCall, 4096)}
	// One sender per CPU's worth of work is not needed: the pipeline is the parallelism.
	go b.run()
	return b
}

func (b *leaseBatcher) do(ctx context.Context, keys []string, args []any) ([]string, error) {
	c := &leaseCall{ctx: ctx, keys: keys, args: args, done: make(chan struct{})}
	select {
	case b.queue <- c:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (b *leaseBatcher) run() {
	batch := make([]*leaseCall, 0, maxLeaseBatch)
	for c := range b.queue {
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

func (b *leaseBatcher) send(batch []*leaseCall) {
	ctx := context.Background()
	pipe := b.rdb.Pipeline()
	cmds := make([]*redis.Cmd, len(batch))
	for i, c := range batch {
		cmds[i] = leaseScript.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	pipe.Exec(ctx)
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
