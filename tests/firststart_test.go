package tests

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A second broker that cannot serve (its port is taken by the first) must not touch sbctl's config:
// it used to write a fresh key for itself before it tried to listen, over the working key of the
// broker that owns the port, and that key is shown only once.
func TestFailedStartKeepsTheWorkingConfig(t *testing.T) {
	b := startBroker(t)
	cfg := filepath.Join(b.Home, ".config", "sbctl", "config.yaml")
	before, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatalf("the first start wrote no sbctl config: %v\n%s", err, b.log)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	second := exec.CommandContext(ctx, filepath.Join(bin, "broker"), "--listen", strings.TrimPrefix(b.URL, "http://"),
		"--data-dir", filepath.Join(b.Home, "other-data"))
	t.Cleanup(func() { os.RemoveAll(filepath.Join(b.Home, "other-data")) })
	second.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
	out, err := second.CombinedOutput()
	if err == nil {
		t.Fatalf("a second broker on a taken port started:\n%s", out)
	}
	if !strings.Contains(string(out), "--listen") {
		t.Errorf("the failed start does not name the setting: %s", out)
	}
	after, _ := os.ReadFile(cfg)
	if string(after) != string(before) {
		t.Fatalf("a broker that failed to start rewrote %s:\nbefore: %s\nafter: %s", cfg, before, after)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(cfg), "*")); len(left) != 1 {
		t.Errorf("files beside the config: %v", left)
	}
	b.ok("list") // the working key still works
}

// Both binaries say which version and commit they are, from what the Go toolchain stamped in.
func TestVersion(t *testing.T) {
	t.Parallel()
	// The Go toolchain stamps the commit from a checkout's .git directory; a git worktree's .git is
	// a file, which it does not read.
	var rev []byte
	if fi, err := os.Stat("../.git"); err == nil && fi.IsDir() {
		rev, _ = exec.Command("git", "rev-parse", "HEAD").Output()
	}
	for _, name := range []string{"broker", "sbctl"} {
		out, err := exec.Command(filepath.Join(bin, name), "--version").CombinedOutput()
		if err != nil {
			t.Fatalf("%s --version: %v\n%s", name, err, out)
		}
		s := string(out)
		if !strings.HasPrefix(s, name+" ") || !strings.Contains(s, "commit ") || !strings.Contains(s, "go1.") {
			t.Errorf("%s --version: %q; want the name, the module version, the commit and the Go version", name, s)
		}
		if r := strings.TrimSpace(string(rev)); r != "" && !strings.Contains(s, r) {
			t.Errorf("%s --version: %q does not name the checkout's commit %s", name, s, r)
		}
	}
}
