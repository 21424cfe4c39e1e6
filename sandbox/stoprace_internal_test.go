package sandbox

import (
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// A stop decided on a read of the record that a resume has overtaken must not end the resumed
// runtime, and a resume must not fail on a runtime whose stop has not ended it yet. The
// interleavings: a reconcile pass reads the record stopped and, before it takes the lifecycle lock
// to end the runtime, a resume claims the record and starts it; or a stop's transition lands and a
// resume takes the lock before the stop ends the runtime. Before, the late stop ended the resumed
// runtime (the record said running with nothing behind it, and no reconcile brought it back), and
// the resume failed ("sandbox is running") leaving the sandbox stopped with runtime_lost.
func TestALateStopLeavesAResumedSandboxRunning(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	c := Caller{Org: "o", Actor: "key:k"}
	running := func(what string, rec store.Record) {
		t.Helper()
		inst, err := m.Instance(rec)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		select {
		case <-inst.Done():
			t.Fatalf("%s: the runtime ended", what)
		default:
		}
		if res, err := inst.Exec(ctx, provider.ExecRequest{Command: "true"}); err != nil || res.ExitCode != 0 {
			t.Fatalf("%s: exec: %v %+v", what, err, res)
		}
	}

	// A reconcile pass's read, overtaken by a resume before its stop runs.
	rec := createdAndStopped(t, m, c, "read-then-resumed")
	stale, err := st.Get(ctx, "o", rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	resumed, err := m.Resume(ctx, c, rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	m.stopLocal(ctx, stale)
	running("a stop decided on a read a resume overtook", resumed)

	// A stop whose transition landed, and whose end of the runtime a resume comes before.
	rec, old, stale := stoppedInRedisOnly(t, m, st, "stopped-then-resumed")
	resumed, err = m.Resume(ctx, c, rec.ID)
	if err != nil || resumed.Status != protocol.StatusRunning {
		t.Fatalf("a resume before the stop ended the runtime: %v %s", err, resumed.Status)
	}
	select {
	case <-old.Done():
	default:
		t.Error("the resume kept the runtime the stop was to end")
	}
	m.stopLocal(ctx, stale)
	running("the stop's late end of the runtime", resumed)
}
