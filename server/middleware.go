package server

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// Context keys. Values are read only through the typed getters below.
const (
	ctxRequestID = "sbx.request_id"
	ctxPrincipal = "sbx.principal"
	ctxSandbox   = "sbx.sandbox"
	ctxErrCode   = "sbx.err_code"
	// ctxJTI is the delegation token a request authenticated with, for its access log line.
	ctxJTI = "sbx.jti"
	// ctxBodyWait is the body wait set on the request (boundBody), for the message when it passes.
	ctxBodyWait = "sbx.body_wait"
)

// Principal is who is calling.
type Principal struct {
	Org string
	// KeyID is set for owners (an org API key).
	KeyID string
}

// Actor names the principal in events and records.
func (p Principal) Actor() string { return "key:" + p.KeyID }

func requestID(c echo.Context) string { s, _ := c.Get(ctxRequestID).(string); return s }

func principal(c echo.Context) Principal { p, _ := c.Get(ctxPrincipal).(Principal); return p }

func sandboxOf(c echo.Context) store.Record { r, _ := c.Get(ctxSandbox).(store.Record); return r }

var requestIDRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// withRequestID takes a well-formed X-Request-Id from the caller (so ids follow a request across
// services) or makes one, and echoes it back.
func withRequestID(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		id := c.Request().Header.Get(echo.HeaderXRequestID)
		if !requestIDRE.MatchString(id) {
			id = uuid.NewString()
		}
		c.Set(ctxRequestID, id)
		c.Response().Header().Set(echo.HeaderXRequestID, id)
		return next(c)
	}
}

// oneAuthorization refuses a request with more than one Authorization header (RFC 9110 allows one)
// on the routes that read one (guardAuth's): a proxy in front of the broker may have checked another
// than the one the broker would read. The MCP endpoint checks it itself, to answer in JSON-RPC.
func oneAuthorization(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		r := c.Request()
		if !strings.HasPrefix(r.URL.Path, "/v1/") && r.URL.Path != "/metrics" || c.Path() == mcpRoute {
			return next(c)
		}
		if err := singleAuthorization(r); err != nil {
			return err
		}
		return next(c)
	}
}

// singleAuthorization is oneAuthorization's check.
func singleAuthorization(r *http.Request) error {
	if n := len(r.Header.Values(echo.HeaderAuthorization)); n > 1 {
		return protocol.Errorf(protocol.CodeInvalidArgument, "the request has %d Authorization headers: send one Authorization header", n)
	}
	return nil
}

// withAccessLog logs each request. Successes are debug (the heartbeat route alone does thousands a
// second); client errors info; server errors were already logged with their cause.
func (s *Server) withAccessLog(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		start := time.Now()
		err := next(c)
		if err != nil {
			c.Error(err)
		}
		status := c.Response().Status
		level := slog.LevelDebug
		if status >= 400 && status < 500 {
			level = slog.LevelInfo
		}
		route := s.routeLabel(c.Path())
		s.metrics.observe(c.Request().Method, route, status, time.Since(start))
		if status >= 500 || !s.log.Enabled(c.Request().Context(), level) {
			return nil
		}
		attrs := []any{"request_id", requestID(c), "method", clipForLog(c.Request().Method), "route", route,
			"status", status, "duration_ms", float64(time.Since(start).Microseconds()) / 1000}
		if p := principal(c); p.Org != "" {
			attrs = append(attrs, "org", p.Org, "key_id", p.KeyID)
		}
		if r := sandboxOf(c); r.ID != "" {
			attrs = append(attrs, "sandbox_id", r.ID)
		}
		if jti, _ := c.Get(ctxJTI).(string); jti != "" {
			attrs = append(attrs, "jti", jti)
		}
		if code, ok := c.Get(ctxErrCode).(string); ok {
			attrs = append(attrs, "code", code)
		}
		s.log.Log(c.Request().Context(), level, "request", attrs...)
		return nil
	}
}

// routeLabel is path if it is one of the server's routes, else otherLabel: what a caller puts in a
// path or method never becomes a metric label or a log field of unbounded size.
func (s *Server) routeLabel(path string) string {
	if s.routes[path] {
		return path
	}
	return otherLabel
}

// maxLoggedField bounds a caller-chosen string (an unknown method name) in a log line.
const maxLoggedField = 32

// clipForLog cuts a caller-chosen string to maxLoggedField bytes of valid UTF-8, marking the cut.
func clipForLog(v string) string {
	if len(v) <= maxLoggedField {
		return strings.ToValidUTF8(v, "?")
	}
	return strings.ToValidUTF8(v[:maxLoggedField], "?") + "...(" + strconv.Itoa(len(v)) + " bytes)"
}

// bearer extracts the credential of an Authorization: Bearer header.
func bearer(r *http.Request) string {
	h := r.Header.Get(echo.HeaderAuthorization)
	scheme, cred, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(cred)
}

var errNoCredentials = protocol.Errorf(protocol.CodeUnauthenticated,
	"missing credentials: send Authorization: Bearer <API key> (sbctl reads it from --api-key, SBX_API_KEY or its config file)")

// requireOwner authenticates an org API key.
func (s *Server) requireOwner(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		cred := bearer(c.Request())
		if cred == "" {
			return errNoCredentials
		}
		if !store.LooksLikeAPIKey(cred) {
			// A delegation token is told apart from garbage, so an agent server learns why it is
			// refused; but only by what the token itself says (Check reads no revocation state), so
			// that a revoked token, one of a deleted sandbox and a live one get the same answer here.
			if _, err := s.delegation.Verifier().Check(cred); err != nil {
				return err
			}
			return protocol.Errorf(protocol.CodeDelegateForbidden,
				"a delegation token may only use its sandbox's dataplane; this route needs the owner's API key")
		}
		p, err := s.ownerKey(c.Request().Context(), cred)
		if err != nil {
			return err
		}
		c.Set(ctxPrincipal, p)
		return next(c)
	}
}

// ownerKey authenticates an org API key (cred looks like one: store.LooksLikeAPIKey) and returns
// its owner. The REST routes and the dataplane both authenticate owners here.
func (s *Server) ownerKey(ctx context.Context, cred string) (Principal, error) {
	p, _, err := s.ownerKeyAt(ctx, cred)
	return p, err
}

// ownerKeyAt is ownerKey, and says when the key's record that answered was read (keyCache's clock).
func (s *Server) ownerKeyAt(ctx context.Context, cred string) (Principal, time.Time, error) {
	k, readAt, err := s.apiKeys.authenticateAt(ctx, cred)
	if errors.Is(err, store.ErrBadKey) {
		return Principal{}, readAt, protocol.Errorf(protocol.CodeUnauthenticated, "invalid or revoked API key: check the key sent (sbctl: --api-key, SBX_API_KEY or its config file), or get one from the broker's operator (broker keys create)")
	}
	if err != nil {
		return Principal{}, readAt, err
	}
	if err := s.limitCredential(ctx, k.Org, "key:"+k.ID); err != nil {
		return Principal{}, readAt, err
	}
	return Principal{Org: k.Org, KeyID: k.ID}, readAt, nil
}

// loadSandbox resolves the :ref path parameter (an id or a name) in the caller's org.
func (s *Server) loadSandbox(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		rec, err := s.sandboxes.Get(c.Request().Context(), principal(c).Org, c.Param("ref"))
		if err != nil {
			return err
		}
		c.Set(ctxSandbox, rec)
		return next(c)
	}
}
