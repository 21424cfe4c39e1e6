package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/gorilla/websocket"
	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// Dataplane limits (docs/dataplane.md).
const (
	dpChunkBytes    = 1 << 20
	dpMaxFrameBytes = dpChunkBytes + 64<<10
	dpMaxInflight   = 64
	// File operations whose answer can be large (read, ls, glob, grep, download: opHeavy and
	// opStreamed in dpOps) hold a heavy slot until their answer is written to the client (or
	// dropped): this many per connection. read, ls,
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
	// dpOpMemoryBudget bounds what operations build in memory, every request's together: the
	// names a tar walk holds and an untar remembers, the names ls, glob and grep read and the
	// answers they and changes assemble, an edit's file and result. Each operation bounds its
	// own, but that bound times the requests a client may have in flight on every connection it
	// may open is many GB. An operation draws on it as what it holds grows (dpOpMemoryGrain at a
	// time) and gives it back when its request ends; past it, it stops with too_many_requests.
	// One org holds at most dpOpMemoryPerOrg of it, so one tenant cannot starve the others.
	dpOpMemoryBudget = 512 << 20
	dpOpMemoryPerOrg = dpOpMemoryBudget / 4
	dpOpMemoryGrain  = 64 << 10
	// dpRetryAfter is the Retry-After (seconds) of an upgrade refused for too many connections.
	dpRetryAfter = "5"
	dpQueueBytes = 4 << 20
	// dpShellInputBytes bounds the keystrokes one client sent that its shells' terminals have not
	// taken yet (a paste into a program that does not read its input): past it the connection's
	// reader waits, as for a pipe. dpShellInputBudget bounds them for every client together and
	// dpShellInputPerOrg one org's. Each shell queued 64 frames of up to max_frame_bytes before.
	dpShellInputBytes  = 1 << 20
	dpShellInputBudget = 256 << 20
	dpShellInputPerOrg = dpShellInputBudget / 4
	// dpDirectBytes is the largest frame a producer writes itself when the connection's writer is
	// idle (dpConn.wmu); larger ones (stream chunks, big answers) go through the writer, so that
	// producing the next one overlaps writing this one.
	dpDirectBytes  = 64 << 10
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
	release, err := s.reserveConnection(c)
	if err != nil {
		return err
	}
	defer release()
	if err := s.checkOrigin(r); err != nil {
		return err
	}
	if !offers(r, protocol.Subprotocol) {
		if v := otherVersion(r); v != "" {
			return protocol.Errorf(protocol.CodeInvalidArgument, "this client speaks %s, which this broker no longer serves: it speaks %s (file content travels in binary frames, docs/dataplane.md); upgrade the client", clipHeader(v), protocol.Subprotocol)
		}
		return protocol.Errorf(protocol.CodeInvalidArgument, "the dataplane needs the WebSocket subprotocol %s", protocol.Subprotocol)
	}
	cred, err := dataplaneCredential(r)
	if err != nil {
		return err
	}
	ctx := r.Context()
	conn, releaseShare, err := s.authorizeConn(ctx, cred, c.Param("ref"), c.Response().Header())
	if conn != nil {
		c.Set(ctxSandbox, conn.rec)
	}
	if err != nil {
		return err
	}
	defer releaseShare()
	if r.Method == http.MethodHead {
		return protocol.Errorf(protocol.CodeInvalidArgument, "a HEAD cannot open the dataplane: upgrade with a GET (docs/dataplane.md)")
	}
	ws, err := s.upgrade(c)
	if err != nil {
		return nil // upgrade answered already
	}
	c.Response().Committed = true
	conn.serve(ws, requestID(c))
	return nil
}

// reserveConnection counts a dataplane connection (an upgrade, an upload over HTTP) against the
// broker's bound before any work, so that concurrent ones cannot overshoot it; release gives it back.
func (s *Server) reserveConnection(c echo.Context) (release func(), err error) {
	release, ok := s.hub.reserve(s.dpLimits.MaxConnections)
	if !ok {
		c.Response().Header().Set("Retry-After", dpRetryAfter)
		return nil, protocol.Errorf(protocol.CodeUnavailable, "this broker has %d dataplane connections open, its maximum; retry shortly", s.dpLimits.MaxConnections)
	}
	return release, nil
}

// authorizeConn authenticates cred for a dataplane connection to the sandbox ref, counts it
// against its org's and its credential's connection caps, and resolves the running sandbox: what
// every dataplane connection passes, over the WebSocket or in process (the MCP endpoint's
// sessions, mcp_dataplane.go). release uncounts the connection; hdr gets Retry-After on a refusal
// that says to retry. conn, when not nil, names the sandbox resolved, even on a refusal.
func (s *Server) authorizeConn(ctx context.Context, cred, ref string, hdr http.Header) (conn *dpConn, release func(), err error) {
	// Noted before any check of the credential: open compares it once the connection is in the hub.
	conn = &dpConn{s: s, evictions: s.delegation.Evictions(), checkedFrom: s.now(), keyCheckedFrom: s.apiKeys.now()}
	if store.LooksLikeAPIKey(cred) {
		p, readAt, err := s.ownerKeyAt(ctx, cred)
		if err != nil {
			return nil, nil, err
		}
		conn.keyReadAt = readAt
		conn.org, conn.keyID, conn.actor = p.Org, p.KeyID, p.Actor()
		conn.scopes = map[string]bool{protocol.ScopeFSRead: true, protocol.ScopeFSWrite: true, protocol.ScopeExec: true}
	} else {
		// Its revocation state comes from Redis at most once per delegation.RecentTTL on this broker
		// (evicted at once by announced revocations); its signature and expiry are checked here
		// every time.
		claims, admission, err := s.delegation.VerifyRecentAdmission(ctx, cred)
		if err != nil {
			return nil, nil, err
		}
		conn.admission = admission
		// A token is a credential like a key: its upgrades spend its own bucket of the org's rps.
		if err := s.limitCredential(ctx, claims.Org, "token:"+claims.ID); err != nil {
			return nil, nil, err
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
		hdr.Set("Retry-After", dpRetryAfter)
		return nil, nil, err
	}
	rec, err := s.dataplaneSandbox(ctx, conn, ref)
	if err != nil {
		releaseShare()
		return nil, nil, err
	}
	conn.rec = rec
	if rec.Status != protocol.StatusRunning {
		releaseShare()
		if conn.claims == nil {
			return conn, nil, protocol.Errorf(protocol.CodeNotRunning, "sandbox %s is %s: resume it first (sbctl resume %s)", rec.Name, rec.Status, rec.Name)
		}
		return conn, nil, protocol.Errorf(protocol.CodeNotRunning, "sandbox %s is %s: its owner must resume it", rec.Name, rec.Status)
	}
	if conn.rt, err = s.sandboxes.Runtime(rec); err != nil {
		releaseShare()
		return conn, nil, err
	}
	conn.files = conn.rt.Files
	return conn, releaseShare, nil
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

// otherVersion is a dataplane subprotocol the client offers that this broker does not speak.
func otherVersion(r *http.Request) string {
	for _, p := range websocket.Subprotocols(r) {
		if strings.HasPrefix(p, protocol.SubprotocolPrefix) && p != protocol.Subprotocol {
			return p
		}
	}
	return ""
}

func subprotocolCredential(r *http.Request) string {
	for _, p := range allSubprotocols(r) {
		if cred, ok := strings.CutPrefix(p, protocol.BearerSubprotocolPrefix); ok {
			return cred
		}
	}
	return ""
}

// dataplaneCredential is the one credential of an upgrade: the Authorization header's, or one
// sbx.bearer. subprotocol's (browsers cannot set the header). Both, or two subprotocols, are
// refused: which one a proxy in front of the broker checked is anyone's guess.
func dataplaneCredential(r *http.Request) (string, error) {
	n := 0
	for _, p := range allSubprotocols(r) {
		if strings.HasPrefix(p, protocol.BearerSubprotocolPrefix) {
			n++
		}
	}
	cred := bearer(r)
	if cred != "" {
		n++
	} else {
		cred = subprotocolCredential(r)
	}
	switch {
	case n > 1:
		return "", protocol.Errorf(protocol.CodeInvalidArgument,
			"the upgrade carries %d credentials: send one credential, in the Authorization header or in one %s subprotocol", n, protocol.BearerSubprotocolPrefix)
	case cred == "":
		return "", errNoCredentials
	}
	return cred, nil
}

// allSubprotocols lists the subprotocols of every Sec-WebSocket-Protocol line of an upgrade: the
// header may come as several lines (RFC 6455 4.1), and websocket.Subprotocols reads the first only,
// where a proxy in front of the broker may read them all.
func allSubprotocols(r *http.Request) []string {
	var out []string
	for _, line := range r.Header.Values("Sec-Websocket-Protocol") {
		for p := range strings.SplitSeq(line, ",") {
			if p = strings.TrimSpace(p); p != "" {
				out = append(out, p)
			}
		}
	}
	return out
}

func clipHeader(s string) string {
	if len(s) > 100 {
		s = s[:100]
	}
	return strings.ToValidUTF8(s, "?")
}

// dataplaneSandbox resolves the URL's ref for a connection. A token only ever looks up its own
// sandbox, and a ref that is not that sandbox's id or name gets the very answer of a missing one:
// answering "another sandbox" (403) for a sandbox that exists would tell a delegate which names
// its owner's org uses. This read is made on every upgrade: it is what refuses a token at once,
// on every broker, when its sandbox is stopped or deleted, whatever the token's cached state says.
func (s *Server) dataplaneSandbox(ctx context.Context, conn *dpConn, ref string) (store.Record, error) {
	if conn.claims == nil {
		return s.sandboxes.Get(ctx, conn.org, ref)
	}
	rec, err := s.sandboxes.Get(ctx, conn.org, conn.claims.Sbx)
	var pe *protocol.Error
	// The token's own sandbox gone or going ends the token: the answer its revocation read gives,
	// whether that read was made for this upgrade or remembered.
	if err == nil && rec.Status == protocol.StatusDeleting || errors.As(err, &pe) && pe.Code == protocol.CodeNotFound {
		return store.Record{}, delegation.SandboxDeleted()
	}
	if err == nil && ref != rec.ID && ref != rec.Name || errors.As(err, &pe) && pe.Code == protocol.CodeNotFound {
		return store.Record{}, sandbox.NotFound(ref)
	}
	return rec, err
}
