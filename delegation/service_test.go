package delegation_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// fakeClock is a settable clock far from the real one, so that a wall-clock read shows.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

func newService(t *testing.T, clk *fakeClock) (*delegation.Service, *store.Store, store.Record) {
	t.Helper()
	st := store.New(redistest.Start(t).Client(t))
	ctx := t.Context()
	rec := store.Record{ID: "sb_6f1c2f9e-2b7d-4c57-9a4e-0d7a1c5e8b21", Org: "svc", Name: "s", Template: "default",
		Status: protocol.StatusProvisioning, Node: "n", CreatedAt: clk.Now(), Heartbeat: clk.Now(), TTL: time.Hour}
	rec, _, err := st.CreateOrReuse(ctx, rec, true)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := delegation.LoadOrCreateKeyring(t.TempDir(), clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := delegation.NewService(delegation.ServiceConfig{Keys: keys, Store: st, Token: delegation.Config{Now: clk.Now},
		Log:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		DataplaneURL: func(context.Context, store.Record) (string, error) { return "ws://x", nil }})
	if err != nil {
		t.Fatal(err)
	}
	return svc, st, rec
}

// A sandbox minted for on every run and never listed keeps a bounded token record.
func TestMintPrunesExpiredRecords(t *testing.T) {
	t.Parallel()
	clk := &fakeClock{t: time.Date(2031, 5, 4, 12, 0, 0, 0, time.UTC)}
	svc, st, rec := newService(t, clk)
	ctx := t.Context()
	ttl := int64(60)
	for i := 0; i < 150; i++ {
		if _, err := svc.Mint(ctx, rec, "key:k", protocol.MintRequest{Scopes: []string{"exec"}, TTLSeconds: &ttl}); err != nil {
			t.Fatal(err)
		}
		clk.Add(time.Second)
	}
	all, err := st.Tokens(ctx, rec.Org, rec.ID)
	if n := len(all); err != nil || n > 101 {
		t.Fatalf("token record holds %d entries (%v); want expired ones pruned", len(all), err)
	}
	list, err := svc.List(ctx, rec)
	if err != nil || len(list) != 60 {
		t.Fatalf("unexpired tokens: %d %v; want 60", len(list), err)
	}
}

// Revoking a token that has expired on the broker's clock denies nothing.
func TestRevokeUsesTheBrokerClock(t *testing.T) {
	t.Parallel()
	clk := &fakeClock{t: time.Now().Add(48 * time.Hour)} // ahead of the wall clock
	svc, st, rec := newService(t, clk)
	ctx := t.Context()
	m, err := svc.Mint(ctx, rec, "key:k", protocol.MintRequest{Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	clk.Add(2 * time.Hour) // expired on the broker's clock, not yet on the wall clock
	if _, err := svc.Revoke(ctx, rec, "key:k", m.JTI); err != nil {
		t.Fatal(err)
	}
	if denied, _, err := st.TokensRevoked(ctx, rec.Org, []string{m.JTI}, nil); err != nil || denied[m.JTI] {
		t.Fatal("an expired token was put on the deny-list")
	}
}

// The broker that revokes forgets the token before it announces anything: its next VerifyRecent
// refuses the token though no announcement was followed here and no time passed.
func TestRevokeForgetsAtOnce(t *testing.T) {
	t.Parallel()
	clk := &fakeClock{t: time.Now()}
	svc, st, rec := newService(t, clk)
	ctx := t.Context()
	_, key, err := st.CreateAPIKey(ctx, rec.Org, "owner", clk.Now())
	if err != nil {
		t.Fatal(err)
	}
	actor := delegation.KeySubjectPrefix + key.ID
	for name, revoke := range map[string]func(jti string) error{
		"one": func(jti string) error { _, err := svc.Revoke(ctx, rec, actor, jti); return err },
		"all": func(string) error { _, err := svc.RevokeAll(ctx, rec, actor); return err },
	} {
		if rec, err = st.Get(ctx, rec.Org, rec.ID); err != nil { // the current generation to mint at
			t.Fatal(err)
		}
		m, err := svc.Mint(ctx, rec, actor, protocol.MintRequest{Scopes: []string{"exec"}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := svc.VerifyRecent(ctx, m.Token); err != nil {
			t.Fatalf("revoke %s: live token: %v", name, err)
		}
		if err := revoke(m.JTI); err != nil {
			t.Fatal(err)
		}
		var pe *protocol.Error
		if _, err := svc.VerifyRecent(ctx, m.Token); !errors.As(err, &pe) || pe.Code != protocol.CodeTokenRevoked {
			t.Errorf("revoke %s: VerifyRecent right after: %v, want token_revoked", name, err)
		}
	}
}
