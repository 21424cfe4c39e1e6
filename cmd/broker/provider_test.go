package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/sandbox/provider"
)

func TestMain(m *testing.M) {
	// The test binary is the sandbox init, as the broker binary is.
	if len(os.Args) > 1 && os.Args[1] == provider.InitArg {
		provider.RunInit()
	}
	os.Exit(m.Run())
}

// providerDataDir is a data dir the sandbox uid can reach, set up as a broker with the given
// provider would have left it: the memo and one sandbox. memo "" leaves a data dir from before the
// memo existed.
func providerDataDir(t *testing.T, memo string) string {
	t.Helper()
	d := t.TempDir()
	// A namespace provider mounts its /etc copies' tmpfs in the data dir (host-etc): gone before
	// TempDir's removal, which registered first and so runs after.
	t.Cleanup(func() { provider.UnmountUnder(d) })
	for _, p := range []string{filepath.Dir(d), d} {
		if err := os.Chmod(p, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(d, "sandboxes", provider.NewID(), "workspace"), 0o711); err != nil {
		t.Fatal(err)
	}
	if memo != "" {
		if err := os.WriteFile(filepath.Join(d, "provider"), []byte(memo+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

// withoutBwrap makes this process's PATH lack bwrap: a host that cannot run namespace sandboxes.
func withoutBwrap(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
}

func memo(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "provider"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// A data dir set up for namespace sandboxes never lands on the dir provider by itself: not with
// auto, not with --provider-reset, not with a data dir from before the memo; only --provider dir
// with --allow-unisolated moves it. No error recommends a step that removes isolation.
func TestChooseProviderNeverFailsOpen(t *testing.T) {
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	removesIsolation := []string{"--provider dir", "--provider-reset", "--allow-unisolated", "SBX_PROVIDER_RESET", "SBX_ALLOW_UNISOLATED"}
	for _, tc := range []struct {
		name, memo, provider string
		reset                bool
	}{
		{name: "auto keeps namespace", memo: "namespace", provider: "auto"},
		{name: "reset never chooses dir", memo: "namespace", provider: "auto", reset: true},
		{name: "a data dir from before the memo", memo: "", provider: "auto"},
		{name: "a data dir from before the memo, reset", memo: "", provider: "auto", reset: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := providerDataDir(t, tc.memo)
			withoutBwrap(t)
			c := &config{DataDir: dir, Provider: tc.provider, ProviderReset: tc.reset, SandboxUID: provider.DefaultUID}
			p, _, err := chooseProvider(context.Background(), c, discard)
			if err == nil {
				t.Fatalf("chose %s for a data dir set up for namespace sandboxes", p.Name())
			}
			for _, bad := range removesIsolation {
				if strings.Contains(err.Error(), bad) {
					t.Errorf("the error recommends %q:\n%v", bad, err)
				}
			}
			if !strings.Contains(err.Error(), "bwrap not found") || !strings.Contains(err.Error(), "namespace sandboxes") {
				t.Errorf("the error must say what is wrong and what the data dir holds:\n%v", err)
			}
			if tc.memo != "" && memo(t, dir) != tc.memo {
				t.Errorf("the memo changed to %q", memo(t, dir))
			}
		})
	}
	t.Run("--provider dir needs a confirmation", func(t *testing.T) {
		dir := providerDataDir(t, "namespace")
		c := &config{DataDir: dir, Provider: "dir", SandboxUID: provider.DefaultUID}
		if p, _, err := chooseProvider(context.Background(), c, discard); err == nil || !strings.Contains(err.Error(), "--allow-unisolated") {
			t.Fatalf("want an error naming the confirmation flag, got %v %v", p, err)
		}
		if memo(t, dir) != "namespace" {
			t.Errorf("the memo changed to %q", memo(t, dir))
		}
		c.AllowUnisolated = true
		p, r, err := chooseProvider(context.Background(), c, discard)
		if err != nil || p.Name() != "dir" || r.Fallback != "" {
			t.Fatalf("explicit and confirmed: %v %+v %v", p, r, err)
		}
		if memo(t, dir) != "dir" {
			t.Errorf("memo %q after a confirmed switch", memo(t, dir))
		}
	})
	t.Run("reset moves a dir data dir to namespace where it works", func(t *testing.T) {
		dir := providerDataDir(t, "dir")
		c := &config{DataDir: dir, Provider: "auto", SandboxUID: provider.DefaultUID}
		if p, _, err := chooseProvider(context.Background(), c, discard); err != nil || p.Name() != "dir" {
			t.Fatalf("auto keeps dir: %v %v", p, err)
		}
		c.ProviderReset = true
		if p, _, err := chooseProvider(context.Background(), c, discard); err != nil || p.Name() != "namespace" || memo(t, dir) != "namespace" {
			t.Fatalf("reset: %v %v, memo %q", p, err, memo(t, dir))
		}
	})
	t.Run("a fresh data dir on a host without namespaces falls back, and says so", func(t *testing.T) {
		dir := filepath.Join(providerDataDir(t, ""), "fresh")
		withoutBwrap(t)
		c := &config{DataDir: dir, Provider: "auto", SandboxUID: provider.DefaultUID}
		p, r, err := chooseProvider(context.Background(), c, discard)
		if err != nil || p.Name() != "dir" || !strings.Contains(r.Fallback, "bwrap not found") {
			t.Fatalf("%v %+v %v", p, r, err)
		}
	})
}

// --allow-unisolated confirms --provider dir and nothing else; it has an env fallback.
func TestAllowUnisolatedFlag(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_ALLOW_UNISOLATED", "true")
	cmd.SetArgs([]string{"--provider", "namespace", "--data-dir", t.TempDir()})
	err := cmd.Execute()
	if err == nil || !strings.Contains(err.Error(), "--allow-unisolated (SBX_ALLOW_UNISOLATED)") {
		t.Fatalf("want a configuration error naming the flag, got %v", err)
	}
	f := rootCmd().Flags().Lookup("allow-unisolated")
	if f == nil || !strings.Contains(f.Usage, "SBX_ALLOW_UNISOLATED") {
		t.Fatalf("--help: %+v", f)
	}
}

// The story that made this matter: a sandbox fills the data dir's disk, and the operator starts the
// broker with --provider-reset. The broker must refuse to start, name the full disk and say how to
// free it; the data dir keeps the namespace provider.
func TestFullDiskResetStaysIsolated(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir := filepath.Join(providerDataDir(t, ""), "data")
	if err := os.Mkdir(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=256k,nr_inodes=64,mode=0711"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(dir, "provider"), []byte("namespace\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "sandboxes", provider.NewID(), "workspace"), 0o711); err != nil {
		t.Fatal(err)
	}
	// The sandbox's files fill the disk, blocks and inodes.
	for i := 0; ; i++ {
		err := os.WriteFile(filepath.Join(dir, "sandboxes", fmt.Sprintf("fill-%d", i)), make([]byte, 64<<10), 0o600)
		if errors.Is(err, unix.ENOSPC) {
			if err := os.WriteFile(filepath.Join(dir, "sandboxes", fmt.Sprintf("fill-%d-0", i)), nil, 0o600); errors.Is(err, unix.ENOSPC) {
				break
			}
		} else if err != nil {
			t.Fatal(err)
		}
	}
	c := &config{DataDir: dir, Provider: "auto", ProviderReset: true, SandboxUID: provider.DefaultUID}
	p, r, err := chooseProvider(context.Background(), c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err == nil {
		t.Fatalf("a reset on a full disk chose %s: %+v", p.Name(), r)
	}
	if !errors.Is(err, provider.ErrResource) || !strings.Contains(err.Error(), "out of disk space or inodes") ||
		strings.Contains(err.Error(), "--provider") {
		t.Errorf("want the full disk named, and no other provider suggested:\n%v", err)
	}
	if memo(t, dir) != "namespace" {
		t.Errorf("the memo changed to %q", memo(t, dir))
	}
}
