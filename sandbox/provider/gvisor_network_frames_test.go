package provider

import (
	"encoding/binary"
	"net"
	"net/netip"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// frame6 is an Ethernet frame from src to the broadcast MAC carrying an IPv6 packet from saddr to
// daddr whose first next header is nh and whose payload (extension headers and all) is payload.
func frame6(src net.HardwareAddr, saddr, daddr netip.Addr, nh byte, payload []byte) []byte {
	f := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	f = append(f, src...)
	f = append(f, 0x86, 0xdd)
	ip := make([]byte, 40)
	ip[0] = 0x60
	binary.BigEndian.PutUint16(ip[4:], uint16(len(payload)))
	ip[6] = nh
	ip[7] = 64
	s, d := saddr.As16(), daddr.As16()
	copy(ip[8:24], s[:])
	copy(ip[24:40], d[:])
	return append(append(f, ip...), payload...)
}

// synAt writes a TCP SYN header (sport, dport) at b[0:20]. b[0] is left alone when keep0 (it is
// also the next-header byte of a header another parser reads there).
func synAt(b []byte, sport, dport uint16, keep0 bool) {
	if !keep0 {
		binary.BigEndian.PutUint16(b[0:], sport)
	}
	binary.BigEndian.PutUint16(b[2:], dport)
	b[12] = 0x50 // data offset 5
	b[13] = 0x02 // SYN
	binary.BigEndian.PutUint16(b[14:], 0xffff)
}

// The frames a compromised sentry (or any sender on eth0) could write, each read one way by the
// firewall (the kernel's IPv6 header walk) and another way by pasta, whose walk counts every
// extension header's length as (hdrlen+1)*8 (an AH's is (hdrlen+2)*4, a fragment header's is 8
// whatever its reserved byte holds), skips next headers the kernel does not (135, 139, 140, 253,
// 254) and takes the transport header to start at the last extension header, not after it.
var smuggled6 = []struct {
	name string
	// payload builds the IPv6 payload (first next header nh) that carries, to pasta, a TCP SYN to
	// port, whatever the firewall reads in it; allowed is a port the firewall may be shown.
	payload func(port, allowed uint16) (nh byte, b []byte)
}{
	// The firewall: AH (12 bytes), destination options (8), ICMPv6 neighbour solicitation, which
	// the neighbour-discovery rule passes to any destination. pasta: AH (16 bytes), then a TCP
	// header at the destination options' padding.
	{"ah-ndp", func(port, _ uint16) (byte, []byte) {
		b := make([]byte, 48)
		b[0], b[1] = 60, 1   // AH: next dest-opts, length (1+2)*4 = 12 to the kernel, 16 to pasta
		b[12], b[13] = 58, 0 // destination options: next ICMPv6
		b[14], b[15] = 1, 4  // PadN over b[16:20]
		b[16] = unix.IPPROTO_TCP
		synAt(b[16:], 0, port, true)
		b[20] = 135 // ICMPv6 neighbour solicitation (b[20:] is also pasta's TCP sequence number)
		return unix.IPPROTO_AH, b
	}},
	// The firewall: fragment header (8 bytes, first and only fragment), destination options,
	// ICMPv6 neighbour solicitation. pasta: a fragment header of 16 bytes (its reserved byte read
	// as a length), ICMPv6's type 135 read as a mobility header, then TCP in the NS's target.
	{"frag-ndp", func(port, _ uint16) (byte, []byte) {
		b := make([]byte, 48)
		b[0], b[1] = 60, 1 // fragment: next dest-opts, reserved 1
		b[8], b[9] = 58, 0 // destination options: next ICMPv6
		b[10], b[11] = 1, 4
		b[16], b[17] = 135, 0 // ICMPv6 neighbour solicitation, code 0
		b[24] = unix.IPPROTO_TCP
		synAt(b[24:], 0, port, true)
		return unix.IPPROTO_FRAGMENT, b
	}},
	// The firewall: hop-by-hop options, then TCP to the allowed port. pasta: TCP at the hop-by-hop
	// header, whose option bytes are the destination port.
	{"hbh-port", func(port, allowed uint16) (byte, []byte) {
		b := make([]byte, 28)
		b[0], b[1] = unix.IPPROTO_TCP, 0
		binary.BigEndian.PutUint16(b[2:], port) // pasta's destination port
		b[12], b[13] = 0x50, 0x02               // pasta's data offset and flags (the kernel's seq)
		binary.BigEndian.PutUint16(b[14:], 0xffff)
		synAt(b[8:], 40000, allowed, false)
		b[12], b[13] = 0x50, 0x02
		return unix.IPPROTO_HOPOPTS, b
	}},
}

// A frame on eth0 is whatever its sender makes it: the firewall must read it as pasta will. These
// frames stand for a compromised sentry (gVisor's packet socket on eth0 can send any frame): IPv6
// packets whose extension headers the kernel and pasta walk differently must not carry a
// connection to the host (its loopback, its address, its second interface) nor to a port off the
// allowlist. A plain SYN written the same way to an allowed destination must arrive, so that the
// frames are known to reach pasta.
func TestGvisorNetworkSmuggledFrames(t *testing.T) {
	n := newGvisor(t)
	hostIP, listenPeer := peerNetns6(t)
	allowed, allowedAccepted := listenPeer()
	other, otherAccepted := listenPeer()
	ah, ap, _ := net.SplitHostPort(allowed)
	tmpl := gvisorNetTemplate
	tmpl.Network = Network{Enabled: true, Allow: []string{"[" + ah + "]:" + ap}}
	for _, tc := range []struct {
		name string
		tmpl Template
	}{{"broad", gvisorNetTemplate}, {"allowlist", tmpl}} {
		t.Run(tc.name, func(t *testing.T) {
			_, spec := startSandbox(t, n, tc.tmpl)
			path := filepath.Join(n.gvisorDir(spec.ID), gvisorNetnsFile)
			var send func(f []byte)
			var src net.HardwareAddr
			var saddr netip.Addr
			inNetns(t, path, func() {
				eth0, err := net.InterfaceByName(gvisorIfname)
				if err != nil {
					t.Fatal(err)
				}
				src = eth0.HardwareAddr
				fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { unix.Close(fd) })
				if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: eth0.Index}); err != nil {
					t.Fatal(err)
				}
				send = func(f []byte) {
					if _, err := unix.Write(fd, f); err != nil && err != unix.ENOBUFS {
						t.Fatalf("send: %v", err)
					}
				}
			})
			for _, a := range hostAddrs6(t) {
				if a.String() != hostIP {
					saddr = a // the sandbox's own address is a copy of the host's
					break
				}
			}
			if !saddr.IsValid() {
				t.Skip("the host has no global IPv6 address")
			}
			port := func(addr string) uint16 {
				_, p, _ := net.SplitHostPort(addr)
				v, _ := strconv.Atoi(p)
				return uint16(v)
			}
			type target struct {
				name     string
				addr     string
				accepted func() bool
			}
			var targets []target
			for _, h := range []string{"::1", saddr.String(), hostIP} {
				addr, accepted := listenOn(t, net.JoinHostPort(h, "0"))
				targets = append(targets, target{"host " + h, addr, accepted})
			}
			if tc.tmpl.Network.Allow != nil {
				targets = append(targets, target{"off the allowlist", other, otherAccepted})
			}
			for _, sm := range smuggled6 {
				for _, tg := range targets {
					nh, b := sm.payload(port(tg.addr), port(allowed))
					dst := netip.MustParseAddrPort(tg.addr).Addr()
					send(frame6(src, saddr, dst, nh, b))
					if tg.accepted() {
						t.Errorf("%s: a %s frame reached the %s listener %s", tc.name, sm.name, tg.name, tg.addr)
					}
				}
			}
			// The control: a plain SYN, written the same way, to the allowed peer arrives.
			b := make([]byte, 20)
			synAt(b, 40001, port(allowed), false)
			send(frame6(src, saddr, netip.MustParseAddrPort(allowed).Addr(), unix.IPPROTO_TCP, b))
			if !allowedAccepted() {
				t.Errorf("%s: a plain SYN frame to the allowed %s never arrived: the checks above test nothing", tc.name, allowed)
			}
		})
	}
}

// hostAddrs6 are the host's global IPv6 addresses.
func hostAddrs6(t *testing.T) []netip.Addr {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Addr
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() == nil && ipn.IP.IsGlobalUnicast() {
			ip, _ := netip.AddrFromSlice(ipn.IP)
			out = append(out, ip)
		}
	}
	return out
}
