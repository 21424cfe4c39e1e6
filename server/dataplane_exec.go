package server

import (
	"context"
	"strings"
	"time"

	"github.com/gorilla/websocket"
	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
)

// The exec operation's handler (dpOps) and the writers its output goes through: streamed in frames
// as it comes, or buffered against the broker-wide exec output budget (dataplane_accounting.go).

func opExec(ctx context.Context, c *dpConn, r *request, a protocol.ExecArgs) (any, error) {
	var allow []string
	if c.claims != nil {
		allow = c.claims.Cmd
	}
	if err := delegation.CheckCommand(allow, a.Command, a.Argv, a.Env); err != nil {
		return nil, err
	}
	if err := protocol.ValidateExec(a); err != nil {
		return nil, err
	}
	a.MaxOutput = a.OutputCap()
	req := sandbox.ExecRequest{Command: a.Command, Argv: a.Argv, Cwd: a.Cwd, Env: a.Env,
		Timeout: time.Duration(a.TimeoutMS) * time.Millisecond, MaxOutput: a.MaxOutput, Background: a.Background,
		Started: r.started}
	if a.Stdin != "" {
		req.Stdin = strings.NewReader(a.Stdin)
	}
	out := &execOutput{budget: c.s.dpExecOutput, org: c.org, limit: int(a.MaxOutput)}
	stdout, stderr := &budgetWriter{out: out}, &budgetWriter{out: out}
	if !a.Stream && !a.Background {
		// The output is counted until the answer that carries it is written or dropped.
		r.exec = out
		r.hold.add(out.free)
	}
	switch {
	case a.Background:
	case a.Stream:
		req.Stdout = &streamWriter{c: c, id: r.id, kind: protocol.FrameStdout}
		if !a.Combined {
			req.Stderr = &streamWriter{c: c, id: r.id, kind: protocol.FrameStderr}
		}
	default:
		req.Stdout = stdout
		if !a.Combined {
			req.Stderr = stderr
		}
	}
	res, err := c.rt.Exec(ctx, req)
	if err != nil {
		return nil, err
	}
	result := protocol.ExecResult{ExitCode: res.ExitCode, Signal: res.Signal, Reason: res.Reason,
		Truncated: res.Truncated || out.wasDropped(), DurationMS: res.Duration.Milliseconds()}
	if a.Background {
		result.Pid = res.Pid
	}
	if !a.Stream && !a.Background {
		result.SetOutput(a, stdout.buf, stderr.buf)
	}
	cmd := a.Command
	if cmd == "" {
		cmd = strings.Join(a.Argv, " ")
	}
	if len(cmd) > 1024 {
		cmd = cmd[:1024] + "..."
	}
	// Every command that ran is in the owner's events, killed ones included (with the reason).
	exit, dur := res.ExitCode, res.Duration.Milliseconds()
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventExec, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor,
		JTI: c.jti(), Command: strings.ToValidUTF8(cmd, "?"), ExitCode: &exit, DurationMS: &dur, Reason: res.Reason})
	if result.Cancelled() {
		return nil, context.Canceled
	}
	return result, nil
}

// streamWriter sends exec output as binary frames as it comes.
type streamWriter struct {
	c    *dpConn
	id   uint32
	kind byte
}

func (w *streamWriter) Write(p []byte) (int, error) {
	for rest := p; len(rest) > 0; {
		n := min(len(rest), dpChunkBytes)
		frame := make([]byte, protocol.FrameHeaderLen+n)
		protocol.PutFrameHeader(frame, w.kind, w.id)
		copy(frame[protocol.FrameHeaderLen:], rest[:n])
		if !w.c.enqueue(outFrame{kind: websocket.BinaryMessage, data: frame}) {
			return 0, context.Canceled
		}
		rest = rest[n:]
	}
	return len(p), nil
}
