package server

import (
	"net"
	"net/netip"
	"testing"

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
