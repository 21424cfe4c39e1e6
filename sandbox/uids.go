package sandbox

import (
	"context"
	"errors"
	"sync"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// Host uids: each sandbox runs as its own, drawn from a range whose table lives in Redis
// (store.AllocateUID), which every broker on that Redis draws from. Redis may lose that table
// (FLUSHALL, an empty replica taking over) and then hand out a uid a sandbox here already holds:
// two sandboxes of different orgs as one host uid could signal and read each other's processes.
// So the broker keeps its own table of the uids its sandboxes hold, and a uid Redis hands out that
// this table holds is given back to its holder and another drawn (allocateUID).
//
// A uid enters the table at its draw, before allocateUID returns it (a create's record and runtime
// come after Redis round trips, in which Redis may lose its data), at a start and at Recover (for
// uids drawn by an earlier run of the broker), and for the kept files of a sandbox whose record Redis
// lost. It leaves when nothing here can run as it any more: the sandbox's runtime and files are
// destroyed (a delete, a pooled sandbox discarded or held), or the create that drew it gave it back.

// uidTable is the host uids this broker's sandboxes hold (org's, and the pool's under
// store.PoolOrg), by sandbox id: one uid per sandbox.
type uidTable struct {
	mu   sync.Mutex
	byID map[string]uidHold
}

type uidHold struct {
	org string
	uid int
}

// hold enters uid as sandbox id's (of org), unless another sandbox holds it: then it answers that
// one and changes nothing. Holding again moves the sandbox's entry (a pooled sandbox claimed by an
// org, or given back).
func (t *uidTable) hold(org, id string, uid int) (holderOrg, holderID string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for hid, h := range t.byID {
		if hid != id && h.uid == uid {
			return h.org, hid
		}
	}
	if t.byID == nil {
		t.byID = map[string]uidHold{}
	}
	t.byID[id] = uidHold{org: org, uid: uid}
	return "", ""
}

// drop forgets sandbox id's uid: nothing of it runs here any more.
func (t *uidTable) drop(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.byID, id)
}

// allocateUID takes a host uid for the sandbox from the range, or answers 0 when there is none. The
// uid is in the broker's table when it returns: the caller gives it back (releaseUID), or the
// sandbox's destroy does.
func (m *Manager) allocateUID(ctx context.Context, org, id string) (int, error) {
	if m.cfg.UIDs.Size() == 0 {
		return 0, nil
	}
	for range m.cfg.UIDs.Size() {
		uid, err := m.cfg.Store.AllocateUID(ctx, m.cfg.UIDs, org, id)
		if errors.Is(err, store.ErrUIDsExhausted) {
			break
		}
		if err != nil {
			return 0, err
		}
		holderOrg, holderID := m.uids.hold(org, id, uid)
		if holderID == "" {
			return uid, nil
		}
		// Redis handed out the uid a sandbox here holds: it lost its uid table (flushed, or an
		// empty replica took over) and the reconcile has not yet found the loss. Give the uid
		// back to its holder in the table and draw again.
		m.cfg.Log.Warn("Redis handed out the uid of a sandbox this broker hosts (did it lose its data?): drawing another",
			"sandbox_id", id, "uid", uid, "held_by", holderID)
		if err := m.cfg.Store.ReleaseUID(ctx, org, id); err != nil {
			return 0, err
		}
		if _, err := m.cfg.Store.ReserveUID(ctx, uid, holderOrg, holderID); err != nil {
			return 0, err
		}
	}
	m.cfg.Log.Error("no sandbox uid left", "sandbox_id", id, "first", m.cfg.UIDs.First, "last", m.cfg.UIDs.Last)
	return 0, protocol.Errorf(protocol.CodeCapacity,
		"the broker has no host uid left for a new sandbox (all %d of its --sandbox-uids range are in use): delete sandboxes you no longer need, or ask the operator to widen the range",
		m.cfg.UIDs.Size())
}

// releaseUID gives back the uid of a sandbox that never came to exist (nothing ran as it).
func (m *Manager) releaseUID(ctx context.Context, rec store.Record) {
	m.uids.drop(rec.ID)
	if err := m.cfg.Store.ReleaseUID(ctx, rec.Org, rec.ID); err != nil {
		m.cfg.Log.Error("releasing the uid of a sandbox that was not created failed; it stays taken", "sandbox_id", rec.ID, "uid", rec.UID, "err", err)
	}
}

// holdUID enters the uid of rec, a sandbox hosted here, in the table (a start, Recover, a runtime
// taken back), and reports false when another sandbox here holds it: rec must not run as it.
func (m *Manager) holdUID(rec store.Record) bool {
	if rec.UID <= 0 {
		return true
	}
	_, holderID := m.uids.hold(rec.Org, rec.ID, rec.UID)
	if holderID != "" {
		m.cfg.Log.Error("two sandboxes hosted here are recorded with one host uid (did Redis lose its data?)",
			"sandbox_id", rec.ID, "uid", rec.UID, "held_by", holderID)
		return false
	}
	return true
}
