package backend

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sync"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
)

// ShellRequest starts an interactive program on a terminal in the sandbox (the shell operation,
// docs/dataplane.md): Argv empty runs the sandbox user's login shell.
type ShellRequest struct {
	protocol.ShellArgs
	// Output receives everything the program writes to its terminal, exact bytes, as it comes.
	Output io.Writer
}

// Shell is a program running on a terminal in the sandbox: write keystrokes to it, resize its
// window, and Wait for its end. ^C, ^Z and ^D are bytes like any other: the sandbox's terminal
// makes them signals or end of input. Cancelling the context given to Remote.Shell ends the whole
// session (answer cancelled), as does closing the Remote.
type Shell struct {
	c    *conn
	id   uint32
	done chan struct{}
	res  protocol.ExecResult
	err  error

	mu     sync.Mutex // orders Write, Resize and CloseInput, and guards closed
	closed bool
	buf    []byte
}

// shellFrame bounds one keystroke frame: well under any broker's max_frame_bytes.
const shellFrame = 32 << 10

// Shell starts req and returns once the request is on its way; a refusal (scope, allowlist, a
// missing program) comes from Wait. It is never retried.
func (r *Remote) Shell(ctx context.Context, req ShellRequest) (*Shell, error) {
	c, err := r.connection(ctx)
	if err != nil {
		return nil, err
	}
	out := req.Output
	if out == nil {
		out = io.Discard
	}
	sent := make(chan uint32, 1)
	cl := &call{stdout: out, sent: func(id uint32) { sent <- id }}
	s := &Shell{c: c, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		if err := c.roundTrip(ctx, protocol.OpShell, req.ShellArgs, cl, nil); err != nil {
			s.err = err
			return
		}
		if err := json.Unmarshal(cl.result, &s.res); err != nil {
			s.err = fmt.Errorf("dataplane answered shell with an unexpected result: %w", err)
		}
	}()
	select {
	case s.id = <-sent:
		return s, nil
	case <-s.done:
		return nil, s.err
	}
}

// Write types p into the terminal.
func (s *Shell) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.usable(); err != nil {
		return 0, err
	}
	for n := 0; n < len(p); {
		m := min(len(p)-n, shellFrame)
		s.buf = append(s.buf[:0], make([]byte, protocol.FrameHeaderLen)...)
		protocol.PutFrameHeader(s.buf, protocol.FrameData, s.id)
		s.buf = append(s.buf, p[n:n+m]...)
		if err := s.c.write(websocket.BinaryMessage, s.buf); err != nil {
			return n, s.c.failure()
		}
		n += m
	}
	return len(p), nil
}

// Resize changes the terminal's window (1 to protocol.ShellMaxWindow rows and columns).
func (s *Shell) Resize(rows, cols int) error {
	if err := protocol.ValidateWindow(rows, cols); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.usable(); err != nil {
		return err
	}
	b, _ := json.Marshal(protocol.Request{ID: s.id, Op: protocol.OpResize, Args: protocol.ResizeArgs{Rows: rows, Cols: cols}})
	if err := s.c.write(websocket.TextMessage, b); err != nil {
		return s.c.failure()
	}
	return nil
}

// CloseInput ends the program's input: the terminal gets its end-of-file character (^D), so a
// program reading a line reads end of file. Nothing more can be written.
func (s *Shell) CloseInput() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.usable(); err != nil {
		return err
	}
	s.closed = true
	hdr := make([]byte, protocol.FrameHeaderLen)
	protocol.PutFrameHeader(hdr, protocol.FrameEnd, s.id)
	if err := s.c.write(websocket.BinaryMessage, hdr); err != nil {
		return s.c.failure()
	}
	return nil
}

func (s *Shell) usable() error {
	select {
	case <-s.done:
		return protocol.Errorf(protocol.CodeInvalidArgument, "the shell has ended")
	default:
	}
	if s.closed {
		return protocol.Errorf(protocol.CodeInvalidArgument, "the shell's input is closed")
	}
	return nil
}

// Done is closed when the shell has ended (Wait then returns at once).
func (s *Shell) Done() <-chan struct{} { return s.done }

// Wait returns how the program ended: its exit code (128+n for signal n), or the error that ended
// the session (cancelled, the connection closed: the credential revoked or expired, the sandbox
// stopped).
func (s *Shell) Wait() (protocol.ExecResult, error) {
	<-s.done
	return s.res, s.err
}
