package server

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
)

// localConn is an MCP session's dataplane connection in process: a dpConn with no WebSocket. It is
// opened by the same checks as an upgrade (authorizeConn), sits in the hub like any connection
// (revocations, drain, shutdown, the connection caps), and its calls pass admit and run the op
// table's handlers (dpOps) with their holds, so scopes, the command allowlist, limits, lease
// renewal and events are the dataplane's own. What it saves is the loopback round trip and the
// frame encoding at both ends.
//
// Its calls take only operations answered by one result (opLight, opHeavy, with no prepare):
// nothing here reads or writes stream frames, so a streamed or background exec, a shell, a
// download or an upload is refused. The seam it
// relies on: an opLight or opHeavy handler answers through its return value (encoded here as the
// WebSocket's answer encodes it) and never queues frames itself (c.send, c.enqueue: this
// connection has no writer); how an answer is framed on the WebSocket is the WebSocket path's
// business (dispatch, answer).
type localConn struct {
	c       *dpConn
	nextID  atomic.Uint32
	endedCh chan struct{}

	mu       sync.Mutex
	endedErr *protocol.Error
}

var _ mcp.Conn = (*localConn)(nil)

// openLocal opens an in-process dataplane connection for an MCP session's token.
func (s *Server) openLocal(ctx context.Context, id mcp.Identity, sessionID string) (mcp.Conn, error) {
	release, ok := s.hub.reserve(s.dpLimits.MaxConnections)
	if !ok {
		return nil, protocol.Errorf(protocol.CodeUnavailable, "this broker has %d dataplane connections open, its maximum; retry shortly", s.dpLimits.MaxConnections)
	}
	// Retry-After has no place in the MCP front end's answers: a refusal's message says to retry.
	c, releaseShare, err := s.authorizeConn(ctx, id.Token, id.SandboxID, http.Header{})
	if err != nil {
		release()
		return nil, err
	}
	log, unregister := c.open("mcp:" + sessionID)
	l := &localConn{c: c, endedCh: make(chan struct{})}
	c.connected(log)
	go func() {
		<-c.ctx.Done()
		c.closed(log, unregister)
		releaseShare()
		release()
		l.ended()
	}()
	return l, nil
}

// Call runs one operation as the dataplane would run request id, and answers its result encoded as
// the dataplane encodes it (the same bytes as a WebSocket answer's result).
func (l *localConn) Call(ctx context.Context, op string, args any) (json.RawMessage, error) {
	c := l.c
	if a, ok := args.(protocol.ExecArgs); op == protocol.OpExec && (!ok || a.Stream || a.Background) {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "this front end runs commands to their end only (no stream, no background)")
	}
	// A write's content travels as its request's body, as on the WebSocket (WriteArgs.Body).
	var body []byte
	if a, ok := args.(protocol.WriteArgs); ok && op == protocol.OpWrite {
		head, content, err := a.Body()
		if err != nil {
			return nil, err
		}
		args, body = head, []byte(content)
	}
	raw, err := json.Marshal(args)
	if err != nil {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "invalid args: %v", err)
	}
	// Counted before shutdown can set closing, so that closed's Wait waits for this call (a
	// WebSocket's requests are counted by its reader, which closed runs after).
	c.mu.Lock()
	if c.closing {
		c.mu.Unlock()
		return nil, l.err()
	}
	c.running.Add(1)
	c.mu.Unlock()
	defer c.running.Done()
	id := l.nextID.Add(1)
	if id == 0 {
		id = l.nextID.Add(1)
	}
	o, rctx, req, refusal := c.admit(id, op)
	switch {
	case refusal != nil && refusal.Error != nil:
		return nil, refusal.Error
	case refusal != nil:
		return nil, l.err()
	case o.class != opLight && o.class != opHeavy || o.prepare != nil || o.bodyIn != (body != nil):
		// An op fed by frames (prepare: a shell's keystrokes) also sends frames of its own (its
		// terminal's output), which this connection, with no writer or queue, cannot carry.
		if req != nil {
			c.forget(id, req)
		}
		return nil, protocol.Errorf(protocol.CodeUnknownOp, "operation %q is not offered in process with these args", clipHeader(op))
	}
	req.body = body
	// The caller's cancellation cancels the request, as a cancel frame would.
	stop := context.AfterFunc(ctx, req.cancel)
	defer stop()
	res, err, _ := c.run(rctx, req, o, raw, true)
	req.body = nil
	var b []byte
	if ans, ok := res.(*bodyAnswer); ok && err == nil {
		// A read's answer is its head and its content as the body, which the Go dataplane client
		// answers as one ReadResult (ReadHead.Result): so is it here, before the hold gives the
		// content's buffer back.
		head, _ := ans.head.(protocol.ReadHead)
		b, err = json.Marshal(head.Result(string(ans.body)))
	} else if err == nil {
		b, err = json.Marshal(res)
	}
	if req.exec != nil {
		req.exec.settle(int64(len(b)))
	}
	// The answer is handed over here: what the request held is given back, as when the writer has
	// written a WebSocket answer.
	c.forget(id, req)
	req.hold.release()
	if err != nil {
		if rctx.Err() != nil && c.ctx.Err() != nil {
			return nil, l.err()
		}
		return nil, c.errorResponse(id, err).Error
	}
	return b, nil
}

// err is why the connection ended (it has, or is ending): the reason shutdown was given.
func (l *localConn) err() *protocol.Error {
	return l.c.endedErr("this session's dataplane connection", "open a new session")
}

func (l *localConn) ended() {
	e := l.err()
	l.mu.Lock()
	l.endedErr = e
	l.mu.Unlock()
	close(l.endedCh)
}

// endMessage says why a connection ended, as the dataplane's Go client says it for the close frame
// with the same reason.
func endMessage(code string) string {
	switch code {
	case protocol.CodeTokenRevoked:
		return "the sandbox's owner revoked this credential"
	case protocol.CodeTokenExpired:
		return "this credential expired; the owner must send a fresh run config"
	case protocol.CodeNotRunning:
		return "the sandbox stopped; its owner must resume it"
	}
	return "the broker closed the connection: " + code
}

// Ended is closed when the connection has ended (revoked, expired, the sandbox stopped, the broker
// shutting down, or Close).
func (l *localConn) Ended() <-chan struct{} { return l.endedCh }

// EndedErr is why the connection ended (nil before).
func (l *localConn) EndedErr() *protocol.Error {
	select {
	case <-l.endedCh:
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.endedErr
	default:
		return nil
	}
}

// Close ends the connection (the MCP session ended) and waits until it has said so.
func (l *localConn) Close() error {
	l.c.shutdown(websocket.CloseNormalClosure, "")
	<-l.endedCh
	return nil
}
