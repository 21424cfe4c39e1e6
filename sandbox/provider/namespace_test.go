package provider

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestNamespaceIsolation is the hostile-sandbox suite, run at both isolation levels the namespace
// provider offers: what holds for a namespace sandbox must hold for a gvisor one.
func TestNamespaceIsolation(t *testing.T) {
	requireRunsc(t)
	n := newNamespace(t, Config{})
	for _, level := range []string{IsolationNamespace, IsolationGvisor} {
		t.Run(level, func(t *testing.T) { testIsolation(t, n, level) })
	}
}

func testIsolation(t *testing.T, n *Namespace, level string) {
	in, spec := startSandbox(t, n, Template{Isolation: level})
	// Inside gVisor the sandbox user keeps its host uid (the gofer creates files with it).
	uid := "1000"
	if level == IsolationGvisor {
		uid = strconv.Itoa(DefaultUID)
	}

	t.Run("host files outside the workspace are invisible", func(t *testing.T) {
		secret := filepath.Join(t.TempDir(), "secret")
		if err := os.WriteFile(secret, []byte("TOPSECRET"), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{secret, "/etc/shadow", "/root/.bashrc", "/etc/sudoers"} {
			res, out := sh(t, in, "cat "+p)
			if res.ExitCode == 0 || strings.Contains(out, "TOPSECRET") {
				t.Errorf("cat %s inside the sandbox: %+v %q", p, res, out)
			}
		}
	})
	t.Run("read-only system, writable workspace and tmp", func(t *testing.T) {
		for _, p := range []string{"/usr/evil", "/usr/bin/evil", "/etc/evil", "/evil", "/bin/evil"} {
			if res, out := sh(t, in, "touch "+p); res.ExitCode == 0 {
				t.Errorf("touch %s succeeded: %q", p, out)
			}
		}
		if res, out := sh(t, in, "touch /workspace/ok /tmp/ok && echo yes"); out != "yes\n" {
			t.Errorf("workspace or /tmp not writable: %+v %q", res, out)
		}
	})
	t.Run("no host network", func(t *testing.T) {
		addr, accepted := listen(t)
		res, out := sh(t, in, bashConnect(addr))
		if res.ExitCode == 0 {
			t.Errorf("connected to the host's %s: %q", addr, out)
		}
		if accepted() {
			t.Error("the host listener accepted a connection from the sandbox")
		}
	})
	t.Run("identity", func(t *testing.T) {
		if _, out := sh(t, in, "id -u; id -g; id -un; hostname; echo $HOME; touch ~/dotfile && echo home-ok"); out != uid+"\n"+uid+"\nuser\nsandbox\n/home/user\nhome-ok\n" {
			t.Errorf("identity inside: %q", out)
		}
		ws := n.WorkspaceDir(spec)
		sh(t, in, "echo x > owned.txt; mkdir owned.d")
		for _, p := range []string{ws, filepath.Join(ws, "owned.txt"), filepath.Join(ws, "owned.d")} {
			var st syscall.Stat_t
			if err := syscall.Stat(p, &st); err != nil {
				t.Fatal(err)
			}
			if st.Uid != DefaultUID || st.Gid != DefaultGID {
				t.Errorf("%s is owned by %d:%d on the host, want %d:%d", p, st.Uid, st.Gid, DefaultUID, DefaultGID)
			}
		}
	})
	t.Run("processes see only the sandbox", func(t *testing.T) {
		_, out := sh(t, in, "ls /proc | grep -c '^[0-9]'")
		if out == "" || len(out) > 3 { // a handful: init, sh, ls, grep
			t.Errorf("visible processes: %q", out)
		}
	})
}

func TestNamespaceSandboxesAreSeparate(t *testing.T) {
	n := newNamespace(t, Config{})
	a, specA := startSandbox(t, n, Template{})
	b, _ := startSandbox(t, n, Template{})
	m := marker()
	sh(t, a, "echo a-only > a.txt; "+m+" &")
	waitHostRunning(t, m)
	if _, out := sh(t, b, "ls -A /workspace"); out != "" {
		t.Errorf("B sees files in its workspace: %q", out)
	}
	if res, out := sh(t, b, "cat "+filepath.Join(n.WorkspaceDir(specA), "a.txt")); res.ExitCode == 0 {
		t.Errorf("B reads A's workspace through the host path: %q", out)
	}
	if _, out := sh(t, b, "ps ax"); strings.Contains(out, m) {
		t.Errorf("B sees A's processes:\n%s", out)
	}
	if _, out := sh(t, a, "pgrep -f '[s]"+m[1:]+"' >/dev/null && echo yes"); out != "yes\n" {
		t.Errorf("A does not see its own background process: %q", out)
	}
}

func TestNamespaceLimits(t *testing.T) {
	n := newNamespace(t, Config{})
	if ok, why := n.LimitsEnforced(); !ok {
		t.Fatalf("limits not enforced on this host: %s", why)
	}

	t.Run("cgroups written, joined and removed", func(t *testing.T) {
		in, spec := startSandbox(t, n, Template{Limits: Limits{MemoryBytes: 256 << 20, Pids: 100, CPUs: 0.5}})
		cg := in.(*instance).cg
		want := map[string]string{"pids.max": "100"}
		if cg.v2 {
			want["memory.max"] = fmt.Sprint(256 << 20)
			want["cpu.max"] = "50000 100000"
		} else {
			want["memory.limit_in_bytes"] = fmt.Sprint(256 << 20)
			want["cpu.cfs_quota_us"] = "50000"
		}
		for f, v := range want {
			if got := cg.stat(f); got != v {
				t.Errorf("%s = %q, want %q", f, got, v)
			}
		}
		// A command's cgroups, as the host's kernel reports them, all name the sandbox (inside,
		// each is / of the sandbox's cgroup namespace: TestSandboxProc).
		m := marker()
		if _, err := in.Exec(context.Background(), ExecRequest{Command: m, Background: true}); err != nil {
			t.Fatal(err)
		}
		waitHostRunning(t, m)
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", hostPids(m)[0]))
		if err != nil {
			t.Fatal(err)
		}
		out := string(b)
		for _, c := range []string{"memory", "pids", "cpu"} {
			found := false
			for _, line := range strings.Split(out, "\n") {
				if (strings.Contains(line, ":"+c+":") || strings.Contains(line, ","+c+":") || strings.Contains(line, ":"+c+",") || strings.HasPrefix(line, "0::")) && strings.Contains(line, spec.ID) {
					found = true
				}
			}
			if !found {
				t.Errorf("command not in the sandbox's %s cgroup:\n%s", c, out)
			}
		}
		if err := in.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
		for _, d := range cg.dirs {
			if _, err := os.Stat(d); !os.IsNotExist(err) {
				t.Errorf("cgroup %s still exists after Stop: %v", d, err)
			}
		}
	})

	t.Run("fork bomb is held by the pids limit", func(t *testing.T) {
		in, _ := startSandbox(t, n, Template{Limits: Limits{Pids: 64}})
		res, err := in.Exec(context.Background(), ExecRequest{
			// bash, not dash: dash gives up at the first failed fork, bash retries, so the bomb
			// keeps pushing against the limit until the timeout ends it.
			Command: "bash -c 'f() { f | f; }; f' 2>/dev/null",
			Stdout:  io.Discard,
			Timeout: 2 * time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		if res.Reason != ReasonTimeout {
			t.Errorf("fork bomb result %+v", res)
		}
		cg := in.(*instance).cg
		if ev := cg.stat("pids.events"); !strings.HasPrefix(ev, "max ") || ev == "max 0" {
			t.Errorf("pids.events = %q: the limit never held a fork", ev)
		}
		if res, out := sh(t, in, "echo alive"); out != "alive\n" {
			t.Errorf("sandbox after the fork bomb: %+v %q", res, out)
		}
	})

	t.Run("memory hog is killed by the memory limit", func(t *testing.T) {
		in, _ := startSandbox(t, n, Template{Limits: Limits{MemoryBytes: 64 << 20}})
		// tail keeps the whole (newline-free) input as its last line.
		res, err := in.Exec(context.Background(), ExecRequest{Command: "head -c 500M /dev/zero | tail", Stdout: io.Discard, Timeout: 60 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if res.Reason != ReasonMemoryLimit || res.ExitCode != 137 {
			t.Errorf("memory hog result %+v", res)
		}
		if res, out := sh(t, in, "echo alive"); out != "alive\n" {
			t.Errorf("sandbox after the OOM kill: %+v %q", res, out)
		}
		// An ordinary kill is not mistaken for the memory limit.
		res, err = in.Exec(context.Background(), ExecRequest{Command: "kill -KILL $$"})
		if err != nil || res.Reason != "" {
			t.Errorf("self-kill result %+v %v", res, err)
		}
	})
}

func TestNamespaceTemplateFeatures(t *testing.T) {
	n := newNamespace(t, Config{})

	t.Run("mounts are read-only binds", func(t *testing.T) {
		kb := testDataDir(t) // the sandbox uid must reach it: bwrap resolves it as that user
		if err := os.WriteFile(filepath.Join(kb, "fact.txt"), []byte("knowledge"), 0o644); err != nil {
			t.Fatal(err)
		}
		in, _ := startSandbox(t, n, Template{Mounts: []Mount{{Source: kb, Target: "/opt/kb"}}})
		if _, out := sh(t, in, "cat /opt/kb/fact.txt"); out != "knowledge" {
			t.Errorf("mounted file: %q", out)
		}
		if res, _ := sh(t, in, "touch /opt/kb/new"); res.ExitCode == 0 {
			t.Error("mount is writable")
		}
	})
	t.Run("rootfs replaces the host system", func(t *testing.T) {
		root := minimalRootfs(t)
		in, _ := startSandbox(t, n, Template{Rootfs: root, Env: map[string]string{"FROM": "tmpl"}})
		_, out := sh(t, in, "[ -e /usr/bin/bash ] && echo host-bash; cat /marker; echo; id -u; pwd; echo $FROM")
		if out != "rootfs\n1000\n/workspace\ntmpl\n" {
			t.Errorf("inside the rootfs: %q", out)
		}
		if env := in.Environment(); env["HOME"] != HomePath || env["FROM"] != "tmpl" {
			t.Errorf("environment without env(1): %v", env)
		}
	})
}

// listen opens a TCP listener on the host's loopback and reports whether it accepted anything.
func listen(t *testing.T) (string, func() bool) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	got := make(chan struct{}, 1)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
			select {
			case got <- struct{}{}:
			default:
			}
		}
	}()
	return l.Addr().String(), func() bool {
		select {
		case <-got:
			return true
		case <-time.After(200 * time.Millisecond):
			return false
		}
	}
}

// bashConnect is a TCP connect from inside with bash's /dev/tcp (this host has no nc).
func bashConnect(addr string) string {
	host, port, _ := net.SplitHostPort(addr)
	return fmt.Sprintf("timeout 5 bash -c 'echo hi > /dev/tcp/%s/%s' 2>&1", host, port)
}

// minimalRootfs builds a tiny root: dash as sh, cat, and the host's libc and loader (the test binary,
// which is the init, is dynamically linked). It has no bash and no env(1).
func minimalRootfs(t *testing.T) string {
	t.Helper()
	root := testDataDir(t)
	copies := map[string]string{
		"/usr/bin/dash":                                  "usr/bin/sh",
		"/usr/bin/cat":                                   "usr/bin/cat",
		"/usr/bin/id":                                    "usr/bin/id",
		"/usr/lib/x86_64-linux-gnu/libc.so.6":            "usr/lib/x86_64-linux-gnu/libc.so.6",
		"/usr/lib/x86_64-linux-gnu/libselinux.so.1":      "usr/lib/x86_64-linux-gnu/libselinux.so.1",
		"/usr/lib/x86_64-linux-gnu/libpcre2-8.so.0":      "usr/lib/x86_64-linux-gnu/libpcre2-8.so.0",
		"/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2": "usr/lib64/ld-linux-x86-64.so.2",
	}
	for src, dst := range copies {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(root, dst)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for link, target := range map[string]string{"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64"} {
		if err := os.Symlink(target, filepath.Join(root, link)); err != nil {
			t.Fatal(err)
		}
	}
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0::/:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc/group"), []byte("root:x:0:\n"), 0o644)
	os.WriteFile(filepath.Join(root, "marker"), []byte("rootfs"), 0o644)
	if b, err := os.ReadFile(filepath.Join(root, "marker")); err != nil || !bytes.Equal(b, []byte("rootfs")) {
		t.Fatal(err)
	}
	return root
}
