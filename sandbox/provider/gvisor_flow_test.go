package provider

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/tests/wait"
)

// At the gvisor level every command's stdio rides one stream between the relay and the bridge
// (gvisor_relay.go, sbxinit/bridge.go). One command whose output nobody reads, or whose input
// nobody reads, must hold up that command only: each channel has its own window, and the stream's
// readers never wait for one channel's consumer. These tests hold one command's channel stalled and
// run others beside it.

// stallWriter is an output whose reader never reads: its first Write says so and every Write
// blocks until release.
type stallWriter struct {
	once    sync.Once
	written chan struct{}
	release chan struct{}
}

func newStallWriter() *stallWriter {
	return &stallWriter{written: make(chan struct{}), release: make(chan struct{})}
}

func (w *stallWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.written) })
	<-w.release
	return len(p), nil
}

// endlessInput is a stdin that never ends; it counts what was taken from it.
type endlessInput struct{ n atomic.Int64 }

func (r *endlessInput) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'a'
	}
	r.n.Add(int64(len(p)))
	return len(p), nil
}

// stalledBeyond is how far a stalled channel's data must have gone before the others are tried:
// past the broker's own pipe and buffers, so that the relay's and the bridge's queues are filling.
const stalledBeyond = 192 << 10

// othersStillRun runs short commands one after another beside a stalled one; each must finish.
// Before flow control, the one stream stopped once the stalled channel's queue was full (64 frames),
// and every later command hung.
func othersStillRun(t *testing.T, in Instance, why string) {
	t.Helper()
	type result struct {
		res ExecResult
		out string
		err error
	}
	for i := range 20 {
		done := make(chan result, 1)
		go func() {
			var out bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			res, err := in.Exec(ctx, ExecRequest{Command: "cat; echo ok", Stdin: strings.NewReader("in "), Stdout: &out})
			done <- result{res, out.String(), err}
		}()
		select {
		case r := <-done:
			if r.err != nil || r.res.ExitCode != 0 || r.out != "in ok\n" {
				t.Fatalf("command %d beside %s: %+v %v %q", i, why, r.res, r.err, r.out)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("command %d beside %s did not finish: the sandbox's other commands are stalled with it", i, why)
		}
	}
}

// endStalled cancels the stalled command, lets its reader go, and waits for its end.
func endStalled(t *testing.T, cancel func(), w *stallWriter, done chan error) {
	t.Helper()
	cancel()
	if w != nil {
		close(w.release)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the stalled command, cancelled: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the stalled command did not end when cancelled")
	}
}

// progress reads the count a command writes to the workspace as it goes.
func progress(ws, name string) int {
	b, _ := os.ReadFile(filepath.Join(ws, name))
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// writeLoop writes 64 KiB at a time to its stdout and counts the writes done in /workspace/n.
const writeLoop = `i=0; while head -c 65536 /dev/zero; do i=$((i+1)); echo $i > /workspace/n; done`

func TestGvisorFlowControl(t *testing.T) {
	n := newGvisor(t)
	discards := relayDiscards.Load()
	t.Cleanup(func() {
		if d := relayDiscards.Load() - discards; d != 0 {
			t.Errorf("%d frames were discarded for channels not open (see the log)", d)
		}
	})

	t.Run("output nobody reads", func(t *testing.T) {
		in, spec := startSandbox(t, n, gvisorTemplate)
		ws := n.WorkspaceDir(spec)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		w := newStallWriter()
		done := make(chan error, 1)
		go func() {
			_, err := in.Exec(ctx, ExecRequest{Command: writeLoop, Stdout: w})
			done <- err
		}()
		<-w.written
		wait.Eventually(t, 20*time.Second, func() bool { return progress(ws, "n")*65536 >= stalledBeyond },
			"the unread command to write %d bytes", stalledBeyond)
		othersStillRun(t, in, "a command whose output nobody reads")
		endStalled(t, cancel, w, done)
	})

	t.Run("stdin the command never reads", func(t *testing.T) {
		in, _ := startSandbox(t, n, gvisorTemplate)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		stdin := &endlessInput{}
		done := make(chan error, 1)
		go func() {
			_, err := in.Exec(ctx, ExecRequest{Command: "exec sleep 600", Stdin: stdin, Stdout: io.Discard})
			done <- err
		}()
		wait.Eventually(t, 20*time.Second, func() bool { return stdin.n.Load() >= stalledBeyond },
			"%d bytes of stdin to be taken", stalledBeyond)
		othersStillRun(t, in, "a command that never reads its stdin")
		endStalled(t, cancel, nil, done)
	})

	t.Run("terminal output nobody reads", func(t *testing.T) {
		in, spec := startSandbox(t, n, gvisorTemplate)
		ws := n.WorkspaceDir(spec)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		w := newStallWriter()
		done := make(chan error, 1)
		go func() {
			_, err := in.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", writeLoop}, Stdout: w, TTY: &TTY{}})
			done <- err
		}()
		<-w.written
		wait.Eventually(t, 20*time.Second, func() bool { return progress(ws, "n")*65536 >= stalledBeyond },
			"the unread terminal to take %d bytes", stalledBeyond)
		othersStillRun(t, in, "a terminal whose output nobody reads")
		endStalled(t, cancel, w, done)
	})

	t.Run("terminal input the program never reads", func(t *testing.T) {
		in, _ := startSandbox(t, n, gvisorTemplate)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		out := &wait.Buffer{}
		pr, pw := io.Pipe()
		defer pw.Close()
		done := make(chan error, 1)
		go func() {
			// No echo (the keystrokes would come back as output) and no lines: the terminal
			// takes keystrokes until its input queue is full, then the bridge's writes block.
			_, err := in.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", "stty -echo -icanon; echo ready; exec sleep 600"},
				Stdin: pr, Stdout: out, TTY: &TTY{}})
			done <- err
		}()
		out.WaitFor(t, 10*time.Second, "ready")
		stdin := &endlessInput{}
		go io.Copy(pw, stdin)
		wait.Eventually(t, 20*time.Second, func() bool { return stdin.n.Load() >= stalledBeyond },
			"%d keystrokes to be taken", stalledBeyond)
		othersStillRun(t, in, "a terminal program that never reads its input")
		endStalled(t, cancel, nil, done)
	})
	t.Run("a process left behind holds no channel once its command returned", func(t *testing.T) {
		max := relayMaxChannels
		relayMaxChannels = 4
		defer func() { relayMaxChannels = max }()
		in, _ := startSandbox(t, n, gvisorTemplate)
		// Each command leaves a process holding its stdout, which writes nothing: at the
		// namespace level the broker's end of the pipe is simply closed when the command
		// returns. Here its channel was freed only once the process wrote again, so a few
		// `server &` filled the bound and the sandbox refused every command until they ended.
		for i := range 3 * relayMaxChannels {
			var out bytes.Buffer
			if err := wait.For(20*time.Second, func() error {
				out.Reset()
				_, err := in.Exec(context.Background(), ExecRequest{Command: "sleep 600 & echo started", Stdout: &out})
				return err
			}); err != nil || out.String() != "started\n" {
				t.Fatalf("command %d beside %d processes left behind: %v %q", i, i, err, out.String())
			}
		}
	})
	t.Run("a process left behind holds no stdin channel once its command returned", func(t *testing.T) {
		max := relayMaxChannels
		relayMaxChannels = 4
		defer func() { relayMaxChannels = max }()
		in, _ := startSandbox(t, n, gvisorTemplate)
		// Each command leaves a process holding its stdin, which it never reads, and the stdin
		// never ends: once the windows are full the relay's copy waits for credit that never
		// comes, and the broker's end of the pipe closing when the command returns told it
		// nothing. Its channel stayed until that process ended.
		for i := range 3 * relayMaxChannels {
			if err := wait.For(20*time.Second, func() error {
				_, err := in.Exec(context.Background(), ExecRequest{Command: "exec 3<&0; sleep 600 0<&3 3<&- & sleep 0.2",
					Stdin: &endlessInput{}, Stdout: io.Discard})
				return err
			}); err != nil {
				t.Fatalf("command %d beside %d processes left behind: %v", i, i, err)
			}
		}
	})
	t.Run("past the channel bound a command is refused, not queued", func(t *testing.T) {
		max := relayMaxChannels
		// Exactly the stalled command's: a kill (no channel) must still pass at the bound.
		relayMaxChannels = 3
		defer func() { relayMaxChannels = max }()
		in, _ := startSandbox(t, n, gvisorTemplate)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		pr, pw := io.Pipe()
		defer pw.Close()
		out := &wait.Buffer{}
		done := make(chan error, 1)
		go func() {
			// Three channels: stdin, stdout, stderr.
			_, err := in.Exec(ctx, ExecRequest{Command: "echo ready; exec sleep 600", Stdin: pr, Stdout: out, Stderr: io.Discard})
			done <- err
		}()
		out.WaitFor(t, 10*time.Second, "ready")
		_, err := in.Exec(context.Background(), ExecRequest{Command: "true", Stdout: io.Discard})
		if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "command streams open") {
			t.Fatalf("a command past the bound: %v", err)
		}
		endStalled(t, cancel, nil, done)
		// Its channels end with it: commands run again.
		if err := wait.For(20*time.Second, func() error {
			_, err := in.Exec(context.Background(), ExecRequest{Command: "true", Stdout: io.Discard})
			return err
		}); err != nil {
			t.Fatalf("after the command holding the channels ended: %v", err)
		}
	})
}
