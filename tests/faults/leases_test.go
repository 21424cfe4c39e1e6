package faults

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
)

// beater heartbeats refs through c every period until stopped, counting failures by code.
type beater struct {
	stopOnce sync.Once
	done     chan struct{}
	wg       sync.WaitGroup
	failures atomic.Int64
	mu       sync.Mutex
	codes    map[string]int
}

func heartbeatEvery(c *client.Client, period time.Duration, refs ...string) *beater {
	b := &beater{done: make(chan struct{}), codes: map[string]int{}}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err := c.Heartbeats(ctx, refs)
			cancel()
			if err != nil {
				b.failures.Add(1)
				var pe *protocol.Error
				code := "other"
				if errors.As(err, &pe) {
					code = pe.Code
				}
				b.mu.Lock()
				b.codes[code]++
				b.mu.Unlock()
			}
			select {
			case <-b.done:
				return
			case <-tick.C:
			}
		}
	}()
	return b
}

func (b *beater) stop() { b.stopOnce.Do(func() { close(b.done) }); b.wg.Wait() }

// A Redis outage longer than a lease, while the owners heartbeat all along (their beats fail with
// 503 unavailable): when Redis returns nothing is stopped; every lease gets a full TTL from the
// recovery; owners that then stay silent lose their sandboxes as ttl_expired, each with an
// expiring event first. Events an agent caused during the outage (file writes over a dataplane
// connection opened before it) are in the stream afterwards, in order.
// Long variant: a 3-minute outage with 30 s leases, as in issue 11.
func TestRedisOutageStopsNothing(t *testing.T) {
	t.Parallel()
	ttl, outage, n := 3*time.Second, 7*time.Second, 2
	if long() {
		ttl, outage, n = 30*time.Second, 3*time.Minute, 5
	}
	r := startRedis(t)
	key := r.apiKey("acme")
	b := startBroker(t, r, "n1", "--sweep-interval", "200ms", "--redis-timeout", "1s")
	c := b.client(key)

	var healthy, silent []string
	for i := 0; i < n; i++ {
		healthy = append(healthy, create(t, c, fmt.Sprintf("healthy-%d", i), ttl).ID)
		silent = append(silent, create(t, c, fmt.Sprintf("silent-%d", i), ttl).ID)
	}
	all := append(append([]string{}, healthy...), silent...)
	everyone := heartbeatEvery(c, ttl/6, all...)
	defer everyone.stop()

	// An agent's connection, opened before the outage, keeps working on the files.
	mint, err := c.Delegate(context.Background(), healthy[0], protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	agent, err := backend.Dial(context.Background(), backend.Config{URL: mint.Sandbox.DataplaneURL, Credential: mint.Token})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()

	r.stop()
	outageEnds := time.Now().Add(outage)
	writes := 0
	for time.Now().Before(outageEnds) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := agent.Write(ctx, protocol.WriteArgs{Path: fmt.Sprintf("/workspace/during-%03d.txt", writes), Content: "x"})
		cancel()
		if err != nil {
			t.Fatalf("a dataplane write during the Redis outage: %v", err)
		}
		writes++
		time.Sleep(outage / 20)
	}
	if everyone.failures.Load() == 0 {
		t.Fatal("no heartbeat failed during the outage: was Redis down?")
	}
	everyone.mu.Lock()
	if everyone.codes[protocol.CodeUnavailable] == 0 {
		t.Errorf("heartbeats during the outage failed with %v, want unavailable (503)", everyone.codes)
	}
	everyone.mu.Unlock()
	r.start()
	recovered := time.Now()
	// The owners of the silent sandboxes go away as Redis returns; the others keep beating.
	everyone.stop()
	owners := heartbeatEvery(c, ttl/6, healthy...)
	defer owners.stop()

	status := func(id string) protocol.Sandbox {
		return get(t, c, id)
	}
	// The grace: nothing is stopped within a TTL of the recovery.
	for time.Since(recovered) < ttl*8/10 {
		for _, id := range all {
			if s := status(id); s.Status != protocol.StatusRunning {
				t.Fatalf("%s is %s (%s) %s after Redis returned from a %s outage: a store outage must not stop sandboxes",
					id, s.Status, s.StopReason, time.Since(recovered).Round(time.Millisecond), outage)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Then the silent ones are stopped as ttl_expired; the healthy ones never.
	eventually(t, 3*ttl+10*time.Second, "the silent owners' sandboxes were not stopped", func() bool {
		for _, id := range silent {
			if status(id).Status != protocol.StatusStopped {
				return false
			}
		}
		return true
	})
	for _, id := range silent {
		s := status(id)
		if s.StopReason != protocol.StopTTLExpired {
			t.Errorf("%s stopped as %q, want ttl_expired", id, s.StopReason)
		}
		if s.StoppedAt != nil && s.StoppedAt.Before(recovered.Add(ttl-300*time.Millisecond)) {
			t.Errorf("%s stopped %s after the recovery, before a full TTL (%s) of grace", id, s.StoppedAt.Sub(recovered), ttl)
		}
	}
	for _, id := range healthy {
		if s := status(id); s.Status != protocol.StatusRunning {
			t.Errorf("%s, heartbeated all along, is %s (%s)", id, s.Status, s.StopReason)
		}
	}

	// A stop's event is written after its record changes: wait for them before reading the order.
	var evs []protocol.Event
	eventually(t, 10*time.Second, "the silent sandboxes' stopped events never reached the log", func() bool {
		evs = r.orgEvents("acme")
		for _, id := range silent {
			if len(of(evs, id, protocol.EventStopped)) == 0 {
				return false
			}
		}
		return true
	})
	for _, id := range silent {
		seq := of(evs, id, protocol.EventExpiring, protocol.EventStopped)
		if len(seq) != 2 || seq[0].Type != protocol.EventExpiring || seq[1].Type != protocol.EventStopped {
			t.Errorf("%s: want one expiring event, then the stop; got %+v", id, seq)
		}
	}
	for _, id := range healthy {
		// Beating every ttl/6, an owner never comes within the warning window (half a short lease).
		if st := of(evs, id, protocol.EventStopped, protocol.EventExpiring); len(st) > 0 {
			t.Errorf("%s, heartbeated all along, got %+v", id, st)
		}
	}
	// Every write of the outage has its event, in order, with no gap.
	var paths []string
	for _, e := range of(evs, healthy[0], protocol.EventFileWritten) {
		paths = append(paths, e.Path)
	}
	if len(paths) != writes {
		t.Fatalf("%d file_written events for %d writes during the outage", len(paths), writes)
	}
	for i, p := range paths {
		if want := fmt.Sprintf("/workspace/during-%03d.txt", i); p != want {
			t.Fatalf("event %d is for %s, want %s (out of order)", i, p, want)
		}
	}
	if g := of(evs, "", protocol.EventGap); len(g) > 0 {
		t.Errorf("gap events though the buffer held everything: %+v", g)
	}
}
