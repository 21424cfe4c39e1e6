package provider

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
