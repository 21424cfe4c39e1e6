package sandbox

import (
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// A stop decided on a read that a resume has overtaken, whose read again under the lifecycle lock
// Redis does not answer, leaves the runtime: it may be the resumed one, and ended, the record says
// running with nothing behind it, which no reconcile brings back. A runtime left there while its
// record says stopped is ended by the next reconcile, once Redis answers. Before, Redis' silence
// was taken for the stale read being right, and the resumed sandbox was ended.
func TestALateStopWithRedisAwayLeavesAResumedSandboxRunning(t *testing.T) {
	ctx := t.Context()
	m, st, srv := testManager(t, time.Now)
	c := Caller{Org: "o", Actor: "key:k"}
	rec := createdAndStopped(t, m, c, "resumed")
	stale, err := st.Get(ctx, "o", rec.ID) // a reconcile pass's read
	if err != nil {
		t.Fatal(err)
	}
	resumed, err := m.Resume(ctx, c, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	inst, err := m.Instance(resumed)
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop(t)
	m.stopLocal(ctx, stale)
	srv.Restart(t)
	select {
	case <-inst.Done():
		t.Fatal("a stop on a stale read ended the resumed runtime while Redis was away")
	default:
	}
	if res, err := inst.Exec(ctx, provider.ExecRequest{Command: "true"}); err != nil || res.ExitCode != 0 {
		t.Fatalf("exec: %v %+v", err, res)
	}

	// A runtime left while its record says stopped is ended by the reconcile.
	if _, err := st.Transition(ctx, "o", rec.ID, store.Transition{From: []string{protocol.StatusRunning}, To: protocol.StatusStopped,
		Fields: map[string]string{store.FieldStopReason: protocol.StopRequested}}); err != nil {
		t.Fatal(err)
	}
	m.reconcileOne(ctx, "o", rec.ID, "")
	select {
	case <-inst.Done():
	default:
		t.Fatal("the reconcile left the runtime of a stopped sandbox running")
	}
}
