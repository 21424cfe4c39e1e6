package provider

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// The dir provider isolates nothing, but it never runs tenant commands as root: a broker running as
// root runs them as the sandbox uid, which cannot read the host's secrets. Files they make, and
// files the broker put there, stay usable by both.
func TestDirNeverRunsAsRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("as another user the dir provider runs commands as that user, never root")
	}
	d := newDir(t)
	spec := Spec{ID: NewID(), Template: Template{Name: "test"}}
	if err := d.Create(t.Context(), spec); err != nil {
		t.Fatal(err)
	}
	// A workspace of a dir sandbox from before commands ran as the sandbox uid: everything in it
	// belongs to root, and it must stay writable from inside. A hard link to a host file that a root
	// tenant planted there must not hand that file to the sandbox uid.
	ws := d.WorkspaceDir(spec)
	if err := os.WriteFile(filepath.Join(ws, "old.txt"), []byte("old\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(ws, 0, 0); err != nil {
		t.Fatal(err)
	}
	planted := os.Link("/etc/shadow", filepath.Join(ws, "shadow")) == nil // only where /tmp and /etc share a filesystem
	in, err := d.Start(t.Context(), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		in.Stop(t.Context())
		d.Destroy(t.Context(), spec)
	})
	if res, out := sh(t, in, "id -u; id -g"); res.ExitCode != 0 || out != strconv.Itoa(DefaultUID)+"\n"+strconv.Itoa(DefaultGID)+"\n" {
		t.Errorf("id: exit %d %q: want the sandbox uid and gid %d", res.ExitCode, out, DefaultUID)
	}
	if res, out := sh(t, in, "cat /etc/shadow"); res.ExitCode == 0 {
		t.Errorf("a dir sandbox read /etc/shadow: %q", out)
	}
	if planted {
		if res, out := sh(t, in, "cat shadow"); res.ExitCode == 0 {
			t.Errorf("a dir sandbox read /etc/shadow through a hard link: %q", out)
		}
	}
	if res, out := sh(t, in, "echo new > new.txt && echo more >> old.txt && echo $HOME"); res.ExitCode != 0 || strings.TrimSpace(out) != ws {
		t.Fatalf("write in the workspace: exit %d %q", res.ExitCode, out)
	}
	for name, want := range map[string]string{"new.txt": "new\n", "old.txt": "old\nmore\n"} {
		if b, err := os.ReadFile(filepath.Join(ws, name)); err != nil || string(b) != want {
			t.Errorf("%s as the broker reads it: %q %v", name, b, err)
		}
	}
}
