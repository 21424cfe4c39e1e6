package server_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

// restartAfter stops b, lets crash change Redis as a crash or an operator would, and starts a
// broker on the same data dir and Redis: its start-up recovery is what the test looks at.
func restartAfter(t *testing.T, b *servertest.Broker, crash func()) *servertest.Broker {
	t.Helper()
	b.Stop()
	crash()
	return servertest.New(t, servertest.Options{Provider: "dir", DataDir: b.DataDir, Redis: b.Redis})
}

// sandboxEvents is ref's event log as reader sees it now (up to 200 events).
func sandboxEvents(t testing.TB, reader *client.Client, ref string) []protocol.Event {
	t.Helper()
	var out []protocol.Event
	if err := reader.Events(t.Context(), client.EventOptions{Ref: ref, Backlog: 200}, func(e protocol.Event) error {
		out = append(out, e)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// eventBarrier emits a marker (a token_minted event) through each of via, one per broker, and
// waits until reader sees every marker in ref's log. Each broker's writer appends in order, so
// every event a broker emitted before its marker is in the log by then: a "nothing else was
// written" check made after the barrier cannot pass only because the log is behind.
func eventBarrier(t testing.TB, reader *client.Client, ref string, via ...*client.Client) {
	t.Helper()
	want := map[string]bool{}
	for _, c := range via {
		m, err := c.Delegate(t.Context(), ref, protocol.MintRequest{Scopes: []string{protocol.ScopeExec}})
		if err != nil {
			t.Fatal(err)
		}
		want[m.JTI] = true
	}
	wait.Eventually(t, 10*time.Second, func() bool {
		seen := 0
		for _, e := range sandboxEvents(t, reader, ref) {
			if e.Type == protocol.EventTokenMinted && want[e.JTI] {
				seen++
			}
		}
		return seen == len(want)
	}, "the barrier's %d token_minted events in %s's log", len(want), ref)
}

// A sandbox whose record Redis lost (flushed, replaced, an old snapshot) keeps its files and its
// index entry: deleting work on Redis' word alone would lose it. Its runtime is not brought back.
func TestRecoveryKeepsFilesWhoseRecordIsGone(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "orphaned"})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Sandbox.ID
	ws := filepath.Join(b.DataDir, "sandboxes", id, "workspace")
	if err := os.WriteFile(filepath.Join(ws, "work.txt"), []byte("hours of it"), 0o644); err != nil {
		t.Fatal(err)
	}
	b2 := restartAfter(t, b, func() {
		if err := b.RDB.Del(t.Context(), store.SandboxKey(b.Org, id)).Err(); err != nil {
			t.Fatal(err)
		}
	})
	if data, err := os.ReadFile(filepath.Join(ws, "work.txt")); err != nil || string(data) != "hours of it" {
		t.Fatalf("workspace file after recovery without a record: %q %v", data, err)
	}
	if _, err := os.Stat(filepath.Join(b2.DataDir, "hosted", id)); err != nil {
		t.Fatalf("index entry dropped: %v", err)
	}
	if n := initsIn(ws); n > 0 {
		t.Fatalf("%d processes run in a sandbox that has no record", n)
	}
}

// A broker that died mid-resume brings the sandbox back stopped (its files are whole: resumable);
// one that died mid-create marks it failed (its template setup may not have run).
func TestRecoveryOfInterruptedProvisioning(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	resumed, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "resuming"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.StopSandbox(t.Context(), "resuming"); err != nil {
		t.Fatal(err)
	}
	created, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "creating"})
	if err != nil {
		t.Fatal(err)
	}
	b2 := restartAfter(t, b, func() {
		// What each record held when the broker died: provisioning, with or without a first start.
		for id, started := range map[string]int{resumed.Sandbox.ID: 1, created.Sandbox.ID: 0} {
			if started == 0 {
				b.RDB.HSet(t.Context(), store.SandboxKey(b.Org, id), "started", 0)
			}
			if err := b.RDB.HSet(t.Context(), store.SandboxKey(b.Org, id), "status", protocol.StatusProvisioning).Err(); err != nil {
				t.Fatal(err)
			}
		}
	})
	got, err := b2.Client.GetSandbox(t.Context(), "resuming")
	if err != nil || got.Status != protocol.StatusStopped || got.StopReason != protocol.StopRuntimeLost {
		t.Fatalf("interrupted resume: %v %+v, want stopped (runtime_lost)", err, got)
	}
	if got, err := b2.Client.ResumeSandbox(t.Context(), "resuming"); err != nil || got.StoppedAt != nil {
		t.Fatalf("resume after recovery: %v, stopped_at %v (a running sandbox has none)", err, got.StoppedAt)
	}
	got, err = b2.Client.GetSandbox(t.Context(), "creating")
	if err != nil || got.Status != protocol.StatusFailed || got.Failure == "" {
		t.Fatalf("interrupted create: %v %+v, want failed", err, got)
	}
}

// A sandbox resumed through a broker that does not host it is started by the one that does: one
// resumed event, naming who asked, and an error (not a stopped sandbox reported as resumed) when
// the hosting broker cannot start it.
func TestResumeThroughAnotherBroker(t *testing.T) {
	t.Parallel()
	a := servertest.New(t, servertest.Options{Provider: "dir", Node: "node-a"})
	b := servertest.New(t, servertest.Options{Provider: "dir", Node: "node-b", Redis: a.Redis})
	viaB := b.NewClient(a.Org)
	ctx := t.Context()
	for _, name := range []string{"far", "broken"} {
		if _, err := a.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Client.StopSandbox(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	got, err := viaB.ResumeSandbox(ctx, "far")
	if err != nil || got.Status != protocol.StatusRunning {
		t.Fatalf("resume through broker B: %v %+v", err, got)
	}
	// Both brokers emit the resumed event inside the call, so once a marker emitted through each
	// after it is in the log, a second resumed event (from either broker) is there too.
	eventBarrier(t, a.Client, "far", a.Client, viaB)
	var resumed []protocol.Event
	for _, e := range sandboxEvents(t, a.Client, "far") {
		if e.Type == protocol.EventResumed {
			resumed = append(resumed, e)
		}
	}
	if len(resumed) != 1 || !strings.HasPrefix(resumed[0].Actor, "key:") {
		t.Fatalf("resumed events: %+v, want one naming the caller's key", resumed)
	}

	// Broker A cannot start "broken": its workspace is gone.
	rec, err := a.Store.Get(ctx, a.Org, "broken")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(a.DataDir, "sandboxes", rec.ID)); err != nil {
		t.Fatal(err)
	}
	got, err = viaB.ResumeSandbox(ctx, "broken")
	if code(err) != protocol.CodeSandboxFailed {
		t.Fatalf("a resume the hosting broker could not do: %v %+v, want sandbox_failed", err, got)
	}
}
