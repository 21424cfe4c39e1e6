package server

import (
	"context"
	"fmt"
	"sync"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/protocol"
)

// What a dataplane request holds of the broker's shared resources (heavy slots, exec output
// budget) and how each is given back exactly once. The byte queue in front of each connection's
// writer is in dataplane_conn.go (charge, enqueue).

// hold is what one request holds of the broker's shared resources (heavy slots, exec output
// budget), from when it takes them until its answer is written to the client, dropped, or left in
// the queue when the connection ends: each is taken once and given back once, by release. Only the
// request's goroutine adds to it, before it hands the answer to the writer.
type hold struct {
	mu       sync.Mutex
	releases []func()
	released bool
}

// add records what to give back; if the hold was released already, it is given back at once.
func (h *hold) add(release func()) {
	h.mu.Lock()
	if h.released {
		h.mu.Unlock()
		release()
		return
	}
	h.releases = append(h.releases, release)
	h.mu.Unlock()
}

// release gives back everything held, once; later calls do nothing.
func (h *hold) release() {
	h.mu.Lock()
	list := h.releases
	h.releases, h.released = nil, true
	h.mu.Unlock()
	for _, f := range list {
		f()
	}
}

// holdHeavy takes a heavy slot for req on this connection and, when broker is set, one broker-wide
// (within the org's share); they go with the request's answer and are given back when it is
// written or dropped. With wait it waits for them (held is false only with ctx's error); without,
// it takes them only if both are free now, and otherwise takes nothing.
func (c *dpConn) holdHeavy(ctx context.Context, req *request, broker, wait bool) (held bool, err error) {
	if !wait {
		select {
		case c.heavy <- struct{}{}:
		default:
			return false, nil
		}
		if broker && !c.s.dpHeavy.tryAcquire(c.org, 1) {
			<-c.heavy
			return false, nil
		}
		req.hold.add(func() { <-c.heavy })
		if broker {
			req.hold.add(func() { c.s.dpHeavy.release(c.org, 1) })
		}
		return true, nil
	}
	select {
	case c.heavy <- struct{}{}:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	req.hold.add(func() { <-c.heavy })
	if !broker {
		return true, nil
	}
	if err := c.s.dpHeavy.acquire(ctx, c.org, 1); err != nil {
		return false, err
	}
	req.hold.add(func() { c.s.dpHeavy.release(c.org, 1) })
	return true, nil
}

// execOutput is what one non-streamed exec holds of the broker-wide output budget: the capacity of
// its stdout and stderr buffers while it runs, then its encoded answer until that is written.
type execOutput struct {
	budget *quota
	org    string
	limit  int // the exec's max_output: no buffer grows past it

	mu      sync.Mutex
	held    int64
	dropped bool
	freed   bool
}

// grow takes n more bytes of budget for a buffer, or says the output must be dropped.
func (o *execOutput) grow(n int64) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.freed || !o.budget.tryAcquire(o.org, n) {
		o.dropped = true
		return false
	}
	o.held += n
	return true
}

func (o *execOutput) wasDropped() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.dropped
}

// settle makes the budget count n bytes, the encoded answer that now carries the output, instead of
// the buffers, which are garbage from here. The answer exists already, so it is counted even past
// the budget (by at most what encoding added to output that was within it).
func (o *execOutput) settle(n int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.freed {
		return
	}
	if d := n - o.held; d > 0 {
		o.budget.force(o.org, d)
	} else {
		o.budget.release(o.org, -d)
	}
	o.held = n
}

// free gives everything back to the budget, once.
func (o *execOutput) free() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.freed {
		o.budget.release(o.org, o.held)
		o.held, o.freed = 0, true
	}
}

// budgetWriter buffers one of a command's outputs against its execOutput; what the budget cannot
// hold is dropped (and said so). Its buffer's capacity is what is counted.
type budgetWriter struct {
	out *execOutput
	buf []byte
}

func (w *budgetWriter) Write(p []byte) (int, error) {
	need := len(w.buf) + len(p)
	if need > cap(w.buf) {
		// Grow as append would, but never past the exec's output cap, and only within budget.
		size := max(need, 2*cap(w.buf), 4096)
		if w.out.limit > 0 {
			size = max(need, min(size, w.out.limit))
		}
		if !w.out.grow(int64(size - cap(w.buf))) {
			return len(p), nil
		}
		grown := make([]byte, len(w.buf), size)
		copy(grown, w.buf)
		w.buf = grown
	}
	w.buf = append(w.buf, p...)
	return len(p), nil
}

// opMemory is what one request's operation holds of the broker-wide budget for what operations
// build in memory (dpOpMemoryBudget), drawn through membudget as it grows. It takes the budget a
// grain at a time, so that an operation growing name by name does not take the budget's lock for
// each, and gives back whole grains it no longer needs. free gives back everything when the
// request ends, however it ends; a Grow after it is refused.
type opMemory struct {
	budget *quota
	org    string
	op     string // the op, for the refusal's message: an untar's says what stays

	mu      sync.Mutex
	held    int64 // what the operation says it holds
	granted int64 // what it took of the budget: held rounded up to grains, with up to a grain spare
	freed   bool
}

// meterOp makes req's account with the op memory budget and returns ctx carrying it, for the
// operation's code (tartree, baseline, the workspace) to draw on.
func (c *dpConn) meterOp(ctx context.Context, op string) (context.Context, *opMemory) {
	m := &opMemory{budget: c.s.dpOpMemory, org: c.org, op: op}
	return membudget.With(ctx, m), m
}

func grains(n int64) int64 { return (n + dpOpMemoryGrain - 1) / dpOpMemoryGrain * dpOpMemoryGrain }

// Grow takes n more bytes, or refuses the operation: too_many_requests, since what fills the
// budget is other requests in flight, which end.
func (m *opMemory) Grow(n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if need := grains(m.held+n) - m.granted; need > 0 {
		if m.freed || !m.budget.tryAcquire(m.org, need) {
			return m.refusal(grains(m.held+n) > m.budget.share)
		}
		m.granted += need
	}
	m.held += n
	return nil
}

// Shrink gives back n bytes; grains past the one spare go back to the budget.
func (m *opMemory) Shrink(n int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.freed {
		return
	}
	m.held = max(m.held-n, 0)
	if keep := grains(m.held) + dpOpMemoryGrain; m.granted > keep {
		m.budget.release(m.org, m.granted-keep)
		m.granted = keep
	}
}

// free gives everything back to the budget, once.
func (m *opMemory) free() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.freed {
		m.budget.release(m.org, m.granted)
		m.held, m.granted, m.freed = 0, 0, true
	}
}

// refusal is the error of a Grow the budget refused; overShare: the request alone needs more than
// one org's share, which no retry gets.
func (m *opMemory) refusal(overShare bool) error {
	what, done := "the request", "nothing was changed"
	if m.op == protocol.OpUntar {
		what, done = "untar", "the entries before it stay extracted; nothing outside the target directory was changed"
	}
	if overShare {
		return protocol.Errorf(protocol.CodeTooManyRequests, "%s was stopped: it alone needed more memory than one org's share of this broker's operations (%s of %s); %s. A retry gets no more: ask for less at once (a narrower path, pattern or tree, or the tree in parts)",
			what, sizeText(m.budget.share), sizeText(m.budget.max), done)
	}
	return protocol.Errorf(protocol.CodeTooManyRequests, "%s was stopped: the operations in flight on this broker hold all the memory it gives them (%s, at most %s for one org's) and this one needed more; %s. Retry once requests in flight end, or ask for less at once (a narrower path, pattern or tree)",
		what, sizeText(m.budget.max), sizeText(m.budget.share), done)
}

// sizeText shows a budget as the docs state it: "512 MiB", or KiB.
func sizeText(n int64) string {
	if n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}
