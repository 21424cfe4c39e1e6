package sandbox

import (
	"context"
	"fmt"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/workspace"
	"github.com/sbxbroker/broker/store"
)

// sweepTimeout bounds the temporary-file sweep when a workspace is opened: a huge workspace is
// swept in part rather than holding up its start or first file operation.
const sweepTimeout = 5 * time.Second

// openWorkspace opens the sandbox's workspace into h.ws if it is not open and then, or always when
// sweep is set (a start), removes the upload temporary files a dead broker left in it, so none
// outlives the broker that wrote it; uploads in progress through h.ws are kept. The caller holds
// h.mu. A failed sweep is logged and changes nothing else: the files stay hidden from listings
// and the next start tries again.
func (m *Manager) openWorkspace(ctx context.Context, h *hosted, rec store.Record, sweep bool) (*workspace.Workspace, error) {
	id := rec.ID
	if h.ws != nil && !sweep {
		return h.ws, nil
	}
	if provider.IsRemote(m.cfg.Provider) {
		return nil, protocol.Errorf(protocol.CodeNotRunning, "sandbox %s's files are served by its %s runtime: it must be running", rec.Name, m.cfg.Provider.Name())
	}
	if h.ws == nil {
		if wm, ok := m.cfg.Provider.(provider.WorkspaceMounter); ok {
			// A disk quota's image is mounted on the workspace dir; after a host reboot nothing
			// has mounted it yet, and opening the bare dir would put files under the mount point.
			if err := wm.MountWorkspace(provider.Spec{ID: id}); err != nil {
				return nil, fmt.Errorf("sandbox %s: open workspace: %w", id, err)
			}
		}
		dir := m.cfg.Provider.WorkspaceDir(provider.Spec{ID: id})
		opts := m.cfg.Workspace
		if rec.UID > 0 && opts.UID > 0 {
			// Files the broker creates belong to the sandbox's own uid (a broker that runs
			// sandboxes as its own user has no Workspace.UID and changes no owner).
			opts.UID, opts.GID = rec.UID, rec.UID
		}
		ws, err := workspace.Open(dir, opts)
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: open workspace: %w", id, err)
		}
		h.ws = ws
	}
	ws := h.ws
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sweepTimeout)
	defer cancel()
	n, err := ws.SweepTemps(ctx)
	if err != nil {
		m.cfg.Log.Warn("sweeping temporary upload files failed", "sandbox_id", id, "err", err)
	}
	if n > 0 {
		m.cfg.Log.Info("removed temporary upload files left by an earlier broker", "sandbox_id", id, "files", n)
	}
	return ws, nil
}

// closeWorkspace closes h.ws, if open, so a sandbox that is not running holds no descriptor (its
// workspace root and directory): a broker hosting many stopped sandboxes would otherwise run out.
// The next file operation or start opens it again. The caller holds h.mu.
func (h *hosted) closeWorkspace() {
	if h.ws != nil {
		h.ws.Close()
		h.ws = nil
	}
}
