package provider

import (
	"os/exec"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The memory limit, as an instance watches it. The memory cgroup counts its OOM kills
// (cgroupSet.oomKills) and signals each one (cgroupSet.watchOOM, started in launch). From those the
// instance tells whether a command's SIGKILL was the limit's (oomKilled: the exec's Reason is
// memory_limit), whether the init itself was its victim (oomSince, read in wait before the cgroup
// goes), and whether memory no process holds has filled the limit so that no command can run any
// more (endIfMemoryWedged), which ends the sandbox with reason memory_limit.

// oomKilled reports whether the cgroup's OOM-kill counter went up since the last time it was seen.
// The kernel bumps it just after sending the kill, so one short re-read covers that race.
func (in *instance) oomKilled() bool {
	for try := 0; try < 2; try++ {
		n := in.cg.oomKills()
		if n < 0 {
			return false
		}
		for {
			old := in.oomSeen.Load()
			if n <= old {
				break
			}
			if in.oomSeen.CompareAndSwap(old, n) {
				in.lastOOM.Store(time.Now().UnixNano())
				return true
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	return false
}

// oomSince reports whether the memory limit's OOM killer acted since an exec last looked, or an
// exec saw it act within the last oomRecent: the init itself, or bwrap, was then its victim.
func (in *instance) oomSince() bool {
	if n := in.cg.oomKills(); n >= 0 && n > in.oomSeen.Load() {
		return true
	}
	last := in.lastOOM.Load()
	return last > 0 && time.Since(time.Unix(0, last)) < oomRecent
}

// oomRecent is how close to an exec's OOM kill the init's own SIGKILL counts as the memory limit's.
const oomRecent = 2 * time.Second

// wedgeHeadroom is the memory a command needs to start at all (a shell, its libraries' pages). When
// less than this is left beside memory no process holds (tmpfs, /dev/shm, SysV shared memory), the
// kernel cannot free anything by killing processes, and every command is killed as it starts.
const wedgeHeadroom = 8 << 20

// endIfMemoryWedged ends the sandbox, with reason memory_limit, when the memory its processes do not
// hold fills its limit: every command would be OOM-killed as it starts, and nothing could run to free
// it. Files in the workspace stay; /tmp and /dev/shm go with the stop.
func (in *instance) endIfMemoryWedged() {
	limit, shmem := in.cg.memoryLimit(), in.cg.shmem()
	if limit <= 0 || shmem < 0 || shmem+wedgeHeadroom < limit {
		return
	}
	select {
	case <-in.done:
		return
	default:
	}
	in.setWhy(ReasonMemoryLimit)
	go in.stopOnce.Do(in.kill)
}

// killedBySIGKILL reports whether the init's process (bwrap's, which reports its child's signal as
// 128+n) ended by SIGKILL.
func killedBySIGKILL(cmd *exec.Cmd, err error) bool {
	if err == nil || cmd.ProcessState == nil {
		return false
	}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return ws.Signal() == unix.SIGKILL
	}
	return cmd.ProcessState.ExitCode() == 128+int(unix.SIGKILL)
}
