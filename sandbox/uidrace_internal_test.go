package sandbox

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
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
	rec := createdAndStopped(t, m, c, "r")
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

// createBlocks is a provider whose Create says it began (entered) and waits for proceed before it
// creates the files: a slow disk, an image being unpacked.
type createBlocks struct {
	provider.Provider
	entered, proceed chan struct{}
}

func (p *createBlocks) Create(ctx context.Context, spec provider.Spec) error {
	p.entered <- struct{}{}
	<-p.proceed
	return p.Provider.Create(ctx, spec)
}

// Redis loses its data while a create on this broker is starting its sandbox (its record made, its
// files not yet), and the reconcile runs then: it finds no record and no files. The create's start
// still holds the uid (it may run the template's setup as it for minutes): the reconcile must not
// give it up, or the next create, which Redis hands the same uid, runs as it too.
func TestTheReconcileKeepsTheUIDOfACreateStartingWhenRedisLostItsData(t *testing.T) {
	ctx := t.Context()
	m, _, srv := testManager(t, time.Now)
	prov := &createBlocks{Provider: m.cfg.Provider, entered: make(chan struct{}), proceed: make(chan struct{})}
	m.cfg.Provider = prov
	m.cfg.UIDs = store.UIDRange{First: 239500, Last: 239503}
	c := Caller{Org: "o", Actor: "key:k"}
	done := make(chan error, 1)
	go func() {
		_, _, err := m.Create(ctx, c, CreateRequest{Name: "a"})
		done <- err
	}()
	<-prov.entered
	uids := heldUIDs(m)
	if len(uids) != 1 {
		t.Fatalf("uids held while the create starts: %v", uids)
	}
	if err := srv.Client(t).FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	m.Reconcile(ctx)
	got := heldUIDs(m)
	close(prov.proceed) // later creates' Create goes straight through
	<-done              // its record is gone: it fails, its runtime ends
	if !maps.Equal(got, uids) {
		t.Fatalf("after the reconcile, while the create still starts: the broker holds %v, want %v", got, uids)
	}
}

// A create drew its uid (in Redis too) and the broker died before the record was made, or Redis
// lost every answer to the create and the record never landed: the sandbox has an index entry, a
// uid in Redis, and no record nor files. Finding so (at the next start, or the reconcile of an
// unsettled create) gives the uid back in Redis too, not only in the broker's table: nothing else
// ever would, and each such create would take one uid out of the range for good.
func TestACreateCutShortBeforeItsRecordGivesItsUIDBackInRedis(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	m.cfg.UIDs = store.UIDRange{First: 239600, Last: 239603}
	id := protocol.NewSandboxID()
	if err := m.index(id, "o"); err != nil {
		t.Fatal(err)
	}
	uid, err := m.allocateUID(ctx, "o", id)
	if err != nil {
		t.Fatal(err)
	}
	m2 := restarted(t, m) // the broker dies here
	wantHeld(t, m2, "after the restart", map[string]int{})
	if owner, err := st.UIDOwner(ctx, uid); err != nil || owner != "" {
		t.Fatalf("uid %d in Redis after the restart found no record and no files: held by %q (%v), want free", uid, owner, err)
	}
}

// A request that read a sandbox's record before its delete and reaches its files after it (a
// dataplane call, a stop) looks up its entry again: the reconcile that finds no record and no files
// forgets that entry too, rather than reading Redis for it (and giving its uid back) every pass for
// as long as the broker runs.
func TestTheReconcileForgetsTheEntryOfADeletedSandboxALateRequestMade(t *testing.T) {
	ctx := t.Context()
	m, _, _ := testManager(t, time.Now)
	c := Caller{Org: "o", Actor: "key:k"}
	rec, _, err := m.Create(ctx, c, CreateRequest{Name: "late"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Delete(ctx, c, rec.ID); err != nil {
		t.Fatal(err)
	}
	m.Workspace(rec) // a request that read the record before the delete
	m.Reconcile(ctx)
	m.mu.Lock()
	_, kept := m.host[rec.ID]
	m.mu.Unlock()
	if kept {
		t.Fatal("the reconcile keeps the entry of a sandbox with no record and no files: it reads Redis for it every pass")
	}
}
