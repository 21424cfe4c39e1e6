package sandbox

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// destroyFails is a provider whose Destroy fails while fails is above zero (a busy mount, an API
// server away), then works.
type destroyFails struct {
	provider.Provider
	fails atomic.Int32
}

func (p *destroyFails) Destroy(ctx context.Context, spec provider.Spec) error {
	if p.fails.Add(-1) >= 0 {
		return errors.New("destroy failed (test)")
	}
	return p.Provider.Destroy(ctx, spec)
}

// A claimed pooled sandbox whose create's outcome is unknown is held: its runtime goes, its uid and
// index entry stay for the record the create may have made. When its destroy fails, its processes
// may live, so the broker keeps its uid from the next sandbox; once a later try succeeds, the uid
// is back in the range (for the record's delete to free in Redis). Before, a failed destroy was not
// tried again, and the uid stayed out of the broker's range until a restart.
func TestAHeldPooledSandboxsUIDComesBackOnceItsDestroySucceeds(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	prov := &destroyFails{Provider: m.cfg.Provider}
	prov.fails.Store(1)
	m.cfg.Provider = prov
	m.cfg.UIDs = store.UIDRange{First: 239000, Last: 239003}
	tmpl := m.cfg.Templates["default"]
	tmpl.Pool = provider.Pool{Size: 1}
	m.cfg.Templates["default"] = tmpl
	m.pool = newPool(m)
	if err := m.pool.fill(ctx, "default"); err != nil {
		t.Fatal(err)
	}
	pd := m.pool.take("default")
	if pd == nil {
		t.Fatal("the pool is empty after a fill")
	}
	defer m.pool.settled(pd)
	if err := m.pool.claim(ctx, "o", pd); err != nil {
		t.Fatal(err)
	}
	m.pool.hold(ctx, pd) // as unclaim does for a create whose outcome is unknown
	if _, id := m.uids.holder(pd.uid); id != pd.id {
		t.Fatalf("uid %d after a failed destroy: held by %q, want %s (its processes may live)", pd.uid, id, pd.id)
	}
	m.pool.retryLeftovers(ctx) // the filler's next round
	if _, id := m.uids.holder(pd.uid); id != "" {
		t.Fatalf("uid %d after its destroy succeeded: still held by %q", pd.uid, id)
	}
	if _, err := os.Stat(m.cfg.Provider.WorkspaceDir(provider.Spec{ID: pd.id})); !os.IsNotExist(err) {
		t.Fatalf("the held sandbox's files after its destroy: %v", err)
	}
	// The record the create may have made still names the uid and the id: both stay.
	if owner, err := st.UIDOwner(ctx, pd.uid); err != nil || owner != "o/"+pd.id {
		t.Fatalf("uid %d in Redis: %q, %v; want o/%s", pd.uid, owner, err, pd.id)
	}
	if _, err := os.Stat(filepath.Join(m.cfg.IndexDir, pd.id)); err != nil {
		t.Fatalf("the held sandbox's index entry: %v", err)
	}
}

// A broker restarted with no pool in its templates finds a pooled sandbox an earlier run left, and
// its removal fails (the store or the provider away): the filler still tries it again, so its uid
// comes back to the range. Before, the filler ran only for templates with a pool, and the uid
// stayed taken in Redis until a restart.
func TestAPooledLeftoverIsRetriedWithNoPoolConfigured(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	m.cfg.UIDs = store.UIDRange{First: 239700, Last: 239703}
	tmpl := m.cfg.Templates["default"]
	tmpl.Pool = provider.Pool{Size: 1}
	m.cfg.Templates["pooled"] = tmpl
	m.pool = newPool(m)
	if err := m.pool.fill(ctx, "pooled"); err != nil {
		t.Fatal(err)
	}
	pd := m.pool.tmpl["pooled"].ready[0]
	pd.h.mu.Lock()
	pd.h.release(ctx) // its processes end with the broker; its index entry and uid stay
	pd.h.mu.Unlock()

	cfg := m.cfg
	cfg.Templates = map[string]provider.Template{"default": provider.DefaultTemplate()} // no pool now
	prov := &destroyFails{Provider: m.cfg.Provider}
	prov.fails.Store(1)
	cfg.Provider = prov
	m2, err := NewManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Close(context.Background()) })
	if err := m2.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	m2.RunPool(ctx) // returns once nothing is left over
	if owner, err := st.UIDOwner(ctx, pd.uid); err != nil || owner != "" {
		t.Fatalf("uid %d of the earlier run's pooled sandbox: held by %q (%v), want free", pd.uid, owner, err)
	}
}
