package store_test

import (
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// TestLostRepliesAreNotReplayedAsSomeoneElses: a lost answer makes the client run the same script
// again. A create or a resume seen a second time must be recognised as the caller's own, not
// answered as a name conflict (a create that then gives back a uid its record holds, leaving the
// record provisioning forever) or as "reused"/"someone else is starting it" (a create or resume that
// then waits for its own start, which never comes).
func TestLostRepliesAreNotReplayedAsSomeoneElses(t *testing.T) {
	srv := redistest.Start(t)
	lossy := &redistest.LoseAnswers{}
	arm := &lossy.Lose
	c := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{srv.Addr}, Dialer: lossy.Dial})
	t.Cleanup(func() { c.Close() })
	s := store.New(c)
	ctx := t.Context()
	// Load the scripts first, so that an armed call is one that runs (not a NOSCRIPT answer).
	warm := newRecord("o", "warm", nil)
	if _, _, err := s.CreateOrReuse(ctx, warm, false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Transition(ctx, "o", warm.ID, store.Transition{From: []string{protocol.StatusProvisioning}, To: protocol.StatusStopped}); err != nil {
		t.Fatal(err)
	}

	for _, reuse := range []bool{false, true} {
		rec := newRecord("o", map[bool]string{false: "fresh", true: "fresh-reuse"}[reuse], nil)
		arm.Store(1)
		got, outcome, err := s.CreateOrReuse(ctx, rec, reuse)
		if err != nil || outcome != protocol.OutcomeCreated || got.ID != rec.ID {
			t.Errorf("create (reuse %v) whose answer was lost: %v, outcome %q, id %s (want created %s)", reuse, err, outcome, got.ID, rec.ID)
		}
	}

	// Create-or-reuse of a stopped sandbox resumes it: this caller owns the start.
	again := newRecord("o", "warm", nil)
	arm.Store(1)
	got, outcome, err := s.CreateOrReuse(ctx, again, true)
	if err != nil || outcome != protocol.OutcomeResumed || got.ID != warm.ID {
		t.Errorf("create-or-reuse resuming, answer lost: %v, outcome %q, id %s (want resumed %s)", err, outcome, got.ID, warm.ID)
	}

	// A resume (stopped -> provisioning) whose answer was lost.
	if _, err := s.Transition(ctx, "o", warm.ID, store.Transition{From: []string{protocol.StatusProvisioning}, To: protocol.StatusStopped}); err != nil {
		t.Fatal(err)
	}
	arm.Store(1)
	got, err = s.Transition(ctx, "o", warm.ID, store.Transition{From: []string{protocol.StatusStopped}, To: protocol.StatusProvisioning, Claim: "resume-1"})
	if err != nil || got.Status != protocol.StatusProvisioning {
		t.Errorf("resume whose answer was lost: %v %+v", err, got)
	}
	// Another caller's resume of the same sandbox is still refused: it is being started.
	if _, err := s.Transition(ctx, "o", warm.ID, store.Transition{From: []string{protocol.StatusStopped}, To: protocol.StatusProvisioning, Claim: "resume-2"}); err == nil {
		t.Error("a second caller's resume of a provisioning sandbox was taken as its own")
	}
	if arm.Load() > 0 {
		t.Fatal("no answer was lost: the test did not test")
	}
}
