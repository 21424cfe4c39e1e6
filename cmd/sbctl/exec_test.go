package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// A request the broker refuses for its arguments is the caller's mistake, exit 2, whether the REST
// API (400) or the dataplane refuses it: sbctl exec --cwd outside the workspace, or a cp path
// outside it, says which flag or path and which paths are allowed. A directory that does not
// exist is no usage error: the command line was right, the sandbox lacks it.
func TestRefusedArgumentsExit2(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		code int
		want []string
	}{
		{[]string{"exec", "dev", "--cwd", "/etc", "--", "true"}, exitUsage, []string{"--cwd", `"/etc" is outside /workspace`, "give a path under /workspace"}},
		{[]string{"exec", "dev", "--cwd", "../x", "--", "true"}, exitUsage, []string{"--cwd", "give a path under /workspace"}},
		{[]string{"cp", "dev:/etc/passwd", t.TempDir() + "/p"}, exitUsage, []string{"outside /workspace"}},
		{[]string{"exec", "dev", "--cwd", "/workspace/missing", "--", "true"}, exitError, []string{"/workspace/missing", "create it first"}},
	} {
		code, _, stderr := sbctlAt(t, b, tc.args...)
		if code != tc.code {
			t.Errorf("sbctl %v: exit %d %q, want %d", tc.args, code, stderr, tc.code)
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("sbctl %v: %q does not say %q", tc.args, stderr, w)
			}
		}
	}
}

// A sandbox path that the path rules refuse whatever the sandbox holds is a wrong command line,
// exit 2, said before anything is sent (the broker here is unreachable). One that passes them but
// that the sandbox's content refuses is no usage error, exit 1: cp onto a link leading out of the
// workspace (followed here, or by the broker through a trailing / or a later name), onto a dangling
// one, or through a link loop says which link and why. Before, every such refusal exited 2.
func TestCpOntoALinkLeadingOutExits1(t *testing.T) {
	t.Parallel()
	f := filepath.Join(t.TempDir(), "f.txt")
	if err := os.WriteFile(f, []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"cp", f, "dev:/etc/x"},
		{"cp", f, "dev:../x"},
		{"cp", "dev:/etc/passwd", t.TempDir()},
		{"cp", "-", "dev:/etc"},
		{"exec", "dev", "--cwd", "/etc", "--", "true"},
		{"shell", "dev", "--cwd", "../x"},
	} {
		if code, _, stderr := sbctl(t, t.Context(), "http://127.0.0.1:1", "", args...); code != exitUsage || !strings.Contains(stderr, "/workspace") {
			t.Errorf("sbctl %v: exit %d %q, want %d naming /workspace", args, code, stderr, exitUsage)
		}
	}

	b := servertest.New(t, servertest.Options{})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	if code, _, stderr := sbctlAt(t, b, "exec", "dev", "--", "sh", "-c", "ln -s /etc out && ln -s ../.. up && ln -s nowhere dangling && ln -s loop loop"); code != 0 {
		t.Fatalf("making the links: exit %d %s", code, stderr)
	}
	for _, tc := range []struct {
		dst  string
		want []string
	}{
		{"dev:out", []string{"dev:out", "symbolic link", "/etc", "leads out of the workspace"}},
		{"dev:up", []string{"dev:up", "symbolic link", "leads out of the workspace"}},
		{"dev:out/", []string{"outside the workspace through a symbolic link"}},
		{"dev:out/x", []string{"outside the workspace through a symbolic link"}},
		{"dev:dangling", []string{"symbolic link to nowhere, which does not exist"}},
		{"dev:loop", []string{"too many levels of symbolic links"}},
	} {
		code, _, stderr := sbctlAt(t, b, "cp", f, tc.dst)
		if code != exitError {
			t.Errorf("cp to %s: exit %d %q, want %d", tc.dst, code, stderr, exitError)
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("cp to %s: %q does not say %q", tc.dst, stderr, w)
			}
		}
	}
	if _, err := os.Stat("/etc/f.txt"); err == nil {
		t.Fatal("a refused copy wrote /etc/f.txt")
	}
}
