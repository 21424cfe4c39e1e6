package server

import (
	"net/http"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/heartbeat"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
)

// orphans is the sweep's dry run: the org's sandboxes that look abandoned, with reasons.
func (s *Server) orphans(c echo.Context) error {
	list, err := heartbeat.Orphans(c.Request().Context(), s.store, principal(c).Org)
	if err != nil {
		return err
	}
	out := protocol.OrphansResponse{Items: make([]protocol.Orphan, 0, len(list))}
	for _, o := range list {
		out.Items = append(out.Items, protocol.Orphan{Sandbox: sandbox.View(o.Record), Reasons: o.Reasons})
	}
	return c.JSON(http.StatusOK, out)
}

func (s *Server) now() time.Time {
	if s.clock != nil {
		return s.clock()
	}
	return time.Now()
}
