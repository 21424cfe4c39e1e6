package sbxinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// InitArg is the argument that turns the broker's executable into a sandbox's resident init.
const InitArg = "sandbox-init"

// ctlFD is the init's end of the control socket.
const ctlFD = 3

// RunInit runs the resident init and never returns. Mains call it first thing when os.Args[1] is
// InitArg (see the package doc); it expects the control socket on fd 3.
func RunInit() {
	if len(os.Args) > 2 && os.Args[2] == BridgeArg {
		bridged = true
		RunBridge() // the same binary, started as the first process of a gVisor sandbox
	}
	if err := runInit(); err != nil {
		fmt.Fprintf(os.Stderr, "sandbox-init: %v\n", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// bridged: the init runs behind the bridge, as a gVisor sandbox's first process. Every syscall it
// makes is then a trap into the sentry, so its commands start with spawn (spawn_linux_amd64.go),
// and it leaves oom_score_adj alone: gVisor has no OOM killer of its own, and the host's takes the
// whole sandbox (its sentry), never one command.
var bridged bool

// initProc is the init's state.
type initProc struct {
	// sendMsg delivers one reply, and the fds passed with it, as over the control socket: the
	// receiver gets its own copies, and ours stay ours.
	sendMsg func(msg []byte, fds []int) error
	env     []string // the whole environment commands start from
	devnull int
	host    bool                // dir provider: shares the host's pid space
	cred    *syscall.Credential // who commands run as, nil: as we do
	self    int
	// oomAdj is our /proc/self/oom_score_adj open for writing (-1 in the dir provider), and oomBase
	// the score we started with: every command is forked with CommandOOMScoreAdj, and we go back
	// to oomBase after the fork (see exec).
	oomAdj  int
	oomBase []byte
	// spawn: commands without a terminal start with spawn, not syscall.ForkExec (see bridged).
	spawn bool
	// pids is where a command's pid goes as it is forked, for the broker to end it without us
	// (PidTable); nil behind the bridge, where no fd passes in from the host.
	pids *PidTable

	// mu is held across fork+register and across every reap, so the reaper never reaps a child it
	// does not know yet (and so a pid is never reused under a registered command).
	mu    sync.Mutex
	byPid map[int]*initChild
	byID  map[uint64]*initChild
	// forked wakes the reaper when it found no children to wait for.
	forked chan struct{}
}

type initChild struct {
	id  uint64
	pid int
	bg  bool
	// tty: the command leads its own session on a terminal (Request.TTY); the session ends with it.
	tty bool
}

func runInit() error {
	// Nothing inherited may stay open in the sandbox: fd 3 is ours, anything above it (the exe fd
	// bwrap ran us from, whatever leaked into the broker) goes at once.
	unix.CloseOnExec(ctlFD)
	closeInherited(ctlFD + 1)
	ctl := newBlockingCtlConn(ctlFD)
	buf := make([]byte, MaxMessage+4096)
	oob := make([]byte, unix.CmsgSpace(8*4)) // the broker sends at most 3 fds; room to spare
	n, oobn, _, err := ctl.recv(buf, oob)
	if err != nil || n == 0 {
		return fmt.Errorf("read config: %v", err)
	}
	// The config brings the pid table (PidTable), if any.
	fds, _ := ParseRights(oob[:oobn])
	var pids *PidTable
	if len(fds) == 1 {
		pids, err = OpenPidTable(fds[0])
		if err != nil {
			return err
		}
	}
	CloseFDs(fds)
	p, err := startInit(buf[:n], ctl.send, pids)
	if err != nil {
		return err
	}
	for {
		n, oobn, flags, err := ctl.recv(buf, oob)
		if err != nil || n == 0 {
			// The broker is gone (or closed us): end everything. In a pid namespace our exit does
			// that; on the host we must.
			if p.host {
				p.killAll()
			}
			return nil
		}
		fds, _ := ParseRights(oob[:oobn])
		if flags&unix.MSG_TRUNC != 0 {
			// Not a request we can answer (the broker never sends these); drop it.
			CloseFDs(fds)
			continue
		}
		p.handle(buf[:n], fds, flags&unix.MSG_CTRUNC != 0)
	}
}

// startInit sets the init up from its config message, starts its reaper and sends ready; replies
// go through send. pids, when not nil, is where commands' pids go instead of a forked reply.
func startInit(msg []byte, send func(msg []byte, fds []int) error, pids *PidTable) (*initProc, error) {
	var cfg Request
	if err := json.Unmarshal(msg, &cfg); err != nil || cfg.Op != OpConfig {
		return nil, fmt.Errorf("bad config message")
	}
	// Orphans (a command's background children whose parent exited) come back to us, so they stay
	// in the tree Stop and timeouts walk. In the namespace provider we are pid 1 and get them anyway.
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	devnull, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/null: %w", err)
	}
	p := &initProc{
		sendMsg: send,
		pids:    pids,
		env:     cfg.Env,
		devnull: devnull,
		host:    cfg.Host,
		self:    os.Getpid(),
		oomAdj:  -1,
		byPid:   make(map[int]*initChild),
		byID:    make(map[uint64]*initChild),
		forked:  make(chan struct{}, 1),
		spawn:   bridged && spawnSupported(),
	}
	if cfg.UID > 0 {
		p.cred = &syscall.Credential{Uid: uint32(cfg.UID), Gid: uint32(cfg.GID), Groups: []uint32{}}
	}
	if !cfg.Host {
		// Opened before we turn non-dumpable: after that our /proc files belong to root.
		if bridged {
			// No OOM score to move (see bridged).
		} else if base, err := os.ReadFile("/proc/self/oom_score_adj"); err == nil {
			if fd, err := unix.Open("/proc/self/oom_score_adj", unix.O_WRONLY|unix.O_CLOEXEC, 0); err == nil {
				p.oomAdj, p.oomBase = fd, []byte(strings.TrimSpace(string(base)))
			}
		}
		// Commands run as our uid: without this any of them could ptrace us, or read our memory
		// and environment through /proc/1. A non-dumpable process can only be traced with
		// CAP_SYS_PTRACE over its user namespace, which nothing inside has. Every command we
		// exec is dumpable again (execve resets it).
		if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
			return nil, fmt.Errorf("prctl(PR_SET_DUMPABLE): %w", err)
		}
	}
	warmThreads(4)
	p.handleSignals()
	go p.reap()
	if err := p.reply(&Reply{Op: OpReady, Pid: p.self}); err != nil {
		return nil, fmt.Errorf("send ready: %w", err)
	}
	return p, nil
}

// handle serves one request. fds came with it and are its own: handle closes them, or the command
// it starts takes them. ctrunc: more fds were sent than arrived.
func (p *initProc) handle(msg []byte, fds []int, ctrunc bool) {
	var req Request
	if json.Unmarshal(msg, &req) != nil {
		// Not a request we can answer (the broker never sends these); drop it.
		CloseFDs(fds)
		return
	}
	if ctrunc {
		CloseFDs(fds)
		p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindStart, Err: "too many file descriptors"})
		return
	}
	switch req.Op {
	case OpExec:
		p.exec(&req, fds)
	case OpKill:
		CloseFDs(fds)
		p.kill(req.ID)
	default:
		CloseFDs(fds)
	}
}

// CommandOOMScoreAdj is every command's oom_score_adj, so that when the sandbox hits its memory
// limit (or the host runs out) the OOM killer takes a command, not the init that runs them all: the
// init (a few MB) keeps the score it inherited and would only be chosen over a command more than
// half the limit smaller than itself (it carries the command's score only from a fork to the write
// that follows the command's exec). The init cannot be given -1000 instead: lowering a score
// needs CAP_SYS_RESOURCE, which these hosts' root lacks, and where it has it the lowered floor
// would pass to every command, which could then make itself unkillable for the whole host. As
// under Kubernetes (whose best-effort pods get 1000), tenant work goes before host services. Going
// back down after the fork needs no privilege: our floor is the score we started with.
var CommandOOMScoreAdj = []byte("500")

// handleSignals keeps the init alive when a command signals it (`kill -TERM 1`, `kill -HUP $PPID`,
// `kill -SEGV 1`): the Go runtime's default is to exit on them, or to crash with a stack dump, which
// would end the sandbox. They are caught, not ignored, because an ignored signal stays ignored in
// every command we exec. Caught SEGV, BUS and FPE are only the ones sent with kill: a real fault in
// the init still crashes it. KILL and STOP from inside never reach a pid namespace's init.
//
// The dir provider starts us with Pdeathsig SIGTERM: when the broker has died (our parent changed)
// we end every command before we go, since there is no pid namespace to do it for us.
func (p *initProc) handleSignals() {
	parent := os.Getppid()
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2,
		unix.SIGALRM, unix.SIGVTALRM, unix.SIGPIPE, unix.SIGTSTP, unix.SIGTTIN, unix.SIGTTOU,
		unix.SIGABRT, unix.SIGSEGV, unix.SIGBUS, unix.SIGTRAP, unix.SIGSYS, unix.SIGILL, unix.SIGFPE)
	go func() {
		for sig := range sigs {
			if sig == unix.SIGTERM && p.host && os.Getppid() != parent {
				p.killAll()
				os.Exit(0)
			}
		}
	}()
}

// warmThreads makes the Go runtime create n spare OS threads now. Threads count against the pids
// limit; under a fork bomb the runtime could not create one when it needs it and would abort the
// init. Parked idle threads are reused and never freed, so creating a few up front avoids that.
func warmThreads(n int) {
	var ready, release sync.WaitGroup
	ready.Add(n)
	release.Add(1)
	for i := 0; i < n; i++ {
		go func() {
			runtime.LockOSThread()
			ready.Done()
			release.Wait()
			runtime.UnlockOSThread()
		}()
	}
	ready.Wait()
	release.Done()
}

// closeInherited closes the fds from `from` up that we inherited. Those are exactly the ones without
// FD_CLOEXEC: exec only passes such fds on, and the Go runtime and standard library open everything
// with O_CLOEXEC, so no fd of the runtime's is touched. Without /proc it falls back to marking all of
// them close-on-exec, which at least keeps them from commands.
func closeInherited(from int) {
	d, err := os.Open("/proc/self/fd")
	if err != nil {
		unix.CloseRange(uint(from), ^uint(0)>>1, unix.CLOSE_RANGE_CLOEXEC)
		return
	}
	names, _ := d.Readdirnames(-1)
	d.Close()
	for _, name := range names {
		fd, err := strconv.Atoi(name)
		if err != nil || fd < from {
			continue
		}
		if flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err == nil && flags&unix.FD_CLOEXEC == 0 {
			unix.Close(fd)
		}
	}
}

func (p *initProc) reply(r *Reply) error { return p.send(r, nil) }

// send is reply with fds passed along (SCM_RIGHTS).
func (p *initProc) send(r *Reply, fds []int) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return p.sendMsg(b, fds)
}

// exec starts one command. fds are the passed stdio ends; they are closed here once the child has
// its copies, so the broker sees EOF exactly when the command (and whatever inherited them) is done.
func (p *initProc) exec(req *Request, fds []int) {
	defer CloseFDs(fds)
	if len(req.Argv) == 0 || req.Argv[0] == "" {
		p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindStart, Err: "empty argv"})
		return
	}
	if req.TTY && req.Bg {
		p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindStart, Err: "a background command has no terminal"})
		return
	}
	var files [3]uintptr
	for i := range files {
		files[i] = uintptr(p.devnull)
		if !req.Bg && !req.TTY && i < len(req.Stdio) && req.Stdio[i] >= 0 && req.Stdio[i] < len(fds) {
			files[i] = uintptr(fds[req.Stdio[i]])
		}
	}
	// A terminal is allocated here, inside the sandbox, and its master handed to the broker with
	// the forked reply: the command's stdio is the slave, and it leads a new session whose
	// controlling terminal that is, so the line discipline turns ^C and ^Z into signals for the
	// foreground job, as on any terminal.
	master := -1
	if req.TTY {
		m, slave, err := openPTY(req.Rows, req.Cols)
		if err != nil {
			p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindStart, Err: "terminal: " + err.Error()})
			return
		}
		master = m
		defer unix.Close(master)
		defer unix.Close(slave)
		files = [3]uintptr{uintptr(slave), uintptr(slave), uintptr(slave)}
	}
	env := p.env
	if len(req.Env) > 0 {
		env = mergeEnv(p.env, req.Env)
	}
	prog := req.Argv[0]
	if !strings.Contains(prog, "/") {
		found, err := lookPath(prog, envValue(env, "PATH"), req.Dir)
		if err != nil {
			p.notRunnable(req, files[2], prog, err)
			return
		}
		prog = found
	}
	attr := &syscall.ProcAttr{
		Dir:   req.Dir,
		Env:   env,
		Files: files[:],
		// Each command leads its own process group, so a kill reaches its children too.
		Sys: &syscall.SysProcAttr{Setpgid: true, Credential: p.cred},
	}
	if req.TTY {
		// A session leader leads its process group too (and may not call setpgid). It runs as
		// every command does (the gvisor level's init is root and drops to the tenant's uid).
		attr.Sys = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0, Credential: p.cred}
	}
	var pid int
	var err error
	for try := 0; ; try++ {
		p.mu.Lock()
		if p.oomAdj >= 0 {
			unix.Pwrite(p.oomAdj, CommandOOMScoreAdj, 0)
		}
		if p.spawn && !req.TTY && spawnable(files) {
			pid, err = spawn(prog, req.Argv, env, req.Dir, files, p.cred)
		} else {
			pid, err = syscall.ForkExec(prog, req.Argv, attr)
		}
		if p.oomAdj >= 0 {
			unix.Pwrite(p.oomAdj, p.oomBase, 0)
		}
		if err == nil {
			c := &initChild{id: req.ID, pid: pid, bg: req.Bg, tty: req.TTY}
			if p.pids != nil && !req.Bg {
				// Written before the command can be waited for: the broker may have to end
				// it from outside from now on.
				p.pids.Put(req.ID, pid)
			}
			p.byPid[pid] = c
			if !req.Bg {
				p.byID[req.ID] = c
			}
			if req.TTY {
				// Sent before mu is let go, so that the reaper's exit reply comes after it: the
				// broker must hold the master before the command's end, or its output is lost.
				p.send(&Reply{Op: OpForked, ID: req.ID, Pid: pid}, []int{master})
			}
		}
		p.mu.Unlock()
		// EAGAIN is the pids limit. Right after a fork bomb was killed its zombies may not all be
		// reaped yet; give the reaper (which needs mu) a moment before failing the request.
		if err != unix.EAGAIN || try == 5 {
			break
		}
		time.Sleep(time.Duration(try+1) * 5 * time.Millisecond)
	}
	if err == nil {
		select {
		case p.forked <- struct{}{}:
		default:
		}
	}
	if err != nil {
		if req.Dir != "" && (errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.EACCES)) {
			if fi, serr := os.Stat(req.Dir); serr != nil {
				p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindCwd, Err: fmt.Sprintf("cwd %s: %v", req.Dir, unwrapPathErr(serr))})
				return
			} else if !fi.IsDir() {
				p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindCwd, Err: fmt.Sprintf("cwd %s is not a directory", req.Dir)})
				return
			}
		}
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EACCES) || errors.Is(err, unix.ENOEXEC) {
			p.notRunnable(req, files[2], req.Argv[0], err)
			return
		}
		p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindStart, Err: "start " + req.Argv[0] + ": " + err.Error()})
		return
	}
	if req.Bg {
		p.reply(&Reply{Op: OpStarted, ID: req.ID, Pid: pid})
		return
	}
	if req.TTY {
		return // forked was sent with the master
	}
	// The broker enforces the command's timeout itself when we do not answer (we may be stopped,
	// hung or starved): it needs the pid, which is the command's process group, to find what to
	// end from outside. It has it from the pid table, written above; the exit carries it too.
	// Behind the bridge it has no use for it: it cannot end a command without us but by ending
	// the whole sandbox (the sentry's processes are not the host's).
	if p.pids == nil && !bridged {
		p.reply(&Reply{Op: OpForked, ID: req.ID, Pid: pid})
	}
}

// notRunnable reports a program that cannot be run the way a shell does: a message on the command's
// stderr and exit status 127 (not found) or 126 (found, not executable).
func (p *initProc) notRunnable(req *Request, stderr uintptr, prog string, err error) {
	code, what := 126, err.Error()
	if errors.Is(err, unix.ENOENT) || errors.Is(err, errNotFound) {
		code, what = 127, "command not found"
	}
	if req.TTY {
		// The terminal goes with this request, so a message written to it would be lost.
		p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindProgram, Err: prog + ": " + what})
		return
	}
	if int(stderr) != p.devnull {
		unix.Write(int(stderr), []byte(prog+": "+what+"\n"))
	}
	if req.Bg {
		p.reply(&Reply{Op: OpError, ID: req.ID, Kind: ErrKindStart, Err: prog + ": " + what})
		return
	}
	p.reply(&Reply{Op: OpExit, ID: req.ID, Code: code})
}

// reap collects every exited child, registered or an orphan handed to us, and reports foreground
// commands. Orphans are reaped silently so that they never linger as zombies.
//
// It blocks in waitid(WNOWAIT) on its own thread rather than waiting for SIGCHLD: the kernel wakes
// it directly when a child exits, where a signal goes through the runtime's signal goroutine and a
// channel first. WNOWAIT leaves the zombie in place, so the actual reap still happens under mu.
func (p *initProc) reap() {
	for {
		var info unix.Siginfo
		err := unix.Waitid(unix.P_ALL, 0, &info, unix.WEXITED|unix.WNOWAIT, nil)
		switch err {
		case nil:
			p.reapExited()
		case unix.ECHILD:
			<-p.forked // no children at all: wait for the next fork
		}
	}
}

func (p *initProc) reapExited() {
	for {
		var ws unix.WaitStatus
		p.mu.Lock()
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if err == unix.EINTR {
			p.mu.Unlock()
			continue
		}
		if pid <= 0 {
			p.mu.Unlock()
			return
		}
		c := p.byPid[pid]
		if c != nil {
			delete(p.byPid, pid)
			if !c.bg {
				delete(p.byID, c.id)
			}
			if c.tty {
				// A terminal session ends with its leader: what it left in the session (jobs,
				// a stopped ^Z job) goes too. A pid stays in use while it names a session, so
				// this sid is still the session's.
				KillTree(0, 0, pid, p.self)
			}
		}
		p.mu.Unlock()
		if c == nil || c.bg {
			continue
		}
		r := Reply{Op: OpExit, ID: c.id, Pid: pid}
		if ws.Signaled() {
			r.Signal = int(ws.Signal())
		} else {
			r.Code = ws.ExitStatus()
		}
		p.reply(&r)
	}
}

// kill ends a command's whole tree (timeout or cancellation). It holds mu so that our own reaper does
// not free pids while the tree is frozen.
func (p *initProc) kill(id uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.byID[id]
	if c == nil {
		return // already exited; its exit report is on the way
	}
	sid := 0
	if c.tty {
		sid = c.pid // job control moves a shell's jobs to groups of their own, within its session
	}
	KillTree(c.pid, c.pid, sid, p.self)
}

// killAll ends every process we started and every orphan handed to us: our descendants (we are
// their subreaper) and anything still in our session.
func (p *initProc) killAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	sid, _ := unix.Getsid(0)
	KillTree(p.self, 0, sid, p.self)
}

var errNotFound = errors.New("executable file not found in $PATH")

// lookPath finds name in PATH like execvp does. Relative PATH entries are relative to the command's
// cwd.
func lookPath(name, pathEnv, dir string) (string, error) {
	for _, d := range strings.Split(pathEnv, ":") {
		if d == "" {
			d = "."
		}
		cand := d + "/" + name
		if !strings.HasPrefix(d, "/") && dir != "" {
			cand = dir + "/" + cand
		}
		var st unix.Stat_t
		if err := unix.Stat(cand, &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFREG && st.Mode&0o111 != 0 {
			return cand, nil
		}
	}
	return "", errNotFound
}

func envValue(env []string, key string) string {
	for i := len(env) - 1; i >= 0; i-- {
		if len(env[i]) > len(key) && env[i][len(key)] == '=' && env[i][:len(key)] == key {
			return env[i][len(key)+1:]
		}
	}
	return ""
}

// mergeEnv returns base with overrides applied (an override replaces a variable of the same name).
func mergeEnv(base, overrides []string) []string {
	out := make([]string, 0, len(base)+len(overrides))
	skip := make(map[string]bool, len(overrides))
	for _, kv := range overrides {
		if i := strings.IndexByte(kv, '='); i > 0 {
			skip[kv[:i]] = true
		}
	}
	for _, kv := range base {
		if i := strings.IndexByte(kv, '='); i > 0 && skip[kv[:i]] {
			continue
		}
		out = append(out, kv)
	}
	return append(out, overrides...)
}

func unwrapPathErr(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
