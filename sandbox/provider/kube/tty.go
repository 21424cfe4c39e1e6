package kube

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// SupportsTTY says a pod's commands may run on a terminal (provider.SupportsTTY): the agent
// allocates it in the pod (agent.OpTTY).
func (in *instance) SupportsTTY() bool { return true }

// execTTY is Exec on a terminal: the agent runs the command on a pseudo-terminal in the pod;
// keystrokes go to it within the agent's window (agent.TTYWindow), resizes as frames, and
// everything it shows comes back as output, written to req.Stdout as it comes (a Stdout that
// blocks holds the agent's reads, and so the program, never memory).
func (in *instance) execTTY(ctx context.Context, req provider.ExecRequest, args agent.ExecArgs) (provider.ExecResult, error) {
	switch {
	case req.Background:
		return provider.ExecResult{}, &provider.InvalidRequestError{Reason: "a background command has no terminal"}
	case req.Stderr != nil:
		return provider.ExecResult{}, &provider.InvalidRequestError{Reason: "a terminal has one output: set Stdout only"}
	}
	// Timeout 0 is none on a terminal (the caller's ctx bounds it); a given one is capped as
	// PrepareExec capped it.
	if req.Timeout == 0 {
		args.TimeoutMs = 0
	}
	args.Stdin, args.Stdout, args.Stderr = false, false, false
	args.Rows, args.Cols = req.TTY.Rows, req.TTY.Cols
	c, _, err := in.client.stream(ctx, agent.OpTTY, args)
	if err != nil {
		return provider.ExecResult{}, err
	}
	defer c.Close()
	finished := make(chan struct{})
	defer close(finished)
	stopGuard := in.guard(ctx, c, finished)
	defer stopGuard()
	win := &window{n: agent.TTYWindow, more: make(chan struct{}, 1)}
	startedOnce := false
	for {
		typ, p, err := c.read()
		if err != nil {
			return in.brokenExec(ctx, err)
		}
		switch typ {
		case agent.FrameStarted:
			if startedOnce {
				continue
			}
			startedOnce = true
			if req.Stdin != nil {
				go sendKeys(c, req.Stdin, win, finished)
			}
			if req.TTY.Resize != nil {
				go sendResizes(c, req.TTY.Resize, finished)
			}
		case agent.FrameCredit:
			if len(p) == 4 {
				win.give(int(binary.BigEndian.Uint32(p)))
			}
		case agent.FrameStdout:
			if req.Stdout != nil {
				req.Stdout.Write(p)
			}
		case agent.FrameResult:
			// The terminal's end: a Stdin Read still blocked is the caller's to end.
			return execResult(p)
		}
	}
}

// sendKeys types Stdin into the terminal within the window; the end of Stdin is typed as the
// terminal's end-of-file character.
func sendKeys(c *agentConn, stdin io.Reader, win *window, finished <-chan struct{}) {
	buf := make([]byte, 32<<10)
	for {
		n := win.take(len(buf), finished)
		if n == 0 {
			return
		}
		k, rerr := stdin.Read(buf[:n])
		win.give(n - k)
		if k > 0 && c.write(agent.FrameStdin, buf[:k]) != nil {
			return
		}
		if rerr == io.EOF {
			c.write(agent.FrameStdinEOF, nil)
		}
		if rerr != nil {
			return
		}
	}
}

func sendResizes(c *agentConn, sizes <-chan provider.WindowSize, finished <-chan struct{}) {
	for {
		select {
		case <-finished:
			return
		case ws, ok := <-sizes:
			if !ok {
				return
			}
			if ws.Rows == 0 || ws.Cols == 0 {
				continue
			}
			var b [4]byte
			binary.BigEndian.PutUint16(b[:], ws.Rows)
			binary.BigEndian.PutUint16(b[2:], ws.Cols)
			if c.write(agent.FrameResize, b[:]) != nil {
				return
			}
		}
	}
}

// window is the input bytes the broker may still send to a terminal.
type window struct {
	mu   sync.Mutex
	n    int
	more chan struct{} // a wake-up for take, buffered 1
}

// take waits until some window is open and takes up to max of it; 0 once done is closed.
func (w *window) take(max int, done <-chan struct{}) int {
	for {
		w.mu.Lock()
		if w.n > 0 {
			n := min(w.n, max)
			w.n -= n
			w.mu.Unlock()
			return n
		}
		w.mu.Unlock()
		select {
		case <-done:
			return 0
		case <-w.more:
		}
	}
}

func (w *window) give(n int) {
	if n <= 0 {
		return
	}
	w.mu.Lock()
	w.n += n
	w.mu.Unlock()
	select {
	case w.more <- struct{}{}:
	default:
	}
}

// guard ends a command's wait when the pod goes or ctx ends: a cancel asks the agent to kill the
// command (FrameKill) and gives up on its answer after a while. The returned func stops it.
func (in *instance) guard(ctx context.Context, c *agentConn, finished <-chan struct{}) func() bool {
	stop := context.AfterFunc(ctx, func() { c.write(agent.FrameKill, nil) })
	go func() {
		select {
		case <-finished:
		case <-in.done:
			c.SetReadDeadline(time.Now())
		case <-ctx.Done():
			// The kill frame is on its way; if the agent does not answer, give up after a while.
			select {
			case <-finished:
				return
			case <-in.done:
			case <-time.After(5 * time.Second):
			}
			c.SetReadDeadline(time.Now())
		}
	}()
	return stop
}

// brokenExec is how a command's wait ends when its connection broke: the pod went, the caller
// cancelled (the agent's answer to the kill did not come), or the connection itself.
func (in *instance) brokenExec(ctx context.Context, err error) (provider.ExecResult, error) {
	if g := in.goneErr(); g != nil {
		return provider.ExecResult{}, g
	}
	if ctx.Err() != nil {
		return provider.ExecResult{Reason: provider.ReasonCancelled, ExitCode: 137, Signal: "KILL"}, nil
	}
	return provider.ExecResult{}, fmt.Errorf("the connection to the sandbox's agent broke: %w", err)
}

// execResult decodes the agent's FrameResult of a command.
func execResult(p []byte) (provider.ExecResult, error) {
	var r agent.Result
	if err := json.Unmarshal(p, &r); err != nil {
		return provider.ExecResult{}, err
	}
	if r.Error != nil {
		switch {
		case r.Error.Kind == agent.KindCwd:
			return provider.ExecResult{}, provider.CwdError(r.Error.Message)
		case r.Error.Kind == agent.KindArgs:
			return provider.ExecResult{}, &provider.InvalidRequestError{Reason: r.Error.Message}
		case r.Error.Code != "": // an agent older than the operation says so
			return provider.ExecResult{}, r.Error.AsError()
		}
		return provider.ExecResult{}, fmt.Errorf("exec: %s", r.Error.Message)
	}
	var res agent.ExecResult
	if err := json.Unmarshal(r.Result, &res); err != nil {
		return provider.ExecResult{}, err
	}
	return provider.ExecResult{
		ExitCode: res.Code, Signal: res.Signal, Reason: res.Reason, Truncated: res.Truncated,
		Duration: time.Duration(res.DurationUs) * time.Microsecond, Pid: res.Pid,
	}, nil
}
