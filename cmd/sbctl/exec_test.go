package main

import (
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
