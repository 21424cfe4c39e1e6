package kube

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
	"github.com/sbxbroker/broker/tests/wait"
)

// recordedClientHello is a TLS 1.3 ClientHello as a client sends it, to replay: an attacker need
// not compute anything to make the agent compute its key exchange and sign its handshake.
func recordedClientHello(t *testing.T) []byte {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan []byte, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- nil
			return
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		// The record's header says its length.
		h := make([]byte, 5)
		if _, err := io.ReadFull(c, h); err != nil {
			got <- nil
			return
		}
		body := make([]byte, int(h[3])<<8|int(h[4]))
		if _, err := io.ReadFull(c, body); err != nil {
			got <- nil
			return
		}
		got <- append(h, body...)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go tls.Client(c, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13}).Handshake()
	hello := <-got
	if hello == nil {
		t.Fatal("no ClientHello recorded")
	}
	return hello
}

// TestAgentHandshakeCostIsBoundedPerSource: each TLS handshake costs the agent a key exchange and
// an Ed25519 signature, and a replayed ClientHello costs its sender nothing, so another pod
// reaching the agent's port (a CNI that does not enforce the NetworkPolicy) could spend the
// sandbox's CPU limit on handshakes (about 5,000 a second here, unbounded). The agent takes only a
// bounded rate of handshakes from an address that never proved the secret, and none of that
// bound applies to an address that did (the broker's), whose exec goes on through the flood and
// whose own bursts are never refused.
func TestAgentHandshakeCostIsBoundedPerSource(t *testing.T) {
	in, _ := agentInstance(t, "the-pods-secret-0123456789")
	hello := recordedClientHello(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The broker (127.0.0.1) proves the secret once.
	if err := in.connect(ctx); err != nil {
		t.Fatal(err)
	}

	// Another pod (127.0.0.2) replays ClientHellos, counting the handshakes the agent answered
	// with its signed flight.
	var signed, refused atomic.Int64
	attempts := func() int64 { return signed.Load() + refused.Load() }
	var stop atomic.Bool
	var wg sync.WaitGroup
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	t0 := time.Now()
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 4096)
			for !stop.Load() {
				c, err := d.Dial("tcp", in.client.addr)
				if err != nil {
					continue
				}
				c.Write(hello)
				c.SetReadDeadline(time.Now().Add(2 * time.Second))
				// The server's flight (hello, certificate, its signature, finished) is several
				// hundred bytes; a refused handshake gets none of it.
				if n, _ := io.ReadAtLeast(c, buf, 200); n >= 200 {
					signed.Add(1)
				} else {
					refused.Add(1)
				}
				c.Close()
			}
		}()
	}
	wait.Eventually(t, 20*time.Second, func() bool { return attempts() >= 500 }, "the flood under way")
	var out bytes.Buffer
	res, err := in.Exec(ctx, provider.ExecRequest{Command: "echo through", Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "through\n" {
		t.Fatalf("the broker during a handshake flood: %v %+v %q", err, res, out.String())
	}
	wait.Eventually(t, 20*time.Second, func() bool { return attempts() >= 2000 }, "the flood going on")
	stop.Store(true)
	wg.Wait()
	took := time.Since(t0)
	t.Logf("%s of replayed ClientHellos from one address: %d handshakes signed, %d refused", took.Round(time.Millisecond), signed.Load(), refused.Load())
	if max := int64(agent.HandshakeBurst + agent.HandshakeRate*(took.Seconds()+1)); signed.Load() > max {
		t.Fatalf("the agent signed %d handshakes in %s for an address that never proved the secret, want at most %d", signed.Load(), took.Round(time.Millisecond), max)
	}

	// The broker's address is not held to that rate: a burst of its connections all go through.
	var wg2 sync.WaitGroup
	errs := make(chan error, 2*agent.HandshakeBurst)
	for range 2 * agent.HandshakeBurst {
		wg2.Add(1)
		go func() {
			defer wg2.Done()
			if _, err := in.Exec(ctx, provider.ExecRequest{Command: "true"}); err != nil {
				errs <- err
			}
		}()
	}
	wg2.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a burst of the broker's execs: %v", err)
	}
}
