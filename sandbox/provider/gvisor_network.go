package provider

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A gvisor sandbox with network: true runs runsc --network=sandbox in a network namespace the
// broker prepares before runsc starts:
//
//  1. a user namespace owned by the sandbox's uid with a network namespace in it, made by unshare(1)
//     run as that uid (pasta, running as the uid, may join only a namespace its uid owns), kept by a
//     bind mount in the sandbox's runsc state (<state>/gvisor/netns), which stop and the next
//     broker start remove with the rest of that state;
//  2. pasta attached to it as at the namespace level, its tap (sbxtap) configured with the host's
//     addresses and routes;
//  3. a veth pair, eth0 for the sentry and sbxfw its peer; pasta's addresses, routes, MTU and MAC
//     move from the tap to eth0, so that the tap and sbxfw have no address left (runsc passes over
//     an interface without one); eth0's transmit checksum offload is turned off (noTxOffload), so
//     that no byte of a frame changes after the rules read it;
//  4. the firewall (egress.go), twice: on the tap's netdev egress hook, the one place every frame
//     bound for pasta passes, drop rules (applyNetdevEgress); on sbxfw's ingress hook, where every
//     frame the sentry sends on eth0 arrives, the same rules with answers, a reset or an ICMP
//     error sent back to the sentry at once, and what passes handed to the tap (applyNetdevIngress);
//     what pasta sends on the tap is handed to sbxfw, and so reaches eth0;
//  5. runsc, named the namespace in the OCI spec, copies eth0's addresses and routes into gVisor's
//     netstack, removes them from the host side, and hands the sentry a packet socket on eth0.
//
// The sentry's frames never pass the namespace's IP layer (an AF_PACKET socket), so neither
// firewall can sit on an IP hook; a netdev egress hook cannot answer (Linux refuses reject there),
// hence the veth: its peer's ingress hook can, and the tap's egress hook stays the wall that holds
// whatever the ingress rules let through.
//
// The sentry never sees the host's network namespace; nothing in the sandbox can change the
// firewall (gVisor's processes have no host capabilities, and the sentry's seccomp filter allows
// it no socket of its own, netlink or other). If any step fails the sandbox does not start.

// gvisorNetnsFile is the bind mount of the sandbox's network namespace in its runsc state dir.
const gvisorNetnsFile = "netns"

// startGvisorNetwork prepares the network namespace at path (steps 1-4 above) and returns its
// running pasta. On error nothing is left: no mount, no process.
func (n *Namespace) startGvisorNetwork(ctx context.Context, spec Spec, path string, uid, gid int) (*netHelper, error) {
	if n.pastaErr != nil {
		return nil, n.pastaErr
	}
	if n.gv.netErr != nil {
		return nil, n.gv.netErr
	}
	var allow []egressRule
	if len(spec.Template.Network.Allow) > 0 {
		var err error
		if allow, err = parseAllow(spec.Template.Network.Allow); err != nil {
			return nil, err
		}
	}
	hostAddrs, err := localAddrs()
	if err != nil {
		return nil, fmt.Errorf("sandbox network: %w", err)
	}
	if err := n.makeNetns(ctx, path, uid, gid); err != nil {
		return nil, err
	}
	done := false
	defer func() {
		if !done {
			unix.Unmount(path, unix.MNT_DETACH)
			os.Remove(path)
		}
	}()
	netns, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("sandbox network: %w", err)
	}
	defer netns.Close()
	fd, err := unix.IoctlRetInt(int(netns.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		return nil, fmt.Errorf("sandbox network: owner of the network namespace: %w", err)
	}
	userns := os.NewFile(uintptr(fd), "userns")
	defer userns.Close()
	h, err := n.startPasta(ctx, spec, userns, netns, "--ns-ifname", gvisorTapIf)
	if err != nil {
		return nil, err
	}
	// The tap exists only once pasta made it, so the rules follow pasta here; runsc, and with it
	// anything of the sandbox's, starts only after them.
	if err := n.plumbGvisorNetwork(ctx, path, int(netns.Fd()), hostAddrs, allow); err != nil {
		h.stop()
		return nil, fmt.Errorf("sandbox network: %w", err)
	}
	done = true
	return h, nil
}

// Interfaces of a gvisor sandbox's network namespace besides eth0 (gvisorIfname).
const (
	gvisorFwIf  = "sbxfw"  // eth0's peer, where the firewall answers
	gvisorTapIf = "sbxtap" // pasta's tap
)

// ipLink is a link in `ip -j addr` output.
type ipLink struct {
	Index    int    `json:"ifindex"`
	Name     string `json:"ifname"`
	MTU      int    `json:"mtu"`
	Address  string `json:"address"`
	AddrInfo []struct {
		Family    string `json:"family"`
		Local     string `json:"local"`
		PrefixLen int    `json:"prefixlen"`
		Scope     string `json:"scope"`
	} `json:"addr_info"`
}

// ipRoute is a route in `ip -j route` output.
type ipRoute struct {
	Dst      string   `json:"dst"`
	Gateway  string   `json:"gateway"`
	Protocol string   `json:"protocol"`
	Metric   int      `json:"metric"`
	Flags    []string `json:"flags"`

	isDefault bool
}

// ip runs ip(8) in the network namespace at path.
func (n *Namespace) ip(ctx context.Context, path, stdin string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, n.gv.nsenter, append([]string{"--net=" + path, "--", n.gv.ip}, args...)...)
	cmd.Dir = "/"
	cmd.Env = []string{}
	cmd.Stdin = strings.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// plumbGvisorNetwork does steps 3 and 4 above in the network namespace at path (netnsFD).
func (n *Namespace) plumbGvisorNetwork(ctx context.Context, path string, netnsFD int, hostAddrs []netip.Addr, allow []egressRule) error {
	var tap []ipLink
	out, err := n.ip(ctx, path, "", "-j", "addr", "show", "dev", gvisorTapIf)
	if err == nil {
		err = json.Unmarshal(out, &tap)
	}
	if err == nil && len(tap) != 1 {
		err = fmt.Errorf("pasta's tap %s not found", gvisorTapIf)
	}
	if err != nil {
		return err
	}
	var routes []ipRoute
	for _, family := range []string{"-4", "-6"} {
		var rs []ipRoute
		out, err := n.ip(ctx, path, "", "-j", family, "route", "show", "dev", gvisorTapIf)
		if err == nil {
			err = json.Unmarshal(out, &rs)
		}
		if err != nil {
			return err
		}
		for _, r := range rs {
			// `default` alone is IPv4's to ip route add, even with an IPv6 gateway.
			if r.Dst == "default" {
				r.Dst = map[string]string{"-4": "0.0.0.0/0", "-6": "::/0"}[family]
				r.isDefault = true
			}
			routes = append(routes, r)
		}
	}
	var mac [6]byte
	if _, err := rand.Read(mac[:]); err != nil {
		return err
	}
	mac[0] = mac[0]&^1 | 2 // unicast, locally administered
	l := tap[0]
	mtu := strconv.Itoa(l.MTU)
	batch := []string{
		"link add " + gvisorIfname + " type veth peer name " + gvisorFwIf,
		// No address on either: no IPv6 link-local appears when they come up.
		"link set " + gvisorFwIf + " addrgenmode none",
		"link set " + gvisorTapIf + " addrgenmode none",
	}
	// The tap's routes go before its addresses: an IPv6 route through a gateway outlives the
	// address it was reached by.
	for _, r := range routes {
		if r.Protocol != "kernel" {
			batch = append(batch, "route del "+r.Dst+" dev "+gvisorTapIf)
		}
	}
	batch = append(batch,
		"addr flush dev "+gvisorTapIf,
		// pasta knows the namespace's side by the tap's MAC: eth0 takes it over.
		"link set "+gvisorTapIf+" address "+net.HardwareAddr(mac[:]).String(),
		"link set "+gvisorIfname+" address "+l.Address,
		"link set "+gvisorIfname+" mtu "+mtu,
		"link set "+gvisorFwIf+" mtu "+mtu,
		"link set "+gvisorFwIf+" up",
		"link set "+gvisorIfname+" up",
	)
	for _, a := range l.AddrInfo {
		if a.Scope != "global" {
			continue
		}
		line := fmt.Sprintf("addr add %s/%d dev %s", a.Local, a.PrefixLen, gvisorIfname)
		if a.Family == "inet6" {
			line += " nodad"
		}
		batch = append(batch, line)
	}
	// Routes without a gateway first: a gateway's own route comes before a route through it.
	for _, withGateway := range []bool{false, true} {
		for _, r := range routes {
			if r.Protocol == "kernel" || (r.Gateway != "") != withGateway || r.isDefault && r.Gateway == "" {
				continue
			}
			line := "route add " + r.Dst
			if r.Gateway != "" {
				line += " via " + r.Gateway
			}
			line += " dev " + gvisorIfname
			if r.Metric > 0 {
				line += " metric " + strconv.Itoa(r.Metric)
			}
			if slices.Contains(r.Flags, "onlink") { // a gateway outside the address's prefix
				line += " onlink"
			}
			batch = append(batch, line)
		}
	}
	if _, err := n.ip(ctx, path, strings.Join(batch, "\n")+"\n", "-batch", "-"); err != nil {
		return err
	}
	if err := noTxOffload(netnsFD, gvisorIfname); err != nil {
		return err
	}
	var links []ipLink
	out, err = n.ip(ctx, path, "", "-j", "link", "show")
	if err == nil {
		err = json.Unmarshal(out, &links)
	}
	if err != nil {
		return err
	}
	index := map[string]int{}
	for _, l := range links {
		index[l.Name] = l.Index
	}
	if index[gvisorFwIf] == 0 || index[gvisorTapIf] == 0 {
		return fmt.Errorf("interfaces %s and %s not found", gvisorFwIf, gvisorTapIf)
	}
	// The wall first: from the moment anything is handed to the tap, the tap's rules hold.
	if err := applyNetdevEgress(netnsFD, gvisorTapIf, hostAddrs, allow); err != nil {
		return err
	}
	return applyNetdevIngress(netnsFD, gvisorFwIf, gvisorTapIf, index[gvisorFwIf], index[gvisorTapIf], hostAddrs, allow)
}

// makeNetns makes a user namespace owned by uid with a network namespace in it, and binds the
// network namespace at path. unshare(1) runs as uid and execs cat, which echoes a byte once it runs
// in the new namespaces; the bind keeps them after cat is gone.
func (n *Namespace) makeNetns(ctx context.Context, path string, uid, gid int) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("sandbox network: %w", err)
	}
	f.Close()
	bound := false
	defer func() {
		if !bound {
			os.Remove(path)
		}
	}()
	stderr := &headBuffer{max: 4 << 10}
	cmd := exec.CommandContext(ctx, n.gv.unshare, "--user", "--net", "cat")
	cmd.Dir = "/"
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	cmd.Stderr = stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Pdeathsig:  syscall.SIGKILL,
		Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}},
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return fmt.Errorf("sandbox network: %w", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return fmt.Errorf("sandbox network: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("sandbox network: start %s: %w", n.gv.unshare, err)
	}
	defer func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	}()
	var b [1]byte
	if _, err := stdin.Write([]byte{'.'}); err == nil {
		_, err = io.ReadFull(stdout, b[:])
	}
	if err != nil || b[0] != '.' {
		cmd.Process.Kill()
		cmd.Wait()
		return fmt.Errorf("sandbox network: unshare could not make the sandbox's network namespace: %v %s", err, stderr.String())
	}
	if err := unix.Mount(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid), path, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("sandbox network: keep the network namespace: %w", err)
	}
	bound = true
	return nil
}

// noTxOffload turns transmit checksum offload off on dev (eth0) in the network namespace netnsFD
// refers to, and checks it is off. The sentry's packet socket takes a virtio_net_hdr with each
// frame (runsc sets PACKET_VNET_HDR for GSO), in which the sender names where the kernel is to
// write the frame's checksum and where its TCP header starts for segmentation. With offload on,
// the kernel does both only where a device cannot, the tap, after both sets of rules read the
// frame: the sender could rewrite any two bytes of a frame they passed (its destination address,
// to the host's loopback; its port, to one off the allowlist). With offload off on eth0, the
// kernel checksums and segments as eth0 transmits, before the frame reaches sbxfw, so the rules
// read the frame pasta gets.
func noTxOffload(netnsFD int, dev string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// The thread goes back to its own namespace, or ends with this goroutine (still locked).
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer self.Close()
		if err := unix.Setns(netnsFD, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		err = setTxChecksum(dev, false)
		if unix.Setns(int(self.Fd()), unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		return fmt.Errorf("transmit checksum offload off on %s: %w", dev, err)
	}
	return nil
}

// ethtoolIfreq is struct ifreq with ifr_data, for SIOCETHTOOL.
type ethtoolIfreq struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [16]byte
}

// ethtoolValue is struct ethtool_value.
type ethtoolValue struct{ cmd, data uint32 }

// setTxChecksum sets transmit checksum offload on dev of the calling thread's network namespace
// (ETHTOOL_STXCSUM, which takes TSO with it), and checks the device took it (ETHTOOL_GTXCSUM).
func setTxChecksum(dev string, on bool) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ethtool := func(cmd, data uint32) (uint32, error) {
		v := &ethtoolValue{cmd: cmd, data: data}
		ifr := &ethtoolIfreq{data: unsafe.Pointer(v)}
		copy(ifr.name[:unix.IFNAMSIZ-1], dev)
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(ifr))); errno != 0 {
			return 0, errno
		}
		return v.data, nil
	}
	want := uint32(0)
	if on {
		want = 1
	}
	if _, err := ethtool(unix.ETHTOOL_STXCSUM, want); err != nil {
		return err
	}
	got, err := ethtool(unix.ETHTOOL_GTXCSUM, 0)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("the device kept it %v", got != 0)
	}
	return nil
}
