package server

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// heldConn holds back the answer to an HGETALL of a key's record while its gate is set: the read
// has happened in Redis, its answer is on the way.
type heldConn struct {
	net.Conn
	gate    chan struct{} // closed to let the answer through
	reading chan struct{} // closed once the held read started
	armed   *atomic.Bool  // only the first lookup is held
	held    bool
}

func (c *heldConn) Write(p []byte) (int, error) {
	if bytes.Contains(bytes.ToLower(p), []byte("hgetall")) && c.armed.CompareAndSwap(true, false) {
		c.held = true
	}
	return c.Conn.Write(p)
}

func (c *heldConn) Read(p []byte) (int, error) {
	if c.held {
		c.held = false
		close(c.reading)
		<-c.gate
	}
	return c.Conn.Read(p)
}

// TestKeyCacheKeepsNoKeyRevokedDuringItsRead: an owner request whose key lookup read Redis just
// before the key's revocation, and got its answer just after this broker evicted the key, must not
// put the key back in the cache: the revoking broker would then take the revoked key for 2 s.
func TestKeyCacheKeepsNoKeyRevokedDuringItsRead(t *testing.T) {
	srv := redistest.Start(t)
	admin := store.New(srv.Client(t))
	t.Cleanup(admin.Close)
	ctx := t.Context()
	plain, key, err := admin.CreateAPIKey(ctx, "acme", "dev", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	gate, reading := make(chan struct{}), make(chan struct{})
	var armed atomic.Bool
	armed.Store(true)
	c := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{srv.Addr}, MaxRetries: -1,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			nc, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &heldConn{Conn: nc, gate: gate, reading: reading, armed: &armed}, nil
		}})
	t.Cleanup(func() { c.Close() })
	st := store.New(c)
	t.Cleanup(st.Close)
	k := newKeyCache(st)

	done := make(chan error, 1)
	go func() {
		_, err := k.authenticate(context.Background(), plain)
		done <- err
	}()
	<-reading // Redis has answered "valid"; the answer is held
	if _, err := admin.RevokeAPIKey(ctx, key.ID, time.Now()); err != nil {
		t.Fatal(err)
	}
	k.evict(key.ID) // the revocation's announcement, applied here
	close(gate)
	if err := <-done; err != nil {
		t.Fatalf("the lookup that read before the revocation: %v", err)
	}
	if _, err := k.authenticate(ctx, plain); !errors.Is(err, store.ErrBadKey) {
		t.Fatalf("the revoked key after its eviction: %v, want it refused", err)
	}
}
