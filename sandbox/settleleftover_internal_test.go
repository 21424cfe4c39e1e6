package sandbox

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// A resume whose claim landed with every answer lost (so it never starts the sandbox), after a stop
// whose end of the runtime read the record claimed and left the runtime to that start, is settled
// like any start cut short: the record goes back to stopped and the runtime its stop left ends.
// Before, the settle passed over a record with a runtime behind it: provisioning for good, the
// stopped sandbox's processes running, until it was deleted.
func TestASettleEndsTheRuntimeAStopLeftToAStartCutShort(t *testing.T) {
	ctx := t.Context()
	var skew atomic.Int64 // the broker's clock runs ahead by this (ns)
	m, st, _ := testManager(t, func() time.Time { return time.Now().Add(time.Duration(skew.Load())) })
	c := Caller{Org: "o", Actor: "key:k"}
	rec, old, stale := stoppedInRedisOnly(t, m, st, "cut-short")
	// This broker's resume: its claim lands, every answer is lost, and it gives up (no start).
	claimForResume(t, st, rec.ID, m.newClaim())
	m.stopLocal(ctx, stale) // reads it claimed: leaves the runtime to the start
	claimed, err := st.Get(ctx, "o", rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	m.settleIfAbandoned(ctx, claimed) // the first sighting
	skew.Store(int64(settleGrace + time.Second))
	got, settled := m.settleIfAbandoned(ctx, claimed)
	if !settled || got.Status != protocol.StatusStopped {
		t.Fatalf("the settle past its grace: settled %v, the sandbox %s", settled, got.Status)
	}
	select {
	case <-old.Done():
	default:
		t.Fatal("the settled sandbox's runtime, left by its stop, still runs")
	}
	if _, err := m.Resume(ctx, c, rec.ID); err != nil {
		t.Fatalf("a resume after the settle: %v", err)
	}
}
