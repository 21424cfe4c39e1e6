package server_test

import (
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store/redistest"
)

// TestCreateWhoseAnswerRedisLost: Redis runs a create, then its answer is lost, on every try of the
// Redis client and once more. The create must still end with one running sandbox under its name:
// before, a lost answer made the client's resend find the name taken (a create refused as a
// conflict, whose uid was then given back though its record held it), or "reused" its own record
// and waited for a start nobody would make, leaving the name stuck in provisioning.
func TestCreateWhoseAnswerRedisLost(t *testing.T) {
	lossy := &redistest.LoseAnswers{Match: []byte("lost-answer")}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial})
	ctx := t.Context()
	// The first create loads the script, so that every armed call below is one that runs.
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	noReuse := false
	for _, tc := range []struct {
		name  string
		lose  int32
		reuse *bool
	}{
		{"lost-answer-1", 1, &noReuse}, // resent by the Redis client
		{"lost-answer-2", 1, nil},      // resent by the Redis client, create-or-reuse
		{"lost-answer-5", 5, nil},      // past the Redis client's retries: resent by the broker
	} {
		lossy.Lose.Store(tc.lose)
		got, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: tc.name, Reuse: tc.reuse})
		if err != nil || got.Outcome != protocol.OutcomeCreated || got.Sandbox.Status != protocol.StatusRunning {
			t.Fatalf("%s, %d answers lost: %v %+v", tc.name, tc.lose, err, got)
		}
		if lossy.Lose.Load() > 0 {
			t.Fatalf("%s: no answer was lost: the test did not test", tc.name)
		}
		again, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: tc.name})
		if err != nil || again.Outcome != protocol.OutcomeReused || again.Sandbox.ID != got.Sandbox.ID {
			t.Fatalf("%s: create again: %v %+v (want reused %s)", tc.name, err, again, got.Sandbox.ID)
		}
	}

	// A resume whose answer was lost is this caller's own, not another's start to wait for.
	if _, err := b.Client.StopSandbox(ctx, "lost-answer-1"); err != nil {
		t.Fatal(err)
	}
	lossy.Lose.Store(1)
	resumed, err := b.Client.ResumeSandbox(ctx, "lost-answer-1")
	if err != nil || resumed.Status != protocol.StatusRunning {
		t.Fatalf("resume, its answer lost: %v %+v", err, resumed)
	}
	if lossy.Lose.Load() > 0 {
		t.Fatal("resume: no answer was lost: the test did not test")
	}
}
