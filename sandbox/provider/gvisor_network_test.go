package provider

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/sbxbroker/broker/tests/wait"
	"golang.org/x/sys/unix"
)

var gvisorNetTemplate = Template{Name: "gvnet", Isolation: IsolationGvisor, Network: NetworkOn}

// A gvisor network sandbox reaches nothing of the host's: not its loopback (by 127.0.0.1, ::1,
// 0.0.0.0 or an IPv4-mapped address, all of which pasta would connect to on the host), not its
// address on the outbound interface, not its address on a second interface (a veth here), and a
// refused connect fails at once. The last address is what only the firewall stands in front of,
// so it also shows that each of its layers holds alone: with the answering rules on the veth
// opened, the tap's drop rules still keep it out; with those gone too, the host's wall for pasta
// does; with that gone as well, the same connect reaches the host, so the checks are not passing
// for another reason.
func TestGvisorNetworkCannotReachHost(t *testing.T) {
	n := newGvisor(t)
	peer, _ := peerNetns(t) // the host gets 10.213.N.1 on a second interface, the peer N.2
	// A uid of its own: the end takes it off the host's wall for pasta, which holds every
	// sandbox's uid, and no other sandbox may lose that wall meanwhile.
	uid := 250000 + os.Getpid()%10000
	in, spec := startSandboxWith(t, n, gvisorNetTemplate, uid)
	type target struct{ listen, dial string }
	var targets []target
	for _, host := range append([]string{"127.0.0.1"}, hostAddrs(t)...) {
		targets = append(targets, target{host, host})
	}
	targets = append(targets, target{"0.0.0.0", "0.0.0.0"}, target{"0.0.0.0", "::ffff:127.0.0.1"}, target{"::1", "::1"})
	for _, tg := range targets {
		addr, accepted, ok := listenOnHost(t, tg.listen)
		if !ok {
			continue
		}
		_, port, _ := net.SplitHostPort(addr)
		res, out := sh(t, in, bashConnect(net.JoinHostPort(tg.dial, port)))
		t.Logf("%s -> host %s: exit %d %q", tg.dial, addr, res.ExitCode, out)
		if res.ExitCode == 0 || accepted() {
			t.Errorf("a gvisor network sandbox reached the host's listener on %s by %s: %+v %q", addr, tg.dial, res, out)
		} else if !strings.Contains(out, "refused") {
			t.Errorf("a refused connect to %s should fail at once with connection refused: %q", tg.dial, out)
		}
	}
	// Without the firewall, pasta connects the sandbox to the host's second interface: this
	// test's own (another run's or test's veth may be on the host too, and go at any moment).
	peerHost := strings.TrimSuffix(peer, ".2") + ".1"
	if !slices.Contains(hostAddrs(t), peerHost) {
		t.Fatalf("the host has no address %s on the test's veth", peerHost)
	}
	path := filepath.Join(n.gvisorDir(spec.ID), gvisorNetnsFile)
	ns, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	var tapIndex int
	inNetns(t, path, func() {
		tap, err := net.InterfaceByName(gvisorTapIf)
		if err != nil {
			t.Fatal(err)
		}
		tapIndex = tap.Index
	})
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	table := &nftables.Table{Name: egressTable, Family: nftables.TableFamilyNetdev}
	fromSandbox := &nftables.Chain{Name: "from-sandbox", Table: table}
	c.FlushChain(fromSandbox)
	c.AddRule(&nftables.Rule{Table: table, Chain: fromSandbox, Exprs: []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint32(uint32(tapIndex))},
		&expr.Dup{RegDev: 1, IsRegDevSet: true},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}})
	if err := c.Flush(); err != nil {
		t.Fatalf("open the veth's rules: %v", err)
	}
	addr, accepted := listenOn(t, net.JoinHostPort(peerHost, "0"))
	if res, out := sh(t, in, bashConnect(addr)); res.ExitCode == 0 || accepted() {
		t.Errorf("with only the tap's rules left, the host's %s was reached: %+v %q", addr, res, out)
	}
	c.DelChain(&nftables.Chain{Name: "egress", Table: table})
	if err := c.Flush(); err != nil {
		t.Fatalf("delete the tap's rules: %v", err)
	}
	// The host's wall for pasta holds alone too.
	if res, out := sh(t, in, bashConnect(addr)); res.ExitCode == 0 || accepted() {
		t.Errorf("with only the host's wall for pasta left, the host's %s was reached: %+v %q", addr, res, out)
	}
	host, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	wall := &nftables.Set{Table: &nftables.Table{Name: pastaWallTable, Family: nftables.TableFamilyINet}, Name: pastaWallSet, KeyType: nftables.TypeUID}
	if err := host.SetDeleteElements(wall, []nftables.SetElement{{Key: binaryutil.NativeEndian.PutUint32(uint32(uid))}}); err != nil {
		t.Fatal(err)
	}
	if err := host.Flush(); err != nil {
		t.Fatalf("take the sandbox's uid off the host's wall for pasta: %v", err)
	}
	if res, out := sh(t, in, bashConnect(addr)); res.ExitCode != 0 || !accepted() {
		t.Errorf("with the firewall opened the host's %s was still out of reach, so the checks above test nothing: %+v %q", addr, res, out)
	}
}

// A gvisor network sandbox reaches the outside (a namespace behind a veth pair, standing for the
// internet) through pasta; a gvisor sandbox without the network does not.
func TestGvisorNetworkEgress(t *testing.T) {
	n := newGvisor(t)
	_, listenPeer := peerNetns(t)
	addr, accepted := listenPeer()
	start := time.Now()
	in, _ := startSandbox(t, n, gvisorNetTemplate)
	t.Logf("create to ready with the network: %v", time.Since(start))
	if res, out := sh(t, in, bashConnect(addr)); res.ExitCode != 0 || !accepted() {
		t.Fatalf("a gvisor network sandbox could not reach %s: %+v %q", addr, res, out)
	}
	// A bulk transfer: gVisor sends segments far above a frame's usual size (the MTU is pasta's
	// 65520, and large sends go as GSO frames), through the veth, the copy to the tap and both
	// sets of rules.
	peerIP, _, _ := net.SplitHostPort(addr)
	var bulk string
	var got chan int64
	inNetns(t, peerNetnsPath(), func() {
		l, err := net.Listen("tcp", net.JoinHostPort(peerIP, "0"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		bulk = l.Addr().String()
		got = make(chan int64, 1)
		go func() {
			c, err := l.Accept()
			if err != nil {
				got <- -1
				return
			}
			defer c.Close()
			n, _ := io.Copy(io.Discard, c)
			got <- n
		}()
	})
	host, port, _ := net.SplitHostPort(bulk)
	const size = 32 << 20
	res, out := sh(t, in, fmt.Sprintf("bash -c 'head -c %d /dev/zero > /dev/tcp/%s/%s'", size, host, port))
	if res.ExitCode != 0 {
		t.Fatalf("bulk send: %+v %q", res, out)
	}
	t.Logf("bulk send of %d MiB: %v", size>>20, res.Duration)
	select {
	case n := <-got:
		if n != size {
			t.Errorf("the peer received %d bytes, want %d", n, size)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the peer never saw the end of the bulk transfer")
	}
	// Only eth0 is the sandbox's: the firewall's veth end and pasta's tap have no address, so runsc
	// passes over them.
	if _, out := sh(t, in, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ' '"); out != "eth0 lo " {
		t.Errorf("interfaces inside: %q, want eth0 and lo", out)
	}
	start = time.Now()
	off, _ := startSandbox(t, n, gvisorTemplate)
	t.Logf("create to ready without: %v", time.Since(start))
	if res, out := sh(t, off, bashConnect(addr)); res.ExitCode == 0 || accepted() {
		t.Errorf("a gvisor sandbox without network reached %s: %+v %q", addr, res, out)
	}
}

// An egress allowlist at the gvisor level lets through only what it lists.
func TestGvisorNetworkAllowlist(t *testing.T) {
	n := newGvisor(t)
	peer, listenPeer := peerNetns(t)
	allowed, allowedAccepted := listenPeer()
	other, otherAccepted := listenPeer()
	_, port, _ := net.SplitHostPort(allowed)
	tmpl := gvisorNetTemplate
	tmpl.Network = Network{Enabled: true, Allow: []string{peer + ":" + port}}
	in, _ := startSandbox(t, n, tmpl)
	if res, out := sh(t, in, bashConnect(allowed)); res.ExitCode != 0 || !allowedAccepted() {
		t.Errorf("an allowed destination %s was refused: %+v %q", allowed, res, out)
	}
	if res, out := sh(t, in, bashConnect(other)); res.ExitCode == 0 || otherAccepted() {
		t.Errorf("a destination %s off the allowlist was reached: %+v %q", other, res, out)
	} else if !strings.Contains(out, "refused") {
		t.Errorf("a refused connect should fail at once with connection refused: %q", out)
	}
}

// netnsHeld says whether anything on the host still holds the network namespace with inode ino: a
// mount, or a process in it.
func netnsHeld(ino uint64) bool {
	ref := fmt.Sprintf("net:[%d]", ino)
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(b), ref) {
		return true
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if l, err := os.Readlink("/proc/" + e.Name() + "/ns/net"); err == nil && l == ref {
			return true
		}
	}
	return false
}

// Stopping a gvisor network sandbox leaves nothing: no runsc, no pasta, no namespace (and so no
// firewall table, which lives in it), no mount, no cgroup.
func TestGvisorNetworkTeardown(t *testing.T) {
	n := newGvisor(t)
	in, spec := startSandbox(t, n, gvisorNetTemplate)
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(n.gvisorDir(spec.ID), gvisorNetnsFile), &st); err != nil {
		t.Fatal(err)
	}
	if !netnsHeld(st.Ino) {
		t.Fatal("cannot see the sandbox's network namespace: the check below tests nothing")
	}
	if pids := pastaPids(t, spec.ID); len(pids) != 1 {
		t.Fatalf("want one pasta for the sandbox, found %v", pids)
	}
	if err := in.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	assertNoLeftovers(t, n, spec.ID)
	if pids := pastaPids(t, spec.ID); len(pids) != 0 {
		t.Errorf("pasta outlived its sandbox: %v", pids)
	}
	if netnsHeld(st.Ino) {
		t.Error("the sandbox's network namespace outlived it")
	}
	// A resume gets a namespace of its own again, and its stop leaves nothing either.
	again, err := n.Start(context.Background(), spec)
	if err != nil {
		t.Fatalf("resume: %v", err)
	}
	if _, out := sh(t, again, "grep -c eth0 /proc/net/dev"); out != "1\n" {
		t.Errorf("after a resume, eth0 inside: %q", out)
	}
	if err := again.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	assertNoLeftovers(t, n, spec.ID)
	if pids := pastaPids(t, spec.ID); len(pids) != 0 {
		t.Errorf("pasta outlived the resumed sandbox: %v", pids)
	}
}

// If the network cannot be set up, a gvisor network sandbox does not start, and nothing is left;
// a host without pasta refuses such templates at create.
func TestGvisorNetworkFailure(t *testing.T) {
	requireRunsc(t)
	n := newNamespace(t, Config{PastaPath: "/nonexistent/pasta"})
	if err := CheckIsolation(n, gvisorNetTemplate); !errors.Is(err, ErrIsolationUnavailable) || !strings.Contains(err.Error(), "pasta") {
		t.Errorf("no pasta: %v", err)
	}
	n = newNamespace(t, Config{PastaPath: "/bin/false"})
	spec := Spec{ID: NewID(), Template: gvisorNetTemplate}
	ctx := context.Background()
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Destroy(context.Background(), spec) })
	if in, err := n.Start(ctx, spec); err == nil {
		in.Stop(ctx)
		t.Fatal("a gvisor network sandbox started with a failing pasta")
	} else {
		t.Log(err)
	}
	assertNoLeftovers(t, n, spec.ID)
	if err := n.Destroy(ctx, spec); errors.Is(err, ErrRunning) {
		t.Fatalf("a failed start left the sandbox running: %v", err)
	}
}

// A broker killed with -9 takes its gvisor network sandbox's pasta with it (Pdeathsig), and the
// next broker on the data dir removes the namespace's mount with the rest of the runsc state, so
// the namespace and its firewall are gone.
func TestGvisorNetworkBrokerCrash(t *testing.T) {
	id := gvisorBrokerCrash(t, crashGvisorNetwork)
	wait.Eventually(t, 10*time.Second, func() bool { return len(pastaPids(t, id)) == 0 }, "the crashed broker's pasta to end")
	// Only this sandbox's: tests running beside this one (and other packages' clusters) mount
	// network namespaces of their own meanwhile.
	if left := netnsMountsOf(id); len(left) > 0 {
		t.Errorf("network namespace mounts of the crashed broker's sandbox left: %v", left)
	}
}

// netnsMountsOf are the host's mounts of network namespaces that belong to sandbox id.
func netnsMountsOf(id string) []string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[3], "net:[") && strings.Contains(f[4], "/"+id+"/") {
			out = append(out, f[3]+" "+f[4])
		}
	}
	return out
}

// peerNetns6 is peerNetns over IPv6: a namespace behind a veth pair, the host's end fd13:N::1/64
// and the peer's fd13:N::2/64 (no duplicate address detection, so both are usable at once). It
// returns the host's address and a function that opens a listener inside the peer namespace.
func peerNetns6(t *testing.T) (string, func() (string, func() bool)) {
	t.Helper()
	name := fmt.Sprintf("sbxt6%d", os.Getpid()%100000)
	hostIf, peerIf := name+"h", name+"p"
	prefix := fmt.Sprintf("fd13:%x::", os.Getpid()%0xffff)
	hostIP, peerIP := prefix+"1", prefix+"2"
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
	run("addr", "add", hostIP+"/64", "dev", hostIf, "nodad")
	run("link", "set", hostIf, "up")
	run("-n", name, "addr", "add", peerIP+"/64", "dev", peerIf, "nodad")
	run("-n", name, "link", "set", peerIf, "up")
	run("-n", name, "link", "set", "lo", "up")
	return hostIP, func() (string, func() bool) {
		t.Helper()
		var addr string
		var accepted func() bool
		inNetns(t, "/run/netns/"+name, func() {
			l, err := net.Listen("tcp", net.JoinHostPort(peerIP, "0"))
			if err != nil {
				t.Fatal(err)
			}
			addr, accepted = serve(t, l)
		})
		return addr, accepted
	}
}

// The same over IPv6: the gvisor sandbox reaches an outside IPv6 listener (so neighbour discovery
// with pasta works through the firewall), listed or not per the allowlist, and not the host's
// IPv6 address on its second interface.
func TestGvisorNetworkIPv6(t *testing.T) {
	n := newGvisor(t)
	hostIP, listenPeer := peerNetns6(t)
	allowed, allowedAccepted := listenPeer()
	other, otherAccepted := listenPeer()
	hostAddr, hostAccepted := listenOn(t, net.JoinHostPort(hostIP, "0"))
	broad, _ := startSandbox(t, n, gvisorNetTemplate)
	if res, out := sh(t, broad, bashConnect(other)); res.ExitCode != 0 || !otherAccepted() {
		t.Errorf("a gvisor network sandbox could not reach %s: %+v %q", other, res, out)
	}
	if res, out := sh(t, broad, bashConnect(hostAddr)); res.ExitCode == 0 || hostAccepted() {
		t.Errorf("a gvisor network sandbox reached the host's %s: %+v %q", hostAddr, res, out)
	} else if !strings.Contains(out, "refused") {
		t.Errorf("a refused IPv6 connect should fail at once with connection refused: %q", out)
	}
	host, port, _ := net.SplitHostPort(allowed)
	tmpl := gvisorNetTemplate
	tmpl.Network = Network{Enabled: true, Allow: []string{"[" + host + "]:" + port}}
	listed, _ := startSandbox(t, n, tmpl)
	if res, out := sh(t, listed, bashConnect(allowed)); res.ExitCode != 0 || !allowedAccepted() {
		t.Errorf("an allowed IPv6 destination %s was refused: %+v %q", allowed, res, out)
	}
	if res, out := sh(t, listed, bashConnect(other)); res.ExitCode == 0 || otherAccepted() {
		t.Errorf("an IPv6 destination %s off the allowlist was reached: %+v %q", other, res, out)
	} else if !strings.Contains(out, "refused") {
		t.Errorf("a refused IPv6 connect should fail at once with connection refused: %q", out)
	}
}

// peerNetnsPath is the namespace peerNetns makes.
func peerNetnsPath() string {
	return fmt.Sprintf("/run/netns/sbxtest%d", os.Getpid()%100000)
}
