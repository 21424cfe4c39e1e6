package sbxinit

import (
	"bytes"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// procInfo is the part of /proc/<pid>/stat that process-tree walks need.
type procInfo struct {
	pid, ppid, pgrp, sid int
}

// scanProcs lists every process visible in /proc. This kernel has no /proc/<pid>/task/*/children
// (CONFIG_PROC_CHILDREN is optional), so a full scan is the portable way to find descendants. Inside a
// sandbox it sees only the sandbox's pid namespace.
func scanProcs() []procInfo {
	d, err := os.Open("/proc")
	if err != nil {
		return nil
	}
	defer d.Close()
	names, _ := d.Readdirnames(-1)
	out := make([]procInfo, 0, len(names))
	buf := make([]byte, 512)
	for _, name := range names {
		pid, err := strconv.Atoi(name)
		if err != nil {
			continue
		}
		if p, ok := readStat(pid, buf); ok {
			out = append(out, p)
		}
	}
	return out
}

// readStat parses /proc/<pid>/stat: "pid (comm) state ppid pgrp session ...". comm may hold spaces
// and parentheses, so the fields start after the last ')'.
func readStat(pid int, buf []byte) (procInfo, bool) {
	fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/stat", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return procInfo{}, false
	}
	n, err := unix.Read(fd, buf)
	unix.Close(fd)
	if err != nil || n <= 0 {
		return procInfo{}, false
	}
	b := buf[:n]
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procInfo{}, false
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 5 {
		return procInfo{}, false
	}
	ppid, _ := strconv.Atoi(string(f[1]))
	pgrp, _ := strconv.Atoi(string(f[2]))
	sid, _ := strconv.Atoi(string(f[3]))
	return procInfo{pid: pid, ppid: ppid, pgrp: pgrp, sid: sid}, true
}

// KillTree ends a process tree that may be forking while we look at it: root (0 for none), every
// member of process group pgid and of session sid (0 for none), and all their descendants, whatever
// group they moved to. It never touches exclude (the caller).
//
// Killing top-down would orphan grandchildren to the reaper before we see them, and a process in
// another group would escape; so it first freezes with SIGSTOP (a stopped process cannot fork or
// exit, so pids are not reused), rescans until no new member appears, then SIGKILLs the lot. root
// is stopped first, so when it is the reaper (the dir provider's init) nothing gets reaped meanwhile.
func KillTree(root, pgid, sid, exclude int) {
	stopped := map[int]bool{}
	stop := func(pid int) {
		if pid <= 0 || pid == exclude || stopped[pid] {
			return
		}
		stopped[pid] = true
		unix.Kill(pid, unix.SIGSTOP)
	}
	stop(root)
	WaitStopped([]int{root})
	for round := 0; round < 100; round++ {
		procs := scanProcs()
		children := make(map[int][]int, len(procs))
		var queue []int
		for _, p := range procs {
			children[p.ppid] = append(children[p.ppid], p.pid)
			if p.pid == root || stopped[p.pid] || pgid > 0 && p.pgrp == pgid || sid > 0 && p.sid == sid {
				queue = append(queue, p.pid)
			}
		}
		seen := make(map[int]bool, len(queue))
		for len(queue) > 0 {
			pid := queue[len(queue)-1]
			queue = queue[:len(queue)-1]
			if seen[pid] {
				continue
			}
			seen[pid] = true
			queue = append(queue, children[pid]...)
		}
		var fresh []int
		for pid := range seen {
			if pid != exclude && !stopped[pid] {
				stop(pid)
				fresh = append(fresh, pid)
			}
		}
		if len(fresh) == 0 {
			break
		}
		// SIGSTOP is asynchronous: until a process is really stopped it may still fork, and the
		// next scan must see that child.
		WaitStopped(fresh)
	}
	if pgid > 0 {
		unix.Kill(-pgid, unix.SIGKILL)
	}
	for pid := range stopped {
		unix.Kill(pid, unix.SIGKILL)
	}
}

// WaitStopped waits (briefly: a process in uninterruptible sleep stops only when it leaves it) until
// each pid is stopped, dead or gone.
func WaitStopped(pids []int) {
	buf := make([]byte, 512)
	deadline := time.Now().Add(200 * time.Millisecond)
	for _, pid := range pids {
		for pid > 0 {
			st := procState(pid, buf)
			if st == 0 || st == 'T' || st == 't' || st == 'Z' || st == 'X' || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
}

// procState is the state letter from /proc/<pid>/stat, 0 if the process is gone.
func procState(pid int, buf []byte) byte {
	fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/stat", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	n, _ := unix.Read(fd, buf)
	unix.Close(fd)
	if n <= 0 {
		return 0
	}
	i := bytes.LastIndexByte(buf[:n], ')')
	if i < 0 || i+2 >= n {
		return 0
	}
	return buf[i+2]
}
