package sandbox

import (
	"cmp"
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// A create or a resume whose every Redis answer was lost (resend.go) may have left its record
// provisioning with nobody to start it. Recover settles such records at the next start; while the
// broker runs, it settles them the same way (settleCutShort, one owner of the rule) once no start of
// this broker holds them: a record is provisioning either because a start is in flight, and that
// start is in the registry below from before its write to Redis until its last one, or because the
// start was cut short.
//
// Only the hosting node settles its records: another broker cannot tell a start in flight there
// from one cut short. A record claimed by another broker (its resume of a sandbox hosted here,
// waiting for this node to start it) is given the time that broker waits (remoteStartWait) before
// it is settled: its ask to start may be lost, and it asks again meanwhile.

// settleGrace is how long a provisioning record of this node that no start of this broker holds is
// left alone before it is settled: a margin, since the registry is written before the record.
const settleGrace = 2 * time.Second

// settler is the registry of starts in flight and what the broker watches to settle.
type settler struct {
	mu sync.Mutex
	// starts counts the starts in flight by their key (startKey): a new record's id, or the claim
	// of a move into provisioning.
	starts map[string]int
	// seen is when each provisioning record was first seen with no start holding it, for its
	// key: the grace runs from then, on the broker's clock.
	seen map[string]sighting
	// unsettled are refs (id or name) of this broker's creates and resumes whose outcome is
	// unknown: the reconcile reads them until they are not provisioning.
	unsettled map[string]unsettled
	// own are claims this broker made that do not name its node (a create-or-reuse claims a
	// stopped sandbox by the new id it made) and whose outcome is unknown.
	own map[string]bool
}

type unsettled struct {
	org    string
	create bool
}

type sighting struct {
	key string
	at  time.Time
}

func newSettler() *settler {
	return &settler{starts: map[string]int{}, seen: map[string]sighting{}, unsettled: map[string]unsettled{}, own: map[string]bool{}}
}

// startKey names the start that a provisioning record waits for: its claim (a resume, a restart)
// or, for a first create, which writes no claim, its id.
func startKey(rec store.Record) string { return cmp.Or(rec.Claim, rec.ID) }

// newClaim is a claim for a move into provisioning made by this broker: it names the node, so that
// a record claimed here is told from one another broker claimed.
func (m *Manager) newClaim() string { return m.cfg.Node + "/" + uuid.NewString() }

// holdStart registers a start in flight under key until release is called (more than once is fine).
func (m *Manager) holdStart(key string) (release func()) {
	s := m.settle
	s.mu.Lock()
	s.starts[key]++
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			if s.starts[key]--; s.starts[key] <= 0 {
				delete(s.starts, key)
			}
			s.mu.Unlock()
		})
	}
}

// watchUnsettled makes the reconcile read ref until it is not provisioning: a create (by its id) or
// a resume (by the caller's ref) of this broker whose outcome is unknown.
func (m *Manager) watchUnsettled(org, ref string, create bool) {
	m.settle.mu.Lock()
	m.settle.unsettled[ref] = unsettled{org: org, create: create}
	m.settle.mu.Unlock()
}

// settleUnsettled reads the creates and resumes whose outcome is unknown, settles those left
// provisioning with no start (past the grace: the first pass that sees one only notes it), and
// forgets those that are not provisioning. A create whose record never landed loses its index
// entry, as at a start (recordMissing).
func (m *Manager) settleUnsettled(ctx context.Context) {
	m.settle.mu.Lock()
	refs := make(map[string]unsettled, len(m.settle.unsettled))
	for ref, u := range m.settle.unsettled {
		refs[ref] = u
	}
	m.settle.mu.Unlock()
	for ref, u := range refs {
		rec, err := m.cfg.Store.Get(ctx, u.org, ref)
		switch {
		case errors.Is(err, store.ErrNotFound):
			if u.create {
				m.recordMissing(ctx, u.org, ref)
			}
		case err != nil:
			continue
		case rec.Status == protocol.StatusProvisioning && rec.Node == m.cfg.Node:
			if rec, _ = m.settleIfAbandoned(ctx, rec); rec.Status == protocol.StatusProvisioning {
				continue
			}
		}
		m.settle.mu.Lock()
		delete(m.settle.unsettled, ref)
		m.settle.mu.Unlock()
	}
}

// ownClaim notes a claim of this broker's that does not name its node, for the grace of its own.
func (m *Manager) ownClaim(claim string) {
	m.settle.mu.Lock()
	m.settle.own[claim] = true
	m.settle.mu.Unlock()
}

// unseen forgets a record's sighting: it is not provisioning any more, or gone.
func (m *Manager) unseen(id string) {
	m.settle.mu.Lock()
	delete(m.settle.seen, id)
	m.settle.mu.Unlock()
}

// settleIfAbandoned settles rec, provisioning on this node, when no start of this broker has held it
// since the grace began; it answers the record and whether it settled it.
func (m *Manager) settleIfAbandoned(ctx context.Context, rec store.Record) (store.Record, bool) {
	if rec.Status != protocol.StatusProvisioning || rec.Node != m.cfg.Node {
		return rec, false
	}
	// cfg.Now, not m.now: m.now's UTC() drops the monotonic reading, and a wall clock stepped
	// forward must not cut the grace short under another broker's start.
	s, key, now := m.settle, startKey(rec), m.cfg.Now()
	s.mu.Lock()
	held := s.starts[key] > 0
	first, seen := s.seen[rec.ID]
	if held || !seen || first.key != key {
		if held {
			delete(s.seen, rec.ID)
		} else {
			s.seen[rec.ID] = sighting{key: key, at: now}
		}
		s.mu.Unlock()
		return rec, false
	}
	own := s.own[rec.Claim]
	s.mu.Unlock()
	grace := settleGrace
	if rec.Claim != "" && !strings.HasPrefix(rec.Claim, m.cfg.Node+"/") && !own {
		// Another broker's claim (or a create-or-reuse's, whichever broker made it): it may be
		// waiting for this node to start it, and asking again.
		grace = remoteStartWait + remoteStartAgain
	}
	if now.Sub(first.at) < grace {
		return rec, false
	}
	// A start of this node runs under h.mu from before it reads the record to its last write, and
	// is registered before its first: with both free, none is in flight, and none can move the
	// record out of provisioning and back while this holds h.mu.
	h := m.hostedFor(rec.ID, rec.Org)
	if !h.mu.TryLock() {
		return rec, false
	}
	defer h.mu.Unlock()
	s.mu.Lock()
	held = s.starts[key] > 0
	delete(s.seen, rec.ID)
	delete(s.own, rec.Claim)
	s.mu.Unlock()
	if held {
		return rec, false
	}
	m.cfg.Log.Warn("settling a sandbox left provisioning by a start that was cut short (Redis lost its answers)",
		"sandbox_id", rec.ID, "org", rec.Org, "provisioning_for_more_than", grace)
	got, settled := m.settleCutShort(ctx, rec, "the broker lost Redis' answers to its create, so it never started it; delete it and create it again", protocol.ReasonStartFailed)
	if settled {
		// A runtime here is the one a stop left to this start (stopLocal read the record claimed):
		// no start of this claim ran (each holds h.mu to its last write, and the record was still
		// under it), so it is nobody's now.
		h.release(context.WithoutCancel(ctx))
	}
	return got, settled
}

// settleCutShort settles a provisioning record whose start was cut short: a resume goes back to
// stopped (runtime_lost, resumable: its files are whole), a first create is marked failed with why
// (its template setup may not have run) and an event with reason. It answers the record and whether
// the change was made. Only the move into provisioning rec names (its claim) is settled: a read of
// the record may be stale by the time the change lands, and a newer start (another resume, once
// this one was settled by someone else) is not this one's to settle.
func (m *Manager) settleCutShort(ctx context.Context, rec store.Record, why, reason string) (store.Record, bool) {
	c := Caller{Org: rec.Org, Actor: "broker"}
	if !rec.StartedAt.IsZero() {
		got, err := m.cfg.Store.Transition(ctx, rec.Org, rec.ID, store.Transition{
			From: []string{protocol.StatusProvisioning}, To: protocol.StatusStopped, Claim: rec.Claim, IfClaim: true,
			Fields: map[string]string{store.FieldStopReason: protocol.StopRuntimeLost}})
		if err != nil {
			return rec, false
		}
		m.emit(c, got, protocol.EventStopped, func(e *protocol.Event) { e.Reason = protocol.StopRuntimeLost })
		return got, true
	}
	got, err := m.cfg.Store.Transition(ctx, rec.Org, rec.ID, store.Transition{
		From: []string{protocol.StatusProvisioning}, To: protocol.StatusFailed, Claim: rec.Claim, IfClaim: true,
		Fields: map[string]string{store.FieldFailure: why}})
	if err != nil {
		return rec, false
	}
	m.emit(c, got, protocol.EventFailed, func(e *protocol.Event) { e.Reason = reason })
	return got, true
}
