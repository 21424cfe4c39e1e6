package server_test

import (
	"strings"
	"testing"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
)

// A sandbox holds at most delegation.MaxLiveTokens unexpired, unrevoked tokens: each keeps its
// metadata in the shared Redis until it expires (up to a day), and every mint past a hundred read
// them all, so one key minting in a loop grew Redis without bound and made each mint slower for
// every org. Past the bound a mint is 429 quota_exceeded saying how to make room, and changes
// nothing; revoking tokens makes room at once; other sandboxes are not affected.
func TestLiveTokensPerSandboxAreBounded(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	for _, name := range []string{"busy", "other"} {
		if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	var last string // the jti of the last token minted for busy
	mint := func(name string) error {
		m, err := b.Client.Delegate(ctx, name, protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
		if err == nil && name == "busy" {
			last = m.JTI
		}
		return err
	}
	for i := range delegation.MaxLiveTokens {
		if err := mint("busy"); err != nil {
			t.Fatalf("mint %d of %d: %v", i+1, delegation.MaxLiveTokens, err)
		}
	}
	busy, err := b.Client.GetSandbox(ctx, "busy")
	if err != nil {
		t.Fatal(err)
	}
	before := b.RDB.HLen(ctx, store.DelegationsKey(b.Org, busy.ID)).Val()
	err = mint("busy")
	if code(err) != protocol.CodeQuotaExceeded || !strings.Contains(err.Error(), "revoke") {
		t.Fatalf("a mint past %d live tokens: %v, want quota_exceeded saying how to make room", delegation.MaxLiveTokens, err)
	}
	if after := b.RDB.HLen(ctx, store.DelegationsKey(b.Org, busy.ID)).Val(); after != before {
		t.Fatalf("a refused mint changed the sandbox's token record: %d entries, then %d", before, after)
	}
	if err := mint("other"); err != nil {
		t.Fatalf("another sandbox: %v", err)
	}
	// Revoking one token makes room for one; revoking them all, for as many as the bound.
	if _, err := b.Client.Revoke(ctx, "busy", last); err != nil {
		t.Fatal(err)
	}
	if err := mint("busy"); err != nil {
		t.Fatalf("a mint after revoking one token: %v", err)
	}
	if err := mint("busy"); code(err) != protocol.CodeQuotaExceeded {
		t.Fatalf("a mint at the bound again: %v, want quota_exceeded", err)
	}
	if _, err := b.Client.RevokeAll(ctx, "busy"); err != nil {
		t.Fatal(err)
	}
	if err := mint("busy"); err != nil {
		t.Fatalf("a mint after revoking the sandbox's tokens: %v", err)
	}
}

// Mints racing at the bound do not pass it together: each read the count below the bound before
// any recorded its token, and all were minted, so a key sending its mints at once held the
// bound plus as many as it had requests in flight.
func TestLiveTokensBoundHoldsForMintsAtOnce(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	sb, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "racy"})
	if err != nil {
		t.Fatal(err)
	}
	const room, racers = 4, 32
	for i := range delegation.MaxLiveTokens - room {
		if _, err := b.Client.Delegate(ctx, "racy", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}}); err != nil {
			t.Fatalf("mint %d: %v", i+1, err)
		}
	}
	start := make(chan struct{})
	errs := make(chan error, racers)
	for range racers {
		go func() {
			<-start
			_, err := b.Client.Delegate(ctx, "racy", protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}})
			errs <- err
		}()
	}
	close(start)
	minted := 0
	for range racers {
		switch err := <-errs; {
		case err == nil:
			minted++
		case code(err) != protocol.CodeQuotaExceeded:
			t.Errorf("a racing mint: %v, want quota_exceeded or a token", err)
		}
	}
	if n := b.RDB.HLen(ctx, store.DelegationsKey(b.Org, sb.Sandbox.ID)).Val(); minted != room || n != delegation.MaxLiveTokens {
		t.Fatalf("%d mints at once with room for %d: %d minted, %d tokens recorded (the bound is %d)", racers, room, minted, n, delegation.MaxLiveTokens)
	}
}
