package agent

import (
	"net"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// What a handshake costs the agent: TLS's key exchange and an Ed25519 signature, paid as soon as a
// ClientHello arrives, which its sender can replay without computing anything. Another pod that
// reaches the agent's port (a CNI that does not enforce the NetworkPolicy) could so spend the
// sandbox's CPU on handshakes, thousands a second. So the agent takes handshakes from an address
// that never proved the secret at a bounded rate, per address and in all, and refuses the rest
// before TLS (the connection is closed, nothing computed); an address that proved the secret (a
// broker's) is never held to it, so the broker's bursts of execs and streams are not refused. A
// broker at a new address pays the bound only until its first connection proves the secret.

// HandshakeRate and HandshakeBurst bound the handshakes per second the agent takes from one address
// that has not proved the secret; HandshakeRateAll and HandshakeBurstAll from all such addresses
// together (many pods flooding at once).
const (
	HandshakeRate     = 16
	HandshakeBurst    = 32
	HandshakeRateAll  = 128
	HandshakeBurstAll = 128
)

const (
	maxKnownSources   = 16   // brokers' addresses; the least recently proved goes first
	maxUnknownSources = 4096 // addresses being rated; idle ones go first
)

type handshakeLimits struct {
	mu      sync.Mutex
	known   map[netip.Addr]time.Time // addresses that proved the secret, when last
	unknown map[netip.Addr]*rate.Limiter
	all     *rate.Limiter
}

func newHandshakeLimits() *handshakeLimits {
	return &handshakeLimits{
		known:   map[netip.Addr]time.Time{},
		unknown: map[netip.Addr]*rate.Limiter{},
		all:     rate.NewLimiter(HandshakeRateAll, HandshakeBurstAll),
	}
}

// sourceOf is a connection's source address (the zero Addr when it is not TCP).
func sourceOf(c net.Conn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// allow says whether a handshake from src may start now.
func (l *handshakeLimits) allow(src netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.known[src]; ok {
		return true
	}
	lim := l.unknown[src]
	if lim == nil {
		if len(l.unknown) >= maxUnknownSources {
			l.forgetIdle()
		}
		lim = rate.NewLimiter(HandshakeRate, HandshakeBurst)
		l.unknown[src] = lim
	}
	// The address's own bound first, so that one flooding address does not spend the shared one.
	return lim.Allow() && l.all.Allow()
}

// forgetIdle drops the rated addresses whose bucket is full again (they sent nothing lately), or
// all of them if none is: the shared bound still holds meanwhile.
func (l *handshakeLimits) forgetIdle() {
	now := time.Now()
	for a, lim := range l.unknown {
		if lim.TokensAt(now) >= HandshakeBurst {
			delete(l.unknown, a)
		}
	}
	if len(l.unknown) >= maxUnknownSources {
		clear(l.unknown)
	}
}

// proved records that src proved the secret: its handshakes are no longer rated.
func (l *handshakeLimits) proved(src netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.known[src]; !ok && len(l.known) >= maxKnownSources {
		var oldest netip.Addr
		var when time.Time
		for a, t := range l.known {
			if when.IsZero() || t.Before(when) {
				oldest, when = a, t
			}
		}
		delete(l.known, oldest)
	}
	l.known[src] = time.Now()
	delete(l.unknown, src)
}
