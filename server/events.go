package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/protocol"
)

// sseKeepalive is how often an idle stream gets a comment line, so proxies and load balancers do
// not close it.
const sseKeepalive = 15 * time.Second

func (s *Server) sandboxEvents(c echo.Context) error { return s.streamEvents(c, sandboxOf(c).ID) }

func (s *Server) orgEvents(c echo.Context) error { return s.streamEvents(c, "") }

// streamEvents serves an SSE stream of the org's events, or one sandbox's. Query: backlog=N (start
// with the last N events), follow=false (send what there is and end), last_event_id (for clients
// that cannot set the Last-Event-ID header on their first request).
func (s *Server) streamEvents(c echo.Context, sandboxID string) error {
	opts := events.SubscribeOptions{SandboxID: sandboxID, After: c.Request().Header.Get("Last-Event-ID")}
	if opts.After == "" {
		opts.After = c.QueryParam("last_event_id")
	}
	if b := c.QueryParam("backlog"); b != "" {
		n, err := strconv.Atoi(b)
		if err != nil || n < 0 || n > 500 {
			return protocol.Errorf(protocol.CodeInvalidArgument, "backlog must be a number from 0 to 500")
		}
		opts.Backlog = n
	}
	follow := true
	if f := c.QueryParam("follow"); f != "" {
		var err error
		if follow, err = strconv.ParseBool(f); err != nil {
			return protocol.Errorf(protocol.CodeInvalidArgument, "follow must be true or false")
		}
	}
	ctx := c.Request().Context()
	org := principal(c).Org
	var sub *events.Subscription
	var history []protocol.Event
	var err error
	if follow {
		sub, err = s.eventsHub.Subscribe(ctx, org, opts)
	} else {
		history, err = s.eventsHub.History(ctx, org, opts)
	}
	if err != nil {
		return err
	}
	h := c.Response().Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache, no-transform")
	h.Set("Connection", "keep-alive")
	h.Set("X-Accel-Buffering", "no") // nginx: do not buffer
	c.Response().WriteHeader(http.StatusOK)
	w := c.Response()
	fmt.Fprint(w, "retry: 2000\n\n")
	w.Flush()
	write := func(e protocol.Event) error {
		data, _ := json.Marshal(e)
		if e.ID != "" {
			fmt.Fprintf(w, "event: %s\nid: %s\ndata: %s\n\n", protocol.SSEEventName, e.ID, data)
		} else {
			fmt.Fprintf(w, "event: %s\ndata: %s\n\n", protocol.SSEEventName, data)
		}
		w.Flush()
		return ctx.Err()
	}
	if !follow {
		for _, e := range history {
			if write(e) != nil {
				break
			}
		}
		return nil
	}
	defer sub.Close()
	keepalive := time.NewTicker(sseKeepalive)
	defer keepalive.Stop()
	for {
		select {
		case e := <-sub.C:
			if write(e) != nil {
				return nil
			}
		case <-keepalive.C:
			fmt.Fprint(w, ": keepalive\n\n")
			w.Flush()
		case <-sub.Done():
			// Redis failed under the subscription: end the stream; the client reconnects with
			// Last-Event-ID and loses nothing.
			return nil
		case <-ctx.Done():
			return nil
		case <-s.bgCtx.Done(): // Shutdown
			return nil
		}
	}
}
