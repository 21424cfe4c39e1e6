package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestPreflight(t *testing.T) {
	requireBwrap(t)
	ctx := context.Background()

	t.Run("auto picks namespace here", func(t *testing.T) {
		dir := testDataDir(t)
		p, r, err := Preflight(ctx, Config{DataDir: dir, CgroupParent: testCgroupParent}, ChoiceAuto)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("report: %+v", r)
		if p.Name() != kindNamespace || r.Provider != kindNamespace || !r.LimitsEnforced || r.Warning != "" || r.Cgroups == "" {
			t.Errorf("provider %s, report %+v", p.Name(), r)
		}
		// The throwaway sandbox is gone.
		if left, _ := filepath.Glob(filepath.Join(dir, "preflight-*")); len(left) > 0 {
			t.Errorf("preflight left %v", left)
		}
		in, _ := startSandbox(t, p, Template{})
		if res, out := sh(t, in, "echo ok"); out != "ok\n" {
			t.Errorf("%+v %q", res, out)
		}
	})
	t.Run("namespace explicitly", func(t *testing.T) {
		p, r, err := Preflight(ctx, Config{DataDir: testDataDir(t), CgroupParent: testCgroupParent}, ChoiceNamespace)
		if err != nil || p.Name() != kindNamespace || !r.LimitsEnforced {
			t.Fatal(p, r, err)
		}
	})
	t.Run("dir explicitly warns", func(t *testing.T) {
		p, r, err := Preflight(ctx, Config{DataDir: testDataDir(t)}, ChoiceDir)
		if err != nil || p.Name() != kindDir || r.LimitsEnforced || !strings.Contains(r.Warning, "no isolation") {
			t.Fatal(p, r, err)
		}
	})
	t.Run("without bwrap auto falls back to dir and says how to fix it", func(t *testing.T) {
		cfg := Config{DataDir: testDataDir(t), BwrapPath: "/nonexistent/bwrap"}
		p, r, err := Preflight(ctx, cfg, ChoiceAuto)
		if err != nil || p.Name() != kindDir {
			t.Fatal(p, r, err)
		}
		if !strings.Contains(r.Warning, "bwrap not found") || !strings.Contains(r.Warning, "apt-get install -y bubblewrap") || !strings.Contains(r.Warning, "no isolation") {
			t.Errorf("warning %q", r.Warning)
		}
		_, _, err = Preflight(ctx, cfg, ChoiceNamespace)
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "apt-get install -y bubblewrap") {
			t.Errorf("explicit namespace without bwrap: %v", err)
		}
	})
	t.Run("unreachable data dir is explained", func(t *testing.T) {
		dir := t.TempDir() // 0700: the sandbox uid cannot get in
		_, _, err := Preflight(ctx, Config{DataDir: dir}, ChoiceNamespace)
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "chmod o+x") {
			t.Errorf("error %v", err)
		}
	})
	t.Run("unknown choice", func(t *testing.T) {
		if _, _, err := Preflight(ctx, Config{DataDir: testDataDir(t)}, "docker"); err == nil {
			t.Error("no error")
		}
	})
}

func TestStartFailureLeavesNothing(t *testing.T) {
	n := newNamespace(t, Config{})
	// Under a 0700 dir: bwrap, running as the sandbox uid, cannot reach it.
	private := filepath.Join(t.TempDir(), "private")
	hidden := filepath.Join(private, "hidden")
	if err := os.Mkdir(private, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(hidden, 0o755); err != nil {
		t.Fatal(err)
	}
	spec := Spec{ID: NewID(), Template: Template{Name: "bad", Mounts: []Mount{{Source: hidden, Target: "/opt/x"}}}}
	ctx := context.Background()
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	_, err := n.Start(ctx, spec)
	if err == nil || !strings.Contains(err.Error(), "Permission denied") {
		t.Fatalf("start error %v: want bwrap's message", err)
	}
	for _, parent := range n.cg.parents {
		if _, err := os.Stat(filepath.Join(parent, spec.ID)); !os.IsNotExist(err) {
			t.Errorf("cgroup left in %s: %v", parent, err)
		}
	}
	if err := n.Destroy(ctx, spec); err != nil {
		t.Errorf("destroy after a failed start: %v", err)
	}
}

func TestAbortedStartLeavesNothing(t *testing.T) {
	n := newNamespace(t, Config{})
	ctx := context.Background()
	spec := Spec{ID: NewID(), Template: DefaultTemplate()}
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	// bwrap's command line names the workspace: nothing with it may survive an aborted Start, at
	// whatever stage the context ends.
	ws := n.WorkspaceDir(spec)
	for _, d := range []time.Duration{100 * time.Microsecond, 500 * time.Microsecond, time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond, 8 * time.Millisecond} {
		short, cancel := context.WithTimeout(ctx, d)
		in, err := n.Start(short, spec)
		cancel()
		if err == nil {
			if err := in.Stop(ctx); err != nil {
				t.Fatal(err)
			}
		}
		waitHostGone(t, ws)
		for _, parent := range n.cg.parents {
			if _, err := os.Stat(filepath.Join(parent, spec.ID)); !os.IsNotExist(err) {
				t.Errorf("after a Start aborted at %v: cgroup left in %s", d, parent)
			}
		}
	}
	in, err := n.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n.Destroy(ctx, spec); err != nil {
		t.Fatal(err)
	}
}

// fullFilesystem mounts a tiny tmpfs at dir/data and fills its blocks and inodes: a data dir whose
// disk is full, without going near the real disk. It is unmounted when the test ends.
func fullFilesystem(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root; TestPreflightOutOfFiles covers resource errors for any user")
	}
	data := filepath.Join(testDataDir(t), "data")
	if err := os.Mkdir(data, 0o711); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", data, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=256k,nr_inodes=64,mode=0711"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(data, unix.MNT_DETACH) })
	// What a broker that ran before has: the sandboxes directory.
	if err := os.Mkdir(filepath.Join(data, "sandboxes"), 0o711); err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 4096)
	for i := 0; ; i++ {
		f, err := os.Create(filepath.Join(data, fmt.Sprintf("fill-%d", i)))
		if err != nil {
			if !errors.Is(err, unix.ENOSPC) {
				t.Fatal(err)
			}
			break
		}
		for {
			if _, err := f.Write(big); err != nil {
				break
			}
		}
		f.Close()
	}
	return data
}

// A full disk is a resource error: "auto" does not fall back to the dir provider (which would run
// tenants as the broker's user, with no isolation) but says what ran out and how to free it.
func TestPreflightFullDisk(t *testing.T) {
	requireBwrap(t)
	data := fullFilesystem(t)
	for _, choice := range []string{ChoiceAuto, ChoiceNamespace} {
		p, r, err := Preflight(context.Background(), Config{DataDir: data, CgroupParent: testCgroupParent}, choice)
		if err == nil {
			t.Fatalf("%s on a full disk chose %s (%+v): want a resource error", choice, p.Name(), r)
		}
		var re *ResourceError
		if !errors.As(err, &re) || re.Errno != unix.ENOSPC || !errors.Is(err, ErrResource) || errors.Is(err, ErrNoNamespaces) {
			t.Fatalf("%s: want an ENOSPC ResourceError, got %T %v", choice, err, err)
		}
		for _, want := range []string{"out of disk space or inodes", "df -h -i " + data, "inodes free"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: error lacks %q: %v", choice, want, err)
			}
		}
		if strings.Contains(err.Error(), "--provider") {
			t.Errorf("%s: the error must not point at another provider: %v", choice, err)
		}
	}
}

// preflightHelperEnv makes the test binary run Preflight with every file descriptor it may open
// already in use, and print what it chose (TestPreflightOutOfFiles).
const preflightHelperEnv = "SBX_PREFLIGHT_TEST_HELPER"

func preflightHelper() {
	// A pipe first, so that the runtime's poller has its descriptors before the table is full.
	r, w, _ := os.Pipe()
	defer r.Close()
	defer w.Close()
	unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 64, Max: 64})
	for {
		if _, err := unix.Open("/dev/null", unix.O_RDONLY, 0); err != nil {
			break
		}
	}
	p, _, err := Preflight(context.Background(), Config{DataDir: os.Getenv(preflightHelperEnv), CgroupParent: testCgroupParent}, ChoiceAuto)
	var re *ResourceError
	switch {
	case errors.As(err, &re):
		fmt.Printf("resource %s: %v\n", unix.ErrnoName(re.Errno), err)
	case err != nil:
		fmt.Printf("error: %v\n", err)
	default:
		fmt.Printf("provider %s\n", p.Name())
	}
	os.Exit(0)
}

// Out of file descriptors is a resource error too, whoever runs the tests.
func TestPreflightOutOfFiles(t *testing.T) {
	requireBwrap(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), preflightHelperEnv+"="+testDataDir(t))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if !strings.HasPrefix(string(out), "resource EMFILE: ") || !strings.Contains(string(out), "ulimit -n") {
		t.Fatalf("want an EMFILE resource error that says to raise ulimit -n, got: %s", out)
	}
}

// Only a host that cannot do namespaces at all lets "auto" fall back. These are bwrap's own
// messages for each case.
func TestClassify(t *testing.T) {
	cfg := Config{DataDir: "/data", UID: 100000}
	for _, tc := range []struct {
		err          string
		resource     syscall.Errno
		noNamespaces bool
	}{
		{err: "start sandbox: init exited: bwrap: Creating new namespace failed: No space left on device", resource: unix.ENOSPC},
		{err: "start sandbox: init exited: bwrap: Creating new namespace failed: Resource temporarily unavailable", resource: unix.EAGAIN},
		{err: "start sandbox: init exited: bwrap: Creating new namespace failed: Operation not permitted", noNamespaces: true},
		{err: "start sandbox: init exited: bwrap: setting up uid map: Permission denied", noNamespaces: true},
		{err: "start sandbox: init exited: bwrap: No permissions to creating new namespace, likely because the kernel does not allow non-privileged user namespaces", noNamespaces: true},
		{err: "start sandbox: init exited: bwrap: Can't find source path /data/sandboxes/x: Permission denied"},
		{err: "start sandbox: init exited: bwrap: seccomp: Operation not permitted"},
		{err: "start sandbox: control socket: too many open files in system", resource: unix.ENFILE},
	} {
		got := classify(errors.New(tc.err), cfg)
		var re *ResourceError
		isRes := errors.As(got, &re)
		switch {
		case tc.resource != 0 && (!isRes || re.Errno != tc.resource):
			t.Errorf("%q: want a %s resource error, got %v", tc.err, unix.ErrnoName(tc.resource), got)
		case tc.resource == 0 && isRes:
			t.Errorf("%q: not a resource error, got %v", tc.err, got)
		case errors.Is(got, ErrNoNamespaces) != tc.noNamespaces:
			t.Errorf("%q: ErrNoNamespaces %v, want %v (%v)", tc.err, errors.Is(got, ErrNoNamespaces), tc.noNamespaces, got)
		}
	}
	re := resourceError(errors.New("bwrap: Creating new namespace failed: No space left on device"), cfg)
	if re == nil || !strings.Contains(re.Error(), "uid 100000") || !strings.Contains(re.Error(), "max_user_namespaces") {
		t.Errorf("a used-up user-namespace quota names the uid and the sysctl: %v", re)
	}
}
