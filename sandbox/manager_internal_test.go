package sandbox

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

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
