package delegation_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// Benchmarks of the Redis-backed half of verification (the jti deny-list, the sandbox's token
// generation and the minting API key's state, one pipelined round trip), against a real redis-server on loopback.

func serviceWithToken(b *testing.B) (*delegation.Service, string) {
	st := store.New(redistest.Start(b).Client(b))
	ctx := context.Background()
	rec := store.Record{ID: "sb_6f1c2f9e-2b7d-4c57-9a4e-0d7a1c5e8b21", Org: "bench", Name: "b", Template: "default",
		Status: protocol.StatusProvisioning, Node: "n", CreatedAt: time.Now(), Heartbeat: time.Now(), TTL: time.Hour}
	rec, _, err := st.CreateOrReuse(ctx, rec, true)
	if err != nil {
		b.Fatal(err)
	}
	st.RegisterNode(ctx, "n", "http://127.0.0.1:1")
	keys, err := delegation.LoadOrCreateKeyring(b.TempDir(), time.Now)
	if err != nil {
		b.Fatal(err)
	}
	svc, err := delegation.NewService(delegation.ServiceConfig{Keys: keys, Store: st, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		DataplaneURL: func(context.Context, store.Record) (string, error) { return "ws://x", nil }})
	if err != nil {
		b.Fatal(err)
	}
	_, key, err := st.CreateAPIKey(ctx, rec.Org, "bench", time.Now())
	if err != nil {
		b.Fatal(err)
	}
	m, err := svc.Mint(ctx, rec, delegation.KeySubjectPrefix+key.ID, protocol.MintRequest{Scopes: protocol.Scopes})
	if err != nil {
		b.Fatal(err)
	}
	return svc, m.Token
}

func BenchmarkRevocationCheck(b *testing.B) {
	svc, token := serviceWithToken(b)
	c, err := svc.Verifier().Verify(context.Background(), token)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := svc.CheckRevocation(context.Background(), c); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkVerifyWithRedis(b *testing.B) {
	svc, token := serviceWithToken(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := svc.Verifier().Verify(context.Background(), token); err != nil {
			b.Fatal(err)
		}
	}
}
