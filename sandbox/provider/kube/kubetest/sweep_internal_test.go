package kubetest

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

// TestKillUsersOf: a cluster program a crashed run left running, found by the state directory its
// command line names (in its own process group, as the cluster's processes are), is killed; the
// same program naming another directory is not, nor is another program (a shell tailing a log)
// naming the dead run's. The whole sweep (sweepCrashedRun) runs only under the cluster lock, at
// every Start: each run of this package's tests starts one.
func TestKillUsersOf(t *testing.T) {
	dir := filepath.Join(t.TempDir(), stateDirPrefix+"dead")
	other := filepath.Join(t.TempDir(), "alive")
	// A shell under a cluster program's name: its comm is "etcd".
	etcd := filepath.Join(t.TempDir(), "etcd")
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(sh, etcd); err != nil {
		t.Fatal(err)
	}
	start := func(prog, d string) *exec.Cmd {
		// The shell waits on its input, never written, with the directory in its command line.
		cmd := exec.Command(prog, "-c", "read x", filepath.Join(d, "etcd"))
		if _, err := cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd
	}
	dead, alive, tail := start(etcd, dir), start(etcd, other), start(sh, dir)
	defer alive.Process.Kill()
	defer tail.Process.Kill()
	if err := killUsersOf(dir); err != nil {
		t.Fatal(err)
	}
	if err := dead.Wait(); err == nil || dead.ProcessState.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the crashed run's process: %v", err)
	}
	if !processExists(alive.Process.Pid) {
		t.Fatal("a cluster program naming another directory was killed")
	}
	if !processExists(tail.Process.Pid) {
		t.Fatal("a program that is no cluster's was killed")
	}
}
