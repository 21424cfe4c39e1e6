package sandbox

import (
	"context"
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

// testManager is a Manager as node "n1" on the dir provider, in a temporary data dir the sandbox
// uid reaches, over a real redis-server (srv, for a test that pauses it); now is its clock. It is
// closed when the test ends.
func testManager(t *testing.T, now func() time.Time) (m *Manager, st *store.Store, srv *redistest.Server) {
	t.Helper()
	srv = redistest.Start(t)
	st = store.New(srv.Client(t))
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
	m, err = NewManager(Config{Store: st, Provider: prov, Templates: map[string]provider.Template{"default": provider.DefaultTemplate()},
		Node: "n1", Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Now: now,
		DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour, IndexDir: filepath.Join(dir, "hosted")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(context.Background()) })
	return m, st, srv
}

// stoppedInRedisOnly creates a running sandbox, then moves its record to stopped in Redis alone,
// as a stop's transition does before its end of the runtime: it answers the record, the runtime
// still running, and the stopped record that stop read.
func stoppedInRedisOnly(t *testing.T, m *Manager, st *store.Store, name string) (rec store.Record, old provider.Instance, stale store.Record) {
	t.Helper()
	ctx := t.Context()
	rec, _, err := m.Create(ctx, Caller{Org: "o", Actor: "key:k"}, CreateRequest{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if old, err = m.Instance(rec); err != nil {
		t.Fatal(err)
	}
	stale, err = st.Transition(ctx, "o", rec.ID, store.Transition{From: []string{protocol.StatusRunning}, To: protocol.StatusStopped,
		Fields: map[string]string{store.FieldStopReason: protocol.StopRequested}})
	if err != nil {
		t.Fatal(err)
	}
	return rec, old, stale
}

// claimForResume moves a stopped record to provisioning under claim, as a resume's transition does.
func claimForResume(t *testing.T, st *store.Store, id, claim string) {
	t.Helper()
	if _, err := st.Transition(t.Context(), "o", id, store.Transition{From: []string{protocol.StatusStopped}, To: protocol.StatusProvisioning,
		Claim: claim, Fields: map[string]string{store.FieldStopReason: "", store.FieldFailure: ""}}); err != nil {
		t.Fatal(err)
	}
}

// createdAndStopped creates sandbox name for c and stops it, as its owner would.
func createdAndStopped(t *testing.T, m *Manager, c Caller, name string) store.Record {
	t.Helper()
	rec, _, err := m.Create(t.Context(), c, CreateRequest{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Stop(t.Context(), c, rec.ID, protocol.StopRequested); err != nil {
		t.Fatal(err)
	}
	return rec
}

// restarted closes m, as a broker that stops, and answers the Manager of its next run on the same
// config, recovered.
func restarted(t *testing.T, m *Manager) *Manager {
	t.Helper()
	m.Close(t.Context())
	m2, err := NewManager(m.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Close(context.Background()) })
	if err := m2.Recover(t.Context()); err != nil {
		t.Fatal(err)
	}
	return m2
}
