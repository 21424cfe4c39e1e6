package delegation

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// RecentTTL bounds how long a broker admits a token on a revocation state it read earlier: the
// longest a revocation that this broker was not told of (an announcement lost while it was cut from
// Redis' pub/sub) can go unseen by a new dataplane connection, as keyCacheTTL is for API keys.
// Announced revocations evict at once (Forget, ForgetKey), and the broker that revokes evicts before
// it announces.
const RecentTTL = 2 * time.Second

// maxRecent bounds the tokens remembered. Past it, expired entries go, then random ones: a flood of
// distinct valid tokens (each minted by an owner) costs the Redis reads it would have cost without
// the cache, never memory.
const maxRecent = 4096

// recent is the broker's one cache of delegation tokens, for the dataplane's upgrade (over the
// WebSocket and the MCP endpoint's in-process connection) and the MCP endpoint's session requests.
// An entry is keyed by the SHA-256 of the whole token, so only those exact bytes, which passed
// Check, find it; it holds the token's claims (valid until exp) and, when the revocation state was
// read and said live, until when that answer may stand in for another read (liveUntil: at most
// RecentTTL after the read began, never past exp).
type recent struct {
	now func() time.Time
	mu  sync.Mutex
	m   map[[32]byte]*recentEntry
	// epoch counts evictions: a read that began before one is not stored, since the revocation it
	// evicts for may have landed after the read.
	epoch uint64
	// reads are the revocation reads in flight, one per token: a storm of upgrades with one token
	// sends one read, not one each.
	reads map[[32]byte]*recentRead
}

type recentEntry struct {
	c         *Claims
	liveUntil time.Time
	readAt    time.Time // when the read that said live began
}

type recentRead struct {
	done    chan struct{}
	epoch   uint64    // r.epoch when the read began
	start   time.Time // when it began
	waiters int       // checks that joined it
	err     error
}

func newRecent(now func() time.Time) *recent {
	return &recent{now: now, m: map[[32]byte]*recentEntry{}, reads: map[[32]byte]*recentRead{}}
}

func recentKey(token string) [32]byte { return sha256.Sum256([]byte(token)) }

// check is checkAt's answer alone.
func (r *recent) check(ctx context.Context, k [32]byte, c *Claims, read func(context.Context, *Claims) error) error {
	_, err := r.checkAt(ctx, k, c, read)
	return err
}

// checkAt answers for the token keyed k, whose claims c passed every other check, what read (the
// revocation state in Redis) answers, reading it only when no answer from the last RecentTTL
// stands, and when the read that answered began. Concurrent checks of one token share one read,
// made on a context that the first caller's hang-up does not cancel (the store bounds it).
func (r *recent) checkAt(ctx context.Context, k [32]byte, c *Claims, read func(context.Context, *Claims) error) (time.Time, error) {
	start := r.now()
	r.mu.Lock()
	if e := r.m[k]; e != nil && start.Before(e.liveUntil) {
		r.mu.Unlock()
		return e.readAt, nil
	}
	// A read that began before an eviction may predate the revocation it was for: join only one
	// that began since, and less than RecentTTL ago (a slow read's answer may be that old).
	if rd := r.reads[k]; rd != nil && rd.epoch == r.epoch && start.Sub(rd.start) < RecentTTL {
		rd.waiters++
		r.mu.Unlock()
		select {
		case <-rd.done:
			return rd.start, rd.err
		case <-ctx.Done():
			return rd.start, ctx.Err()
		}
	}
	rd := &recentRead{done: make(chan struct{}), epoch: r.epoch, start: start}
	r.reads[k] = rd
	r.mu.Unlock()

	// Settled even if read panics (the HTTP server recovers the caller's goroutine): left in reads,
	// the read would hold every later check of the token waiting on a done never closed.
	defer r.settle(k, c, rd, start)
	rd.err = errReadPanicked
	rd.err = read(context.WithoutCancel(ctx), c)
	return start, rd.err
}

// errReadPanicked is what the checks sharing a read hear when it panicked: never live.
var errReadPanicked = fmt.Errorf("%w: the read panicked", ErrRevocationState)

// settle ends the read rd of the token keyed k, begun at start: it remembers a live answer unless an
// eviction came meanwhile, and releases the checks that joined it.
func (r *recent) settle(k [32]byte, c *Claims, rd *recentRead, start time.Time) {
	r.mu.Lock()
	if r.reads[k] == rd {
		delete(r.reads, k)
	}
	var pe *protocol.Error
	switch {
	case rd.err == nil && r.epoch == rd.epoch:
		until := start.Add(RecentTTL)
		if exp := c.ExpiresAt.Time; exp.Before(until) {
			until = exp
		}
		r.putLocked(k, &recentEntry{c: c, liveUntil: until, readAt: start}, start)
	case errors.As(rd.err, &pe):
		delete(r.m, k) // revoked: nothing of it is worth keeping
	}
	r.mu.Unlock()
	close(rd.done)
}

// claims answers the claims of the token keyed k if it passed Check before and has not expired.
func (r *recent) claims(k [32]byte) *Claims {
	now := r.now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.m[k]; e != nil && now.Before(e.c.ExpiresAt.Time) {
		return e.c
	}
	return nil
}

// checked remembers that the token keyed k passed Check with claims c, keeping what its entry knew
// of its revocation state.
func (r *recent) checked(k [32]byte, c *Claims) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.m[k]; e != nil {
		return
	}
	r.putLocked(k, &recentEntry{c: c}, r.now())
}

func (r *recent) putLocked(k [32]byte, e *recentEntry, now time.Time) {
	if _, ok := r.m[k]; !ok && len(r.m) >= maxRecent {
		for k, e := range r.m {
			if !now.Before(e.c.ExpiresAt.Time) {
				delete(r.m, k)
			}
		}
		// Map order is random: what goes is a random quarter, so that the next sweep is
		// maxRecent/4 insertions away whatever the entries' lifetimes.
		for k := range r.m {
			if len(r.m) < maxRecent*3/4 {
				break
			}
			delete(r.m, k)
		}
	}
	r.m[k] = e
}

// forget evicts the entries whose claims match, and makes reads in flight not store their answer.
func (r *recent) forget(match func(*Claims) bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.epoch++
	for k, e := range r.m {
		if match(e.c) {
			delete(r.m, k)
		}
	}
}

func (r *recent) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.m)
}

// VerifyRecent is Verify for the dataplane's upgrade and the MCP endpoint's first request of a
// session: every check but revocation runs on the token as presented, every time (signature,
// expiry on the broker's clock, claims); the revocation state is read from Redis at most once per
// RecentTTL per token on this broker, and concurrent upgrades with one token share that read.
// Revocations this broker makes or is told of take effect at once (Forget, ForgetKey); one it missed
// takes at most RecentTTL. A state that cannot be read is never taken as live: with nothing
// answered within RecentTTL the error wraps ErrRevocationState, as Verify's does.
func (s *Service) VerifyRecent(ctx context.Context, token string) (*Claims, error) {
	c, _, err := s.VerifyRecentAdmission(ctx, token)
	return c, err
}

// Admission is what a VerifyRecent answer rested on: the token's place in the cache (a hash, never
// the token) and when the revocation read that answered began. An answer read before the caller's
// checks began came from the cache, and may predate a revocation this broker was not told of.
type Admission struct {
	key    [32]byte
	ReadAt time.Time
}

// VerifyRecentAdmission is VerifyRecent, and says what its answer rested on.
func (s *Service) VerifyRecentAdmission(ctx context.Context, token string) (*Claims, Admission, error) {
	rs := &recentState{s: s, key: recentKey(token)}
	c, err := s.verifier.verifyWith(ctx, token, rs)
	return c, Admission{key: rs.key, ReadAt: rs.readAt}, err
}

// Reconfirm checks the revocation state of a token admitted on a, whose claims are c, again
// through the cache: call it once a.ReadAt is RecentTTL old, when that answer no longer stands, so
// that the state is read again (once, for every connection of the token) unless an answer read
// since stands. It says what the new answer rests on.
func (s *Service) Reconfirm(ctx context.Context, a Admission, c *Claims) (Admission, error) {
	at, err := s.recent.checkAt(ctx, a.key, c, s.CheckRevocation)
	return Admission{key: a.key, ReadAt: at}, err
}

// recentState is the State of VerifyRecent: the service's revocation read behind the cache. readAt
// is when the read that answered began.
type recentState struct {
	s      *Service
	key    [32]byte
	readAt time.Time
}

func (rs *recentState) CheckRevocation(ctx context.Context, c *Claims) error {
	var err error
	rs.readAt, err = rs.s.recent.checkAt(ctx, rs.key, c, rs.s.CheckRevocation)
	return err
}

// CheckRecent is Check for the MCP endpoint's requests within a session: the claims of exactly this
// token if it passed Check on this broker and has not expired, else Check (an Ed25519 verification
// was a fifth of a tool call's CPU). It reads no revocation state: the session's dataplane connection
// is what ends on a revocation.
func (s *Service) CheckRecent(token string) (*Claims, error) {
	k := recentKey(token)
	if c := s.recent.claims(k); c != nil {
		return c, nil
	}
	c, err := s.verifier.Check(token)
	if err != nil {
		return nil, err
	}
	s.recent.checked(k, c)
	return c, nil
}

// Forget applies a revocation to what this broker remembers of tokens: the revoked token, or every
// token of the sandbox older than its new generation, is read again at its next use. The broker
// that revokes calls it before announcing; every broker calls it for each announcement.
func (s *Service) Forget(rv Revocation) {
	s.recent.forget(func(c *Claims) bool {
		return c.Org == rv.Org && (rv.JTI != "" && c.ID == rv.JTI || rv.Gen > 0 && c.Sbx == rv.SandboxID && c.Gen < rv.Gen)
	})
}

// Evictions counts the revocations this broker has applied (Forget, ForgetKey): a connection notes
// it before its credential's checks and looks again once it can be found by announcements, to learn
// whether one may have passed it by in between.
func (s *Service) Evictions() uint64 {
	s.recent.mu.Lock()
	defer s.recent.mu.Unlock()
	return s.recent.epoch
}

// ForgetAll forgets every token: revocations may have been announced while this broker was not
// subscribed, and each is read again at its next use. It counts as an eviction (Evictions).
func (s *Service) ForgetAll() {
	s.recent.forget(func(*Claims) bool { return true })
}

// ForgetKey forgets every token the API key keyID minted, for its revocation.
func (s *Service) ForgetKey(keyID string) {
	s.recent.forget(func(c *Claims) bool { return c.KeyID() == keyID })
}
