package provider

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// inNetns runs f on a thread in the network namespace at path (sockets it opens stay there).
func inNetns(t *testing.T, path string, f func()) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	ns, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			panic(err) // this thread is in the wrong namespace; it must not run anything else
		}
	}()
	f()
}

// vethNetns is a network namespace holding a veth pair v0/v1, both up, with no address: frames
// sent on v0 arrive on v1. It returns the namespace's path.
func vethNetns(t *testing.T) string {
	t.Helper()
	name := fmt.Sprintf("sbxeg%d%s", os.Getpid()%100000, strings.ReplaceAll(strings.ToLower(t.Name()), "/", ""))
	if len(name) > 40 {
		name = name[:40]
	}
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	run("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
	run("-n", name, "link", "set", "v0", "up")
	run("-n", name, "link", "set", "v1", "up")
	return "/run/netns/" + name
}

// udpFrame is an Ethernet frame with an IPv4 UDP datagram to dst:port carrying tag.
func udpFrame(dst netip.Addr, port uint16, tag string) []byte {
	payload := []byte(tag)
	ip := make([]byte, 20+8+len(payload))
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(len(ip)))
	ip[8] = 64
	ip[9] = unix.IPPROTO_UDP
	copy(ip[12:16], []byte{10, 99, 0, 2})
	d := dst.As4()
	copy(ip[16:20], d[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	binary.BigEndian.PutUint16(ip[20:], 40000)
	binary.BigEndian.PutUint16(ip[22:], port)
	binary.BigEndian.PutUint16(ip[24:], uint16(8+len(payload)))
	copy(ip[28:], payload)
	eth := append([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0, 0, 0, 0, 1, 0x08, 0x00}, ip...)
	return eth
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// The gvisor level's firewall sits on the netdev egress hook of the interface gVisor's netstack
// sends on, because the sentry's frames go out through an AF_PACKET socket and never pass the IP
// layer's hooks. This checks on the running kernel that the hook sees such frames, by both of
// AF_PACKET's transmit paths (the qdisc, and PACKET_QDISC_BYPASS, which runsc does not set but a
// compromised sentry might try), and that a frame whose declared protocol disagrees with its
// ethertype cannot slip past: each refused frame is sent before an allowed one on the same
// socket, and none may be among what arrives on the veth's other end.
func TestNetdevEgressSeesPacketSockets(t *testing.T) {
	for _, tc := range []struct {
		name  string
		allow []string
		pass  []netip.AddrPort // arrive
		drop  []netip.AddrPort // must not
	}{
		{name: "broad",
			pass: []netip.AddrPort{netip.MustParseAddrPort("10.1.1.1:53")},
			drop: []netip.AddrPort{netip.MustParseAddrPort("10.9.9.9:53"), netip.MustParseAddrPort("127.0.0.1:53"), netip.MustParseAddrPort("0.0.0.0:53")}},
		{name: "allowlist", allow: []string{"10.1.1.0/24:53"},
			pass: []netip.AddrPort{netip.MustParseAddrPort("10.1.1.1:53")},
			drop: []netip.AddrPort{netip.MustParseAddrPort("10.1.1.1:54"), netip.MustParseAddrPort("10.1.2.1:53"), netip.MustParseAddrPort("10.9.9.9:53")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := vethNetns(t)
			ns, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer ns.Close()
			var allow []egressRule
			if tc.allow != nil {
				if allow, err = parseAllow(tc.allow); err != nil {
					t.Fatal(err)
				}
			}
			if err := applyNetdevEgress(int(ns.Fd()), "v0", []netip.Addr{netip.MustParseAddr("10.9.9.9")}, allow); err != nil {
				t.Fatal(err)
			}
			var got []string
			inNetns(t, path, func() {
				v0, err1 := net.InterfaceByName("v0")
				v1, err2 := net.InterfaceByName("v1")
				if err1 != nil || err2 != nil {
					t.Fatal(err1, err2)
				}
				rx, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
				if err != nil {
					t.Fatal(err)
				}
				defer unix.Close(rx)
				if err := unix.Bind(rx, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: v1.Index}); err != nil {
					t.Fatal(err)
				}
				// A safety net only: the test ends on the last allowed frame.
				unix.SetsockoptTimeval(rx, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 10})
				// As runsc makes the sentry's socket: protocol 0, bound with ETH_P_ALL.
				tx := func(bypass bool) int {
					fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { unix.Close(fd) })
					if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: v0.Index}); err != nil {
						t.Fatal(err)
					}
					if bypass {
						if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_QDISC_BYPASS, 1); err != nil {
							t.Fatal(err)
						}
					}
					return fd
				}
				// A frame the egress hook drops is reported to its sender as ENOBUFS (the
				// sentry's netstack counts it as a send error); what counts is what arrives.
				send := func(fd int, f []byte) {
					if _, err := unix.Write(fd, f); err != nil && err != unix.ENOBUFS {
						t.Fatalf("send: %v", err)
					}
				}
				for _, bypass := range []bool{false, true} {
					fd := tx(bypass)
					for _, d := range tc.drop {
						send(fd, udpFrame(d.Addr(), d.Port(), fmt.Sprintf("drop %v bypass=%v", d, bypass)))
					}
					// An IPv4 frame declared as ARP, to an allowed destination: only a rule that
					// trusted the declaration would pass it.
					for _, d := range tc.pass {
						f := udpFrame(d.Addr(), d.Port(), fmt.Sprintf("declared-arp %v bypass=%v", d, bypass))
						if err := unix.Sendto(fd, f, 0, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ARP), Ifindex: v0.Index, Halen: 6, Addr: [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}}); err != nil && err != unix.ENOBUFS {
							t.Fatalf("sendto: %v", err)
						}
					}
					for _, d := range tc.pass {
						send(fd, udpFrame(d.Addr(), d.Port(), fmt.Sprintf("pass %v bypass=%v", d, bypass)))
					}
				}
				want := 2 * len(tc.pass)
				buf := make([]byte, 2048)
				for passed := 0; passed < want; {
					n, err := unix.Read(rx, buf)
					if err != nil {
						t.Fatalf("receive on v1 after %q: %v", got, err)
					}
					if n < 42 || binary.BigEndian.Uint16(buf[12:]) != unix.ETH_P_IP || buf[14+9] != unix.IPPROTO_UDP {
						continue // the kernel's own (IPv6 neighbour discovery on the new links)
					}
					tag := string(buf[42:n])
					got = append(got, tag)
					if strings.HasPrefix(tag, "pass ") {
						passed++
					}
				}
			})
			for _, tag := range got {
				if !strings.HasPrefix(tag, "pass ") {
					t.Errorf("the firewall let through %q (all that arrived: %q)", tag, got)
				}
			}
			if !slices.ContainsFunc(got, func(s string) bool { return strings.HasSuffix(s, "bypass=true") }) {
				t.Errorf("nothing came through the qdisc bypass: the check tests nothing: %q", got)
			}
		})
	}
}
