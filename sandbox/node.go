package sandbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// Sandboxes live on the broker (node) whose disk holds their files. Any broker may change a record;
// the hosting node makes its runtimes match: at once when told over its Redis channel, and by a
// periodic reconcile that covers lost messages.

type nodeCmd struct {
	Cmd string `json:"cmd"`
	Org string `json:"org"`
	ID  string `json:"id"`
	// Actor asked for a start; the hosting broker's resumed event names them.
	Actor string `json:"actor,omitempty"`
}

const (
	cmdStop    = "stop"
	cmdStart   = "start"
	cmdDestroy = "destroy"
)

// Remote starts: how long a resume waits for the hosting broker, and how often it asks again
// meanwhile (a pub/sub message can be lost, and the reconcile loop starts nothing by itself).
const (
	remoteStartWait  = 30 * time.Second
	remoteStartAgain = 2 * time.Second
)

// notify sends cmd to the broker hosting rec; actor is who asked, for a start ("" otherwise).
func (m *Manager) notify(ctx context.Context, rec store.Record, cmd, actor string) {
	msg, _ := json.Marshal(nodeCmd{Cmd: cmd, Org: rec.Org, ID: rec.ID, Actor: actor})
	if err := m.cfg.Store.Publish(ctx, store.NodeChannel(rec.Node), string(msg)); err != nil {
		m.cfg.Log.Warn("could not notify the hosting broker; its reconcile will catch up", "sandbox_id", rec.ID, "node", rec.Node, "err", err)
	}
}

// Run serves commands for this node and reconciles every interval until ctx ends. Commands and
// reconciles run one at a time, on this goroutine. When Redis cannot be subscribed to at first, it
// tries again at every reconcile.
func (m *Manager) Run(ctx context.Context, interval time.Duration) {
	msgs := make(chan string, 128)
	follow := func() bool {
		err := m.cfg.Store.Follow(ctx, store.NodeChannel(m.cfg.Node), func(payload string) {
			select {
			case msgs <- payload:
			case <-ctx.Done():
			}
		})
		if err != nil && ctx.Err() == nil {
			m.cfg.Log.Warn("cannot follow this node's commands yet; the periodic reconcile covers them meanwhile", "err", err)
		}
		return err == nil
	}
	following := follow()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case payload := <-msgs:
			var c nodeCmd
			if json.Unmarshal([]byte(payload), &c) == nil {
				startBy := ""
				if c.Cmd == cmdStart {
					startBy = cmp.Or(c.Actor, "broker")
				}
				m.reconcileOne(ctx, c.Org, c.ID, startBy)
			}
		case <-tick.C:
			if !following {
				following = follow()
			}
			m.reconcileAll(ctx)
		}
	}
}

// recoverReconcileWithin bounds Recover's reconcile of the provider's runtimes.
const recoverReconcileWithin = time.Minute

// Recover makes this node's runtimes match the records after a broker start: running sandboxes come
// back running with a fresh init on the same files (their processes were lost, and the record says
// so), unless their lease ran out meanwhile (they stay stopped, ttl_expired), half-done deletions
// finish, a half-done resume is stopped again and a half-done create fails. A runtime that outlived
// the broker (a pod) is taken back as it is, processes and all, when it proves itself (outlive.go);
// one whose sandbox no longer runs is ended.
func (m *Manager) Recover(ctx context.Context) error {
	entries, err := os.ReadDir(m.cfg.IndexDir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		org, err := os.ReadFile(m.cfg.IndexDir + "/" + e.Name())
		if err != nil {
			continue
		}
		if pooled, _, _ := parsePooledIndex(string(org)); pooled {
			m.recoverPooled(ctx, e.Name(), string(org))
			continue
		}
		m.recoverOne(ctx, string(org), e.Name())
	}
	m.recoverUnclaimed(ctx)
	if r, ok := m.cfg.Provider.(provider.Reconciler); ok {
		// Runtimes that outlived the broker (pods) of sandboxes stopped, failed or deleted by
		// another broker while this one was away end now, not at the first reconcile; within a
		// bound, since a throttling API server is retried for as long as the context lasts (the
		// periodic reconcile finishes what this one could not).
		rctx, cancel := context.WithTimeout(ctx, recoverReconcileWithin)
		m.reconcileRuntimes(rctx, r)
		cancel()
	}
	return nil
}

// recoverUnclaimed ends the runtimes a provider holds for this broker with no owner (pooled pods)
// that the index does not list: an earlier broker on this node lost its data dir with them. Their
// files stay, as for any runtime with no record: a claim whose labelling failed looks the same, and
// files are never deleted on a missing record's word. Run before the pool fills.
func (m *Manager) recoverUnclaimed(ctx context.Context) {
	cl, ok := m.cfg.Provider.(provider.Claimer)
	r, rok := m.cfg.Provider.(provider.Reconciler)
	if !ok || !rok {
		return
	}
	ids, err := cl.Unclaimed(ctx)
	if err != nil {
		m.cfg.Log.Warn("listing the provider's pooled runtimes left by an earlier broker failed", "err", err)
		return
	}
	for _, id := range ids {
		if _, err := os.Stat(filepath.Join(m.cfg.IndexDir, id)); err == nil {
			continue // recovered above
		}
		m.cfg.Log.Warn("ending a pooled runtime an earlier broker on this node left without a trace in its data dir; its files are kept (delete them by hand)", "sandbox_id", id)
		if err := r.EndRuntime(ctx, id); err != nil {
			m.cfg.Log.Error("ending a pooled runtime left by an earlier broker failed", "sandbox_id", id, "err", err)
		}
	}
}

func (m *Manager) recoverOne(ctx context.Context, org, id string) {
	log := m.cfg.Log.With("sandbox_id", id, "org", org)
	c := Caller{Org: org, Actor: "broker"}
	rec, err := m.cfg.Store.Get(ctx, org, id)
	switch {
	case errors.Is(err, store.ErrNotFound):
		m.recordMissing(ctx, org, id)
		return
	case err != nil:
		log.Error("recover: cannot read record", "err", err)
		return
	case rec.Node != m.cfg.Node:
		return
	}
	// Its uid, drawn by an earlier run of the broker, is held here until its destroy (uids.go),
	// whatever its state: its files belong to it, and it may be started again. Its entry puts it
	// among the sandboxes the reconcile reads, as one this run made: a delete or stop by another
	// broker whose message is lost is then still carried out here.
	m.holdUID(rec)
	m.hostedFor(id, org)
	switch rec.Status {
	case protocol.StatusDeleting:
		if m.destroy(ctx, rec) == nil {
			m.emit(c, rec, protocol.EventDeleted, nil)
		}
	case protocol.StatusProvisioning:
		// A start cut short: a resume goes back to stopped, a first create fails.
		m.settleCutShort(ctx, rec, "the broker restarted while the sandbox was being created; delete it and create it again", protocol.ReasonBrokerRestart)
	case protocol.StatusRunning:
		if !rec.ExpiresAt.IsZero() && m.expireOnRecover(ctx, c, rec) {
			return
		}
		if m.readopt(ctx, rec) {
			return // its runtime ran on while the broker was away (outlive.go)
		}
		got, err := m.cfg.Store.Transition(ctx, org, id, store.Transition{
			From: []string{protocol.StatusRunning}, To: protocol.StatusProvisioning, Claim: m.newClaim(),
			Fields: map[string]string{store.FieldLost: strconv.FormatInt(m.now().UnixMilli(), 10)}})
		if err != nil {
			return
		}
		tmpl, ok := m.cfg.Templates[got.Template]
		if !ok {
			tmpl = m.cfg.Templates["default"]
		}
		if got, err = m.provision(ctx, c, got, tmpl, false); err == nil {
			log.Info("sandbox restarted after a broker restart; its processes were lost")
			m.emit(c, got, protocol.EventResumed, func(e *protocol.Event) { e.Reason = protocol.ReasonBrokerRestart })
		}
	}
}

// expireOnRecover stops a sandbox whose lease ran out while this broker was down, instead of
// bringing it back with a fresh lease: its owner stopped heartbeating, or could not reach any broker,
// and a restart must not renew what the owner did not. Its processes are gone already; the record
// says stopped, ttl_expired, with an expiring event first as for any expiry. A heartbeat through
// another broker that lands first wins: the stop re-checks the deadline on the lease clock. It
// reports whether it stopped the sandbox.
func (m *Manager) expireOnRecover(ctx context.Context, c Caller, rec store.Record) bool {
	got, err := m.cfg.Store.Transition(ctx, rec.Org, rec.ID, store.Transition{
		From: []string{protocol.StatusRunning}, To: protocol.StatusStopped, IfExpired: true,
		Fields: map[string]string{store.FieldStopReason: protocol.StopTTLExpired,
			store.FieldLost: strconv.FormatInt(m.now().UnixMilli(), 10)}})
	if err != nil {
		return false
	}
	var left int64
	m.emit(c, rec, protocol.EventExpiring, func(e *protocol.Event) { e.SecondsLeft = &left })
	m.emit(c, got, protocol.EventStopped, func(e *protocol.Event) { e.Reason = protocol.StopTTLExpired })
	m.cfg.Log.Info("sandbox's lease ran out while the broker was down: it stays stopped (ttl_expired), files kept",
		"sandbox_id", rec.ID, "org", rec.Org, "expired_at", rec.ExpiresAt)
	return true
}

// recordMissing handles a sandbox indexed here whose record Redis does not have. Files come after
// the record, so with no files it is a create that crashed in between: drop the index entry. With
// files, Redis lost data (flushed, replaced, restored from an old snapshot): stop the runtime but
// keep the files and the index entry, and say so at every start, because deleting them on Redis'
// word would lose work.
func (m *Manager) recordMissing(ctx context.Context, org, id string) {
	dir := m.cfg.Provider.WorkspaceDir(provider.Spec{ID: id})
	if !m.filesToKeep(ctx, org, id, dir) {
		return
	}
	h := m.hostedFor(id, org)
	h.mu.Lock()
	h.release(ctx)
	h.mu.Unlock()
	m.mu.Lock()
	delete(m.host, id)
	m.mu.Unlock()
	m.keepUID(ctx, org, id, dir)
	m.cfg.Log.Warn("a sandbox on this broker has no record in Redis (was Redis flushed or replaced?): its files are kept; "+
		"copy out what you need, then remove the directory and its index entry",
		"sandbox_id", id, "org", org, "files", dir, "index_entry", filepath.Join(m.cfg.IndexDir, id))
}

// filesToKeep reports whether the sandbox id with no record has files (dir) for recordMissing to
// keep. With none, it is a create that crashed before its files, or whose record Redis lost: its
// uid (in Redis too: its create drew it before the record, and nothing else would give it back),
// index entry and hosted entry go; a release Redis does not answer leaves them for the next look.
// A start holds the lifecycle lock from before the provider makes the files until its last write:
// one under way (Redis lost the record it just made) keeps the uid, since its runtime may run as it
// (the template's setup) until the record's loss ends it; nor is anything dropped while a runtime
// of it runs here (a remote provider's files are not here). The next reconcile looks again.
func (m *Manager) filesToKeep(ctx context.Context, org, id, dir string) bool {
	m.mu.Lock()
	h := m.host[id]
	m.mu.Unlock()
	if h != nil {
		if !h.mu.TryLock() {
			return false
		}
		defer h.mu.Unlock()
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		return true
	}
	if h != nil && h.inst != nil {
		return false
	}
	if err := m.cfg.Store.ReleaseUID(ctx, org, id); err != nil {
		m.cfg.Log.Warn("releasing the uid of a sandbox with no record and no files failed; trying again later", "sandbox_id", id, "err", err)
		return false
	}
	m.uids.drop(id) // nothing ran as it: no runtime starts before its files
	m.unindex(id)
	if h != nil {
		// An entry a late request made (it read the record before a delete), or a start's whose
		// record Redis lost: the sandbox is gone, and the reconcile need not read it again.
		h.destroyed = true
		m.mu.Lock()
		if m.host[id] == h {
			delete(m.host, id)
		}
		m.mu.Unlock()
	}
	return false
}

// keepUID holds the uid that the kept files of a sandbox with no record belong to, in Redis and in
// the broker's table: had Redis lost the uid table with the record, the uid would go to a new
// sandbox, which would then own them.
func (m *Manager) keepUID(ctx context.Context, org, id, ws string) {
	var st syscall.Stat_t
	if m.cfg.UIDs.Size() == 0 || syscall.Lstat(ws, &st) != nil {
		m.uids.drop(id)
		return
	}
	uid := int(st.Uid)
	if uid < m.cfg.UIDs.First || uid > m.cfg.UIDs.Last || uid == m.cfg.UIDs.Skip {
		m.uids.drop(id)
		return
	}
	m.uids.hold(org, id, uid)
	if _, err := m.cfg.Store.ReserveUID(ctx, uid, org, id); err != nil {
		m.cfg.Log.Error("the kept files of a sandbox with no record belong to a uid another sandbox now has: remove them",
			"sandbox_id", id, "org", org, "uid", uid, "files", ws, "err", err)
	}
}

// Reconcile runs one reconcile pass now; Run runs one every interval.
func (m *Manager) Reconcile(ctx context.Context) { m.reconcileAll(ctx) }

// reconcileAll checks every sandbox this node runs against its record, and settles the records its
// starts cut short left provisioning (settle.go).
func (m *Manager) reconcileAll(ctx context.Context) {
	m.mu.Lock()
	type pair struct{ org, id string }
	var all []pair
	for id, h := range m.host {
		all = append(all, pair{h.org, id})
	}
	m.mu.Unlock()
	for _, p := range all {
		m.reconcileOne(ctx, p.org, p.id, "")
	}
	m.settleUnsettled(ctx)
	if r, ok := m.cfg.Provider.(provider.Reconciler); ok {
		m.reconcileRuntimes(ctx, r)
	}
}

// reconcileRuntimes ends the runtimes a provider keeps for this broker (pods on a cluster) that no
// record wants: a sandbox whose record is gone (Redis lost it, or a delete crashed between the two)
// or that is stopped or failed. Files stay; a runtime a start or a stop is busy with is left alone.
func (m *Manager) reconcileRuntimes(ctx context.Context, r provider.Reconciler) {
	refs, err := r.Runtimes(ctx)
	if err != nil {
		m.cfg.Log.Warn("listing the provider's runtimes to reconcile them failed; trying again at the next reconcile", "err", err)
		return
	}
	for _, ref := range refs {
		h := m.hostedFor(ref.ID, ref.Org)
		h.mu.Lock()
		rec, err := m.cfg.Store.Get(ctx, ref.Org, ref.ID)
		why := ""
		switch {
		case errors.Is(err, store.ErrNotFound):
			why = "it has no record"
		case err != nil || rec.Node != m.cfg.Node:
		case h.inst == nil && (rec.Status == protocol.StatusStopped || rec.Status == protocol.StatusFailed):
			why = "it is " + rec.Status
		}
		if why != "" {
			m.cfg.Log.Warn("ending the runtime of a sandbox that should have none (its files are kept)", "sandbox_id", ref.ID, "org", ref.Org, "why", why)
			if err := r.EndRuntime(ctx, ref.ID); err != nil {
				m.cfg.Log.Error("ending an orphan runtime failed; trying again at the next reconcile", "sandbox_id", ref.ID, "err", err)
			}
		}
		h.mu.Unlock()
		if why == "it has no record" {
			m.mu.Lock()
			if h.inst == nil {
				delete(m.host, ref.ID)
			}
			m.mu.Unlock()
		}
	}
}

// reconcileOne makes the local runtime of one sandbox match its record. A provisioning record is
// started only when another broker asked, for startBy: otherwise it is this node's own create or
// resume in progress, or one cut short (settleIfAbandoned).
func (m *Manager) reconcileOne(ctx context.Context, org, id, startBy string) {
	rec, err := m.cfg.Store.Get(ctx, org, id)
	if errors.Is(err, store.ErrNotFound) {
		m.recordMissing(ctx, org, id)
		return
	}
	if err != nil || rec.Node != m.cfg.Node {
		return
	}
	if rec.Status != protocol.StatusProvisioning {
		m.unseen(id)
	}
	switch rec.Status {
	case protocol.StatusStopped, protocol.StatusFailed:
		if !m.holdsNothing(id) {
			m.stopLocal(ctx, rec)
		}
	case protocol.StatusDeleting:
		m.destroy(ctx, rec)
	case protocol.StatusProvisioning:
		if startBy == "" {
			// This node's own start in progress, or one cut short: settled once none holds it.
			m.settleIfAbandoned(ctx, rec)
			return
		}
		h := m.hostedFor(id, org)
		if h.mu.TryLock() {
			// Read again under the lifecycle lock: a start that ran since the read above has
			// moved the record out of provisioning (a start holds the lock to its last write).
			// A runtime here under a record still claimed is the one its stop left to the start
			// (stopLocal), not a started one: provision ends it.
			now, err := m.cfg.Store.Get(ctx, org, id)
			h.mu.Unlock()
			if err == nil && now.Status == protocol.StatusProvisioning && now.Node == m.cfg.Node && now.Claim == rec.Claim {
				// Claimed for a resume by another broker: start it here. (A repeated ask finds
				// it locked, or running.)
				m.start(ctx, Caller{Org: org, Actor: startBy}, now)
			}
		}
	}
}

// holdsNothing reports whether sandbox id's entry here has neither a runtime nor an open workspace:
// a stopped sandbox's then needs no stop, nor stopLocal's second read of its record. Every stopped
// sandbox hosted here is reconciled on every pass, so that read would double the pass's Redis
// round trips. An entry a start or stop holds is not looked into: stopLocal waits for it.
func (m *Manager) holdsNothing(id string) bool {
	m.mu.Lock()
	h := m.host[id]
	m.mu.Unlock()
	if h == nil || !h.mu.TryLock() {
		return false
	}
	defer h.mu.Unlock()
	return h.inst == nil && h.ws == nil
}

// Close stops every runtime on this node without touching records: they are "running" still, and a
// restarted broker brings them back (with their processes lost, as it records). Runtimes that
// outlive the broker (pods) are let go of instead, still running, for the next start to take back
// (outlive.go). The warm pool's sandboxes are destroyed.
func (m *Manager) Close(ctx context.Context) {
	m.mu.Lock()
	m.closing = true
	hs := make([]*hosted, 0, len(m.host))
	for _, h := range m.host {
		hs = append(hs, h)
	}
	m.mu.Unlock()
	for _, h := range hs {
		h.mu.Lock()
		if !m.detach(h) {
			h.release(ctx)
		}
		h.mu.Unlock()
	}
	// Pooled sandboxes have no record to bring them back: they go with the broker.
	m.pool.close(ctx)
}

// Liveness: a broker renews its node record every beat; one silent for longer than lostAfter is
// declared lost by another broker, which marks the sandboxes it hosts (their view and heartbeats
// say node_status lost, and a node_lost event says so). The node's next beat reconciles them:
// it clears the marks and says node_returned.

// Liveness is one broker's node beat: what it registers and how long others may be silent.
type Liveness struct {
	// URL is the base URL clients reach this broker at.
	URL string
	// Every is the beat interval; LostAfter is the silence after which another node is lost.
	Every, LostAfter time.Duration

	// beatingSince is when this broker's beats last started to succeed (after its start or after a
	// failed beat): it declares no other node lost before it has itself beaten for LostAfter, so a
	// Redis outage that silenced every broker alike makes none of them lost.
	beatingSince time.Time
	// owesReturn: this node was declared lost and its sandboxes' marks are not all cleared yet.
	owesReturn bool
}

// RunLiveness beats every l.Every until ctx ends (the broker's start beats first, by itself).
func (m *Manager) RunLiveness(ctx context.Context, l *Liveness) {
	t := time.NewTicker(l.Every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			m.Beat(ctx, l)
		}
	}
}

// Beat renews this node's record (re-registering it after Redis lost its data), reconciles the
// marks of its own sandboxes if it had been declared lost, and declares lost the nodes silent for
// longer than l.LostAfter. It answers the error of the renewal only (the store logs outages; the
// next beat tries again).
func (m *Manager) Beat(ctx context.Context, l *Liveness) error {
	back, err := m.cfg.Store.RegisterNode(ctx, m.cfg.Node, l.URL)
	if err != nil {
		l.beatingSince = time.Time{}
		return err
	}
	if l.beatingSince.IsZero() {
		l.beatingSince = time.Now()
	}
	if back {
		m.cfg.Log.Warn("this broker had been declared lost by another (it was silent for longer than --node-lost-after); it serves its sandboxes again", "node", m.cfg.Node)
		l.owesReturn = true
	}
	if l.owesReturn && m.setNodeLost(ctx, m.cfg.Node, false) == nil {
		l.owesReturn = false
	}
	if time.Since(l.beatingSince) < l.LostAfter {
		return nil
	}
	lost, err := m.cfg.Store.DeclareLostNodes(ctx, m.cfg.Node, l.LostAfter)
	if err != nil {
		return nil
	}
	for _, node := range lost {
		m.cfg.Log.Warn("a broker stopped renewing its liveness record: declared lost; its sandboxes say node_status lost until it is back",
			"node", node, "silent_for_more_than", l.LostAfter)
		m.setNodeLost(ctx, node, true)
		// The node may have come back during the marking, and cleared the marks before they were
		// all set: clear what is left, as it would have.
		if still, err := m.cfg.Store.NodeLost(ctx, node); err == nil && !still {
			m.setNodeLost(ctx, node, false)
		}
	}
	return nil
}

// setNodeLost marks (lost) or clears the node-lost mark of every sandbox node hosts, each with its
// event. It walks every org's sandboxes: nodes are lost rarely, and there is no per-node index.
func (m *Manager) setNodeLost(ctx context.Context, node string, lost bool) error {
	orgs, err := m.cfg.Store.Orgs(ctx)
	if err != nil {
		return err
	}
	typ := protocol.EventNodeReturned
	if lost {
		typ = protocol.EventNodeLost
	}
	var firstErr error
	for _, org := range orgs {
		recs, err := m.cfg.Store.ListAll(ctx, org, store.Filter{})
		if err != nil {
			firstErr = cmp.Or(firstErr, err)
			continue
		}
		for _, r := range recs {
			if r.Node != node || r.NodeLostAt.IsZero() == !lost {
				continue
			}
			got, changed, err := m.cfg.Store.MarkNodeLost(ctx, org, r.ID, node, lost)
			if err != nil {
				firstErr = cmp.Or(firstErr, err)
				continue
			}
			if changed {
				m.emit(Caller{Org: org, Actor: "broker"}, got, typ, nil)
			}
		}
	}
	return firstErr
}
