package server

import (
	"context"
	"encoding/json"
	"io"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
)

// The shell operation (dpOps): an interactive program on a terminal that the sandbox's init
// allocates inside the sandbox. Keystrokes arrive as binary frames on the connection's reader
// (binary) and resizes as resize requests (resizeShell); both find the session through the
// request, which prepareShell sets up on the reader before any frame for it can arrive.

// shellQueue bounds the keystroke frames waiting for the terminal: past it the connection's reader
// waits (a paste into a program that does not read its input slows the client, as a pipe would).
const shellQueue = 64

// shellSession is what the reader feeds a shell in progress.
type shellSession struct {
	keys    chan []byte // keystrokes, in order; closed by a FrameEnd (the reader is its one sender)
	closed  bool        // keys is closed (reader goroutine only)
	resizes chan sandbox.WindowSize
	done    chan struct{}   // closed when the shell ended: nothing more is taken
	ctx     context.Context // the request's: ended when its answer is taken, whether the shell ran or not
	// mu guards shutdown and end: the broker is shutting down and ended the shell
	// (endForShutdown), through end, which cancels the shell's own context.
	mu       sync.Mutex
	shutdown bool
	end      context.CancelFunc
	pending  []byte // what the terminal's writer has taken of the frame at the head
	head     int64  // the size of that frame, given back once pending is all taken

	// Keystrokes queued are counted against the connection's and the broker's shell input
	// (chargeInput) from the reader's taking them until the terminal has, or the request ended.
	c      *dpConn
	inMu   sync.Mutex
	held   int64 // counted and not given back
	inDone bool  // the request ended: everything held was given back
}

func prepareShell(c *dpConn, ctx context.Context, r *request) {
	s := &shellSession{keys: make(chan []byte, shellQueue), resizes: make(chan sandbox.WindowSize, 1), done: make(chan struct{}), ctx: ctx, c: c}
	r.shell = s
	// However the request ends (the program exited, a cancel, the connection closing), what its
	// queued keystrokes hold is given back then; frames still queued are garbage.
	context.AfterFunc(ctx, s.releaseInput)
}

// releaseInput gives back every keystroke byte the session still holds, for good.
func (s *shellSession) releaseInput() {
	s.inMu.Lock()
	n := s.held
	s.held, s.inDone = 0, true
	s.inMu.Unlock()
	s.c.unchargeInput(n)
}

// taken gives back n bytes the terminal has taken.
func (s *shellSession) taken(n int64) {
	s.inMu.Lock()
	if s.inDone {
		s.inMu.Unlock()
		return
	}
	s.held -= n
	s.inMu.Unlock()
	s.c.unchargeInput(n)
}

// chargeInput counts n bytes of keystrokes against the connection's and the org's shell input,
// waiting while they are full; false when the connection is ending.
func (c *dpConn) chargeInput(n int64) bool {
	if c.shellIn.acquire(c.ctx, "", n) != nil {
		return false
	}
	if c.s.dpShellInput.acquire(c.ctx, c.org, n) != nil {
		c.shellIn.release("", n)
		return false
	}
	return true
}

func (c *dpConn) unchargeInput(n int64) {
	c.shellIn.release("", n)
	c.s.dpShellInput.release(c.org, n)
}

// Read is the terminal's input: the keystrokes in order, then io.EOF when the input was closed or
// the shell ended.
func (s *shellSession) Read(p []byte) (int, error) {
	if len(s.pending) == 0 {
		select {
		case b, ok := <-s.keys:
			if !ok {
				return 0, io.EOF
			}
			s.pending, s.head = b, int64(len(b))
		case <-s.done:
			return 0, io.EOF
		case <-s.ctx.Done():
			return 0, io.EOF
		}
	}
	n := copy(p, s.pending)
	s.pending = s.pending[n:]
	if len(s.pending) == 0 && s.head > 0 {
		s.taken(s.head)
		s.head = 0
	}
	return n, nil
}

// feed queues one frame of keystrokes (reader goroutine), waiting while the queue, or the
// connection's or the broker's shell input, is full.
func (s *shellSession) feed(ctx context.Context, b []byte) {
	if s.closed {
		return
	}
	n := int64(len(b))
	if !s.c.chargeInput(n) {
		return
	}
	s.inMu.Lock()
	if s.inDone {
		s.inMu.Unlock()
		s.c.unchargeInput(n)
		return
	}
	s.held += n
	s.inMu.Unlock()
	select {
	case s.keys <- b:
	case <-s.done:
	case <-s.ctx.Done():
	case <-ctx.Done():
	}
}

// endForShutdown ends a shell when the broker starts a graceful shutdown: an exec in flight runs to
// its end, but a shell has none of its own, and would hold the shutdown for its whole timeout.
// Its request stays in flight until its answer (unavailable) is taken, as drain expects.
func (s *shellSession) endForShutdown() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shutdown = true
	if s.end != nil {
		s.end()
	}
}

// run gives the shell its own context, ended by endForShutdown too, and says whether that ended it.
func (s *shellSession) run(ctx context.Context, f func(ctx context.Context)) (shutdown bool) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s.mu.Lock()
	s.end = cancel
	if s.shutdown {
		cancel()
	}
	s.mu.Unlock()
	f(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shutdown
}

// closeInput is a FrameEnd: once the terminal has taken the rest, it gets its end-of-file
// character (the provider types it at the end of Stdin).
func (s *shellSession) closeInput() {
	if !s.closed {
		s.closed = true
		close(s.keys)
	}
}

// resize keeps the latest window only: a burst of resizes while the terminal is busy ends at the
// size the client has now (reader goroutine, the one sender).
func (s *shellSession) resize(ws sandbox.WindowSize) {
	for {
		select {
		case s.resizes <- ws:
			return
		default:
		}
		select {
		case <-s.resizes:
		default:
		}
	}
}

func opShell(ctx context.Context, c *dpConn, r *request, a protocol.ShellArgs) (any, error) {
	defer close(r.shell.done)
	if err := protocol.ValidateShell(a); err != nil {
		return nil, err
	}
	var allow []string
	if c.claims != nil {
		allow = c.claims.Cmd
	}
	argv := a.Argv
	if len(argv) == 0 {
		var err error
		if argv, err = defaultShell(allow, c.rt.Environment()["SHELL"]); err != nil {
			return nil, err
		}
	}
	if err := delegation.CheckCommand(allow, "", argv, a.Env); err != nil {
		return nil, err
	}
	// TERM is the terminal's, not the caller's environment: it is set under an allowlist too
	// (ValidateShell keeps it a plain name).
	env := make(map[string]string, len(a.Env)+1)
	for k, v := range a.Env {
		env[k] = v
	}
	env["TERM"] = a.Term
	if a.Term == "" {
		env["TERM"] = "xterm-256color"
	}
	tty := &sandbox.TTY{Rows: uint16(a.Rows), Cols: uint16(a.Cols), Resize: r.shell.resizes}
	req := sandbox.ExecRequest{Argv: argv, Cwd: a.Cwd, Env: env, Stdin: r.shell, TTY: tty,
		Stdout: &streamWriter{c: c, id: r.id, kind: protocol.FrameStdout}}
	cmd := commandText("", argv)
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventShellStarted, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor,
		JTI: c.jti(), Command: cmd})
	start := time.Now()
	var res sandbox.ExecResult
	var err error
	shutdown := r.shell.run(ctx, func(ctx context.Context) { res, err = c.rt.Exec(ctx, req) })
	exit, dur := res.ExitCode, time.Since(start).Milliseconds()
	ended := protocol.Event{Type: protocol.EventShellEnded, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor,
		JTI: c.jti(), Command: cmd, DurationMS: &dur, Reason: res.Reason}
	if err == nil {
		ended.ExitCode = &exit
	} else if ctx.Err() != nil {
		ended.Reason = protocol.ExecReasonCancelled
	} else {
		ended.Reason = "failed"
	}
	c.s.events.Emit(c.org, ended)
	if shutdown {
		return nil, protocol.Errorf(protocol.CodeUnavailable, "the broker is shutting down, which ended the shell; open a new one once it is back")
	}
	if err != nil {
		return nil, err
	}
	result := protocol.ExecResult{ExitCode: res.ExitCode, Signal: res.Signal, Reason: res.Reason, DurationMS: res.Duration.Milliseconds()}
	if result.Cancelled() {
		return nil, context.Canceled
	}
	return result, nil
}

// defaultShell is the program a shell runs when the request names none: the sandbox user's login
// shell ($SHELL of the sandbox: bash, or /bin/sh where there is no bash). Under a command allowlist
// it is the allowlist's own entry for that shell (its path or its name), so that the allowlist
// decides exactly as for an exec of it; an allowlist that names neither refuses the shell.
func defaultShell(allow []string, shell string) ([]string, error) {
	if shell == "" {
		shell = "/bin/sh"
	}
	if len(allow) == 0 {
		return []string{shell}, nil
	}
	for _, name := range []string{shell, path.Base(shell)} {
		if slices.Contains(allow, name) {
			return []string{name}, nil
		}
	}
	return nil, &protocol.Error{Code: protocol.CodeCommandNotAllowed, Message: "an interactive shell needs the token's command allowlist to name the shell (" +
		path.Base(shell) + " or " + shell + "); it allows " + strings.Join(allow, ", ")}
}

// commandText is a command as events show it: valid UTF-8, at most about 1 KiB.
func commandText(command string, argv []string) string {
	cmd := command
	if cmd == "" {
		cmd = strings.Join(argv, " ")
	}
	if len(cmd) > 1024 {
		cmd = cmd[:1024] + "..."
	}
	return strings.ToValidUTF8(cmd, "?")
}

// resizeShell is the resize op, answered by the reader: it changes the window of shell id, and is
// never answered unless it is wrong (then with id 0, since shell id's own answer is still to come).
func (c *dpConn) resizeShell(id uint32, raw json.RawMessage) {
	var a protocol.ResizeArgs
	err := decodeArgs(raw, &a)
	if err == nil {
		err = protocol.ValidateWindow(a.Rows, a.Cols)
	}
	if err != nil {
		pe := c.errorResponse(0, err).Error
		pe.Message = "resize of request " + strconv.FormatUint(uint64(id), 10) + ": " + pe.Message
		c.send(protocol.Response{Error: pe})
		return
	}
	c.mu.Lock()
	req := c.inflight[id]
	c.mu.Unlock()
	if req == nil || req.shell == nil {
		c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "resize of request %d, which is not a shell in progress", id)})
		return
	}
	req.shell.resize(sandbox.WindowSize{Rows: uint16(a.Rows), Cols: uint16(a.Cols)})
}

// shellInput takes one binary frame for a shell (reader goroutine): keystrokes, or the end of input.
func (c *dpConn) shellInput(s *shellSession, kind byte, payload io.Reader) {
	if kind == protocol.FrameEnd {
		io.Copy(io.Discard, payload)
		s.closeInput()
		return
	}
	b, err := io.ReadAll(payload) // one frame: the read limit bounds it
	if err != nil || len(b) == 0 {
		return
	}
	s.feed(c.ctx, b)
}
