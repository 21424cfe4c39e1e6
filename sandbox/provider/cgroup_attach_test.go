package provider

import (
	"os"
	"path/filepath"
	"testing"
)

// attach never moves the broker: "0" in cgroup.procs names the writer's process, and our own pid
// is the broker's. Either is refused before anything is written (here, into a plain directory
// standing for a cgroup: nothing must be written at all).
func TestAttachNeverMovesTheBroker(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := &cgroupSet{dirs: []string{dir}}
	for _, pids := range [][]int{{0}, {os.Getpid()}, {-1}, {os.Getppid(), 0}} {
		if err := s.attach(pids...); err == nil {
			t.Errorf("attach(%v) was not refused", pids)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.procs")); !os.IsNotExist(err) {
		t.Fatalf("a refused attach wrote cgroup.procs: %v", err)
	}
}
