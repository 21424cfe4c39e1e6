package delegation

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tests/wait"
)

// waitersFor is how many checks joined the read of k in flight.
func (r *recent) waitersFor(k [32]byte) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rd := r.reads[k]; rd != nil {
		return rd.waiters
	}
	return 0
}

// The revocation cache's rules, with a counting read in place of Redis (the server's tests hold the
// same rules on a real broker and redis-server).

func recentClaims(clk *clock, jti string, ttl time.Duration) *Claims {
	return &Claims{Org: "o", Sbx: "sb_1", Gen: 1, RegisteredClaims: jwt.RegisteredClaims{ID: jti, Subject: "key:k1",
		ExpiresAt: jwt.NewNumericDate(clk.Now().Add(ttl))}}
}

type countingRead struct {
	n   atomic.Int64
	err error
	// gate, when set, holds every read until it is closed; started says one has begun.
	gate    chan struct{}
	started chan struct{}
}

func (r *countingRead) read(ctx context.Context, _ *Claims) error {
	r.n.Add(1)
	if r.gate != nil {
		select {
		case r.started <- struct{}{}:
		default:
		}
		<-r.gate
	}
	return r.err
}

func TestRecentReadsOncePerTTLAndNeverPastExp(t *testing.T) {
	clk := newClock()
	r := newRecent(clk.Now)
	c := recentClaims(clk, "j1", time.Hour)
	k := recentKey("token-1")
	var rd countingRead
	for range 3 {
		if err := r.check(t.Context(), k, c, rd.read); err != nil {
			t.Fatal(err)
		}
	}
	if n := rd.n.Load(); n != 1 {
		t.Fatalf("%d reads for three checks within RecentTTL, want 1", n)
	}
	clk.Advance(RecentTTL)
	r.check(t.Context(), k, c, rd.read)
	if n := rd.n.Load(); n != 2 {
		t.Fatalf("%d reads after RecentTTL, want 2", n)
	}

	// A token with less than RecentTTL to live: its answer stands until exp, not a moment past.
	short := recentClaims(clk, "j2", RecentTTL/2)
	ks := recentKey("token-2")
	var rs countingRead
	r.check(t.Context(), ks, short, rs.read)
	clk.Advance(RecentTTL/2 - time.Nanosecond)
	r.check(t.Context(), ks, short, rs.read)
	if n := rs.n.Load(); n != 1 {
		t.Fatalf("%d reads before exp, want 1", n)
	}
	clk.Advance(time.Nanosecond)
	r.check(t.Context(), ks, short, rs.read)
	if n := rs.n.Load(); n != 2 {
		t.Errorf("at exp the cached answer still stood (%d reads, want 2)", n)
	}
	if r.claims(ks) != nil {
		t.Errorf("claims of an expired token still answered")
	}
}

// A state that could not be read, or that said revoked, is never remembered as live.
func TestRecentRemembersOnlyLive(t *testing.T) {
	clk := newClock()
	r := newRecent(clk.Now)
	c := recentClaims(clk, "j1", time.Hour)
	k := recentKey("t")
	for _, failure := range []error{errors.New("redis: connection refused"), protocol.Errorf(protocol.CodeTokenRevoked, "revoked")} {
		rd := countingRead{err: failure}
		for i := range 2 {
			if err := r.check(t.Context(), k, c, rd.read); !errors.Is(err, failure) {
				t.Fatalf("check %d with the read failing (%v): %v", i, failure, err)
			}
		}
		if n := rd.n.Load(); n != 2 {
			t.Errorf("%v: %d reads for two checks, want 2 (nothing remembered)", failure, n)
		}
	}
}

// Concurrent checks of one token share one read; a revocation made while it is in flight is not
// undone by its answer, and a check that comes after the revocation does not take the older read's
// answer either.
func TestRecentSharesReadsButNotAcrossEvictions(t *testing.T) {
	clk := newClock()
	r := newRecent(clk.Now)
	c := recentClaims(clk, "j1", time.Hour)
	k := recentKey("t")
	rd := countingRead{gate: make(chan struct{}), started: make(chan struct{}, 1)}
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	wg.Add(1)
	go func() { defer wg.Done(); errs <- r.check(context.Background(), k, c, rd.read) }()
	<-rd.started
	for range 49 {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- r.check(context.Background(), k, c, rd.read) }()
	}
	// The followers join the read in flight (they cannot finish before the gate opens).
	wait.Eventually(t, 10*time.Second, func() bool { return r.waitersFor(k) == 49 }, "49 checks joining the read in flight")
	// Revoked now, while that read (which began before) is still in flight.
	r.forget(func(cl *Claims) bool { return cl.ID == "j1" })
	late := countingRead{err: protocol.Errorf(protocol.CodeTokenRevoked, "revoked")}
	lateErr := make(chan error, 1)
	go func() { lateErr <- r.check(context.Background(), k, c, late.read) }()
	if !wait.Until(10*time.Second, func() bool { return late.n.Load() == 1 }) {
		t.Errorf("a check after the revocation joined the read that began before it")
	}
	close(rd.gate)
	if err := <-lateErr; err == nil {
		t.Errorf("a check after the revocation was answered live")
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := rd.n.Load(); n != 1 {
		t.Errorf("%d reads for 50 concurrent checks of one token, want 1", n)
	}
	again := countingRead{}
	r.check(context.Background(), k, c, again.read)
	if again.n.Load() != 1 {
		t.Errorf("the read that began before the revocation was remembered: the next check did not read")
	}
}

// Distinct valid tokens beyond the bound cost reads, never memory.
func TestRecentIsBounded(t *testing.T) {
	clk := newClock()
	r := newRecent(clk.Now)
	var rd countingRead
	for i := range 3 * maxRecent {
		tok := fmt.Sprintf("token-%d", i)
		r.check(t.Context(), recentKey(tok), recentClaims(clk, tok, time.Hour), rd.read)
		if i%2 == 0 {
			r.checked(recentKey(tok+"-mcp"), recentClaims(clk, tok, time.Hour))
		}
		if n := r.len(); n > maxRecent {
			t.Fatalf("%d entries after %d tokens, bound %d", n, i+1, maxRecent)
		}
	}
}

// A read that panics (the HTTP server recovers the upgrade's goroutine) must not leave its entry in
// reads: every later check of the token would join it and wait on a done that never closes, until
// its caller hangs up, and the token would never be read again on this broker until some eviction.
func TestRecentReadPanicReleasesWaiters(t *testing.T) {
	clk := newClock()
	r := newRecent(clk.Now)
	c := recentClaims(clk, "j1", time.Hour)
	k := recentKey("t")
	gate := make(chan struct{})
	started := make(chan struct{})
	panicked := make(chan any, 1)
	go func() {
		defer func() { panicked <- recover() }()
		r.check(context.Background(), k, c, func(context.Context, *Claims) error {
			close(started)
			<-gate
			panic("read blew up")
		})
	}()
	<-started
	joined := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		joined <- r.check(ctx, k, c, func(context.Context, *Claims) error { return nil })
	}()
	wait.Eventually(t, 10*time.Second, func() bool { return r.waitersFor(k) == 1 }, "a check joining the read in flight")
	close(gate)
	if p := <-panicked; p == nil {
		t.Fatal("the read's panic was swallowed")
	}
	if err := <-joined; err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a check that joined a read that panicked: %v, want a prompt refusal", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var rd countingRead
	if err := r.check(ctx, k, c, rd.read); err != nil || rd.n.Load() != 1 {
		t.Errorf("a check after a read panicked: %v after %d reads, want live after 1", err, rd.n.Load())
	}
}

// A check never takes the answer of a read that began RecentTTL or more before it: a slow read
// (Redis' answer delayed, go-redis resending) would otherwise stand in for a state older than the
// bound, which an unannounced revocation relies on.
func TestRecentJoinsNoReadOlderThanTTL(t *testing.T) {
	clk := newClock()
	r := newRecent(clk.Now)
	c := recentClaims(clk, "j1", time.Hour)
	k := recentKey("t")
	slow := countingRead{gate: make(chan struct{}), started: make(chan struct{}, 1)}
	leader := make(chan error, 1)
	go func() { leader <- r.check(context.Background(), k, c, slow.read) }()
	<-slow.started
	clk.Advance(RecentTTL)
	late := countingRead{err: protocol.Errorf(protocol.CodeTokenRevoked, "revoked")}
	lateErr := make(chan error, 1)
	go func() { lateErr <- r.check(context.Background(), k, c, late.read) }()
	if !wait.Until(5*time.Second, func() bool { return late.n.Load() == 1 }) {
		t.Errorf("a check %s after a read began joined it instead of reading", RecentTTL)
	}
	close(slow.gate)
	if err := <-leader; err != nil {
		t.Fatal(err)
	}
	if err := <-lateErr; err == nil {
		t.Errorf("a check %s after a slow read began was answered live by it", RecentTTL)
	}
}
