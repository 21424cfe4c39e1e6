package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"
	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// One dataplane connection after the upgrade: its reader, its writer and the byte queue between
// requests and the writer, the lifetime of each request in flight, and what ends the connection.

// dpConn is one dataplane connection: one reader goroutine (serve's, until an exec moves the reading
// to a new one: dispatch), one writer goroutine, and a goroutine per request in flight.
type dpConn struct {
	s      *Server
	org    string
	actor  string
	keyID  string             // owners
	claims *delegation.Claims // delegates
	scopes map[string]bool
	rec    store.Record
	rt     *sandbox.Runtime
	files  sandbox.Files
	// evictions is the broker's count of revocations applied (delegation.Service.Evictions) before
	// the credential's checks began (authorizeConn), and checkedFrom is when they began.
	evictions   uint64
	checkedFrom time.Time
	// admission is what a delegate's revocation check rested on (the token cache's answer).
	admission delegation.Admission
	// keyReadAt is when an owner's key record that admitted it was read, and keyCheckedFrom when
	// its checks began, both on the API key cache's clock.
	keyReadAt, keyCheckedFrom time.Time

	conn *websocket.Conn
	out  chan outFrame
	// wmu is held by whoever writes a frame. A producer writes a small frame (dpDirectBytes)
	// itself, on its own goroutine, when no write is under way and nothing is queued (wqueued
	// counts frames from their queueing to the end of their write): a small answer then costs no
	// handoff to the writer goroutine. Otherwise it queues the frame and goes on (a stream reads
	// its next chunk while the writer writes this one), and frames of one request never overtake
	// each other.
	wmu     sync.Mutex
	wqueued atomic.Int64
	ctx     context.Context
	cancel  context.CancelFunc

	// lastRenew is when dataplane activity last renewed the lease (with --dataplane-renews-lease).
	lastRenew time.Time

	// heavy holds this connection's slots for operations with large answers (holdHeavy).
	heavy chan struct{}
	// queued counts the bytes waiting for this client (dpQueueBytes).
	queued *quota
	// shellIn counts the keystrokes this client sent that its shells' terminals have not taken
	// (dpShellInputBytes).
	shellIn *quota

	mu       sync.Mutex
	inflight map[uint32]*request
	closing  bool
	closeMsg []byte // the close frame to send, set once
	// endCode and endReason are the close code and reason given to shutdown (closeMsg's parts).
	endCode   int
	endReason string
	// drained, once set (the broker is shutting down), refuses new requests and is closed when
	// no request is in flight any more (stopNew).
	drained       chan struct{}
	drainedClosed bool

	// running counts request goroutines, which serve waits for: they may still emit events.
	running sync.WaitGroup

	// rd is the reader's state, which moves with the reading from goroutine to goroutine
	// (dispatch), and readerDone is closed by the goroutine whose reading ended the connection.
	rd         readerState
	readerDone chan struct{}
}

// request is one request in flight.
type request struct {
	id     uint32
	cancel context.CancelFunc
	upload inStream // set for uploads and untars, fed by the reader
	// body is the content a FrameRequestBody carried (a write's), in a pooled buffer that is given
	// back when the operation returns.
	body []byte
	// hold is what the request holds of shared resources; its answer frame carries it.
	hold hold
	// exec is a non-streamed exec's output, counted against the broker-wide budget.
	exec *execOutput
	// shell is a shell's input, fed by the reader (dataplane_shell.go).
	shell *shellSession
	// started, set for an exec run by the connection's reader, moves the reading to a new
	// goroutine once the command is on its way (dpConn.dispatch).
	started func()
}

// outFrame is a frame for the writer. n is what it counts against the connection's queue bytes.
// taken, when set, runs when the writer takes the frame, before writing it. release, when set, runs
// after the frame is written, or when it is dropped because the connection is ending: what the
// frame holds (a pooled buffer, a request's hold) is given back then, and in every case.
type outFrame struct {
	kind    int
	data    []byte
	n       int64
	release func()
	taken   func()
}

func (c *dpConn) serve(ws *websocket.Conn, reqID string) {
	c.conn = ws
	c.out = make(chan outFrame, dpWriteQueue)
	c.queued = newQuota(dpQueueBytes, 0)
	ws.SetReadLimit(dpMaxFrameBytes)
	ws.SetReadDeadline(time.Now().Add(dpPongWait))
	ws.SetPongHandler(func(string) error { return ws.SetReadDeadline(time.Now().Add(dpPongWait)) })
	log, unregister := c.open(reqID)
	writerDone := make(chan struct{})
	go func() { defer close(writerDone); c.writer() }()

	hello := protocol.Hello{Protocol: protocol.Subprotocol, SandboxID: c.rec.ID, Workspace: sandbox.WorkspaceRoot,
		Scopes: c.scopeList(), Limits: protocol.Limits{MaxFrameBytes: dpMaxFrameBytes, MaxInflight: dpMaxInflight,
			MaxChunkBytes: dpChunkBytes, MaxOutputBytes: protocol.ExecMaxStreamOutput}}
	if c.claims != nil {
		hello.AllowCmd = c.claims.Cmd
		exp := c.claims.ExpiresAt.Time.UTC()
		hello.ExpiresAt = &exp
	}
	c.send(protocol.Response{Type: "hello", Hello: &hello})
	c.connected(log)

	c.rd = readerState{chunk: make([]byte, dpChunkBytes), header: make([]byte, protocol.FrameHeaderLen)}
	c.readerDone = make(chan struct{})
	c.readLoop()
	<-c.readerDone // the reading may have moved to another goroutine

	c.shutdown(websocket.CloseNormalClosure, "")
	<-writerDone
	ws.Close()
	c.closed(log, unregister)
}

// open starts what every connection has, over the WebSocket or in process (mcp_dataplane.go): its
// context, its requests in flight, its place in the hub (revocations, drain, shutdown) and its
// watcher (expiry, the sandbox ending, rechecks).
func (c *dpConn) open(reqID string) (log *slog.Logger, unregister func()) {
	c.inflight = map[uint32]*request{}
	c.heavy = make(chan struct{}, dpHeavyPerConn)
	c.shellIn = newQuota(dpShellInputBytes, 0)
	c.ctx, c.cancel = context.WithCancel(context.Background())
	log = c.s.log.With("request_id", reqID, "sandbox_id", c.rec.ID, "org", c.org, "actor", c.actor)
	unregister = c.s.hub.add(c)
	// A revocation announced since the credential's checks began may have been applied to the hub
	// before this connection was in it, and its answer (read then, or remembered for up to
	// delegation.RecentTTL) may predate the revocation: read the credential's state again now, as
	// the periodic re-check would 30 s later. Revocations are applied to the token cache before the
	// hub (Server.Serve), so one the hub missed always shows here.
	if c.s.delegation.Evictions() != c.evictions {
		if code := c.recheck(); code != "" {
			log.Info("dataplane credential revoked while the connection was opened", "jti", c.jti(), "code", code)
			c.shutdown(protocol.CloseCredentialEnded, code)
		}
	}
	if c.claims != nil && c.admission.ReadAt.Before(c.checkedFrom) {
		go c.reconfirm()
	}
	if c.claims == nil && c.keyReadAt.Before(c.keyCheckedFrom) {
		go c.reconfirmKey()
	}
	go c.watch()
	return log, unregister
}

func (c *dpConn) connected(log *slog.Logger) {
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventConnected, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti()})
	log.Info("dataplane connected", "jti", c.jti())
}

// closed ends a connection that was shut down: it waits for its requests, then says so. The
// handler's release comes after it: broker shutdown waits for that, then closes the event writer.
func (c *dpConn) closed(log *slog.Logger, unregister func()) {
	c.running.Wait()
	// Frames queued after the writer left (a producer that raced the close) are given back here:
	// nothing produces any more.
	c.dropQueued()
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventDisconnected, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti()})
	log.Info("dataplane disconnected", "jti", c.jti())
	unregister()
}

func (c *dpConn) jti() string {
	if c.claims != nil {
		return c.claims.ID
	}
	return ""
}

func (c *dpConn) scopeList() []string {
	var out []string
	for _, sc := range protocol.Scopes {
		if c.scopes[sc] {
			out = append(out, sc)
		}
	}
	return out
}

// shutdown starts closing the connection once: requests in flight are cancelled and the writer sends
// a close frame with code and reason, then stops.
func (c *dpConn) shutdown(code int, reason string) {
	c.mu.Lock()
	if c.closing {
		c.mu.Unlock()
		return
	}
	c.closing = true
	c.closeMsg = websocket.FormatCloseMessage(code, reason)
	c.endCode, c.endReason = code, reason
	for _, r := range c.inflight {
		r.cancel()
		if r.upload != nil {
			r.upload.Abort()
		}
	}
	c.mu.Unlock()
	c.cancel()
	if c.conn != nil {
		// Unblock the reader if the close came from elsewhere.
		c.conn.SetReadDeadline(time.Now().Add(time.Second))
	}
}

// writer is the one goroutine that writes to the socket. A peer that stops reading blocks it; the
// write deadline then ends the connection, and everything waiting to send sees ctx done.
func (c *dpConn) writer() {
	ping := time.NewTicker(dpPingEvery)
	defer ping.Stop()
	// Whatever is still queued when the writer leaves is never written: give it back now.
	defer c.dropQueued()
	for {
		select {
		case f := <-c.out:
			c.wmu.Lock()
			err := c.write(f)
			c.wqueued.Add(-1)
			c.wmu.Unlock()
			if err != nil {
				return
			}
		case <-ping.C:
			c.conn.WriteControl(websocket.PingMessage, nil, time.Now().Add(dpWriteTimeout))
		case <-c.ctx.Done():
			c.mu.Lock()
			msg := c.closeMsg
			c.mu.Unlock()
			c.conn.WriteControl(websocket.CloseMessage, msg, time.Now().Add(time.Second))
			return
		}
	}
}

// write writes one frame and ends its life; a failed write ends the connection. c.wmu is held.
func (c *dpConn) write(f outFrame) error {
	if f.taken != nil {
		f.taken()
	}
	c.conn.SetWriteDeadline(time.Now().Add(dpWriteTimeout))
	err := c.conn.WriteMessage(f.kind, f.data)
	c.written(f)
	if err != nil {
		c.shutdown(websocket.CloseAbnormalClosure, "")
	}
	return err
}

// charge counts n bytes against the connection's queue, waiting while it is full (backpressure
// from a slow reader reaches the producer: an exec's pipe, a download's file reads, the
// connection's reader). It fails when the connection is ending.
func (c *dpConn) charge(n int64) bool {
	if c.queued.acquire(c.ctx, "", n) != nil {
		return false
	}
	if c.s.dpQueued.acquire(c.ctx, c.org, n) != nil {
		c.queued.release("", n)
		return false
	}
	return true
}

func (c *dpConn) uncharge(n int64) {
	c.queued.release("", n)
	c.s.dpQueued.release(c.org, n)
}

// enqueue hands a frame to the writer, counting its bytes against the connection's queue first.
// Whatever happens to the frame, its release runs exactly once.
func (c *dpConn) enqueue(f outFrame) bool {
	f.n = int64(len(f.data))
	if !c.charge(f.n) {
		f.n = 0
		c.dropped(f)
		return false
	}
	return c.enqueueCharged(f)
}

// enqueueCharged is enqueue for a frame whose f.n bytes were charged already. With nothing queued,
// the frame is written here and now (see wmu).
func (c *dpConn) enqueueCharged(f outFrame) bool {
	if len(f.data) <= dpDirectBytes && c.wqueued.Load() == 0 && c.wmu.TryLock() {
		if c.wqueued.Load() == 0 { // nothing was queued meanwhile that this frame could overtake
			if c.ctx.Err() != nil {
				c.wmu.Unlock()
				c.dropped(f)
				return false
			}
			err := c.write(f)
			c.wmu.Unlock()
			return err == nil
		}
		c.wmu.Unlock()
	}
	c.wqueued.Add(1)
	select {
	case c.out <- f:
		return true
	case <-c.ctx.Done():
		c.wqueued.Add(-1)
		c.dropped(f)
		return false
	}
}

// written ends the life of a frame the writer wrote (or failed to write).
func (c *dpConn) written(f outFrame) {
	c.uncharge(f.n)
	if f.release != nil {
		f.release()
	}
}

// dropped ends the life of a frame that will never be written.
func (c *dpConn) dropped(f outFrame) {
	if f.taken != nil {
		f.taken()
	}
	c.written(f)
}

// dropQueued drops every frame left in the queue.
func (c *dpConn) dropQueued() {
	for {
		select {
		case f := <-c.out:
			c.dropped(f)
		default:
			return
		}
	}
}

func (c *dpConn) send(r protocol.Response) {
	c.enqueue(outFrame{kind: websocket.TextMessage, data: encode(r)})
}

func encode(r protocol.Response) []byte {
	b, err := json.Marshal(r)
	if err != nil {
		b, _ = json.Marshal(protocol.Response{ID: r.ID, Error: protocol.Errorf(protocol.CodeInternal, "the result could not be encoded")})
	}
	return b
}

// answer queues the one answer to req. The request stays in flight until the writer takes its
// answer, not until the answer is queued: a client may reuse the id (or the slot) the moment it
// reads the answer, which can be before this goroutine runs again; and an answer waiting in the
// queue must still count against max_inflight, or a client that does not read could queue them
// unbounded. What the request holds is given back once its answer is written or dropped.
func (c *dpConn) answer(id uint32, req *request, resp protocol.Response) {
	if ba, ok := resp.Result.(*bodyAnswer); ok && resp.Error == nil {
		c.enqueue(outFrame{kind: websocket.BinaryMessage, data: ba.encode(id), taken: func() { c.forget(id, req) }, release: req.hold.release})
		return
	}
	b := encode(resp)
	if req.exec != nil {
		// The output is in b now; the budget counts b from here, and the buffers are let go.
		req.exec.settle(int64(len(b)))
	}
	c.enqueue(outFrame{kind: websocket.TextMessage, data: b, taken: func() { c.forget(id, req) }, release: req.hold.release})
}

func (c *dpConn) fail(id uint32, err error) { c.send(c.errorResponse(id, err)) }

// errorResponse is the answer that ends request id with err: apiError's mapping, the one REST
// answers use, except that a cancelled request says which one it was.
func (c *dpConn) errorResponse(id uint32, err error) protocol.Response {
	var pe *protocol.Error
	if !errors.As(err, &pe) && errors.Is(err, context.Canceled) {
		return protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeCancelled, "request %d was cancelled", id)}
	}
	status, pe := apiError(err)
	if status >= 500 {
		c.s.log.Error("dataplane request failed", "sandbox_id", c.rec.ID, "id", id, "code", pe.Code, "err", err)
		if pe.Code == protocol.CodeInternal {
			// A dataplane answer carries no HTTP request id: name the request instead.
			pe.Message = fmt.Sprintf("internal error on request %d; the broker logged it", id)
		}
	}
	return protocol.Response{ID: id, Error: pe}
}

// finish forgets an upload in flight (it holds no shared resources beyond its file).
func (c *dpConn) finish(id uint32) {
	c.mu.Lock()
	if r := c.inflight[id]; r != nil {
		r.cancel()
		delete(c.inflight, id)
		c.checkDrained()
	}
	c.mu.Unlock()
}

// stopNew makes the connection refuse new requests (the broker is shutting down) and returns a
// channel that is closed once no request is in flight.
func (c *dpConn) stopNew() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.drained == nil {
		c.drained = make(chan struct{})
		c.checkDrained()
		for _, r := range c.inflight {
			if r.shell != nil {
				r.shell.endForShutdown()
			}
		}
	}
	return c.drained
}

// checkDrained closes drained when the last request in flight is gone. c.mu is held.
func (c *dpConn) checkDrained() {
	if c.drained != nil && !c.drainedClosed && len(c.inflight) == 0 {
		close(c.drained)
		c.drainedClosed = true
	}
}

// forget is finish for request req only: by the time it runs, its id may name a newer request.
func (c *dpConn) forget(id uint32, req *request) {
	req.cancel()
	c.mu.Lock()
	if c.inflight[id] == req {
		delete(c.inflight, id)
		c.checkDrained()
	}
	c.mu.Unlock()
}

// cancelRequest cancels request id if it is in flight (the cancel op, never answered); an upload
// ends at once, answered cancelled, since no end frame will come to end it.
func (c *dpConn) cancelRequest(id uint32) {
	c.mu.Lock()
	r := c.inflight[id]
	c.mu.Unlock()
	if r == nil {
		return
	}
	r.cancel()
	if r.upload != nil {
		c.finish(id)
		r.upload.Abort()
		c.fail(id, context.Canceled)
	}
}

// emitPath emits a file event (file_written, file_deleted) for path, naming the connection's actor.
func (c *dpConn) emitPath(typ, path string) {
	c.s.events.Emit(c.org, protocol.Event{Type: typ, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti(), Path: path})
}

// perform runs req and queues its answer; c.running counted it. Without wait (on the reader's
// goroutine) it does nothing and answers false when the op would wait for a slot.
func (c *dpConn) perform(ctx context.Context, req *request, o dpOp, args json.RawMessage, put func(), wait bool) bool {
	res, err, ran := c.run(ctx, req, o, args, wait)
	if !ran {
		return false
	}
	defer c.running.Done()
	req.body = nil
	put()
	resp := protocol.Response{ID: req.id, Result: res}
	if err != nil {
		if ctx.Err() != nil && c.ctx.Err() == nil {
			err = context.Canceled
		}
		resp = c.errorResponse(req.id, err)
	}
	c.answer(req.id, req, resp)
	return true
}

// admit applies the op table's policy to request id, the one place every front end's requests pass
// (dispatch for the WebSocket, call for in-process connections): the op must be known and its scope
// the credential's, and the connection must be open, not draining, and within max_inflight. An
// admitted request is in flight (the caller ends it with forget, or through its answer) and may
// renew the sandbox's lease. A refusal is the response to send (no Error: send nothing, the
// connection is closing); an opInline op is admitted with no request.
func (c *dpConn) admit(id uint32, op string) (o dpOp, ctx context.Context, req *request, refusal *protocol.Response) {
	o, known := dpOps[op]
	if !known {
		return o, nil, nil, &protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeUnknownOp, "unknown operation %q", clipHeader(op))}
	}
	if o.class == opInline {
		return o, nil, nil, nil
	}
	if o.scope != "" && !c.scopes[o.scope] {
		return o, nil, nil, &protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeScopeDenied, "%s needs the %s scope, which this credential does not have", op, o.scope)}
	}
	ctx, cancel := context.WithCancel(c.ctx)
	req = &request{id: id, cancel: cancel}
	c.mu.Lock()
	switch {
	case c.closing:
		c.mu.Unlock()
		cancel()
		return o, nil, nil, &protocol.Response{}
	case c.drained != nil:
		c.mu.Unlock()
		cancel()
		return o, nil, nil, &protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeUnavailable, "the broker is shutting down: request %d was not started; reconnect (the sandbox's broker will be back) and send it again", id)}
	case c.inflight[id] != nil:
		c.mu.Unlock()
		cancel()
		// Answered with id 0: the request already in flight under this id gets its own answer.
		return o, nil, nil, &protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "request id %d is already in flight; this request was ignored", id)}
	case len(c.inflight) >= dpMaxInflight:
		c.mu.Unlock()
		cancel()
		return o, nil, nil, &protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeTooManyRequests, "%d requests are in flight on this connection, the most allowed: wait for answers", dpMaxInflight)}
	}
	c.inflight[id] = req
	if o.prepare != nil {
		o.prepare(c, ctx, req)
	}
	renew := c.s.dpRenews && time.Since(c.lastRenew) > c.rec.TTL/10
	if renew {
		c.lastRenew = time.Now()
	}
	c.mu.Unlock()
	if renew {
		go c.s.sandboxes.Heartbeat(context.WithoutCancel(ctx), c.org, c.rec.ID)
	}
	return o, ctx, req, nil
}

// decodeArgs reads an op's arguments strictly: one JSON object of known fields, nothing after it.
func decodeArgs(raw json.RawMessage, v any) error {
	if len(raw) == 0 || string(raw) == "null" {
		raw = []byte("{}")
	}
	if protocol.DecodeFlat(raw, v) { // the hot ops' canonical args, without encoding/json
		return nil
	}
	if err := decodeStrict(raw, v); err != nil {
		return protocol.Errorf(protocol.CodeInvalidArgument, "invalid args: %s", jsonProblem(err))
	}
	return nil
}
