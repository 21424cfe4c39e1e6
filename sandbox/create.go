package sandbox

// Creating a sandbox: Create (new, or reused and resumed), its provisioning on this node (a uid, the
// provider's files and instance, the template's setup), the watch that settles the record when the
// instance ends, and the wait for a create under way elsewhere.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

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
		return store.Record{}, "", protocol.Errorf(protocol.CodeUnknownTemplate, "template %q does not exist on this broker; it has %s (the broker's --templates)",
			clip(req.Template), strings.Join(slices.Sorted(maps.Keys(m.cfg.Templates)), ", "))
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
	got, err := m.provisionClaim(ctx, c, rec, tmpl, first)
	if errors.Is(err, errStartedAlready) {
		return got, nil
	}
	return got, err
}

// errStartedAlready is provisionClaim's answer when another start of the same claim started the
// sandbox: the record it answers is running, and this start did nothing (so it says nothing: no
// second resumed event).
var errStartedAlready = errors.New("another start of this claim started it")

// provisionClaim is provision, answering errStartedAlready (with the running record) when another
// start of the same claim took the lifecycle lock first and started the sandbox.
func (m *Manager) provisionClaim(ctx context.Context, c Caller, rec store.Record, tmpl provider.Template, first bool) (store.Record, error) {
	defer m.holdStart(startKey(rec))() // whoever asked (a remote resume, Recover) is held too
	h := m.hostedFor(rec.ID, rec.Org)
	h.mu.Lock()
	defer h.mu.Unlock()
	// Provisioning must finish even if the client that asked goes away: others wait on it.
	ctx = context.WithoutCancel(ctx)
	if h.destroyed {
		// A delete took the lock first and removed the sandbox: its record, files and uid are
		// gone, and this start's would never be released.
		return rec, m.mapStoreErr(store.ErrNotFound, rec.Name)
	}
	if h.inst != nil && rec.Claim != "" && h.claim == rec.Claim {
		// Another start of this claim took the lock first (a resume's own and a reconcile's for
		// the record it found provisioning): its runtime is this start's, and ending it would
		// end whatever the sandbox ran since.
		now, err := m.cfg.Store.Get(ctx, rec.Org, rec.ID)
		if err != nil {
			return rec, m.mapStoreErr(err, rec.Name)
		}
		select {
		case <-h.inst.Done():
		default:
			if now.Status == protocol.StatusRunning && now.Claim == rec.Claim {
				return now, errStartedAlready
			}
		}
	}
	if h.inst != nil {
		// A stop's transition landed and this resume took the lock before the stop ended the
		// runtime (stopLocal then leaves it to us): end it here, as the stop would have.
		if err := h.inst.Stop(ctx); err != nil {
			m.cfg.Log.Error("stopping sandbox processes", "sandbox_id", rec.ID, "err", err)
		}
		h.inst = nil
	}
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
	// Held from before the runtime exists (a uid drawn by an earlier run of the broker is entered
	// here, or at Recover): a create drawing a uid from a Redis that lost its table meanwhile must
	// find this one taken. One that another sandbox here holds is never run as twice.
	if !m.holdUID(rec) {
		return fail(protocol.ReasonStartFailed, "its host uid is held by another sandbox on this broker (Redis lost its data?); the broker's log names both for the operator", nil)
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
	m.runtimeFields(inst, fields)
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
		// The move may have landed with its answer lost: the Redis client's resend then finds the
		// record running, or every try's answer was lost. While this start holds the lifecycle lock
		// nobody else moves the record to running, so finding it running, under this start's
		// claim, is finding the move done.
		if now, rerr := m.cfg.Store.Get(ctx, rec.Org, rec.ID); rerr == nil && now.Status == protocol.StatusRunning && now.Claim == rec.Claim {
			got, err = now, nil
		}
	}
	if err != nil {
		inst.Stop(ctx)
		h.inst = nil
		h.closeWorkspace()
		return rec, m.mapStoreErr(err, rec.Name)
	}
	h.claim = rec.Claim
	go m.watch(rec.Org, rec.ID, h, inst)
	return got, nil
}

// ProviderStarts is how many sandboxes the provider created and started for creates on this broker
// (neither warm-pool fills nor claims), and the time that took, from its Create until its Start
// returned (the workspace's sweep between them included).
func (m *Manager) ProviderStarts() (n int64, took time.Duration) {
	return m.firstStarts.n.Load(), time.Duration(m.firstStarts.nanos.Load())
}

// runtimeFields adds to fields what a started runtime tells its record: where a provider that
// places sandboxes elsewhere put it, and a remote runtime's PATH, which the broker cannot know
// before it runs (an image's) and every broker's mint checks an allowlist against (SearchPath).
func (m *Manager) runtimeFields(inst provider.Instance, fields map[string]string) {
	if pl, ok := inst.(placed); ok {
		b, _ := json.Marshal(protocol.Placement{Node: pl.Node(), Pod: pl.Pod()})
		fields[store.FieldPlacement] = string(b)
	}
	if provider.IsRemote(m.cfg.Provider) {
		fields[store.FieldSearchPath] = inst.Environment()["PATH"] // "": it reported none
	}
}

// placed is an instance that runs elsewhere and says where (the kubernetes provider's pod).
type placed interface {
	Node() string
	Pod() string
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
