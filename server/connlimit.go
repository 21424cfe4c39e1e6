package server

import (
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sbxbroker/broker/protocol"
)

// DefaultConnsPerSource is how many connections one source address may hold open on a broker
// unless Config.ConnsPerSource says otherwise: the default dataplane connections of a whole broker,
// a fifth of a 20,000-descriptor limit.
const DefaultConnsPerSource = 4096

// sourceLimiter bounds the connections each source address holds open at once, whatever they are
// (REST kept alive, event streams, dataplane WebSockets, or nothing sent yet). Without it a client
// with no credentials at all holds a descriptor per connection for as long as the idle timeout
// (120 s) after one GET /healthz, and a loop of them takes every descriptor the broker has, from
// every org. It counts at accept, before any byte is read, which is why it is a listener and not a
// middleware: http.Server offers no hook that can refuse a connection.
type sourceLimiter struct {
	net.Listener
	max     int
	refused prometheus.Counter
	// refusal is the answer past the cap, made once.
	refusal []byte

	mu   sync.Mutex
	open map[netip.Addr]int
}

func newSourceLimiter(l net.Listener, max int, refused prometheus.Counter) *sourceLimiter {
	body, _ := json.Marshal(protocol.ErrorBody{Error: protocol.Error{Code: protocol.CodeTooManyConnections,
		Message: fmt.Sprintf("this address has %d connections open to this broker, its maximum: close some (keep-alive connections count), or retry later (the operator's --max-connections-per-source raises it)", max)}})
	refusal := fmt.Appendf(nil, "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: %d\r\nRetry-After: 5\r\nConnection: close\r\n\r\n%s", len(body), body)
	return &sourceLimiter{Listener: l, max: max, refused: refused, refusal: refusal, open: map[netip.Addr]int{}}
}

// Accept returns the next connection whose source is under the cap; the others are answered and
// closed here, without a goroutine each.
func (l *sourceLimiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		src := sourceAddr(c.RemoteAddr())
		if l.take(src) {
			return &sourceConn{Conn: c, release: func() { l.give(src) }}, nil
		}
		l.refused.Inc()
		// A new socket's send buffer is empty: the answer fits and the write does not wait. The
		// deadline is for a kernel that thinks otherwise.
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(l.refusal)
		c.Close()
	}
}

func (l *sourceLimiter) take(src netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[src] >= l.max {
		return false
	}
	l.open[src]++
	return true
}

func (l *sourceLimiter) give(src netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[src]--; l.open[src] <= 0 {
		delete(l.open, src)
	}
}

// sourceAddr is what a connection counts against: its source address without the port (IPv4 in
// IPv6 unmapped, so that one client counts once whichever way it arrives), and for an IPv6 peer
// its /64, as sourceOf counts authentication failures: one host commonly holds a whole /64 and may
// take any address in it, so counted per address it would have 2^64 caps.
func sourceAddr(a net.Addr) netip.Addr {
	var ip netip.Addr
	if ta, ok := a.(*net.TCPAddr); ok {
		ip, _ = netip.AddrFromSlice(ta.IP)
	} else {
		ap, _ := netip.ParseAddrPort(a.String())
		ip = ap.Addr()
	}
	ip = ip.Unmap()
	if ip.Is6() {
		p, _ := ip.WithZone("").Prefix(64)
		return p.Addr()
	}
	return ip
}

// sourceConn gives its source's place back when it is closed, once, however often Close is
// called (http.Server, a hijacker's WebSocket and a shutdown may each close it).
type sourceConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *sourceConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// CloseWrite half-closes the connection. net/http looks for it by a type assertion when it closes
// a connection whose request body it gave up on (a refusal before a large body was read): FIN at
// once, then its grace, then the close. Without it the wrapper hid *net.TCPConn's, and such a
// client got no FIN, only a reset 500 ms later, which may take the answer with it.
func (c *sourceConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
