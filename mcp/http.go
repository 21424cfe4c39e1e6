package mcp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/protocol"
)

// Identity is the verified delegation token behind one HTTP request.
type Identity struct {
	// Token is the credential itself: a session's tool calls open the dataplane with it.
	Token     string
	JTI       string
	SandboxID string
	Scopes    []string
	AllowCmd  []string
	ExpiresAt time.Time
}

// Conn is one session's dataplane connection. *backend.Remote is one; the broker opens its
// sessions' connections in process.
type Conn interface {
	Dataplane
	// Ended is closed when the broker ends the connection for good (the token was revoked or
	// expired, the sandbox stopped), and EndedErr says why.
	Ended() <-chan struct{}
	EndedErr() *protocol.Error
	Close() error
}

// HTTPConfig configures the Streamable HTTP front end.
type HTTPConfig struct {
	// Open opens the dataplane connection of a session (sessionID) with its verified token, on its
	// first tool call. A refusal that ends the session for good (revoked, expired, the sandbox
	// stopped or gone) ends it.
	Open    func(ctx context.Context, id Identity, sessionID string) (Conn, error)
	Options Options
	// SessionTimeout closes a session idle this long (default 30 minutes).
	SessionTimeout time.Duration
	// MaxSessionsPerToken bounds the sessions one token holds open at once (default
	// DefaultMaxSessionsPerToken).
	MaxSessionsPerToken int
	Logger              *slog.Logger
}

// DefaultMaxSessionsPerToken is HTTPConfig.MaxSessionsPerToken's default: the dataplane's
// connections per credential, which a session's tool calls open one of.
const DefaultMaxSessionsPerToken = 256

// HTTP serves MCP over Streamable HTTP. Each session belongs to one delegation token (its jti): the
// SDK refuses a session's id to any other token. A session's dataplane connection is opened with
// its token on its first tool call, and ends the session when the broker ends the connection (the
// token was revoked or expired, the sandbox stopped).
type HTTP struct {
	cfg     HTTPConfig
	handler http.Handler

	mu sync.Mutex
	// servers are the MCP servers by tool set (scopes and allowlist): sessions of tokens with the
	// same rights share one. The SDK asks for a server on every request, so this is a lookup.
	servers map[string]*sdk.Server
	// sessions are the sessions that made a tool call, by session id.
	sessions map[string]*httpSession
	// ended remembers why sessions the broker ended did end, until their token would have expired,
	// so that the session's next request hears why rather than "session not found".
	ended map[string]endedSession
	// open counts the sessions each token (jti) holds, from the request that opens one until it
	// ends. Each idle session holds the SDK's goroutine and buffers for SessionTimeout: unbounded,
	// one token at its request rate held hundreds of thousands of them.
	open map[string]int
}

// opening is what a session-opening request learns on its way through the SDK: the server that
// took it, whose session it then watches; and whether its place was given back.
type opening struct {
	srv      *sdk.Server
	released atomic.Bool
}

// release gives the request's place among its token's sessions back, once.
func (o *opening) release(h *HTTP, jti string) {
	if o.released.CompareAndSwap(false, true) {
		h.release(jti)
	}
}

type openingKey struct{}

// maxCachedServers bounds the servers kept by tool set; past it a server is built per session.
const maxCachedServers = 256

// maxEnded bounds the ended sessions remembered.
const maxEnded = 10000

type endedSession struct {
	err *protocol.Error
	exp time.Time
}

type identityKey struct{}

// WithIdentity returns a request context carrying id, which HTTP.Serve requires.
func WithIdentity(ctx context.Context, id Identity) context.Context {
	return context.WithValue(ctx, identityKey{}, id)
}

func identityOf(ctx context.Context) (Identity, bool) {
	id, ok := ctx.Value(identityKey{}).(Identity)
	return id, ok
}

const identityExtra = "sbx.identity"

// NewHTTP builds the Streamable HTTP front end.
func NewHTTP(cfg HTTPConfig) *HTTP {
	if cfg.SessionTimeout <= 0 {
		cfg.SessionTimeout = 30 * time.Minute
	}
	if cfg.Options.MaxArgBytes <= 0 {
		cfg.Options.MaxArgBytes = DefaultMaxArgBytes
	}
	if cfg.MaxSessionsPerToken <= 0 {
		cfg.MaxSessionsPerToken = DefaultMaxSessionsPerToken
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	h := &HTTP{cfg: cfg, servers: map[string]*sdk.Server{}, sessions: map[string]*httpSession{}, ended: map[string]endedSession{},
		open: map[string]int{}}
	sh := sdk.NewStreamableHTTPHandler(h.server, &sdk.StreamableHTTPOptions{
		Logger:         cfg.Logger,
		SessionTimeout: cfg.SessionTimeout,
		// Room for the largest arguments a tool takes, so that a call over MaxArgBytes gets a
		// JSON-RPC error that says so rather than a bare 413.
		MaxRequestBodyBytes: int64(cfg.Options.MaxArgBytes) + 64<<10,
	})
	// The SDK binds a session to the user id of the request that opened it and refuses it to any
	// other: the user here is the token's jti. The identity rides along to the tool calls.
	h.handler = auth.RequireBearerToken(func(ctx context.Context, _ string, _ *http.Request) (*auth.TokenInfo, error) {
		id, ok := identityOf(ctx)
		if !ok {
			return nil, auth.ErrInvalidToken
		}
		return &auth.TokenInfo{UserID: id.JTI, Scopes: id.Scopes, Expiration: id.ExpiresAt, Extra: map[string]any{identityExtra: id}}, nil
	}, nil)(sh)
	return h
}

// Serve answers one MCP request whose token the caller verified and put in the context with
// WithIdentity. A request of a session the broker ended is answered with the error that ended it
// (returned, for the caller to write in its own error shape).
func (h *HTTP) Serve(w http.ResponseWriter, r *http.Request) error {
	if sid := r.Header.Get("Mcp-Session-Id"); sid != "" {
		h.mu.Lock()
		e, ok := h.ended[sid]
		h.mu.Unlock()
		if ok {
			return e.err
		}
	}
	if r.Method == http.MethodPost && r.Body != nil {
		// The SDK answers a body that is not JSON, or too large, in plain text: MCP clients read
		// JSON-RPC errors, so these get one here.
		limit := int64(h.cfg.Options.MaxArgBytes) + 64<<10
		body, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
		switch {
		case err != nil:
			return protocol.Errorf(protocol.CodeInvalidArgument, "reading the request: %v", err)
		case int64(len(body)) > limit:
			writeRPCError(w, http.StatusRequestEntityTooLarge, jsonrpc.CodeInvalidRequest,
				fmt.Sprintf("the request is over %d bytes, this endpoint's limit", limit))
			return nil
		case !json.Valid(body):
			writeRPCError(w, http.StatusBadRequest, jsonrpc.CodeParseError, "the request body is not valid JSON")
			return nil
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		rw := &rpcErrors{ResponseWriter: w, body: body}
		defer rw.finish()
		w = rw
	}
	if r.Method == http.MethodPost && r.Header.Get("Mcp-Session-Id") == "" {
		id, _ := identityOf(r.Context())
		if !h.reserve(id.JTI) {
			return protocol.Errorf(protocol.CodeTooManyConnections, "this token holds %d MCP sessions open, the most: end one (DELETE it with its Mcp-Session-Id) or let one idle out (after %s)",
				h.cfg.MaxSessionsPerToken, h.cfg.SessionTimeout)
		}
		o := &opening{}
		r = r.WithContext(context.WithValue(r.Context(), openingKey{}, o))
		w = &openingAnswer{ResponseWriter: w, noSession: func() { o.release(h, id.JTI) }}
		defer h.opened(id.JTI, o, w.Header().Get)
	}
	h.handler.ServeHTTP(w, r)
	return nil
}

// reserve takes a place among jti's open sessions, or says there is none.
func (h *HTTP) reserve(jti string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.open[jti] >= h.cfg.MaxSessionsPerToken {
		return false
	}
	h.open[jti]++
	return true
}

// release gives back a place reserve took.
func (h *HTTP) release(jti string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.open[jti]--; h.open[jti] <= 0 {
		delete(h.open, jti)
	}
}

// opened keeps the place a session-opening request reserved while the session it opened lives,
// and gives it back at once when it opened none.
func (h *HTTP) opened(jti string, o *opening, header func(string) string) {
	sid := header("Mcp-Session-Id")
	if sid != "" && o.srv != nil {
		for ss := range o.srv.Sessions() {
			if ss.ID() == sid {
				go func() {
					ss.Wait()
					o.release(h, jti)
				}()
				return
			}
		}
	}
	o.release(h, jti)
}

// openingAnswer is the answer to a request that may open a session. An answer that opens none (no
// Mcp-Session-Id in its header: server/discover, a refused initialize) gives the request's place
// back as its header is written, not once the handler returns: the SDK's client sends its next
// request (initialize after discover) on the answer, and a token allowed one session was refused
// it while the handler had yet to return.
type openingAnswer struct {
	http.ResponseWriter
	noSession func()
	checked   bool
}

func (a *openingAnswer) check() {
	if !a.checked {
		a.checked = true
		if a.Header().Get("Mcp-Session-Id") == "" {
			a.noSession()
		}
	}
}

func (a *openingAnswer) WriteHeader(status int) { a.check(); a.ResponseWriter.WriteHeader(status) }

func (a *openingAnswer) Write(p []byte) (int, error) { a.check(); return a.ResponseWriter.Write(p) }

func (a *openingAnswer) Flush() {
	a.check()
	if f, ok := a.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (a *openingAnswer) Unwrap() http.ResponseWriter { return a.ResponseWriter }

// requestID is the id of a single JSON-RPC request, or nil.
func requestID(body []byte) any {
	var m struct {
		ID json.RawMessage `json:"id"`
	}
	if json.Unmarshal(body, &m) != nil || len(m.ID) == 0 {
		return nil
	}
	var id any
	if json.Unmarshal(m.ID, &id) != nil {
		return nil
	}
	switch id.(type) {
	case string, float64:
		return m.ID
	}
	return nil
}

// rpcErrors turns the SDK's plain-text refusals of a POST (a payload that is no JSON-RPC message, a
// method it does not handle, a wrong Accept or Content-Type) into JSON-RPC error responses with the
// same status, so that a client reads an error it understands. 404 (the session is gone) stays as
// the transport specifies it: clients act on the status.
type rpcErrors struct {
	http.ResponseWriter
	// body is the request's, whose id a rewritten refusal echoes (found only then: decoding it for
	// every request cost as much as a third of the SDK's own handling of a tool call).
	body    []byte
	rewrite bool
	status  int
	buf     bytes.Buffer
}

func (e *rpcErrors) WriteHeader(status int) {
	ct := e.Header().Get("Content-Type")
	if status >= 400 && status != http.StatusNotFound && !strings.HasPrefix(ct, "application/json") {
		e.rewrite, e.status = true, status
		return
	}
	e.ResponseWriter.WriteHeader(status)
}

func (e *rpcErrors) Write(p []byte) (int, error) {
	if e.rewrite {
		if e.buf.Len() < 4096 {
			e.buf.Write(p)
		}
		return len(p), nil
	}
	return e.ResponseWriter.Write(p)
}

func (e *rpcErrors) Flush() {
	if f, ok := e.ResponseWriter.(http.Flusher); ok && !e.rewrite {
		f.Flush()
	}
}

func (e *rpcErrors) Unwrap() http.ResponseWriter { return e.ResponseWriter }

// finish writes the JSON-RPC error of a rewritten refusal.
func (e *rpcErrors) finish() {
	if !e.rewrite {
		return
	}
	msg := strings.TrimSpace(e.buf.String())
	code := int64(jsonrpc.CodeInvalidRequest)
	// The SDK says so only in its text: a method it does not handle.
	if strings.Contains(msg, "not handled") || strings.Contains(msg, "unsupported") {
		code = jsonrpc.CodeMethodNotFound
	}
	body, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": requestID(e.body), "error": map[string]any{"code": code, "message": msg}})
	e.Header().Del("X-Content-Type-Options")
	e.Header().Set("Content-Type", "application/json")
	e.Header().Del("Content-Length")
	e.ResponseWriter.WriteHeader(e.status)
	e.ResponseWriter.Write(body)
}

// writeRPCError answers a request that never reached MCP with a JSON-RPC error of no id.
func writeRPCError(w http.ResponseWriter, status int, code int64, msg string) {
	body, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": nil, "error": map[string]any{"code": code, "message": msg}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(body)
}

// server is the MCP server for the token of r: one per tool set.
func (h *HTTP) server(r *http.Request) *sdk.Server {
	id, ok := identityOf(r.Context())
	if !ok {
		return nil
	}
	srv := h.serverFor(id)
	if o, ok := r.Context().Value(openingKey{}).(*opening); ok {
		o.srv = srv
	}
	return srv
}

// serverFor is the MCP server of id's tool set.
func (h *HTTP) serverFor(id Identity) *sdk.Server {
	key := strings.Join(id.Scopes, " ") + "\x00" + strings.Join(id.AllowCmd, "\x00")
	h.mu.Lock()
	defer h.mu.Unlock()
	if srv, ok := h.servers[key]; ok {
		return srv
	}
	o := h.cfg.Options
	o.Scopes, o.AllowCmd = id.Scopes, id.AllowCmd
	srv := newServer(h.dataplane, o)
	if len(h.servers) < maxCachedServers {
		h.servers[key] = srv
	}
	return srv
}

// dataplane is the dataplane connection of a tool call's session, opened on its first call with
// the token that opened the session.
func (h *HTTP) dataplane(ctx context.Context, req *sdk.CallToolRequest) (Dataplane, error) {
	ss := req.Session
	var id Identity
	if req.Extra != nil && req.Extra.TokenInfo != nil {
		id, _ = req.Extra.TokenInfo.Extra[identityExtra].(Identity)
	}
	if ss == nil || id.Token == "" {
		return nil, protocol.Errorf(protocol.CodeUnauthenticated, "the MCP request carries no verified delegation token")
	}
	sid := ss.ID()
	h.mu.Lock()
	s, ok := h.sessions[sid]
	if !ok {
		s = &httpSession{h: h, id: id, sid: sid, ss: ss}
		h.sessions[sid] = s
	}
	h.mu.Unlock()
	return s.dataplane(ctx)
}

// httpSession is one session's dataplane connection.
type httpSession struct {
	h   *HTTP
	id  Identity
	sid string
	ss  *sdk.ServerSession

	mu   sync.Mutex
	conn Conn
}

func (s *httpSession) dataplane(ctx context.Context) (Conn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn != nil {
		return s.conn, nil
	}
	r, err := s.h.cfg.Open(ctx, s.id, s.sid)
	if err != nil {
		var pe *protocol.Error
		if errors.As(err, &pe) && endsSession(pe.Code) {
			go s.end(pe)
		}
		s.h.forget(s.sid)
		return nil, err
	}
	s.conn = r
	go s.watch(r)
	return r, nil
}

func (h *HTTP) forget(sid string) {
	h.mu.Lock()
	delete(h.sessions, sid)
	h.mu.Unlock()
}

// endsSession says whether a refusal at connection time ends the session for good.
func endsSession(code string) bool {
	switch code {
	case protocol.CodeTokenRevoked, protocol.CodeTokenExpired, protocol.CodeNotRunning, protocol.CodeNotFound:
		return true
	}
	return false
}

// watch ends the session when the broker ends its dataplane connection, and closes the connection
// when the session ends.
func (s *httpSession) watch(r Conn) {
	defer func() {
		r.Close()
		s.h.forget(s.sid)
	}()
	done := make(chan struct{})
	go func() { s.ss.Wait(); close(done) }()
	select {
	case <-r.Ended():
		s.end(r.EndedErr())
		<-done
	case <-done:
	}
}

// end records why the session ended and closes it: its next request is answered with err.
func (s *httpSession) end(err *protocol.Error) {
	if err == nil {
		return
	}
	err = &protocol.Error{Code: err.Code, Message: "the MCP session ended: " + err.Message, Status: err.Status}
	h := s.h
	now := time.Now()
	h.mu.Lock()
	if len(h.ended) >= maxEnded {
		for k, e := range h.ended {
			if now.After(e.exp) || len(h.ended) >= maxEnded {
				delete(h.ended, k)
			}
		}
	}
	h.ended[s.sid] = endedSession{err: err, exp: s.id.ExpiresAt}
	h.mu.Unlock()
	h.cfg.Logger.Info("mcp session ended", "jti", s.id.JTI, "sandbox_id", s.id.SandboxID, "code", err.Code)
	s.ss.Close()
}
