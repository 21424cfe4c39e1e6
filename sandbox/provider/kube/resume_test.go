package kube

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
	"github.com/sbxbroker/broker/tests/wait"
)

// TestImpostorRefusedAfterResumedSessions: the broker resumes its TLS sessions with a sandbox's
// agent (an exec after the first skips the full handshake) and runs an exec on a spare connection
// dialed after the previous one; whatever answers at the agent's address afterwards without the
// sandbox's key (another pod given the gone pod's IP) is still refused before a request leaves the
// broker, resumable sessions in the cache or not.
func TestImpostorRefusedAfterResumedSessions(t *testing.T) {
	const secret = "the-pods-secret-0123456789"
	cert, key, pin := testCredentials(t)
	serve := func(addr string, cert, key []byte) (string, net.Listener) {
		t.Helper()
		dir := t.TempDir()
		srv, err := agent.NewServer(agent.Config{Secret: []byte(secret), Workspace: dir,
			Env: []string{"PATH=/usr/bin:/bin"}, Cert: cert, Key: key})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		go srv.Serve(ln)
		return dir, ln
	}
	_, ln := serve("127.0.0.1:0", cert, key)
	addr := ln.Addr().String()
	in := &instance{name: "test", done: make(chan struct{})}
	in.client = &agentClient{addr: addr, secret: []byte(secret), tls: pin, gone: in.goneErr}
	defer in.client.close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for range 3 {
		res, err := in.Exec(ctx, provider.ExecRequest{Command: "true"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec on the sandbox's agent: %v %+v", err, res)
		}
	}
	if _, ok := pin.ClientSessionCache.Get(addr); !ok {
		t.Fatal("no session of the agent in the cache after three execs: they do not resume")
	}

	// An exec leaves a spare connection dialed for the next: with the listener closed, the next
	// exec still runs, on the spare.
	spare := func() bool {
		in.client.mu.Lock()
		defer in.client.mu.Unlock()
		return in.client.refilled == nil && len(in.client.idle) > 0
	}
	wait.Eventually(t, 10*time.Second, spare, "a spare connection after an exec")
	ln.Close()
	if res, err := in.Exec(ctx, provider.ExecRequest{Command: "true"}); err != nil || res.ExitCode != 0 {
		t.Fatalf("exec on the spare connection, the agent's listener closed: %v %+v", err, res)
	}

	// The agent goes, its connections with it; at its address, an agent with another key (and
	// even the sandbox's secret).
	wait.Until(10*time.Second, func() bool { // the refill after the last exec fails or lands
		in.client.mu.Lock()
		defer in.client.mu.Unlock()
		return in.client.refilled == nil
	})
	in.client.mu.Lock()
	for _, c := range in.client.idle {
		c.Close()
	}
	in.client.idle = nil
	in.client.mu.Unlock()
	otherCert, otherKey, _ := testCredentials(t)
	dir, ln2 := serve(addr, otherCert, otherKey)
	defer ln2.Close()
	_, err := in.Exec(ctx, provider.ExecRequest{Command: "touch /workspace/ran"})
	if err == nil || !strings.Contains(err.Error(), "did not present the sandbox's agent certificate") {
		t.Fatalf("exec at an impostor after resumed sessions: %v (want the pin's refusal)", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "ran")); !os.IsNotExist(err) {
		t.Fatalf("the impostor ran the command: %v", err)
	}
}
