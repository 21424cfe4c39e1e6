package kubetest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Stop deletes every pod (so kubelet tears their containers and networks down), stops every process
// it started, by pid, and removes what they left: leftover containerd shims, mounts under the state
// directory, the CNI bridge, the KUBE-/CNI- iptables chains (kubelet's, kube-proxy's, the CNI
// plugins'), anything else of kube-proxy's (proxy.go) and the sysctls it may have changed, the
// kubepods cgroups, the claims' directories and the state directory. Conntrack entries of Service
// connections stay (they expire by themselves). It returns the cleanup's errors.
func (c *Cluster) Stop() error {
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var hostPaths []string
	if c.Client != nil {
		if pvs, err := c.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{}); err == nil {
			for _, pv := range pvs.Items {
				if pv.Spec.HostPath != nil && strings.HasPrefix(pv.Spec.HostPath.Path, "/tmp/") {
					hostPaths = append(hostPaths, pv.Spec.HostPath.Path)
				}
			}
		}
		c.deleteAllPods(ctx)
	}
	// Stop in reverse order of start; containerd after kubelet, etcd last.
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		if p.name == "containerd" {
			c.killContainers(ctx)
		}
		p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-p.done
		}
	}
	if c.containerd != "" {
		killShims(c.containerd)
	}
	if c.Dir != "" {
		errs = append(errs, unmountUnder(c.Dir))
	}
	errs = append(errs, cleanNetworkAndCgroups())
	c.restoreSysctls()
	if c.ipForward != nil {
		os.WriteFile("/proc/sys/net/ipv4/ip_forward", c.ipForward, 0o644)
	}
	for _, p := range hostPaths {
		os.RemoveAll(p)
	}
	os.Remove("/tmp/hostpath_pv") // the provisioner's parent directory, when nothing else is in it
	for d, before := range c.hostDirs {
		for name := range listDir(d) {
			// Of the network namespaces, only the CNI plugin's (cni-<id>) are the cluster's: one
			// another test made meanwhile (`ip netns add`) is not, and removing it took that test's
			// veth, and its host address, away under it.
			if !before[name] && (d != netnsDir || strings.HasPrefix(name, "cni-")) {
				p := filepath.Join(d, name)
				syscall.Unmount(p, syscall.MNT_DETACH) // a network namespace is a bind mount
				os.RemoveAll(p)
			}
		}
	}
	if c.Dir != "" {
		if err := os.RemoveAll(c.Dir); err != nil {
			errs = append(errs, err)
		}
	}
	if c.lock != nil {
		c.lock.Close()
	}
	return errors.Join(errs...)
}

// deleteAllPods deletes every pod and waits (bounded) until containerd runs no task.
func (c *Cluster) deleteAllPods(ctx context.Context) {
	zero := int64(0)
	nss, err := c.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return
	}
	for _, ns := range nss.Items {
		c.Client.CoreV1().Pods(ns.Name).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
	}
	if c.containerd == "" {
		return
	}
	wait, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for wait.Err() == nil {
		out, err := c.Ctr(wait, "tasks", "ls", "-q")
		if err == nil && len(bytes.TrimSpace(out)) == 0 {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// killContainers kills and removes any task and container containerd still has.
func (c *Cluster) killContainers(ctx context.Context) {
	out, _ := c.Ctr(ctx, "tasks", "ls", "-q")
	for _, id := range strings.Fields(string(out)) {
		c.Ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
		for range 50 {
			if _, err := c.Ctr(ctx, "tasks", "delete", id); err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	out, _ = c.Ctr(ctx, "containers", "ls", "-q")
	for _, id := range strings.Fields(string(out)) {
		c.Ctr(ctx, "containers", "delete", id)
	}
}

// killShims kills the containerd-shim processes serving this cluster's containerd (they outlive it).
func killShims(sock string) {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !bytes.Contains(cmdline, []byte("containerd-shim")) || !bytes.Contains(cmdline, []byte(sock)) {
			continue
		}
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

// unmountUnder lazily unmounts every mount point under dir, deepest first.
func unmountUnder(dir string) error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			points = append(points, fields[4])
		}
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	var errs []error
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

// cleanIptables removes the KUBE-* and CNI-* chains (kubelet's and the CNI plugins') from every
// table, with the rules that jump to them.
func cleanIptables(bin string) error {
	if _, err := exec.LookPath(bin + "-save"); err != nil {
		return nil
	}
	var script strings.Builder
	for _, table := range []string{"filter", "nat", "mangle"} {
		out, err := exec.Command(bin+"-save", "-t", table).Output()
		if err != nil {
			continue
		}
		ours := func(chain string) bool { return strings.HasPrefix(chain, "KUBE-") || strings.HasPrefix(chain, "CNI-") }
		var chains, deletes []string
		for _, line := range strings.Split(string(out), "\n") {
			switch {
			case strings.HasPrefix(line, ":"):
				if name := strings.Fields(line[1:])[0]; ours(name) {
					chains = append(chains, name)
				}
			case strings.HasPrefix(line, "-A "):
				f := strings.Fields(line)
				if ours(f[1]) {
					continue // flushed below
				}
				for i := 0; i+1 < len(f); i++ {
					if (f[i] == "-j" || f[i] == "-g") && ours(f[i+1]) {
						deletes = append(deletes, "-D"+line[2:])
						break
					}
				}
			}
		}
		if len(chains) == 0 && len(deletes) == 0 {
			continue
		}
		script.WriteString("*" + table + "\n")
		for _, d := range deletes {
			script.WriteString(d + "\n")
		}
		for _, ch := range chains {
			script.WriteString("-F " + ch + "\n")
		}
		for _, ch := range chains {
			script.WriteString("-X " + ch + "\n")
		}
		script.WriteString("COMMIT\n")
	}
	if script.Len() == 0 {
		return nil
	}
	cmd := exec.Command(bin+"-restore", "--noflush")
	cmd.Stdin = strings.NewReader(script.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s-restore: %v: %s", bin, err, out)
	}
	return nil
}

// removeCgroups removes the kubepods cgroups (kubelet's pod hierarchy) from every cgroup hierarchy,
// deepest first.
func removeCgroups() error {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods")
	if _, err := os.Stat("/sys/fs/cgroup/kubepods"); err == nil {
		roots = append(roots, "/sys/fs/cgroup/kubepods")
	}
	var errs []error
	for _, root := range roots {
		var dirs []string
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := os.Remove(dirs[i]); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Leftovers lists what a stopped cluster must not leave behind: the bridge, KUBE-/CNI- chains,
// kubepods cgroups, kube-proxy's interfaces, ipsets and nftables table. Empty means clean.
func Leftovers() []string {
	var left []string
	if _, err := net.InterfaceByName(bridgeName); err == nil {
		left = append(left, "bridge "+bridgeName)
	}
	for _, bin := range []string{"iptables-save", "ip6tables-save"} {
		out, _ := exec.Command(bin).Output()
		for _, line := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(line, ":KUBE-") || strings.HasPrefix(line, ":CNI-") {
				left = append(left, bin+" chain "+strings.Fields(line[1:])[0])
			}
		}
	}
	if m, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods"); len(m) > 0 {
		left = append(left, m...)
	}
	left = append(left, proxyLeftovers()...)
	return left
}
