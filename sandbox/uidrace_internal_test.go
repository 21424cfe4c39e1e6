package sandbox

import (
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// A resume whose start waited for the lifecycle lock while a delete of the same sandbox took it
// (Delete moves a provisioning record to deleting) finds the sandbox destroyed: its record purged,
// its files gone, its uid given back. The start must not take that uid again: nothing would ever
// give it back, and the next create Redis hands it to would hand it back to the dead sandbox.
func TestAStartThatLosesTheLockToADeleteHoldsNoUID(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	m.cfg.UIDs = store.UIDRange{First: 239400, Last: 239403}
	c := Caller{Org: "o", Actor: "key:k"}
	rec, _, err := m.Create(ctx, c, CreateRequest{Name: "r"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Stop(ctx, c, rec.ID, protocol.StopRequested); err != nil {
		t.Fatal(err)
	}
	// The resume's claim lands; its start has not taken the lifecycle lock yet.
	claimed, err := st.Transition(ctx, "o", rec.ID, store.Transition{From: []string{protocol.StatusStopped},
		To: protocol.StatusProvisioning, Claim: m.newClaim()})
	if err != nil {
		t.Fatal(err)
	}
	h0 := m.hostedFor(rec.ID, rec.Org) // the start's entry, looked up before the delete's destroy
	if _, err := m.Delete(ctx, c, rec.ID); err != nil {
		t.Fatal(err)
	}
	wantHeld(t, m, "the delete", map[string]int{})
	m.mu.Lock()
	m.host[rec.ID] = h0 // as the start found it (it looked it up first)
	m.mu.Unlock()
	if _, err := m.start(ctx, c, claimed); err == nil {
		t.Fatal("the start of a deleted sandbox succeeded")
	}
	m.mu.Lock()
	delete(m.host, rec.ID) // the destroy had removed it: only the start's copy holds it
	m.mu.Unlock()
	m.Reconcile(ctx)
	wantHeld(t, m, "the start that lost the lock to the delete, then a reconcile", map[string]int{})
}
