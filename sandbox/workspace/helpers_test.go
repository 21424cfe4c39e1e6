package workspace

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// newWS opens a workspace on a fresh directory and returns it with its host directory.
func newWS(t testing.TB, opts Options) (*Workspace, string) {
	t.Helper()
	dir := t.TempDir()
	w, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w, dir
}

// put writes a host file, creating parents.
func put(t testing.TB, dir, rel, content string) {
	t.Helper()
	p := filepath.Join(dir, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func symlink(t testing.TB, target, link string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

func hostRead(t testing.TB, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// codeOf is the protocol code of err, "" for nil, and a marker for an untyped error (always a bug).
func codeOf(err error) string {
	if err == nil {
		return ""
	}
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return pe.Code
	}
	return "UNTYPED(" + err.Error() + ")"
}

// wantCode fails unless err carries code (or is nil when code is ""), and checks the message never
// shows the host directory.
func wantCode(t testing.TB, err error, code, hostDir string) {
	t.Helper()
	if got := codeOf(err); got != code {
		t.Fatalf("error = %v (code %q), want code %q", err, got, code)
	}
	if err != nil && hostDir != "" && strings.Contains(err.Error(), hostDir) {
		t.Fatalf("error %q shows the host directory %s", err, hostDir)
	}
}

// within fails the test if f does not return in d: the operations under test must never block.
func within(t testing.TB, d time.Duration, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("operation still running after %v", d)
	}
}

// noTemps fails if a temporary upload file was left anywhere under dir.
func noTemps(t testing.TB, dir string) {
	t.Helper()
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), tempPrefix) {
			t.Errorf("temporary file left behind: %s", p)
		}
		return nil
	})
}
