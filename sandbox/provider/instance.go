package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
	"golang.org/x/sys/unix"
)

const (
	// exitGrace is how long Exec keeps reading after the command's main process exited while
	// something (a background child: `server &`) still holds its output pipe open. After that Exec
	// returns and the background process keeps running.
	exitGrace = 20 * time.Millisecond
	// postExitLimit bounds what Exec reads after the main process exited, so a chatty background
	// process cannot keep Exec from returning. It is well above a pipe's buffer (64 KiB), which is
	// all the main process itself can have left unread.
	postExitLimit = 1 << 20
	// startTimeout bounds how long Start waits for the init to say it is ready.
	startTimeout = 15 * time.Second
	// stdinWait bounds how long Exec waits, after the command ended, for a Stdin reader that is
	// blocked in Read; past it the copy is abandoned.
	stdinWait = time.Second
)

// instance is a running sandbox as the broker sees it: the init's process (bwrap's, for the
// namespace provider), the control socket, and the commands in flight.
type instance struct {
	kind    string // "namespace" or "dir"
	ctl     *ctlConn
	cmd     *exec.Cmd
	stderr  *headBuffer
	cg      *cgroupSet
	limits  Limits
	hostWS  string // dir provider: the host directory /workspace stands for
	release func()
	lostWhy func() string // see launchSpec.lostWhy

	mu    sync.Mutex
	calls map[uint64]*call
	// pids is where the init writes each command's pid (sbxinit.PidTable), nil at the gvisor
	// level; slots maps each of its slots taken by a call in flight to the call's id, so that no
	// two calls in flight share one.
	pids    *sbxinit.PidTable
	slots   map[uint64]uint64
	nextID  uint64
	deadErr error
	initPid int    // host pid of the init
	pidfd   int    // the init's pidfd (namespace), so Stop never signals a reused pid
	netStop func() // ends the network helper; nil when there is none
	oomStop func() // ends the OOM event watch; nil when there is none
	ended   bool   // wait has torn down: a helper started now must be stopped at once

	env      map[string]string
	done     chan struct{}
	stopOnce sync.Once
	oomSeen  atomic.Int64
	// lastOOM is when an exec last reported an OOM kill (unix nanoseconds), so that wait can tell an
	// init killed by the memory limit even when that exec consumed the counter's last step.
	lastOOM atomic.Int64
	// stopping is set when the sandbox is ended on purpose (Stop, a failed start, memory wedged).
	stopping atomic.Bool
	// why is the reason the instance ended without a Stop (EndReason), set before done closes.
	why atomic.Pointer[string]
}

// launchSpec is what a provider hands to launch.
type launchSpec struct {
	kind string
	// cmd runs the init (directly, or bwrap running it). launch puts the control socket at fd 3;
	// cmd.ExtraFiles, if any, follow at fd 4 and are closed by launch once the child has them.
	cmd     *exec.Cmd
	config  request
	cg      *cgroupSet
	limits  Limits
	hostWS  string
	release func()
	// info, when set, is the read end of bwrap's --info-fd: it names the sandbox's first process
	// as soon as bwrap has cloned it, so the cgroup attach can run while the init is still starting.
	info *os.File
	// placed: the init is forked inside cg (cgroupSet.placeThread), so nothing needs attaching.
	placed bool
	// network, when set, attaches the sandbox's network helper to the namespaces of the init (host
	// pid) once it is ready; the function it returns ends the helper and runs when the sandbox ends.
	network func(ctx context.Context, initPid int) (stop func(), err error)
	// relay: the init runs where no fd passes in from the host (gvisor); cmd's stdin and stdout
	// are the stream to its bridge, and startRelay carries the control socket over it.
	relay bool
	// id is the sandbox's, for the relay's logs.
	id string
	// lostWhy, when set, says why the init's process ended when nobody stopped it ("" if it does
	// not know), before anything is torn down: gvisor reads its sentry's cgroup.
	lostWhy func() string
}

// launch starts an init and returns once it is ready, attached to its cgroups, and the environment
// snapshot is taken. On error nothing is left running.
func launch(ctx context.Context, ls launchSpec) (*instance, error) {
	extra := ls.cmd.ExtraFiles
	closeExtra := func() {
		for _, f := range extra {
			f.Close()
		}
	}
	fail := func(err error) (*instance, error) {
		closeExtra()
		if ls.info != nil {
			ls.info.Close()
		}
		ls.cg.remove()
		ls.release()
		return nil, err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fail(fmt.Errorf("control socket: %w", err))
	}
	// With SO_PASSCRED every message carries its sender's pid, translated by the kernel into our pid
	// namespace: the ready message tells us the init's host pid without scanning /proc. It is turned
	// off once the init is ready.
	if err := unix.SetsockoptInt(pair[0], unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		closeFDs(pair[:])
		return fail(fmt.Errorf("control socket: %w", err))
	}
	ctl, err := newCtlConn(pair[0], "sandbox-ctl")
	if err != nil {
		unix.Close(pair[1])
		return fail(fmt.Errorf("control socket: %w", err))
	}
	initEnd := os.NewFile(uintptr(pair[1]), "sandbox-ctl-init")
	var pids *sbxinit.PidTable
	var configFDs []int
	if !ls.relay {
		var fd int
		if pids, fd, err = sbxinit.NewPidTable(); err != nil {
			initEnd.Close()
			ctl.close()
			return fail(err)
		}
		defer unix.Close(fd) // the init has its own once the config is sent
		configFDs = []int{fd}
	}
	in := &instance{
		kind:    ls.kind,
		ctl:     ctl,
		cmd:     ls.cmd,
		stderr:  &headBuffer{max: 8 << 10},
		cg:      ls.cg,
		limits:  ls.limits,
		hostWS:  ls.hostWS,
		release: ls.release,
		lostWhy: ls.lostWhy,
		calls:   make(map[uint64]*call),
		pids:    pids,
		slots:   make(map[uint64]uint64),
		done:    make(chan struct{}),
	}
	var afterSpawn func()
	if ls.relay {
		if afterSpawn, err = startRelay(initEnd, in.cmd, slog.With("sandbox_id", ls.id)); err != nil {
			initEnd.Close()
			ctl.close()
			return fail(fmt.Errorf("control relay: %w", err))
		}
	} else {
		in.cmd.ExtraFiles = append([]*os.File{initEnd}, extra...)
	}
	in.cmd.Stderr = in.stderr
	in.cmd.WaitDelay = time.Second
	// The config waits in the socket buffer until the init reads it, so it costs no round trip.
	cfg, _ := json.Marshal(&ls.config)
	if err := ctl.send(cfg, configFDs); err != nil {
		initEnd.Close()
		ctl.close()
		if pids != nil {
			pids.Close()
		}
		return fail(fmt.Errorf("send init config: %w", err))
	}
	if ls.placed {
		err = spawn(in.cmd, in.cg)
	} else {
		err = spawn(in.cmd, nil)
	}
	initEnd.Close()
	closeExtra()
	if afterSpawn != nil {
		afterSpawn()
	}
	if err != nil {
		ctl.close()
		if pids != nil {
			pids.Close()
		}
		if ls.info != nil {
			ls.info.Close()
		}
		ls.cg.remove()
		ls.release()
		return nil, fmt.Errorf("start %s: %w", in.cmd.Path, err)
	}
	// Moving a process between v1 cgroups waits for an RCU grace period (milliseconds); doing it
	// while bwrap sets up and the Go runtime of the init starts keeps it off the critical path.
	var attached chan attachResult
	if ls.info != nil && in.cg != nil {
		attached = make(chan attachResult, 1)
		bwrapPid := in.cmd.Process.Pid
		go func() { attached <- earlyAttach(ls.info, in.cg, bwrapPid) }()
	} else if ls.info != nil {
		ls.info.Close()
	}
	if in.kind == kindDir {
		in.initPid = in.cmd.Process.Pid
	}
	go in.wait()

	abort := func(err error) (*instance, error) {
		in.stopOnce.Do(in.kill)
		<-in.done
		if msg := strings.TrimSpace(in.stderr.String()); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		return nil, err
	}
	pid, err := in.awaitReady(ctx)
	if err != nil {
		return abort(fmt.Errorf("start sandbox: %w", err))
	}
	in.mu.Lock()
	if in.kind == kindNamespace {
		in.initPid = pid
		pfd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			in.mu.Unlock()
			return abort(fmt.Errorf("start sandbox: pidfd of init: %w", err))
		}
		in.pidfd = pfd
	}
	in.mu.Unlock()
	if in.cg != nil && !ls.placed {
		// The attach must be complete before the first command: everything the init forks from
		// then on inherits the cgroups.
		attachedPid, err := -1, error(nil)
		if attached != nil {
			select {
			case r := <-attached:
				attachedPid, err = r.pid, r.err
			case <-ctx.Done():
				err = ctx.Err()
			case <-time.After(startTimeout):
				err = errors.New("no child pid from bwrap's --info-fd")
			}
		}
		switch {
		case err != nil:
			return abort(fmt.Errorf("start sandbox: cgroup attach: %w", err))
		case attachedPid == pid:
		case attached != nil:
			err = in.cg.attach(pid)
		default:
			err = in.cg.attach(in.cmd.Process.Pid, pid)
		}
		if err != nil {
			return abort(err)
		}
	}
	if in.cg != nil {
		in.oomSeen.Store(max(in.cg.oomKills(), 0))
		// Memory no process holds can fill the limit without any exec being killed for it (a
		// shell that survives its child's kill), so the wedge is checked at each OOM event.
		stop := in.cg.watchOOM(in.endIfMemoryWedged)
		in.mu.Lock()
		if in.ended {
			in.mu.Unlock()
			stop()
		} else {
			in.oomStop = stop
			in.mu.Unlock()
		}
	}
	if ls.network != nil {
		stop, err := ls.network(ctx, pid)
		if err != nil {
			return abort(fmt.Errorf("start sandbox: %w", err))
		}
		in.mu.Lock()
		ended := in.ended
		if !ended {
			in.netStop = stop
		}
		in.mu.Unlock()
		if ended {
			stop()
			return abort(errors.New("start sandbox: init exited while its network was set up"))
		}
	}
	go in.readLoop()

	// The environment snapshot is the config's: the init starts every command with exactly that
	// environment (plus what the request adds), so it needs no round trip. It was `env -0` through
	// the init, ~2 ms of every cold start for the same list.
	in.env = parseEnv0([]byte(strings.Join(ls.config.Env, "\x00")))
	return in, nil
}

type attachResult struct {
	pid int // the child bwrap reported, -1 if none
	err error
}

// earlyAttach reads bwrap's info ({"child-pid": N}) and moves bwrap and that child into the cgroups.
func earlyAttach(info *os.File, cg *cgroupSet, bwrapPid int) attachResult {
	defer info.Close()
	var v struct {
		ChildPid int `json:"child-pid"`
	}
	// Decode stops after one value; bwrap need not close the fd for this to return.
	if err := json.NewDecoder(io.LimitReader(info, 4096)).Decode(&v); err != nil || v.ChildPid <= 0 {
		return attachResult{pid: -1, err: fmt.Errorf("bwrap info: %v", err)}
	}
	return attachResult{pid: v.ChildPid, err: cg.attach(bwrapPid, v.ChildPid)}
}

// awaitReady reads the init's first message and returns the init's host pid.
func (in *instance) awaitReady(ctx context.Context) (int, error) {
	deadline := time.Now().Add(startTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	var mu sync.Mutex
	armed := true
	in.ctl.f.SetReadDeadline(deadline)
	stop := context.AfterFunc(ctx, func() {
		mu.Lock()
		if armed {
			in.ctl.f.SetReadDeadline(time.Now())
		}
		mu.Unlock()
	})
	defer stop()
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(unix.SizeofUcred)+unix.CmsgSpace(4*4))
	n, oobn, _, err := in.ctl.recv(buf, oob)
	mu.Lock()
	armed = false
	in.ctl.f.SetReadDeadline(time.Time{})
	mu.Unlock()
	if fds, _ := parseRights(oob[:oobn]); len(fds) > 0 {
		closeFDs(fds)
	}
	switch {
	case err != nil && ctx.Err() != nil:
		return 0, ctx.Err()
	case errors.Is(err, os.ErrDeadlineExceeded):
		return 0, fmt.Errorf("init not ready after %v", startTimeout)
	case n == 0 && err == nil, errors.Is(err, unix.ECONNRESET):
		// The other end closed (ECONNRESET when our config was still unread): bwrap or the init
		// exited. Once it is reaped its stderr is complete, and abort appends it.
		<-in.done
		return 0, errors.New("init exited before it was ready")
	case err != nil:
		return 0, err
	}
	var r reply
	if err := json.Unmarshal(buf[:n], &r); err != nil || r.Op != opReady {
		return 0, errors.New("init sent a bad ready message")
	}
	pid, err := parseCreds(oob[:oobn])
	if err != nil {
		return 0, err
	}
	in.ctl.rc.Control(func(fd uintptr) {
		unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PASSCRED, 0)
	})
	return pid, nil
}

// wait reaps the init's process and tears everything down, however the init ended.
func (in *instance) wait() {
	err := in.cmd.Wait()
	// The cgroup goes below: whether its OOM killer took the init must be read first.
	if !in.stopping.Load() && killedBySIGKILL(in.cmd, err) && in.oomSince() {
		in.setWhy(ReasonMemoryLimit)
	}
	if in.lostWhy != nil && !in.stopping.Load() {
		if why := in.lostWhy(); why != "" {
			in.setWhy(why)
		}
	}
	// The reason is final from here (a later memory watch must not change what Done reported), and
	// it is the word new calls get: the reply loop may have failed the calls in flight first, as
	// the init's socket closed, before the memory watch had said why.
	in.setWhy("")
	final := in.endErr()
	in.fail(final)
	in.mu.Lock()
	in.deadErr = final
	in.mu.Unlock()
	if in.kind == kindDir && in.initPid > 0 {
		// Without a pid namespace, processes that outlived the init (their parent died, and so did
		// their subreaper) are still in its session.
		killTree(0, 0, in.initPid, os.Getpid())
	}
	in.ctl.close()
	in.mu.Lock()
	if in.pidfd > 0 {
		unix.Close(in.pidfd)
		in.pidfd = 0
	}
	if in.pids != nil {
		in.pids.Close()
		in.pids = nil
	}
	netStop, oomStop := in.netStop, in.oomStop
	in.netStop, in.oomStop, in.ended = nil, nil, true
	in.mu.Unlock()
	if netStop != nil {
		netStop()
	}
	if oomStop != nil {
		oomStop()
	}
	in.cg.remove()
	in.release()
	close(in.done)
}

// kill ends everything in the sandbox; wait does the rest.
func (in *instance) kill() {
	in.stopping.Store(true)
	select {
	case <-in.done:
		return
	default:
	}
	switch in.kind {
	case kindNamespace:
		// Killing the pid namespace's init makes the kernel kill every process in the namespace,
		// and bwrap exits once they are gone.
		in.mu.Lock()
		pfd := in.pidfd
		if pfd > 0 {
			unix.PidfdSendSignal(pfd, unix.SIGKILL, nil, 0)
		}
		in.mu.Unlock()
		if pfd > 0 {
			return
		}
		// The init is not known yet (an aborted Start). Killing bwrap alone is not enough: its
		// child may still be in bwrap's setup, before --die-with-parent applies, blocked forever
		// waiting for the parent we killed. Freeze bwrap (it clones nothing more), then kill the
		// whole tree under it.
		if err := in.cmd.Process.Signal(unix.SIGSTOP); err != nil {
			return
		}
		killTree(in.cmd.Process.Pid, 0, 0, os.Getpid())
	case kindGvisor:
		// runsc run is attached: its sandbox and gofer die with it (Pdeathsig), and with the
		// sandbox every process in it. The release removes its state.
		in.cmd.Process.Kill()
	case kindDir:
		// Stop the init first (through its pidfd, so never a reused pid): frozen, it reaps nothing
		// and forks nothing, so the pids of its tree stay valid while we walk and kill it.
		if err := in.cmd.Process.Signal(unix.SIGSTOP); err != nil {
			return
		}
		killTree(in.initPid, 0, in.initPid, os.Getpid())
	}
}

// setWhy records why the instance ended without a Stop; the first reason stays.
func (in *instance) setWhy(reason string) { in.why.CompareAndSwap(nil, &reason) }

// endReason is the reason setWhy recorded, "" if none.
func (in *instance) endReason() string {
	if p := in.why.Load(); p != nil {
		return *p
	}
	return ""
}

// endErr is what calls in flight and new ones get once the init is gone.
func (in *instance) endErr() error {
	if in.endReason() == ReasonMemoryLimit {
		return ErrMemoryLimit
	}
	return fmt.Errorf("%w: the sandbox's init exited", ErrStopped)
}

// parseEnv0 reads env -0's output (NUL-separated KEY=VALUE entries).
func parseEnv0(b []byte) map[string]string {
	env := map[string]string{}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if k, v, ok := bytes.Cut(kv, []byte("=")); ok && len(k) > 0 {
			env[string(k)] = string(v)
		}
	}
	return env
}

// Environment is the snapshot taken at Start; the map is a copy.
func (in *instance) Environment() map[string]string {
	out := make(map[string]string, len(in.env))
	for k, v := range in.env {
		out[k] = v
	}
	return out
}

// Stop ends every process in the sandbox and waits until they are gone and the cgroups removed.
func (in *instance) Stop(ctx context.Context) error {
	in.stopOnce.Do(in.kill)
	select {
	case <-in.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stop sandbox: %w", ctx.Err())
	}
}

// Done is closed when the init has exited and the sandbox is torn down.
func (in *instance) Done() <-chan struct{} { return in.done }

// headBuffer keeps the first max bytes written (bwrap's and the init's error messages come first).
type headBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (h *headBuffer) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if room := h.max - len(h.b); room > 0 {
		h.b = append(h.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (h *headBuffer) String() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return string(h.b)
}

// The provider kinds, as Name reports them.
const (
	kindNamespace = "namespace"
	kindDir       = "dir"
	kindGvisor    = "gvisor"
)
