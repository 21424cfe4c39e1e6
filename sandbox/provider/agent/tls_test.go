package agent

import (
	"crypto/tls"
	"errors"
	"io"
	"testing"
)

// TestClientTLSResumesAndPinsResumedSessions: the broker's TLS to a sandbox's agent resumes its
// sessions (a connection after the first skips the certificate's signature), and the pin holds on
// a resumed session too: crypto/tls skips VerifyPeerCertificate when it resumes, so a session in
// the cache that is not of the pinned agent (a cache shared by mistake, or an impostor able to
// resume, which the cache of another sandbox's config hands a ticket to) must still be refused.
func TestClientTLSResumesAndPinsResumedSessions(t *testing.T) {
	cert, key, err := NewCredentials()
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ServerTLS(cert, key)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srv)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				// The agent's greeting: the client reads it, and with it the session ticket.
				if c.(*tls.Conn).Handshake() == nil {
					c.Write([]byte("hi"))
					io.Copy(io.Discard, c)
				}
			}()
		}
	}()
	dial := func(cfg *tls.Config) (tls.ConnectionState, error) {
		t.Helper()
		c, err := tls.Dial("tcp", ln.Addr().String(), cfg)
		if err != nil {
			return tls.ConnectionState{}, err
		}
		defer c.Close()
		buf := make([]byte, 2)
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatal(err)
		}
		return c.ConnectionState(), nil
	}

	pinned, err := ClientTLS(cert)
	if err != nil {
		t.Fatal(err)
	}
	if pinned.ClientSessionCache == nil {
		t.Fatal("ClientTLS has no session cache: every connection pays a full handshake")
	}
	if st, err := dial(pinned); err != nil || st.DidResume {
		t.Fatalf("first connection: %v, resumed %v", err, st.DidResume)
	}
	if st, err := dial(pinned); err != nil || !st.DidResume {
		t.Fatalf("second connection: %v, resumed %v (want a resumed session)", err, st.DidResume)
	}

	// Another sandbox's pin, handed this sandbox's sessions: it must not take this agent for its own.
	other, _, err := NewCredentials()
	if err != nil {
		t.Fatal(err)
	}
	wrong, err := ClientTLS(other)
	if err != nil {
		t.Fatal(err)
	}
	wrong.ClientSessionCache = pinned.ClientSessionCache
	if st, err := dial(wrong); !errors.Is(err, ErrNotPinned) {
		t.Fatalf("a resumable session of another certificate than the pinned one: %v, resumed %v (want ErrNotPinned)", err, st.DidResume)
	}
	// And a full handshake with it is refused as ever.
	wrong.ClientSessionCache = nil
	if _, err := dial(wrong); !errors.Is(err, ErrNotPinned) {
		t.Fatalf("a full handshake with another certificate than the pinned one: %v (want ErrNotPinned)", err)
	}
}
