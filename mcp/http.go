package mcp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/backend"
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

// HTTPConfig configures the Streamable HTTP front end.
type HTTPConfig struct {
	// DataplaneURL is the dataplane URL of a sandbox on this broker (its own listener, so a session
	// drives exactly the dataplane any delegate would).
	DataplaneURL func(sandboxID string) string
	Options      Options
	// SessionTimeout closes a session idle this long (default 30 minutes).
	SessionTimeout time.Duration
	Logger         *slog.Logger
}

// HTTP serves MCP over Streamable HTTP. Each session belongs to one delegation token (its jti): a
// request with another token's session id is refused, and the session's dataplane connection,
// opened with that token on the first tool call, ends the session when the broker ends the
// connection (the token was revoked or expired, the sandbox stopped).
type HTTP struct {
	cfg     HTTPConfig
	handler http.Handler
	schemas *sdk.SchemaCache

	mu sync.Mutex
	// ended remembers why sessions the broker ended did end, until their token would have expired,
	// so that the session's next request hears why rather than "session not found".
	ended map[string]endedSession
}

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

// NewHTTP builds the Streamable HTTP front end.
func NewHTTP(cfg HTTPConfig) *HTTP {
	if cfg.SessionTimeout <= 0 {
		cfg.SessionTimeout = 30 * time.Minute
	}
	if cfg.Options.MaxArgBytes <= 0 {
		cfg.Options.MaxArgBytes = DefaultMaxArgBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	h := &HTTP{cfg: cfg, ended: map[string]endedSession{}}
	sh := sdk.NewStreamableHTTPHandler(h.newSession, &sdk.StreamableHTTPOptions{
		Logger:         cfg.Logger,
		SessionTimeout: cfg.SessionTimeout,
		// Room for the largest arguments a tool takes, so that a call over MaxArgBytes gets a
		// JSON-RPC error that says so rather than a bare 413.
		MaxRequestBodyBytes: int64(cfg.Options.MaxArgBytes) + 64<<10,
	})
	// The SDK binds a session to the user id of the request that opened it and refuses it to any
	// other: the user here is the token's jti.
	h.handler = auth.RequireBearerToken(func(ctx context.Context, _ string, _ *http.Request) (*auth.TokenInfo, error) {
		id, ok := identityOf(ctx)
		if !ok {
			return nil, auth.ErrInvalidToken
		}
		return &auth.TokenInfo{UserID: id.JTI, Scopes: id.Scopes, Expiration: id.ExpiresAt}, nil
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
	h.handler.ServeHTTP(w, r)
	return nil
}

// newSession builds the server of a new session, for the token of the request that opens it.
func (h *HTTP) newSession(r *http.Request) *sdk.Server {
	id, ok := identityOf(r.Context())
	if !ok {
		return nil
	}
	s := &httpSession{h: h, id: id, sid: newSessionID()}
	o := h.cfg.Options
	o.Scopes, o.AllowCmd = id.Scopes, id.AllowCmd
	s.srv = newServer(s, o, func() string { return s.sid })
	return s.srv
}

func newSessionID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// httpSession is one session's dataplane connection, opened on its first tool call.
type httpSession struct {
	h   *HTTP
	id  Identity
	sid string
	srv *sdk.Server

	mu     sync.Mutex
	remote *backend.Remote
}

// Call runs op on the session's dataplane connection, opening it first.
func (s *httpSession) Call(ctx context.Context, op string, args any) (json.RawMessage, error) {
	r, err := s.dataplane(ctx)
	if err != nil {
		return nil, err
	}
	return r.Call(ctx, op, args)
}

func (s *httpSession) dataplane(ctx context.Context) (*backend.Remote, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.remote != nil {
		return s.remote, nil
	}
	r, err := backend.Dial(ctx, backend.Config{URL: s.h.cfg.DataplaneURL(s.id.SandboxID), Credential: s.id.Token,
		SandboxID: s.id.SandboxID, Reconnects: 1})
	if err != nil {
		var pe *protocol.Error
		if errors.As(err, &pe) && endsSession(pe.Code) {
			s.end(pe)
		}
		return nil, err
	}
	s.remote = r
	var ss *sdk.ServerSession
	for x := range s.srv.Sessions() {
		ss = x
	}
	go s.watch(r, ss)
	return r, nil
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
func (s *httpSession) watch(r *backend.Remote, ss *sdk.ServerSession) {
	defer r.Close()
	if ss == nil {
		return // no session to serve (it closed before its first call got here)
	}
	done := make(chan struct{})
	go func() { ss.Wait(); close(done) }()
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
	for k, e := range h.ended {
		if now.After(e.exp) {
			delete(h.ended, k)
		}
	}
	h.ended[s.sid] = endedSession{err: err, exp: s.id.ExpiresAt}
	h.mu.Unlock()
	h.cfg.Logger.Info("mcp session ended", "jti", s.id.JTI, "sandbox_id", s.id.SandboxID, "code", err.Code)
	for ss := range s.srv.Sessions() {
		ss.Close()
	}
}
