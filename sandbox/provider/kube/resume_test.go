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
)

// TestImpostorRefusedAfterResumedSessions: the broker resumes its TLS sessions with a sandbox's
// agent (an exec after the first skips the full handshake), and whatever answers at the agent's
// address afterwards without the sandbox's key (another pod given the gone pod's IP) is still
// refused before a request leaves the broker, resumable sessions in the cache or not.
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

	// The agent goes; at its address, an agent with another key (and even the sandbox's secret).
	ln.Close()
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
