package kube

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"
)

// The agent runs in the tenant's own pod, beside the tenant's code, which can stop it (SIGSTOP)
// or starve it: an agent that stops answering must not hold the broker's connections and
// goroutines for as long as TCP keepalive takes to notice (about 2.5 minutes, while the kernel
// still acknowledges), nor past the pod's end. So every operation on the agent channel ends when
// the instance ends (agentClient.close, from finish), and is bounded when its caller set none:
//
//   - agentOpTimeout bounds an operation that answers once (stat, write, edit, list, read, grep,
//     ...): on a healthy agent these take milliseconds; the bound is generous enough for a grep or
//     a glob over a large workspace, and there is nothing to measure progress by in between (the
//     agent sends a single result frame), so it bounds the whole operation. It applies only when
//     the caller's context has no deadline of its own.
//   - agentIdleTimeout bounds how long a streamed transfer (upload, download, tar in and out) may
//     make no progress on the agent's side: a large transfer takes as long as it takes, but each
//     frame written must be taken, and each frame awaited must come, within it. Time spent on the
//     broker's side of the stream (a slow client) does not count: the deadline is set anew just
//     before each frame is read or written.
//
// Commands (exec, terminals) are not bounded here: a command may be silent for as long as it
// runs; they end with the caller's context, the pod's end, or the command's own timeout.
var (
	agentOpTimeout   = 2 * time.Minute
	agentIdleTimeout = time.Minute
)

// agentTimeoutError says the agent stopped answering within a bound; it is a
// context.DeadlineExceeded (the API answers 503, retry).
type agentTimeoutError struct {
	what string
	d    time.Duration
}

func (e *agentTimeoutError) Error() string {
	return fmt.Sprintf("the sandbox's agent %s for %s: it is stopped or stuck (the sandbox's own processes can stop it)", e.what, e.d)
}

func (e *agentTimeoutError) Unwrap() error { return context.DeadlineExceeded }

// errChannelClosed ends what was in flight when the client closed (the pod ended).
var errChannelClosed = errors.New("the channel to the sandbox's agent was closed")

// lifeCtx is cancelled when the client closes.
func (a *agentClient) lifeCtx() context.Context {
	a.lifeOnce.Do(func() { a.life, a.endLife = context.WithCancel(context.Background()) })
	return a.life
}

// bound is ctx, also cancelled when the client closes (with the pod's end as the cause) and, when
// ctx has no deadline, after agentOpTimeout.
func (a *agentClient) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	cancelTimeout := context.CancelFunc(func() {})
	if _, ok := ctx.Deadline(); !ok {
		ctx, cancelTimeout = context.WithTimeoutCause(ctx, agentOpTimeout, &agentTimeoutError{"did not answer", agentOpTimeout})
	}
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(a.lifeCtx(), func() { cancel(a.lost(errChannelClosed)) })
	return ctx, func() {
		stop()
		cancel(nil)
		cancelTimeout()
	}
}

// watch aborts c when ctx ends or the client closes; stop releases the watch.
func (a *agentClient) watch(ctx context.Context, c *agentConn) (stop func()) {
	s1 := context.AfterFunc(ctx, c.abort)
	s2 := context.AfterFunc(a.lifeCtx(), c.abort)
	return func() { s1(); s2() }
}

// streamErr says why a streamed operation's connection failed: the pod ended, the caller's
// context ended, or the agent made no progress within agentIdleTimeout; else err as it is (the
// agent's own answer, or a broken connection).
func (a *agentClient) streamErr(ctx context.Context, err error) error {
	if g := a.lost(nil); g != nil {
		return g
	}
	if ctx != nil && ctx.Err() != nil {
		return context.Cause(ctx)
	}
	if a.lifeCtx().Err() != nil {
		return errChannelClosed
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return &agentTimeoutError{"made no progress", agentIdleTimeout}
	}
	return err
}

// abort closes the connection under TLS at once: what blocks on it returns, and nothing waits to
// send TLS's close alert to a peer that does not read.
func (c *agentConn) abort() {
	if c.raw != nil {
		c.raw.Close()
	}
	c.Conn.Close()
}

// readIdle reads the next frame, waiting at most agentIdleTimeout for it.
func (c *agentConn) readIdle() (byte, []byte, error) {
	c.SetReadDeadline(time.Now().Add(agentIdleTimeout))
	return c.read()
}

// writeIdle writes a frame, waiting at most agentIdleTimeout for the agent to take it.
func (c *agentConn) writeIdle(typ byte, p []byte) error {
	c.SetWriteDeadline(time.Now().Add(agentIdleTimeout))
	return c.write(typ, p)
}

// resultIdle is result with each frame awaited at most agentIdleTimeout.
func resultIdle(c *agentConn, out any) error {
	c.SetReadDeadline(time.Now().Add(agentIdleTimeout))
	return result(c, out)
}
