package server

import (
	"encoding/json"
	"io"
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// mcpFront is the Streamable HTTP MCP endpoint. Each session's tool calls run on an in-process
// dataplane connection opened with the caller's delegation token (mcp_dataplane.go): the checks of
// an upgrade, the hub, admit and the op table's handlers, so scopes, the command allowlist, limits,
// revocation and events apply exactly as for any delegate, without a loopback WebSocket.
type mcpFront struct {
	http *mcp.HTTP
}

func (s *Server) newMCP() {
	s.mcp = &mcpFront{}
	s.mcp.http = mcp.NewHTTP(mcp.HTTPConfig{Open: s.openLocal, Logger: s.log, MaxSessionsPerToken: s.dpLimits.PerCredential})
}

var errMCPNoToken = protocol.Errorf(protocol.CodeUnauthenticated,
	"missing credentials: send Authorization: Bearer <delegation token> (sbctl delegate REF, or the credential of sbctl run-config REF)")

var errMCPOwnerKey = protocol.Errorf(protocol.CodeForbidden,
	"the MCP endpoint takes a delegation token, not an API key: mint one with sbctl delegate REF --scope ..., or run sbctl mcp REF for a local MCP client")

// mcpEndpoint authenticates GET, POST and DELETE /v1/sandboxes/{id}/mcp with a delegation token
// of that sandbox and hands the request to the MCP front end. A request that opens a session is
// checked against revocations too, as an upgrade is (delegation.Service.VerifyRecent); a session's
// later requests are checked by signature and expiry alone, a hash once the token passed
// (CheckRecent: no Redis round trip), because the session's dataplane connection ends it on
// revocation. Both share the broker's one cache of tokens, which revocations evict.
func (s *Server) mcpEndpoint(c echo.Context) error {
	if err := s.mcpServe(c); err != nil {
		s.mcpError(c, err)
	}
	return nil
}

// mcpError answers a refusal as a JSON-RPC error response (what an MCP client reads and shows), with
// the HTTP status and the stable code of every other answer: data.code is the code of the REST
// error shape, and the message starts with it.
func (s *Server) mcpError(c echo.Context, err error) {
	status, pe := apiError(err)
	pe.RequestID = requestID(c)
	if status >= 500 {
		s.log.Error("request failed", "request_id", pe.RequestID, "route", c.Path(), "err", err)
	} else {
		c.Set(ctxErrCode, pe.Code)
	}
	if status == http.StatusTooManyRequests {
		c.Response().Header().Set("Retry-After", retryAfter(err))
		s.countRefusal(c, err)
	}
	id := json.RawMessage("null")
	if c.Request().Method == http.MethodPost {
		var m struct {
			ID json.RawMessage `json:"id"`
		}
		if json.NewDecoder(io.LimitReader(c.Request().Body, 64<<10)).Decode(&m) == nil && validRPCID(m.ID) {
			id = m.ID
		}
	}
	c.JSON(status, mcpErrorBody{JSONRPC: "2.0", ID: id, Error: mcpRPCError{Code: mcpErrorCode, Message: pe.Code + ": " + pe.Message,
		Data: mcpErrorData{Code: pe.Code, RequestID: pe.RequestID}}})
}

// mcpErrorCode is the JSON-RPC error code of every refusal of the MCP endpoint (the range -32000 to
// -32099 is the implementation's); data.code says which.
const mcpErrorCode = -32001

type mcpErrorBody struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Error   mcpRPCError     `json:"error"`
}

type mcpRPCError struct {
	Code    int          `json:"code"`
	Message string       `json:"message"`
	Data    mcpErrorData `json:"data"`
}

type mcpErrorData struct {
	Code      string `json:"code"`
	RequestID string `json:"request_id,omitempty"`
}

// validRPCID is a JSON-RPC id worth echoing: a string or a number.
func validRPCID(id json.RawMessage) bool {
	if len(id) == 0 || len(id) > 256 {
		return false
	}
	var v any
	if json.Unmarshal(id, &v) != nil {
		return false
	}
	switch v.(type) {
	case string, float64:
		return true
	}
	return false
}

func (s *Server) mcpServe(c echo.Context) error {
	r := c.Request()
	if err := singleAuthorization(r); err != nil {
		return err
	}
	cred := bearer(r)
	if cred == "" {
		return errMCPNoToken
	}
	if store.LooksLikeAPIKey(cred) {
		return errMCPOwnerKey
	}
	ctx := r.Context()
	var claims *delegation.Claims
	var err error
	if r.Header.Get("Mcp-Session-Id") == "" {
		claims, err = s.delegation.VerifyRecent(ctx, cred)
	} else {
		claims, err = s.delegation.CheckRecent(cred)
	}
	if err != nil {
		return err
	}
	if err := s.limitCredential(ctx, claims.Org, "token:"+claims.ID); err != nil {
		return err
	}
	// A token reaches its own sandbox only; any other ref gets the answer of a missing one.
	if ref := c.Param("ref"); ref != claims.Sbx {
		return sandbox.NotFound(ref)
	}
	id := mcp.Identity{Token: cred, JTI: claims.ID, SandboxID: claims.Sbx, Scopes: claims.Scopes(), AllowCmd: claims.Cmd,
		ExpiresAt: claims.ExpiresAt.Time}
	return s.mcp.http.Serve(c.Response(), r.WithContext(mcp.WithIdentity(ctx, id)))
}
