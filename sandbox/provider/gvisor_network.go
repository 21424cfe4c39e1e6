package provider

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"
)

// A gvisor sandbox with network: true runs runsc --network=sandbox in a network namespace the
// broker prepares before runsc starts:
//
//  1. a user namespace owned by the sandbox's uid with a network namespace in it, made by unshare(1)
//     run as that uid (pasta, running as the uid, may join only a namespace its uid owns), kept by a
//     bind mount in the sandbox's runsc state (<state>/gvisor/netns), which stop and the next
//     broker start remove with the rest of that state;
//  2. pasta attached to it as at the namespace level, its tap named eth0 and configured with the
//     host's addresses and routes;
//  3. the egress firewall on that tap's netdev egress hook (egress.go, applyNetdevEgress), the one
//     place every frame bound for pasta passes, the sentry's AF_PACKET frames included;
//  4. runsc, named the namespace in the OCI spec, copies eth0's addresses and routes into gVisor's
//     netstack, removes them from the host side, and hands the sentry a packet socket on eth0.
//
// The sentry never sees the host's network namespace; nothing in the sandbox can change the
// firewall (gVisor's processes have no host capabilities, and the sentry's seccomp filter allows
// it no netlink socket). If any step fails the sandbox does not start.

// gvisorNetnsFile is the bind mount of the sandbox's network namespace in its runsc state dir.
const gvisorNetnsFile = "netns"

// startGvisorNetwork prepares the network namespace at path (steps 1-3 above) and returns its
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
	h, err := n.startPasta(ctx, spec, userns, netns, "--ns-ifname", gvisorIfname)
	if err != nil {
		return nil, err
	}
	// The tap exists only once pasta made it, so the rules follow pasta here; runsc, and with it
	// anything of the sandbox's, starts only after them.
	if err := applyNetdevEgress(int(netns.Fd()), gvisorIfname, hostAddrs, allow); err != nil {
		h.stop()
		return nil, fmt.Errorf("sandbox network: %w", err)
	}
	done = true
	return h, nil
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
