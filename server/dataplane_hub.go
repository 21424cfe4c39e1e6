package server

import (
	"context"
	"sync"
	"time"

	"github.com/gorilla/websocket"
	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
)

// hub tracks open dataplane connections by sandbox, for revocations announced by any broker and for
// shutdown.
type hub struct {
	mu    sync.Mutex
	conns map[string]map[*dpConn]struct{} // org/sandbox id -> connections
	// open is the one count of dataplane connections, from reserve (before the handshake's checks)
	// until the handler returns: it bounds them, it is the sbx_dataplane_connections gauge, and
	// closeAll waits for it, since http.Server.Shutdown does not wait for hijacked connections and
	// after closeAll the broker closes its event writer, which a connection still ending would emit
	// into.
	open int
	// byOrg and byCred count connections that passed authentication, by org and by credential
	// (admit), against the per-org and per-credential caps.
	byOrg, byCred map[string]int
	closed        bool          // closeAll ran: a connection upgraded later is closed at once
	idle          chan struct{} // closed when open drops to 0 after closeAll
	// rechecking: a recheckAll pass runs; recheckAgain: another was asked for meanwhile.
	rechecking, recheckAgain bool
}

func newHub() *hub {
	return &hub{conns: map[string]map[*dpConn]struct{}{}, byOrg: map[string]int{}, byCred: map[string]int{}}
}

// admit counts an authenticated connection against its org's cap (the org's connections limit; 0:
// none) and its credential's, or refuses it with too_many_connections. release uncounts it, once.
func (h *hub) admit(org, cred string, perOrg, perCred int) (release func(), err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.byCred[cred] >= perCred {
		return nil, protocol.Errorf(protocol.CodeTooManyConnections, "this credential has %d dataplane connections open on this broker, its maximum: close one, or retry later", perCred)
	}
	if perOrg > 0 && h.byOrg[org] >= perOrg {
		return nil, protocol.Errorf(protocol.CodeTooManyConnections, "this org has %d dataplane connections open on this broker, its connections limit: close one, or retry later (broker orgs set-limits %s --connections N raises it)", perOrg, org)
	}
	h.byCred[cred]++
	h.byOrg[org]++
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			if h.byCred[cred]--; h.byCred[cred] <= 0 {
				delete(h.byCred, cred)
			}
			if h.byOrg[org]--; h.byOrg[org] <= 0 {
				delete(h.byOrg, org)
			}
		})
	}, nil
}

// reserve counts a connection being opened, unless max are counted already. release uncounts it,
// once; call it when the connection has ended (or was refused).
func (h *hub) reserve(max int) (release func(), ok bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.open >= max {
		return nil, false
	}
	h.open++
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			if h.open--; h.open == 0 && h.idle != nil {
				close(h.idle)
				h.idle = nil
			}
			h.mu.Unlock()
		})
	}, true
}

// count is the number of connections open or being opened.
func (h *hub) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.open
}

func (h *hub) add(c *dpConn) (remove func()) {
	key := c.org + "/" + c.rec.ID
	h.mu.Lock()
	if h.conns[key] == nil {
		h.conns[key] = map[*dpConn]struct{}{}
	}
	h.conns[key][c] = struct{}{}
	closed := h.closed
	h.mu.Unlock()
	if closed {
		c.shutdown(websocket.CloseGoingAway, "broker shutting down")
	}
	return func() {
		h.mu.Lock()
		delete(h.conns[key], c)
		if len(h.conns[key]) == 0 {
			delete(h.conns, key)
		}
		h.mu.Unlock()
	}
}

// each calls fn for the connections of one sandbox ("org/id"), or of all sandboxes when key is "".
func (h *hub) each(key string, fn func(*dpConn)) {
	h.mu.Lock()
	var list []*dpConn
	for k, set := range h.conns {
		if key == "" || k == key {
			for c := range set {
				list = append(list, c)
			}
		}
	}
	h.mu.Unlock()
	for _, c := range list {
		fn(c)
	}
}

// keyRevoked closes the connections of an owner whose API key was revoked, and those of every
// delegation token that key minted (their verification now fails: Service.CheckRevocation).
func (h *hub) keyRevoked(keyID string) {
	h.each("", func(c *dpConn) {
		switch {
		case c.claims == nil && c.keyID == keyID:
			c.shutdown(protocol.CloseCredentialEnded, protocol.CodeUnauthenticated)
		case c.claims != nil && c.claims.KeyID() == keyID:
			c.shutdown(protocol.CloseCredentialEnded, protocol.CodeTokenRevoked)
		}
	})
}

// recheckAll re-verifies every connection's credential against Redis now, a few at a time, and ends
// those that fail (revocations missed while unsubscribed). It returns at once; a pass already
// running makes it start another once that one ends, not two at once.
func (h *hub) recheckAll() {
	h.mu.Lock()
	h.recheckAgain = h.rechecking
	start := !h.rechecking
	h.rechecking = true
	h.mu.Unlock()
	if !start {
		return
	}
	go func() {
		for {
			var list []*dpConn
			h.each("", func(c *dpConn) { list = append(list, c) })
			sem := make(chan struct{}, hubRecheckAtOnce)
			var wg sync.WaitGroup
			for _, c := range list {
				sem <- struct{}{}
				wg.Add(1)
				go func() {
					defer func() { <-sem; wg.Done() }()
					if code := c.recheck(); code != "" {
						c.shutdown(protocol.CloseCredentialEnded, code)
					}
				}()
			}
			wg.Wait()
			h.mu.Lock()
			again := h.recheckAgain
			h.recheckAgain, h.rechecking = false, again
			h.mu.Unlock()
			if !again {
				return
			}
		}
	}()
}

// hubRecheckAtOnce bounds the Redis reads of a recheckAll pass.
const hubRecheckAtOnce = 16

// revoked applies an announced revocation to the connections it concerns.
func (h *hub) revoked(r delegation.Revocation) {
	h.each(r.Org+"/"+r.SandboxID, func(c *dpConn) { c.revoked(r) })
}

// drain begins a graceful shutdown: connections upgraded from now on are closed at once, open ones
// refuse new requests, and drain waits until those in flight are answered or ctx ends (closeAll
// then cuts the rest).
func (h *hub) drain(ctx context.Context) {
	h.mu.Lock()
	h.closed = true
	h.mu.Unlock()
	type waiting struct {
		drained <-chan struct{}
		ended   <-chan struct{}
	}
	var list []waiting
	h.each("", func(c *dpConn) { list = append(list, waiting{c.stopNew(), c.ctx.Done()}) })
	for _, w := range list {
		select {
		case <-w.drained:
		case <-w.ended: // the connection is ending anyway
		case <-ctx.Done():
			return
		}
	}
}

// closeAll closes every connection (broker shutdown) and waits, up to dpCloseWait, until each has
// sent its close frame and emitted its last events.
func (h *hub) closeAll() {
	h.mu.Lock()
	h.closed = true
	idle := h.idle
	if h.open > 0 && idle == nil {
		idle = make(chan struct{})
		h.idle = idle
	}
	h.mu.Unlock()
	h.each("", func(c *dpConn) { c.shutdown(websocket.CloseGoingAway, "broker shutting down") })
	if idle == nil {
		return
	}
	t := time.NewTimer(dpCloseWait)
	defer t.Stop()
	select {
	case <-idle:
	case <-t.C:
	}
}
