package server

import (
	"bytes"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// One IPv6 host commonly holds a whole /64 (and picks a new address in it at will), so the cap per
// source counts an IPv6 peer's /64, as the authentication guard does (sourceOf): counted per
// address, a client with a /64 had 2^64 caps. An IPv4 peer, in IPv6 form or not, is one address.
func TestSourceCapCountsAnIPv6Slash64Once(t *testing.T) {
	l := newSourceLimiter(nil, 2, prometheus.NewCounter(prometheus.CounterOpts{Name: "x"}))
	tcp := func(s string) netip.Addr { return sourceAddr(&net.TCPAddr{IP: net.ParseIP(s), Port: 40000}) }
	for _, a := range []string{"2001:db8:1:2::1", "2001:db8:1:2:ffff:0:0:7"} {
		if !l.take(tcp(a)) {
			t.Fatalf("%s refused under the cap", a)
		}
	}
	if l.take(tcp("2001:db8:1:2:dead:beef:0:1")) {
		t.Error("a third address of the same /64 was let in past a cap of 2")
	}
	if !l.take(tcp("2001:db8:1:3::1")) {
		t.Error("another /64 was refused")
	}
	l.give(tcp("2001:db8:1:2::1"))
	if !l.take(tcp("2001:db8:1:2::99")) {
		t.Error("a place given back in the /64 was not free")
	}
	// IPv4, mapped or not, is one address each.
	if !l.take(tcp("192.0.2.1")) || !l.take(tcp("::ffff:192.0.2.1")) || l.take(tcp("192.0.2.1")) {
		t.Error("an IPv4 peer in IPv6 form counted apart from itself")
	}
	if !l.take(tcp("192.0.2.2")) {
		t.Error("a neighbouring IPv4 address shared its cap")
	}
}

// silentConn is a connection whose peer sends nothing until hangup is closed, and whose deadlines
// never pass: a refusal waiting for its head waits until the test ends it, whatever the machine's
// speed.
type silentConn struct {
	net.Conn // nil: only what the limiter calls is here
	remote   net.Addr
	hangup   chan struct{}
	closed   chan struct{}
	once     sync.Once
	mu       sync.Mutex
	written  []byte
}

func newSilentConn(ip string) *silentConn {
	return &silentConn{remote: &net.TCPAddr{IP: net.ParseIP(ip), Port: 40000}, hangup: make(chan struct{}), closed: make(chan struct{})}
}

func (c *silentConn) RemoteAddr() net.Addr { return c.remote }
func (c *silentConn) Read([]byte) (int, error) {
	<-c.hangup
	return 0, io.EOF
}
func (c *silentConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.written = append(c.written, b...)
	return len(b), nil
}
func (c *silentConn) Close() error                     { c.once.Do(func() { close(c.closed) }); return nil }
func (c *silentConn) SetDeadline(time.Time) error      { return nil }
func (c *silentConn) SetReadDeadline(time.Time) error  { return nil }
func (c *silentConn) SetWriteDeadline(time.Time) error { return nil }

func (c *silentConn) answeredAtOnce() bool {
	select {
	case <-c.closed:
	default:
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Contains(c.written, []byte("429 Too Many Requests"))
}

// chanListener accepts the connections sent on it.
type chanListener struct {
	net.Listener // nil
	conns        chan net.Conn
}

func (l chanListener) Accept() (net.Conn, error) {
	c, ok := <-l.conns
	if !ok {
		return nil, net.ErrClosed
	}
	return c, nil
}

// A refusal past the per-source cap waits for the request's head so that a Go client sees the 429
// (TestGoClientPastTheSourceCapSeesThe429), on one of maxRefusers places. One source that sends
// nothing on many connections takes at most maxRefusersPerSource of them: its other refusals are
// answered at once, and another source's refusal still waits for its head. Before, one silent
// source held all 64 places, and every other source's refusals were answered before their request
// again, which Go clients report as a broken connection.
func TestOneSourceCannotHoldEveryWaitingRefusal(t *testing.T) {
	conns := make(chan net.Conn)
	l := newSourceLimiter(chanListener{conns: conns}, 1, prometheus.NewCounter(prometheus.CounterOpts{Name: "x"}))
	accepted := make(chan net.Conn)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	var all []*silentConn
	send := func(ip string) *silentConn {
		c := newSilentConn(ip)
		all = append(all, c)
		conns <- c
		return c
	}
	var under []net.Conn
	accept := func() { under = append(under, <-accepted) }
	defer func() {
		close(conns)
		for _, c := range under {
			c.Close()
		}
		for _, c := range all { // the waiting refusals end as their peers hang up
			close(c.hangup)
			<-c.closed
		}
	}()
	// Both sources at their cap of one.
	send("192.0.2.1")
	accept()
	send("192.0.2.2")
	accept()

	var silent []*silentConn
	for range maxRefusers + 8 {
		silent = append(silent, send("192.0.2.1"))
	}
	other := send("192.0.2.2")
	// A connection under the cap is accepted only after every refusal before it was placed.
	send("192.0.2.3")
	accept()

	waiting := 0
	for _, c := range silent {
		if !c.answeredAtOnce() {
			waiting++
		}
	}
	if waiting != maxRefusersPerSource {
		t.Errorf("one silent source holds %d waiting refusals, want %d", waiting, maxRefusersPerSource)
	}
	if other.answeredAtOnce() {
		t.Error("another source's refusal was answered before its request: a Go client reports a broken connection")
	}
}
