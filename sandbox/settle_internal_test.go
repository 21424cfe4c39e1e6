package sandbox

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// A settle decided on a read of the record that is no longer current must not settle what the
// record is now. The interleaving: a reconcile pass (or a waitSettled) reads a resume cut short
// (claim C1) and finds its grace over; before it takes the lifecycle lock, another waiter settles
// the record (stopped) and a new resume claims it (C2, held in the registry) and has not yet taken
// the lock for its start. The first settle's checks are all of C1 (not held), the lock is free,
// nothing runs: only the claim tells the record it would settle from the one it read.
func TestASettleOnAStaleReadLeavesANewerStartAlone(t *testing.T) {
	ctx := t.Context()
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	m, st, _ := testManager(t, func() time.Time { return time.Unix(0, now.Load()) })
	advance := func() { now.Add(int64(time.Hour)) }
	created := time.Now()
	rec := store.Record{ID: protocol.NewSandboxID(), Org: "o", Name: "s", Template: "default", Provider: "dir", Node: "n1",
		Status: protocol.StatusStopped, TTL: time.Hour, CreatedAt: created, Heartbeat: created, StartedAt: created}
	if _, _, err := st.CreateOrReuse(ctx, rec, false); err != nil {
		t.Fatal(err)
	}
	resume := func(claim string) {
		t.Helper()
		if _, err := st.Transition(ctx, "o", rec.ID, store.Transition{From: []string{protocol.StatusStopped}, To: protocol.StatusProvisioning, Claim: claim}); err != nil {
			t.Fatal(err)
		}
	}
	// A resume whose every answer was lost: provisioning, claimed by C1, held by no start.
	resume(m.newClaim())
	stale, err := st.Get(ctx, "o", rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	settle := func(r store.Record) (store.Record, bool) {
		m.settleIfAbandoned(ctx, r) // first seen
		advance()
		return m.settleIfAbandoned(ctx, r)
	}
	if got, ok := settle(stale); !ok || got.Status != protocol.StatusStopped {
		t.Fatalf("the resume cut short was not settled: %v %s", ok, got.Status)
	}
	// A new resume in flight: registered, its claim written, its start not yet under the lock.
	c2 := m.newClaim()
	defer m.holdStart(c2)()
	resume(c2)
	if got, ok := settle(stale); ok || got.Status != protocol.StatusProvisioning {
		t.Errorf("a settle decided on the stale read settled the new resume in flight: %v %s", ok, got.Status)
	}
	if got, err := st.Get(ctx, "o", rec.ID); err != nil || got.Status != protocol.StatusProvisioning || got.Claim != c2 {
		t.Fatalf("the resume in flight's record is %s (claim %q, err %v), want provisioning by its claim", got.Status, got.Claim, err)
	}
}
