package sandbox

import (
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// A resume made through another broker, claimed before the hosting broker ended the runtime of the
// stop before it, must start the sandbox. The hosting broker's end of the runtime reads the record
// provisioning and leaves the old runtime to the start (c9e0e56); the start it is asked for must
// then end that runtime and start a new one. Before, the ask to start found a runtime there and
// did nothing, every time it was asked again, and the settle passed over a record with a runtime:
// the record stayed provisioning, the stopped sandbox's processes running, until it was deleted.
func TestARemoteResumeOvertakingItsStopStarts(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)

	for _, tc := range []struct {
		name, sandbox string
		// stopHere is the hosting broker's end of the runtime, after the resume's claim landed.
		stopHere func(stale store.Record)
	}{
		{"its own stop's end of the runtime", "remote-resumed-a", func(stale store.Record) { m.stopLocal(ctx, stale) }},
		{"the other broker's stop command", "remote-resumed-b", func(stale store.Record) { m.reconcileOne(ctx, stale.Org, stale.ID, "") }},
	} {
		rec, old, stale := stoppedInRedisOnly(t, m, st, tc.sandbox)
		// Another broker's resume claims it (Resume's own transition, under that broker's claim).
		claimForResume(t, st, rec.ID, "n2/"+rec.ID)
		tc.stopHere(stale)
		m.reconcileOne(ctx, "o", rec.ID, "key:k") // the other broker's ask to start
		got, err := st.Get(ctx, "o", rec.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.Status != protocol.StatusRunning {
			t.Fatalf("%s: the asked start left the sandbox %s", tc.name, got.Status)
		}
		select {
		case <-old.Done():
		default:
			t.Errorf("%s: the stopped runtime still runs", tc.name)
		}
		inst, err := m.Instance(got)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if res, err := inst.Exec(ctx, provider.ExecRequest{Command: "true"}); err != nil || res.ExitCode != 0 {
			t.Fatalf("%s: exec: %v %+v", tc.name, err, res)
		}
	}
}
