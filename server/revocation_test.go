package server_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// twoBrokers starts two brokers on one Redis that share a signing keyring, so that each verifies the
// other's tokens, as brokers behind one load balancer do.
func twoBrokers(t *testing.T) (*servertest.Broker, *servertest.Broker) {
	t.Helper()
	keys := filepath.Join(t.TempDir(), "signing")
	b1 := servertest.New(t, servertest.Options{Provider: "dir", SigningKeys: keys})
	b2 := servertest.New(t, servertest.Options{Provider: "dir", Redis: b1.Redis, Node: "node-2", SigningKeys: keys})
	return b1, b2
}

// keyClient makes a second API key in b's org and a client of b that uses it.
func keyClient(t *testing.T, b *servertest.Broker) (*client.Client, string) {
	t.Helper()
	c := b.NewClient(b.Org)
	k, err := b.Store.Authenticate(t.Context(), c.APIKey())
	if err != nil {
		t.Fatal(err)
	}
	return c, k.ID
}

// clientOn is a client of broker b with the API key of c.
func clientOn(t *testing.T, b *servertest.Broker, c *client.Client) *client.Client {
	t.Helper()
	out, err := client.New(b.URL, c.APIKey())
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Revoking an API key ends every delegation token it minted, at once and on every broker: open
// dataplane connections close, a new dial is refused and introspection on either broker says
// inactive. Tokens minted by another key of the org are untouched.
func TestAPIKeyRevocationEndsItsTokens(t *testing.T) {
	t.Parallel()
	b1, b2 := twoBrokers(t)
	laptop, laptopID := keyClient(t, b1)
	res, err := laptop.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "minted"})
	if err != nil {
		t.Fatal(err)
	}
	id := res.Sandbox.ID
	m, err := laptop.Delegate(t.Context(), id, protocol.MintRequest{Scopes: []string{"fs:read", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	other, err := b1.Client.Delegate(t.Context(), id, protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, m.Sandbox.DataplaneURL, m.Token)
	c.sendJSON(protocol.Request{ID: 1, Op: "exec", Args: map[string]any{"command": "sleep 30"}})
	c.ping()
	closed := closeWatch(c)

	start := time.Now()
	// The revocation goes through the other broker's store, as `broker keys revoke` does.
	if _, err := b2.Store.RevokeAPIKey(context.Background(), laptopID, time.Now()); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-closed:
		if took := got.at.Sub(start); took > time.Second {
			t.Errorf("closed %s after the key's revocation, want within 1s", took)
		}
		if got.code != protocol.CloseCredentialEnded || got.reason != protocol.CodeTokenRevoked {
			t.Errorf("close %d %q (%v), want %d %s", got.code, got.reason, got.err, protocol.CloseCredentialEnded, protocol.CodeTokenRevoked)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the token's connection is still open 5s after its key was revoked")
	}
	status, eb := dialStatus(t, m.Sandbox.DataplaneURL, authHeader(m.Token), []string{protocol.Subprotocol})
	if status != 401 || eb.Error.Code != protocol.CodeTokenRevoked {
		t.Errorf("redial with a token of a revoked key: %d %+v, want 401 token_revoked", status, eb)
	}
	for i, b := range []*servertest.Broker{b1, b2} {
		in, err := clientOn(t, b, b1.Client).Introspect(t.Context(), m.Token)
		if err != nil {
			t.Fatal(err)
		}
		if in.Active || in.Reason != protocol.CodeTokenRevoked {
			t.Errorf("broker %d introspects a token of a revoked key as %+v, want inactive, token_revoked", i+1, in)
		}
		in, err = clientOn(t, b, b1.Client).Introspect(t.Context(), other.Token)
		if err != nil {
			t.Fatal(err)
		}
		if !in.Active {
			t.Errorf("broker %d: a token of another key of the org is %+v, want active", i+1, in)
		}
	}
	list, err := b1.Client.ListDelegations(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range list.Items {
		if want := d.JTI == m.JTI; d.Revoked != want {
			t.Errorf("listed token %s (issued by %s) revoked=%v, want %v", d.JTI, d.IssuedBy, d.Revoked, want)
		}
	}
	assertAlive(t, b1, m.Sandbox.DataplaneURL, other.Token)
}
