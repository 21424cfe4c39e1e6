package provider

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"strconv"
	"testing"
	"time"
)

// TestMemoryLimitEndsTheSandbox: a sandbox that reaches its memory limit in a way no command's death
// can undo ends with reason memory_limit, and its requests say so, rather than hang or fail with a
// generic error.
func TestMemoryLimitEndsTheSandbox(t *testing.T) {
	n := newNamespace(t, Config{})
	if ok, why := n.LimitsEnforced(); !ok {
		t.Fatalf("memory limits are not enforced on this host: %s", why)
	}
	ended := func(t *testing.T, in Instance) {
		t.Helper()
		select {
		case <-in.Done():
		case <-time.After(20 * time.Second):
			t.Fatal("the sandbox did not end")
		}
		if r := EndReason(in); r != ReasonMemoryLimit {
			t.Errorf("end reason %q, want %q", r, ReasonMemoryLimit)
		}
		_, err := in.Exec(context.Background(), ExecRequest{Command: "true"})
		if !errors.Is(err, ErrMemoryLimit) || !errors.Is(err, ErrStopped) {
			t.Errorf("exec after the end: %v, want ErrMemoryLimit", err)
		}
	}
	t.Run("tmpfs and shared memory fill it", func(t *testing.T) {
		t.Parallel()
		// /tmp and /dev/shm are sized (here larger than the template default, a quarter each):
		// their pages are charged to the limit and no OOM kill frees them, so once they fill it
		// every command is killed as it starts.
		in, _ := startSandbox(t, n, Template{Limits: Limits{MemoryBytes: 64 << 20}, Tmp: 48 << 20})
		var out bytes.Buffer
		res, err := in.Exec(context.Background(), ExecRequest{
			// Appended again and again: a writer the OOM killer takes early leaves the rest unfilled,
			// and a loaded run saw the sandbox left with room (so, rightly, not ended).
			Command: "for i in 1 2 3 4 5 6; do head -c 40M /dev/zero >> /dev/shm/a; head -c 40M /dev/zero >> /tmp/b; done 2>/dev/null; echo filled",
			Stdout:  &out, Timeout: 30 * time.Second})
		// It is killed (memory_limit), the sandbox ends under it first (ErrMemoryLimit), or, on a
		// fast machine, the shell outlives its killed child and answers before the watcher stops the
		// sandbox: whichever, the sandbox must then end for the memory limit (ended, below).
		if err != nil && !errors.Is(err, ErrMemoryLimit) {
			t.Errorf("the exec that filled it: %+v %v %q, want it ended for the memory limit", res, err, out.String())
		}
		ended(t, in)
	})
	t.Run("the OOM killer takes the init", func(t *testing.T) {
		t.Parallel()
		in, _ := startSandbox(t, n, Template{Limits: Limits{MemoryBytes: 64 << 20}, Tmp: 48 << 20})
		// The init is never the OOM killer's first choice from inside (TestInitWithstandsTenant);
		// made its likeliest victim from the host, it is taken when /dev/shm and /tmp fill the
		// limit: the writer is small, and what fills memory is no process's.
		// The command's processes must not share the init's score: they inherit it at fork, and
		// one of them taken first (a loaded run saw it) would spare the init. So the shell starts,
		// says so, and only once the init's score is raised is it told to fill the memory.
		inst := in.(*instance)
		stdinR, stdinW := io.Pipe()
		ready := make(chan struct{})
		out := writerFunc(func(p []byte) (int, error) {
			if bytes.Contains(p, []byte("ready")) {
				select {
				case <-ready:
				default:
					close(ready)
				}
			}
			return len(p), nil
		})
		done := make(chan error, 1)
		go func() {
			_, err := in.Exec(context.Background(), ExecRequest{
				Command: "echo ready; read go; head -c 40M /dev/zero > /dev/shm/a; head -c 40M /dev/zero > /tmp/b; sleep 30",
				Stdin:   stdinR, Stdout: out, Timeout: 30 * time.Second})
			done <- err
		}()
		select {
		case <-ready:
		case err := <-done:
			t.Fatalf("the exec ended before it was told to fill the memory: %v", err)
		}
		if err := os.WriteFile("/proc/"+strconv.Itoa(inst.initPid)+"/oom_score_adj", []byte("1000"), 0); err != nil {
			t.Fatal(err)
		}
		stdinW.Write([]byte("go\n"))
		if err := <-done; !errors.Is(err, ErrStopped) {
			t.Errorf("the exec in flight: %v, want the sandbox stopped", err)
		}
		stdinW.Close()
		ended(t, in)
	})
}

// writerFunc is a Writer made of a function.
type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
