package sandbox

import (
	"context"
	"errors"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// Runtimes that outlive the broker (provider.Outliving: the kubernetes provider's pods) are let go
// of, not stopped, when the broker closes, and taken back, not started again, when it starts: a
// restart or a rolling update of the brokers loses none of their processes, and their records go
// on saying running without a processes_lost_at or a resumed event, because nothing happened to
// them.
//
// The manager asks the provider rather than knowing that pods live on: whether a runtime survives
// the broker's process is a fact about where it runs, which only the provider knows (a pod does; a
// namespace sandbox's init, the broker's child, does not; a microVM under a separate daemon might),
// and what proves that the runtime found is still the sandbox's own (a pod's labels, readiness and
// its agent's TLS pin and secret) is the provider's to check. Everything around it stays one
// lifecycle for every provider: which records come back, leases that ran out meanwhile, stops and
// deletes made by other brokers meanwhile (Recover), and the fallback to a fresh start.

// detach lets go of h's instance without ending it when the provider's instances outlive the
// broker, and reports whether it did; the caller holds h.mu.
func (m *Manager) detach(h *hosted) bool {
	o, ok := m.cfg.Provider.(provider.Outliving)
	if !ok || h.inst == nil {
		return false
	}
	inst := h.inst
	h.inst = nil // first: the instance's watcher then sees it was let go of, not lost
	o.Detach(inst)
	h.closeWorkspace()
	return true
}

// readopt takes back the runtime of a running record that an earlier run of this broker left
// running, and reports whether the record needs nothing more. When it answers false, the caller
// starts the sandbox afresh: its runtime was gone, not the one made for it, or did not prove
// itself (the provider ended what was left), or the provider does not outlive the broker.
func (m *Manager) readopt(ctx context.Context, rec store.Record) bool {
	o, ok := m.cfg.Provider.(provider.Outliving)
	if !ok {
		return false
	}
	log := m.cfg.Log.With("sandbox_id", rec.ID, "org", rec.Org)
	h := m.hostedFor(rec.ID, rec.Org)
	h.mu.Lock()
	defer h.mu.Unlock()
	tmpl, ok := m.cfg.Templates[rec.Template]
	if !ok {
		tmpl = m.cfg.Templates["default"]
	}
	if level := provider.RecordedIsolation(rec.Provider); level != "" {
		tmpl.Isolation = level
	}
	if !m.holdUID(rec) {
		return false // another sandbox here holds its uid: the fresh start refuses it (provision)
	}
	inst, err := o.Adopt(ctx, provider.Spec{ID: rec.ID, Template: tmpl, UID: rec.UID, Org: rec.Org, Name: rec.Name})
	if err != nil {
		var na *provider.NotAdoptedError
		if errors.As(err, &na) {
			log.Info("the sandbox's runtime did not outlive the broker's restart as it was: starting it again, its processes lost", "why", na.Reason)
		} else {
			log.Warn("taking back the sandbox's runtime after the broker's restart failed: starting it again", "err", err)
		}
		return false
	}
	// The record may have moved during the adoption (another broker stopped or deleted it): that
	// action wins. A record that cannot be read now keeps its runtime; the reconcile looks again.
	cur, err := m.cfg.Store.Get(ctx, rec.Org, rec.ID)
	if errors.Is(err, store.ErrNotFound) || err == nil && (cur.Status != protocol.StatusRunning || cur.Node != m.cfg.Node) {
		if err := inst.Stop(context.WithoutCancel(ctx)); err != nil {
			log.Error("stopping a runtime taken back for a sandbox that no longer runs", "err", err)
		}
		return true
	}
	h.inst = inst
	go m.watch(rec.Org, rec.ID, h, inst)
	log.Info("sandbox taken back after the broker's restart: its runtime ran on, its processes with it")
	return true
}
