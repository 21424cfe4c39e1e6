package kubetest

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

// TestKillUsersOf: what a crashed run left running, found by the state directory its command line
// names (in its own process group, as the cluster's processes are), is killed; a process naming
// another directory is not. The whole sweep (sweepCrashedRun) runs only under the cluster lock, at
// every Start: each run of this package's tests starts one.
func TestKillUsersOf(t *testing.T) {
	dir := filepath.Join(t.TempDir(), stateDirPrefix+"dead")
	other := filepath.Join(t.TempDir(), "alive")
	start := func(d string) *exec.Cmd {
		// The shell waits on its input, never written, with the directory in its command line.
		cmd := exec.Command("sh", "-c", "read x", filepath.Join(d, "etcd"))
		if _, err := cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd
	}
	dead, alive := start(dir), start(other)
	defer alive.Process.Kill()
	if err := killUsersOf(dir); err != nil {
		t.Fatal(err)
	}
	if err := dead.Wait(); err == nil || dead.ProcessState.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the crashed run's process: %v", err)
	}
	if !processExists(alive.Process.Pid) {
		t.Fatal("a process naming another directory was killed")
	}
	if !processExists(os.Getpid()) {
		t.Fatal("processExists denies this process")
	}
}
