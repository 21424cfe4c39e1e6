package workspace

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// A write's replace that finds a directory at its target (one raced into place after the
// write's checks) leaves that directory where it was and fails as a rename over a directory does.
// Before, the exchange put the directory under the write's hidden temporary name, the unlink of
// the "old file" failed on it, and the directory, with everything in it, vanished from its name.
func TestExchangeWithADirectoryLeavesItInPlace(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, ".sbx-tmp-1"), []byte("new"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "target", "keep"), 0o755); err != nil {
		t.Fatal(err)
	}
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	err = exchange(int(d.Fd()), ".sbx-tmp-1", "target")
	if !errors.Is(err, syscall.EISDIR) {
		t.Errorf("exchange over a directory: %v, want EISDIR", err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "target", "keep")); err != nil || !fi.IsDir() {
		t.Errorf("the directory left its name: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, ".sbx-tmp-1")); err != nil || string(b) != "new" {
		t.Errorf("the new file is not back under its temporary name: %q %v", b, err)
	}

	// A file at the target is replaced, and its old copy is gone.
	if err := os.WriteFile(filepath.Join(dir, "file"), []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := exchange(int(d.Fd()), ".sbx-tmp-1", "file"); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "file")); string(b) != "new" {
		t.Errorf("the target holds %q, want the new content", b)
	}
	if _, err := os.Lstat(filepath.Join(dir, ".sbx-tmp-1")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the old copy is left under the temporary name: %v", err)
	}
}
