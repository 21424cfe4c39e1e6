package sandbox

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// TestMain lets the dir provider run this test binary as its sandboxes' init.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == provider.InitArg {
		provider.RunInit()
	}
	os.Exit(m.Run())
}

// A stop decided on a read of the record that a resume has overtaken must not end the resumed
// runtime, and a resume must not fail on a runtime whose stop has not ended it yet. The
// interleavings: a reconcile pass reads the record stopped and, before it takes the lifecycle lock
// to end the runtime, a resume claims the record and starts it; or a stop's transition lands and a
// resume takes the lock before the stop ends the runtime. Before, the late stop ended the resumed
// runtime (the record said running with nothing behind it, and no reconcile brought it back), and
// the resume failed ("sandbox is running") leaving the sandbox stopped with runtime_lost.
func TestALateStopLeavesAResumedSandboxRunning(t *testing.T) {
	ctx := t.Context()
	st := store.New(redistest.Start(t).Client(t))
	dir := t.TempDir()
	for _, p := range []string{filepath.Dir(dir), dir} { // the sandbox uid reaches the workspaces through them
		if err := os.Chmod(p, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	prov, err := provider.NewDir(provider.Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewManager(Config{Store: st, Provider: prov, Templates: map[string]provider.Template{"default": provider.DefaultTemplate()},
		Node: "n1", Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Now: time.Now,
		DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour, IndexDir: filepath.Join(dir, "hosted")})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close(ctx)
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
	rec, _, err := m.Create(ctx, c, CreateRequest{Name: "read-then-resumed"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Stop(ctx, c, rec.ID, protocol.StopRequested); err != nil {
		t.Fatal(err)
	}
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
	rec, _, err = m.Create(ctx, c, CreateRequest{Name: "stopped-then-resumed"})
	if err != nil {
		t.Fatal(err)
	}
	old, err := m.Instance(rec)
	if err != nil {
		t.Fatal(err)
	}
	stale, err = st.Transition(ctx, "o", rec.ID, store.Transition{From: []string{protocol.StatusRunning}, To: protocol.StatusStopped,
		Fields: map[string]string{store.FieldStopReason: protocol.StopRequested}})
	if err != nil {
		t.Fatal(err)
	}
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
