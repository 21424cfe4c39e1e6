package server_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
)

// restartAfter stops b, lets crash change Redis as a crash or an operator would, and starts a
// broker on the same data dir and Redis: its start-up recovery is what the test looks at.
func restartAfter(t *testing.T, b *servertest.Broker, crash func()) *servertest.Broker {
	t.Helper()
	b.Stop()
	crash()
	return servertest.New(t, servertest.Options{Provider: "dir", DataDir: b.DataDir, Redis: b.Redis})
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
