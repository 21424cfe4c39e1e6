package provider

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// nonRootHelperEnv makes the test binary a non-root broker that starts one sandbox with the template
// named by the variable's value ("network" or "plain") and prints how it went.
const nonRootHelperEnv = "SBX_PROVIDER_TEST_NONROOT"

func nonRootHelper(mode string) {
	n, err := NewNamespace(Config{DataDir: os.Getenv("SBX_HELPER_DATA")})
	if err != nil {
		fmt.Println("provider error:", err)
		os.Exit(0)
	}
	tmpl := Template{Name: mode}
	if mode == "network" {
		tmpl.Network = NetworkOn
	}
	spec := Spec{ID: NewID(), Template: tmpl}
	ctx := context.Background()
	if err := n.Create(ctx, spec); err != nil {
		fmt.Println("create error:", err)
		os.Exit(0)
	}
	in, err := n.Start(ctx, spec)
	if err != nil {
		fmt.Println("start error:", err)
		os.Exit(0)
	}
	res, err := in.Exec(ctx, ExecRequest{Command: "echo up", Stdout: io.Discard})
	fmt.Println("started:", res.ExitCode, err)
	in.Stop(ctx)
	os.Exit(0)
}

// A broker that is not root cannot install the firewall that keeps a network sandbox from the host's
// addresses, so it refuses to start one, saying why and what to do, rather than run it unfirewalled.
// Its sandboxes without the network start as usual.
func TestNonRootBrokerRefusesNetwork(t *testing.T) {
	requireBwrap(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root to run the broker as another user")
	}
	// The test binary, where an unprivileged uid can run it (go test's build dir is private).
	bin := filepath.Join(testDataDir(t), "provider.test")
	src, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, src, 0o755); err != nil {
		t.Fatal(err)
	}
	const uid = 241003
	run := func(mode string) string {
		data := filepath.Join(testDataDir(t), "data")
		if err := os.Mkdir(data, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(data, uid, uid); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(bin, "-test.run=^$")
		cmd.Dir = "/"
		cmd.Env = []string{"PATH=" + os.Getenv("PATH"), nonRootHelperEnv + "=" + mode, "SBX_HELPER_DATA=" + data}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{}}}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("non-root broker (%s): %v: %s", mode, err, out)
		}
		// Its last line is the helper's; warnings (no disk quota, no cgroups) come before.
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		return lines[len(lines)-1]
	}
	if out := run("plain"); !strings.HasPrefix(out, "started: 0 <nil>") {
		t.Fatalf("a non-root broker's sandbox without the network: %s", out)
	}
	out := run("network")
	if !strings.HasPrefix(out, "start error:") || !strings.Contains(out, "root") || !strings.Contains(out, "network: false") {
		t.Fatalf("a non-root broker's network sandbox: %q, want a start error that says it needs root", out)
	}
}
