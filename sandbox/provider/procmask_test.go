package provider

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// mountinfo is one line of /proc/self/mountinfo: the mount's root within its filesystem, where it
// is mounted, and its per-mount options.
type mountinfo struct{ root, point, opts, line string }

func parseMountinfo(s string) []mountinfo {
	var out []mountinfo
	for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		out = append(out, mountinfo{root: f[3], point: f[4], opts: f[5], line: line})
	}
	return out
}

// TestSandboxProc is Docker's /proc hardening, and a mount table that tells a tenant nothing about
// the host.
func TestSandboxProc(t *testing.T) {
	n := newNamespace(t, Config{})
	in, spec := startSandbox(t, n, Template{})

	t.Run("masked files and directories are empty", func(t *testing.T) {
		_, table := sh(t, in, "cat /proc/self/mountinfo")
		mounts := parseMountinfo(table)
		checked := 0
		for _, name := range []string{"keys", "timer_list", "kcore", "sched_debug", "latency_stats", "timer_stats", "acpi", "scsi", "asound"} {
			fi, err := os.Stat("/proc/" + name)
			if err != nil {
				continue // this kernel has none
			}
			checked++
			p := "/proc/" + name
			cmd := "cat " + p + " 2>/dev/null | head -c 64"
			if fi.IsDir() {
				cmd = "ls -A " + p + " 2>/dev/null"
			}
			if _, out := sh(t, in, cmd); out != "" {
				t.Errorf("%s shows inside the sandbox: %q", p, out)
			}
			// Empty is not enough (an idle sandbox has no keys to list): something must be
			// mounted over it, read-only.
			if !slices.ContainsFunc(mounts, func(m mountinfo) bool { return m.point == p && strings.HasPrefix(m.opts, "ro") }) {
				t.Errorf("%s is not masked by a read-only mount", p)
			}
		}
		if checked == 0 {
			t.Fatal("none of Docker's masked /proc paths exist on this host: nothing was tested")
		}
		// The keyring list is what the mask is for: the host's kernel shows it to its uid.
		if _, out := sh(t, in, "cat /proc/keys 2>&1 >/dev/null; echo end"); !strings.HasSuffix(out, "end\n") {
			t.Errorf("reading /proc/keys: %q", out)
		}
	})
	t.Run("the kernel's knobs are read-only mounts", func(t *testing.T) {
		_, out := sh(t, in, "cat /proc/self/mountinfo")
		mounts := parseMountinfo(out)
		for _, name := range []string{"sys", "sysrq-trigger", "irq", "bus", "fs"} {
			if _, err := os.Stat("/proc/" + name); err != nil {
				continue
			}
			found := false
			for _, m := range mounts {
				if m.point == "/proc/"+name {
					found = true
					if !strings.HasPrefix(m.opts, "ro,") && m.opts != "ro" {
						t.Errorf("/proc/%s is mounted %s", name, m.opts)
					}
				}
			}
			if !found {
				t.Errorf("/proc/%s is not a read-only mount inside:\n%s", name, out)
			}
		}
		if res, out := sh(t, in, "echo 1 > /proc/sys/kernel/ns_last_pid"); res.ExitCode == 0 {
			t.Errorf("wrote a sysctl: %q", out)
		}
	})
	t.Run("no /sys", func(t *testing.T) {
		if res, out := sh(t, in, "ls /sys/firmware"); res.ExitCode == 0 {
			t.Errorf("/sys/firmware is visible: %q", out)
		}
	})
	t.Run("own cgroup namespace", func(t *testing.T) {
		host, err := os.Readlink("/proc/self/ns/cgroup")
		if err != nil {
			t.Fatal(err)
		}
		if _, out := sh(t, in, "readlink /proc/self/ns/cgroup"); strings.TrimSpace(out) == host || !strings.HasPrefix(out, "cgroup:[") {
			t.Errorf("cgroup namespace inside %q, the broker's %q", out, host)
		}
	})
	t.Run("/proc/self/cgroup names nothing of the host", func(t *testing.T) {
		// Every hierarchy's path is the cgroup namespace's root: no sandbox id, no parent, no
		// broker's cgroup, whatever the cgroup version.
		_, out := sh(t, in, "cat /proc/self/cgroup /proc/1/cgroup")
		if strings.Contains(out, spec.ID) || strings.Contains(out, "..") || strings.Contains(out, n.cfg.CgroupParent) {
			t.Errorf("/proc/self/cgroup inside:\n%s", out)
		}
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			if f := strings.SplitN(line, ":", 3); len(f) != 3 || f[2] != "/" {
				t.Errorf("cgroup line %q, want its path to be /", line)
			}
		}
	})
	t.Run("the mount table names no host path", func(t *testing.T) {
		_, out := sh(t, in, "cat /proc/self/mountinfo")
		data := filepath.Dir(filepath.Dir(n.WorkspaceDir(spec))) // <data dir>/sandboxes
		for _, m := range parseMountinfo(out) {
			if m.point == WorkspacePath && !n.asRoot {
				// A bind mount shows its directory's path within the host filesystem, and only a
				// filesystem of the sandbox's own (its disk image, which a root broker mounts)
				// hides it. Under a broker that cannot mount, this one line names the data dir;
				// see docs/ARCHITECTURE.md.
				continue
			}
			if strings.Contains(m.line, spec.ID) || strings.Contains(m.line, data) || strings.Contains(m.line, n.cfg.DataDir) {
				t.Errorf("mount names a host path: %s", m.line)
			}
		}
		if _, out := sh(t, in, "cat /etc/passwd; id -un"); !strings.Contains(out, "user:x:1000:1000:") || !strings.HasSuffix(out, "\nuser\n") {
			t.Errorf("identity files: %q", out)
		}
	})
}
