package server_test

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
	"github.com/sbxbroker/broker/tests/wait"
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

// A create from the warm pool whose every answer Redis lost may have made its record (provisioning,
// naming the pooled sandbox's id and uid): as for any create of unknown outcome, the uid stays the
// record's and the index entry stays for the next start to settle it. Before, the pooled sandbox
// was discarded as though no record named it: its uid was freed for the next sandbox while the
// record held it, and its index entry removed, so no start would ever settle the record, left
// provisioning (its name stuck, its place in the org's running count taken) until deleted.
func TestPooledCreateWhoseAnswersRedisLostKeepsItsUID(t *testing.T) {
	needRoot(t)
	lossy := &redistest.LoseAnswers{Match: []byte("pool-lost")}
	uids := store.UIDRange{First: 235000, Last: 235999}
	b := pooledBroker(t, 1, "", servertest.Options{RedisDialer: lossy.Dial, SandboxUIDs: &uids})
	ctx := t.Context()
	// The first create loads the script, so that every armed call below is one that runs.
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	waitPool(t, b, 1)
	lossy.Lose.Store(1000)
	_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "pool-lost"})
	lossy.Lose.Store(0)
	if code(err) != protocol.CodeUnavailable {
		t.Fatalf("a pooled create whose every answer was lost: %v, want unavailable", err)
	}
	rec, err := b.Store.Get(ctx, b.Org, "pool-lost")
	if err != nil {
		t.Fatalf("the create ran in Redis, its record: %v", err)
	}
	if rec.UID == 0 {
		t.Fatalf("the pooled sandbox's record names no uid: %+v", rec)
	}
	want := b.Org + "/" + rec.ID
	// What the broker does with the claimed sandbox runs in the background: once its files are
	// gone (the hold destroys the runtime), the uid must still be the record's.
	wait.Eventually(t, 10*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(b.DataDir, "sandboxes", rec.ID))
		return os.IsNotExist(err)
	}, "the claimed sandbox's runtime and files to go")
	if owner, err := b.Store.UIDOwner(ctx, rec.UID); err != nil || owner != want {
		t.Fatalf("uid %d, named by sandbox %s's record, is held by %q (%v), want %q", rec.UID, rec.ID, owner, err, want)
	}
	if _, err := os.Stat(filepath.Join(b.DataDir, "hosted", rec.ID)); err != nil {
		t.Fatalf("the index entry that lets the next start settle the record: %v", err)
	}
	// The next start settles it as any create cut short: failed, its delete frees the uid.
	b.Stop()
	b2 := pooledBroker(t, 1, "", servertest.Options{Redis: b.Redis, DataDir: b.DataDir, SandboxUIDs: &uids})
	if got, err := b2.Store.Get(ctx, b.Org, rec.ID); err != nil || got.Status != protocol.StatusFailed {
		t.Fatalf("after a restart: %v %s, want failed", err, got.Status)
	}
	if _, err := b2.Client.DeleteSandbox(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, 10*time.Second, func() bool {
		owner, err := b2.Store.UIDOwner(ctx, rec.UID)
		return err == nil && owner == ""
	}, "the deleted sandbox's uid %d is freed", rec.UID)
}

// A create whose answer was lost, and whose sandbox was deleted before the call came again (a
// delete by id from the listing, or by tag, in that window), is not made a second time by the
// resend: the delete gave the sandbox's uid back, and a record made again would hold a uid the next
// sandbox of any org can be given, both running as one host user. The create answers 409 saying the
// sandbox was deleted meanwhile. Before, the resend made it again and started it, on a uid nobody
// held.
func TestCreateDeletedBeforeItsResendIsNotMadeAgain(t *testing.T) {
	needRoot(t)
	lossy := &redistest.LoseAnswers{Match: []byte("deleted-between")}
	uids := store.UIDRange{First: 236000, Last: 236999}
	b := servertest.New(t, servertest.Options{Provider: "dir", RedisDialer: lossy.Dial, SandboxUIDs: &uids})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	var deleted atomic.Bool
	lossy.Lost = func(answer []byte) {
		id := regexp.MustCompile(`sb_[0-9a-f-]{36}`).Find(answer)
		if id == nil {
			t.Errorf("no sandbox id in the lost answer %q", answer)
			return
		}
		if _, err := b.Client.DeleteSandbox(context.Background(), string(id)); err != nil {
			t.Errorf("delete in the window: %v", err)
			return
		}
		deleted.Store(true)
	}
	lossy.Lose.Store(1)
	got, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "deleted-between"})
	if !deleted.Load() {
		t.Fatal("the sandbox was not deleted in the window: the test did not test")
	}
	if err == nil {
		rec, _ := b.Store.Get(ctx, b.Org, got.Sandbox.ID)
		owner, oerr := b.Store.UIDOwner(ctx, rec.UID)
		t.Fatalf("a create deleted before its resend was made again: %s %s, uid %d held by %q (%v)",
			got.Outcome, got.Sandbox.Status, rec.UID, owner, oerr)
	}
	if code(err) != protocol.CodeInvalidState {
		t.Errorf("a create deleted before its resend: %v, want invalid_state", err)
	}
	if _, err := b.Store.Get(ctx, b.Org, "deleted-between"); err == nil {
		t.Errorf("the deleted sandbox's record is back")
	}
}

// A create whose answer was lost, and whose caller hung up before the Redis client's resend (which
// the hang-up then cut), may have made its record: it is asked again, not taken as refused. Before,
// the hang-up counted as a refusal and the broker gave back the uid and index entry of the record
// it had made, left provisioning for good (no start would settle it) on a uid the next sandbox of
// any org could be given.
func TestCreateWhoseCallerHungUpAfterALostAnswer(t *testing.T) {
	needRoot(t)
	lossy := &redistest.LoseAnswers{Match: []byte("hung-up")}
	uids := store.UIDRange{First: 237000, Last: 237999}
	b := servertest.New(t, servertest.Options{Provider: "dir", RedisDialer: lossy.Dial, SandboxUIDs: &uids})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	hangUp, cancel := context.WithCancel(ctx)
	defer cancel()
	// The client hangs up while the answer is being lost; the pause lets the broker see it before
	// the Redis client sends the call again.
	lossy.Lost = func([]byte) { cancel(); time.Sleep(200 * time.Millisecond) }
	lossy.Lose.Store(1)
	if _, err := b.Client.CreateSandbox(hangUp, protocol.CreateSandboxRequest{Name: "hung-up"}); err == nil {
		t.Fatal("the create answered its caller after it hung up: the test did not test")
	}
	var rec store.Record
	wait.Eventually(t, 10*time.Second, func() bool {
		var err error
		rec, err = b.Store.Get(ctx, b.Org, "hung-up")
		return err == nil && rec.Status != protocol.StatusProvisioning
	}, "the created sandbox settles (%s)", rec.Status)
	if rec.Status != protocol.StatusRunning {
		t.Errorf("the sandbox whose caller hung up is %s, want running (a create that reached the store goes on)", rec.Status)
	}
	if owner, err := b.Store.UIDOwner(ctx, rec.UID); err != nil || owner != b.Org+"/"+rec.ID {
		t.Errorf("uid %d of sandbox %s is held by %q (%v), want its own", rec.UID, rec.ID, owner, err)
	}
	if _, err := os.Stat(filepath.Join(b.DataDir, "hosted", rec.ID)); err != nil {
		t.Errorf("its index entry: %v", err)
	}
}

// A resume whose every answer the Redis client lost (its own resends included) is sent again by the
// broker, which finds its own claim: the sandbox starts. Before, the resume answered 503 while its
// claim had landed, and the sandbox stayed provisioning, its start waited for by every other
// caller, until the broker's next start.
func TestResumeWhoseAnswersRedisLost(t *testing.T) {
	// The resume's own call, from stopped to provisioning: the route's read of the sandbox names
	// no status, and the stop before is armed for nothing.
	lossy := &redistest.LoseAnswers{Match: []byte("stopped"), Also: []byte("provisioning")}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "resume-lost"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.StopSandbox(ctx, "resume-lost"); err != nil {
		t.Fatal(err)
	}
	lossy.Lose.Store(4) // the first try and the Redis client's 3 resends
	resumed, err := b.Client.ResumeSandbox(ctx, "resume-lost")
	if err != nil || resumed.Status != protocol.StatusRunning {
		t.Fatalf("resume, 4 answers lost: %v %+v", err, resumed)
	}
	if lossy.Lose.Load() > 0 {
		t.Fatal("resume: not every answer was lost: the test did not test")
	}
}
