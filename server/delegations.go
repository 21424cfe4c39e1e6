package server

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
)

func (s *Server) mintDelegation(c echo.Context) error {
	var req protocol.MintRequest
	if err := decodeJSON(c, &req); err != nil {
		return err
	}
	rec := sandboxOf(c)
	searchPath, known := s.sandboxes.SearchPath(rec)
	if err := delegation.CheckSearchPath(req.Scopes, req.AllowCmd, searchPath, known); err != nil {
		return err
	}
	res, err := s.delegation.Mint(c.Request().Context(), rec, principal(c).Actor(), req)
	if err != nil {
		return err
	}
	// Minting is an owner call: it renews a running sandbox's lease.
	if rec.Status == protocol.StatusRunning {
		s.sandboxes.Heartbeat(c.Request().Context(), rec.Org, rec.ID)
	}
	s.log.Info("delegation minted", "request_id", requestID(c), "sandbox_id", rec.ID, "jti", res.JTI,
		"scopes", req.Scopes, "allow_cmd", req.AllowCmd, "expires_at", res.ExpiresAt)
	return c.JSON(http.StatusCreated, res)
}

func (s *Server) listDelegations(c echo.Context) error {
	items, err := s.delegation.List(c.Request().Context(), sandboxOf(c))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, protocol.ListDelegationsResponse{Items: items})
}

func (s *Server) revokeDelegation(c echo.Context) error {
	rec := sandboxOf(c)
	jti := c.Param("jti")
	r, err := s.delegation.Revoke(c.Request().Context(), rec, principal(c).Actor(), jti)
	if err != nil {
		return err
	}
	s.hub.revoked(r) // at once, whatever becomes of the announcement
	s.log.Info("delegation revoked", "request_id", requestID(c), "sandbox_id", rec.ID, "jti", jti)
	return c.JSON(http.StatusOK, protocol.RevokeResponse{SandboxID: rec.ID, JTI: jti})
}

func (s *Server) revokeAllDelegations(c echo.Context) error {
	rec := sandboxOf(c)
	r, err := s.delegation.RevokeAll(c.Request().Context(), rec, principal(c).Actor())
	if err != nil {
		return err
	}
	s.hub.revoked(r) // at once, whatever becomes of the announcement
	s.log.Info("all delegations revoked", "request_id", requestID(c), "sandbox_id", rec.ID)
	return c.JSON(http.StatusOK, protocol.RevokeResponse{SandboxID: rec.ID, All: true})
}

func (s *Server) introspect(c echo.Context) error {
	var req protocol.IntrospectRequest
	if err := decodeJSON(c, &req); err != nil {
		return err
	}
	if req.Token == "" {
		return protocol.Errorf(protocol.CodeInvalidArgument, "token is required")
	}
	res, err := s.delegation.Introspect(c.Request().Context(), principal(c).Org, req.Token)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, res)
}

func (s *Server) jwks(c echo.Context) error {
	b, err := s.keys.JWKS()
	if err != nil {
		return err
	}
	c.Response().Header().Set("Cache-Control", "public, max-age=60")
	return c.Blob(http.StatusOK, "application/jwk-set+json", b)
}
