package provider

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// asNobody runs argv on the host as nobody (65534), another local user, and returns its combined
// output and whether it succeeded.
func asNobody(t *testing.T, argv ...string) (string, bool) {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534, Groups: []uint32{}}}
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err == nil
}

// Another local user can neither list nor read a sandbox's workspace, nor run a setuid file the
// sandbox planted there to become the sandbox's uid; the sandbox's directories say so in their modes.
func TestNamespaceDirsClosedToOtherUsers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to act as another local user")
	}
	t.Parallel()
	n := newNamespace(t, Config{})
	in, spec := startSandboxAs(t, n, 241001)
	if res, out := sh(t, in, "echo secret > /workspace/notes && cp /usr/bin/id /workspace/suid && chmod 4755 /workspace/suid && ls -l /workspace/suid"); res.ExitCode != 0 {
		t.Fatalf("planting: %s", out)
	}
	ws := n.WorkspaceDir(spec)
	if out, ok := asNobody(t, "/usr/bin/ls", ws); ok {
		t.Errorf("nobody listed the workspace: %s", out)
	}
	if out, ok := asNobody(t, "/usr/bin/cat", filepath.Join(ws, "notes")); ok {
		t.Errorf("nobody read a workspace file: %s", out)
	}
	if out, ok := asNobody(t, filepath.Join(ws, "suid"), "-u"); ok {
		t.Errorf("nobody ran the sandbox's setuid file and became uid %s", out)
	}
	if out, ok := asNobody(t, "/usr/bin/ls", n.layout.root()); ok {
		t.Errorf("nobody listed the sandboxes: %s", out)
	}
	for _, d := range []struct {
		path       string
		uid, gid   int
		mode       os.FileMode
		whoseGroup string
	}{
		{n.layout.sandboxDir(spec.ID), 0, 241001, 0o710, "root's, the sandbox's group"},
		{n.layout.stateDir(spec.ID), 0, 0, 0o700, "root's"},
		{ws, 241001, 241001, 0o700, "the sandbox's"},
	} {
		fi, err := os.Lstat(d.path)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().Perm() != d.mode || int(st.Uid) != d.uid || int(st.Gid) != d.gid {
			t.Errorf("%s: %04o %d:%d, want %04o %s", d.path, fi.Mode().Perm(), st.Uid, st.Gid, d.mode, d.whoseGroup)
		}
	}
	// The sandbox opening its workspace up lasts until its next start.
	sh(t, in, "chmod 755 /workspace")
	if err := in.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	in2, err := n.Start(t.Context(), spec)
	if err != nil {
		t.Fatal(err)
	}
	defer in2.Stop(t.Context())
	if fi, _ := os.Lstat(ws); fi.Mode().Perm() != 0o700 {
		t.Errorf("after a restart the workspace is %04o, want 0700", fi.Mode().Perm())
	}
}
