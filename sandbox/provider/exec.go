package provider

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"golang.org/x/sys/unix"
)

// Commands. Exec checks a request and runs it in the background (startBackground), on a terminal
// (runTTY, tty.go), or in the foreground (run): the command's ends of its stdio pipes go to the init
// with the request, ours are read as output comes (drain), then the init reports the exit. A timeout
// or a cancel asks the init to kill the command (killCall), and the broker ends it from outside if
// the init does not (outside.go).

// Exec runs one command; see Instance.
func (in *instance) Exec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	if err := ctx.Err(); err != nil {
		return ExecResult{}, err
	}
	r := request{Op: opExec, Bg: req.Background}
	var err error
	if r.Argv, err = execArgv(req); err != nil {
		return ExecResult{}, err
	}
	if r.Dir, err = sandboxCwd(req.Cwd); err != nil {
		return ExecResult{}, err
	}
	if in.hostWS != "" {
		r.Dir = in.hostWS + strings.TrimPrefix(r.Dir, WorkspacePath)
	}
	if r.Env, err = envOverrides(req.Env); err != nil {
		return ExecResult{}, err
	}
	if req.Timeout < 0 {
		return ExecResult{}, invalidRequest("negative timeout")
	}
	if req.TTY != nil || req.Background {
		// These wait for the init's answer to their start.
		started(&req)
	}
	if req.TTY != nil {
		return in.runTTY(ctx, &r, req)
	}
	if req.Background {
		return in.startBackground(&r)
	}
	timeout := req.Timeout
	if timeout == 0 {
		timeout = time.Duration(in.limits.ExecTimeout)
	}
	timeout = min(timeout, time.Duration(in.limits.ExecTimeoutMax))
	return in.run(ctx, &r, req, timeout)
}

// startBackground is Exec of a background command: it returns once the init reports the start,
// with the command's pid.
func (in *instance) startBackground(r *request) (ExecResult, error) {
	c := &call{done: make(chan struct{})}
	if err := in.register(c); err != nil {
		return ExecResult{}, err
	}
	r.ID = c.id
	if err := in.send(r, nil, startTimeout); err != nil {
		in.unregister(c)
		return ExecResult{}, err
	}
	<-c.done
	if c.err != nil {
		return ExecResult{}, c.err
	}
	return ExecResult{Pid: c.rep.Pid}, nil
}

// run is a foreground exec: pipes for stdio, the request, output as it comes, then the exit.
func (in *instance) run(ctx context.Context, r *request, req ExecRequest, timeout time.Duration) (ExecResult, error) {
	start := time.Now()
	var (
		send   []int // fds for the init: the command's ends of the pipes
		outs   []*os.File
		stdinW *os.File
		outR   *os.File
		errR   *os.File
	)
	closeAll := func() {
		closeFDs(send)
		send = nil
		for _, f := range outs {
			f.Close()
		}
		if stdinW != nil {
			stdinW.Close()
		}
	}
	r.Stdio = []int{-1, -1, -1}
	if req.Stdin != nil {
		var rfd int
		var err error
		if stdinW, rfd, err = writePipe(); err != nil {
			return ExecResult{}, err
		}
		r.Stdio[0] = len(send)
		send = append(send, rfd)
	}
	if req.Stdout != nil {
		f, wfd, err := readPipe()
		if err != nil {
			closeAll()
			return ExecResult{}, err
		}
		outR, outs = f, append(outs, f)
		r.Stdio[1] = len(send)
		r.Stdio[2] = len(send) // one pipe for both unless Stderr is set: true interleaving
		send = append(send, wfd)
	}
	if req.Stderr != nil {
		f, wfd, err := readPipe()
		if err != nil {
			closeAll()
			return ExecResult{}, err
		}
		errR, outs = f, append(outs, f)
		r.Stdio[2] = len(send)
		send = append(send, wfd)
	}

	c := &call{done: make(chan struct{}), outs: outs, hostWS: in.hostWS}
	if err := in.register(c); err != nil {
		closeAll()
		return ExecResult{}, err
	}
	r.ID = c.id
	// An init that does not take the request at once is waited for: the caller is told first.
	err := in.sendOr(r, send, timeout, func() { started(&req) })
	started(&req) // from here on Exec waits for the command
	if err != nil {
		in.unregister(c)
		closeAll()
		return ExecResult{}, err
	}
	// The init has its own copies now; ours must go, or we would never see EOF.
	closeFDs(send)
	send = nil
	var stdinDone chan struct{}
	if stdinW != nil {
		stdinDone = make(chan struct{})
		go func() {
			io.Copy(stdinW, req.Stdin)
			stdinW.Close()
			close(stdinDone)
		}()
	}
	timer := time.AfterFunc(timeout, func() { in.killCall(c, ReasonTimeout) })
	stopCancel := context.AfterFunc(ctx, func() { in.killCall(c, ReasonCancelled) })

	// Each read end is closed as soon as its output ended: that is usually before the init's exit
	// report arrives, so its close is off the path from the exit to the answer (closeAll's second
	// close of it does nothing).
	o := protocol.NewExecOutputLimit(req.MaxOutput)
	switch {
	case outR != nil && errR != nil:
		errDone := make(chan struct{})
		go func() {
			c.drain(errR, &sink{w: req.Stderr}, o)
			errR.Close()
			close(errDone)
		}()
		c.drain(outR, &sink{w: req.Stdout}, o)
		outR.Close()
		<-errDone
	case outR != nil:
		c.drain(outR, &sink{w: req.Stdout}, o)
		outR.Close()
	case errR != nil:
		c.drain(errR, &sink{w: req.Stderr}, o)
		errR.Close()
	}
	<-c.done
	timer.Stop()
	stopCancel()
	c.mu.Lock()
	if c.outside != nil {
		c.outside.Stop()
	}
	c.mu.Unlock()
	closeAll()
	if stdinDone != nil {
		// Closing our end stops the copy at its next write; it may still sit in Stdin.Read. As
		// os/exec does, wait for it (the caller may reuse the reader) but not forever.
		select {
		case <-stdinDone:
		case <-time.After(stdinWait):
		}
	}

	c.mu.Lock()
	rep, cerr, reason := c.rep, c.err, c.reason
	c.mu.Unlock()
	if cerr != nil {
		return ExecResult{}, cerr
	}
	res := ExecResult{Pid: rep.Pid, ExitCode: rep.Code, Truncated: o.Truncated()}
	if rep.Signal > 0 {
		res.Signal = signalName(rep.Signal)
		res.ExitCode = 128 + rep.Signal
	}
	killed := rep.Signal == int(unix.SIGKILL) || rep.Signal == 0 && rep.Code == 128+int(unix.SIGKILL)
	if reason != "" && rep.Signal == int(unix.SIGKILL) {
		res.Reason = reason
	} else if killed && in.oomKilled() {
		// A shell reports its SIGKILLed child as 137, so an OOM kill of a pipeline member counts.
		res.Reason = ReasonMemoryLimit
		in.endIfMemoryWedged()
	}
	res.Duration = time.Since(start)
	return res, nil
}

// callsStarted: Exec calls ExecRequest.Started itself (CallsStarted).
func (in *instance) callsStarted() {}

// started calls req.Started once: it is dropped after.
func started(req *ExecRequest) {
	if req.Started != nil {
		req.Started()
		req.Started = nil
	}
}

// killCall asks the init to end a command's tree, once, and makes sure it ends: if the init has not
// reported its end killGrace later (it may be stopped, hung or starved), the broker ends it from
// outside (outside.go).
func (in *instance) killCall(c *call, reason string) {
	c.mu.Lock()
	if c.exited || c.reason != "" {
		c.mu.Unlock()
		return
	}
	c.reason = reason
	c.outside = time.AfterFunc(killGrace, func() { in.killOutside(c) })
	c.mu.Unlock()
	in.send(&request{Op: opKill, ID: c.id}, nil, killGrace)
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// drain reads one output pipe until EOF. Once the main process exited, complete sets a deadline: if
// it passes, whatever still holds the pipe is a background process, so drain takes what is already
// buffered and stops when the pipe stays empty for exitGrace.
func (c *call) drain(f *os.File, s *sink, o *protocol.ExecOutputLimit) {
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	afterExit, extra := false, 0
	for {
		n, err := f.Read(buf)
		if n > 0 {
			s.deliver(o, buf[:n])
			if afterExit {
				if extra += n; extra > postExitLimit {
					return
				}
			}
		}
		if err == nil {
			continue
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return // EOF
		}
		c.mu.Lock()
		failed := c.err != nil
		c.mu.Unlock()
		if failed {
			return
		}
		// A deadline read fails even with data buffered; read what is there without waiting.
		afterExit = true
		n, eof := readNow(f, buf)
		if n > 0 {
			s.deliver(o, buf[:n])
			extra += n
		}
		if n == 0 || eof || extra > postExitLimit {
			return
		}
		f.SetReadDeadline(time.Now().Add(exitGrace))
	}
}

// readNow does one non-blocking read, bypassing the deadline.
func readNow(f *os.File, buf []byte) (n int, eof bool) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, true
	}
	rc.Control(func(fd uintptr) {
		m, err := unix.Read(int(fd), buf)
		if m > 0 {
			n = m
		} else if err == nil {
			eof = true
		}
	})
	return n, eof
}

// sink is one destination of a command's output; after its first write error it only drains.
type sink struct {
	w      io.Writer
	failed bool
}

// deliver gives p to the sink within the command's output cap (shared by its outputs, which it also
// serializes). Each sink is fed by one goroutine.
func (s *sink) deliver(o *protocol.ExecOutputLimit, p []byte) {
	w := s.w
	if w == nil || s.failed {
		w = io.Discard
	}
	if err := o.Deliver(w, p); err != nil {
		s.failed = true
	}
}

// readPipe returns a pipe whose read end we keep (non-blocking, so reads go through the poller)
// and whose write end goes to the command. O_NONBLOCK belongs to the open file, and each pipe end
// is its own, so the command still gets the blocking pipe programs expect.
func readPipe() (*os.File, int, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return nil, -1, fmt.Errorf("pipe: %w", err)
	}
	if err := unix.SetNonblock(p[0], true); err != nil {
		closeFDs(p[:])
		return nil, -1, err
	}
	return os.NewFile(uintptr(p[0]), "exec-output"), p[1], nil
}

// writePipe is readPipe the other way round, for stdin.
func writePipe() (*os.File, int, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return nil, -1, fmt.Errorf("pipe: %w", err)
	}
	if err := unix.SetNonblock(p[1], true); err != nil {
		closeFDs(p[:])
		return nil, -1, err
	}
	return os.NewFile(uintptr(p[1]), "exec-stdin"), p[0], nil
}

// execArgv checks Command/Argv and returns what the init will run.
func execArgv(req ExecRequest) ([]string, error) {
	switch {
	case req.Command != "" && len(req.Argv) > 0:
		return nil, invalidRequest("set Command or Argv, not both")
	case req.Command != "":
		if strings.IndexByte(req.Command, 0) >= 0 {
			return nil, invalidRequest("command contains a NUL byte")
		}
		return []string{"/bin/sh", "-c", req.Command}, nil
	case len(req.Argv) > 0:
		if req.Argv[0] == "" {
			return nil, invalidRequest("empty program name")
		}
		for _, a := range req.Argv {
			if strings.IndexByte(a, 0) >= 0 {
				return nil, invalidRequest("argument contains a NUL byte")
			}
		}
		return req.Argv, nil
	}
	return nil, invalidRequest("no command")
}

// envOverrides checks a request's environment and returns it as the init takes it (KEY=VALUE).
func envOverrides(env map[string]string) ([]string, error) {
	if len(env) == 0 {
		return nil, nil
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		if !validEnvName(k) {
			return nil, invalidRequest("environment variable name %q", k)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return nil, invalidRequest("environment variable %s contains a NUL byte", k)
		}
		out = append(out, k+"="+v)
	}
	return out, nil
}

// signalName is the name without "SIG" ("KILL"), or the number for unknown signals.
func signalName(sig int) string {
	if name := unix.SignalName(unix.Signal(sig)); name != "" {
		return strings.TrimPrefix(name, "SIG")
	}
	return fmt.Sprint(sig)
}
