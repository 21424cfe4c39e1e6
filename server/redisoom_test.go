package server_test

import (
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// A Redis at its maxmemory refuses writes ("OOM command not allowed"). Whatever an owner asks then
// that must write gets 503 unavailable saying so (retry later), not a 500, and changes nothing: a
// revoke that fails says so and the token keeps its old state until a revoke succeeds, which then
// holds. Heartbeats keep working (a lease renewal takes no memory to speak of), so a full Redis does
// not stop healthy sandboxes; stops and deletes, which free memory, work too.
func TestFullRedisAnswersUnavailable(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	ctx := t.Context()
	ttl := int64(10)
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev", TTLSeconds: &ttl}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "gone"}); err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, "dev", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	admin := b.Redis.Client(t)
	if err := admin.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	full := true
	defer func() {
		if full {
			admin.ConfigSet(ctx, "maxmemory", "0")
		}
	}()
	calls := []struct {
		what string
		call func() error
	}{
		{"create", func() error {
			_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "other"})
			return err
		}},
		{"mint", func() error {
			_, err := b.Client.Delegate(ctx, "dev", protocol.MintRequest{Scopes: []string{"fs:read"}})
			return err
		}},
		{"revoke", func() error { _, err := b.Client.Revoke(ctx, "dev", m.JTI); return err }},
		{"revoke all", func() error { _, err := b.Client.RevokeAll(ctx, "dev"); return err }},
	}
	for _, c := range calls {
		if err := c.call(); code(err) != protocol.CodeUnavailable {
			t.Errorf("%s with Redis full: %v, want 503 unavailable", c.what, err)
		}
	}
	// A stop and a delete free memory: they work.
	if _, err := b.Client.StopSandbox(ctx, "gone"); err != nil {
		t.Errorf("a stop with Redis full: %v", err)
	}
	if _, err := b.Client.DeleteSandbox(ctx, "gone"); err != nil {
		t.Errorf("a delete with Redis full: %v", err)
	}
	clock.Advance(time.Second)
	if _, err := b.Client.Heartbeat(ctx, "dev"); err != nil {
		t.Errorf("a heartbeat with Redis full: %v", err)
	}
	clock.Advance(time.Duration(ttl-1) * time.Second)
	if _, err := b.Client.Heartbeat(ctx, "dev"); err != nil {
		t.Errorf("a heartbeat with Redis full: %v", err)
	}
	if r, _ := b.Sweeper.SweepOnce(ctx); r.Stopped != 0 {
		t.Errorf("a sweep with Redis full stopped %d", r.Stopped)
	}

	if err := admin.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	full = false
	got, err := b.Client.GetSandbox(ctx, "dev")
	if err != nil || got.Status != protocol.StatusRunning {
		t.Fatalf("after Redis was full: %v %+v, want running", err, got)
	}
	if _, err := b.Client.Revoke(ctx, "dev", m.JTI); err != nil {
		t.Fatal(err)
	}
	if _, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token}); code(err) != protocol.CodeTokenRevoked {
		t.Fatalf("the token revoked once Redis had room: %v, want token_revoked", err)
	}
}

// A Redis that refuses every write for a while (min-replicas-to-write unmet: NOREPLICAS; a failed
// save: MISCONF) fails the owners' heartbeats through no fault of theirs, as an outage does: they
// get 503 unavailable, and once Redis takes writes again the leases that ran out meanwhile get a
// full TTL of grace before any sweep stops them.
func TestRedisRefusingWritesStopsNothing(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	ctx := t.Context()
	ttl := int64(10)
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev", TTLSeconds: &ttl}); err != nil {
		t.Fatal(err)
	}
	admin := b.Redis.Client(t)
	if err := admin.ConfigSet(ctx, "min-replicas-to-write", "1").Err(); err != nil {
		t.Fatal(err)
	}
	refusing := true
	defer func() {
		if refusing {
			admin.ConfigSet(ctx, "min-replicas-to-write", "0")
		}
	}()
	clock.Advance(time.Second)
	if _, err := b.Client.Heartbeat(ctx, "dev"); code(err) != protocol.CodeUnavailable {
		t.Errorf("a heartbeat with Redis refusing writes: %v, want 503 unavailable", err)
	}
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "other"}); code(err) != protocol.CodeUnavailable {
		t.Errorf("a create with Redis refusing writes: %v, want 503 unavailable", err)
	}
	clock.Advance(time.Duration(ttl) * time.Second)
	if r, _ := b.Sweeper.SweepOnce(ctx); r.Stopped != 0 {
		t.Errorf("a sweep with Redis refusing writes stopped %d", r.Stopped)
	}
	if err := admin.ConfigSet(ctx, "min-replicas-to-write", "0").Err(); err != nil {
		t.Fatal(err)
	}
	refusing = false
	// A sweep warns before it stops, a warning window later: three sweeps, within a TTL of the
	// recovery.
	for range 3 {
		if r, err := b.Sweeper.SweepOnce(ctx); err != nil || r.Stopped != 0 {
			t.Fatalf("a sweep within a TTL of Redis taking writes again: %+v %v, want nothing stopped", r, err)
		}
		clock.Advance(time.Duration(ttl) * time.Second * 3 / 10)
	}
	got, err := b.Client.GetSandbox(ctx, "dev")
	if err != nil || got.Status != protocol.StatusRunning {
		t.Fatalf("after Redis refused writes for longer than the lease: %v %+v, want running", err, got)
	}
}

// A revoke that Redis did not take (hung, or refusing writes) says that the token may still work and
// to revoke again, rather than only "retry": a delegate's token must not be taken for dead when it
// is not.
func TestFailedRevokeSaysTheTokenMayStillWork(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(ctx, "dev", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	check := func(what string, err error) {
		t.Helper()
		if code(err) != protocol.CodeUnavailable || !strings.Contains(err.Error(), "may still work") {
			t.Errorf("%s: %v, want 503 unavailable saying the token may still work", what, err)
		}
	}
	// Within the API key's 2 s cache (the mint just read it): the revoke reaches the store.
	b.Redis.Pause()
	_, err = b.Client.Revoke(ctx, "dev", m.JTI)
	b.Redis.Continue()
	check("a revoke with Redis hung", err)

	admin := b.Redis.Client(t)
	if err := admin.ConfigSet(ctx, "min-replicas-to-write", "1").Err(); err != nil {
		t.Fatal(err)
	}
	defer admin.ConfigSet(ctx, "min-replicas-to-write", "0")
	_, err = b.Client.Revoke(ctx, "dev", m.JTI)
	check("a revoke with Redis refusing writes", err)
	_, err = b.Client.RevokeAll(ctx, "dev")
	check("a revoke of all with Redis refusing writes", err)
}
