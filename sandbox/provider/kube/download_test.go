package kube

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// fakeAgent serves TLS with cert and key on loopback and hands each connection to serve (which
// speaks as much of the agent protocol as its test needs), closing it after; it answers the address.
func fakeAgent(t *testing.T, cert, key []byte, serve func(nc net.Conn)) string {
	t.Helper()
	srvTLS, err := agent.ServerTLS(cert, key)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	// Wrapped before the accept loop starts: wrapping it after raced the loop's read of ln, and
	// could let the loop accept in clear.
	tln := tls.NewListener(ln, srvTLS)
	go func() {
		for {
			nc, err := tln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer nc.Close()
				serve(nc)
			}()
		}
	}()
	return tln.Addr().String()
}

// sizelessAgent serves the agent protocol (TLS, the secret's handshake) on loopback, and answers
// every open as an agent that does not say the file's size would: a started frame with no info,
// then the file's bytes.
func sizelessAgent(t *testing.T, secret []byte, content string) (addr string, pin *tls.Config) {
	t.Helper()
	cert, key, pin := testCredentials(t)
	return fakeAgent(t, cert, key, func(nc net.Conn) {
		challenge := bytes.Repeat([]byte{7}, agent.ChallengeSize)
		nc.Write(challenge)
		hs := make([]byte, 2*agent.ChallengeSize)
		if _, err := io.ReadFull(nc, hs); err != nil {
			return
		}
		nc.Write(agent.Proof(secret, hs[agent.ChallengeSize:]))
		typ, _, err := agent.ReadFrame(nc, nil)
		if err != nil || typ != agent.FrameRequest {
			return
		}
		agent.WriteJSON(nc, agent.FrameStarted, agent.Started{})
		agent.WriteFrame(nc, agent.FrameData, []byte(content))
		agent.WriteJSON(nc, agent.FrameResult, agent.Result{})
		io.Copy(io.Discard, nc)
	}), pin
}

// A download stops at the size the agent gives when it opens the file (so that a file growing
// meanwhile cannot make it endless): an agent that gives none is an error that says so, never an
// empty file downloaded with success.
func TestDownloadWithoutASizeIsAnError(t *testing.T) {
	secret := []byte("the-pods-secret-0123456789")
	addr, pin := sizelessAgent(t, secret, "the file's bytes")
	in := &instance{name: "test", done: make(chan struct{})}
	in.client = &agentClient{addr: addr, secret: secret, tls: pin, gone: in.goneErr}
	t.Cleanup(in.client.close)
	rc, info, err := agentFiles{a: in.client}.OpenRead("/workspace/f.txt")
	if err == nil {
		rc.Close()
		t.Fatalf("an open without a size: %+v, no error", info)
	}
	if !strings.Contains(err.Error(), "size") {
		t.Errorf("the error %q does not say the size is missing", err)
	}
}
