package faults

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// A hung Redis (SIGSTOP: connections open, nothing answers) costs a caller about --redis-timeout
// and a clear 503, not a hang: `sbctl get` says so and exits 6, and a crowd of heartbeats at once
// each fail in about a second instead of queueing behind one stuck call. When Redis thaws, the
// same calls work.
func TestHungRedisAnswers503Fast(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key := r.apiKey("acme")
	b := startBroker(t, r, "n1", "--redis-timeout", "1s")
	c := b.client(key)
	sb := create(t, c, "dev", time.Hour)

	r.freeze()
	defer r.thaw()
	res := b.sbctl(key, "get", "dev")
	// 1 s of --redis-timeout, plus sbctl's start and a loaded machine.
	if res.code != 6 || !strings.Contains(res.stderr, "Redis") || !strings.Contains(res.stderr, "retry") || res.took > 3500*time.Millisecond {
		t.Fatalf("sbctl get with Redis hung: exit %d after %s: %q; want exit 6 in about a second, saying to retry", res.code, res.took, res.stderr)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var slow []time.Duration
	var codes []string
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			_, err := c.Heartbeat(ctx, sb.ID)
			took := time.Since(start)
			var pe *protocol.Error
			mu.Lock()
			defer mu.Unlock()
			if !errors.As(err, &pe) || pe.Code != protocol.CodeUnavailable {
				codes = append(codes, errString(err))
			}
			if took > 3500*time.Millisecond {
				slow = append(slow, took)
			}
		}()
	}
	wg.Wait()
	if len(codes) > 0 || len(slow) > 0 {
		t.Fatalf("20 heartbeats with Redis hung: %d answered other than unavailable (%v), %d took longer than 3.5 s (%v)", len(codes), codes, len(slow), slow)
	}
	r.thaw()
	eventually(t, 10*time.Second, "heartbeats did not work again after Redis thawed", func() bool {
		_, err := c.Heartbeat(context.Background(), sb.ID)
		return err == nil
	})
	if s := get(t, c, sb.ID); s.Status != protocol.StatusRunning {
		t.Fatalf("after the hang: %s (%s)", s.Status, s.StopReason)
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

// A broker down for longer than a lease does not bring the expired sandboxes back with a fresh
// lease when it restarts: they are stopped as ttl_expired, an expiring event before the stopped
// one; a sandbox whose lease still runs comes back running.
func TestRestartDoesNotRenewExpiredLeases(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key := r.apiKey("acme")
	b := startBroker(t, r, "n1", "--sweep-interval", "200ms")
	c := b.client(key)
	short := create(t, c, "short", 3*time.Second)
	longer := create(t, c, "longer", time.Hour)
	b.kill9()
	// The broker stays down until the short lease has run out (on Redis' clock, here the same).
	time.Sleep(time.Until(short.ExpiresAt.Add(500 * time.Millisecond)))
	b.start()
	c = b.client(key)
	eventually(t, 10*time.Second, "the expired sandbox did not end up stopped", func() bool {
		return get(t, c, short.ID).Status == protocol.StatusStopped
	})
	if s := get(t, c, short.ID); s.StopReason != protocol.StopTTLExpired {
		t.Fatalf("the expired sandbox stopped as %q, want ttl_expired", s.StopReason)
	}
	if s := get(t, c, longer.ID); s.Status != protocol.StatusRunning {
		t.Fatalf("the sandbox whose lease runs is %s after the restart", s.Status)
	}
	// The stop's event is written after its record changes: wait for it before reading the order.
	var seq []protocol.Event
	eventually(t, 10*time.Second, "the expired sandbox's stopped event never reached the log", func() bool {
		seq = of(r.orgEvents("acme"), short.ID, protocol.EventExpiring, protocol.EventStopped, protocol.EventResumed)
		return len(of(seq, "", protocol.EventStopped)) > 0
	})
	if len(seq) != 2 || seq[0].Type != protocol.EventExpiring || seq[1].Type != protocol.EventStopped {
		t.Fatalf("events of the expired sandbox: %+v; want expiring then stopped", seq)
	}
}
