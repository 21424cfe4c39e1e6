package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"net"
	"testing"
	"time"
)

// listenOn opens a TCP listener on addr ("127.0.0.1:0", "192.0.2.2:0") and reports whether it
// accepted anything.
func listenOn(t *testing.T, addr string) (string, func() bool) {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return serve(t, l)
}

// listenOnHost is listenOn for an address hostAddrs listed: one gone by the time of the bind (an
// interface another package's test removed in between, such as the test cluster's CNI bridge or
// another run's veth) is no longer the host's, so it is skipped (ok false), not a failure.
func listenOnHost(t *testing.T, host string) (addr string, accepted func() bool, ok bool) {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if errors.Is(err, unix.EADDRNOTAVAIL) {
		t.Logf("%s is no longer one of the host's addresses (another test's interface went away): skipped", host)
		return "", nil, false
	}
	if err != nil {
		t.Fatal(err)
	}
	addr, accepted = serve(t, l)
	return addr, accepted, true
}

func serve(t *testing.T, l net.Listener) (string, func() bool) {
	t.Cleanup(func() { l.Close() })
	got := make(chan struct{}, 1)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
			select {
			case got <- struct{}{}:
			default:
			}
		}
	}()
	return l.Addr().String(), func() bool {
		select {
		case <-got:
			return true
		case <-time.After(2 * time.Second): // generous: a positive check waits on a loaded machine
			return false
		}
	}
}

// hostAddrs are the host's non-loopback IPv4 addresses on interfaces that are up.
func hostAddrs(t *testing.T) []string {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			if ip, ok := a.(*net.IPNet); ok && ip.IP.To4() != nil {
				out = append(out, ip.IP.String())
			}
		}
	}
	return out
}

// A network sandbox has a network of its own: nothing that listens on the host's loopback (the
// broker, Redis, /metrics, pprof, other sandboxes' services) nor on any of the host's addresses
// (here also one on a second interface, a veth) is reachable from inside.
func TestNetworkSandboxCannotReachHost(t *testing.T) {
	n := newNamespace(t, Config{})
	peer, _ := peerNetns(t) // the host gets 10.213.N.1 on a second interface
	peerHost := strings.TrimSuffix(peer, ".2") + ".1"
	in, _ := startSandbox(t, n, Template{Network: NetworkOn})
	tried := map[string]bool{}
	probe := func(host string) {
		addr, accepted, ok := listenOnHost(t, host)
		if !ok {
			return
		}
		tried[host] = true
		res, out := sh(t, in, bashConnect(addr))
		if res.ExitCode == 0 || accepted() {
			t.Errorf("a network sandbox reached the host's listener on %s: %+v %q", addr, res, out)
		}
	}
	for _, host := range append([]string{"127.0.0.1"}, hostAddrs(t)...) {
		probe(host)
	}
	if !tried[peerHost] {
		// A CI run lost this test's own veth address at the moment another package's test cluster
		// took its bridge down; cause not found. Say what the host had, put the address back on
		// the veth, and probe it again: the check must not pass without it.
		out, _ := exec.Command("ip", "-4", "addr").CombinedOutput()
		t.Logf("the test's own veth address %s went away; the host's addresses:\n%s", peerHost, out)
		if out, err := exec.Command("ip", "addr", "replace", peerHost+"/30", "dev", peerNetnsHostIf()).CombinedOutput(); err != nil {
			t.Fatalf("put %s back: %v: %s", peerHost, err, out)
		}
		probe(peerHost)
	}
	if !tried["127.0.0.1"] || !tried[peerHost] {
		t.Errorf("the host's loopback and the test's own veth (%s) were not both tried: %v", peerHost, tried)
	}
}

// peerNetnsName names this test process's peer namespace, and peerNetnsHostIf the host's end of
// its veth pair.
func peerNetnsName() string   { return fmt.Sprintf("sbxtest%d", os.Getpid()%100000) }
func peerNetnsHostIf() string { return peerNetnsName() + "h" }

// peerNetns makes a network namespace joined to the host by a veth pair, the host's end
// 10.213.N.1/30 and the peer's 10.213.N.2/30: an "outside" host that needs no internet. It returns
// the peer's address and a function that opens a listener inside the peer namespace.
func peerNetns(t *testing.T) (string, func() (string, func() bool)) {
	t.Helper()
	name := peerNetnsName()
	octet := os.Getpid()%200 + 20
	hostIf, peerIf := peerNetnsHostIf(), name+"p"
	hostIP, peerIP := fmt.Sprintf("10.213.%d.1", octet), fmt.Sprintf("10.213.%d.2", octet)
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", name)
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", hostIf).Run()
		exec.Command("ip", "netns", "del", name).Run()
	})
	run("link", "add", hostIf, "type", "veth", "peer", "name", peerIf)
	run("link", "set", peerIf, "netns", name)
	run("addr", "add", hostIP+"/30", "dev", hostIf)
	run("link", "set", hostIf, "up")
	run("-n", name, "addr", "add", peerIP+"/30", "dev", peerIf)
	run("-n", name, "link", "set", peerIf, "up")
	run("-n", name, "link", "set", "lo", "up")

	return peerIP, func() (string, func() bool) {
		t.Helper()
		// A listening socket stays in the namespace it was made in.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			t.Fatal(err)
		}
		defer self.Close()
		peer, err := os.Open("/run/netns/" + name)
		if err != nil {
			t.Fatal(err)
		}
		defer peer.Close()
		if err := unix.Setns(int(peer.Fd()), unix.CLONE_NEWNET); err != nil {
			t.Fatal(err)
		}
		l, lerr := net.Listen("tcp", peerIP+":0")
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			panic(err) // this thread is in the wrong namespace; it must not run anything else
		}
		if lerr != nil {
			t.Fatal(lerr)
		}
		return serve(t, l)
	}
}

// A network sandbox reaches the outside (here a namespace behind a veth pair, standing for the
// internet this machine may not have) through pasta.
func TestNetworkSandboxEgress(t *testing.T) {
	n := newNamespace(t, Config{})
	_, listenPeer := peerNetns(t)
	addr, accepted := listenPeer()
	in, _ := startSandbox(t, n, Template{Network: NetworkOn})
	if res, out := sh(t, in, bashConnect(addr)); res.ExitCode != 0 || !accepted() {
		t.Fatalf("a network sandbox could not reach %s: %+v %q", addr, res, out)
	}
	// Without the network, the same address is unreachable.
	off, _ := startSandbox(t, n, Template{})
	if res, out := sh(t, off, bashConnect(addr)); res.ExitCode == 0 || accepted() {
		t.Errorf("a sandbox without network reached %s: %+v %q", addr, res, out)
	}
}

// pasta lives exactly as long as its sandbox: stopping the sandbox reaps it.
func TestNetworkHelperEndsWithSandbox(t *testing.T) {
	n := newNamespace(t, Config{})
	spec := Spec{ID: NewID(), Template: Template{Name: "net", Network: NetworkOn}}
	ctx := context.Background()
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Destroy(context.Background(), spec) })
	in, err := n.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	inst := in.(*instance)
	inst.mu.Lock()
	stop := inst.netStop
	inst.mu.Unlock()
	if stop == nil {
		t.Fatal("a network sandbox has no network helper")
	}
	pids := pastaPids(t, spec.ID)
	if len(pids) != 1 {
		t.Fatalf("want one pasta for the sandbox, found %v", pids)
	}
	if err := in.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if pids := pastaPids(t, spec.ID); len(pids) != 0 {
		t.Errorf("pasta outlived its sandbox: %v", pids)
	}
}

// pastaPids are the pasta processes of the sandbox.
func pastaPids(t *testing.T, id string) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil {
			continue
		}
		// The command line names no sandbox (ps shows it to every user); the pid file pasta
		// inherits, in the sandbox's state dir, does.
		pidFile, _ := os.Readlink("/proc/" + e.Name() + "/fd/" + strconv.Itoa(pastaPidFD))
		if strings.HasPrefix(string(b), "pasta\x00") && strings.Contains(pidFile, id) {
			out = append(out, e.Name())
		}
	}
	return out
}

// If the network helper cannot start, neither does the sandbox: never a fallback to the host's
// network, and nothing is left running.
func TestNetworkHelperFailureFailsStart(t *testing.T) {
	for name, pasta := range map[string]string{
		"missing": "/nonexistent/pasta",
		"fails":   "/bin/false",
	} {
		t.Run(name, func(t *testing.T) {
			n := newNamespace(t, Config{PastaPath: pasta})
			spec := Spec{ID: NewID(), Template: Template{Name: "net", Network: NetworkOn}}
			ctx := context.Background()
			if err := n.Create(ctx, spec); err != nil {
				t.Fatal(err)
			}
			_, err := n.Start(ctx, spec)
			if err == nil || !strings.Contains(err.Error(), "network") {
				t.Fatalf("start with a broken network helper: %v", err)
			}
			t.Log(err)
			// Nothing runs: the sandbox can be destroyed, and started without the network.
			if err := n.Destroy(ctx, spec); errors.Is(err, ErrRunning) {
				t.Fatalf("a failed start left the sandbox running: %v", err)
			}
		})
	}
}

// An egress allowlist lets through only what it lists, and the sandbox cannot lift it.
func TestNetworkAllowlist(t *testing.T) {
	n := newNamespace(t, Config{})
	peer, listenPeer := peerNetns(t)
	allowed, allowedAccepted := listenPeer()
	other, otherAccepted := listenPeer()
	_, port, _ := net.SplitHostPort(allowed)
	in, _ := startSandbox(t, n, Template{Network: Network{Enabled: true, Allow: []string{peer + ":" + port}}})
	if res, out := sh(t, in, bashConnect(allowed)); res.ExitCode != 0 || !allowedAccepted() {
		t.Errorf("an allowed destination %s was refused: %+v %q", allowed, res, out)
	}
	if res, out := sh(t, in, bashConnect(other)); res.ExitCode == 0 || otherAccepted() {
		t.Errorf("a destination %s off the allowlist was reached: %+v %q", other, res, out)
	} else if !strings.Contains(out, "refused") {
		t.Errorf("a refused connect should fail at once with connection refused: %q", out)
	}
	// Nothing inside may change the firewall: no capability over the namespace, so netlink
	// requests to nftables are refused (python's socket module speaks raw netlink).
	res, out := sh(t, in, `python3 -c '
import socket
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
# NFT_MSG_DELTABLE (subsys 10, msg 2) for table "sbx", family inet (1), with NLM_F_REQUEST|NLM_F_ACK
import struct
name = b"sbx\0"
attr = struct.pack("=HH", 4 + len(name), 1) + name + b"\0" * ((4 - len(name) % 4) % 4)
body = struct.pack("=BBH", 1, 0, 0) + attr
hdr = struct.pack("=IHHII", 16 + len(body), (10 << 8) | 2, 1 | 4, 1, 0)
s.send(hdr + body)
r = s.recv(4096)
print(struct.unpack("=i", r[16:20])[0])
'`)
	if res.ExitCode != 0 || strings.TrimSpace(out) != "-1" {
		t.Errorf("deleting the firewall from inside: want -1 (EPERM), got %+v %q", res, out)
	}
	if res, out := sh(t, in, bashConnect(other)); res.ExitCode == 0 || otherAccepted() {
		t.Errorf("after the attempt, %s off the allowlist was reached: %+v %q", other, res, out)
	}
}
