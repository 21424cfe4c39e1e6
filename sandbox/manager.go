package sandbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
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
	ws   *workspace.Workspace
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

// CreateRequest is a validated-by-Create request to create or reuse a sandbox.
type CreateRequest struct {
	Name     string
	Template string // "" = default
	TTL      *time.Duration
	Tags     map[string]string
	Reuse    bool
	// Isolation is the level asked for instead of the template's ("" = the template's); it may
	// raise the template's level, never lower it.
	Isolation string
}

// Create creates the named sandbox, or reuses it (resuming it when stopped) when req.Reuse. It returns
// once the sandbox is running (or failed).
func (m *Manager) Create(ctx context.Context, c Caller, req CreateRequest) (store.Record, store.Outcome, error) {
	if err := ValidateName(req.Name); err != nil {
		return store.Record{}, "", err
	}
	if req.Template == "" {
		req.Template = "default"
	}
	tmpl, ok := m.cfg.Templates[req.Template]
	if !ok {
		return store.Record{}, "", protocol.Errorf(protocol.CodeUnknownTemplate, "template %q does not exist on this broker", clip(req.Template))
	}
	tmpl, err := withIsolation(m.cfg.Provider, tmpl, req.Isolation)
	if err != nil {
		return store.Record{}, "", err
	}
	ttl := m.cfg.DefaultTTL
	if req.TTL != nil {
		ttl = *req.TTL
	}
	if err := ValidateTTL(ttl, m.cfg.MaxTTL); err != nil {
		return store.Record{}, "", err
	}
	if err := ValidateTags(req.Tags); err != nil {
		return store.Record{}, "", err
	}
	now := m.now()
	rec := store.Record{
		ID: protocol.NewSandboxID(), Org: c.Org, Name: req.Name, Template: req.Template,
		Provider: provider.Runner(m.cfg.Provider, tmpl), Node: m.cfg.Node, Status: protocol.StatusProvisioning,
		Tags: req.Tags, TTL: ttl, CreatedAt: now, CreatedBy: c.Actor, Heartbeat: now,
	}
	// A sandbox from the template's warm pool, when it has one ready, is already started and set up:
	// the create only records it (pool.go).
	// Pooled sandboxes run at their template's own level: a create that raised it never takes one.
	var pd *pooled
	if provider.LevelOf(tmpl) == provider.LevelOf(m.cfg.Templates[req.Template]) {
		pd = m.pool.take(req.Template)
	}
	if pd != nil {
		defer m.pool.settled(pd)
		if cerr := m.pool.claim(ctx, c.Org, pd); cerr != nil {
			m.cfg.Log.Warn("claiming a pooled sandbox failed; starting one", "sandbox_id", pd.id, "err", cerr)
			pd = nil
		} else {
			rec.ID, rec.UID = pd.id, pd.uid
		}
	}
	if pd == nil {
		// The index entry comes first: a crash after the record is written must still leave a
		// trace on this node for Recover to find.
		if err := m.index(rec.ID, c.Org); err != nil {
			return store.Record{}, "", err
		}
		// The uid is taken before the record exists, so that the record never lacks it; a create
		// that ends up reusing another sandbox gives it back.
		if rec.UID, err = m.allocateUID(ctx, c.Org, rec.ID); err != nil {
			// With every uid taken, a reuse of a sandbox that exists still works: it needs none.
			var pe *protocol.Error
			capacity := errors.As(err, &pe) && pe.Code == protocol.CodeCapacity
			if _, gerr := m.cfg.Store.Get(ctx, c.Org, req.Name); !capacity || !req.Reuse || gerr != nil {
				m.unindex(rec.ID)
				return store.Record{}, "", err
			}
		}
	}
	// Held from before the record may exist until its start ends: the record, or the stopped one
	// this create resumes (claimed by this id), is not settled under it (settle.go).
	defer m.holdStart(rec.ID)()
	got, outcome, err := m.createOrReuse(ctx, rec, req.Reuse)
	unknown := errors.Is(err, errUnknownOutcome)
	if err != nil || got.ID != rec.ID {
		switch {
		case pd != nil:
			m.pool.unclaim(ctx, c.Org, pd, err) // an unknown outcome keeps its uid and index entry (pool.hold)
		case !unknown:
			m.unindex(rec.ID)
			m.releaseUID(context.WithoutCancel(ctx), rec)
		}
	}
	if unknown {
		// The record may exist: its uid and the index entry stay, rather than go to another
		// sandbox, and the reconcile settles a record left provisioning (settle.go).
		m.watchUnsettled(c.Org, rec.ID, pd == nil) // a pooled one's index entry is recoverPooled's
		if req.Reuse {
			// It may have claimed a stopped one to resume, by this create's id.
			m.watchUnsettled(c.Org, req.Name, false)
			m.ownClaim(rec.ID)
		}
		m.cfg.Log.Error("Redis lost every answer to a create: whether the record exists is unknown", "sandbox_id", rec.ID, "org", rec.Org, "err", err)
		return store.Record{}, "", protocol.Errorf(protocol.CodeUnavailable,
			"Redis did not answer the create of sandbox %q, so whether it was made is unknown: once Redis is back, `sbctl get %s` tells; one left provisioning is marked failed within seconds (then delete it)",
			clip(req.Name), clip(req.Name))
	}
	if err != nil {
		return store.Record{}, "", m.mapStoreErr(err, req.Name)
	}
	switch outcome {
	case protocol.OutcomeCreated:
		if pd != nil {
			got, err = m.adopt(ctx, c, got, pd)
		} else {
			got, err = m.provision(ctx, c, got, tmpl, true)
		}
		if err == nil {
			m.emit(c, got, protocol.EventCreated, nil)
		}
	case protocol.OutcomeResumed:
		got, err = m.start(ctx, c, got)
	case protocol.OutcomeReused:
		got, err = m.waitSettled(ctx, c.Org, got)
		if err == nil && got.Status == protocol.StatusFailed {
			// It failed while this call waited (its start was cut short): as if found failed.
			return got, outcome, m.mapStoreErr(&store.StateError{Status: got.Status}, req.Name)
		}
		if err == nil && got.Status == protocol.StatusRunning {
			// Reuse is an owner call: it renews the lease.
			if l, lerr := m.cfg.Store.Heartbeat(ctx, c.Org, got.ID); lerr == nil {
				got.ExpiresAt, got.Heartbeat = l.ExpiresAt, m.now()
			}
		}
		if err == nil {
			m.emit(c, got, protocol.EventReused, nil)
		}
	}
	return got, outcome, err
}

// provision starts a record that is provisioning on this node: the provider's Create (first time
// only), Start, the template's setup command (first time only), then running. Failures leave the
// sandbox failed (first time) or stopped (resume) with the reason recorded.
func (m *Manager) provision(ctx context.Context, c Caller, rec store.Record, tmpl provider.Template, first bool) (store.Record, error) {
	defer m.holdStart(startKey(rec))() // whoever asked (a remote resume, Recover) is held too
	h := m.hostedFor(rec.ID, rec.Org)
	h.mu.Lock()
	defer h.mu.Unlock()
	// Provisioning must finish even if the client that asked goes away: others wait on it.
	ctx = context.WithoutCancel(ctx)
	if !first {
		// A sandbox keeps the level it was created at, whatever its template says now.
		if level := provider.RecordedIsolation(rec.Provider); level != "" {
			tmpl.Isolation = level
		}
	}
	spec := provider.Spec{ID: rec.ID, Template: tmpl, UID: rec.UID, Org: rec.Org, Name: rec.Name}
	// fail records why (for the owner, on the record) and emits code (the event carries no text).
	fail := func(code, why string, cause error) (store.Record, error) {
		m.cfg.Log.Error("sandbox provisioning failed", "sandbox_id", rec.ID, "org", rec.Org, "why", why, "err", cause)
		if h.inst != nil {
			h.inst.Stop(ctx)
			h.inst = nil
		}
		h.closeWorkspace()
		to, reason := protocol.StatusFailed, code
		fields := map[string]string{store.FieldFailure: why}
		if !first {
			to = protocol.StatusStopped
			fields[store.FieldStopReason] = protocol.StopRuntimeLost
			reason = protocol.StopRuntimeLost
		}
		got, err := m.cfg.Store.Transition(ctx, rec.Org, rec.ID, store.Transition{
			From: []string{protocol.StatusProvisioning}, To: to, Fields: fields})
		if err != nil {
			return rec, err
		}
		m.emit(c, got, map[bool]string{true: protocol.EventFailed, false: protocol.EventStopped}[first], func(e *protocol.Event) {
			e.Reason = reason
		})
		return got, protocol.Errorf(protocol.CodeSandboxFailed, "sandbox %s could not start: %s", rec.Name, why)
	}
	fields := map[string]string{store.FieldProvider: provider.Runner(m.cfg.Provider, tmpl)}
	if rec.UID == 0 && m.cfg.UIDs.Size() > 0 {
		// A sandbox recorded before each got its own uid gets one now; the provider gives it its
		// files. Keeping it on the shared uid would keep it sharing keyrings and limits with every
		// other such sandbox. A failure here leaves the sandbox as it was, to start again later.
		uid, err := m.allocateUID(ctx, rec.Org, rec.ID)
		if err != nil {
			return fail(protocol.ReasonStartFailed, "no host uid for it: "+err.Error(), err)
		}
		rec.UID, spec.UID = uid, uid
		fields[store.FieldUID] = strconv.Itoa(uid)
		if h.ws != nil { // opened for the shared uid
			h.ws.Close()
			h.ws = nil
		}
	}
	started := time.Now()
	if first {
		if err := m.cfg.Provider.Create(ctx, spec); err != nil {
			return fail(protocol.ReasonCreateFailed, "the provider could not create it", err)
		}
	}
	// A remote provider's workspace is not here (and holds no upload temporaries of a broker).
	if !provider.IsRemote(m.cfg.Provider) {
		if _, err := m.openWorkspace(ctx, h, rec, true); err != nil {
			m.cfg.Log.Warn("opening the workspace to sweep it failed", "sandbox_id", rec.ID, "err", err)
		}
	}
	inst, err := m.cfg.Provider.Start(ctx, spec)
	if err != nil {
		return fail(protocol.ReasonStartFailed, "the provider could not start it: "+err.Error(), err)
	}
	h.inst = inst
	if first {
		m.firstStarts.n.Add(1)
		m.firstStarts.nanos.Add(int64(time.Since(started)))
	}
	if pl, ok := inst.(placed); ok {
		b, _ := json.Marshal(protocol.Placement{Node: pl.Node(), Pod: pl.Pod()})
		fields[store.FieldPlacement] = string(b)
	}
	if first && tmpl.Setup != "" {
		if why := runSetup(ctx, inst, tmpl.Setup); why != "" {
			return fail(protocol.ReasonSetupFailed, why, nil)
		}
	}
	// The record names the provider that runs the sandbox now: after a data dir moved providers, the
	// one it was created with would claim an isolation it no longer has.
	return m.markRunning(ctx, rec, h, inst, fields)
}

// markRunning records a sandbox that is provisioning as running, with fields, and watches its
// runtime. When the record moved meanwhile (deleted, or the store failed), the other action wins:
// the runtime stops and the record's own path cleans up. The caller holds h.mu.
func (m *Manager) markRunning(ctx context.Context, rec store.Record, h *hosted, inst provider.Instance, fields map[string]string) (store.Record, error) {
	got, err := m.cfg.Store.Transition(ctx, rec.Org, rec.ID, store.Transition{
		From: []string{protocol.StatusProvisioning}, To: protocol.StatusRunning, Fields: fields})
	if err != nil {
		inst.Stop(ctx)
		h.inst = nil
		h.closeWorkspace()
		return rec, m.mapStoreErr(err, rec.Name)
	}
	go m.watch(rec.Org, rec.ID, h, inst)
	return got, nil
}

// ProviderStarts is how many sandboxes the provider created and started for creates on this broker
// (neither warm-pool fills nor claims), and the time that took, from its Create until its Start
// returned (the workspace's sweep between them included).
func (m *Manager) ProviderStarts() (n int64, took time.Duration) {
	return m.firstStarts.n.Load(), time.Duration(m.firstStarts.nanos.Load())
}

// placed is an instance that runs elsewhere and says where (the kubernetes provider's pod).
type placed interface {
	Node() string
	Pod() string
}

// allocateUID takes a host uid for the sandbox from the range, or answers 0 when there is none.
func (m *Manager) allocateUID(ctx context.Context, org, id string) (int, error) {
	if m.cfg.UIDs.Size() == 0 {
		return 0, nil
	}
	uid, err := m.cfg.Store.AllocateUID(ctx, m.cfg.UIDs, org, id)
	if errors.Is(err, store.ErrUIDsExhausted) {
		m.cfg.Log.Error("no sandbox uid left", "sandbox_id", id, "first", m.cfg.UIDs.First, "last", m.cfg.UIDs.Last)
		return 0, protocol.Errorf(protocol.CodeCapacity,
			"the broker has no host uid left for a new sandbox (all %d of its --sandbox-uids range are in use): delete sandboxes you no longer need, or ask the operator to widen the range",
			m.cfg.UIDs.Size())
	}
	return uid, err
}

// releaseUID gives back the uid of a sandbox that never came to exist.
func (m *Manager) releaseUID(ctx context.Context, rec store.Record) {
	if err := m.cfg.Store.ReleaseUID(ctx, rec.Org, rec.ID); err != nil {
		m.cfg.Log.Error("releasing the uid of a sandbox that was not created failed; it stays taken", "sandbox_id", rec.ID, "uid", rec.UID, "err", err)
	}
}

// runSetup runs the template's setup command and returns why it failed, or "".
func runSetup(ctx context.Context, inst provider.Instance, cmd string) string {
	var out tailBuffer
	res, err := inst.Exec(ctx, provider.ExecRequest{Command: cmd, Stdout: &out})
	if err != nil {
		return "setup command could not run: " + err.Error()
	}
	if res.ExitCode != 0 || res.Reason != "" {
		why := fmt.Sprintf("setup command exited %d", res.ExitCode)
		if res.Reason != "" {
			why += " (" + res.Reason + ")"
		}
		return why + ": " + out.String()
	}
	return ""
}

// watch notices an instance that ends without Stop (killed, crashed) and records it.
func (m *Manager) watch(org, id string, h *hosted, inst provider.Instance) {
	<-inst.Done()
	h.mu.Lock()
	lost := h.inst == inst
	if lost {
		h.inst = nil
		h.closeWorkspace()
	}
	h.mu.Unlock()
	m.mu.Lock()
	closing := m.closing
	m.mu.Unlock()
	if !lost || closing {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	reason := protocol.StopRuntimeLost
	if provider.EndReason(inst) == provider.ReasonMemoryLimit {
		reason = protocol.StopMemoryLimit
	}
	fields := map[string]string{store.FieldStopReason: reason}
	why := provider.EndMessage(inst)
	if why != "" {
		fields[store.FieldFailure] = why // the owner sees what happened, not only its code
	}
	rec, err := m.cfg.Store.Transition(ctx, org, id, store.Transition{
		From: []string{protocol.StatusRunning}, To: protocol.StatusStopped, Fields: fields})
	if err != nil {
		return
	}
	m.cfg.Log.Warn("sandbox processes ended on their own; sandbox stopped", "sandbox_id", id, "org", org, "reason", reason, "why", why)
	m.emit(Caller{Org: org, Actor: "broker"}, rec, protocol.EventStopped, func(e *protocol.Event) { e.Reason = reason })
}

// waitSettled waits while a sandbox is provisioning (another caller is starting it). One of this
// node's that no start holds is settled meanwhile (settle.go), rather than waited for in vain; one
// hosted by a node declared lost is not waited for (no start can come until it is back).
func (m *Manager) waitSettled(ctx context.Context, org string, rec store.Record) (store.Record, error) {
	for delay := time.Millisecond; rec.Status == protocol.StatusProvisioning; delay = min(delay*2, 50*time.Millisecond) {
		if rec.Node != m.cfg.Node && !rec.NodeLostAt.IsZero() {
			return rec, protocol.Errorf(protocol.CodeUnavailable,
				"sandbox %s is being started by broker %s, which was declared lost (silent for longer than --node-lost-after): it stays provisioning until that broker is back; retry then, or delete it",
				rec.Name, rec.Node)
		}
		select {
		case <-ctx.Done():
			return rec, ctx.Err()
		case <-time.After(delay):
		}
		got, err := m.cfg.Store.Get(ctx, org, rec.ID)
		if err != nil {
			return rec, m.mapStoreErr(err, rec.Name)
		}
		rec, _ = m.settleIfAbandoned(ctx, got)
	}
	return rec, nil
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

// Stop stops a running sandbox: every process ends, files stay. Stopping a stopped sandbox is a no-op.
func (m *Manager) Stop(ctx context.Context, c Caller, ref, reason string) (store.Record, error) {
	rec, err := m.cfg.Store.Transition(ctx, c.Org, ref, store.Transition{
		From: []string{protocol.StatusRunning}, To: protocol.StatusStopped,
		Fields: map[string]string{store.FieldStopReason: reason}})
	var se *store.StateError
	if errors.As(err, &se) && se.Status == protocol.StatusStopped {
		return m.Get(ctx, c.Org, ref)
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
func (m *Manager) stopLocal(ctx context.Context, rec store.Record) {
	if rec.Node != m.cfg.Node {
		m.notify(ctx, rec, cmdStop, "")
		return
	}
	h := m.hostedFor(rec.ID, rec.Org)
	h.mu.Lock()
	defer h.mu.Unlock()
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
	got, err := m.provision(ctx, c, rec, tmpl, false)
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
	// record: if this fails, the record stays deleting and the release is retried with it.
	if err := m.cfg.Store.ReleaseUID(ctx, rec.Org, rec.ID); err != nil {
		m.cfg.Log.Error("releasing the sandbox uid failed; it stays deleting and is retried at next start", "sandbox_id", rec.ID, "uid", rec.UID, "err", err)
		return fmt.Errorf("sandbox %s: release uid: %w", rec.ID, err)
	}
	if err := m.cfg.Store.Purge(ctx, rec); err != nil && !errors.Is(err, store.ErrWrongState) {
		return err
	}
	m.unindex(rec.ID)
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
