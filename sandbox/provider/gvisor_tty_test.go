package provider

import (
	"context"
	"errors"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/tests/wait"
)

// sandboxRunning counts the processes inside in whose command line starts with s (a gVisor
// sandbox's processes are the sentry's, not visible on the host).
func sandboxRunning(t *testing.T, in Instance, s string) int {
	t.Helper()
	_, out := sh(t, in, `n=0; for f in /proc/[0-9]*/cmdline; do c=$(tr '\0' ' ' < "$f" 2>/dev/null); case "$c" in "`+s+` "*) n=$((n+1));; esac; done; echo $n`)
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("counting %q inside: %q", s, out)
	}
	return n
}

// TestGvisorTerminal: a command on a terminal at the gvisor level behaves as at the namespace
// level (TestExecOnTerminal), though the terminal's master cannot leave the sentry: the bridge
// holds it and carries its bytes and window changes as frames.
func TestGvisorTerminal(t *testing.T) {
	n := newGvisor(t)
	in, spec := startSandbox(t, n, gvisorTemplate)
	ctx := context.Background()

	out, _, done := ttyRun(t, ctx, in, []string{"sh", "-c", "tty; stty size; exit 7"}, &TTY{Rows: 33, Cols: 101})
	res := waitResult(t, done)
	if res.ExitCode != 7 || !strings.Contains(out.String(), "/dev/pts/") || !strings.Contains(out.String(), "33 101\r\n") {
		t.Fatalf("tty; stty size; exit 7: %+v %q", res, out.String())
	}

	resize := make(chan WindowSize, 1)
	out, stdin, done := ttyRun(t, ctx, in, []string{"sh", "-c", "while read x; do stty size; done"}, &TTY{Resize: resize})
	io.WriteString(stdin, "\n")
	out.WaitFor(t, 10*time.Second, "24 80\r\n")
	resize <- WindowSize{Rows: 50, Cols: 120}
	waitForResize(t, out, stdin, "50 120")
	stdin.Close() // the end of input is typed as ^D: read sees end of file
	if res := waitResult(t, done); res.ExitCode != 0 {
		t.Fatalf("^D ended the loop with %+v", res)
	}

	// ^C interrupts the foreground job: a byte through the bridge, turned into SIGINT by the
	// sentry's line discipline.
	mark := marker()
	out, stdin, done = ttyRun(t, ctx, in, []string{"sh", "-c", "echo ready; exec " + mark}, nil)
	out.WaitFor(t, 10*time.Second, "ready")
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
	wait.Eventually(t, 10*time.Second, func() bool { return sandboxRunning(t, in, mark) == 0 }, "the session's background job to end")

	// Cancelling ends the whole session, jobs in their own process groups included.
	mark = marker()
	cctx, cancel := context.WithCancel(ctx)
	out, _, done = ttyRun(t, cctx, in, []string{"bash", "-ic", "set -m; " + mark + " & echo ready; wait"}, nil)
	out.WaitFor(t, 10*time.Second, "ready")
	if got := sandboxRunning(t, in, mark); got != 1 {
		t.Fatalf("%d processes %q before the cancel, want 1", got, mark)
	}
	cancel()
	if res := waitResult(t, done); res.Reason != ReasonCancelled {
		t.Fatalf("cancelled: %+v", res)
	}
	wait.Eventually(t, 10*time.Second, func() bool { return sandboxRunning(t, in, mark) == 0 }, "the cancelled session's job to end")

	// A program that is not there is a clear error.
	_, err := in.Exec(ctx, ExecRequest{Argv: []string{"no-such-shell"}, Stdout: io.Discard, TTY: &TTY{}})
	var ire *InvalidRequestError
	if !errors.As(err, &ire) || !strings.Contains(err.Error(), "no-such-shell: command not found") {
		t.Fatalf("a missing program on a terminal: %v", err)
	}

	// The sandbox stopping ends a terminal command in flight, and leaves no runsc process.
	sout := &wait.Buffer{}
	pr, pw := io.Pipe()
	defer pw.Close()
	errc := make(chan error, 1)
	go func() {
		_, err := in.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", "echo ready; exec sleep 1000"}, Stdin: pr, Stdout: sout, TTY: &TTY{}})
		errc <- err
	}()
	sout.WaitFor(t, 10*time.Second, "ready")
	if err := in.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err == nil {
			t.Error("a terminal command outlived its sandbox's stop with no error")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the terminal command did not end with its sandbox")
	}
	wait.Eventually(t, 10*time.Second, func() bool { return len(runscPids(spec.ID)) == 0 }, "runsc processes of %s to end", spec.ID)
}
