package faults

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// Many leases of real sandboxes running out together are stopped on time: none overstays its lease
// by much more than a sweep interval because the others expired with it. Long variant: 200 (their
// stops one after another, the last came 2.5 s after its deadline; 16 at a time, 1.0 s).
func TestMassExpiryStopsOnTime(t *testing.T) {
	t.Parallel()
	n := 30
	if long() {
		n = 200
	}
	r := startRedis(t)
	key := r.apiKey("acme")
	b := startBroker(t, r, "n1", "--sweep-interval", "200ms", "--org-max-running", "0")
	c := b.client(key)
	var ids []string
	for i := 0; i < n; i++ {
		ids = append(ids, create(t, c, fmt.Sprintf("mass-%d", i), time.Hour).ID)
	}
	// One lease length for all, set in a burst: they run out within moments of each other.
	const ttl = 4 * time.Second
	deadlines := map[string]time.Time{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			hb, err := c.SetTTL(context.Background(), id, ttl)
			if err != nil || hb.ExpiresAt == nil {
				t.Errorf("set ttl: %v", err)
				return
			}
			mu.Lock()
			deadlines[id] = *hb.ExpiresAt
			mu.Unlock()
		}()
	}
	wg.Wait()
	eventually(t, ttl+60*time.Second, "the expired sandboxes were not all stopped", func() bool {
		items, err := c.ListAllSandboxes(context.Background(), clientListRunning())
		return err == nil && len(items) == 0
	})
	var over []time.Duration
	for _, id := range ids {
		s := get(t, c, id)
		if s.StopReason != protocol.StopTTLExpired || s.StoppedAt == nil {
			t.Fatalf("%s: %s (%s)", id, s.Status, s.StopReason)
		}
		over = append(over, s.StoppedAt.Sub(deadlines[id]))
	}
	sort.Slice(over, func(i, j int) bool { return over[i] < over[j] })
	t.Logf("%d leases: stopped after their deadline by %s (median) to %s (last)", n, over[len(over)/2], over[len(over)-1])
	if last := over[len(over)-1]; last > 2*time.Second {
		t.Errorf("the last of %d sandboxes was stopped %s after its lease ran out; want within a sweep interval and its stop", n, last)
	}
}
