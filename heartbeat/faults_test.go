package heartbeat_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// createLeased creates n running sandboxes with a ttl-second lease and returns their names.
func createLeased(t *testing.T, c *client.Client, prefix string, n int, ttlSeconds int64) []string {
	t.Helper()
	var names []string
	for i := range n {
		name := fmt.Sprintf("%s-%d", prefix, i)
		if _, err := c.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name, TTLSeconds: ttl(ttlSeconds)}); err != nil {
			t.Fatal(err)
		}
		names = append(names, name)
	}
	return names
}

// heartbeatAll heartbeats every name and returns how many failed.
func heartbeatAll(t *testing.T, c *client.Client, names []string) int {
	t.Helper()
	failed := 0
	for _, n := range names {
		if _, err := c.Heartbeat(t.Context(), n); err != nil {
			failed++
		}
	}
	return failed
}

func statuses(t *testing.T, c *client.Client, names []string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, n := range names {
		sb, err := c.GetSandbox(t.Context(), n)
		if err != nil {
			t.Fatal(err)
		}
		out[sb.Status+"/"+sb.StopReason]++
	}
	return out
}

// expiringBeforeStopped checks that a sandbox's stopped event (if any) follows an expiring one.
func expiringBeforeStopped(t *testing.T, c *client.Client, name string) {
	t.Helper()
	warned := false
	for _, e := range history(t, c, name) {
		switch e.Type {
		case protocol.EventExpiring:
			warned = true
		case protocol.EventStopped:
			if !warned {
				t.Fatalf("%s was stopped with no expiring event first", name)
			}
			return
		}
	}
}

// A Redis outage longer than the leases, while the owners kept heartbeating (and failing): when
// Redis returns, nothing is stopped; every lease gets a full TTL from the recovery; only owners that
// then stay silent lose their sandboxes, each warned first.
func TestRedisOutageStopsNothing(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	names := createLeased(t, b.Client, "out", 6, 4)
	if failed := heartbeatAll(t, b.Client, names); failed != 0 {
		t.Fatalf("%d heartbeats failed before the outage", failed)
	}

	b.Redis.Stop(t)
	for range 3 { // the owners keep trying, over three times the lease
		clock.Advance(5 * time.Second)
		if failed := heartbeatAll(t, b.Client, names); failed != len(names) {
			t.Fatalf("%d of %d heartbeats failed with Redis down", failed, len(names))
		}
	}
	b.Redis.Restart(t)
	recovered := clock.Now().Truncate(time.Millisecond) // the store keeps milliseconds
	waitRedis(t, b)

	// The sweeper runs before any owner is back: it stops nothing.
	r, err := b.Sweeper.SweepOnce(t.Context())
	if err != nil || r.Stopped != 0 || r.Warned != 0 {
		t.Fatalf("first sweep after the outage: %+v %v", r, err)
	}
	for _, n := range names {
		sb, err := b.Client.GetSandbox(t.Context(), n)
		if err != nil || sb.Status != protocol.StatusRunning || sb.ExpiresAt == nil || sb.ExpiresAt.Before(recovered.Add(4*time.Second)) {
			t.Fatalf("%s after the outage: %v %+v, want running with a full lease from %s", n, err, sb, recovered)
		}
	}
	// Just short of the grace (and past the warning window), still nothing stops.
	clock.Advance(3900 * time.Millisecond)
	if r, err := b.Sweeper.SweepOnce(t.Context()); err != nil || r.Stopped != 0 {
		t.Fatalf("sweep within the grace: %+v %v", r, err)
	}
	// Owners that heartbeat again keep their sandboxes; the silent ones are stopped, warned first.
	alive, silent := names[:3], names[3:]
	if failed := heartbeatAll(t, b.Client, alive); failed != 0 {
		t.Fatalf("%d heartbeats failed after the outage", failed)
	}
	for range 3 { // silent ones: warned at +3.9 s, stoppable 2 s (half the lease) later, at +5.9 s
		clock.Advance(time.Second)
		if _, err := b.Sweeper.SweepOnce(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if got := statuses(t, b.Client, alive); got["running/"] != len(alive) {
		t.Fatalf("heartbeated owners: %v", got)
	}
	if got := statuses(t, b.Client, silent); got["stopped/"+protocol.StopTTLExpired] != len(silent) {
		t.Fatalf("silent owners: %v", got)
	}
	for _, n := range silent {
		eventually(t, func() bool { return len(types(history(t, b.Client, n), protocol.EventStopped)) == 1 })
		expiringBeforeStopped(t, b.Client, n)
	}
}

// Two brokers on one Redis: broker A sees the outage (its owners' heartbeats fail), broker B does
// not (it made no call meanwhile) and sweeps first when Redis returns. B may warn, never stop; A's
// grace, granted as soon as it reaches Redis again, then gives every lease a full TTL.
func TestRedisOutageTwoBrokers(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	a := servertest.New(t, servertest.Options{Now: clock.Now, Node: "node-a"})
	b := servertest.New(t, servertest.Options{Now: clock.Now, Node: "node-b", Redis: a.Redis})
	names := createLeased(t, a.Client, "two", 4, 4)

	a.Redis.Stop(t)
	clock.Advance(10 * time.Second)
	if failed := heartbeatAll(t, a.Client, names); failed != len(names) {
		t.Fatalf("%d of %d heartbeats failed with Redis down", failed, len(names))
	}
	a.Redis.Restart(t)

	r, err := b.Sweeper.SweepOnce(t.Context())
	if err != nil || r.Stopped != 0 {
		t.Fatalf("broker B's sweep right after the outage: %+v %v", r, err)
	}
	recovered := clock.Now().Truncate(time.Millisecond) // the store keeps milliseconds
	// Any call through A (here an owner's get) shows A that Redis is back: it grants the grace.
	if _, err := a.Client.GetSandbox(t.Context(), names[0]); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		eventually(t, func() bool {
			sb, err := a.Client.GetSandbox(t.Context(), n)
			return err == nil && sb.ExpiresAt != nil && !sb.ExpiresAt.Before(recovered.Add(4*time.Second))
		})
	}
	clock.Advance(3 * time.Second) // past B's warnings' window, within A's grace
	if r, err := b.Sweeper.SweepOnce(t.Context()); err != nil || r.Stopped != 0 {
		t.Fatalf("broker B's sweep within the grace: %+v %v", r, err)
	}
	if got := statuses(t, a.Client, names); got["running/"] != len(names) {
		t.Fatalf("after the outage: %v", got)
	}
}

// The lease clock is Redis': a broker whose own clock is an hour ahead neither stops sandboxes
// early when it sweeps nor cuts leases short when it renews them, and one an hour behind does not
// make them expire at once.
func TestSkewedBrokerClock(t *testing.T) {
	t.Parallel()
	ahead := func() time.Time { return time.Now().Add(time.Hour) }
	behind := func() time.Time { return time.Now().Add(-time.Hour) }
	a := servertest.New(t, servertest.Options{Now: ahead, RedisTime: true, Node: "node-ahead"})
	b := servertest.New(t, servertest.Options{Now: behind, RedisTime: true, Node: "node-behind", Redis: a.Redis})
	names := createLeased(t, a.Client, "skew", 3, 120)
	onB := b.NewClient(a.Org)
	if failed := heartbeatAll(t, onB, names); failed != 0 {
		t.Fatalf("%d heartbeats through the late broker failed", failed)
	}
	for _, br := range []*servertest.Broker{a, b} {
		if r, err := br.Sweeper.SweepOnce(t.Context()); err != nil || r.Stopped != 0 || r.Warned != 0 {
			t.Fatalf("sweep by %s: %+v %v", br.Manager.Node(), r, err)
		}
	}
	redisNow, err := a.RDB.Time(t.Context()).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		sb, err := a.Client.GetSandbox(t.Context(), n)
		if err != nil || sb.Status != protocol.StatusRunning || sb.ExpiresAt == nil {
			t.Fatalf("%s: %v %+v", n, err, sb)
		}
		if d := sb.ExpiresAt.Sub(redisNow); d < 110*time.Second || d > 121*time.Second {
			t.Fatalf("%s: lease ends %s from Redis' now, want about 120s", n, d)
		}
	}
}

// A lease shorter than the expiry warning (1m by default) is not warned about on every heartbeat:
// the window is half the lease, so an owner heartbeating at a sane pace sees none, and a silent one
// sees exactly one before its stop.
func TestShortLeaseWarnsOncePerExpiry(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "short", TTLSeconds: ttl(10)}); err != nil {
		t.Fatal(err)
	}
	for range 10 { // a heartbeat every 3 s, a sweep every second
		for range 3 {
			clock.Advance(time.Second)
			if _, err := b.Sweeper.SweepOnce(t.Context()); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := b.Client.Heartbeat(t.Context(), "short"); err != nil {
			t.Fatal(err)
		}
	}
	for range 20 { // then silence
		clock.Advance(time.Second)
		if _, err := b.Sweeper.SweepOnce(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, func() bool { return len(types(history(t, b.Client, "short"), protocol.EventStopped)) == 1 })
	if n := len(types(history(t, b.Client, "short"), protocol.EventExpiring)); n != 1 {
		t.Fatalf("%d expiring events for one expiry, want 1", n)
	}
	expiringBeforeStopped(t, b.Client, "short")
}

// waitRedis waits until the broker's client reaches Redis again (go-redis probes a refused address
// once a second before it dials again).
func waitRedis(t *testing.T, b *servertest.Broker) {
	t.Helper()
	if err := wait.For(10*time.Second, func() error { return b.RDB.Ping(t.Context()).Err() }); err != nil {
		t.Fatalf("the broker did not reach the restarted Redis within 10s: %v", err)
	}
}

// A broker restart does not renew leases that ran out while it was down: those sandboxes stay
// stopped as ttl_expired, with an expiring event before the stopped one; a sandbox whose lease
// still runs comes back running.
func TestRestartDoesNotRenewExpiredLeases(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "lapsed", TTLSeconds: ttl(5)}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "leased", TTLSeconds: ttl(60)}); err != nil {
		t.Fatal(err)
	}
	b.Stop()
	clock.Advance(10 * time.Second)
	b2 := servertest.New(t, servertest.Options{Now: clock.Now, DataDir: b.DataDir, Redis: b.Redis})

	lapsed, err := b2.Client.GetSandbox(t.Context(), "lapsed")
	if err != nil || lapsed.Status != protocol.StatusStopped || lapsed.StopReason != protocol.StopTTLExpired {
		t.Fatalf("a sandbox whose lease ran out during the restart: %v %+v", err, lapsed)
	}
	rec, _ := b2.Store.Get(t.Context(), b2.Org, "lapsed")
	if _, err := b2.Manager.Instance(rec); err == nil {
		t.Fatal("the restarted broker runs a sandbox whose lease ran out")
	}
	leased, err := b2.Client.GetSandbox(t.Context(), "leased")
	if err != nil || leased.Status != protocol.StatusRunning {
		t.Fatalf("a sandbox whose lease still runs: %v %+v", err, leased)
	}
	eventually(t, func() bool { return len(types(history(t, b2.Client, "lapsed"), protocol.EventStopped)) == 1 })
	expiringBeforeStopped(t, b2.Client, "lapsed")
	// It resumes as any stopped sandbox does.
	if rs, err := b2.Client.ResumeSandbox(t.Context(), "lapsed"); err != nil || rs.Status != protocol.StatusRunning {
		t.Fatalf("resume: %v %+v", err, rs)
	}
}
