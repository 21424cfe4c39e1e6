package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// sseKeepalive is how often an idle stream gets a comment line, so proxies and load balancers do
// not close it.
const sseKeepalive = 15 * time.Second

// sseRecheckEvery re-reads the stream's API key, a backstop for key revocation announcements lost
// while a broker was disconnected from Redis (normally a stream ends at once: streams.keyRevoked).
const sseRecheckEvery = 30 * time.Second

// streams tracks open SSE streams by the API key that opened them, so that revoking the key ends
// them on every broker (each follows store.APIKeyRevokedChannel), and bounds how many one key may
// hold open: each is a connection and a file descriptor, and one tenant's key opening them at its
// request rate would otherwise take the broker's descriptors from every org in minutes.
type streams struct {
	mu     sync.Mutex
	byKey  map[string]map[chan struct{}]struct{}
	perKey int
	// rechecking: a recheckStreams pass runs; recheckAgain: another was asked for meanwhile.
	rechecking, recheckAgain bool
}

func newStreams(perKey int) *streams {
	return &streams{byKey: map[string]map[chan struct{}]struct{}{}, perKey: perKey}
}

// add registers a stream of keyID, or refuses it with too_many_connections when the key holds its
// maximum; revoked is closed when the key is revoked. remove unregisters it.
func (ss *streams) add(keyID string) (revoked <-chan struct{}, remove func(), err error) {
	ch := make(chan struct{})
	ss.mu.Lock()
	if len(ss.byKey[keyID]) >= ss.perKey {
		ss.mu.Unlock()
		return nil, nil, protocol.Errorf(protocol.CodeTooManyConnections, "this API key has %d event streams open on this broker, its maximum: close one, or retry later", ss.perKey)
	}
	if ss.byKey[keyID] == nil {
		ss.byKey[keyID] = map[chan struct{}]struct{}{}
	}
	ss.byKey[keyID][ch] = struct{}{}
	ss.mu.Unlock()
	return ch, func() {
		ss.mu.Lock()
		if _, ok := ss.byKey[keyID][ch]; ok {
			delete(ss.byKey[keyID], ch)
			if len(ss.byKey[keyID]) == 0 {
				delete(ss.byKey, keyID)
			}
		}
		ss.mu.Unlock()
	}, nil
}

// keyRevoked ends every stream of keyID.
func (ss *streams) keyRevoked(keyID string) {
	ss.mu.Lock()
	set := ss.byKey[keyID]
	delete(ss.byKey, keyID)
	ss.mu.Unlock()
	for ch := range set {
		close(ch)
	}
}

// recheckStreams ends the streams of every key that Redis says is gone or revoked: key revocations
// announced while this broker was not subscribed were missed (Server.revocationsMissed). It returns
// at once; passes run one at a time, a pass asked for while one runs once after it (as
// hub.recheckAll), so that a storm of resubscriptions while Redis is slow costs at most two passes
// of reads, not one goroutine and one pass per resubscription.
func (s *Server) recheckStreams() {
	ss := s.streams
	ss.mu.Lock()
	ss.recheckAgain = ss.rechecking
	start := !ss.rechecking
	ss.rechecking = true
	ss.mu.Unlock()
	if start {
		go s.recheckStreamsPasses()
	}
}

func (s *Server) recheckStreamsPasses() {
	ss := s.streams
	for {
		ss.mu.Lock()
		ids := make([]string, 0, len(ss.byKey))
		for id := range ss.byKey {
			ids = append(ids, id)
		}
		ss.mu.Unlock()
		for _, id := range ids {
			if !s.keyStillValid(s.bgCtx, id) {
				ss.keyRevoked(id)
			}
		}
		ss.mu.Lock()
		again := ss.recheckAgain
		ss.recheckAgain, ss.rechecking = false, again
		ss.mu.Unlock()
		if !again {
			return
		}
	}
}

// keyStillValid reads a key's record from Redis (not the cache): false only when it is gone or
// revoked, so that a Redis error never ends a stream.
func (s *Server) keyStillValid(ctx context.Context, keyID string) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	k, err := s.store.APIKeyByID(ctx, keyID)
	return !errors.Is(err, store.ErrNotFound) && (err != nil || k.RevokedAt.IsZero())
}

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
	// A HEAD gets the headers of a stream that would follow, and ends: it takes no stream slot.
	head := c.Request().Method == http.MethodHead
	if head {
		follow = false
	}
	ctx := c.Request().Context()
	org := principal(c).Org
	var sub *events.Subscription
	var history []protocol.Event
	var err error
	// A followed stream takes one of its key's slots before it subscribes, and is registered before
	// the key is read again, so that a revocation landing between the request's authentication
	// (possibly from the cache) and here is seen by one or the other.
	keyID := principal(c).KeyID
	var revoked <-chan struct{}
	if follow {
		var remove func()
		if revoked, remove, err = s.streams.add(keyID); err != nil {
			c.Response().Header().Set("Retry-After", dpRetryAfter)
			return err
		}
		defer remove()
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
	if head {
		return nil
	}
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
	if !s.keyStillValid(ctx, keyID) {
		return nil
	}
	keepalive := time.NewTicker(sseKeepalive)
	defer keepalive.Stop()
	recheck := time.NewTicker(sseRecheckEvery)
	defer recheck.Stop()
	for {
		select {
		case <-revoked:
			// The key was revoked: end the stream. The client's reconnection gets 401.
			return nil
		case <-recheck.C:
			if !s.keyStillValid(ctx, keyID) {
				return nil
			}
		case e := <-sub.C:
			// A select picks at random among ready cases: an event queued before the revocation
			// must not go out after it.
			select {
			case <-revoked:
				return nil
			default:
			}
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
