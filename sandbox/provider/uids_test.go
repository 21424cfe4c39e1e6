package provider

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// holdInotify opens inotify instances until the kernel refuses one, says how many it got in
// /workspace/held, and keeps them open.
const holdInotify = `import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init()
    if fd < 0:
        break
    fds.append(fd)
open('/workspace/.held', 'w').write('%d %d' % (len(fds), ctypes.get_errno()))
os.rename('/workspace/.held', '/workspace/held')
time.sleep(600)
`

// oneInotify prints "ok" if this process can make an inotify instance, else the errno.
const oneInotify = `import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init()
print('ok' if fd >= 0 else 'errno %d (%s)' % (ctypes.get_errno(), os.strerror(ctypes.get_errno())))
`

// Each sandbox has its own host uid, so per-uid kernel objects are not shared: both are uid 1000
// inside but different uids on the host (the kernel's view, /proc/<pid>/status), and one sandbox
// that takes every inotify instance its uid may have (fs.inotify.max_user_instances, counted per
// host uid) leaves the other able to make its own. The shared case is the control: with one uid
// for both, as before, the second sandbox is refused.
func TestNamespacePerUIDKernelObjects(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("sandboxes run as their own host uid only under a root broker")
	}
	t.Parallel()
	for _, tc := range []struct {
		name       string
		uidA, uidB int
		shared     bool
	}{
		{name: "own uids", uidA: 240001, uidB: 240002},
		{name: "shared uid (before)", uidA: 240003, uidB: 240003, shared: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			n := newNamespace(t, Config{})
			a, specA := startSandboxAs(t, n, tc.uidA)
			b, _ := startSandboxAs(t, n, tc.uidB)
			for _, s := range []struct {
				in  Instance
				uid int
			}{{a, tc.uidA}, {b, tc.uidB}} {
				if _, out := sh(t, s.in, "id -u"); strings.TrimSpace(out) != "1000" {
					t.Errorf("id -u inside: %q, want 1000", out)
				}
				if got := hostUIDs(t, s.in.(*instance).initPid); got != fmt.Sprintf("%d %d %d %d", s.uid, s.uid, s.uid, s.uid) {
					t.Errorf("the init's host uids (real, effective, saved, fs): %q, want %d", got, s.uid)
				}
			}

			if _, err := a.Exec(context.Background(), ExecRequest{Argv: []string{"python3", "-c", holdInotify}, Background: true}); err != nil {
				t.Fatal(err)
			}
			held := filepath.Join(n.WorkspaceDir(specA), "held")
			var got []byte
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				var err error
				if got, err = os.ReadFile(held); err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("sandbox A did not say how many inotify instances it holds")
				}
			}
			var count, errno int
			fmt.Sscanf(string(got), "%d %d", &count, &errno)
			if count == 0 || errno != 24 { // EMFILE: the per-uid limit, not some other failure
				t.Fatalf("sandbox A got %d inotify instances, then errno %d; want the per-uid limit (EMFILE)", count, errno)
			}
			_, out := sh(t, b, "python3 -c \""+oneInotify+"\"")
			out = strings.TrimSpace(out)
			t.Logf("A took %d inotify instances (then EMFILE); B's own: %s", count, out)
			switch {
			case tc.shared && out == "ok":
				t.Errorf("with one uid for both, B still made an inotify instance after A took %d: the control no longer shows the sharing", count)
			case !tc.shared && out != "ok":
				t.Errorf("sandbox B cannot make an inotify instance after A took %d of its own uid's: %s", count, out)
			}
		})
	}
}

// A network sandbox's pasta runs as the sandbox's own uid, the owner of its user namespace (as any
// other uid it would have no capability there and the sandbox no network).
func TestNamespaceNetworkHelperRunsAsSandboxUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("sandboxes run as their own host uid only under a root broker")
	}
	t.Parallel()
	n := newNamespace(t, Config{})
	in, spec := startSandboxWith(t, n, Template{Name: "net", Network: NetworkOn}, 240011)
	pids := pastaPids(t, spec.ID)
	if len(pids) != 1 {
		t.Fatalf("want one pasta, found %v", pids)
	}
	var pid int
	fmt.Sscan(pids[0], &pid)
	if got := hostUIDs(t, pid); got != "240011 240011 240011 240011" {
		t.Errorf("pasta's host uids: %q, want the sandbox's 240011", got)
	}
	if res, out := sh(t, in, "ip -o addr show 2>/dev/null | grep -v ' lo ' | head -1 || cat /proc/net/dev"); res.ExitCode != 0 {
		t.Errorf("network inside: %s", out)
	}
}

// startSandboxAs is startSandbox for a sandbox that runs as host uid uid.
func startSandboxAs(t *testing.T, p Provider, uid int) (Instance, Spec) {
	return startSandboxWith(t, p, Template{Name: "test"}, uid)
}

// startSandboxWith is startSandboxAs for a template.
func startSandboxWith(t *testing.T, p Provider, tmpl Template, uid int) (Instance, Spec) {
	t.Helper()
	spec := Spec{ID: NewID(), Template: tmpl, UID: uid}
	ctx := context.Background()
	if err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	in, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := in.Stop(context.Background()); err != nil {
			t.Error(err)
		}
		if err := p.Destroy(context.Background(), spec); err != nil {
			t.Error(err)
		}
	})
	return in, spec
}

// hostUIDs is the Uid line of /proc/<pid>/status: real, effective, saved and filesystem uid as the
// host's kernel sees them.
func hostUIDs(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			return strings.Join(strings.Fields(rest), " ")
		}
	}
	t.Fatalf("no Uid line in /proc/%d/status", pid)
	return ""
}
