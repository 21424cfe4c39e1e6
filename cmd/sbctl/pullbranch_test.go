package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// sbctl pull --branch sorts its refusals for scripts: a name git refuses is a usage error (2), a
// branch that exists is a conflict (5), and a sandbox that changed nothing since the push is an
// error (1) but no usage error: the command line was right.
func TestPullBranchExitCodes(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	repo := t.TempDir()
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = repo
		cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=a", "GIT_AUTHOR_EMAIL=a@b", "GIT_COMMITTER_NAME=a", "GIT_COMMITTER_EMAIL=a@b", "GIT_CONFIG_GLOBAL=/dev/null")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	git("init", "-q")
	if err := os.WriteFile(filepath.Join(repo, "a.txt"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	git("add", "a.txt")
	git("commit", "-qm", "init")
	git("branch", "taken")
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	if code, _, stderr := sbctlAt(t, b, "push", "dev", repo); code != 0 {
		t.Fatalf("push: exit %d %s", code, stderr)
	}
	for _, tc := range []struct {
		branch string
		code   int
		want   string
	}{
		{"agent/dev", exitError, "nothing changed"},
		{"bad..name", exitUsage, "not a valid branch name"},
	} {
		code, _, stderr := sbctlAt(t, b, "pull", "dev", "--dir", repo, "--branch", tc.branch)
		if code != tc.code || !strings.Contains(stderr, tc.want) {
			t.Errorf("pull --branch %s: exit %d %q; want %d saying %q", tc.branch, code, stderr, tc.code, tc.want)
		}
	}
	if code, _, stderr := sbctlAt(t, b, "exec", "dev", "--", "sh", "-c", "echo changed > a.txt"); code != 0 {
		t.Fatalf("exec: %d %s", code, stderr)
	}
	if code, _, stderr := sbctlAt(t, b, "pull", "dev", "--dir", repo, "--branch", "taken"); code != exitConflict || !strings.Contains(stderr, "exists already") {
		t.Errorf("pull --branch onto an existing branch: exit %d %q; want %d", code, stderr, exitConflict)
	}
	if code, out, stderr := sbctlAt(t, b, "pull", "dev", "--dir", repo, "--branch", "agent/dev"); code != 0 || !strings.Contains(out, "1 changed path") {
		t.Errorf("pull --branch: exit %d %q %q", code, out, stderr)
	}
}
