package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// The warm pool keeps, per template with a pool (provider.Template.Pool), a few sandboxes started and
// set up on this broker, so that a create claims one (a few Redis round trips) instead of starting
// one (bwrap, the init, cgroups, the template's setup: tens of milliseconds, more under load).
//
// A pooled sandbox belongs to no org: it has no record in Redis, so no org lists, counts or reaches
// it, and its host uid is held under store.PoolOrg. It lives only in this broker's memory and in
// its index entry (content "~pool\n<template>"), so only this broker can hand it out, and another
// broker on the same Redis never can: there is nothing of it to claim there. A claim is, in order:
//
//  1. take it from the pool (under the pool's mutex: two creates never take the same one);
//  2. mark its index entry with the claiming org ("~pool\n<template>\n<org>"), so that a crash from
//     here on is recovered either as the org's sandbox (its record exists) or as a pool leftover
//     (the mark stays: Recover turns it into the org's plain entry);
//  3. move its uid to the org's sandbox (store.TransferUID, atomic), overlapping step 2;
//  4. create the record with its id (store.CreateOrReuse: the name index, the org's max_sandboxes
//     and max_running count it from here, atomically with the name);
//  5. record it running and hand it to the lifecycle like any sandbox.
//
// A claim that loses the name to a concurrent create (reused), or that a limit refuses, moves the
// uid back and returns the sandbox to the pool untouched: nobody saw it. A claim cut by a store
// error whose outcome is unknown (Redis blinked) discards the sandbox (processes, files, uid) rather
// than risk handing it out twice; the pool makes another. A pooled sandbox is used once: it is
// never returned to the pool after an org had it, so its workspace is empty and its uid its own.
//
// Stopping the broker destroys the pooled sandboxes (their processes end with the broker anyway);
// an entry a crash left behind is destroyed by Recover at the next start.

// poolRetryMax bounds the back-off after failed fills of one template.
const poolRetryMax = 30 * time.Second

// pooled is one sandbox waiting in the pool.
type pooled struct {
	id, template string
	uid          int
	h            *hosted // its instance and workspace; h.org is store.PoolOrg until adopted
	// held: its claim's create has an unknown outcome, so its uid and index entry stay for the
	// record it may have made; only its runtime and files go (hold), and a leftover is retried so.
	held bool
}

// pool is the Manager's warm pool.
type pool struct {
	m    *Manager
	mu   sync.Mutex
	tmpl map[string]*poolState
	kick chan struct{} // wakes the filler
	// closed: Close ran; nothing enters the pool any more.
	closed bool
	// leftovers are pooled sandboxes whose removal failed (the store or the provider failed);
	// the filler retries. Their uids stay in the Manager's table until it succeeds.
	leftovers []*pooled
}

type poolState struct {
	size       int
	ready      []*pooled
	starting   int
	claiming   int   // taken by creates not finished yet: each may come back (settled)
	claims     int64 // creates served from the pool
	misses     int64 // creates that found it empty
	fillErrors int64
	fails      int       // consecutive failed fills
	retryAt    time.Time // no fill before this after failures
}

// PoolStat is one template's pool as operators see it (/metrics, /readyz).
type PoolStat struct {
	Template   string `json:"template"`
	Size       int    `json:"size"`
	Ready      int    `json:"ready"`
	Starting   int    `json:"starting"`
	Claims     int64  `json:"claims"`
	Misses     int64  `json:"misses"`
	FillErrors int64  `json:"fill_errors"`
}

func newPool(m *Manager) *pool {
	p := &pool{m: m, tmpl: map[string]*poolState{}, kick: make(chan struct{}, 1)}
	for name, t := range m.cfg.Templates {
		if t.Pool.Size > 0 {
			p.tmpl[name] = &poolState{size: t.Pool.Size}
		}
	}
	return p
}

// PoolStats reports every template's pool, by template name.
func (m *Manager) PoolStats() []PoolStat {
	p := m.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]PoolStat, 0, len(p.tmpl))
	for name, s := range p.tmpl {
		out = append(out, PoolStat{Template: name, Size: s.size, Ready: len(s.ready), Starting: s.starting,
			Claims: s.claims, Misses: s.misses, FillErrors: s.fillErrors})
	}
	slices.SortFunc(out, func(a, b PoolStat) int { return strings.Compare(a.Template, b.Template) })
	return out
}

func (p *pool) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// RunPool fills the templates' pools and keeps them full until ctx ends. Call it after Recover.
// Fills run one at a time: a start takes a core for milliseconds, and creates come first.
func (m *Manager) RunPool(ctx context.Context) {
	p := m.pool
	if len(p.tmpl) == 0 {
		// No template has a pool now, but Recover may have left an earlier run's pooled sandboxes
		// it could not remove (the store away): their uids stay taken in Redis until removed.
		for {
			p.retryLeftovers(ctx)
			p.mu.Lock()
			left := len(p.leftovers)
			p.mu.Unlock()
			if left == 0 || ctx.Err() != nil {
				return
			}
			timer := time.NewTimer(poolRetryMax)
			select {
			case <-ctx.Done():
			case <-timer.C:
			}
			timer.Stop()
		}
	}
	for ctx.Err() == nil {
		p.retryLeftovers(ctx)
		name, wait := p.next()
		if name == "" {
			timer := time.NewTimer(wait)
			select {
			case <-ctx.Done():
			case <-p.kick:
			case <-timer.C:
			}
			timer.Stop()
			continue
		}
		err := p.fill(ctx, name)
		p.mu.Lock()
		s := p.tmpl[name]
		s.starting--
		if err != nil && ctx.Err() == nil {
			s.fillErrors++
			s.fails++
			s.retryAt = time.Now().Add(min(time.Duration(1<<min(s.fails-1, 5))*time.Second, poolRetryMax))
		} else if err == nil {
			s.fails = 0
		}
		fails := s.fails
		p.mu.Unlock()
		if err != nil && ctx.Err() == nil {
			m.cfg.Log.Error("filling the warm pool failed; retrying later", "template", name, "consecutive_failures", fails, "err", err)
		}
	}
}

// next picks the template whose pool is furthest below its size and may be filled now, and marks
// one start for it; with none, it says how long to wait before looking again.
func (p *pool) next() (string, time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	best, deficit, wait := "", 0, poolRetryMax
	for name, s := range p.tmpl {
		d := s.size - len(s.ready) - s.starting - s.claiming
		if d <= 0 {
			continue
		}
		if now.Before(s.retryAt) {
			wait = min(wait, s.retryAt.Sub(now))
			continue
		}
		if d > deficit || d == deficit && name < best {
			best, deficit = name, d
		}
	}
	if best != "" {
		p.tmpl[best].starting++
	}
	return best, wait
}

// fill starts one sandbox of template name, runs its setup, and puts it in the pool.
func (p *pool) fill(ctx context.Context, name string) error {
	m := p.m
	tmpl := m.cfg.Templates[name]
	id := protocol.NewSandboxID()
	// The index entry comes first, as for any create: a crash leaves a trace for Recover.
	if err := m.indexPooled(id, name, ""); err != nil {
		return err
	}
	pd := &pooled{id: id, template: name, h: &hosted{org: store.PoolOrg}}
	if m.cfg.UIDs.Size() > 0 {
		uid, err := m.allocateUID(ctx, store.PoolOrg, id)
		if err != nil {
			m.unindex(id)
			return fmt.Errorf("a host uid for a pooled sandbox: %w", err)
		}
		pd.uid = uid
	}
	fail := func(err error) error {
		p.discard(context.WithoutCancel(ctx), pd, "")
		return err
	}
	spec := provider.Spec{ID: id, Template: tmpl, UID: pd.uid}
	if err := m.cfg.Provider.Create(ctx, spec); err != nil {
		return fail(fmt.Errorf("create a pooled sandbox: %w", err))
	}
	if !provider.IsRemote(m.cfg.Provider) { // a remote provider's workspace is not here
		if _, err := m.openWorkspace(ctx, pd.h, store.Record{ID: id, UID: pd.uid}, true); err != nil {
			return fail(err)
		}
	}
	inst, err := m.cfg.Provider.Start(ctx, spec)
	if err != nil {
		return fail(fmt.Errorf("start a pooled sandbox: %w", err))
	}
	pd.h.inst = inst
	if tmpl.Setup != "" {
		if why := runSetup(ctx, inst, tmpl.Setup); why != "" {
			return fail(errors.New(why))
		}
	}
	p.mu.Lock()
	if p.closed || ctx.Err() != nil {
		p.mu.Unlock()
		return fail(errors.New("the broker is stopping"))
	}
	s := p.tmpl[name]
	s.ready = append(s.ready, pd)
	p.mu.Unlock()
	go p.watch(pd, inst)
	return nil
}

// watch replaces a pooled sandbox whose processes end while it waits (killed from the host, the
// OOM killer): it must never be handed out.
func (p *pool) watch(pd *pooled, inst provider.Instance) {
	<-inst.Done()
	if !p.remove(pd) {
		return // claimed (the lifecycle's watch has it now) or discarded
	}
	p.m.cfg.Log.Warn("a pooled sandbox's processes ended while it waited; replacing it", "sandbox_id", pd.id, "template", pd.template)
	p.discard(context.Background(), pd, "")
	p.wake()
}

// remove takes pd out of the pool and reports whether it was there.
func (p *pool) remove(pd *pooled) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.tmpl[pd.template]
	if s == nil {
		return false
	}
	i := slices.Index(s.ready, pd)
	if i < 0 {
		return false
	}
	s.ready = slices.Delete(s.ready, i, i+1)
	return true
}

// take hands out a ready sandbox of template name, or nil when its pool is empty (or it has none).
// The caller calls settled once the create that took it is over, whatever became of it.
func (p *pool) take(name string) *pooled {
	var dead []*pooled
	defer func() {
		for _, pd := range dead {
			go p.discard(context.Background(), pd, "")
		}
	}()
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.tmpl[name]
	if s == nil || p.closed {
		return nil
	}
	for len(s.ready) > 0 {
		// The most recently started: its pages are the likeliest to be in cache.
		pd := s.ready[len(s.ready)-1]
		s.ready = s.ready[:len(s.ready)-1]
		if !provider.Alive(pd.h.inst) {
			// Killed while it waited, and its watch has not seen it yet (out of the pool now,
			// the watch leaves it to us).
			dead = append(dead, pd)
			continue
		}
		s.claims++
		s.claiming++
		return pd
	}
	s.misses++
	p.wake()
	return nil
}

// settled ends the claim of a sandbox that take handed out: it was adopted, given back or
// discarded by now. The filler replaces it.
func (p *pool) settled(pd *pooled) {
	p.mu.Lock()
	if s := p.tmpl[pd.template]; s != nil {
		s.claiming--
	}
	p.mu.Unlock()
	p.wake()
}

// giveBack returns a sandbox whose claim did not happen (nobody saw it) to the pool.
func (p *pool) giveBack(pd *pooled) {
	p.mu.Lock()
	s := p.tmpl[pd.template]
	if p.closed || s == nil {
		p.mu.Unlock()
		p.discard(context.Background(), pd, "")
		return
	}
	s.claims--
	s.ready = append(s.ready, pd)
	p.mu.Unlock()
}

// discard removes a pooled sandbox that will not be handed out: its processes, its files, its uid
// (under the pool and, for a claim cut short, under org) and its index entry. What fails stays for
// the filler (and, after a restart, Recover) to retry.
func (p *pool) discard(ctx context.Context, pd *pooled, org string) {
	m := p.m
	pd.h.mu.Lock()
	pd.h.release(ctx)
	pd.h.mu.Unlock()
	err := m.cfg.Provider.Destroy(ctx, provider.Spec{ID: pd.id, Template: m.cfg.Templates[pd.template], UID: pd.uid})
	if err == nil {
		err = m.cfg.Store.ReleaseUID(ctx, store.PoolOrg, pd.id)
	}
	if err == nil && org != "" {
		err = m.cfg.Store.ReleaseUID(ctx, org, pd.id)
	}
	if err != nil {
		m.cfg.Log.Warn("removing a pooled sandbox failed; retrying later", "sandbox_id", pd.id, "err", err)
		p.leaveOver(pd)
		return
	}
	m.uids.drop(pd.id)
	m.unindex(pd.id)
}

// leaveOver keeps pd, whose removal failed, for the filler to retry.
func (p *pool) leaveOver(pd *pooled) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !slices.Contains(p.leftovers, pd) {
		p.leftovers = append(p.leftovers, pd)
	}
}

// removeLeftover tries again to remove pd, as discard or hold would have.
func (p *pool) removeLeftover(ctx context.Context, pd *pooled) {
	if pd.held {
		p.hold(ctx, pd)
		return
	}
	p.discard(ctx, pd, p.claimedBy(pd.id))
}

func (p *pool) retryLeftovers(ctx context.Context) {
	p.mu.Lock()
	left := p.leftovers
	p.leftovers = nil
	p.mu.Unlock()
	for _, pd := range left {
		if ctx.Err() != nil {
			p.mu.Lock()
			p.leftovers = append(p.leftovers, pd)
			p.mu.Unlock()
			continue
		}
		p.removeLeftover(ctx, pd)
	}
}

// claimedBy reads the org a pooled sandbox's index entry names (a claim was under way), or "".
func (p *pool) claimedBy(id string) string {
	b, err := os.ReadFile(filepath.Join(p.m.cfg.IndexDir, id))
	if err != nil {
		return ""
	}
	_, _, org := parsePooledIndex(string(b))
	return org
}

// close empties the pool for good, destroying what waits in it. The filler must have stopped.
func (p *pool) close(ctx context.Context) {
	p.mu.Lock()
	p.closed = true
	var all []*pooled
	for _, s := range p.tmpl {
		all = append(all, s.ready...)
		s.ready = nil
	}
	all = append(all, p.leftovers...)
	p.leftovers = nil
	p.mu.Unlock()
	for _, pd := range all {
		p.removeLeftover(ctx, pd)
	}
}

// claim moves a sandbox taken from the pool to org (steps 2 and 3 above). On error the sandbox is
// discarded and the create goes on without it.
func (p *pool) claim(ctx context.Context, org string, pd *pooled) error {
	m := p.m
	// The index write (a file) and the uid's move (Redis) are independent: they overlap.
	indexed := make(chan error, 1)
	go func() { indexed <- m.indexPooled(pd.id, pd.template, org) }()
	var moveErr error
	if pd.uid > 0 {
		_, moveErr = m.cfg.Store.TransferUID(ctx, store.PoolOrg, org, pd.id)
	}
	indexErr := <-indexed
	switch {
	case moveErr != nil:
		// The move may have happened: release under both owners.
		go p.discard(context.WithoutCancel(ctx), pd, org)
		return moveErr
	case indexErr != nil:
		// Without the mark a crash could not tell this sandbox's record from a leftover.
		go p.discard(context.WithoutCancel(ctx), pd, org)
		return indexErr
	}
	if pd.uid > 0 {
		m.uids.hold(org, pd.id, pd.uid) // the org's now, in Redis too
	}
	return nil
}

// hold ends a claimed sandbox whose create's outcome is unknown (Redis lost every answer): its
// record may exist, naming its id and uid, so the uid (the org's since the claim) and the index
// entry naming the org stay, as a create's of unknown outcome do: a record that landed fails as any
// create cut short (settle.go while the broker runs, recoverPooled at its next start), and its
// delete frees the uid; none found, the next start removes the rest. Only its processes and files go: nothing of the org's is in them.
// A destroy that fails keeps the uid in the broker's table (its processes may live) and is retried
// by the filler; the one that succeeds gives it back to the range here.
func (p *pool) hold(ctx context.Context, pd *pooled) {
	m := p.m
	pd.held = true
	pd.h.mu.Lock()
	pd.h.release(ctx)
	pd.h.mu.Unlock()
	if err := m.cfg.Provider.Destroy(ctx, provider.Spec{ID: pd.id, Template: m.cfg.Templates[pd.template], UID: pd.uid}); err != nil {
		m.cfg.Log.Warn("removing a claimed pooled sandbox whose create's outcome is unknown failed; retrying later", "sandbox_id", pd.id, "err", err)
		p.leaveOver(pd)
		return
	}
	m.uids.drop(pd.id) // nothing here runs as it any more; its record, if any, keeps it in Redis
}

// unclaim undoes a claim whose create did not make the record: createErr is nil when the name was
// taken (reused or resumed), or the store's error. A refusal the store answered (a limit, a name
// conflict) changed nothing, and the sandbox goes back to the pool; an error whose outcome is
// unknown discards it.
func (p *pool) unclaim(ctx context.Context, org string, pd *pooled, createErr error) {
	m := p.m
	ctx = context.WithoutCancel(ctx)
	var qe *store.QuotaError
	var tm *store.TemplateMismatchError
	var se *store.StateError
	answered := createErr == nil || errors.As(createErr, &qe) || errors.As(createErr, &tm) || errors.As(createErr, &se) ||
		errors.Is(createErr, store.ErrNameConflict) || errors.Is(createErr, store.ErrNotFound)
	if !answered {
		if errors.Is(createErr, errUnknownOutcome) {
			go p.hold(ctx, pd)
			return
		}
		go p.discard(ctx, pd, org)
		return
	}
	if pd.uid > 0 {
		if _, err := m.cfg.Store.TransferUID(ctx, org, store.PoolOrg, pd.id); err != nil {
			go p.discard(ctx, pd, org)
			return
		}
		m.uids.hold(store.PoolOrg, pd.id, pd.uid)
	}
	if err := m.indexPooled(pd.id, pd.template, ""); err != nil {
		go p.discard(ctx, pd, "")
		return
	}
	p.giveBack(pd)
}

// adopt makes a claimed sandbox, whose record CreateOrReuse just made (provisioning), the org's
// running sandbox (step 5).
func (m *Manager) adopt(ctx context.Context, c Caller, rec store.Record, pd *pooled) (store.Record, error) {
	ctx = context.WithoutCancel(ctx)
	m.mu.Lock()
	h := m.host[rec.ID]
	if h == nil {
		h = pd.h
		m.host[rec.ID] = h
	}
	m.mu.Unlock()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h != pd.h {
		// Someone looked the id up between the record and now: give that entry the runtime.
		pd.h.mu.Lock()
		h.inst, h.ws = pd.h.inst, pd.h.ws
		pd.h.mu.Unlock()
	}
	h.org = rec.Org
	inst := h.inst
	tmpl := m.cfg.Templates[rec.Template]
	if cl, ok := m.cfg.Provider.(provider.Claimer); ok {
		// The runtime was made for nobody: it names its owner from now on. A failure leaves a
		// working sandbox that the provider's reconcile does not match to its record (a pod left
		// unlabelled is ignored, never ended); its next start names the owner again.
		spec := provider.Spec{ID: rec.ID, Template: tmpl, UID: rec.UID, Org: rec.Org, Name: rec.Name}
		if err := cl.Claimed(ctx, spec); err != nil {
			m.cfg.Log.Warn("naming a claimed pooled sandbox's owner on its runtime failed; its next start does", "sandbox_id", rec.ID, "err", err)
		}
	}
	fields := map[string]string{store.FieldProvider: provider.Runner(m.cfg.Provider, tmpl)}
	m.runtimeFields(inst, fields)
	// Its index entry keeps the claim's mark ("~pool", template, org) rather than being written
	// again on the create's path: Recover reads the mark, finds the record and rewrites it.
	return m.markRunning(ctx, rec, h, inst, fields)
}

// indexPooled writes a pooled sandbox's index entry: the pool marker, its template and, while a
// claim is under way, the claiming org.
func (m *Manager) indexPooled(id, template, org string) error {
	content := store.PoolOrg + "\n" + template
	if org != "" {
		content += "\n" + org
	}
	return m.index(id, content)
}

// parsePooledIndex reads an index entry's content: ok when it is a pooled sandbox's.
func parsePooledIndex(content string) (ok bool, template, org string) {
	parts := strings.Split(content, "\n")
	if parts[0] != store.PoolOrg {
		return false, "", ""
	}
	if len(parts) > 1 {
		template = parts[1]
	}
	if len(parts) > 2 {
		org = parts[2]
	}
	return true, template, org
}

// recoverPooled handles a pooled sandbox's index entry found at start: its processes ended with
// the broker that pooled it. One whose claim reached the store is the org's and is recovered as
// such; any other is destroyed.
func (m *Manager) recoverPooled(ctx context.Context, id, content string) {
	_, template, org := parsePooledIndex(content)
	if org != "" {
		_, err := m.cfg.Store.Get(ctx, org, id)
		switch {
		case err == nil:
			if err := m.index(id, org); err != nil {
				m.cfg.Log.Error("recover: rewriting a claimed pooled sandbox's index entry", "sandbox_id", id, "err", err)
				return
			}
			m.recoverOne(ctx, org, id)
			return
		case !errors.Is(err, store.ErrNotFound):
			m.cfg.Log.Error("recover: cannot read record", "sandbox_id", id, "org", org, "err", err)
			return
		}
	}
	pd := &pooled{id: id, template: template, h: &hosted{org: store.PoolOrg}}
	m.pool.discard(ctx, pd, org)
	m.cfg.Log.Info("removed a pooled sandbox left by an earlier broker", "sandbox_id", id, "template", template)
}
