package client_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

func TestMain(m *testing.M) { servertest.Main(m) }

// cutter is a TCP proxy in front of a broker whose connections a test can cut, as a network or a
// load balancer would.
type cutter struct {
	l     net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func newCutter(t *testing.T, target string) *cutter {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{l: l}
	t.Cleanup(func() { l.Close(); c.cut() })
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			c.mu.Lock()
			c.conns = append(c.conns, in, out)
			c.mu.Unlock()
			go func() { io.Copy(out, in); out.Close() }()
			go func() { io.Copy(in, out); in.Close() }()
		}
	}()
	return c
}

func (c *cutter) cut() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.conns {
		conn.Close()
	}
	c.conns = nil
}

// A follower whose stream is cut while Redis is away keeps trying through the 503s that follow,
// with backoff, and resumes after the last event it saw when the broker can serve again: every
// event once, none lost.
func TestFollowRetries503AndResumes(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	proxy := newCutter(t, strings.TrimPrefix(b.URL, "http://"))
	c, err := client.New("http://"+proxy.l.Addr().String(), b.Client.APIKey())
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan protocol.Event, 100)
	reconnects := make(chan error, 100)
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	var ferr error
	go func() {
		defer close(done)
		ferr = c.Events(fctx, client.EventOptions{Ref: "dev", Backlog: 10, Follow: true,
			OnReconnect: func(err error, _ int) { reconnects <- err }},
			func(e protocol.Event) error { got <- e; return nil })
	}()
	defer func() { cancel(); <-done }()
	next := func(typ string) {
		t.Helper()
		select {
		case e := <-got:
			if e.Type != typ {
				t.Fatalf("event %+v, want %s", e, typ)
			}
		case <-done:
			t.Fatalf("the follower gave up: %v", ferr)
		case <-time.After(15 * time.Second):
			t.Fatalf("no %s event", typ)
		}
	}
	next(protocol.EventCreated)

	b.Redis.Stop(t)
	proxy.cut()
	// The follower reconnects and meets 503s (Redis is away), and keeps trying.
	deadline := time.After(15 * time.Second)
	for saw503 := false; !saw503; {
		select {
		case err := <-reconnects:
			var pe *protocol.Error
			saw503 = errors.As(err, &pe) && pe.Status == 503
		case <-done:
			t.Fatalf("the follower gave up on a 503: %v", ferr)
		case <-deadline:
			t.Fatal("no 503 while Redis was away")
		}
	}
	b.Redis.Restart(t)
	if _, err := b.Client.Delegate(ctx, "dev", protocol.MintRequest{Scopes: []string{protocol.ScopeExec}}); err != nil {
		t.Fatal(err)
	}
	next(protocol.EventTokenMinted) // and not created again: it resumed after the last one it saw
}

// A follower pointed at a broker that never answered stops at once with an error that says so,
// instead of retrying forever.
func TestFollowStopsWhenTheBrokerWasNeverReachable(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	c, err := client.New("http://"+addr, "sbk_x_y")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	err = c.Events(ctx, client.EventOptions{Ref: "dev", Follow: true}, func(protocol.Event) error { return nil })
	var un *client.UnreachableError
	if ctx.Err() != nil || !errors.As(err, &un) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("following a broker that never answered: %v, want an unreachable error naming %s at once", err, addr)
	}
}

// OnOpen says when the stream is subscribed: an event that happens after it is delivered, without
// a backlog and without waiting "long enough" first; and it is called again after a reconnect.
func TestFollowOnOpen(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	proxy := newCutter(t, strings.TrimPrefix(b.URL, "http://"))
	c, err := client.New("http://"+proxy.l.Addr().String(), b.Client.APIKey())
	if err != nil {
		t.Fatal(err)
	}
	opened := make(chan struct{}, 4)
	got := make(chan protocol.Event, 16)
	fctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Events(fctx, client.EventOptions{Follow: true, OnOpen: func() { opened <- struct{}{} }},
			func(e protocol.Event) error { got <- e; return nil })
	}()
	defer func() { cancel(); <-done }()
	for round, name := range []string{"first", "after-reconnect"} {
		select {
		case <-opened:
		case <-time.After(15 * time.Second):
			t.Fatalf("round %d: OnOpen was not called", round)
		}
		if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
		select {
		case e := <-got:
			if e.Type != protocol.EventCreated || e.Name != name {
				t.Fatalf("round %d: first event %+v, want created %s", round, e, name)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("round %d: an event made after OnOpen was not delivered", round)
		}
		proxy.cut() // the follower reconnects, and opens again
	}
}
