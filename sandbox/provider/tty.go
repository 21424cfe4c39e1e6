package provider

import (
	"context"
	"io"
	"os"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"golang.org/x/sys/unix"
)

// A command on a terminal (ExecRequest.TTY). The init allocates the terminal inside the sandbox and
// passes its master back with the forked reply; from then on the broker talks to the master
// directly: keystrokes are written to it, output read from it, and a resize is an ioctl on it. No
// byte of the session goes through the init.
//
// At the gvisor level the master cannot leave the sentry: the bridge keeps it and the relay passes,
// in its place, one end of a socket pair whose messages the bridge's frames carry (gvisor_relay.go).
// Output reads the same from either; what the broker writes differs (bridgedTerminal), and that is
// the only place the two levels part.

// runsTTY is the mark SupportsTTY looks for: every instance launch starts can run a command on a
// terminal.
func (in *instance) runsTTY() {}

// takeTerminal hands a terminal call its master, received with the forked reply. It answers false
// (the caller closes fds) when the call wants none, the reply carried anything else, or a master
// came already: the init sends one, and a second must neither block the reply loop (pty holds
// one) nor be kept.
func (c *call) takeTerminal(fds []int) bool {
	if c.pty == nil || len(fds) != 1 {
		return false
	}
	c.mu.Lock()
	if c.ptyTaken {
		c.mu.Unlock()
		return false
	}
	c.mu.Unlock()
	if err := unix.SetNonblock(fds[0], true); err != nil {
		return false
	}
	f := os.NewFile(uintptr(fds[0]), "tty-master")
	c.mu.Lock()
	c.ptyTaken = true
	// Among outs, the command's end sets its read deadline as for a pipe (complete, fail).
	c.outs = append(c.outs, f)
	c.mu.Unlock()
	c.pty <- f // buffered, and the init sends one forked reply per command
	return true
}

// runTTY is Exec on a terminal: the request, the master, then keystrokes in and output out until the
// command (the session's leader) ends.
func (in *instance) runTTY(ctx context.Context, r *request, req ExecRequest) (ExecResult, error) {
	switch {
	case req.Background:
		return ExecResult{}, invalidRequest("a background command has no terminal")
	case req.Stderr != nil:
		return ExecResult{}, invalidRequest("a terminal has one output: set Stdout only")
	}
	start := time.Now()
	r.TTY, r.Rows, r.Cols = true, req.TTY.Rows, req.TTY.Cols
	if r.Rows == 0 || r.Cols == 0 {
		r.Rows, r.Cols = 24, 80
	}
	c := &call{done: make(chan struct{}), hostWS: in.hostWS, pty: make(chan *os.File, 1)}
	if err := in.register(c); err != nil {
		return ExecResult{}, err
	}
	r.ID = c.id
	if err := in.send(r, nil, startTimeout); err != nil {
		in.unregister(c)
		return ExecResult{}, err
	}
	var master *os.File
	select {
	case master = <-c.pty:
	case <-c.done:
		// The command failed to start, or the init is gone. (Its exit cannot come first: the
		// init sends forked, with the master, before the reaper may report the exit.)
		select {
		case master = <-c.pty:
		default:
		}
	}
	if master == nil {
		<-c.done
		c.mu.Lock()
		err := c.err
		c.mu.Unlock()
		if err == nil {
			err = ErrStopped
		}
		return ExecResult{}, err
	}
	defer master.Close()
	term := terminalOf(master)
	var timer *time.Timer
	if req.Timeout > 0 {
		timer = time.AfterFunc(min(req.Timeout, time.Duration(in.limits.ExecTimeoutMax)), func() { in.killCall(c, ReasonTimeout) })
	}
	stopCancel := context.AfterFunc(ctx, func() { in.killCall(c, ReasonCancelled) })
	quit := make(chan struct{})
	if req.TTY.Resize != nil {
		go resizeLoop(term, req.TTY.Resize, quit)
	}
	if req.Stdin != nil {
		// Ends at the master's close (its next write fails), or when Stdin ends; a Read still
		// blocked then is the caller's to end. The end of Stdin is typed as the terminal's
		// end-of-file character (^D), which is how a terminal says it: a program reading a line
		// reads end of file.
		go func() {
			if _, err := io.Copy(term, req.Stdin); err == nil {
				term.typeEOF()
			}
		}()
	}
	c.drain(master, &sink{w: req.Stdout}, protocol.NewExecOutputLimit(req.MaxOutput))
	<-c.done
	close(quit)
	if timer != nil {
		timer.Stop()
	}
	stopCancel()
	c.mu.Lock()
	if c.outside != nil {
		c.outside.Stop()
	}
	rep, cerr, reason := c.rep, c.err, c.reason
	c.mu.Unlock()
	if cerr != nil {
		return ExecResult{}, cerr
	}
	res := ExecResult{Pid: rep.Pid, ExitCode: rep.Code, Duration: time.Since(start)}
	if rep.Signal > 0 {
		res.Signal = signalName(rep.Signal)
		res.ExitCode = 128 + rep.Signal
	}
	if reason != "" && rep.Signal == int(unix.SIGKILL) {
		res.Reason = reason
	} else if rep.Signal == int(unix.SIGKILL) && in.oomKilled() {
		res.Reason = ReasonMemoryLimit
		in.endIfMemoryWedged()
	}
	return res, nil
}

// terminal is the broker's end of a command's terminal: keystrokes are written to it; the window
// and the end of input are set through it. Output is read from the file under it.
type terminal interface {
	io.Writer
	resize(WindowSize)
	typeEOF()
}

// terminalOf is the terminal whose end f is: a master (the namespace level), or a socket to the
// gvisor level's bridge, which holds the master.
func terminalOf(f *os.File) terminal {
	if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeSocket != 0 {
		return bridgedTerminal{f}
	}
	return ptyMaster{f}
}

// ptyMaster is a terminal's master itself.
type ptyMaster struct{ f *os.File }

func (m ptyMaster) Write(p []byte) (int, error) { return m.f.Write(p) }

// ReadFrom keeps io.Copy to a master on the file's own path.
func (m ptyMaster) ReadFrom(r io.Reader) (int64, error) { return m.f.ReadFrom(r) }

// resize sets the window: the kernel sends SIGWINCH to the terminal's foreground process group.
func (m ptyMaster) resize(ws WindowSize) {
	rc, err := m.f.SyscallConn()
	if err != nil {
		return
	}
	rc.Control(func(fd uintptr) {
		unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: ws.Rows, Col: ws.Cols})
	})
}

func (m ptyMaster) typeEOF() { typeEOF(m.f) }

// bridgedTerminal is a socket to the bridge that holds the master (gvisor level): each message says
// what it is (ttyMsgData, ttyMsgResize, ttyMsgEOF) and the bridge does it to the master.
type bridgedTerminal struct{ f *os.File }

func (b bridgedTerminal) Write(p []byte) (int, error) {
	msg := make([]byte, 1+min(len(p), ttyMsgMax))
	msg[0] = ttyMsgData
	n := 0
	for n < len(p) {
		k := copy(msg[1:], p[n:])
		if _, err := b.f.Write(msg[:1+k]); err != nil {
			return n, err
		}
		n += k
	}
	return n, nil
}

func (b bridgedTerminal) resize(ws WindowSize) {
	b.f.Write([]byte{ttyMsgResize, byte(ws.Rows >> 8), byte(ws.Rows), byte(ws.Cols >> 8), byte(ws.Cols)})
}

func (b bridgedTerminal) typeEOF() { b.f.Write([]byte{ttyMsgEOF}) }

// resizeLoop applies window sizes to the terminal until quit.
func resizeLoop(term terminal, sizes <-chan WindowSize, quit <-chan struct{}) {
	for {
		select {
		case <-quit:
			return
		case ws, ok := <-sizes:
			if !ok {
				return
			}
			if ws.Rows == 0 || ws.Cols == 0 {
				continue
			}
			term.resize(ws)
		}
	}
}

// typeEOF writes the terminal's VEOF character (^D unless the program changed it) to the master.
func typeEOF(master *os.File) {
	rc, err := master.SyscallConn()
	if err != nil {
		return
	}
	eof := byte(4)
	rc.Control(func(fd uintptr) {
		// Terminal modes asked of a master are its slave's, which the program sets.
		if t, err := unix.IoctlGetTermios(int(fd), unix.TCGETS); err == nil && t.Cc[unix.VEOF] != 0 {
			eof = t.Cc[unix.VEOF]
		}
	})
	master.Write([]byte{eof})
}
