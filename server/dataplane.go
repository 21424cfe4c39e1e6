package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/gorilla/websocket"
	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/workspace"
	"github.com/sbxbroker/broker/store"
)

// Dataplane limits (docs/dataplane.md).
const (
	dpChunkBytes    = 1 << 20
	dpMaxFrameBytes = dpChunkBytes + 64<<10
	dpMaxInflight   = 64
	// File operations whose answer can be large (read, ls, glob, grep, download) hold a heavy slot
	// until their answer is written to the client (or dropped): this many per connection. read, ls,
	// glob and grep also hold one of dpHeavyPerBroker across every connection, which bounds the
	// memory their answers take however many connections or tokens a client opens; a client that
	// does not read makes that wait as long as it likes, so one org holds at most dpHeavyPerOrg of
	// them and the others are still served. A download takes no broker-wide slot: it streams, so it
	// holds a chunk at a time (its memory is bounded by the connection's write queue, as for a
	// streamed exec), and it lasts as long as its reader is slow: broker-wide slots held by slow
	// downloads would stall every other connection's reads.
	dpHeavyPerConn   = 2
	dpHeavyPerBroker = 16
	dpHeavyPerOrg    = dpHeavyPerBroker / 4
	// dpExecOutputBudget bounds the output of non-streamed execs held in memory broker-wide (a
	// command may run for minutes, so it cannot hold a slot), from its first byte until its answer
	// is written to the client: the buffers' capacity while the command runs, then the encoded
	// answer. Past it, output is dropped and the result says truncated. One org holds at most
	// dpExecOutputPerOrg of it.
	dpExecOutputBudget = 256 << 20
	dpExecOutputPerOrg = dpExecOutputBudget / 4
	// dpQueueBytes bounds the bytes waiting for one client: answers and stream chunks queued, the
	// frame being written, and a download's chunk being read. A producer that would pass it waits
	// (the connection's reader too: a client that does not read stops being read), so a client
	// that does not read holds at most this much, or one answer larger than it. dpWriteQueue bounds
	// the frames in the queue as well, for tiny ones.
	// dpQueuedBudget bounds the bytes waiting for every client together, and dpQueuedPerOrg one
	// org's: an org whose clients do not read fills its share and then waits, alone.
	dpQueuedBudget = 1 << 30
	dpQueuedPerOrg = dpQueuedBudget / 4
	// dpRetryAfter is the Retry-After (seconds) of an upgrade refused for too many connections.
	dpRetryAfter   = "5"
	dpQueueBytes   = 4 << 20
	dpWriteQueue   = 64
	dpWriteTimeout = 30 * time.Second
	dpPingEvery    = 30 * time.Second
	dpPongWait     = 75 * time.Second
	// dpRecheckEvery re-verifies each connection's credential, a backstop for revocation
	// announcements lost while a broker was disconnected from Redis.
	dpRecheckEvery = 30 * time.Second
	// dpCloseWait bounds how long shutdown waits for connections to end; each ends within about a
	// second (the reader's deadline after a close).
	dpCloseWait = 5 * time.Second
)

var upgrader = websocket.Upgrader{
	ReadBufferSize:    64 << 10,
	WriteBufferSize:   64 << 10,
	Subprotocols:      []string{protocol.Subprotocol},
	EnableCompression: false,
	// Origin is checked before the upgrade (checkOrigin); by then it is acceptable.
	CheckOrigin: func(*http.Request) bool { return true },
}

// dataplane authenticates, authorizes and upgrades GET /v1/sandboxes/{ref}/dataplane. Failures
// before the upgrade are ordinary JSON errors.
func (s *Server) dataplane(c echo.Context) error {
	r := c.Request()
	// The dataplane takes no query parameters, so refusing all of them refuses every spelling of
	// a credential in the URL (URLs end up in logs).
	if r.URL.RawQuery != "" {
		return protocol.Errorf(protocol.CodeInvalidArgument, "the dataplane takes no query parameters (and never credentials in the URL): send Authorization: Bearer, or the %s<credential> subprotocol", protocol.BearerSubprotocolPrefix)
	}
	// Counted from here, before any work, so that concurrent upgrades cannot overshoot the bound.
	release, ok := s.hub.reserve(s.dpLimits.MaxConnections)
	if !ok {
		c.Response().Header().Set("Retry-After", dpRetryAfter)
		return protocol.Errorf(protocol.CodeUnavailable, "this broker has %d dataplane connections open, its maximum; retry shortly", s.dpLimits.MaxConnections)
	}
	defer release()
	if err := s.checkOrigin(r); err != nil {
		return err
	}
	if !offers(r, protocol.Subprotocol) {
		return protocol.Errorf(protocol.CodeInvalidArgument, "the dataplane needs the WebSocket subprotocol %s", protocol.Subprotocol)
	}
	cred := bearer(r)
	if cred == "" {
		cred = subprotocolCredential(r)
	}
	if cred == "" {
		return errNoCredentials
	}
	conn := &dpConn{s: s}
	ctx := r.Context()
	if store.LooksLikeAPIKey(cred) {
		p, err := s.ownerKey(ctx, cred)
		if err != nil {
			return err
		}
		conn.org, conn.keyID, conn.actor = p.Org, p.KeyID, p.Actor()
		conn.scopes = map[string]bool{protocol.ScopeFSRead: true, protocol.ScopeFSWrite: true, protocol.ScopeExec: true}
	} else {
		claims, err := s.delegation.Verifier().Verify(ctx, cred)
		if err != nil {
			return err
		}
		// A token is a credential like a key: its upgrades spend its own bucket of the org's rps.
		if err := s.limitCredential(ctx, claims.Org, "token:"+claims.ID); err != nil {
			return err
		}
		conn.org, conn.claims, conn.actor = claims.Org, claims, "token:"+claims.ID
		conn.scopes = map[string]bool{}
		for _, sc := range claims.Scopes() {
			conn.scopes[sc] = true
		}
	}
	// The credential and its org are known from here: count the connection against their caps
	// before anything else is looked up on its behalf.
	holder := "key:" + conn.keyID
	if conn.claims != nil {
		holder = "token:" + conn.claims.ID
	}
	releaseShare, err := s.hub.admit(conn.org, holder, s.orgLimits.get(ctx, conn.org).Connections, s.dpLimits.PerCredential)
	if err != nil {
		c.Response().Header().Set("Retry-After", dpRetryAfter)
		return err
	}
	defer releaseShare()
	rec, err := s.dataplaneSandbox(ctx, conn, c.Param("ref"))
	if err != nil {
		return err
	}
	c.Set(ctxSandbox, rec)
	if rec.Status != protocol.StatusRunning {
		return protocol.Errorf(protocol.CodeNotRunning, "sandbox %s is %s: its owner must resume it", rec.Name, rec.Status)
	}
	if conn.inst, err = s.sandboxes.Instance(rec); err != nil {
		return err
	}
	if conn.files, err = s.sandboxes.Workspace(rec); err != nil {
		return err
	}
	conn.rec = rec
	ws, err := s.upgrade(c)
	if err != nil {
		return nil // upgrade answered already
	}
	c.Response().Committed = true
	conn.serve(ws, requestID(c))
	return nil
}

// upgrade switches the request to a WebSocket. A request that is not a well-formed upgrade gets the
// JSON error answer of every other failure (not gorilla's plain-text one), through errorHandler.
func (s *Server) upgrade(c echo.Context) (*websocket.Conn, error) {
	up := upgrader
	up.Error = func(w http.ResponseWriter, _ *http.Request, status int, reason error) {
		w.Header().Set("Sec-WebSocket-Version", "13") // RFC 6455 4.4, as gorilla's own answer does
		if status >= http.StatusInternalServerError {
			s.errorHandler(fmt.Errorf("dataplane upgrade: %w", reason), c) // logged, never sent
			return
		}
		s.errorHandler(protocol.Errorf(protocol.CodeInvalidArgument, "%v", reason), c)
	}
	hdr := http.Header{}
	hdr.Set(echo.HeaderXRequestID, requestID(c))
	return up.Upgrade(c.Response(), c.Request(), hdr)
}

func (s *Server) checkOrigin(r *http.Request) error {
	origin := r.Header.Get("Origin")
	if origin == "" {
		return nil // not a browser
	}
	for _, o := range s.allowedOrigins {
		if strings.EqualFold(o, origin) {
			return nil
		}
	}
	return protocol.Errorf(protocol.CodeForbidden, "origin %q may not open the dataplane (the broker's --allowed-origins)", clipHeader(origin))
}

func offers(r *http.Request, proto string) bool {
	for _, p := range websocket.Subprotocols(r) {
		if p == proto {
			return true
		}
	}
	return false
}

func subprotocolCredential(r *http.Request) string {
	for _, p := range websocket.Subprotocols(r) {
		if cred, ok := strings.CutPrefix(p, protocol.BearerSubprotocolPrefix); ok {
			return cred
		}
	}
	return ""
}

func clipHeader(s string) string {
	if len(s) > 100 {
		s = s[:100]
	}
	return strings.ToValidUTF8(s, "?")
}

// dpConn is one dataplane connection: one reader goroutine (this one), one writer goroutine, and a
// goroutine per request in flight.
type dpConn struct {
	s      *Server
	org    string
	actor  string
	keyID  string             // owners
	claims *delegation.Claims // delegates
	scopes map[string]bool
	rec    store.Record
	inst   provider.Instance
	files  *workspace.Workspace

	conn   *websocket.Conn
	out    chan outFrame
	ctx    context.Context
	cancel context.CancelFunc

	// lastRenew is when dataplane activity last renewed the lease (with --dataplane-renews-lease).
	lastRenew time.Time

	// heavy holds this connection's slots for operations with large answers (holdHeavy).
	heavy chan struct{}
	// queued counts the bytes waiting for this client (dpQueueBytes).
	queued *quota

	mu       sync.Mutex
	inflight map[uint32]*request
	closing  bool
	closeMsg []byte // the close frame to send, set once
	// drained, once set (the broker is shutting down), refuses new requests and is closed when
	// no request is in flight any more (stopNew).
	drained       chan struct{}
	drainedClosed bool

	// running counts request goroutines, which serve waits for: they may still emit events.
	running sync.WaitGroup
}

// request is one request in flight.
type request struct {
	cancel context.CancelFunc
	upload *workspace.Upload // set for uploads, fed by the reader
	// hold is what the request holds of shared resources; its answer frame carries it.
	hold hold
	// exec is a non-streamed exec's output, counted against the broker-wide budget.
	exec *execOutput
}

// hold is what one request holds of the broker's shared resources (heavy slots, exec output
// budget), from when it takes them until its answer is written to the client, dropped, or left in
// the queue when the connection ends: each is taken once and given back once, by release. Only the
// request's goroutine adds to it, before it hands the answer to the writer.
type hold struct {
	mu       sync.Mutex
	releases []func()
	released bool
}

// add records what to give back; if the hold was released already, it is given back at once.
func (h *hold) add(release func()) {
	h.mu.Lock()
	if h.released {
		h.mu.Unlock()
		release()
		return
	}
	h.releases = append(h.releases, release)
	h.mu.Unlock()
}

// release gives back everything held, once; later calls do nothing.
func (h *hold) release() {
	h.mu.Lock()
	list := h.releases
	h.releases, h.released = nil, true
	h.mu.Unlock()
	for _, f := range list {
		f()
	}
}

// holdHeavy takes a heavy slot for req on this connection and, when broker is set, one broker-wide
// (within the org's share), waiting if none is free; they go with the request's answer and are
// given back when it is written or dropped.
func (c *dpConn) holdHeavy(ctx context.Context, req *request, broker bool) error {
	select {
	case c.heavy <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	req.hold.add(func() { <-c.heavy })
	if !broker {
		return nil
	}
	if err := c.s.dpHeavy.acquire(ctx, c.org, 1); err != nil {
		return err
	}
	req.hold.add(func() { c.s.dpHeavy.release(c.org, 1) })
	return nil
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
	c.inflight = map[uint32]*request{}
	c.heavy = make(chan struct{}, dpHeavyPerConn)
	c.ctx, c.cancel = context.WithCancel(context.Background())
	log := c.s.log.With("request_id", reqID, "sandbox_id", c.rec.ID, "org", c.org, "actor", c.actor)
	ws.SetReadLimit(dpMaxFrameBytes)
	ws.SetReadDeadline(time.Now().Add(dpPongWait))
	ws.SetPongHandler(func(string) error { return ws.SetReadDeadline(time.Now().Add(dpPongWait)) })

	unregister := c.s.hub.add(c)
	writerDone := make(chan struct{})
	go func() { defer close(writerDone); c.writer() }()
	go c.watch()

	hello := protocol.Hello{Protocol: protocol.Subprotocol, SandboxID: c.rec.ID, Workspace: workspace.Root,
		Scopes: c.scopeList(), Limits: protocol.Limits{MaxFrameBytes: dpMaxFrameBytes, MaxInflight: dpMaxInflight,
			MaxChunkBytes: dpChunkBytes, MaxOutputBytes: protocol.ExecMaxStreamOutput}}
	if c.claims != nil {
		hello.AllowCmd = c.claims.Cmd
		exp := c.claims.ExpiresAt.Time.UTC()
		hello.ExpiresAt = &exp
	}
	c.send(protocol.Response{Type: "hello", Hello: &hello})
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventConnected, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti()})
	log.Info("dataplane connected", "jti", c.jti())

	c.readLoop()

	c.shutdown(websocket.CloseNormalClosure, "")
	<-writerDone
	ws.Close()
	c.running.Wait()
	// Frames queued after the writer left (a producer that raced the close) are given back here:
	// nothing produces any more.
	c.dropQueued()
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventDisconnected, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti()})
	log.Info("dataplane disconnected", "jti", c.jti())
	unregister()
	// The handler's release comes last: broker shutdown waits for it, then closes the event writer.
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

// dataplaneSandbox resolves the URL's ref for a connection. A token only ever looks up its own
// sandbox, and a ref that is not that sandbox's id or name gets the very answer of a missing one:
// answering "another sandbox" (403) for a sandbox that exists would tell a delegate which names
// its owner's org uses.
func (s *Server) dataplaneSandbox(ctx context.Context, conn *dpConn, ref string) (store.Record, error) {
	if conn.claims == nil {
		return s.sandboxes.Get(ctx, conn.org, ref)
	}
	rec, err := s.sandboxes.Get(ctx, conn.org, conn.claims.Sbx)
	var pe *protocol.Error
	if err == nil && ref != rec.ID && ref != rec.Name || errors.As(err, &pe) && pe.Code == protocol.CodeNotFound {
		return store.Record{}, sandbox.NotFound(ref)
	}
	return rec, err
}

// watch closes the connection when the credential expires or the sandbox's processes end (stop,
// delete, a crash), and re-verifies the credential periodically.
func (c *dpConn) watch() {
	var expiry <-chan time.Time
	if c.claims != nil {
		t := time.NewTimer(c.claims.ExpiresAt.Time.Sub(c.s.now()))
		defer t.Stop()
		expiry = t.C
	}
	recheck := time.NewTicker(dpRecheckEvery)
	defer recheck.Stop()
	for {
		select {
		case <-c.ctx.Done():
			return
		case <-expiry:
			c.shutdown(protocol.CloseCredentialEnded, protocol.CodeTokenExpired)
			return
		case <-c.inst.Done():
			c.shutdown(protocol.CloseSandboxGone, protocol.CodeNotRunning)
			return
		case <-recheck.C:
			if code := c.recheck(); code != "" {
				c.shutdown(protocol.CloseCredentialEnded, code)
				return
			}
		}
	}
}

// recheck re-verifies the credential against Redis; it answers the code that ends it, or "".
func (c *dpConn) recheck() string {
	ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
	defer cancel()
	if c.claims != nil {
		var pe *protocol.Error
		if err := c.s.delegation.CheckRevocation(ctx, c.claims); errors.As(err, &pe) {
			return pe.Code
		}
		return ""
	}
	if k, err := c.s.store.APIKeyByID(ctx, c.keyID); errors.Is(err, store.ErrNotFound) || (err == nil && !k.RevokedAt.IsZero()) {
		return protocol.CodeUnauthenticated
	}
	return ""
}

// revoked is called by the hub for a revocation announced by any broker.
func (c *dpConn) revoked(r delegation.Revocation) {
	if c.claims == nil {
		return
	}
	if (r.JTI != "" && r.JTI == c.claims.ID) || (r.Gen > 0 && c.claims.Gen < r.Gen) {
		c.shutdown(protocol.CloseCredentialEnded, protocol.CodeTokenRevoked)
	}
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
	for _, r := range c.inflight {
		r.cancel()
		if r.upload != nil {
			r.upload.Abort()
		}
	}
	c.mu.Unlock()
	c.cancel()
	// Unblock the reader if the close came from elsewhere.
	c.conn.SetReadDeadline(time.Now().Add(time.Second))
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
			if f.taken != nil {
				f.taken()
			}
			c.conn.SetWriteDeadline(time.Now().Add(dpWriteTimeout))
			err := c.conn.WriteMessage(f.kind, f.data)
			c.written(f)
			if err != nil {
				c.shutdown(websocket.CloseAbnormalClosure, "")
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

// enqueueCharged is enqueue for a frame whose f.n bytes were charged already.
func (c *dpConn) enqueueCharged(f outFrame) bool {
	select {
	case c.out <- f:
		return true
	case <-c.ctx.Done():
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

// wireRequest is a client text frame with its args still raw.
type wireRequest struct {
	ID   *uint32         `json:"id"`
	Op   string          `json:"op"`
	Args json.RawMessage `json:"args"`
}

func (c *dpConn) readLoop() {
	var text bytes.Buffer
	chunk := make([]byte, dpChunkBytes)
	header := make([]byte, protocol.FrameHeaderLen)
	for {
		mt, r, err := c.conn.NextReader()
		if err != nil {
			if errors.Is(err, websocket.ErrReadLimit) {
				c.shutdown(websocket.CloseMessageTooBig, "frame over max_frame_bytes")
			}
			return
		}
		if mt == websocket.BinaryMessage {
			if _, err := io.ReadFull(r, header); err != nil {
				c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "%v", protocol.ErrShortFrame)})
				continue
			}
			c.binary(header[0], uint32(header[1])<<24|uint32(header[2])<<16|uint32(header[3])<<8|uint32(header[4]), r, chunk)
			continue
		}
		text.Reset()
		if _, err := text.ReadFrom(r); err != nil {
			return
		}
		// RFC 6455 text frames are UTF-8; decoding would silently turn invalid bytes (in a path, say)
		// into U+FFFD, so refuse them instead.
		if !utf8.Valid(text.Bytes()) {
			c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidJSON, "text frames must be valid UTF-8")})
			continue
		}
		// The canonical form is split without decoding; its args are decoded once, strictly, by the
		// operation. Any other form goes through the full decoder.
		id, op, args, ok := protocol.SplitRequest(text.Bytes())
		args = bytes.Clone(args) // text is reused for the next frame; the request outlives it
		if !ok {
			var req wireRequest
			if err := decodeStrict(text.Bytes(), &req); err != nil || req.ID == nil || req.Op == "" {
				c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidJSON, "a request is a JSON object {\"id\": <uint32>, \"op\": <string>, \"args\": {...}} and nothing else")})
				continue
			}
			id, op, args = *req.ID, req.Op, req.Args
		}
		if id == 0 && op != protocol.OpCancel { // a cancel is never answered, whatever its id
			c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "request id 0 is reserved for errors not tied to a request; use 1 or more")})
			continue
		}
		c.dispatch(id, op, args)
	}
}

// binary routes a binary frame: only upload data and upload end go client -> server.
func (c *dpConn) binary(kind byte, id uint32, payload io.Reader, chunk []byte) {
	c.mu.Lock()
	req := c.inflight[id]
	c.mu.Unlock()
	if req == nil || req.upload == nil || (kind != protocol.FrameData && kind != protocol.FrameEnd) {
		io.Copy(io.Discard, payload)
		// Answered with id 0: request id may be in flight, and its one answer is still to come.
		c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "binary frame of kind %d for request %d, which is not an upload in progress", kind, id)})
		return
	}
	if kind == protocol.FrameData {
		for {
			n, err := io.ReadFull(payload, chunk)
			if n > 0 {
				if _, werr := req.upload.Write(chunk[:n]); werr != nil {
					c.finish(id)
					req.upload.Abort()
					c.fail(id, werr)
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	c.finish(id)
	res, err := req.upload.Commit()
	if err != nil {
		c.fail(id, err)
		return
	}
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventFileWritten, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti(), Path: res.Path})
	c.send(protocol.Response{ID: id, Result: res})
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

func (c *dpConn) dispatch(id uint32, op string, args json.RawMessage) {
	if op == protocol.OpCancel {
		c.mu.Lock()
		r := c.inflight[id]
		c.mu.Unlock()
		if r != nil {
			r.cancel()
			if r.upload != nil {
				c.finish(id)
				r.upload.Abort()
				c.fail(id, context.Canceled)
			}
		}
		return
	}
	if op == protocol.OpPing {
		c.send(protocol.Response{ID: id, Result: struct{}{}})
		return
	}
	scope, known := delegation.RequiredScope(op)
	if !known {
		c.send(protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeUnknownOp, "unknown operation %q", clipHeader(op))})
		return
	}
	if !c.scopes[scope] {
		c.send(protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeScopeDenied, "%s needs the %s scope, which this credential does not have", op, scope)})
		return
	}
	ctx, cancel := context.WithCancel(c.ctx)
	req := &request{cancel: cancel}
	c.mu.Lock()
	switch {
	case c.closing:
		c.mu.Unlock()
		cancel()
		return
	case c.drained != nil:
		c.mu.Unlock()
		cancel()
		c.send(protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeUnavailable, "the broker is shutting down: request %d was not started; reconnect (the sandbox's broker will be back) and send it again", id)})
		return
	case c.inflight[id] != nil:
		c.mu.Unlock()
		cancel()
		// Answered with id 0: the request already in flight under this id gets its own answer.
		c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "request id %d is already in flight; this request was ignored", id)})
		return
	case len(c.inflight) >= dpMaxInflight:
		c.mu.Unlock()
		cancel()
		c.send(protocol.Response{ID: id, Error: protocol.Errorf(protocol.CodeTooManyRequests, "%d requests are in flight on this connection, the most allowed: wait for answers", dpMaxInflight)})
		return
	}
	c.inflight[id] = req
	renew := c.s.dpRenews && time.Since(c.lastRenew) > c.rec.TTL/10
	if renew {
		c.lastRenew = time.Now()
	}
	c.mu.Unlock()
	if renew {
		go c.s.sandboxes.Heartbeat(context.WithoutCancel(ctx), c.org, c.rec.ID)
	}

	if op == protocol.OpUpload {
		// Opened here, in the reader, so that the data frames that follow find it.
		var a protocol.UploadArgs
		if err := decodeArgs(args, &a); err != nil {
			c.finish(id)
			c.fail(id, err)
			return
		}
		up, err := c.files.Create(a.Path, a.Mode)
		if err != nil {
			c.finish(id)
			c.fail(id, err)
			return
		}
		c.mu.Lock()
		req.upload = up
		closing := c.closing
		c.mu.Unlock()
		if closing {
			// shutdown ran while the file was being created and could not abort it.
			up.Abort()
		}
		return
	}
	c.running.Add(1)
	go func() {
		defer c.running.Done()
		res, err := c.run(ctx, id, req, op, args)
		resp := protocol.Response{ID: id, Result: res}
		if err != nil {
			if ctx.Err() != nil && c.ctx.Err() == nil {
				err = context.Canceled
			}
			resp = c.errorResponse(id, err)
		}
		c.answer(id, req, resp)
	}()
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

// decodeStrict decodes exactly one JSON value with no unknown fields and nothing but space after it.
func decodeStrict(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if len(bytes.TrimSpace(b[dec.InputOffset():])) != 0 {
		return errTrailingData
	}
	return nil
}

var errTrailingData = errors.New("data after the JSON value")

// run performs one operation and returns its result.
func (c *dpConn) run(ctx context.Context, id uint32, req *request, op string, raw json.RawMessage) (any, error) {
	switch op {
	case protocol.OpRead, protocol.OpLs, protocol.OpGlob, protocol.OpGrep:
		if err := c.holdHeavy(ctx, req, true); err != nil {
			return nil, err
		}
	case protocol.OpDownload:
		// Streamed, bounded by the write queue, and as slow as its reader (dpHeavyPerConn).
		if err := c.holdHeavy(ctx, req, false); err != nil {
			return nil, err
		}
	}
	emit := func(typ, path string) {
		c.s.events.Emit(c.org, protocol.Event{Type: typ, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti(), Path: path})
	}
	switch op {
	case protocol.OpEnv:
		if err := decodeArgs(raw, &struct{}{}); err != nil {
			return nil, err
		}
		return protocol.EnvResult{Env: c.inst.Environment()}, nil
	case protocol.OpStat:
		var a protocol.StatArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		return c.files.Stat(a.Path)
	case protocol.OpLs:
		var a protocol.LsArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		res, err := c.files.ListContext(ctx, a.Path)
		if res.Entries == nil {
			res.Entries = []protocol.FileInfo{}
		}
		return res, err
	case protocol.OpRead:
		var a protocol.ReadArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		return c.files.ReadContext(ctx, a)
	case protocol.OpWrite:
		var a protocol.WriteArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		res, err := c.files.Write(a)
		if err == nil {
			emit(protocol.EventFileWritten, res.Path)
		}
		return res, err
	case protocol.OpEdit:
		var a protocol.EditArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		res, err := c.files.Edit(a)
		if err == nil {
			emit(protocol.EventFileWritten, res.Path)
		}
		return res, err
	case protocol.OpDelete:
		var a protocol.DeleteArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		if err := c.files.Delete(a); err != nil {
			return nil, err
		}
		p := sandboxPath(a.Path)
		emit(protocol.EventFileDeleted, p)
		return protocol.PathResult{Path: p}, nil
	case protocol.OpMkdir:
		var a protocol.MkdirArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		if err := c.files.Mkdir(a); err != nil {
			return nil, err
		}
		return protocol.PathResult{Path: sandboxPath(a.Path)}, nil
	case protocol.OpMove:
		var a protocol.MoveArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		if err := c.files.Move(a); err != nil {
			return nil, err
		}
		emit(protocol.EventFileDeleted, sandboxPath(a.From))
		emit(protocol.EventFileWritten, sandboxPath(a.To))
		return protocol.PathResult{Path: sandboxPath(a.To)}, nil
	case protocol.OpGlob:
		var a protocol.GlobArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		return c.files.GlobContext(ctx, a)
	case protocol.OpGrep:
		var a protocol.GrepArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		return c.files.Grep(ctx, a)
	case protocol.OpDownload:
		var a protocol.DownloadArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		return c.download(ctx, id, a)
	case protocol.OpExec:
		var a protocol.ExecArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		return c.exec(ctx, id, req, a)
	}
	return nil, protocol.Errorf(protocol.CodeUnknownOp, "unknown operation %q", op)
}

// sandboxPath names a path the way results do (/workspace/...), for events.
func sandboxPath(p string) string {
	rel, err := workspace.Resolve(p)
	if err != nil || rel == "." {
		return workspace.Root
	}
	return workspace.Root + "/" + rel
}

// chunkPool holds download buffers: a frame header followed by one chunk.
var chunkPool = sync.Pool{New: func() any { b := make([]byte, protocol.FrameHeaderLen+dpChunkBytes); return &b }}

func (c *dpConn) download(ctx context.Context, id uint32, a protocol.DownloadArgs) (any, error) {
	f, info, err := c.files.OpenRead(a.Path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var size int64
	for {
		// The chunk is counted against the connection's queue from before it is filled: a client
		// that does not read holds no chunk that is not counted.
		const chunk = protocol.FrameHeaderLen + dpChunkBytes
		if !c.charge(chunk) {
			return nil, context.Canceled
		}
		bp := chunkPool.Get().(*[]byte)
		buf := *bp
		n, err := io.ReadFull(f, buf[protocol.FrameHeaderLen:])
		if n > 0 {
			protocol.PutFrameHeader(buf, protocol.FrameData, id)
			size += int64(n)
			if !c.enqueueCharged(outFrame{kind: websocket.BinaryMessage, data: buf[:protocol.FrameHeaderLen+n], n: chunk, release: func() { chunkPool.Put(bp) }}) {
				return nil, context.Canceled
			}
		} else {
			c.uncharge(chunk)
			chunkPool.Put(bp)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return protocol.DownloadResult{Path: info.Path, Size: size}, nil
		}
		if err != nil {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
}

func (c *dpConn) exec(ctx context.Context, id uint32, r *request, a protocol.ExecArgs) (any, error) {
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
	if a.Cwd != "" {
		if _, err := workspace.Resolve(a.Cwd); err != nil {
			return nil, err
		}
	}
	if a.MaxOutput == 0 {
		a.MaxOutput = protocol.ExecDefaultOutput
	}
	req := provider.ExecRequest{Command: a.Command, Argv: a.Argv, Cwd: a.Cwd, Env: a.Env,
		Timeout: time.Duration(a.TimeoutMS) * time.Millisecond, MaxOutput: a.MaxOutput, Background: a.Background}
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
		req.Stdout = &streamWriter{c: c, id: id, kind: protocol.FrameStdout}
		if !a.Combined {
			req.Stderr = &streamWriter{c: c, id: id, kind: protocol.FrameStderr}
		}
	default:
		req.Stdout = stdout
		if !a.Combined {
			req.Stderr = stderr
		}
	}
	res, err := c.inst.Exec(ctx, req)
	if err != nil {
		return nil, err
	}
	result := protocol.ExecResult{ExitCode: res.ExitCode, Signal: res.Signal, Reason: res.Reason,
		Truncated: res.Truncated || out.wasDropped(), DurationMS: res.Duration.Milliseconds()}
	if a.Background {
		result.Pid = res.Pid
	}
	if !a.Stream && !a.Background {
		if a.Combined {
			result.Output = utf8String(stdout.buf)
		} else {
			result.Stdout, result.Stderr = utf8String(stdout.buf), utf8String(stderr.buf)
		}
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
	if res.Reason == provider.ReasonCancelled {
		return nil, context.Canceled
	}
	return result, nil
}

// execOutput is what one non-streamed exec holds of the broker-wide output budget: the capacity of
// its stdout and stderr buffers while it runs, then its encoded answer until that is written.
type execOutput struct {
	budget *quota
	org    string
	limit  int // the exec's max_output: no buffer grows past it

	mu      sync.Mutex
	held    int64
	dropped bool
	freed   bool
}

// grow takes n more bytes of budget for a buffer, or says the output must be dropped.
func (o *execOutput) grow(n int64) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.freed || !o.budget.tryAcquire(o.org, n) {
		o.dropped = true
		return false
	}
	o.held += n
	return true
}

func (o *execOutput) wasDropped() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.dropped
}

// settle makes the budget count n bytes, the encoded answer that now carries the output, instead of
// the buffers, which are garbage from here. The answer exists already, so it is counted even past
// the budget (by at most what encoding added to output that was within it).
func (o *execOutput) settle(n int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.freed {
		return
	}
	if d := n - o.held; d > 0 {
		o.budget.force(o.org, d)
	} else {
		o.budget.release(o.org, -d)
	}
	o.held = n
}

// free gives everything back to the budget, once.
func (o *execOutput) free() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.freed {
		o.budget.release(o.org, o.held)
		o.held, o.freed = 0, true
	}
}

// budgetWriter buffers one of a command's outputs against its execOutput; what the budget cannot
// hold is dropped (and said so). Its buffer's capacity is what is counted.
type budgetWriter struct {
	out *execOutput
	buf []byte
}

func (w *budgetWriter) Write(p []byte) (int, error) {
	need := len(w.buf) + len(p)
	if need > cap(w.buf) {
		// Grow as append would, but never past the exec's output cap, and only within budget.
		size := max(need, 2*cap(w.buf), 4096)
		if w.out.limit > 0 {
			size = max(need, min(size, w.out.limit))
		}
		if !w.out.grow(int64(size - cap(w.buf))) {
			return len(p), nil
		}
		grown := make([]byte, len(w.buf), size)
		copy(grown, w.buf)
		w.buf = grown
	}
	w.buf = append(w.buf, p...)
	return len(p), nil
}

func utf8String(b []byte) *string {
	s := string(b)
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	return &s
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

// hub tracks open dataplane connections by sandbox, for revocations announced by any broker and for
// shutdown.
type hub struct {
	mu    sync.Mutex
	conns map[string]map[*dpConn]struct{} // org/sandbox id -> connections
	// open is the one count of dataplane connections, from reserve (before the handshake's checks)
	// until the handler returns: it bounds them, it is the sbx_dataplane_connections gauge, and
	// closeAll waits for it, since http.Server.Shutdown does not wait for hijacked connections and
	// after closeAll the broker closes its event writer, which a connection still ending would emit
	// into.
	open int
	// byOrg and byCred count connections that passed authentication, by org and by credential
	// (admit), against the per-org and per-credential caps.
	byOrg, byCred map[string]int
	closed        bool          // closeAll ran: a connection upgraded later is closed at once
	idle          chan struct{} // closed when open drops to 0 after closeAll
}

func newHub() *hub {
	return &hub{conns: map[string]map[*dpConn]struct{}{}, byOrg: map[string]int{}, byCred: map[string]int{}}
}

// admit counts an authenticated connection against its org's cap (the org's connections limit; 0:
// none) and its credential's, or refuses it with too_many_connections. release uncounts it, once.
func (h *hub) admit(org, cred string, perOrg, perCred int) (release func(), err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.byCred[cred] >= perCred {
		return nil, protocol.Errorf(protocol.CodeTooManyConnections, "this credential has %d dataplane connections open on this broker, its maximum: close one, or retry later", perCred)
	}
	if perOrg > 0 && h.byOrg[org] >= perOrg {
		return nil, protocol.Errorf(protocol.CodeTooManyConnections, "this org has %d dataplane connections open on this broker, its connections limit: close one, or retry later (broker orgs set-limits %s --connections N raises it)", perOrg, org)
	}
	h.byCred[cred]++
	h.byOrg[org]++
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			if h.byCred[cred]--; h.byCred[cred] <= 0 {
				delete(h.byCred, cred)
			}
			if h.byOrg[org]--; h.byOrg[org] <= 0 {
				delete(h.byOrg, org)
			}
		})
	}, nil
}

// reserve counts a connection being opened, unless max are counted already. release uncounts it,
// once; call it when the connection has ended (or was refused).
func (h *hub) reserve(max int) (release func(), ok bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.open >= max {
		return nil, false
	}
	h.open++
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			if h.open--; h.open == 0 && h.idle != nil {
				close(h.idle)
				h.idle = nil
			}
			h.mu.Unlock()
		})
	}, true
}

// count is the number of connections open or being opened.
func (h *hub) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.open
}

func (h *hub) add(c *dpConn) (remove func()) {
	key := c.org + "/" + c.rec.ID
	h.mu.Lock()
	if h.conns[key] == nil {
		h.conns[key] = map[*dpConn]struct{}{}
	}
	h.conns[key][c] = struct{}{}
	closed := h.closed
	h.mu.Unlock()
	if closed {
		c.shutdown(websocket.CloseGoingAway, "broker shutting down")
	}
	return func() {
		h.mu.Lock()
		delete(h.conns[key], c)
		if len(h.conns[key]) == 0 {
			delete(h.conns, key)
		}
		h.mu.Unlock()
	}
}

// each calls fn for the connections of one sandbox ("org/id"), or of all sandboxes when key is "".
func (h *hub) each(key string, fn func(*dpConn)) {
	h.mu.Lock()
	var list []*dpConn
	for k, set := range h.conns {
		if key == "" || k == key {
			for c := range set {
				list = append(list, c)
			}
		}
	}
	h.mu.Unlock()
	for _, c := range list {
		fn(c)
	}
}

// keyRevoked closes the connections of an owner whose API key was revoked, and those of every
// delegation token that key minted (their verification now fails: Service.CheckRevocation).
func (h *hub) keyRevoked(keyID string) {
	h.each("", func(c *dpConn) {
		switch {
		case c.claims == nil && c.keyID == keyID:
			c.shutdown(protocol.CloseCredentialEnded, protocol.CodeUnauthenticated)
		case c.claims != nil && c.claims.KeyID() == keyID:
			c.shutdown(protocol.CloseCredentialEnded, protocol.CodeTokenRevoked)
		}
	})
}

// revoked applies an announced revocation to the connections it concerns.
func (h *hub) revoked(r delegation.Revocation) {
	h.each(r.Org+"/"+r.SandboxID, func(c *dpConn) { c.revoked(r) })
}

// drain begins a graceful shutdown: connections upgraded from now on are closed at once, open ones
// refuse new requests, and drain waits until those in flight are answered or ctx ends (closeAll
// then cuts the rest).
func (h *hub) drain(ctx context.Context) {
	h.mu.Lock()
	h.closed = true
	h.mu.Unlock()
	type waiting struct {
		drained <-chan struct{}
		ended   <-chan struct{}
	}
	var list []waiting
	h.each("", func(c *dpConn) { list = append(list, waiting{c.stopNew(), c.ctx.Done()}) })
	for _, w := range list {
		select {
		case <-w.drained:
		case <-w.ended: // the connection is ending anyway
		case <-ctx.Done():
			return
		}
	}
}

// closeAll closes every connection (broker shutdown) and waits, up to dpCloseWait, until each has
// sent its close frame and emitted its last events.
func (h *hub) closeAll() {
	h.mu.Lock()
	h.closed = true
	idle := h.idle
	if h.open > 0 && idle == nil {
		idle = make(chan struct{})
		h.idle = idle
	}
	h.mu.Unlock()
	h.each("", func(c *dpConn) { c.shutdown(websocket.CloseGoingAway, "broker shutting down") })
	if idle == nil {
		return
	}
	t := time.NewTimer(dpCloseWait)
	defer t.Stop()
	select {
	case <-idle:
	case <-t.C:
	}
}
