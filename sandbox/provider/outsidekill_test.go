package provider

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/tests/wait"
)

// TestTimeoutFiresWithoutTheInit: an exec's timeout is the broker's, not the init's. With the
// resident init frozen (as if a tenant had stopped it, or it hung), a command that ignores the
// polite signals and a child that left its session and its parent, holding the output pipe, still
// end at the timeout, and the answer says timed out. The init, once thawed, keeps serving.
func TestTimeoutFiresWithoutTheInit(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			in, _ := startSandbox(t, p, Template{})
			inst := in.(*instance)
			main, away := marker(), marker()
			// The subshell exits at once: the setsid child is an orphan in its own session and
			// process group, found only through the output pipe it holds.
			cmd := fmt.Sprintf("trap '' TERM INT HUP; (setsid %s &); %s", away, main)
			type result struct {
				res ExecResult
				err error
			}
			done := make(chan result, 1)
			go func() {
				res, err := in.Exec(context.Background(), ExecRequest{Command: cmd, Stdout: &bytes.Buffer{}, Timeout: 700 * time.Millisecond})
				done <- result{res, err}
			}()
			waitHostRunning(t, main)
			waitHostRunning(t, away)
			waitCommandPids(t, inst)
			inst.mu.Lock()
			initPid := inst.initPid
			inst.mu.Unlock()
			if err := unix.Kill(initPid, unix.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			thawed := false
			thaw := func() {
				if !thawed {
					thawed = true
					unix.Kill(initPid, unix.SIGCONT)
				}
			}
			defer thaw()
			select {
			case r := <-done:
				if r.err != nil {
					t.Fatalf("exec: %v", r.err)
				}
				if r.res.Reason != ReasonTimeout || r.res.Signal != "KILL" || r.res.ExitCode != 137 {
					t.Errorf("result %+v, want a KILL for timeout", r.res)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("the exec did not end at its timeout while the init was frozen")
			}
			waitHostGone(t, main)
			waitHostGone(t, away)
			thaw()
			if res, out := sh(t, in, "echo alive"); out != "alive\n" || res.ExitCode != 0 {
				t.Errorf("after the init was thawed: %+v %q", res, out)
			}
		})
	}
}

// TestTimeoutFindsACommandByItsGroup: a command that let go of its output pipes is found from
// outside only by its process group, the pid the init wrote to the pid table as it forked it (no
// message carries it): with the init frozen, the timeout still ends it.
func TestTimeoutFindsACommandByItsGroup(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			in, _ := startSandbox(t, p, Template{})
			inst := in.(*instance)
			main := marker()
			cmd := fmt.Sprintf("exec >/dev/null 2>&1 </dev/null; trap '' TERM INT HUP; %s; true", main)
			done := make(chan ExecResult, 1)
			go func() {
				res, err := in.Exec(context.Background(), ExecRequest{Command: cmd, Stdout: &bytes.Buffer{}, Timeout: 700 * time.Millisecond})
				if err != nil {
					t.Errorf("exec: %v", err)
				}
				done <- res
			}()
			waitHostRunning(t, main)
			waitCommandPids(t, inst)
			inst.mu.Lock()
			initPid := inst.initPid
			inst.mu.Unlock()
			if err := unix.Kill(initPid, unix.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			defer unix.Kill(initPid, unix.SIGCONT)
			select {
			case res := <-done:
				if res.Reason != ReasonTimeout || res.Signal != "KILL" {
					t.Errorf("result %+v, want a KILL for timeout", res)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("the exec did not end at its timeout while the init was frozen")
			}
			waitHostGone(t, main)
		})
	}
}

// TestRequestsToAFrozenInitEnd: requests that the init cannot take (it stopped reading, so its end of
// the socket is full) end at their timeout with an error rather than block their caller for good.
func TestRequestsToAFrozenInitEnd(t *testing.T) {
	n := newNamespace(t, Config{})
	in, _ := startSandbox(t, n, Template{})
	inst := in.(*instance)
	inst.mu.Lock()
	initPid := inst.initPid
	inst.mu.Unlock()
	if err := unix.Kill(initPid, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(initPid, unix.SIGCONT)
	// Two of these fill the socket's buffer (about 200 KiB).
	big := strings.Repeat("x", 100<<10)
	const execs = 4
	errs := make(chan error, execs)
	for i := 0; i < execs; i++ {
		go func() {
			_, err := in.Exec(context.Background(), ExecRequest{Argv: []string{"true", big}, Timeout: 500 * time.Millisecond})
			errs <- err
		}()
	}
	notTaken := 0
	for i := 0; i < execs; i++ {
		select {
		case err := <-errs:
			if errors.Is(err, context.DeadlineExceeded) {
				notTaken++
			} else if err != nil {
				t.Errorf("exec: %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("%d of %d execs to a frozen init did not end at their timeout", execs-i, execs)
		}
	}
	if notTaken == 0 {
		t.Error("every request fitted in the socket: the test sent too little to fill it")
	}
}

// TestHostilePidTableSignalsNothingOutside: the pid table is writable by the sandbox's init, which
// a tenant may control; the broker reads a command's group from it only to end the command from
// outside. A table naming another sandbox's command (its host pid, which in the dir provider is also
// its group) or the init itself makes the broker signal nothing outside the sandbox, nor its init.
func TestHostilePidTableSignalsNothingOutside(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			t.Parallel()
			victimIn, _ := startSandbox(t, p, Template{})
			victim := marker()
			go victimIn.Exec(context.Background(), ExecRequest{Argv: strings.Fields(victim), Timeout: time.Minute})
			waitHostRunning(t, victim)
			victimPid := hostPids(victim)[0]

			in, _ := startSandbox(t, p, Template{})
			inst := in.(*instance)
			for _, forged := range []int{victimPid, 1} {
				main := marker()
				cmd := fmt.Sprintf("exec >/dev/null 2>&1 </dev/null; trap '' TERM INT HUP; %s; true", main)
				done := make(chan ExecResult, 1)
				go func() {
					res, _ := in.Exec(context.Background(), ExecRequest{Command: cmd, Stdout: &bytes.Buffer{}, Timeout: 700 * time.Millisecond})
					done <- res
				}()
				waitHostRunning(t, main)
				waitCommandPids(t, inst)
				inst.mu.Lock()
				initPid := inst.initPid
				if forged == 1 {
					forged = initPid // the init's own host pid (its group in the dir provider)
				}
				for id := range inst.calls {
					inst.pids.Put(id, forged) // after the init wrote the real one
				}
				inst.mu.Unlock()
				if err := unix.Kill(initPid, unix.SIGSTOP); err != nil {
					t.Fatal(err)
				}
				select {
				case <-done:
				case <-time.After(15 * time.Second):
					t.Fatal("the exec did not end at its timeout while the init was frozen")
				}
				unix.Kill(initPid, unix.SIGCONT)
				if len(hostPids(victim)) == 0 {
					t.Fatalf("a forged pid table entry (%d) killed another sandbox's command", forged)
				}
				if res, out := sh(t, in, "echo alive"); out != "alive\n" || res.ExitCode != 0 {
					t.Fatalf("after a forged pid table entry (%d) the init is gone: %+v %q", forged, res, out)
				}
				for _, pid := range hostPids(main) {
					unix.Kill(pid, unix.SIGKILL) // the forged entry hid it: the tenant's own loss
				}
			}
		})
	}
}

// TestKillOutsideSparesAReusedPid: between the broker's scan of /proc and its signals, a process of
// the sandbox can exit and be reaped (a tenant decides when) and its pid be taken by any host
// process: the broker is root, and a signal by pid would reach that process. Here the scan reports
// a host process outside every sandbox as a child of the init in the command's group, as a scan
// just before such a reuse would; the kill from outside must leave it alone.
func TestKillOutsideSparesAReusedPid(t *testing.T) {
	for _, p := range providers(t) {
		t.Run(p.Name(), func(t *testing.T) {
			in, _ := startSandbox(t, p, Template{})
			inst := in.(*instance)
			outside := exec.Command("sleep", "300")
			outside.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
			if err := outside.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- outside.Wait() }()
			t.Cleanup(func() { outside.Process.Kill(); <-exited })
			inst.mu.Lock()
			initPid := inst.initPid
			inst.mu.Unlock()
			scanProcs = func() []hostProc {
				procs := scanHostProcs()
				for _, pr := range procs {
					if pr.ppid == initPid && pr.pid != outside.Process.Pid {
						// The host process, seen as if it had taken a command's pid.
						return append(procs, hostProc{pid: outside.Process.Pid, ppid: initPid, pgid: pr.pgid})
					}
				}
				return procs
			}
			t.Cleanup(func() { scanProcs = scanHostProcs })

			main := marker()
			cmd := fmt.Sprintf("exec >/dev/null 2>&1 </dev/null; trap '' TERM INT HUP; %s; true", main)
			done := make(chan ExecResult, 1)
			go func() {
				res, _ := in.Exec(context.Background(), ExecRequest{Command: cmd, Stdout: &bytes.Buffer{}, Timeout: 700 * time.Millisecond})
				done <- res
			}()
			waitHostRunning(t, main)
			waitCommandPids(t, inst)
			if err := unix.Kill(initPid, unix.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			defer unix.Kill(initPid, unix.SIGCONT)
			select {
			case res := <-done:
				if res.Reason != ReasonTimeout || res.Signal != "KILL" {
					t.Errorf("result %+v, want a KILL for timeout", res)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("the exec did not end at its timeout while the init was frozen")
			}
			waitHostGone(t, main)
			select {
			case err := <-exited:
				exited <- err
				t.Fatalf("the kill from outside signalled a host process that held a pid its scan saw in the sandbox: %v", err)
			default:
			}
			// Stopped, killed (a zombie until Wait) or reaped: signalled all the same.
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", outside.Process.Pid))
			if f := strings.Fields(string(b)); err != nil || len(f) < 3 || strings.ContainsAny(f[2], "TtZX") {
				t.Fatalf("the kill from outside signalled a host process that held a pid its scan saw in the sandbox: %q %v", b, err)
			}
		})
	}
}

// waitCommandPids waits until the broker knows the pid of every command in flight, before a test
// freezes the init: the init writes a command's pid into the pid table after its fork returns, and
// one frozen in between (the command running already, its pid not yet written) leaves the broker no
// process group to end from outside, which a CI run under load met.
func waitCommandPids(t *testing.T, inst *instance) {
	t.Helper()
	wait.Eventually(t, 10*time.Second, func() bool {
		inst.mu.Lock()
		calls := make([]*call, 0, len(inst.calls))
		for _, c := range inst.calls {
			calls = append(calls, c)
		}
		inst.mu.Unlock()
		for _, c := range calls {
			if inst.commandPid(c) <= 0 {
				return false
			}
		}
		return true
	}, "the init writing the pids of the commands in flight")
}
