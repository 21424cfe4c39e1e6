package provider

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestMain(m *testing.M) {
	// The test binary is the init, exactly as the broker's binary is.
	if len(os.Args) > 1 && os.Args[1] == InitArg {
		RunInit()
	}
	if os.Getenv(preflightHelperEnv) != "" {
		preflightHelper()
	}
	if mode := os.Getenv(nonRootHelperEnv); mode != "" {
		nonRootHelper(mode)
	}
	if mode := os.Getenv(helperEnv); mode != "" {
		crashHelper(mode)
	}
	code := m.Run()
	if leaked := removeTestCgroups(); len(leaked) > 0 && code == 0 {
		fmt.Fprintf(os.Stderr, "FAIL: sandbox cgroups left behind: %v\n", leaked)
		code = 1
	}
	os.Exit(code)
}

// testCgroupParent keeps this test process's sandbox cgroups apart from any broker's (and from
// another test run's), so that leaks can be checked at the end.
var testCgroupParent = fmt.Sprintf("sbx-provider-test/%d", os.Getpid())

// removeTestCgroups removes this process's test cgroup parents and returns the sandbox cgroups that
// were still in them.
func removeTestCgroups() []string {
	var leaked []string
	for _, m := range []string{"memory", "pids", "cpu", "unified"} {
		root := filepath.Join("/sys/fs/cgroup", m, testCgroupParent)
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() && validID(d.Name()) {
				leaked = append(leaked, p)
			}
			return nil
		})
		// Deepest first: the crash test's own parents sit below this one.
		var dirs []string
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			os.Remove(dirs[i])
		}
		os.Remove(filepath.Dir(root)) // sbx-provider-test, if no other run uses it
	}
	return leaked
}

// helperEnv makes the test binary act as a broker that starts one sandbox and is then killed
// (TestBrokerCrashLeavesNoStrays).
const helperEnv = "SBX_PROVIDER_TEST_HELPER"

// crashNetwork is the helper mode that starts a namespace sandbox with the network (and pasta).
const crashNetwork = "network"

// crashGvisorNetwork is the helper mode that starts a gvisor sandbox with the network.
const crashGvisorNetwork = "gvisor-network"

// crashHelper starts a sandbox with a background process, prints the sandbox id, and waits to be
// killed. Its arguments come in the environment: the provider, the data dir and a marker command.
func crashHelper(mode string) {
	cfg := Config{DataDir: os.Getenv("SBX_HELPER_DATA"), CgroupParent: os.Getenv("SBX_HELPER_CGROUP")}
	if mode == crashStartLoop {
		startLoopHelper(cfg)
	}
	var p Provider
	var err error
	if mode == kindNamespace || mode == crashNetwork || mode == kindGvisor || mode == crashGvisorNetwork {
		p, err = NewNamespace(cfg)
	} else {
		p, err = NewDir(cfg)
	}
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	spec := Spec{ID: NewID(), Template: DefaultTemplate()}
	if mode == crashNetwork {
		// pasta's command line names the sandbox's state dir, so the test sees it die too.
		spec.Template.Network = NetworkOn
	}
	if mode == kindGvisor || mode == crashGvisorNetwork {
		spec.Template.Isolation = IsolationGvisor
	}
	if mode == crashGvisorNetwork {
		spec.Template.Network = NetworkOn
	}
	ctx := context.Background()
	if err := p.Create(ctx, spec); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	in, err := p.Start(ctx, spec)
	if err == nil {
		_, err = in.Exec(ctx, ExecRequest{Command: os.Getenv("SBX_HELPER_CMD"), Background: true})
	}
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println(spec.ID)
	select {}
}

// testDataDir is a fresh data dir the sandbox uid can traverse: t.TempDir and its parent are 0700.
func testDataDir(t testing.TB) string {
	t.Helper()
	d := t.TempDir()
	// Workspaces with a disk quota are mounts; one a test leaves (a crashed broker leaves them by
	// design) would keep TempDir from removing the dir. Cleanups run last first: this runs before.
	t.Cleanup(func() { UnmountUnder(d) })
	for _, p := range []string{filepath.Dir(d), d} {
		if err := os.Chmod(p, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

// requireBwrap fails (never skips): the namespace provider is what this package is for.
func requireBwrap(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("bwrap"); err != nil {
		t.Fatal("bubblewrap is required for these tests: apt-get install -y bubblewrap")
	}
}

func newNamespace(t testing.TB, cfg Config) *Namespace {
	t.Helper()
	requireBwrap(t)
	if cfg.DataDir == "" {
		cfg.DataDir = testDataDir(t)
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = testCgroupParent
	}
	n, err := NewNamespace(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func newDir(t testing.TB) *Dir {
	t.Helper()
	d, err := NewDir(Config{DataDir: testDataDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// startSandbox creates and starts a sandbox that is stopped and destroyed when the test ends.
func startSandbox(t testing.TB, p Provider, tmpl Template) (Instance, Spec) {
	t.Helper()
	if tmpl.Name == "" {
		tmpl.Name = "test"
	}
	spec := Spec{ID: NewID(), Template: tmpl}
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

// sh runs a shell command with combined output and fails the test on a request error.
func sh(t testing.TB, in Instance, cmd string) (ExecResult, string) {
	t.Helper()
	var out bytes.Buffer
	res, err := in.Exec(context.Background(), ExecRequest{Command: cmd, Stdout: &out, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	return res, out.String()
}

func TestBrokerCrashLeavesNoStrays(t *testing.T) {
	requireBwrap(t)
	for _, mode := range []string{kindNamespace, kindDir, crashNetwork} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			m := marker()
			data := testDataDir(t)
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			parent := testCgroupParent + "/crash-" + mode
			cmd.Env = append(os.Environ(), helperEnv+"="+mode, "SBX_HELPER_DATA="+data, "SBX_HELPER_CMD="+m+"; "+m, "SBX_HELPER_CGROUP="+parent)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			line, _ := bufio.NewReader(out).ReadString('\n')
			id := strings.TrimSpace(line)
			if !validID(id) {
				cmd.Process.Kill()
				cmd.Wait()
				t.Fatalf("helper: %q", line)
			}
			waitHostRunning(t, m)
			// A broker crash: no Stop, no cleanup, just gone.
			cmd.Process.Kill()
			cmd.Wait()
			waitHostGone(t, m)
			waitHostGone(t, filepath.Join(data, "sandboxes", id)) // bwrap's command line
			if mode == kindDir {
				return
			}
			// The crashed broker could not remove its cgroups; a restarted broker sweeps them once
			// they are old enough to be leftovers (here: at once).
			restarted := newNamespace(t, Config{DataDir: data, CgroupParent: parent})
			var left []string
			deadline := time.Now().Add(5 * time.Second)
			for {
				restarted.cg.sweepStale(0)
				left = left[:0]
				for _, p := range restarted.cg.parents {
					if _, err := os.Stat(filepath.Join(p, id)); err == nil {
						left = append(left, p)
					}
				}
				if len(left) == 0 || time.Now().After(deadline) {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if len(left) > 0 {
				t.Errorf("cgroups of the crashed broker's sandbox not swept: %v", left)
			}
			// The crashed broker's image pool (its images mounted ahead) is gone too.
			if pool := filepath.Join(data, "disk-images", "pool"); mountedHere(t, pool+"/") {
				t.Errorf("the crashed broker's pooled images are still mounted under %s", pool)
			}
		})
	}
}
