package kubetest

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// stateDirPrefix names each cluster's state directory under the temporary directory.
const stateDirPrefix = "sbxkube-"

// sweepCrashedRun removes what a cluster whose test process died (killed, or crashed before its
// Stop) left on the machine, which Leftovers would otherwise report at the end of every later run:
// its processes (etcd, the API server, kubelet, containerd and its shims, kube-proxy: started in
// their own process groups, they outlive the test), its state directories and their mounts, the
// bridge, the KUBE-/CNI- chains, kube-proxy's leftovers, the kubepods cgroups and the CNI plugin's
// network namespaces. The caller holds the machine's cluster lock, so no live cluster is running.
// It acts only on the evidence of a dead run, a state directory left behind: chains, cgroups or
// namespaces alone may be another program's (a container runtime's CNI networks).
func sweepCrashedRun() error {
	stale, _ := filepath.Glob(filepath.Join(os.TempDir(), stateDirPrefix+"*"))
	if len(stale) == 0 {
		return nil
	}
	var errs []error
	for _, dir := range stale {
		errs = append(errs, killUsersOf(dir))
	}
	for _, dir := range stale {
		errs = append(errs, unmountUnder(dir))
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, err)
		}
	}
	if ents, err := os.ReadDir(netnsDir); err == nil {
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "cni-") {
				p := filepath.Join(netnsDir, e.Name())
				syscall.Unmount(p, syscall.MNT_DETACH) // a network namespace is a bind mount
				os.Remove(p)
			}
		}
	}
	errs = append(errs, cleanNetworkAndCgroups())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("kubetest: sweeping what a crashed run left: %w", err)
	}
	return nil
}

// cleanNetworkAndCgroups removes the bridge, the KUBE-/CNI- chains, kube-proxy's leftovers and the
// kubepods cgroups: what Stop and sweepCrashedRun both end with.
func cleanNetworkAndCgroups() error {
	var errs []error
	if _, err := net.InterfaceByName(bridgeName); err == nil {
		if out, err := exec.Command("ip", "link", "delete", bridgeName).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("ip link delete %s: %v: %s", bridgeName, err, out))
		}
	}
	return errors.Join(append(errs, cleanIptables("iptables"), cleanIptables("ip6tables"), cleanProxy(), removeCgroups())...)
}

// clusterPrograms are the names (as /proc/PID/comm gives them, cut at 15 bytes) of what a cluster
// runs: etcd, kube-apiserver, kubelet, kube-proxy, kube-scheduler, kube-controller-manager,
// containerd and its shims.
var clusterPrograms = []string{"etcd", "kube", "containerd"}

// killUsersOf SIGKILLs every cluster program (clusterPrograms) whose command line names dir (a dead
// cluster's processes and containerd's shims all name their state directory), nothing else (a shell
// tailing a log there is left alone), and waits, bounded, for them to be gone.
func killUsersOf(dir string) error {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if !slices.ContainsFunc(clusterPrograms, func(p string) bool { return bytes.HasPrefix(comm, []byte(p)) }) {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && bytes.Contains(cmdline, []byte(dir+"/")) {
			syscall.Kill(pid, syscall.SIGKILL)
			pids = append(pids, pid)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range pids {
		for processExists(pid) {
			if time.Now().After(deadline) {
				return fmt.Errorf("process %d of %s survived SIGKILL", pid, dir)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// processExists reports whether pid names a process that has not yet been reaped or, for one that
// is not our child, is still running (a zombie another parent will reap counts as gone).
func processExists(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i > 0 && i+2 < len(b) && b[i+2] != 'Z'
}
