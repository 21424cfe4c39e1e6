package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A network: true sandbox has a network namespace of its own, like every other sandbox (bwrap
// --unshare-net), and reaches the outside through pasta, a user-mode network stack (Debian package
// passt) attached to that namespace from the host. pasta turns the sandbox's TCP, UDP and ICMP echo
// into ordinary sockets of its own on the host, so:
//   - the sandbox's 127.0.0.1 is its own loopback: the host's (the broker, Redis, /metrics, pprof,
//     other sandboxes' services) is not reachable, because pasta forwards no port either way
//     (-t/-u/-T/-U none) and does not map the gateway to the host (--no-map-gw);
//   - the sandbox gets a copy of the host's address on the outbound interface, so that address is
//     the sandbox's own too, and a connection to it stays inside;
//   - pasta would reach the host's addresses on its other interfaces like any local process (no
//     pasta option hides them), so the sandbox's egress firewall (egress.go) refuses them, and
//     applies the template's allowlist if it has one; a rule on the host (applyPastaHostWall)
//     refuses pasta, by its uid, whatever the host routes to itself, addresses it gains later too;
//   - any other destination is reached as the host would reach it.
//
// pasta runs as the sandbox's host uid, never root, as a child of the broker that is killed with the
// sandbox (and with the broker: Pdeathsig). If it cannot start, neither does the sandbox: there is no
// fallback to the host's network.

// errNetworkNeedsRoot refuses a network sandbox under a broker that is not root. Its firewall
// (egress.go) is installed from inside the sandbox's network namespace, which needs CAP_SYS_ADMIN on
// the host; without it pasta would connect the sandbox to every address of the host but loopback
// (a docker0 bridge, a second NIC), so the sandbox does not start at all.
func errNetworkNeedsRoot(template string) error {
	return fmt.Errorf("template %q: the network needs the broker to run as root, to install the firewall that keeps a network sandbox from the host's addresses: run the broker as root, or set network: false in the template", template)
}

// pastaReadyTimeout bounds how long Start waits for pasta to have configured the namespace.
const pastaReadyTimeout = 10 * time.Second

// Fds pasta inherits: the sandbox's user and network namespaces, opened by the broker (the init is
// not dumpable, so pasta, running as the sandbox's uid, could not open its /proc/PID/ns files).
const (
	pastaUserNSFD = 3
	pastaNetNSFD  = 4
	// pastaPidFD is the pid file pasta writes once the namespace is ready (startNetwork).
	pastaPidFD = 5
)

// netHelper is a running pasta.
type netHelper struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once pasta is reaped
}

// pastaArgs is pasta's command line for a namespace it finds at its fds 3 and 4.
func pastaArgs(pidFile string) []string {
	return []string{
		// Addresses, routes and the link up inside, copied from the host's.
		"--config-net",
		// Our child, not a daemon: its lifetime is the sandbox's.
		"--foreground", "--quiet",
		// The gateway address is the real gateway, never the host.
		"--no-map-gw",
		// No port forwarded either way: "auto" would bind the host's listening ports inside the
		// sandbox and carry connections to them back to the host.
		"-t", "none", "-u", "none", "-T", "none", "-U", "none",
		// --config-net sets the addresses itself: no DHCP, DHCPv6 or router advertisements for the
		// sandbox to talk to (ARP and NDP answers stay: the sandbox needs its gateway's address).
		"--no-dhcp", "--no-dhcpv6", "--no-ra",
		// Written once the namespace is configured: our ready signal.
		"--pid", pidFile,
		// The namespaces as fds the broker opened (see pastaUserNSFD).
		"--userns", "/proc/self/fd/" + strconv.Itoa(pastaUserNSFD),
		"--netns", "/proc/self/fd/" + strconv.Itoa(pastaNetNSFD),
		"--no-netns-quit",
	}
}

// startNetwork attaches pasta to the network namespace of the sandbox whose init is host pid pid,
// and returns once the namespace is configured. On error nothing is left running.
func (n *Namespace) startNetwork(ctx context.Context, spec Spec, pid int, net Network) (*netHelper, error) {
	if n.pastaErr != nil {
		return nil, n.pastaErr
	}
	var allow []egressRule
	if len(net.Allow) > 0 {
		var err error
		if allow, err = parseAllow(net.Allow); err != nil {
			return nil, err
		}
	}
	var nsFiles []*os.File
	defer func() {
		for _, f := range nsFiles {
			f.Close()
		}
	}()
	// The network namespace belongs to bwrap's outer user namespace, not to the init's (bwrap's
	// --disable-userns nests one more): pasta must join the owner, which the kernel names.
	netns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		return nil, fmt.Errorf("sandbox network: network namespace of the init: %w", err)
	}
	nsFiles = append(nsFiles, netns)
	userns, err := unix.IoctlRetInt(int(netns.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		return nil, fmt.Errorf("sandbox network: owner of the network namespace: %w", err)
	}
	nsFiles = []*os.File{os.NewFile(uintptr(userns), "userns"), netns}
	// The firewall goes in before pasta: there is no moment with egress and without the rules.
	if n.asRoot {
		hostAddrs, err := localAddrs()
		if err != nil {
			return nil, fmt.Errorf("sandbox network: %w", err)
		}
		if err := applyEgress(int(netns.Fd()), hostAddrs, allow); err != nil {
			return nil, fmt.Errorf("sandbox network: %w", err)
		}
	} else {
		return nil, errNetworkNeedsRoot(spec.Template.Name)
	}
	return n.startPasta(ctx, spec, nsFiles[0], netns)
}

// startPasta attaches pasta, as the sandbox's uid, to the network namespace netns owned by the user
// namespace userns, and returns once pasta has configured it. extra are more pasta arguments. The
// caller keeps its files. On error nothing is left running.
func (n *Namespace) startPasta(ctx context.Context, spec Spec, userns, netns *os.File, extra ...string) (*netHelper, error) {
	id := spec.ID
	nsFiles := []*os.File{userns, netns}
	// pasta writes its pid into this file when the namespace is ready. It runs as the sandbox uid,
	// so the file is made for it; the state dir is not visible inside the sandbox.
	pidFile := filepath.Join(n.layout.stateDir(id), "pasta.pid")
	os.Remove(pidFile)
	pf, err := os.OpenFile(pidFile, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, fmt.Errorf("sandbox network: %w", err)
	}
	attr := &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	uid, gid := n.ids(spec)
	if uid >= 0 {
		if err := pf.Chown(uid, gid); err != nil {
			pf.Close()
			return nil, fmt.Errorf("sandbox network: %w", err)
		}
		// The user namespace's owner, the sandbox's own uid: pasta has the capabilities it needs
		// inside the sandbox's namespaces and none on the host.
		attr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	}
	defer os.Remove(pidFile)
	// pasta reaches the pid file through an fd it inherits (fd 5, after the namespaces): the state
	// dir is closed to the sandbox uid, and a path would put the sandbox's id in ps.
	defer pf.Close()
	nsFiles = append(nsFiles, pf) // pastaPidFD
	stderr := &headBuffer{max: 4 << 10}
	cmd := &exec.Cmd{
		Path:        n.pasta,
		Args:        append(append([]string{"pasta"}, pastaArgs("/proc/self/fd/"+strconv.Itoa(pastaPidFD))...), extra...),
		Dir:         "/",
		Env:         []string{},
		Stderr:      stderr,
		ExtraFiles:  nsFiles,
		SysProcAttr: attr,
		WaitDelay:   time.Second,
	}
	// The host's own wall before pasta runs: whatever the namespace's rules let through, pasta
	// reaches no address of the host's, including one added after the sandbox started.
	if uid > 0 {
		if err := applyPastaHostWall(uid); err != nil {
			pf.Close()
			return nil, fmt.Errorf("sandbox network: %w", err)
		}
	}
	if err := spawn(cmd, nil); err != nil {
		return nil, fmt.Errorf("sandbox network: start %s: %w: install pasta: apt-get install -y passt", n.pasta, err)
	}
	h := &netHelper{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(h.done)
	}()
	fail := func(err error) (*netHelper, error) {
		h.stop()
		if msg := pastaMessage(stderr.String()); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		return nil, err
	}
	deadline := time.NewTimer(pastaReadyTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(pidFile); err == nil && len(bytes.TrimSpace(b)) > 0 {
			return h, nil
		}
		select {
		case <-tick.C:
		case <-h.done:
			<-h.done
			return fail(errors.New("sandbox network: pasta exited before the sandbox's network was up"))
		case <-deadline.C:
			return fail(fmt.Errorf("sandbox network: pasta did not configure the network within %v", pastaReadyTimeout))
		case <-ctx.Done():
			return fail(fmt.Errorf("sandbox network: %w", ctx.Err()))
		}
	}
}

// pastaMessage is what pasta said on stderr, without its complaints about a missing syslog.
func pastaMessage(s string) string {
	var keep []string
	for _, line := range strings.Split(s, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "Failed to send") && strings.HasSuffix(line, "to syslog") {
			continue
		}
		keep = append(keep, line)
	}
	msg := strings.Join(keep, "; ")
	if strings.Contains(msg, "tun") {
		msg += " (pasta needs /dev/net/tun readable and writable by the sandbox uid: chmod 0666 /dev/net/tun, the kernel's default)"
	}
	return msg
}

// stop kills pasta and waits until it is reaped. It is safe to call more than once.
func (h *netHelper) stop() {
	if h == nil {
		return
	}
	select {
	case <-h.done:
		return
	default:
	}
	_ = h.cmd.Process.Signal(unix.SIGKILL)
	<-h.done
}

// Network is a template's network setting. In a templates file it is `false` (the default), `true`
// (egress to any destination), or `{allow: ["10.0.0.0/8:443", "192.0.2.7:53", "2001:db8::/32"]}`
// (egress only to those destinations; implies true).
type Network struct {
	// Enabled gives the sandbox egress through pasta.
	Enabled bool
	// Allow, when not empty, is the egress allowlist: each entry an IP address or CIDR prefix, with
	// an optional port or port range (":443", ":8000-8999"; IPv6 in brackets when a port follows).
	// TCP and UDP to a listed destination pass; everything else leaving the sandbox is refused.
	Allow []string
}

// NetworkOn is the template setting `network: true`.
var NetworkOn = Network{Enabled: true}

// MarshalJSON writes false, true, or {"allow": [...]}.
func (n Network) MarshalJSON() ([]byte, error) {
	if !n.Enabled || len(n.Allow) == 0 {
		return json.Marshal(n.Enabled)
	}
	return json.Marshal(struct {
		Allow []string `json:"allow"`
	}{n.Allow})
}

// UnmarshalJSON reads true, false or {"allow": [...]}.
func (n *Network) UnmarshalJSON(b []byte) error {
	var on bool
	if err := json.Unmarshal(b, &on); err == nil {
		*n = Network{Enabled: on}
		return nil
	}
	var v struct {
		Allow []string `json:"allow"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return fmt.Errorf("network: want true, false or {allow: [\"10.0.0.0/8:443\", ...]}: %v", strings.TrimPrefix(err.Error(), "json: "))
	}
	if len(v.Allow) == 0 {
		return errors.New("network: allow is empty: list destinations (\"10.0.0.0/8:443\"), or use network: false for no network")
	}
	*n = Network{Enabled: true, Allow: v.Allow}
	return nil
}

// egressRule is one parsed allowlist entry: a prefix and an inclusive port range (0-65535 for any).
type egressRule struct {
	prefix   netip.Prefix
	from, to uint16
}

// parseAllow parses the allowlist; an error names the entry and says what is wrong.
func parseAllow(allow []string) ([]egressRule, error) {
	var out []egressRule
	for i, e := range allow {
		r, err := parseEgress(e)
		if err != nil {
			return nil, fmt.Errorf("network.allow[%d] %q: %v", i, e, err)
		}
		out = append(out, r)
	}
	return out, nil
}

func parseEgress(e string) (egressRule, error) {
	host, ports := e, ""
	switch {
	case strings.HasPrefix(e, "["):
		end := strings.Index(e, "]")
		if end < 0 {
			return egressRule{}, errors.New("missing ']'")
		}
		host, ports = e[1:end], strings.TrimPrefix(e[end+1:], ":")
		if e[end+1:] != "" && !strings.HasPrefix(e[end+1:], ":") {
			return egressRule{}, errors.New("want [IPv6]:PORT")
		}
	case strings.Count(e, ":") == 1:
		host, ports, _ = strings.Cut(e, ":")
	}
	r := egressRule{from: 0, to: 65535}
	var err error
	if strings.Contains(host, "/") {
		r.prefix, err = netip.ParsePrefix(host)
	} else {
		var a netip.Addr
		if a, err = netip.ParseAddr(host); err == nil {
			r.prefix = netip.PrefixFrom(a, a.BitLen())
		}
	}
	if err != nil {
		return egressRule{}, errors.New("want an IP address or CIDR prefix (host names are not supported: the rule is enforced on addresses), with an optional :PORT or :FROM-TO")
	}
	r.prefix = r.prefix.Masked()
	if r.prefix.Addr().Is4In6() {
		return egressRule{}, errors.New("write IPv4 addresses in dotted form")
	}
	if ports != "" {
		lo, hi, isRange := strings.Cut(ports, "-")
		if !isRange {
			hi = lo
		}
		a, err1 := strconv.ParseUint(lo, 10, 16)
		b, err2 := strconv.ParseUint(hi, 10, 16)
		if err1 != nil || err2 != nil || a == 0 || a > b {
			return egressRule{}, errors.New("port: want a number 1-65535 or a range FROM-TO")
		}
		r.from, r.to = uint16(a), uint16(b)
	}
	return r, nil
}
