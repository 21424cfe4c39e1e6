package provider

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
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

// A cgroup whose last process is still on its way out when the sandbox is torn down (killed
// processes leave it only as they finish exiting, which under load takes more than a second) is
// removed once it has drained, not left behind with EBUSY.
func TestCgroupRemoveWaitsForTasksToDrain(t *testing.T) {
	t.Parallel()
	n := newNamespace(t, Config{})
	if !n.cg.enforced() {
		t.Fatalf("this test needs cgroups: %s", n.cg.reason)
	}
	id := NewID()
	s, err := n.cg.create(id, DefaultLimits())
	if err != nil {
		t.Fatal(err)
	}
	// A task that leaves the cgroup 1.5 s after the removal starts.
	cmd := exec.Command("sleep", "1.5")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited; s.remove() })
	if err := s.attach(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if err := s.remove(); err != nil {
		t.Fatalf("removing a cgroup whose task leaves in 1.5 s: %v", err)
	}
	if left := cgroupDirsOf(n, id); len(left) > 0 {
		t.Fatalf("cgroups left: %v", left)
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

// crashStartLoop is the helper mode that starts sandboxes one after another until it is killed.
const crashStartLoop = "startloop"

// startLoopHelper starts namespace sandboxes in a loop, printing a line as each begins, so that a
// kill lands at every moment of a start.
func startLoopHelper(cfg Config) {
	p, err := NewNamespace(cfg)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	ctx := context.Background()
	for {
		spec := Spec{ID: NewID(), Template: DefaultTemplate()}
		if err := p.Create(ctx, spec); err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Println("start")
		if _, err := p.Start(ctx, spec); err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
	}
}

// markedPids lists the live processes carrying the marker of dataDir.
func markedPids(dataDir string) []int {
	want := []byte(orphanMarker(dataDir))
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile("/proc/" + e.Name() + "/environ")
		if err != nil || len(env) == 0 { // a zombie has none
			continue
		}
		if slices.ContainsFunc(bytes.Split(env, []byte{0}), func(kv []byte) bool { return bytes.Equal(kv, want) }) {
			out = append(out, pid)
		}
	}
	return out
}

// A broker killed at any moment of starting sandboxes leaves nothing of them running once it has
// started again: kill -9 lands at random points of bwrap's and the init's start, round after round.
func TestKillDuringStartLeavesNoOrphans(t *testing.T) {
	t.Parallel()
	requireBwrap(t)
	data := testDataDir(t)
	parent := testCgroupParent + "/startloop"
	const rounds = 15
	for r := 0; r < rounds; r++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), helperEnv+"="+crashStartLoop, "SBX_HELPER_DATA="+data, "SBX_HELPER_CGROUP="+parent)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// The next start broker reaps the last one's orphans; here the helper is that broker too.
		rd := bufio.NewReader(out)
		for i := 0; i < 1+r%3; i++ {
			line, err := rd.ReadString('\n')
			if err != nil || strings.HasPrefix(line, "error") {
				cmd.Process.Kill()
				cmd.Wait()
				t.Fatalf("helper: %q %v", line, err)
			}
		}
		time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
		cmd.Process.Kill()
		cmd.Wait()
	}
	restarted := newNamespace(t, Config{DataDir: data, CgroupParent: parent})
	// Marked processes, and bwraps by their command line (which names the data dir), marker or not.
	left := func() []int { return append(markedPids(data), hostPids(data)...) }
	deadline := time.Now().Add(5 * time.Second)
	for len(left()) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if l := left(); len(l) > 0 {
		t.Errorf("processes of the killed broker's sandboxes still running after a restart: %v", l)
	}
	// Their cgroups are empty now and swept (at once here, after a minute in a broker).
	for {
		restarted.cg.sweepStale(0)
		var cgs []string
		for _, p := range restarted.cg.parents {
			found, _ := filepath.Glob(filepath.Join(p, "sb_*"))
			cgs = append(cgs, found...)
		}
		if len(cgs) == 0 {
			break
		}
		if time.Now().After(deadline.Add(5 * time.Second)) {
			t.Errorf("cgroups left: %v", cgs)
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
}
