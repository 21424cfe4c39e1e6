package kube_test

import (
	"context"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/kube"
	"github.com/sbxbroker/broker/sandbox/provider/kube/kubetest"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// term collects a shell's screen.
type term struct {
	mu   sync.Mutex
	b    strings.Builder
	hold chan struct{} // when set, writes block until it is closed: a client that stopped reading
}

func (s *term) Write(p []byte) (int, error) {
	s.mu.Lock()
	s.b.Write(p)
	hold := s.hold
	s.mu.Unlock()
	if hold != nil {
		<-hold
	}
	return len(p), nil
}

func (s *term) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (s *term) waitFor(t *testing.T, text string) {
	t.Helper()
	wait.Eventually(t, 20*time.Second, func() bool { return strings.Contains(s.String(), text) },
		"%q on the pod's terminal; it shows %q", text, s.String())
}

var pidIs = regexp.MustCompile(`pid=(\d+)`)

// TestShellInAPod: the dataplane's shell op on a pod sandbox, through the broker's runtime handle
// and the pod's agent over the pod network, unchanged above the handle: the login shell on a
// terminal of the pod's devpts, sized as asked, resized (stty size sees it), a typed command's
// output, the exit code. Then the hostile cases on the real pod: a client that stops reading a
// terminal that floods (the program blocks, as on any terminal), and a connection cut mid-session
// (the session's processes in the pod end, its background job included).
func TestShellInAPod(t *testing.T) {
	c := kube.SharedCluster(t)
	ctx := t.Context()
	p, err := kube.New(ctx, kube.Config{
		Client: c.Client, Namespace: "default", Broker: "node-shell", Image: kubetest.SandboxImage,
		PullPolicy: corev1.PullNever, StorageClass: kubetest.StorageClass,
	})
	if err != nil {
		t.Fatal(err)
	}
	b := servertest.New(t, servertest.Options{ProviderImpl: p, Node: "node-shell",
		Templates: map[string]provider.Template{"default": {Name: "default"}}})
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "shell-box"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Client.DeleteSandbox(context.Background(), "shell-box") })
	dial := func() *backend.Remote {
		t.Helper()
		m, err := b.Client.Delegate(ctx, "shell-box", protocol.MintRequest{Scopes: []string{"exec"}})
		if err != nil {
			t.Fatal(err)
		}
		r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		return r
	}
	// inPod runs a command in the pod apart from the shell under test.
	inPod := func(cmd string) string {
		t.Helper()
		r := dial()
		defer r.Close()
		res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: cmd, Combined: true}})
		if err != nil || res.Output == nil {
			t.Fatalf("exec %q: %v %+v", cmd, err, res)
		}
		return *res.Output
	}
	end := func(sh *backend.Shell) (protocol.ExecResult, error) {
		t.Helper()
		select {
		case <-sh.Done():
		case <-time.After(30 * time.Second):
			t.Fatal("the shell did not end")
		}
		return sh.Wait()
	}

	r := dial()
	out := &term{}
	sh, err := r.Shell(ctx, backend.ShellRequest{ShellArgs: protocol.ShellArgs{Rows: 30, Cols: 90}, Output: out})
	if err != nil {
		t.Fatal(err)
	}
	sh.Write([]byte("tty; stty size; echo answer=$((6*7))\n"))
	out.waitFor(t, "30 90\r\n")
	out.waitFor(t, "answer=42\r\n")
	if !strings.Contains(out.String(), "/dev/pts/") {
		t.Errorf("the shell's tty: %q", out.String())
	}
	if err := sh.Resize(50, 120); err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, 20*time.Second, func() bool {
		if strings.Contains(out.String(), "50 120") {
			return true
		}
		sh.Write([]byte("stty size\n")) // a keystroke may overtake the resize sent ahead of it
		return false
	}, "stty size seeing the resize: %q", out)
	sh.Write([]byte("exit 4\n"))
	if res, err := end(sh); err != nil || res.ExitCode != 4 {
		t.Fatalf("exit 4: %+v %v", res, err)
	}

	// A client that stops reading a terminal that floods: yes blocks on the terminal (state S in
	// the pod) rather than anything piling up; the client's connection then goes, and with it the
	// session.
	r = dial()
	out = &term{}
	sh, err = r.Shell(ctx, backend.ShellRequest{ShellArgs: protocol.ShellArgs{Argv: []string{"sh", "-c", "echo pid=$$ ready; read x; exec yes"}}, Output: out})
	if err != nil {
		t.Fatal(err)
	}
	out.waitFor(t, "ready")
	yes := pidIs.FindStringSubmatch(out.String())[1]
	hold := make(chan struct{})
	out.mu.Lock()
	out.hold = hold
	out.mu.Unlock()
	sh.Write([]byte("\n"))
	wait.Eventually(t, 30*time.Second, func() bool {
		f := strings.Fields(inPod("cat /proc/" + yes + "/stat | sed 's/.*) //'"))
		return len(f) > 0 && f[0] == "S"
	}, "yes blocked on the terminal nobody reads")
	r.Close()
	close(hold)
	wait.Eventually(t, 20*time.Second, func() bool {
		return strings.TrimSpace(inPod("test -e /proc/"+yes+" && echo there || echo gone")) == "gone"
	}, "yes ending with its client's connection")

	// A connection cut mid-session ends the session, its job in a group of its own included.
	r = dial()
	out = &term{}
	sh, err = r.Shell(ctx, backend.ShellRequest{ShellArgs: protocol.ShellArgs{Argv: []string{"sh", "-c", "set -m; sleep 1000 & echo pid=$! ready; wait"}}, Output: out})
	if err != nil {
		t.Fatal(err)
	}
	out.waitFor(t, "ready")
	job := pidIs.FindStringSubmatch(out.String())[1]
	if got := strings.TrimSpace(inPod("test -e /proc/" + job + " && echo there")); got != "there" {
		t.Fatalf("the job %s is not running: %q", job, got)
	}
	r.Close()
	wait.Eventually(t, 20*time.Second, func() bool {
		return strings.TrimSpace(inPod("test -e /proc/"+job+" && echo there || echo gone")) == "gone"
	}, "the job ending with the cut session")
}
