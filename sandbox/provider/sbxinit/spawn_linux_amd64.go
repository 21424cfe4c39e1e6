package sbxinit

import (
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The init's own start of a command, for the gvisor level (see spawn). syscall.ForkExec's child
// resets every signal handler the Go runtime installed, one rt_sigaction each (62 of them), because
// a Go handler must never run in a child that shares our memory; it also makes a pipe for the
// child's error and reads and closes it. On Linux those are a few microseconds in all. Under
// gVisor's systrap platform every one is a trap into the sentry (~12 µs each on these machines,
// more under load): about 70 traps, 0.8 ms and more, of an exec `true` whose own fork, exec, loading
// and exit take a few milliseconds. Here the kernel clears the handlers (CLONE_CLEAR_SIGHAND), no
// Go code runs in the child, and the child reports a failure in our shared memory instead of a
// pipe: the child makes the 8 or 9 calls the command needs (setpgid, the credentials, chdir, its 3
// stdio, execve) and nothing else.

// emptySigset is the signal mask commands start with: none blocked.
var emptySigset uint64

// spawnMax bounds the calls of one child.
const spawnMax = 12

// spawnProg is what the child runs: its layout is the assembly's (spawn_linux_amd64.s).
type spawnProg struct {
	n     uintptr // calls to run
	errno uintptr // set by the child: the errno of the call that failed
	calls [spawnMax][7]uintptr
}

func (p *spawnProg) add(nr uintptr, args ...uintptr) {
	c := &p.calls[p.n]
	c[0] = nr
	copy(c[1:], args)
	p.n++
}

// cloneArgs is struct clone_args up to tls (CLONE_ARGS_SIZE_VER0).
type cloneArgs struct {
	flags, pidfd, childTID, parentTID, exitSignal, stack, stackSize, tls uint64
}

const cloneClearSighand = 0x100000000

// rawSpawn is in spawn_linux_amd64.s. Its arguments stay on the heap (no go:noescape): the child
// reads prog and the strings it points to while we wait.
func rawSpawn(args *cloneArgs, size uintptr, prog *spawnProg) (pid uintptr, errno uintptr)

// spawnSupported reports whether spawn can start commands here: the soft limit of open files must
// be the hard one, which Go leaves alone (it raises a lower soft limit for itself and restores it in
// each child it forks; a child started here would keep the raised one). The init asks once: nothing
// inside may change its limits (the init is the only root, and commands cannot prlimit it).
func spawnSupported() bool {
	var lim unix.Rlimit
	return unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) == nil && lim.Cur == lim.Max
}

// spawnable reports whether spawn may start a command with these stdio fds: each must be above the
// child's 0, 1 and 2, so that placing one never closes another still to be placed (the init's own
// stdio holds 0-2, so every fd it opens is above them).
func spawnable(files [3]uintptr) bool {
	for _, fd := range files {
		if fd < 3 {
			return false
		}
	}
	return true
}

// spawn starts prog as a command the way syscall.ForkExec with Setpgid and cred does (the caller
// checked spawnable): in its own process group, as cred, in dir, with files as its stdio. A child
// that failed before its exec is reaped here.
func spawn(prog string, argv, env []string, dir string, files [3]uintptr, cred *syscall.Credential) (int, error) {
	path, err := syscall.BytePtrFromString(prog)
	if err != nil {
		return 0, err
	}
	argvp, err := syscall.SlicePtrFromStrings(argv)
	if err != nil {
		return 0, err
	}
	envp, err := syscall.SlicePtrFromStrings(env)
	if err != nil {
		return 0, err
	}
	var dirp *byte
	if dir != "" {
		if dirp, err = syscall.BytePtrFromString(dir); err != nil {
			return 0, err
		}
	}
	p := new(spawnProg)
	p.add(unix.SYS_SETPGID, 0, 0)
	if cred != nil {
		// As syscall.ForkExec: supplementary groups, then the group, then the user (last, while
		// we may still change the others).
		var groups unsafe.Pointer
		if len(cred.Groups) > 0 {
			groups = unsafe.Pointer(&cred.Groups[0])
		}
		if !cred.NoSetGroups {
			p.add(unix.SYS_SETGROUPS, uintptr(len(cred.Groups)), uintptr(groups))
		}
		p.add(unix.SYS_SETGID, uintptr(cred.Gid))
		p.add(unix.SYS_SETUID, uintptr(cred.Uid))
	}
	if dirp != nil {
		p.add(unix.SYS_CHDIR, uintptr(unsafe.Pointer(dirp)))
	}
	for i, fd := range files {
		p.add(unix.SYS_DUP3, fd, uintptr(i), 0) // the copy is not close-on-exec
	}
	p.add(unix.SYS_RT_SIGPROCMASK, unix.SIG_SETMASK, uintptr(unsafe.Pointer(&emptySigset)), 0, 8)
	p.add(unix.SYS_EXECVE, uintptr(unsafe.Pointer(path)), uintptr(unsafe.Pointer(&argvp[0])), uintptr(unsafe.Pointer(&envp[0])))
	args := &cloneArgs{flags: unix.CLONE_VM | unix.CLONE_VFORK | cloneClearSighand, exitSignal: uint64(unix.SIGCHLD)}

	// No fd may be made inheritable while the child copies our table (as syscall.ForkExec).
	syscall.ForkLock.Lock()
	pid, errno := rawSpawn(args, unsafe.Sizeof(*args), p)
	syscall.ForkLock.Unlock()
	runtime.KeepAlive(path)
	runtime.KeepAlive(argvp)
	runtime.KeepAlive(envp)
	runtime.KeepAlive(dirp)
	runtime.KeepAlive(cred)
	if errno != 0 {
		return 0, syscall.Errno(errno)
	}
	if p.errno != 0 {
		for {
			if _, err := unix.Wait4(int(pid), nil, 0, nil); err != unix.EINTR {
				break
			}
		}
		return 0, syscall.Errno(p.errno)
	}
	return int(pid), nil
}
