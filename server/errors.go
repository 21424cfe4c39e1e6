package server

import (
	"context"
	"errors"
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// statusOf is the one table from error code to HTTP status.
var statusOf = map[string]int{
	protocol.CodeInvalidJSON: 400, protocol.CodeInvalidArgument: 400, protocol.CodeInvalidName: 400,
	protocol.CodeInvalidTTL: 400, protocol.CodeInvalidTag: 400, protocol.CodeInvalidStatus: 400,
	protocol.CodeInvalidCursor: 400, protocol.CodeInvalidEventID: 400, protocol.CodeInvalidScope: 400, protocol.CodeUnknownTemplate: 400, protocol.CodeIsolationUnavailable: 400,
	protocol.CodeUnauthenticated: 401,
	protocol.CodeTokenMalformed:  401, protocol.CodeTokenTooLarge: 401, protocol.CodeTokenAlgorithm: 401,
	protocol.CodeTokenType: 401, protocol.CodeTokenUnknownKey: 401, protocol.CodeTokenSignature: 401,
	protocol.CodeTokenExpired: 401, protocol.CodeTokenNotYet: 401, protocol.CodeTokenIssuedAt: 401,
	protocol.CodeTokenIssuer: 401, protocol.CodeTokenAudience: 401, protocol.CodeTokenClaims: 401,
	protocol.CodeTokenRevoked: 401, protocol.CodeTokenSandbox: 403,
	protocol.CodeDelegateForbidden: 403, protocol.CodeForbidden: 403, protocol.CodeScopeDenied: 403,
	protocol.CodeCommandNotAllowed: 403,
	protocol.CodeNotFound:          404, protocol.CodeRouteNotFound: 404,
	protocol.CodeMethodNotAllowed: 405,
	protocol.CodeNameConflict:     409, protocol.CodeInvalidState: 409, protocol.CodeSandboxFailed: 409,
	protocol.CodeNotRunning: 409, protocol.CodeWrongNode: 409,
	protocol.CodeTooLarge: 413, protocol.CodeTooManyRequests: 429, protocol.CodeTooManyConnections: 429,
	protocol.CodeQuotaExceeded: 429, protocol.CodeRateLimited: 429,
	protocol.CodeInternal: 500, protocol.CodeUnavailable: 503, protocol.CodeCapacity: 503,
}

// apiError maps any error to the one JSON error shape, for REST answers and dataplane answers alike.
// Protocol errors pass through (their messages are written for people), and so do the domain errors
// whose text is written for callers; anything else is an internal cause that is logged, never sent.
func apiError(err error) (int, *protocol.Error) {
	var pe *protocol.Error
	var he *echo.HTTPError
	switch {
	case errors.As(err, &pe):
		status := statusOf[pe.Code]
		if status == 0 {
			status = http.StatusBadRequest
		}
		return status, &protocol.Error{Code: pe.Code, Message: pe.Message}
	case errors.As(err, &he):
		switch he.Code {
		case http.StatusNotFound:
			return 404, protocol.Errorf(protocol.CodeRouteNotFound, "no such route: see docs/openapi.yaml for the API")
		case http.StatusMethodNotAllowed:
			return 405, protocol.Errorf(protocol.CodeMethodNotAllowed, "method not allowed on this route: its Allow header lists the ones it takes (docs/openapi.yaml)")
		case http.StatusRequestEntityTooLarge:
			return 413, protocol.Errorf(protocol.CodeTooLarge, "request body too large")
		case http.StatusUnauthorized:
			return 401, protocol.Errorf(protocol.CodeUnauthenticated, "missing or invalid credentials")
		}
		return he.Code, protocol.Errorf(protocol.CodeInvalidArgument, "%v", he.Message)
	case errors.Is(err, context.DeadlineExceeded):
		return 503, protocol.Errorf(protocol.CodeUnavailable, "the broker timed out; retry")
	case store.RefusesWrites(err):
		return 503, protocol.Errorf(protocol.CodeUnavailable, "the broker's Redis refuses writes: %s; nothing was changed, retry later", store.WriteRefusal(err))
	case isRedisDown(err):
		return 503, protocol.Errorf(protocol.CodeUnavailable, "the broker cannot reach its Redis; retry shortly")
	}
	return 500, protocol.Errorf(protocol.CodeInternal, "internal error; the broker logged it under this request id")
}

func isRedisDown(err error) bool {
	var ne interface{ Timeout() bool }
	return errors.Is(err, store.ErrClientClosed) || errors.As(err, &ne) || store.Unavailable(err)
}

// isRevocation reports a request that revokes delegation tokens.
func isRevocation(c echo.Context) bool {
	p := c.Path()
	return c.Request().Method == http.MethodDelete && (p == "/v1/sandboxes/:ref/delegations" || p == "/v1/sandboxes/:ref/delegations/:jti")
}

// errorHandler is echo's HTTPErrorHandler: every error answer goes through here.
func (s *Server) errorHandler(err error, c echo.Context) {
	if c.Response().Committed {
		return
	}
	if c.Path() == uploadRoute {
		refuseBody(c)
	}
	status, pe := apiError(err)
	pe.RequestID = requestID(c)
	if status == http.StatusServiceUnavailable && isRevocation(c) {
		// "Retry" alone lets an owner believe a delegate is cut off when it is not.
		pe.Message += " (the revocation may not have happened: the token may still work; revoke again until this succeeds)"
	}
	if status >= 500 {
		s.log.Error("request failed", "request_id", pe.RequestID, "route", c.Path(), "err", err)
	} else {
		c.Set(ctxErrCode, pe.Code)
	}
	if status == http.StatusTooManyRequests {
		if c.Response().Header().Get("Retry-After") == "" { // the dataplane sets its own
			c.Response().Header().Set("Retry-After", retryAfter(err))
		}
		s.countRefusal(c, err)
	}
	// A HEAD gets the same headers; net/http drops the body.
	c.JSON(status, protocol.ErrorBody{Error: *pe})
}
