package provider

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// cgroupDirsOf lists the cgroup directories of sandbox id that exist under p's parents.
func cgroupDirsOf(n *Namespace, id string) []string {
	var left []string
	for _, parent := range n.cg.parents {
		if _, err := os.Stat(filepath.Join(parent, id)); err == nil {
			left = append(left, filepath.Join(parent, id))
		}
	}
	return left
}

// The cgroups of a sandbox whose start fails, of one stopped and destroyed, and of one whose init
// died on its own are gone by the time the provider returns (or Done is closed).
func TestCgroupsRemovedAfterFailureAndDelete(t *testing.T) {
	t.Parallel()
	n := newNamespace(t, Config{})
	if !n.cg.enforced() {
		t.Fatalf("this test needs cgroups: %s", n.cg.reason)
	}
	ctx := context.Background()

	t.Run("start fails", func(t *testing.T) {
		bad := newNamespace(t, Config{InitPath: "/bin/false"})
		spec := Spec{ID: NewID(), Template: DefaultTemplate()}
		if err := bad.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		if in, err := bad.Start(ctx, spec); err == nil {
			in.Stop(ctx)
			t.Fatal("a sandbox whose init is /bin/false started")
		}
		if left := cgroupDirsOf(bad, spec.ID); len(left) > 0 {
			t.Errorf("cgroups of a failed start left: %v", left)
		}
		if err := bad.Destroy(ctx, spec); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("stopped and destroyed", func(t *testing.T) {
		spec := Spec{ID: NewID(), Template: DefaultTemplate()}
		if err := n.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		in, err := n.Start(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		// Processes that would keep a cgroup busy if anything outlived the stop.
		if _, err := in.Exec(ctx, ExecRequest{Command: "for i in $(seq 200); do sleep 300 & done; (sleep 300 &); yes > /dev/null & wait", Background: true}); err != nil {
			t.Fatal(err)
		}
		if len(cgroupDirsOf(n, spec.ID)) == 0 {
			t.Fatal("a running sandbox has no cgroup")
		}
		if err := in.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		if err := n.Destroy(ctx, spec); err != nil {
			t.Fatal(err)
		}
		if left := cgroupDirsOf(n, spec.ID); len(left) > 0 {
			t.Errorf("cgroups of a deleted sandbox left: %v", left)
		}
	})

	t.Run("init dies", func(t *testing.T) {
		spec := Spec{ID: NewID(), Template: DefaultTemplate()}
		if err := n.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		in, err := n.Start(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		// Killed from the host: inside its pid namespace the init is immune to SIGKILL.
		if err := unix.Kill(in.(*instance).initPid, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		select {
		case <-in.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the sandbox did not end when its init was killed")
		}
		if left := cgroupDirsOf(n, spec.ID); len(left) > 0 {
			t.Errorf("cgroups of a sandbox whose init died left: %v", left)
		}
		if err := n.Destroy(ctx, spec); err != nil {
			t.Fatal(err)
		}
	})
}

// A cgroup a stop could not remove (here: made by hand, as a failed removal leaves it) is removed
// when the sandbox is destroyed.
func TestDestroyRemovesLeftoverCgroups(t *testing.T) {
	t.Parallel()
	n := newNamespace(t, Config{})
	if !n.cg.enforced() {
		t.Fatalf("this test needs cgroups: %s", n.cg.reason)
	}
	ctx := context.Background()
	spec := Spec{ID: NewID(), Template: DefaultTemplate()}
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	for _, parent := range n.cg.parents {
		if err := os.MkdirAll(filepath.Join(parent, spec.ID), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.Destroy(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if left := cgroupDirsOf(n, spec.ID); len(left) > 0 {
		t.Errorf("cgroups left after Destroy: %v", left)
	}
}

// orphanBwrap starts the bwrap n would start for a new sandbox running `sleep N`, but as the
// orphan of bubblewrap issue 633: without the parent-death signal, so nothing ends it with its
// parent. It returns the sleep's marker.
func orphanBwrap(t *testing.T, n *Namespace) string {
	t.Helper()
	spec := Spec{ID: NewID(), Template: DefaultTemplate()}
	if err := n.Create(context.Background(), spec); err != nil {
		t.Fatal(err)
	}
	if err := n.writeIdentity(spec); err != nil {
		t.Fatal(err)
	}
	m := marker()
	cmd, err := n.command(spec, nil, strings.Fields(m))
	if err != nil {
		t.Fatal(err)
	}
	cmd.SysProcAttr.Pdeathsig = 0
	files, err := n.startFiles(spec) // what bwrap reads from seccompFD on
	if err != nil {
		t.Fatal(err)
	}
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	cmd.ExtraFiles = append([]*os.File{null, null}, files...) // fds 3 and 4: the init's, unused here
	err = cmd.Start()
	null.Close()
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	go cmd.Wait() // reaps it once killed
	t.Cleanup(func() { cmd.Process.Kill() })
	waitHostRunning(t, m)
	return m
}

// A restarted provider ends the bwraps (and what they started) that a broker killed while starting
// them left behind, and leaves another data dir's alone.
func TestNewNamespaceReapsOrphanedBwraps(t *testing.T) {
	t.Parallel()
	data, other := testDataDir(t), testDataDir(t)
	orphan := orphanBwrap(t, newNamespace(t, Config{DataDir: data}))
	bystander := orphanBwrap(t, newNamespace(t, Config{DataDir: other}))

	newNamespace(t, Config{DataDir: data}) // the broker's next start
	waitHostGone(t, orphan)
	if len(hostPids(bystander)) == 0 {
		t.Error("another data dir's sandbox was ended")
	}

	// The marker is the broker's: commands in a sandbox do not see it.
	in, _ := startSandbox(t, newNamespace(t, Config{}), Template{})
	if _, out := sh(t, in, "env; cat /proc/1/environ 2>/dev/null; true"); strings.Contains(out, orphanEnv) {
		t.Errorf("a command sees the marker: %s", out)
	}
}
