package sandbox

import (
	"errors"
	"maps"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// heldUIDs is the broker's table of held uids, as "org/id" -> uid.
func heldUIDs(m *Manager) map[string]int {
	m.uids.mu.Lock()
	defer m.uids.mu.Unlock()
	out := map[string]int{}
	for id, h := range m.uids.byID {
		out[h.org+"/"+id] = h.uid
	}
	return out
}

func wantHeld(t *testing.T, m *Manager, step string, want map[string]int) {
	t.Helper()
	if got := heldUIDs(m); !maps.Equal(got, want) {
		t.Fatalf("%s: the broker holds uids %v, want %v", step, got, want)
	}
}

// The broker's table of held uids follows every path a uid takes: a create enters it, a create that
// reuses another sandbox or is refused gives its drawn uid back, a stopped sandbox keeps it, a
// delete frees it; a pooled sandbox's is the pool's, then the claiming org's; a pool that closes
// frees its own; a restarted broker takes back the uids of the sandboxes it hosts. A uid held after
// its sandbox is gone would be lost to the range for good; one dropped early could be handed out
// while its processes run.
func TestTheBrokersUIDTableFollowsEverySandbox(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	m.cfg.UIDs = store.UIDRange{First: 239100, Last: 239103}
	tmpl := m.cfg.Templates["default"]
	tmpl.Pool = provider.Pool{Size: 1}
	m.cfg.Templates["pooled"] = tmpl
	m.pool = newPool(m)
	c := Caller{Org: "o", Actor: "key:k"}

	a, _, err := m.Create(ctx, c, CreateRequest{Name: "a"})
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]int{"o/" + a.ID: a.UID}
	wantHeld(t, m, "a create", held)
	if _, outcome, err := m.Create(ctx, c, CreateRequest{Name: "a", Reuse: true}); err != nil || outcome != protocol.OutcomeReused {
		t.Fatalf("create-or-reuse: %v %s", err, outcome)
	}
	wantHeld(t, m, "a create that reused another sandbox", held)
	if _, _, err := m.Create(ctx, c, CreateRequest{Name: "a"}); err == nil {
		t.Fatal("a create of a taken name succeeded")
	}
	wantHeld(t, m, "a create refused", held)
	if _, err := m.Stop(ctx, c, a.ID, protocol.StopRequested); err != nil {
		t.Fatal(err)
	}
	wantHeld(t, m, "a stop", held)
	if _, err := m.Delete(ctx, c, a.ID); err != nil {
		t.Fatal(err)
	}
	wantHeld(t, m, "a delete", map[string]int{})

	// The pool's, then the org's that claims it.
	if err := m.pool.fill(ctx, "pooled"); err != nil {
		t.Fatal(err)
	}
	pd := m.pool.tmpl["pooled"].ready[0]
	wantHeld(t, m, "a pooled sandbox", map[string]int{store.PoolOrg + "/" + pd.id: pd.uid})
	p, _, err := m.Create(ctx, c, CreateRequest{Name: "p", Template: "pooled"})
	if err != nil || p.ID != pd.id {
		t.Fatalf("a create from the pool: %v, %s (pooled %s)", err, p.ID, pd.id)
	}
	wantHeld(t, m, "a pooled sandbox claimed", map[string]int{"o/" + p.ID: p.UID})
	if err := m.pool.fill(ctx, "pooled"); err != nil {
		t.Fatal(err)
	}
	m.pool.close(ctx)
	wantHeld(t, m, "the pool closed", map[string]int{"o/" + p.ID: p.UID})
	if _, err := m.Stop(ctx, c, p.ID, protocol.StopRequested); err != nil {
		t.Fatal(err)
	}

	// A restarted broker holds the uids of the sandboxes it hosts before any starts.
	m2 := restarted(t, m)
	wantHeld(t, m2, "after a restart", map[string]int{"o/" + p.ID: p.UID})
	if _, err := m2.Delete(ctx, c, p.ID); err != nil {
		t.Fatal(err)
	}
	wantHeld(t, m2, "a delete after the restart", map[string]int{})
	if owners, err := st.UIDOwner(ctx, p.UID); err != nil || owners != "" {
		t.Fatalf("uid %d in Redis after the delete: %q, %v", p.UID, owners, err)
	}
}

// A sandbox whose recorded uid another sandbox on this broker holds (Redis lost its uid table and
// handed the uid out again, then got the record back from an old snapshot) is not started as it:
// two sandboxes would run as one host uid. The start fails, saying why; its files stay.
func TestAStartAsAUIDAnotherSandboxHereHoldsIsRefused(t *testing.T) {
	ctx := t.Context()
	m, _, _ := testManager(t, time.Now)
	m.cfg.UIDs = store.UIDRange{First: 239200, Last: 239203}
	c := Caller{Org: "o", Actor: "key:k"}
	rec := createdAndStopped(t, m, c, "b")
	m.uids.drop(rec.ID) // as after a restart, before Recover
	if org, id := m.uids.hold("other-org", "sb-other", rec.UID); id != "" {
		t.Fatalf("uid %d is held by %s/%s", rec.UID, org, id)
	}
	got, err := m.Resume(ctx, c, rec.ID)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeSandboxFailed || !strings.Contains(pe.Message, "held by another sandbox") {
		t.Fatalf("a resume as a uid another sandbox holds: %v, want %s saying why", err, protocol.CodeSandboxFailed)
	}
	if _, ierr := m.Instance(got); ierr == nil {
		t.Fatal("the sandbox runs as a uid another sandbox holds")
	}
	if now, err := m.Get(ctx, "o", rec.ID); err != nil || now.Status != protocol.StatusStopped {
		t.Fatalf("after the refused start: %v %s, want stopped", err, now.Status)
	}
}

// A stopped sandbox that another broker deletes while its message to this one, the hosting broker,
// is lost (a Redis blip on the channel) is destroyed by this broker's next reconcile: its files go
// and its uid comes back to the range. Before, a sandbox this broker had not touched since its start
// (stopped at the restart) was not among those its reconcile reads: it stayed deleting, its files
// on disk and its uid held, until the broker's next restart.
func TestADeleteWhoseMessageWasLostIsFinishedByTheReconcileAfterARestart(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	m.cfg.UIDs = store.UIDRange{First: 239300, Last: 239303}
	c := Caller{Org: "o", Actor: "key:k"}
	rec := createdAndStopped(t, m, c, "s")
	m2 := restarted(t, m)
	// Another broker's delete: the record moves; the message to this node is lost.
	if _, err := st.Transition(ctx, "o", rec.ID, store.Transition{From: []string{protocol.StatusStopped}, To: protocol.StatusDeleting}); err != nil {
		t.Fatal(err)
	}
	m2.Reconcile(ctx)
	if _, err := st.Get(ctx, "o", rec.ID); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("the record after the reconcile: %v, want it gone", err)
	}
	if _, err := os.Stat(m2.cfg.Provider.WorkspaceDir(provider.Spec{ID: rec.ID})); !os.IsNotExist(err) {
		t.Fatalf("the deleted sandbox's files after the reconcile: %v", err)
	}
	if owner, err := st.UIDOwner(ctx, rec.UID); err != nil || owner != "" {
		t.Fatalf("uid %d after the reconcile: held by %q, %v", rec.UID, owner, err)
	}
	wantHeld(t, m2, "after the reconcile", map[string]int{})
}

// holder names the sandbox that holds uid here, if any.
func (t *uidTable) holder(uid int) (org, id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for hid, h := range t.byID {
		if h.uid == uid {
			return h.org, hid
		}
	}
	return "", ""
}
