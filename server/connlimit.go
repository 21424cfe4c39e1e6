package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
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
	// refusers holds a token per refused connection being answered on a goroutine of its own.
	refusers chan struct{}

	mu   sync.Mutex
	open map[netip.Addr]int
	// waiting counts each source's refusals on those goroutines, at most maxRefusersPerSource.
	waiting map[netip.Addr]int
}

func newSourceLimiter(l net.Listener, max int, refused prometheus.Counter) *sourceLimiter {
	body, _ := json.Marshal(protocol.ErrorBody{Error: protocol.Error{Code: protocol.CodeTooManyConnections,
		Message: fmt.Sprintf("this address has %d connections open to this broker, its maximum: close some (keep-alive connections count), or retry later (the operator's --max-connections-per-source raises it)", max)}})
	refusal := fmt.Appendf(nil, "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: %d\r\nRetry-After: 5\r\nConnection: close\r\n\r\n%s", len(body), body)
	return &sourceLimiter{Listener: l, max: max, refused: refused, refusal: refusal,
		refusers: make(chan struct{}, maxRefusers), open: map[netip.Addr]int{}, waiting: map[netip.Addr]int{}}
}

// Accept returns the next connection whose source is under the cap; the others are answered and
// closed, each on a goroutine of its own up to maxRefusers at once (maxRefusersPerSource of one
// source) and here past them, so refused connections never hold more than those.
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
		if l.add(l.waiting, src, maxRefusersPerSource) {
			select {
			case l.refusers <- struct{}{}:
				go func() {
					defer func() { <-l.refusers; l.remove(l.waiting, src) }()
					l.refuse(c, true)
				}()
				continue
			default:
				l.remove(l.waiting, src)
			}
		}
		l.refuse(c, false)
	}
}

// maxRefusers bounds the refused connections answered after their request's head at once (a
// goroutine and a 4 KiB buffer each, for at most refusalWait plus refusalLinger); past it a refused
// connection is answered at once, on the accepting goroutine. maxRefusersPerSource is one source's
// share of them: one that opens connections and sends nothing would otherwise hold them all, and
// every other source's refusals would be answered before their request again.
const (
	maxRefusers          = 64
	maxRefusersPerSource = 8
)

const (
	// refusalWait is how long a refusal waits for the request's head.
	refusalWait = time.Second
	// refusalLinger is how long it reads on after its FIN, so that a client still sending a body
	// reads the answer before a reset (net/http's own grace is 500 ms).
	refusalLinger = 500 * time.Millisecond
)

// refuse answers c 429 and closes it. afterHead waits first for the request's head (up to 16 KiB,
// refusalWait): an answer that arrives before the client has sent anything meets an HTTP client
// with no request on that connection, which reports a broken connection instead of the 429 (Go's
// transport: "Unsolicited response received on idle HTTP channel").
func (l *sourceLimiter) refuse(c net.Conn, afterHead bool) {
	defer c.Close()
	if afterHead {
		c.SetReadDeadline(time.Now().Add(refusalWait))
		readHead(c, 16<<10)
	}
	// A new socket's send buffer is empty: the answer fits and the write does not wait. The
	// deadline is for a kernel that thinks otherwise.
	c.SetWriteDeadline(time.Now().Add(time.Second))
	if _, err := c.Write(l.refusal); err != nil || !afterHead {
		return
	}
	if cw, ok := c.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
		c.SetReadDeadline(time.Now().Add(refusalLinger))
		io.Copy(io.Discard, io.LimitReader(c, 1<<20))
	}
}

// readHead reads from c until the end of an HTTP request's head (an empty line), limit bytes, or an
// error (the deadline).
func readHead(c net.Conn, limit int) {
	buf := make([]byte, 3+4<<10) // the last 3 bytes of the read before, then this read's
	kept := 0
	for read := 0; read < limit; {
		n, err := c.Read(buf[kept:])
		read += n
		seen := buf[:kept+n]
		if bytes.Contains(seen, []byte("\r\n\r\n")) || err != nil {
			return
		}
		kept = copy(buf, seen[max(0, len(seen)-3):])
	}
}

// take counts a connection of src open, unless src is at the cap.
func (l *sourceLimiter) take(src netip.Addr) bool { return l.add(l.open, src, l.max) }

func (l *sourceLimiter) give(src netip.Addr) { l.remove(l.open, src) }

// add counts one more for src in counts (open or waiting), unless it has max already.
func (l *sourceLimiter) add(counts map[netip.Addr]int, src netip.Addr, max int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if counts[src] >= max {
		return false
	}
	counts[src]++
	return true
}

func (l *sourceLimiter) remove(counts map[netip.Addr]int, src netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if counts[src]--; counts[src] <= 0 {
		delete(counts, src)
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
