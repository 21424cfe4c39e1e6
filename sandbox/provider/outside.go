package provider

import (
	"bytes"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
)

// killGrace is how long the broker lets the init end a command (after a timeout or a cancel) before
// it ends the command itself from outside. The init does it in well under a millisecond; it misses
// this only when it is stopped, hung or starved, and the timeout must fire all the same.
const killGrace = time.Second

// outsideReport is how long killOutside waits, after its kill, for the init's own report of the
// command's end before it answers for it.
const outsideReport = 100 * time.Millisecond

// gvisorWedged is how much longer than killGrace a gvisor sandbox's init may take to end a command
// before the sandbox is ended instead: gVisor's kernel is slower to kill, and the report comes
// through the bridge.
const gvisorWedged = 10 * time.Second

// killOutside ends a command from the broker's side: every process of the sandbox in the command's
// process group, every one that holds the command's output pipes (a child that left the group and
// its parent still keeps the exec open), and all their descendants. Then, if the init still has not
// reported the end, it completes the call itself: the command was killed for c.reason.
//
// The sandbox's processes are the host processes descending from its init: in a pid namespace every
// orphan is reparented to the init (pid 1), and in the dir provider the init is their subreaper.
// Nothing else is ever signalled, and never the init itself.
func (in *instance) killOutside(c *call) {
	pid := in.commandPid(c)
	c.mu.Lock()
	exited := c.exited
	var pipes []string
	for _, f := range c.outs {
		// Through SyscallConn, not Fd: Fd would put the pipe in blocking mode, and drain's
		// deadlines would stop working.
		rc, err := f.SyscallConn()
		if err != nil {
			continue
		}
		if c.pty != nil {
			// A terminal's master: its session's jobs (in groups of their own) hold the slave,
			// which their fds name by its path in the sandbox's devpts.
			var n uint32
			var nerr error
			if rc.Control(func(fd uintptr) { n, nerr = unix.IoctlGetUint32(int(fd), unix.TIOCGPTN) }) == nil && nerr == nil {
				pipes = append(pipes, "/dev/pts/"+strconv.FormatUint(uint64(n), 10))
			}
			continue
		}
		var st unix.Stat_t
		var serr error
		if rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }) == nil && serr == nil {
			pipes = append(pipes, "pipe:["+strconv.FormatUint(st.Ino, 10)+"]")
		}
	}
	c.mu.Unlock()
	if in.kind == kindGvisor {
		// A gvisor sandbox's processes are the sentry's, not the host's: there is no tree to walk
		// from here. An init that has not ended the command gvisorWedged later is wedged, and a
		// timeout must fire: the sandbox ends (runtime_lost), its files stay.
		if !exited {
			select {
			case <-c.done:
			case <-in.done:
			case <-time.After(gvisorWedged):
				in.stopOnce.Do(in.kill)
			}
		}
		return
	}
	in.mu.Lock()
	initPid := in.initPid
	in.mu.Unlock()
	if exited || initPid <= 0 {
		return
	}
	killGroupOutside(initPid, pid, pipes, in.initAlive)
	select {
	case <-c.done:
		return
	case <-time.After(outsideReport):
	}
	in.mu.Lock()
	in.forgetLocked(c)
	in.mu.Unlock()
	c.complete(reply{Op: opExit, ID: c.id, Signal: int(unix.SIGKILL)})
}

// hostProc is what killGroupOutside needs of a process, as the host sees it.
type hostProc struct {
	pid, ppid int
	pgid      int // its process group as the sandbox sees it (NSpgid's innermost)
}

// killGroupOutside freezes then kills, from the host, the descendants of initPid that are in process
// group pgid as the sandbox sees it (0: none) or hold one of the pipes ("pipe:[inode]"), and all
// their descendants. alive says whether initPid is still the sandbox's init: once it is not (reaped,
// its pid free for any host process to take), no more of its "children" are looked for. Like
// sbxinit.KillTree it stops what it finds first, rescans until nothing new appears, then kills the
// lot. Every signal goes through a pidfd pinned on the process the scan saw (sandboxPins): the
// broker is root, and a process of the sandbox can exit and be reaped (by another, when the tenant
// chooses) between the scan and a signal, or be killed while stopped, and its pid taken by any host
// process.
func killGroupOutside(initPid, pgid int, pipes []string, alive func() bool) {
	stopped := map[int]bool{}
	pins := sandboxPins{initPid: initPid, alive: alive, fds: map[int]int{}}
	defer pins.close()
	self := os.Getpid()
	for round := 0; round < 100 && alive(); round++ {
		procs := scanProcs()
		children := make(map[int][]int, len(procs))
		byPid := make(map[int]hostProc, len(procs))
		for _, p := range procs {
			children[p.ppid] = append(children[p.ppid], p.pid)
			byPid[p.pid] = p
		}
		// The sandbox: everything below the init.
		inSandbox := map[int]bool{}
		queue := append([]int(nil), children[initPid]...)
		for len(queue) > 0 {
			pid := queue[len(queue)-1]
			queue = queue[:len(queue)-1]
			if inSandbox[pid] || pid == initPid || pid == self {
				continue
			}
			inSandbox[pid] = true
			queue = append(queue, children[pid]...)
		}
		// The command: its group, the holders of its pipes, and what is below them.
		for pid := range inSandbox {
			if stopped[pid] || pgid > 0 && byPid[pid].pgid == pgid || holdsAny(pid, pipes) {
				queue = append(queue, pid)
			}
		}
		target := map[int]bool{}
		for len(queue) > 0 {
			pid := queue[len(queue)-1]
			queue = queue[:len(queue)-1]
			if target[pid] || !inSandbox[pid] {
				continue
			}
			target[pid] = true
			queue = append(queue, children[pid]...)
		}
		var fresh []int
		for pid := range target {
			if stopped[pid] {
				continue
			}
			fd, ok := pins.pin(pid, 0)
			if !ok {
				continue // gone, or no longer the process the scan saw
			}
			stopped[pid] = true
			unix.PidfdSendSignal(fd, unix.SIGSTOP, nil, 0)
			fresh = append(fresh, pid)
		}
		if len(fresh) == 0 {
			break
		}
		sbxinit.WaitStopped(fresh) // the host's /proc here: the same pids the broker signalled
	}
	for pid := range stopped {
		unix.PidfdSendSignal(pins.fds[pid], unix.SIGKILL, nil, 0)
	}
}

// sandboxPins holds pidfds on processes below a sandbox's init, each confirmed to be below it while
// the fd named it.
type sandboxPins struct {
	initPid int
	alive   func() bool // the init is still the sandbox's
	fds     map[int]int // pid → pidfd, confirmed
}

// maxPinDepth bounds the walk from a process up to the init.
const maxPinDepth = 1 << 16

// pin returns a pidfd on pid once it has confirmed that the process the fd names is below the init:
// its parent, read again once that parent is pinned the same way, is still that parent, and the
// process, then its parent (or the init), are still alive after that read. A live process's pid
// names no other, so the parent read is the pinned one; a pid that changed hands fails.
func (s *sandboxPins) pin(pid, depth int) (int, bool) {
	if fd, ok := s.fds[pid]; ok {
		return fd, true
	}
	if depth > maxPinDepth {
		return -1, false
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, false
	}
	ppid := parentOf(pid)
	ok := ppid > 0
	pfd := -1
	if ok && ppid != s.initPid {
		pfd, ok = s.pin(ppid, depth+1)
	}
	ok = ok && parentOf(pid) == ppid && unix.PidfdSendSignal(fd, 0, nil, 0) == nil
	if ok && ppid == s.initPid {
		ok = s.alive()
	} else if ok {
		ok = unix.PidfdSendSignal(pfd, 0, nil, 0) == nil
	}
	if !ok {
		unix.Close(fd)
		return -1, false
	}
	s.fds[pid] = fd
	return fd, true
}

func (s *sandboxPins) close() {
	for _, fd := range s.fds {
		unix.Close(fd)
	}
}

// parentOf is the PPid in /proc/<pid>/status, 0 if the process is gone.
func parentOf(pid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	_, rest, ok := bytes.Cut(b, []byte("\nPPid:"))
	if !ok {
		return 0
	}
	line, _, _ := bytes.Cut(rest, []byte("\n"))
	ppid, _ := strconv.Atoi(string(bytes.TrimSpace(line)))
	return ppid
}

// scanProcs is scanHostProcs; tests make it see what a scan racing a pid's reuse would.
var scanProcs = scanHostProcs

// scanHostProcs reads every process's parent and (innermost) process group from /proc/<pid>/status.
func scanHostProcs() []hostProc {
	d, err := os.Open("/proc")
	if err != nil {
		return nil
	}
	names, _ := d.Readdirnames(-1)
	d.Close()
	out := make([]hostProc, 0, len(names))
	buf := make([]byte, 4096)
	for _, name := range names {
		pid, err := strconv.Atoi(name)
		if err != nil {
			continue
		}
		fd, err := unix.Open("/proc/"+name+"/status", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		n, _ := unix.Read(fd, buf)
		unix.Close(fd)
		if n <= 0 {
			continue
		}
		p := hostProc{pid: pid, ppid: -1, pgid: -1}
		for _, line := range bytes.Split(buf[:n], []byte("\n")) {
			k, v, ok := bytes.Cut(line, []byte(":"))
			if !ok {
				continue
			}
			f := bytes.Fields(v)
			if len(f) == 0 {
				continue
			}
			switch string(k) {
			case "PPid":
				p.ppid, _ = strconv.Atoi(string(f[0]))
			case "NSpgid":
				p.pgid, _ = strconv.Atoi(string(f[len(f)-1]))
			}
		}
		out = append(out, p)
	}
	return out
}

// holdsAny reports whether the process has one of the pipes open.
func holdsAny(pid int, pipes []string) bool {
	if len(pipes) == 0 {
		return false
	}
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	d, err := os.Open(dir)
	if err != nil {
		return false
	}
	names, _ := d.Readdirnames(-1)
	d.Close()
	for _, name := range names {
		target, err := os.Readlink(dir + "/" + name)
		if err != nil {
			continue
		}
		for _, p := range pipes {
			if target == p {
				return true
			}
		}
	}
	return false
}

// initAlive says whether the init is still this sandbox's: not torn down, and, where there is a
// pidfd, not yet reaped (a reaped init's pid may already belong to another host process).
func (in *instance) initAlive() bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.ended {
		return false
	}
	return in.pidfd <= 0 || unix.PidfdSendSignal(in.pidfd, 0, nil, 0) == nil
}
