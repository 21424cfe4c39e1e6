package sandbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/workspace"
	"github.com/sbxbroker/broker/store"
)

// Config wires a Manager.
type Config struct {
	Store     *store.Store
	Provider  provider.Provider
	Templates map[string]provider.Template // must hold "default"
	// Node names this broker; records say which node hosts each sandbox.
	Node string
	// Events receives the lifecycle's events (the broker's events.Writer.Emit); nil drops them.
	Events func(org string, e protocol.Event)
	Log    *slog.Logger
	// Now is the clock of every lease and deadline computed here.
	Now        func() time.Time
	DefaultTTL time.Duration
	MaxTTL     time.Duration
	// IndexDir remembers which sandboxes this node hosts (file name = id, content = org), so that a
	// restarted broker finds them without scanning every org.
	IndexDir string
	// Workspace options (the sandbox user that owns created files, caps). A sandbox with its own
	// uid gets that uid in place of Workspace.UID/GID.
	Workspace workspace.Options
	// UIDs is the range each sandbox gets its own host uid from (allocated at create, or at the
	// next start of a sandbox recorded without one, released on delete). The zero value gives none:
	// sandboxes then share the provider's uid, which only makes sense when the broker is not root.
	UIDs store.UIDRange
}

// Caller is who acts: the org whose sandboxes are in reach, and the actor recorded in events.
type Caller struct {
	Org   string
	Actor string // "key:<id>", "sweeper", "broker"
}

// Manager runs the lifecycle. It is safe for concurrent use.
type Manager struct {
	cfg  Config
	mu   sync.Mutex
	host map[string]*hosted // sandbox id -> local runtime state, for sandboxes this node hosts
	// closing is set by Close: instances ending then are the broker's doing, not a crash.
	closing bool
	// uids are the host uids this broker's sandboxes hold, from their draw until nothing runs as
	// them (uids.go).
	uids uidTable
	// pool keeps started sandboxes ready for templates that ask for it (pool.go).
	pool *pool
	// settle knows the starts in flight, to settle records whose start was cut short (settle.go).
	settle *settler
	// firstStarts sums the provider's part of creates (its Create and Start), so that /metrics
	// can tell it from the broker's own work around it (store, HTTP) in the same creates.
	firstStarts struct{ n, nanos atomic.Int64 }
}

// hosted is the local state of one sandbox. mu serializes lifecycle actions on it (start, stop,
// destroy); exec and file operations do not take it.
type hosted struct {
	mu   sync.Mutex
	org  string
	inst provider.Instance // nil when not running
	// claim is the record's claim inst was started under: a second start of that claim finds
	// its runtime here rather than a runtime a stop left (provision).
	claim string
	ws    *workspace.Workspace
	// destroyed: the sandbox is gone (destroy removed its files, uid and record, or the reconcile
	// found neither record nor files) and this entry left m.host. A start that looked the entry
	// up before and waited for mu must not start it, nor take its uid again: nothing would give
	// that uid back.
	destroyed bool
}

// SearchPath is the PATH rec's commands find a bare program name through, and whether the broker
// knows it, for the delegation policy that checks an allowlist against it. A remote provider's
// running sandbox has the PATH its runtime reported at its start (on kubernetes its image's when
// the template sets none, or the template's as it was then), which every broker reads from the
// record; any other has what its template gives it now (provider.SearchPath), unknown for a
// remote sandbox not running.
func (m *Manager) SearchPath(rec store.Record) (path string, known bool) {
	if rec.Status == protocol.StatusRunning && rec.SearchPath != "" && provider.IsRemote(m.cfg.Provider) {
		return rec.SearchPath, true
	}
	tmpl, ok := m.cfg.Templates[rec.Template]
	if !ok {
		tmpl = m.cfg.Templates["default"]
	}
	return provider.SearchPath(m.cfg.Provider, tmpl)
}

// release stops the sandbox's processes and closes its workspace; the caller holds h.mu.
func (h *hosted) release(ctx context.Context) {
	if h.inst != nil {
		h.inst.Stop(ctx)
		h.inst = nil
	}
	h.closeWorkspace()
}

// NewManager builds a Manager; call Recover before serving.
func NewManager(cfg Config) (*Manager, error) {
	if _, ok := cfg.Templates["default"]; !ok {
		return nil, errors.New("sandbox: templates must include \"default\"")
	}
	if err := os.MkdirAll(cfg.IndexDir, 0o700); err != nil {
		return nil, fmt.Errorf("sandbox: index dir: %w", err)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Events == nil {
		cfg.Events = func(string, protocol.Event) {}
	}
	m := &Manager{cfg: cfg, host: map[string]*hosted{}, settle: newSettler()}
	m.pool = newPool(m)
	return m, nil
}

// Provider is the provider in use.
func (m *Manager) Provider() provider.Provider { return m.cfg.Provider }

// Node is this broker's node name.
func (m *Manager) Node() string { return m.cfg.Node }

func (m *Manager) now() time.Time { return m.cfg.Now().UTC() }

func (m *Manager) hostedFor(id, org string) *hosted {
	m.mu.Lock()
	defer m.mu.Unlock()
	h := m.host[id]
	if h == nil {
		h = &hosted{org: org}
		m.host[id] = h
	}
	return h
}

// hostedHere is rec's entry on this broker, or wrong_node when another broker hosts it.
func (m *Manager) hostedHere(rec store.Record) (*hosted, error) {
	if rec.Node != m.cfg.Node {
		return nil, protocol.Errorf(protocol.CodeWrongNode, "sandbox %s is hosted by another broker (%s)", rec.Name, rec.Node)
	}
	return m.hostedFor(rec.ID, rec.Org), nil
}

func (m *Manager) emit(c Caller, rec store.Record, typ string, mut func(*protocol.Event)) {
	e := protocol.Event{Type: typ, SandboxID: rec.ID, Name: rec.Name, Time: m.now(), Actor: c.Actor, Status: rec.Status}
	if mut != nil {
		mut(&e)
	}
	m.cfg.Events(rec.Org, e)
}

// Get reads a sandbox by id or name.
func (m *Manager) Get(ctx context.Context, org, ref string) (store.Record, error) {
	rec, err := m.cfg.Store.Get(ctx, org, ref)
	return rec, m.mapStoreErr(err, ref)
}

// List lists sandboxes.
func (m *Manager) List(ctx context.Context, org string, f store.Filter, limit int, cursor string) (store.Page, error) {
	p, err := m.cfg.Store.List(ctx, org, f, limit, cursor)
	return p, m.mapStoreErr(err, "")
}

// Stop stops a running sandbox: every process ends, files stay. Stopping a stopped sandbox changes
// nothing but a runtime left running.
func (m *Manager) Stop(ctx context.Context, c Caller, ref, reason string) (store.Record, error) {
	rec, err := m.cfg.Store.Transition(ctx, c.Org, ref, store.Transition{
		From: []string{protocol.StatusRunning}, To: protocol.StatusStopped,
		Fields: map[string]string{store.FieldStopReason: reason}})
	var se *store.StateError
	if errors.As(err, &se) && se.Status == protocol.StatusStopped {
		// Stopped already, perhaps by this very call: the Redis client sends it again when Redis'
		// answer is lost, and then the runtime is still to end (stopLocal leaves one a resume owns).
		rec, err := m.Get(ctx, c.Org, ref)
		if err == nil {
			m.stopLocal(ctx, rec)
		}
		return rec, err
	}
	return m.stopped(ctx, c, ref, reason, rec, err)
}

// StopExpired is the sweeper's stop (reason ttl_expired), re-checked atomically on the lease clock:
// it happens only if no heartbeat moved the deadline meanwhile and the sandbox's expiring warning
// was claimed at least its window (warning, or half the lease) earlier. Otherwise the error is an
// invalid_state one.
func (m *Manager) StopExpired(ctx context.Context, c Caller, ref string, warning time.Duration) (store.Record, error) {
	rec, err := m.cfg.Store.Transition(ctx, c.Org, ref, store.Transition{
		From: []string{protocol.StatusRunning}, To: protocol.StatusStopped, IfExpired: true, Warning: warning,
		Fields: map[string]string{store.FieldStopReason: protocol.StopTTLExpired}})
	var se *store.StateError
	if errors.As(err, &se) && se.Status == protocol.StatusStopped {
		// Stopped already, perhaps by this very call (resent when Redis' answer was lost), as in
		// Stop: the runtime is still to end. The caller hears the refusal all the same.
		if now, gerr := m.Get(ctx, c.Org, ref); gerr == nil {
			m.stopLocal(ctx, now)
		}
	}
	return m.stopped(ctx, c, ref, protocol.StopTTLExpired, rec, err)
}

// stopped ends the runtime of a sandbox whose record a stop transition changed, and says so.
func (m *Manager) stopped(ctx context.Context, c Caller, ref, reason string, rec store.Record, err error) (store.Record, error) {
	if err != nil {
		return store.Record{}, m.mapStoreErr(err, ref)
	}
	m.stopLocal(ctx, rec)
	m.emit(c, rec, protocol.EventStopped, func(e *protocol.Event) { e.Reason = reason })
	return rec, nil
}

// stopLocal ends the runtime of a sandbox whose record no longer says running, here or on its node.
// rec may be overtaken by the time the lifecycle lock is held: a resume may have claimed the record
// since (and started it, or be waiting for the lock to), so the record is read again under the lock
// and a runtime a start now owns is left to it (provision ends a leftover one before it starts). A
// read Redis does not answer leaves the runtime to the next reconcile.
func (m *Manager) stopLocal(ctx context.Context, rec store.Record) {
	if rec.Node != m.cfg.Node {
		m.notify(ctx, rec, cmdStop, "")
		return
	}
	h := m.hostedFor(rec.ID, rec.Org)
	h.mu.Lock()
	defer h.mu.Unlock()
	now, err := m.cfg.Store.Get(context.WithoutCancel(ctx), rec.Org, rec.ID)
	switch {
	case err == nil && (now.Status == protocol.StatusRunning || now.Status == protocol.StatusProvisioning):
		return
	case err != nil && !errors.Is(err, store.ErrNotFound):
		// Redis did not say: the runtime may be a resume's, and ended, the record would say
		// running with nothing behind it. One left while its record says stopped is ended by
		// the reconcile, which reads the record again (DESIGN 7c: a blink stops nothing).
		if h.inst != nil {
			m.cfg.Log.Warn("cannot read the record of a sandbox to stop; its processes are left to the next reconcile", "sandbox_id", rec.ID, "err", err)
		}
		return
	}
	if h.inst != nil {
		if err := h.inst.Stop(context.WithoutCancel(ctx)); err != nil {
			m.cfg.Log.Error("stopping sandbox processes", "sandbox_id", rec.ID, "err", err)
		}
		h.inst = nil
	}
	h.closeWorkspace()
}

// Resume starts a stopped sandbox again on the same files; resuming a running one is a no-op.
func (m *Manager) Resume(ctx context.Context, c Caller, ref string) (store.Record, error) {
	t := store.Transition{From: []string{protocol.StatusStopped}, To: protocol.StatusProvisioning, Claim: m.newClaim(),
		Fields: map[string]string{store.FieldStopReason: "", store.FieldFailure: ""}}
	defer m.holdStart(t.Claim)()
	// Sent again while its answer may have been lost (resend.go): the store recognises its own
	// claim. Given up on, a claim that did land leaves the sandbox provisioning until the
	// reconcile settles it (settle.go).
	rec, err := resend(ctx, m.cfg.Log.With("ref", clip(ref), "org", c.Org), "resume", func(ctx context.Context) (store.Record, error) {
		return m.cfg.Store.Transition(ctx, c.Org, ref, t)
	})
	if errors.Is(err, errUnknownOutcome) {
		m.watchUnsettled(c.Org, ref, false)
	}
	var se *store.StateError
	if errors.As(err, &se) && (se.Status == protocol.StatusRunning || se.Status == protocol.StatusProvisioning) {
		rec, err = m.Get(ctx, c.Org, ref)
		if err != nil {
			return rec, err
		}
		if rec, err = m.waitSettled(ctx, c.Org, rec); err != nil {
			return rec, err
		}
		return rec, startedOrWhyNot(rec)
	}
	if err != nil {
		return store.Record{}, m.mapStoreErr(err, ref)
	}
	return m.start(ctx, c, rec)
}

// start brings a record claimed for resuming (provisioning) to running, here or on its node.
func (m *Manager) start(ctx context.Context, c Caller, rec store.Record) (store.Record, error) {
	if rec.Node != m.cfg.Node {
		return m.startRemote(ctx, c, rec)
	}
	tmpl, ok := m.cfg.Templates[rec.Template]
	if !ok {
		tmpl = m.cfg.Templates["default"]
		m.cfg.Log.Warn("sandbox template no longer exists; resuming with the default", "sandbox_id", rec.ID, "template", rec.Template)
	}
	got, err := m.provisionClaim(ctx, c, rec, tmpl, false)
	if errors.Is(err, errStartedAlready) {
		return got, nil // the start that did it said so
	}
	if err == nil {
		m.emit(c, got, protocol.EventResumed, nil)
	}
	return got, err
}

// startRemote asks the hosting broker to start a record claimed for resuming, asking again while it
// is provisioning, and waits at most remoteStartWait. The hosting broker emits the resumed event.
func (m *Manager) startRemote(ctx context.Context, c Caller, rec store.Record) (store.Record, error) {
	deadline := time.Now().Add(remoteStartWait)
	for {
		m.notify(ctx, rec, cmdStart, c.Actor)
		wait, cancel := context.WithTimeout(ctx, remoteStartAgain)
		got, err := m.waitSettled(wait, rec.Org, rec)
		cancel()
		switch {
		case err == nil:
			return got, startedOrWhyNot(got)
		case ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded):
			return got, err
		case time.Now().After(deadline):
			return got, protocol.Errorf(protocol.CodeUnavailable,
				"broker %s, which hosts sandbox %s, did not start it within %s: is it running? The sandbox stays claimed until that broker runs again, which brings it back stopped",
				rec.Node, rec.Name, remoteStartWait)
		}
	}
}

// startedOrWhyNot is nil for a running record, else the error of a start that did not happen.
func startedOrWhyNot(rec store.Record) error {
	if rec.Status == protocol.StatusRunning {
		return nil
	}
	why := cmp.Or(rec.Failure, "it is "+rec.Status)
	return protocol.Errorf(protocol.CodeSandboxFailed, "sandbox %s could not start: %s", rec.Name, why)
}

// Delete removes a sandbox: its processes, its files and its record. Its name is free at once and
// every delegation token for it stops working (the token generation is bumped).
func (m *Manager) Delete(ctx context.Context, c Caller, ref string) (store.Record, error) {
	return m.delete(ctx, c, ref, store.Transition{
		From: []string{protocol.StatusProvisioning, protocol.StatusRunning, protocol.StatusStopped, protocol.StatusFailed, protocol.StatusDeleting},
		To:   protocol.StatusDeleting})
}

// DeleteStopped deletes a sandbox only if it has been stopped since stoppedBy or earlier, checked
// atomically: retention's delete, which a resume that lands first wins.
func (m *Manager) DeleteStopped(ctx context.Context, c Caller, ref string, stoppedBy time.Time) (store.Record, error) {
	return m.delete(ctx, c, ref, store.Transition{
		From: []string{protocol.StatusStopped}, To: protocol.StatusDeleting, IfStoppedBy: stoppedBy})
}

func (m *Manager) delete(ctx context.Context, c Caller, ref string, t store.Transition) (store.Record, error) {
	rec, err := m.cfg.Store.Transition(ctx, c.Org, ref, t)
	if err != nil {
		return store.Record{}, m.mapStoreErr(err, ref)
	}
	if rec.Node != m.cfg.Node {
		m.notify(ctx, rec, cmdDestroy, "")
		m.emit(c, rec, protocol.EventDeleted, nil)
		return rec, nil
	}
	if err := m.destroy(context.WithoutCancel(ctx), rec); err != nil {
		return rec, err
	}
	m.emit(c, rec, protocol.EventDeleted, nil)
	return rec, nil
}

// destroy removes a deleting sandbox's runtime, files and record (idempotent, local only).
func (m *Manager) destroy(ctx context.Context, rec store.Record) error {
	h := m.hostedFor(rec.ID, rec.Org)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.release(ctx)
	tmpl := m.cfg.Templates[rec.Template]
	if err := m.cfg.Provider.Destroy(ctx, provider.Spec{ID: rec.ID, Template: tmpl, UID: rec.UID, Org: rec.Org, Name: rec.Name}); err != nil {
		m.cfg.Log.Error("removing sandbox files failed; it stays deleting and is retried at next start", "sandbox_id", rec.ID, "err", err)
		return fmt.Errorf("sandbox %s: remove files: %w", rec.ID, err)
	}
	// The uid goes back only now that its processes ended and its files are gone, and before the
	// record: if this fails, the record stays deleting and the release is retried with it. Nothing
	// here runs as it any more: a create given it meanwhile must not find it held (uids.go).
	m.uids.drop(rec.ID)
	if err := m.cfg.Store.ReleaseUID(ctx, rec.Org, rec.ID); err != nil {
		m.cfg.Log.Error("releasing the sandbox uid failed; it stays deleting and is retried at next start", "sandbox_id", rec.ID, "uid", rec.UID, "err", err)
		return fmt.Errorf("sandbox %s: release uid: %w", rec.ID, err)
	}
	if err := m.cfg.Store.Purge(ctx, rec); err != nil && !errors.Is(err, store.ErrWrongState) {
		return err
	}
	m.unindex(rec.ID)
	h.destroyed = true
	m.mu.Lock()
	delete(m.host, rec.ID)
	m.mu.Unlock()
	m.unseen(rec.ID)
	return nil
}

// DeleteMatching deletes every sandbox carrying all the tags (at least one is required), or only
// lists them when dryRun.
func (m *Manager) DeleteMatching(ctx context.Context, c Caller, tags map[string]string, dryRun bool) ([]store.Record, error) {
	if len(tags) == 0 {
		return nil, protocol.Errorf(protocol.CodeInvalidTag, "a batch delete needs at least one tag selector (tag=key=value)")
	}
	recs, err := m.cfg.Store.ListAll(ctx, c.Org, store.Filter{Tags: tags})
	if err != nil || dryRun {
		return recs, m.mapStoreErr(err, "")
	}
	var deleted []store.Record
	var errs []error
	for _, r := range recs {
		got, err := m.Delete(ctx, c, r.ID)
		if err != nil {
			var pe *protocol.Error
			if errors.As(err, &pe) && pe.Code == protocol.CodeNotFound {
				continue // deleted by someone else meanwhile
			}
			errs = append(errs, err)
			continue
		}
		deleted = append(deleted, got)
	}
	return deleted, errors.Join(errs...)
}

// Heartbeat renews a running sandbox's lease.
func (m *Manager) Heartbeat(ctx context.Context, org, ref string) (store.Lease, error) {
	l, err := m.cfg.Store.Heartbeat(ctx, org, ref)
	return l, m.mapStoreErr(err, ref)
}

// HeartbeatMany renews many leases at once; each ref gets its lease or its own error.
func (m *Manager) HeartbeatMany(ctx context.Context, org string, refs []string) ([]store.Lease, []error) {
	leases, errs := m.cfg.Store.HeartbeatMany(ctx, org, refs)
	for i, err := range errs {
		errs[i] = m.mapStoreErr(err, refs[i])
	}
	return leases, errs
}

// SetTTL changes a sandbox's lease length and, when running, renews it.
func (m *Manager) SetTTL(ctx context.Context, org, ref string, ttl time.Duration) (store.Lease, error) {
	if err := ValidateTTL(ttl, m.cfg.MaxTTL); err != nil {
		return store.Lease{}, err
	}
	l, err := m.cfg.Store.SetTTL(ctx, org, ref, ttl)
	return l, m.mapStoreErr(err, ref)
}

// Instance returns the running runtime of a sandbox hosted here.
func (m *Manager) Instance(rec store.Record) (provider.Instance, error) {
	h, err := m.hostedHere(rec)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.inst == nil {
		return nil, protocol.Errorf(protocol.CodeNotRunning, "sandbox %s is %s: resume it first", rec.Name, rec.Status)
	}
	return h.inst, nil
}

// Workspace returns the file operations of a sandbox hosted here (running or not).
func (m *Manager) Workspace(rec store.Record) (*workspace.Workspace, error) {
	h, err := m.hostedHere(rec)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return m.openWorkspace(context.Background(), h, rec, false)
}

// Environment is what printenv shows inside a running sandbox.
func (m *Manager) Environment(rec store.Record) (map[string]string, error) {
	inst, err := m.Instance(rec)
	if err != nil {
		return nil, err
	}
	return inst.Environment(), nil
}

func (m *Manager) index(id, org string) error {
	if err := os.WriteFile(filepath.Join(m.cfg.IndexDir, id), []byte(org), 0o600); err != nil {
		return fmt.Errorf("sandbox: write index: %w", err)
	}
	return nil
}

func (m *Manager) unindex(id string) { os.Remove(filepath.Join(m.cfg.IndexDir, id)) }

// tailBuffer keeps the last 2 KiB written to it (a failed setup command's output).
type tailBuffer struct{ b []byte }

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > 2048 {
		t.b = t.b[len(t.b)-2048:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }
