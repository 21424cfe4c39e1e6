package provider

import (
	"encoding/binary"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
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
// Before the firewall refused extension headers, frag-ndp reached the host through pasta
// 0.0~git20230309 (Debian bookworm); ah-ndp and hbh-port did not there, but are the same class and
// stay as checks against other pasta versions.
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

// synFrame4 is an Ethernet frame from src to the broadcast MAC carrying an IPv4 TCP SYN from saddr
// to daddr:dport, with no checksums (pasta checks none).
func synFrame4(src net.HardwareAddr, saddr, daddr netip.Addr, dport uint16) []byte {
	f := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	f = append(f, src...)
	f = append(f, 0x08, 0x00)
	ip := make([]byte, 40)
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], 40)
	ip[8] = 64
	ip[9] = unix.IPPROTO_TCP
	s, d := saddr.As4(), daddr.As4()
	copy(ip[12:16], s[:])
	copy(ip[16:20], d[:])
	synAt(ip[20:], 40002, dport, false)
	return append(f, ip...)
}

// vnetHdr is the virtio_net_hdr a PACKET_VNET_HDR socket takes before each frame: with csum, the
// frame's checksum is left to the kernel (VIRTIO_NET_HDR_F_NEEDS_CSUM), summed from byte start
// and written at start+off.
func vnetHdr(csum bool, start, off uint16) []byte {
	h := make([]byte, 10)
	if csum {
		h[0] = 1
		binary.LittleEndian.PutUint16(h[6:], start)
		binary.LittleEndian.PutUint16(h[8:], off)
	}
	return h
}

// steerChecksum sets the 16-bit word of f at free (an even distance from start) so that the
// checksum the kernel computes from start to the end of f, and writes at start, is want.
func steerChecksum(f []byte, start, free int, want uint16) bool {
	for w := 0; w <= 0xffff; w++ {
		binary.BigEndian.PutUint16(f[free:], uint16(w))
		var sum uint32
		for i := start; i < len(f); i += 2 {
			v := uint32(f[i]) << 8
			if i+1 < len(f) {
				v |= uint32(f[i+1])
			}
			sum += v
		}
		for sum > 0xffff {
			sum = sum&0xffff + sum>>16
		}
		got := ^uint16(sum)
		if got == 0 {
			got = 0xffff
		}
		if got == want {
			return true
		}
	}
	return false
}

// The sentry's packet socket on eth0 takes a virtio_net_hdr before each frame (runsc sets
// PACKET_VNET_HDR for GSO), and with it the sender says where the kernel is to write the frame's
// checksum. A kernel that writes it after the firewall has read the frame lets a compromised
// sentry rewrite any two bytes of a frame the firewall passed: the destination address, to the
// host's loopback or its addresses, or the destination port, to one off the allowlist. Frames go
// through the qdisc and around it. (Since the host's wall for pasta, the host's addresses are
// refused there too; the allowlist row shows the rewrite with no other wall behind it.)
func TestGvisorNetworkChecksumRewrite(t *testing.T) {
	n := newGvisor(t)
	_, listenPeer := peerNetns(t) // the host gets 10.213.N.1 on a second interface
	allowed, allowedAccepted := listenPeer()
	other, otherAccepted := listenPeer()
	ah, ap, _ := net.SplitHostPort(allowed)
	listed := gvisorNetTemplate
	listed.Network = Network{Enabled: true, Allow: []string{ah + ":" + ap}}
	port := func(addr string) uint16 {
		_, p, _ := net.SplitHostPort(addr)
		v, _ := strconv.Atoi(p)
		return uint16(v)
	}
	for _, tc := range []struct {
		name string
		tmpl Template
	}{{"broad", gvisorNetTemplate}, {"allowlist", listed}} {
		t.Run(tc.name, func(t *testing.T) {
			_, spec := startSandbox(t, n, tc.tmpl)
			path := filepath.Join(n.gvisorDir(spec.ID), gvisorNetnsFile)
			// send writes the frame build makes, with a source port of its own, on each socket.
			var send func(build func(sport uint16) []byte)
			var src net.HardwareAddr
			inNetns(t, path, func() {
				eth0, err := net.InterfaceByName(gvisorIfname)
				if err != nil {
					t.Fatal(err)
				}
				src = eth0.HardwareAddr
				// Each frame goes through the qdisc and around it (PACKET_QDISC_BYPASS).
				var fds []int
				for _, bypass := range []bool{false, true} {
					fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { unix.Close(fd) })
					if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VNET_HDR, 1); err != nil {
						t.Fatal(err)
					}
					if bypass {
						if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_QDISC_BYPASS, 1); err != nil {
							t.Fatal(err)
						}
					}
					if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: eth0.Index}); err != nil {
						t.Fatal(err)
					}
					fds = append(fds, fd)
				}
				sport := uint16(41000)
				send = func(build func(sport uint16) []byte) {
					for _, fd := range fds {
						sport++
						if _, err := unix.Write(fd, build(sport)); err != nil && err != unix.ENOBUFS {
							t.Fatalf("send: %v", err)
						}
					}
				}
			})
			saddr := netip.MustParseAddr(hostAddrs(t)[0])
			const daddrOff, dportOff, windowOff = etherLen + 16, etherLen + 20 + 2, etherLen + 20 + 14
			type target struct {
				name     string
				addr     string
				accepted func() bool
			}
			var targets []target
			if tc.tmpl.Network.Allow == nil {
				for _, h := range append([]string{"127.0.0.1"}, hostAddrs(t)...) {
					addr, accepted, ok := listenOnHost(t, h)
					if !ok {
						continue
					}
					targets = append(targets, target{"host " + h, addr, accepted})
				}
			} else {
				targets = append(targets, target{"off the allowlist", other, otherAccepted})
			}
			for _, tg := range targets {
				dst := netip.MustParseAddrPort(tg.addr)
				send(func(sport uint16) []byte {
					var f []byte
					var start int
					if tc.tmpl.Network.Allow == nil {
						// Sent to 198.51.x.y (passed), written as the target's first two bytes.
						d := dst.Addr().As4()
						f = synFrame4(src, saddr, netip.AddrFrom4([4]byte{198, 51, d[2], d[3]}), dst.Port())
						start = daddrOff
					} else {
						// Sent to the allowed port (passed), written as the other's.
						f = synFrame4(src, saddr, netip.MustParseAddrPort(allowed).Addr(), port(allowed))
						start = dportOff
					}
					binary.BigEndian.PutUint16(f[etherLen+20:], sport)
					want := binary.BigEndian.Uint16(append(dst.Addr().AsSlice(), 0, 0)[0:2])
					if tc.tmpl.Network.Allow != nil {
						want = dst.Port()
					}
					if !steerChecksum(f, start, windowOff, want) {
						t.Fatal("no window word gives the checksum wanted")
					}
					return append(vnetHdr(true, uint16(start), 0), f...)
				})
				if tg.accepted() {
					t.Errorf("%s: a frame whose checksum the kernel wrote over its destination reached the %s listener %s", tc.name, tg.name, tg.addr)
				}
			}
			// The control: the same socket reaches the allowed peer.
			send(func(sport uint16) []byte {
				f := synFrame4(src, saddr, netip.MustParseAddrPort(allowed).Addr(), port(allowed))
				binary.BigEndian.PutUint16(f[etherLen+20:], sport)
				return append(vnetHdr(false, 0, 0), f...)
			})
			if !allowedAccepted() {
				t.Errorf("%s: a plain SYN frame to the allowed %s never arrived: the checks above test nothing", tc.name, allowed)
			}
		})
	}
}

// tagged wraps an Ethernet frame's payload in VLAN tags (802.1ad outer, 802.1Q inner for two).
func tagged(f []byte, tags int) []byte {
	out := append([]byte(nil), f[:12]...)
	for i := 0; i < tags; i++ {
		tpid := []byte{0x81, 0x00}
		if tags > 1 && i == 0 {
			tpid = []byte{0x88, 0xa8}
		}
		out = append(out, tpid[0], tpid[1], 0, 7)
	}
	return append(out, f[12:]...)
}

// withOption gives an IPv4 frame's header a 4-byte option (NOPs), moving the TCP header behind it.
func withOption(f []byte) []byte {
	out := append([]byte(nil), f[:etherLen+20]...)
	out = append(out, 1, 1, 1, 1)
	out = append(out, f[etherLen+20:]...)
	out[etherLen] = 0x46
	binary.BigEndian.PutUint16(out[etherLen+2:], uint16(len(out)-etherLen))
	return out
}

// Frames a compromised sentry could write on eth0, plain or dressed (VLAN tags, stacked tags, IP
// options), to the host by every address pasta could turn into the host: its loopback, its
// addresses (IPv6 link-local ones included), and the gateways pasta offers, which pasta maps to the
// host's loopback unless told not to (--no-map-gw). None may reach a listener on all of the host's
// addresses; a plain SYN written the same way reaches the outside peer.
func TestGvisorNetworkFramesToHost(t *testing.T) {
	n := newGvisor(t)
	_, listenPeer := peerNetns(t)
	peer, peerAccepted := listenPeer()
	_, spec := startSandbox(t, n, gvisorNetTemplate)
	path := filepath.Join(n.gvisorDir(spec.ID), gvisorNetnsFile)
	var send func(f []byte)
	var src net.HardwareAddr
	var gateways []netip.Addr
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
	// The gateways pasta gave the namespace are the host's.
	for _, family := range []string{"-4", "-6"} {
		out, err := exec.Command("ip", family, "route", "show", "default").Output()
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(out))
		for i := range f {
			if f[i] == "via" && i+1 < len(f) {
				gateways = append(gateways, netip.MustParseAddr(f[i+1]))
			}
		}
	}
	addr, accepted := listenOn(t, "[::]:0") // every address of the host, IPv4 and IPv6
	port := netip.MustParseAddrPort(addr).Port()
	saddr4 := netip.MustParseAddr(hostAddrs(t)[0])
	var saddr6 netip.Addr
	if a := hostAddrs6(t); len(a) > 0 {
		saddr6 = a[0]
	}
	dsts := append([]netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::1")}, gateways...)
	all, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range all {
		if ipn, ok := a.(*net.IPNet); ok && !ipn.IP.IsLoopback() {
			ip, _ := netip.AddrFromSlice(ipn.IP)
			dsts = append(dsts, ip.Unmap())
		}
	}
	for _, d := range dsts {
		type dressed struct {
			name  string
			frame []byte
		}
		var frames []dressed
		if d.Is4() {
			f := synFrame4(src, saddr4, d, port)
			frames = []dressed{{"plain", f}, {"vlan", tagged(f, 1)}, {"qinq", tagged(f, 2)}, {"ip-option", withOption(f)}}
		} else if saddr6.IsValid() {
			b := make([]byte, 20)
			synAt(b, 40003, port, false)
			s := saddr6
			if d.IsLinkLocalUnicast() {
				s = netip.MustParseAddr("fe80::2")
			}
			f := frame6(src, s, d, unix.IPPROTO_TCP, b)
			frames = []dressed{{"plain", f}, {"vlan", tagged(f, 1)}}
		}
		for _, fr := range frames {
			send(fr.frame)
			if accepted() {
				t.Errorf("a %s SYN frame to %s reached the host's listener %s", fr.name, d, addr)
			}
		}
	}
	send(synFrame4(src, saddr4, netip.MustParseAddrPort(peer).Addr(), netip.MustParseAddrPort(peer).Port()))
	if !peerAccepted() {
		t.Errorf("a plain SYN frame to the outside %s never arrived: the checks above test nothing", peer)
	}
}
