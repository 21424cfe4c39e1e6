package provider

import (
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/tests/wait"
)

// waitForResize types Enter until a `while read; do stty size; done` loop on the terminal prints
// the new size: a keystroke can reach the terminal before a resize sent ahead of it.
func waitForResize(t *testing.T, out *wait.Buffer, stdin io.Writer, size string) {
	t.Helper()
	wait.Eventually(t, 10*time.Second, func() bool {
		if strings.Contains(out.String(), size) {
			return true
		}
		io.WriteString(stdin, "\n")
		return false
	}, "stty size seeing the resize to %s", size)
}

// ttyRun starts argv on a terminal and returns its output, its stdin and the result's channel.
func ttyRun(t *testing.T, ctx context.Context, in Instance, argv []string, tty *TTY) (*wait.Buffer, *io.PipeWriter, chan ExecResult) {
	t.Helper()
	if tty == nil {
		tty = &TTY{}
	}
	out := &wait.Buffer{}
	pr, pw := io.Pipe()
	t.Cleanup(func() { pw.Close() })
	done := make(chan ExecResult, 1)
	go func() {
		res, err := in.Exec(ctx, ExecRequest{Argv: argv, Stdin: pr, Stdout: out, TTY: tty})
		if err != nil {
			t.Errorf("exec %v on a terminal: %v", argv, err)
		}
		pr.Close()
		done <- res
	}()
	return out, pw, done
}

func waitResult(t *testing.T, done chan ExecResult) ExecResult {
	t.Helper()
	select {
	case res := <-done:
		return res
	case <-time.After(30 * time.Second):
		t.Fatal("the terminal command did not end")
	}
	return ExecResult{}
}

// A command on a terminal gets one from the sandbox's own devpts (a fresh instance numbers from 0,
// the host's has others), sized as asked and resized on request; ^C typed is SIGINT to the
// foreground job; its exit code comes back; its session ends with it; cancelling kills the session.
func TestExecOnTerminal(t *testing.T) {
	t.Parallel()
	in, _ := startSandbox(t, newNamespace(t, Config{}), Template{})
	if !SupportsTTY(in) {
		t.Fatal("the namespace provider says it has no terminals")
	}
	ctx := context.Background()

	out, _, done := ttyRun(t, ctx, in, []string{"sh", "-c", "tty; stty size; exit 7"}, &TTY{Rows: 33, Cols: 101})
	res := waitResult(t, done)
	if res.ExitCode != 7 || !strings.Contains(out.String(), "/dev/pts/0\r\n") || !strings.Contains(out.String(), "33 101\r\n") {
		t.Fatalf("tty; stty size; exit 7: %+v %q", res, out.String())
	}

	resize := make(chan WindowSize, 1)
	out, stdin, done := ttyRun(t, ctx, in, []string{"sh", "-c", "while read x; do stty size; done"}, &TTY{Resize: resize})
	io.WriteString(stdin, "\n")
	out.WaitFor(t, 10*time.Second, "24 80\r\n")
	resize <- WindowSize{Rows: 50, Cols: 120}
	waitForResize(t, out, stdin, "50 120")
	io.WriteString(stdin, "\x04") // ^D: read sees the end of input
	if res := waitResult(t, done); res.ExitCode != 0 {
		t.Fatalf("^D ended the loop with %+v", res)
	}

	// ^C interrupts the foreground job, the way the line discipline does it: a byte, not a request.
	mark := marker()
	out, stdin, done = ttyRun(t, ctx, in, []string{"sh", "-c", "echo ready; exec " + mark}, nil)
	out.WaitFor(t, 10*time.Second, "ready")
	waitHostRunning(t, mark)
	io.WriteString(stdin, "\x03")
	if res := waitResult(t, done); res.Signal != "INT" || res.ExitCode != 130 {
		t.Fatalf("^C: %+v, want SIGINT", res)
	}

	// A job left in the background goes with the session's leader.
	mark = marker()
	out, _, done = ttyRun(t, ctx, in, []string{"sh", "-c", "(" + mark + " &); echo ready; exit 3"}, nil)
	if res := waitResult(t, done); res.ExitCode != 3 {
		t.Fatalf("exit 3: %+v %q", res, out.String())
	}
	waitHostGone(t, mark)

	// Cancelling ends the whole session, jobs in their own process groups included.
	mark = marker()
	cctx, cancel := context.WithCancel(ctx)
	out, _, done = ttyRun(t, cctx, in, []string{"bash", "-ic", "set -m; " + mark + " & echo ready; wait"}, nil)
	out.WaitFor(t, 10*time.Second, "ready")
	waitHostRunning(t, mark)
	cancel()
	if res := waitResult(t, done); res.Reason != ReasonCancelled {
		t.Fatalf("cancelled: %+v", res)
	}
	waitHostGone(t, mark)

	// A program that is not there is a clear error, not a silent 127.
	_, err := in.Exec(ctx, ExecRequest{Argv: []string{"no-such-shell"}, Stdout: io.Discard, TTY: &TTY{}})
	var ire *InvalidRequestError
	if !errors.As(err, &ire) || !strings.Contains(err.Error(), "no-such-shell: command not found") {
		t.Fatalf("a missing program on a terminal: %v", err)
	}
}

// With the init frozen, cancelling a terminal command still ends its whole session from outside:
// the leader's group and what is below it, and an orphan that job control left in a group of its
// own, found through the terminal it holds.
func TestTerminalCancelWithoutTheInit(t *testing.T) {
	t.Parallel()
	in, _ := startSandbox(t, newNamespace(t, Config{}), Template{})
	inst := in.(*instance)
	job := marker()
	ctx, cancel := context.WithCancel(context.Background())
	// The job's subshell exits at once: its child is an orphan in the job's group, not the
	// shell's, found only through the terminal it holds.
	out, _, done := ttyRun(t, ctx, in, []string{"bash", "-ic", "set -m; trap '' HUP; (" + job + " &); echo ready; sleep 1000"}, nil)
	out.WaitFor(t, 10*time.Second, "ready")
	waitHostRunning(t, job)
	waitCommandPids(t, inst)
	inst.mu.Lock()
	initPid := inst.initPid
	inst.mu.Unlock()
	if err := unix.Kill(initPid, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(initPid, unix.SIGCONT)
	cancel()
	if res := waitResult(t, done); res.Reason != ReasonCancelled {
		t.Fatalf("cancelled with the init frozen: %+v", res)
	}
	waitHostGone(t, job)
}

// TestTakeTerminalOnlyOnce: the init sends one master per terminal command; a second or third
// forked reply with an fd (an init that misbehaves) is refused and its fd left to the caller to
// close, and never blocks the reply loop, which every command of the sandbox waits on.
func TestTakeTerminalOnlyOnce(t *testing.T) {
	c := &call{done: make(chan struct{}), pty: make(chan *os.File, 1)}
	var fds []int
	for range 3 {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		unix.Close(p[1])
		fds = append(fds, p[0])
	}
	took := make(chan []bool, 1)
	go func() {
		var got []bool
		for _, fd := range fds {
			got = append(got, c.takeTerminal([]int{fd}))
		}
		took <- got
	}()
	select {
	case got := <-took:
		if !got[0] || got[1] || got[2] {
			t.Fatalf("takeTerminal answered %v, want the first only", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a third master blocked the reply loop")
	}
	for _, fd := range fds[1:] {
		if err := unix.Close(fd); err != nil {
			t.Errorf("fd %d was not left to the caller: %v", fd, err)
		}
	}
	(<-c.pty).Close()
}
