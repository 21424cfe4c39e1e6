package provider

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestSbxInitInRootfsWithoutLibc: a template whose rootfs holds nothing but a static shell (no libc,
// no loader) starts with cmd/sbx-init as its init and runs commands. cmd/sbx-init is built with the
// environment's CGO_ENABLED, as a developer would: it must be static whatever that is.
func TestSbxInitInRootfsWithoutLibc(t *testing.T) {
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatal("busybox is required for this test (a static shell for a rootfs without libc): run scripts/deps.sh (apt-get install -y busybox-static)")
	}
	if libs := elfNeeded(t, busybox); len(libs) > 0 {
		t.Fatalf("%s is dynamically linked (%v); install busybox-static", busybox, libs)
	}
	init := filepath.Join(t.TempDir(), "sbx-init")
	if out, err := exec.Command("go", "build", "-o", init, "../../cmd/sbx-init").CombinedOutput(); err != nil {
		t.Fatalf("go build cmd/sbx-init: %v\n%s", err, out)
	}
	root := testDataDir(t)
	if err := os.MkdirAll(filepath.Join(root, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin/sh"), b, 0o755); err != nil {
		t.Fatal(err)
	}

	n := newNamespace(t, Config{InitPath: init})
	in, _ := startSandbox(t, n, Template{Rootfs: root, Env: map[string]string{"FROM": "tmpl"}})
	_, out := sh(t, in, `echo "$FROM $(pwd)"; [ -e /lib64 ] || [ -e /usr/lib ] || echo no-libc`)
	if out != "tmpl /workspace\nno-libc\n" {
		t.Errorf("inside the busybox rootfs: %q", out)
	}
}

// elfNeeded lists the shared libraries an ELF binary needs.
func elfNeeded(t *testing.T, p string) []string {
	t.Helper()
	f, err := elf.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	libs, err := f.ImportedLibraries()
	if err != nil {
		t.Fatal(err)
	}
	return libs
}
