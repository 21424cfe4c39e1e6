package redistest

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
)

// LoseAnswers is a faulty network in front of a real Redis: while armed, it loses Redis' answers to
// script calls (EVALSHA) whose request holds Match (any, when Match is nil). The call reaches Redis
// and runs; its answer is read off the socket and thrown away, and the client sees the connection
// cut (EOF), as when a network blip or a failover lands between a script's run and its answer.
// go-redis then sends the same call again on a new connection (3 times by default). Give Dial as a
// client's Dialer; Lose.Store(n) arms it for n answers.
type LoseAnswers struct {
	Match []byte
	Also  []byte       // when set, a call must hold it too
	Lose  atomic.Int32 // answers still to lose
	// Lost, when set, runs with each answer thrown away, before the client sees the cut.
	Lost func(answer []byte)
}

// Dial opens a connection whose answers may be lost.
func (n *LoseAnswers) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	nc, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &lossyConn{Conn: nc, n: n}, nil
}

type lossyConn struct {
	net.Conn
	n    *LoseAnswers
	mu   sync.Mutex
	lose bool
}

func (c *lossyConn) Write(p []byte) (int, error) {
	if bytes.Contains(bytes.ToLower(p), []byte("evalsha")) && (c.n.Match == nil || bytes.Contains(p, c.n.Match)) && (c.n.Also == nil || bytes.Contains(p, c.n.Also)) && c.n.Lose.Add(-1) >= 0 {
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
		answer := make([]byte, 64<<10)
		n, _ := c.Conn.Read(answer) // the script ran: this is its answer
		c.Conn.Close()
		if c.n.Lost != nil && n > 0 {
			c.n.Lost(answer[:n])
		}
		return 0, io.EOF
	}
	return c.Conn.Read(p)
}
