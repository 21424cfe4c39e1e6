package server_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// lossyNet loses Redis' answers to the broker's script calls that name a given sandbox, while
// armed: the call reaches Redis and runs, its answer is read and thrown away, and the broker sees
// the connection cut, as when a network blip or a failover lands between the two. go-redis then
// sends the call again on a new connection (3 times by default).
type lossyNet struct {
	match []byte
	arm   atomic.Int32 // answers still to lose
}

func (n *lossyNet) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	nc, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &lossyConn{Conn: nc, n: n}, nil
}

type lossyConn struct {
	net.Conn
	n    *lossyNet
	mu   sync.Mutex
	lose bool
}

func (c *lossyConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte("evalsha")) && bytes.Contains(p, c.n.match) && c.n.arm.Add(-1) >= 0 {
		c.mu.Lock()
		c.lose = true
		c.mu.Unlock()
	}
	return c.Conn.Write(p)
}

func (c *lossyConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	lose := c.lose
	c.mu.Unlock()
	if lose {
		c.Conn.Read(make([]byte, 64<<10)) // the script ran: this is its answer
		c.Conn.Close()
		return 0, io.EOF
	}
	return c.Conn.Read(p)
}

// TestCreateWhoseAnswerRedisLost: Redis runs a create, then its answer is lost, on every try of the
// Redis client and once more. The create must still end with one running sandbox under its name:
// before, a lost answer made the client's resend find the name taken (a create refused as a
// conflict, whose uid was then given back though its record held it), or "reused" its own record
// and waited for a start nobody would make, leaving the name stuck in provisioning.
func TestCreateWhoseAnswerRedisLost(t *testing.T) {
	lossy := &lossyNet{match: []byte("lost-answer")}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.dial})
	ctx := t.Context()
	// The first create loads the script, so that every armed call below is one that runs.
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	noReuse := false
	for _, tc := range []struct {
		name  string
		lose  int32
		reuse *bool
	}{
		{"lost-answer-1", 1, &noReuse}, // resent by the Redis client
		{"lost-answer-2", 1, nil},      // resent by the Redis client, create-or-reuse
		{"lost-answer-5", 5, nil},      // past the Redis client's retries: resent by the broker
	} {
		lossy.arm.Store(tc.lose)
		got, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: tc.name, Reuse: tc.reuse})
		if err != nil || got.Outcome != protocol.OutcomeCreated || got.Sandbox.Status != protocol.StatusRunning {
			t.Fatalf("%s, %d answers lost: %v %+v", tc.name, tc.lose, err, got)
		}
		if lossy.arm.Load() > 0 {
			t.Fatalf("%s: no answer was lost: the test did not test", tc.name)
		}
		again, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: tc.name})
		if err != nil || again.Outcome != protocol.OutcomeReused || again.Sandbox.ID != got.Sandbox.ID {
			t.Fatalf("%s: create again: %v %+v (want reused %s)", tc.name, err, again, got.Sandbox.ID)
		}
	}

	// A resume whose answer was lost is this caller's own, not another's start to wait for.
	if _, err := b.Client.StopSandbox(ctx, "lost-answer-1"); err != nil {
		t.Fatal(err)
	}
	lossy.arm.Store(1)
	resumed, err := b.Client.ResumeSandbox(ctx, "lost-answer-1")
	if err != nil || resumed.Status != protocol.StatusRunning {
		t.Fatalf("resume, its answer lost: %v %+v", err, resumed)
	}
	if lossy.arm.Load() > 0 {
		t.Fatal("resume: no answer was lost: the test did not test")
	}
}
