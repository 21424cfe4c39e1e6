package server_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
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
	hungUp := &hangUpListener{seen: make(chan struct{}, 64)}
	b := servertest.New(t, servertest.Options{Provider: "dir", RedisDialer: lossy.Dial, SandboxUIDs: &uids,
		Listener: func(l net.Listener) net.Listener { hungUp.Listener = l; return hungUp }})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	hangUp, cancel := context.WithCancel(ctx)
	defer cancel()
	// The client hangs up while the answer is being lost, and the answer is held until the broker
	// has read the hang-up (net/http cancels the request's context as that read ends), so the
	// Redis client's resend comes after it.
	for len(hungUp.seen) > 0 { // ends read before this create are not its hang-up
		<-hungUp.seen
	}
	lossy.Lost = func([]byte) {
		cancel()
		select {
		case <-hungUp.seen:
		case <-time.After(5 * time.Second):
			t.Error("the broker never read the client's hang-up")
		}
	}
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

// A create whose every answer Redis lost, whose record did land, is settled while the broker runs:
// no start of this broker holds it, so it is marked failed (as the next start would), within a
// reconcile or at once when a create-or-reuse of its name finds it. Before, the record stayed
// provisioning until the broker restarted or the owner deleted it, and a create-or-reuse of the
// name waited out its whole request.
func TestCreateWhoseAnswersRedisLostIsSettledWhileTheBrokerRuns(t *testing.T) {
	lossy := &redistest.LoseAnswers{Match: []byte("stuck-create")}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	lossy.Lose.Store(1000)
	_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "stuck-create"})
	lossy.Lose.Store(0)
	if code(err) != protocol.CodeUnavailable {
		t.Fatalf("a create whose every answer was lost: %v, want unavailable", err)
	}
	rec, err := b.Store.Get(ctx, b.Org, "stuck-create")
	if err != nil || rec.Status != protocol.StatusProvisioning {
		t.Fatalf("the create ran in Redis: %v %q, want a provisioning record (the test did not test)", err, rec.Status)
	}
	// A create-or-reuse of the name answers within a few seconds, not at its deadline.
	reuseCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	_, err = b.Client.CreateSandbox(reuseCtx, protocol.CreateSandboxRequest{Name: "stuck-create"})
	if reuseCtx.Err() != nil {
		t.Fatalf("a create-or-reuse of the abandoned record waited out its request (%s): %v", time.Since(start), err)
	}
	if code(err) != protocol.CodeSandboxFailed {
		t.Errorf("a create-or-reuse of the abandoned record: %v, want sandbox_failed", err)
	}
	got, err := b.Store.Get(ctx, b.Org, rec.ID)
	if err != nil || got.Status != protocol.StatusFailed || got.Failure == "" {
		t.Fatalf("the abandoned record: %v %q %q, want failed with a reason", err, got.Status, got.Failure)
	}
	// Deleting it frees the name for a create that works.
	if _, err := b.Client.DeleteSandbox(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	if again, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "stuck-create"}); err != nil || again.Sandbox.Status != protocol.StatusRunning {
		t.Fatalf("create again: %v %+v", err, again)
	}
}

// A resume whose every answer Redis lost, whose claim did land, is settled by the broker's reconcile
// with nobody asking: back to stopped (runtime_lost), resumable. Before, it stayed provisioning until
// the broker restarted, and every resume of it waited for a start nobody would make.
func TestResumeWhoseAnswersRedisLostIsSettledWhileTheBrokerRuns(t *testing.T) {
	lossy := &redistest.LoseAnswers{Match: []byte("stopped"), Also: []byte("provisioning")}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "stuck-resume"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.StopSandbox(ctx, "stuck-resume"); err != nil {
		t.Fatal(err)
	}
	lossy.Lose.Store(1000)
	_, err := b.Client.ResumeSandbox(ctx, "stuck-resume")
	lossy.Lose.Store(0)
	if code(err) != protocol.CodeUnavailable {
		t.Fatalf("a resume whose every answer was lost: %v, want unavailable", err)
	}
	if rec, err := b.Store.Get(ctx, b.Org, "stuck-resume"); err != nil || rec.Status != protocol.StatusProvisioning {
		t.Fatalf("the resume's claim: %v %q, want provisioning (the test did not test)", err, rec.Status)
	}
	var rec store.Record
	wait.Eventually(t, 20*time.Second, func() bool {
		rec, _ = b.Store.Get(ctx, b.Org, "stuck-resume")
		return rec.Status != protocol.StatusProvisioning
	}, "the abandoned resume is settled")
	if rec.Status != protocol.StatusStopped || rec.StopReason != protocol.StopRuntimeLost {
		t.Fatalf("the abandoned resume: %s (%s), want stopped (runtime_lost)", rec.Status, rec.StopReason)
	}
	if got, err := b.Client.ResumeSandbox(ctx, "stuck-resume"); err != nil || got.Status != protocol.StatusRunning {
		t.Fatalf("resume again: %v %+v", err, got)
	}
}

// A start in flight is never settled under it, however long it takes: the broker's registry of
// starts holds it. The clock is moved far past the grace while a create's setup runs and a
// create-or-reuse of its name waits; both must end with the sandbox running.
func TestASlowStartIsNotSettledUnderIt(t *testing.T) {
	gate := filepath.Join(t.TempDir(), "go")
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now, Templates: map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"slow":    {Name: "slow", Setup: "while [ ! -e " + gate + " ]; do sleep 0.05; done"},
	}})
	ctx := t.Context()
	created := make(chan error, 1)
	go func() {
		got, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "slow", Template: "slow"})
		if err == nil && got.Sandbox.Status != protocol.StatusRunning {
			err = fmt.Errorf("the create answered %s", got.Sandbox.Status)
		}
		created <- err
	}()
	var rec store.Record
	wait.Eventually(t, 10*time.Second, func() bool {
		rec, _ = b.Store.Get(ctx, b.Org, "slow")
		return rec.Status == protocol.StatusProvisioning
	}, "the slow create is provisioning")
	reused := make(chan error, 1)
	go func() {
		got, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "slow", Template: "slow"})
		if err == nil && got.Sandbox.Status != protocol.StatusRunning {
			err = fmt.Errorf("the create-or-reuse answered %s", got.Sandbox.Status)
		}
		reused <- err
	}()
	// Whatever happens, the setup ends before the broker stops (cleanups run last first).
	t.Cleanup(func() { os.WriteFile(gate, nil, 0o600) })
	passes := make(chan struct{})
	go func() {
		defer close(passes)
		b.Manager.Reconcile(ctx) // sees it provisioning
		clock.Advance(time.Hour)
		b.Manager.Reconcile(ctx) // an hour later: still in flight
	}()
	select {
	case <-passes:
	case <-time.After(10 * time.Second):
		t.Error("a reconcile pass waited for the start in flight")
	}
	if got, err := b.Store.Get(ctx, b.Org, rec.ID); err != nil || got.Status != protocol.StatusProvisioning {
		t.Errorf("the start in flight was settled under it: %v %s", err, got.Status)
	}
	if err := os.WriteFile(gate, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := <-created; err != nil {
		t.Fatalf("the slow create: %v", err)
	}
	if err := <-reused; err != nil {
		t.Fatalf("the create-or-reuse that waited for it: %v", err)
	}
}

// A record left provisioning on a broker declared lost is settled by nobody (only its own broker
// can tell a start in flight there from one cut short) until that broker is back; meanwhile a
// create-or-reuse of its name on another broker answers 503 at once, saying why, instead of waiting
// out its request for a start that cannot come.
func TestCreateOrReuseOfARecordProvisioningOnALostNodeAnswersAtOnce(t *testing.T) {
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	now := time.Now()
	rec := store.Record{ID: protocol.NewSandboxID(), Org: b.Org, Name: "on-lost-node", Template: "default", Provider: "dir",
		Node: "lost-node", Status: protocol.StatusProvisioning, TTL: time.Minute, CreatedAt: now, CreatedBy: "key:test", Heartbeat: now}
	if _, _, err := b.Store.CreateOrReuse(ctx, rec, false); err != nil {
		t.Fatal(err)
	}
	if _, changed, err := b.Store.MarkNodeLost(ctx, b.Org, rec.ID, "lost-node", true); err != nil || !changed {
		t.Fatalf("marking the node lost: %v %v", changed, err)
	}
	reuseCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err := b.Client.CreateSandbox(reuseCtx, protocol.CreateSandboxRequest{Name: "on-lost-node"})
	if reuseCtx.Err() != nil {
		t.Fatalf("a create-or-reuse of a record provisioning on a lost node waited out its request (%s): %v", time.Since(start), err)
	}
	if code(err) != protocol.CodeUnavailable {
		t.Errorf("a create-or-reuse of a record provisioning on a lost node: %v, want unavailable", err)
	}
	if got, err := b.Store.Get(ctx, b.Org, rec.ID); err != nil || got.Status != protocol.StatusProvisioning {
		t.Errorf("the lost node's record was changed: %v %s", err, got.Status)
	}
}

// A create-or-reuse that claimed a stopped sandbox to resume it, whose every answer Redis lost, is
// settled like a resume of this broker's (within a reconcile or two): its claim is the new id it
// made, which this broker knows as its own. Before, it stayed provisioning until the broker
// restarted; a claim of unknown origin is given another broker's 30 s wait first.
func TestCreateOrReuseResumeWhoseAnswersRedisLostIsSettled(t *testing.T) {
	lossy := &redistest.LoseAnswers{Match: []byte("reuse-lost"), Also: []byte("provisioning")}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "reuse-lost"}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.StopSandbox(ctx, "reuse-lost"); err != nil {
		t.Fatal(err)
	}
	lossy.Lose.Store(1000)
	_, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "reuse-lost"})
	lossy.Lose.Store(0)
	if code(err) != protocol.CodeUnavailable {
		t.Fatalf("a create-or-reuse whose every answer was lost: %v, want unavailable", err)
	}
	if rec, err := b.Store.Get(ctx, b.Org, "reuse-lost"); err != nil || rec.Status != protocol.StatusProvisioning {
		t.Fatalf("the resume's claim: %v %q, want provisioning (the test did not test)", err, rec.Status)
	}
	var rec store.Record
	wait.Eventually(t, 15*time.Second, func() bool {
		rec, _ = b.Store.Get(ctx, b.Org, "reuse-lost")
		return rec.Status != protocol.StatusProvisioning
	}, "the abandoned resume is settled")
	if rec.Status != protocol.StatusStopped || rec.StopReason != protocol.StopRuntimeLost {
		t.Fatalf("the abandoned resume: %s (%s), want stopped (runtime_lost)", rec.Status, rec.StopReason)
	}
	if got, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "reuse-lost"}); err != nil || got.Sandbox.Status != protocol.StatusRunning {
		t.Fatalf("create-or-reuse again: %v %+v", err, got)
	}
}

// hangUpListener's connections say on seen when the broker reads a client's end of stream.
type hangUpListener struct {
	net.Listener
	seen chan struct{}
}

func (l *hangUpListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &hangUpConn{Conn: c, seen: l.seen}, nil
}

type hangUpConn struct {
	net.Conn
	seen chan struct{}
}

func (c *hangUpConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		select {
		case c.seen <- struct{}{}:
		default:
		}
	}
	return n, err
}

// A start whose move to running landed in Redis but whose answer was lost (a network blip or a
// failover between the two) is running: before, the Redis client's resend found the record running
// already, the broker took that for another's move and ended the runtime it had just started, so
// the record said running with nothing behind it, no reconcile brought it back, and the owner's
// resume answered it was running.
func TestStartWhoseRunningAnswerRedisLost(t *testing.T) {
	t.Parallel()
	// Only the move from provisioning to running names both.
	lossy := &redistest.LoseAnswers{Match: []byte("provisioning"), Also: []byte("running")}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	works := func(what string, sb protocol.Sandbox, err error) {
		t.Helper()
		if lossy.Lose.Load() > 0 {
			t.Fatalf("%s: no answer was lost: the test did not test", what)
		}
		if err != nil || sb.Status != protocol.StatusRunning {
			t.Fatalf("%s: %v %+v, want running", what, err, sb.Status)
		}
		if res, err := runtimeOf(t, b, sb.ID).Exec(ctx, provider.ExecRequest{Command: "true"}); err != nil || res.ExitCode != 0 {
			t.Fatalf("%s: exec: %v %+v", what, err, res)
		}
	}
	// One answer lost: the Redis client's resend finds the record running. Four: every try of it.
	for _, lose := range []int32{1, 4} {
		name := fmt.Sprint("lost-", lose)
		lossy.Lose.Store(lose)
		res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name})
		works(fmt.Sprintf("a create, %d answers lost", lose), res.Sandbox, err)
		if _, err := b.Client.StopSandbox(ctx, name); err != nil {
			t.Fatal(err)
		}
		lossy.Lose.Store(lose)
		sb, err := b.Client.ResumeSandbox(ctx, name)
		works(fmt.Sprintf("a resume, %d answers lost", lose), sb, err)
	}
}

// A stop whose answer Redis lost ends the runtime at once: before, the Redis client's resend found
// the record stopped, the broker took that for a stop already made and left the runtime running
// (its processes, its place on the host, outside the org's running count) until the next reconcile.
func TestStopWhoseAnswerRedisLost(t *testing.T) {
	t.Parallel()
	lossy := &redistest.LoseAnswers{Also: []byte(protocol.StatusStopped)}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"})
	if err != nil {
		t.Fatal(err)
	}
	inst := runtimeOf(t, b, res.Sandbox.ID)
	lossy.Match = []byte(res.Sandbox.ID)
	lossy.Lose.Store(1)
	if sb, err := b.Client.StopSandbox(ctx, "dev"); err != nil || sb.Status != protocol.StatusStopped {
		t.Fatalf("stop, its answer lost: %v %+v", err, sb.Status)
	}
	if lossy.Lose.Load() > 0 {
		t.Fatal("no answer was lost: the test did not test")
	}
	select {
	case <-inst.Done():
	default:
		t.Fatal("the stopped sandbox's runtime still runs")
	}
}

// TestExpiryStopWhoseAnswerRedisLost: the sweeper's stop of an expired sandbox, its answer lost
// (the Redis client sends it again and finds the record stopped, by itself), still ends the
// runtime at once, as a user's stop does: it ran on, outside the org's running count, until the
// next reconcile.
func TestExpiryStopWhoseAnswerRedisLost(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	lossy := &redistest.LoseAnswers{Also: []byte(protocol.StopTTLExpired)}
	b := servertest.New(t, servertest.Options{RedisDialer: lossy.Dial, Now: clock.Now})
	ctx := t.Context()
	ttl := int64(2)
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev", TTLSeconds: &ttl})
	if err != nil {
		t.Fatal(err)
	}
	inst := runtimeOf(t, b, res.Sandbox.ID)
	clock.Advance(1500 * time.Millisecond)
	if r, err := b.Sweeper.SweepOnce(ctx); err != nil || r.Warned != 1 {
		t.Fatalf("first sweep: %+v %v", r, err)
	}
	clock.Advance(time.Second)
	lossy.Match = []byte(res.Sandbox.ID)
	lossy.Lose.Store(1)
	b.Sweeper.SweepOnce(ctx)
	if lossy.Lose.Load() > 0 {
		t.Fatal("no answer was lost: the test did not test")
	}
	if got, err := b.Client.GetSandbox(ctx, "dev"); err != nil || got.Status != protocol.StatusStopped {
		t.Fatalf("after the sweep: %v %+v", err, got)
	}
	select {
	case <-inst.Done():
	default:
		t.Fatal("the expired sandbox's runtime still runs")
	}
}
