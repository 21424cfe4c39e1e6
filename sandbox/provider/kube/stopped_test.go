package kube

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/tests/wait"
)

// agentHostPID is the host pid of the sbx-agent in the pod with uid: the test cluster's
// containers are host processes, in the pod's cgroup.
func agentHostPID(t *testing.T, uid string) int {
	t.Helper()
	var pid int
	wait.Eventually(t, 10*time.Second, func() bool {
		cgs, _ := filepath.Glob("/proc/[0-9]*/cgroup")
		for _, cg := range cgs {
			b, err := os.ReadFile(cg)
			if err != nil || !(bytes.Contains(b, []byte(uid)) || bytes.Contains(b, []byte(strings.ReplaceAll(uid, "-", "_")))) {
				continue
			}
			dir := filepath.Dir(cg)
			cmd, _ := os.ReadFile(dir + "/cmdline")
			if !bytes.Contains(cmd, []byte("sbx-agent")) {
				continue
			}
			if stat, _ := os.ReadFile(dir + "/stat"); len(stat) > 0 {
				pid = atoiPrefix(stat)
				return pid > 0
			}
		}
		return false
	}, "the host pid of the agent in pod %s", uid)
	return pid
}

func atoiPrefix(b []byte) int {
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			break
		}
		n = n*10 + int(c-'0')
	}
	return n
}

// zeros is an endless upload: what an agent that stopped reading never takes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// TestStoppedAgentHoldsNothing: the agent runs beside the tenant's code, which can stop it
// (SIGSTOP). Every file operation on it, pooled connections and streams alike, ends with a clear
// error within its bound instead of waiting for TCP keepalive; the connections and goroutines
// they held are released; the agent serves again once it runs again; and with no bound in sight,
// the pod's end ends what still waits on it.
func TestStoppedAgentHoldsNothing(t *testing.T) {
	p, c := newProvider(t)
	ctx := context.Background()
	spec := provider.Spec{ID: protocol.NewSandboxID(), Template: provider.Template{Name: "t"}}
	defer p.Destroy(context.Background(), spec)
	if err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	pin, err := p.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	in := pin.(*instance)
	f := files(t, in)
	defer func(op, idle time.Duration) { agentOpTimeout, agentIdleTimeout = op, idle }(agentOpTimeout, agentIdleTimeout)
	agentOpTimeout, agentIdleTimeout = 3*time.Second, 3*time.Second

	if _, err := f.Write(protocol.WriteArgs{Path: "/workspace/a", Content: "a"}); err != nil {
		t.Fatal(err)
	}
	// A file larger than the socket buffers between the broker and the agent: a download of it
	// cannot end while the agent is stopped.
	big, err := f.Create("/workspace/big", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := big.Write(make([]byte, 32<<20)); err != nil {
		t.Fatal(err)
	}
	if _, err := big.Commit(); err != nil {
		t.Fatal(err)
	}
	// Fill the pool: eight file operations at once leave eight idle connections.
	var wg sync.WaitGroup
	for range maxIdle {
		wg.Go(func() { f.Stat("/workspace/a") })
	}
	wg.Wait()
	up, err := f.Create("/workspace/up", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := up.Write([]byte("begun")); err != nil {
		t.Fatal(err)
	}
	settle := func() (int, int) {
		runtime.GC()
		return runtime.NumGoroutine(), openFDs()
	}
	g0, fd0 := settle()
	in.client.mu.Lock()
	pooled := len(in.client.idle)
	in.client.mu.Unlock()
	t.Logf("before the stop: %d goroutines, %d descriptors, %d pooled connections", g0, fd0, pooled)

	pid := agentHostPID(t, in.uid)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if stopped {
			syscall.Kill(pid, syscall.SIGCONT)
		}
	}()
	stopped = true
	wait.Eventually(t, 10*time.Second, func() bool { return procState(pid) == 'T' }, "the agent (host pid %d) stopped", pid)

	type outcome struct {
		what string
		err  error
		took time.Duration
	}
	ops := map[string]func() error{
		"upload begun before the stop": func() error { _, err := up.Write(make([]byte, 64<<20)); return err },
		"write":                        func() error { _, err := f.Write(protocol.WriteArgs{Path: "/workspace/b", Content: "b"}); return err },
		"edit": func() error {
			_, err := f.EditContext(t.Context(), protocol.EditArgs{Path: "/workspace/b", Old: "b", New: "c"})
			return err
		},
		"delete": func() error { return f.Delete(protocol.DeleteArgs{Path: "/workspace/b"}) },
		"mkdir":  func() error { return f.Mkdir(protocol.MkdirArgs{Path: "/workspace/d"}) },
		"move":   func() error { return f.Move(protocol.MoveArgs{From: "/workspace/b", To: "/workspace/c"}) },
		"list":   func() error { _, err := f.ListContext(context.Background(), "/workspace"); return err },
		"open": func() error {
			r, _, err := f.OpenRead("/workspace/big")
			if err == nil {
				_, err = io.Copy(io.Discard, r)
				r.Close()
			}
			return err
		},
		"create": func() error {
			u, err := f.Create("/workspace/e", "")
			if err == nil {
				_, err = u.Write(make([]byte, 64<<20))
				u.Abort()
			}
			return err
		},
		"tar in":  func() error { _, err := f.Extract(context.Background(), "/workspace", zeros{}); return err },
		"tar out": func() error { _, err := f.Archive(context.Background(), "/workspace", io.Discard); return err },
	}
	for i := range maxIdle {
		ops["stat "+string(rune('0'+i))] = func() error { _, err := f.Stat("/workspace/a"); return err }
	}
	out := make(chan outcome, len(ops))
	t0 := time.Now()
	for what, op := range ops {
		go func() {
			t1 := time.Now()
			err := op()
			out <- outcome{what, err, time.Since(t1)}
		}()
	}
	// An op that dials waits for the agent's TLS handshake, bounded at 10 s by the dial, and a
	// streamed one may first wait for the spare being dialed (refill), as long; the rest wait for
	// their bound (3 s here).
	const within = 2*10*time.Second + 3*time.Second + 5*time.Second
	for range ops {
		select {
		case o := <-out:
			t.Logf("%s on a stopped agent: %s: %v", o.what, o.took.Round(time.Millisecond), o.err)
			if o.err == nil {
				t.Errorf("%s on a stopped agent succeeded", o.what)
			} else if !errors.Is(o.err, context.DeadlineExceeded) && !errors.Is(o.err, os.ErrDeadlineExceeded) {
				t.Errorf("%s on a stopped agent: %v, want a timeout", o.what, o.err)
			}
		case <-time.After(time.Until(t0.Add(within))):
			t.Fatalf("file operations on a stopped agent still wait %s after they began", time.Since(t0).Round(time.Second))
		}
	}
	up.Abort()
	// What the operations held goes: their goroutines, their connections (the pool's included).
	wait.Eventually(t, 20*time.Second, func() bool {
		g, fd := settle()
		return g <= g0 && fd < fd0
	}, "the goroutines and descriptors held on a stopped agent released")
	g1, fd1 := settle()
	in.client.mu.Lock()
	pooled = len(in.client.idle)
	in.client.mu.Unlock()
	t.Logf("after: %d goroutines, %d descriptors, %d pooled connections", g1, fd1, pooled)

	// Running again, it serves again.
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	stopped = false
	if _, err := f.Write(protocol.WriteArgs{Path: "/workspace/b", Content: "again"}); err != nil {
		t.Fatalf("a write once the agent runs again: %v", err)
	}
	if got, err := f.ReadContext(ctx, protocol.ReadArgs{Path: "/workspace/b"}); err != nil || got.Content != "again" {
		t.Fatalf("a read once the agent runs again: %q, %v", got.Content, err)
	}

	// With no bound in sight (a caller's own long deadline, say), the pod's end ends the wait: of
	// a download begun while the agent ran, and of a stat begun after it stopped.
	agentOpTimeout, agentIdleTimeout = time.Hour, time.Hour
	r, _, err := f.OpenRead("/workspace/big")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped = true
	wait.Eventually(t, 10*time.Second, func() bool { return procState(pid) == 'T' }, "the agent stopped again")
	ended := make(chan error, 2)
	go func() { _, err := f.Stat("/workspace/a"); ended <- err }()
	go func() {
		// A stopped agent sends at most what its socket buffers held: the read then waits.
		_, err := io.Copy(io.Discard, r)
		if err == nil {
			err = errors.New("the download ended with all its data")
		}
		ended <- err
	}()
	select {
	case err := <-ended:
		t.Fatalf("an operation on a stopped agent ended before its pod did: %v", err)
	default:
	}
	t0 = time.Now()
	grace := int64(0)
	if err := c.Client.CoreV1().Pods("default").Delete(ctx, in.name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		select {
		case err := <-ended:
			if !errors.Is(err, provider.ErrStopped) {
				t.Fatalf("an operation on a stopped agent whose pod ended: %v, want ErrStopped", err)
			}
			t.Logf("an operation on a stopped agent ended %s after its pod's delete: %v", time.Since(t0).Round(time.Millisecond), err)
		case <-time.After(60 * time.Second):
			t.Fatal("an operation on a stopped agent still waits a minute after its pod's delete")
		}
	}
	stopped = false
}
