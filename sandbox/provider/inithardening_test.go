package provider

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
)

// TestInitWithstandsTenant: nothing a command can do from inside takes the resident init down or
// reads it: it cannot be traced or read through /proc, the signals that crash a Go program do not
// reach it, and the OOM killer takes the tenant's processes before it.
func TestInitWithstandsTenant(t *testing.T) {
	n := newNamespace(t, Config{})
	in, _ := startSandbox(t, n, Template{})

	t.Run("no ptrace, no /proc/1 memory or environment", func(t *testing.T) {
		// PTRACE_SEIZE does not stop the tracee, so a success here leaves the init running.
		res, out := sh(t, in, `python3 -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); r = libc.ptrace(0x4206, 1, 0, 0); print(r, ctypes.get_errno())'`)
		if res.ExitCode != 0 || out != "-1 1\n" {
			t.Errorf("PTRACE_SEIZE of the init: %+v %q, want -1 EPERM", res, out)
		}
		for _, f := range []string{"environ", "mem", "maps"} {
			if res, out := sh(t, in, "head -c 16 /proc/1/"+f+" 2>/dev/null | wc -c"); out != "0\n" {
				t.Errorf("/proc/1/%s is readable inside: %+v %q", f, res, out)
			}
		}
	})
	t.Run("crash signals from inside do nothing", func(t *testing.T) {
		for _, sig := range []string{"ABRT", "SEGV", "BUS", "TRAP", "SYS", "ILL", "FPE", "QUIT", "KILL", "STOP"} {
			res, out := sh(t, in, "kill -"+sig+" 1; echo sent")
			if out != "sent\n" {
				t.Fatalf("kill -%s 1: %+v %q", sig, res, out)
			}
			if res, out := sh(t, in, "echo alive"); out != "alive\n" {
				t.Fatalf("after kill -%s 1 the sandbox answers %+v %q", sig, res, out)
			}
		}
		select {
		case <-in.Done():
			t.Fatal("the sandbox ended")
		default:
		}
	})
	t.Run("the init is not the OOM killer's choice; commands are", func(t *testing.T) {
		in, _ := startSandbox(t, n, Template{})
		self, err := os.ReadFile("/proc/self/oom_score_adj")
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile("/proc/" + strconv.Itoa(in.(*instance).initPid) + "/oom_score_adj")
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != string(self) {
			t.Errorf("the init's oom_score_adj is %q, want the broker's %q", b, self)
		}
		want := string(sbxinit.CommandOOMScoreAdj) + "\n"
		if _, out := sh(t, in, "cat /proc/self/oom_score_adj"); out != want {
			t.Errorf("a command's oom_score_adj is %q, want %q", out, want)
		}
		bg, err := in.Exec(t.Context(), ExecRequest{Command: "sleep 30", Background: true})
		if err != nil {
			t.Fatal(err)
		}
		if _, out := sh(t, in, fmt.Sprintf("cat /proc/%d/oom_score_adj; kill %d", bg.Pid, bg.Pid)); out != want {
			t.Errorf("a background command's oom_score_adj is %q, want %q", out, want)
		}
		// What the OOM killer compares: the init's badness is below a small command's. The init
		// is read between commands: while it forks one it carries the command's score.
		_, out := sh(t, in, "cat /proc/self/oom_score")
		initScore, err := os.ReadFile("/proc/" + strconv.Itoa(in.(*instance).initPid) + "/oom_score")
		if err != nil {
			t.Fatal(err)
		}
		i, _ := strconv.Atoi(strings.TrimSpace(string(initScore)))
		c, _ := strconv.Atoi(strings.TrimSpace(out))
		if i == 0 || c == 0 || i >= c {
			t.Errorf("oom_score of the init %q and of cat %q", initScore, out)
		}
		// A command may lower its own score back to the init's, no further.
		base, _ := strconv.Atoi(strings.TrimSpace(string(self)))
		if res, out := sh(t, in, fmt.Sprintf("echo %d > /proc/self/oom_score_adj", base-1)); res.ExitCode == 0 {
			t.Errorf("a command lowered its oom_score_adj below the broker's: %q", out)
		}
	})
}
