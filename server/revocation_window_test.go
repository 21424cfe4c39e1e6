package server_test

import (
	"testing"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
)

// A revocation that lands between a connection's checks (its token's state read, or remembered
// from the last delegation.RecentTTL) and its place in the hub, where announced revocations find
// open connections, still ends it at once: the announcement passed it by, so the connection itself
// sees that a revocation came while it was being opened and reads the token's state again.
// Before, it stayed open until its periodic re-check, 30 s later, serving the revoked token.
func TestRevocationWhileOpeningEndsTheConnection(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "window"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, res.Sandbox.ID, protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	// A connection open before the revocation: its closing says the announcement reached the hub.
	before := dialRaw(t, m.Sandbox.DataplaneURL, m.Token)
	closed := closeWatch(before)
	ended, err := server.AuthorizeThenOpen(b.Server, m.Token, res.Sandbox.ID, func() {
		if _, err := b.Client.Revoke(ctx, res.Sandbox.ID, m.JTI); err != nil {
			t.Fatal(err)
		}
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatal("the connection open before the revocation is still open 5 s after it")
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("a connection whose token was revoked while it was being opened is still open 5 s after the revocation was announced")
	}
}

// A connection admitted on the token cache's answer (read up to delegation.RecentTTL before) by a
// broker that was not told of a revocation made since (here: written to Redis with no
// announcement, as by a broker whose announcement this one missed) reads the token's state again
// once that answer is RecentTTL old, and ends: within about RecentTTL of the revocation. Before, it
// lived until its periodic re-check, 30 s later.
func TestConnectionAdmittedOnACachedAnswerIsReconfirmed(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "cached"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, res.Sandbox.ID, protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	url := m.Sandbox.DataplaneURL
	dialRaw(t, url, m.Token) // reads the token's state: cached for RecentTTL from here
	if err := b.Store.DenyToken(ctx, b.Org, m.JTI, time.Hour); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	late := dialRaw(t, url, m.Token) // admitted on the cached answer
	if since := time.Since(revoked); since >= delegation.RecentTTL {
		t.Skipf("the second upgrade came %s after the revocation, past the cache's bound: the test did not test", since)
	}
	late.ws.SetReadDeadline(time.Time{})
	select {
	case info := <-closeWatch(late):
		if info.code != protocol.CloseCredentialEnded || info.reason != protocol.CodeTokenRevoked {
			t.Errorf("closed with %d %q, want %d %s", info.code, info.reason, protocol.CloseCredentialEnded, protocol.CodeTokenRevoked)
		}
		t.Logf("closed %s after the revocation", info.at.Sub(revoked).Round(time.Millisecond))
	case <-time.After(delegation.RecentTTL + 5*time.Second):
		t.Fatalf("a connection admitted on a cached answer is still open %s after its token was revoked", time.Since(revoked).Round(time.Second))
	}
}

// The same for an owner's connection admitted on the API key cache's answer: a key revoked with no
// announcement reaching this broker ends the connection within about the cache's bound (2 s).
// Before, it lived until its periodic re-check, 30 s later.
func TestOwnerConnectionAdmittedOnACachedKeyIsReconfirmed(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	ctx := t.Context()
	owner, ownerKey := keyClient(t, b)
	res, err := owner.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "cached-key"}) // caches the key
	if err != nil {
		t.Fatal(err)
	}
	if err := b.RDB.HSet(ctx, store.APIKeyKey(ownerKey), "revoked", time.Now().UnixMilli()).Err(); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	late := dialRaw(t, res.Sandbox.DataplaneURL, owner.APIKey()) // admitted on the cached key
	if since := time.Since(revoked); since >= 2*time.Second {
		t.Skipf("the upgrade came %s after the revocation, past the cache's bound: the test did not test", since)
	}
	late.ws.SetReadDeadline(time.Time{})
	select {
	case info := <-closeWatch(late):
		if info.code != protocol.CloseCredentialEnded || info.reason != protocol.CodeUnauthenticated {
			t.Errorf("closed with %d %q, want %d %s", info.code, info.reason, protocol.CloseCredentialEnded, protocol.CodeUnauthenticated)
		}
		t.Logf("closed %s after the revocation", info.at.Sub(revoked).Round(time.Millisecond))
	case <-time.After(7 * time.Second):
		t.Fatalf("an owner connection admitted on a cached key is still open %s after the key was revoked", time.Since(revoked).Round(time.Second))
	}
}
