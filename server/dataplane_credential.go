package server

import (
	"context"
	"errors"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// What ends a dataplane connection from outside its requests: its credential's expiry, revocation
// (announced, re-checked periodically, or re-checked once the cached answer that admitted it is
// stale) and its sandbox's end.

// watch closes the connection when the credential expires or the sandbox's processes end (stop,
// delete, a crash), and re-verifies the credential periodically.
func (c *dpConn) watch() {
	var expiry <-chan time.Time
	if c.claims != nil {
		t := time.NewTimer(c.claims.ExpiresAt.Time.Sub(c.s.now()))
		defer t.Stop()
		expiry = t.C
	}
	recheck := time.NewTicker(dpRecheckEvery)
	defer recheck.Stop()
	for {
		select {
		case <-c.ctx.Done():
			return
		case <-expiry:
			c.shutdown(protocol.CloseCredentialEnded, protocol.CodeTokenExpired)
			return
		case <-c.rt.Done():
			c.shutdown(protocol.CloseSandboxGone, protocol.CodeNotRunning)
			return
		case <-recheck.C:
			if code := c.recheck(); code != "" {
				c.shutdown(protocol.CloseCredentialEnded, code)
				return
			}
		}
	}
}

// recheck re-verifies the credential against Redis; it answers the code that ends it, or "".
func (c *dpConn) recheck() string {
	ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
	defer cancel()
	if c.claims != nil {
		var pe *protocol.Error
		if err := c.s.delegation.CheckRevocation(ctx, c.claims); errors.As(err, &pe) {
			return pe.Code
		}
		return ""
	}
	if k, err := c.s.store.APIKeyByID(ctx, c.keyID); errors.Is(err, store.ErrNotFound) || (err == nil && !k.RevokedAt.IsZero()) {
		return protocol.CodeUnauthenticated
	}
	return ""
}

// revoked is called by the hub for a revocation announced by any broker.
func (c *dpConn) revoked(r delegation.Revocation) {
	if c.claims == nil {
		return
	}
	if (r.JTI != "" && r.JTI == c.claims.ID) || (r.Gen > 0 && c.claims.Gen < r.Gen) {
		c.shutdown(protocol.CloseCredentialEnded, protocol.CodeTokenRevoked)
	}
}

// reconfirmKey re-reads the API key of an owner admitted on the key cache's answer once that answer
// is keyCacheTTL old, as reconfirm does for a token: a revocation this broker was not told of ends
// the connection within about keyCacheTTL. Owners' connections are few: each reads Redis itself.
func (c *dpConn) reconfirmKey() {
	t := time.NewTimer(c.keyReadAt.Add(keyCacheTTL).Sub(c.s.apiKeys.now()))
	defer t.Stop()
	select {
	case <-c.ctx.Done():
		return
	case <-t.C:
	}
	if code := c.recheck(); code != "" {
		c.shutdown(protocol.CloseCredentialEnded, code)
	}
}

// reconfirm re-checks a token admitted on an answer of the token cache, read before its checks
// began (up to delegation.RecentTTL earlier), once that answer is RecentTTL old, until an answer
// read since the checks began says it is live: a revocation this broker was not told of (its
// announcement missed) that landed between that read and the admission ends the connection within
// about RecentTTL, not at the 30 s re-check. The reads go through the cache, so a storm of
// connections with one token adds one read, not one each. A state that cannot be read leaves the
// connection to its periodic re-check, as there.
func (c *dpConn) reconfirm() {
	a := c.admission
	for a.ReadAt.Before(c.checkedFrom) {
		t := time.NewTimer(a.ReadAt.Add(delegation.RecentTTL).Sub(c.s.now()))
		select {
		case <-c.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
		next, err := c.s.delegation.Reconfirm(ctx, a, c.claims)
		cancel()
		var pe *protocol.Error
		if errors.As(err, &pe) {
			c.shutdown(protocol.CloseCredentialEnded, pe.Code)
			return
		}
		if err != nil || !next.ReadAt.After(a.ReadAt) {
			return
		}
		a = next
	}
}
