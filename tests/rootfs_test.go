package tests

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A template whose rootfs is nothing but a static shell (no libc, no loader) works end to end: the
// broker runs bin/sbx-init, built the way scripts/broker.sh builds it, as the sandbox's init.
func TestTemplateRootfsWithoutLibc(t *testing.T) {
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatal("busybox is required (a static shell for a rootfs without libc): run scripts/deps.sh (apt-get install -y busybox-static)")
	}
	dir := t.TempDir()
	root := filepath.Join(dir, "rootfs")
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
	// The sandbox uid must reach the rootfs.
	for _, p := range []string{filepath.Dir(dir), dir} {
		os.Chmod(p, 0o711)
	}
	tmpl := filepath.Join(dir, "templates.yaml")
	if err := os.WriteFile(tmpl, []byte("- name: bare\n  rootfs: "+root+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	br := startBroker(t, "--templates", tmpl)
	br.ok("create", "box", "--template", "bare")
	r := br.sbctl("exec", "box", "--", "sh", "-c", `echo "in $(pwd)"; [ -e /lib64 ] || [ -e /usr/lib ] || echo no-libc`)
	if r.code != 0 || r.stdout != "in /workspace\nno-libc\n" {
		t.Fatalf("exec in the bare rootfs: exit %d\nstdout: %q\nstderr: %s\nbroker log:\n%s", r.code, r.stdout, r.stderr, tailLines(br.log.String(), 20))
	}
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
