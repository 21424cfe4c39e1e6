package sandbox

import (
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// Two starts of one claim (a resume's own start and a reconcile's for the record it found
// provisioning under that claim, taking the lifecycle lock one after the other) start the runtime
// once. Before, the second found the first's fresh runtime, ended it as a runtime a stop had left,
// and started another: whatever the sandbox ran in between (a command an agent started at once)
// was gone, while the record said running all along.
func TestTwoStartsOfOneClaimStartItOnce(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	c := Caller{Org: "o", Actor: "key:k"}
	claimed := stoppedAndClaimed(t, m, st, c, "twice")
	first, err := m.start(ctx, c, claimed)
	if err != nil || first.Status != protocol.StatusRunning {
		t.Fatalf("the first start: %v %s", err, first.Status)
	}
	inst, err := m.Instance(first)
	if err != nil {
		t.Fatal(err)
	}
	second, err := m.start(ctx, c, claimed) // the same claim, read before the first ended
	if err != nil || second.Status != protocol.StatusRunning {
		t.Fatalf("the second start of the same claim: %v %s", err, second.Status)
	}
	select {
	case <-inst.Done():
		t.Fatal("the second start of the same claim ended the runtime the first had started")
	default:
	}
	now, err := m.Instance(second)
	if err != nil {
		t.Fatal(err)
	}
	if now != inst {
		t.Fatal("the second start of the same claim replaced the runtime the first had started")
	}
	if res, err := now.Exec(ctx, provider.ExecRequest{Command: "true"}); err != nil || res.ExitCode != 0 {
		t.Fatalf("exec after both starts: %v %+v", err, res)
	}
}

// The second start of one claim starts nothing, so it says nothing: one resume is one `resumed`
// event. Before, the second start answered the first's record as its own start and emitted a
// second `resumed` (a pane showed the sandbox resumed twice, by two actors).
func TestTwoStartsOfOneClaimEmitOneResumed(t *testing.T) {
	ctx := t.Context()
	m, st, _ := testManager(t, time.Now)
	var mu sync.Mutex
	var resumed []protocol.Event
	m.cfg.Events = func(_ string, e protocol.Event) {
		if e.Type == protocol.EventResumed {
			mu.Lock()
			resumed = append(resumed, e)
			mu.Unlock()
		}
	}
	c := Caller{Org: "o", Actor: "key:k"}
	claimed := stoppedAndClaimed(t, m, st, c, "once")
	if _, err := m.start(ctx, c, claimed); err != nil {
		t.Fatal(err)
	}
	if got, err := m.start(ctx, Caller{Org: "o", Actor: "broker"}, claimed); err != nil || got.Status != protocol.StatusRunning {
		t.Fatalf("the second start of the same claim: %v %s", err, got.Status)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(resumed) != 1 {
		t.Fatalf("%d resumed events for one resume started twice, want 1: %+v", len(resumed), resumed)
	}
}

// stoppedAndClaimed creates a sandbox, stops it and claims its record for a resume ("claim-1"),
// as a resume's transition does: it answers the claimed record, for the starts to come.
func stoppedAndClaimed(t *testing.T, m *Manager, st *store.Store, c Caller, name string) store.Record {
	t.Helper()
	ctx := t.Context()
	rec := createdAndStopped(t, m, c, name)
	claimForResume(t, st, rec.ID, "claim-1")
	claimed, err := st.Get(ctx, "o", rec.ID)
	if err != nil {
		t.Fatal(err)
	}
	return claimed
}
