package agent

import (
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
)

// A command on a terminal (OpTTY), as the namespace provider's init runs one: the agent allocates a
// pseudo-terminal from the pod's own devpts (sbxinit.OpenPTY, the init's code: x/sys/unix, no
// library needed), the command leads a new session with it as its controlling terminal, so ^C and
// ^Z typed are signals to its foreground job. Keystrokes come as FrameStdin within TTYWindow,
// credited back as the terminal takes them; a resize is FrameResize; the end of input is typed as
// the terminal's end-of-file character; everything the terminal shows goes back as FrameStdout.
//
// Bounds: output is read only as fast as the connection takes it (a broker that does not read
// stops the program at its next write, nothing piles up here); input held here is at most the
// window. When the session's leader ends, the rest of its session goes too; a kill, a timeout or a
// broken connection ends the whole session (its jobs in their own process groups included).

// execTTY runs one command on a terminal on its connection.
func (s *Server) execTTY(c *conn, a ExecArgs) {
	if len(a.Argv) == 0 || a.Argv[0] == "" {
		c.result(nil, &Error{Kind: KindArgs, Message: "no command"})
		return
	}
	if a.Background || a.Stderr {
		c.result(nil, &Error{Kind: KindArgs, Message: "a terminal has one output and no background"})
		return
	}
	dir, derr := s.commandDir(a.Dir)
	if derr != nil {
		c.result(nil, derr)
		return
	}
	env := mergeEnv(s.cfg.Env, a.Env)
	prog, err := lookPath(a.Argv[0], envValue(env, "PATH"), dir)
	if err != nil {
		// On a terminal there is no stderr to print it on: the caller gets it as a refusal.
		what := err.Error()
		if errors.Is(err, errNotFound) || errors.Is(err, os.ErrNotExist) {
			what = "command not found"
		}
		c.result(nil, &Error{Kind: KindArgs, Message: a.Argv[0] + ": " + what})
		return
	}
	rows, cols := a.Rows, a.Cols
	if rows == 0 || cols == 0 {
		rows, cols = 24, 80
	}
	m, sl, err := sbxinit.OpenPTY(rows, cols)
	if err != nil {
		c.result(nil, &Error{Kind: KindStart, Message: "terminal: " + err.Error()})
		return
	}
	slave := os.NewFile(uintptr(sl), "tty-slave")
	// Non-blocking, so the runtime's poller serves it: a read deadline and a close end a read
	// or a write in progress.
	unix.SetNonblock(m, true)
	master := os.NewFile(uintptr(m), "tty-master")
	defer master.Close()
	cmd := &exec.Cmd{Path: prog, Args: a.Argv, Dir: dir, Env: env, Stdin: slave, Stdout: slave, Stderr: slave,
		SysProcAttr: &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}}
	start := time.Now()
	err = cmd.Start()
	slave.Close() // the command holds it now; the master reads EIO once every holder is gone
	if err != nil {
		c.result(nil, &Error{Kind: KindStart, Message: err.Error()})
		return
	}
	pid, self := cmd.Process.Pid, os.Getpid()
	var mu sync.Mutex
	reason, ended := "", false
	kill := func(why string) {
		mu.Lock()
		defer mu.Unlock()
		if ended {
			return // reaped: its pid may be another's now
		}
		if reason == "" {
			reason = why
		}
		// The leader's group, its session (job control gives jobs groups of their own) and
		// whatever they started.
		sbxinit.KillTree(pid, pid, pid, self)
	}
	if err := WriteJSON(c, FrameStarted, Started{Pid: pid}); err != nil {
		kill(protocol.ExecReasonCancelled)
	}
	var timer *time.Timer
	if a.TimeoutMs > 0 {
		timer = time.AfterFunc(time.Duration(a.TimeoutMs)*time.Millisecond, func() { kill(protocol.ExecReasonTimeout) })
	}
	in := newTTYInput()
	// The broker's frames, read to the connection's end whatever the terminal does.
	go func() {
		defer in.close()
		for {
			typ, p, err := ReadFrame(c.r, nil)
			if err != nil {
				kill(protocol.ExecReasonCancelled)
				return
			}
			switch typ {
			case FrameStdin:
				if !in.push(p) {
					kill(protocol.ExecReasonCancelled) // a broker past its window: broken
					return
				}
			case FrameStdinEOF:
				in.push(nil)
			case FrameResize:
				if len(p) == 4 {
					ws := unix.Winsize{Row: binary.BigEndian.Uint16(p), Col: binary.BigEndian.Uint16(p[2:])}
					if ws.Row > 0 && ws.Col > 0 {
						control(master, func(fd int) { unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, &ws) })
					}
				}
			case FrameKill:
				kill(protocol.ExecReasonCancelled)
			}
		}
	}()
	// Keystrokes to the terminal, each batch credited back once taken. A program that does not
	// read leaves this write blocked; the master's close ends it.
	go func() {
		var credit [4]byte
		for {
			p, ok := in.pop()
			if !ok {
				return
			}
			if p == nil {
				typeEOF(master)
				continue
			}
			if _, err := master.Write(p); err != nil {
				return
			}
			binary.BigEndian.PutUint32(credit[:], uint32(len(p)))
			if c.write(FrameCredit, credit[:]) != nil {
				return
			}
		}
	}()
	limit := protocol.NewExecOutputLimit(a.MaxOutput)
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		w := &frameWriter{c: c, typ: FrameStdout}
		buf := make([]byte, 32<<10)
		for {
			n, err := master.Read(buf)
			if n > 0 && limit.Deliver(w, buf[:n]) != nil {
				kill(protocol.ExecReasonCancelled)
			}
			if err != nil {
				return // EIO: every holder of the terminal is gone
			}
		}
	}()
	// Wait without reaping, so that a kill racing the end never reaches a reused pid; the session
	// ends with its leader (what it left behind, a stopped ^Z job included, goes too), while the
	// leader's pid still names it.
	var info unix.Siginfo
	for {
		if err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil); err != unix.EINTR {
			break
		}
	}
	mu.Lock()
	sbxinit.KillTree(0, 0, pid, self)
	ended = true
	mu.Unlock()
	cmd.Wait()
	if timer != nil {
		timer.Stop()
	}
	// A process that left the session (setsid) may still hold the terminal: give its output a
	// moment, then stop reading.
	select {
	case <-drained:
	case <-time.After(time.Second):
		master.SetReadDeadline(time.Now())
		<-drained
	}
	in.close()
	mu.Lock()
	res := exitResult(cmd.ProcessState, time.Since(start), limit.Truncated(), pid, reason)
	mu.Unlock()
	c.result(res, nil)
}

// ttyInput is the keystrokes a terminal has yet to take, at most TTYWindow bytes (the broker's
// side keeps to it); a nil entry is the end of input.
type ttyInput struct {
	mu     sync.Mutex
	queue  [][]byte
	held   int
	closed bool
	more   chan struct{} // a wake-up for pop, buffered 1
}

func newTTYInput() *ttyInput { return &ttyInput{more: make(chan struct{}, 1)} }

// push queues p; false when it would pass the window.
func (t *ttyInput) push(p []byte) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return true
	}
	if t.held+len(p) > TTYWindow {
		return false
	}
	t.held += len(p)
	t.queue = append(t.queue, p)
	select {
	case t.more <- struct{}{}:
	default:
	}
	return true
}

// pop waits for the next entry; false once closed.
func (t *ttyInput) pop() ([]byte, bool) {
	for {
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			return nil, false
		}
		if len(t.queue) > 0 {
			p := t.queue[0]
			t.queue[0] = nil
			t.queue = t.queue[1:]
			t.held -= len(p)
			t.mu.Unlock()
			return p, true
		}
		t.mu.Unlock()
		<-t.more
	}
}

func (t *ttyInput) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		t.closed, t.queue, t.held = true, nil, 0
		close(t.more)
	}
}

// control runs fn on f's descriptor.
func control(f *os.File, fn func(fd int)) {
	if rc, err := f.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) { fn(int(fd)) })
	}
}

// typeEOF types the terminal's VEOF character (^D unless the program changed it).
func typeEOF(master *os.File) {
	eof := byte(4)
	control(master, func(fd int) {
		// Terminal modes asked of a master are its slave's, which the program sets.
		if t, err := unix.IoctlGetTermios(fd, unix.TCGETS); err == nil && t.Cc[unix.VEOF] != 0 {
			eof = t.Cc[unix.VEOF]
		}
	})
	master.Write([]byte{eof})
}
