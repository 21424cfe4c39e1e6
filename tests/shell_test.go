package tests

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/tests/wait"
)

// sbctl shell in a real terminal (tmux) against a real broker: the login shell on a terminal
// inside the sandbox, sized like the window and resized with it, ^C and ^Z reaching the job
// running in it, the shell's exit code as sbctl's, and the local terminal restored afterwards.
func TestShell(t *testing.T) {
	b := startBroker(t)
	b.ok("create", "dev")
	// The local terminal's modes after sbctl exits: raw mode would show -icanon -echo.
	p := startPaneThen(t, b, 80, 24, `stty -a | tr ' ;' '\n\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\n' ' '; echo;`, "shell", "dev")
	p.waitMatch(`(?m)^bash-[0-9.]+\$`)
	p.keys("echo \"$0 on $(tty)\"; stty size", "Enter")
	p.waitText("/bin/bash on /dev/pts/0")
	p.waitText("24 80")

	p.tmux("resize-window", "-t", "w", "-x", "100", "-y", "30")
	p.keys("clear; stty size", "Enter")
	p.waitText("30 100")

	running := func(pattern string) func() bool {
		return func() bool { return b.sbctl("exec", "dev", "--", "pgrep", "-f", pattern).code == 0 }
	}
	p.keys("sleep 1000", "Enter")
	wait.Eventually(t, 20*time.Second, running("[s]leep 1000"), "sleep 1000 running in the shell")
	p.keys("C-c")
	p.keys("echo rc=$?", "Enter")
	p.waitText("rc=130")

	p.keys("sleep 1001", "Enter")
	wait.Eventually(t, 20*time.Second, running("[s]leep 1001"), "sleep 1001 running in the shell")
	p.keys("C-z")
	p.waitText("Stopped")
	p.keys("fg", "Enter")
	wait.Eventually(t, 20*time.Second, func() bool {
		return strings.HasPrefix(b.sbctl("exec", "dev", "--", "ps", "-o", "stat=", "-C", "sleep").stdout, "S")
	}, "sleep 1001 running again in the foreground")
	p.keys("C-c")
	p.keys("exit 7", "Enter")
	s := p.waitText("sbctl-exited=7")
	if !strings.Contains(s, "icanon echo") {
		t.Fatalf("the terminal was not restored after sbctl shell:\n%s", s)
	}
	if running("[s]leep 100[01]")() {
		t.Fatal("a job of the shell outlived it")
	}

	// A command instead of the login shell; its code is sbctl's.
	p = startPane(t, b, 80, 24, "shell", "dev", "--", "sh", "-c", "read x; exit $x")
	p.keys("3", "Enter")
	p.waitText("sbctl-exited=3")

	// The lease is renewed while the shell runs (only owner calls renew it).
	b.ok("create", "brief", "--ttl", "3s")
	expires := func() time.Time {
		var sb struct {
			ExpiresAt time.Time `json:"expires_at"`
		}
		json.Unmarshal([]byte(b.ok("get", "brief", "-o", "json")), &sb)
		return sb.ExpiresAt
	}
	p = startPane(t, b, 80, 24, "shell", "brief")
	p.waitMatch(`(?m)^bash-[0-9.]+\$`)
	first := expires()
	wait.Eventually(t, 20*time.Second, func() bool { return expires().After(first) }, "the lease renewed while the shell runs")
	p.keys("exit", "Enter")
	p.waitText("sbctl-exited=0")

	// Without a terminal it says it needs one.
	r := b.sbctl("shell", "dev")
	if r.code != 2 || !strings.Contains(r.stderr, "needs a terminal") {
		t.Fatalf("sbctl shell without a terminal: exit %d %s", r.code, r.stderr)
	}
}
