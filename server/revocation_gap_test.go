package server_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
)

// Revocations announced while a broker's subscription was down are lost to it; when it subscribes
// again it forgets every credential it cached and re-checks every open connection at once, so a
// connection of a credential revoked in the gap ends within a second or so of the reconnect. Before,
// it stayed open until its periodic re-check, 30 s later. The subscription is cut for real (CLIENT
// KILL on the Redis server) and kept down (the broker cannot dial Redis) while the revocations are
// written, as another broker would, with their announcements gone to nobody. The broker's clock
// stands still, and the owner connection's key is read afresh at its upgrade, so that every
// connection here was admitted on a fresh answer: none is re-confirmed for having been admitted
// on a cached one (TestConnectionAdmittedOnACachedAnswerIsReconfirmed), which would end it too.
func TestRevocationsMissedWhileUnsubscribedEndConnectionsOnResubscribe(t *testing.T) {
	var refuse atomic.Bool
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		if refuse.Load() {
			return nil, errors.New("test: Redis unreachable")
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Provider: "dir", RedisDialer: dial, Now: clock.Now})
	ctx := t.Context()
	owner, ownerKey := keyClient(t, b)
	dialer, dialerKey := keyClient(t, b) // used for its connection only
	res, err := owner.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "gap"})
	if err != nil {
		t.Fatal(err)
	}
	denied, err := owner.Delegate(ctx, res.Sandbox.ID, protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	byKey, err := owner.Delegate(ctx, res.Sandbox.ID, protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	url := res.Sandbox.DataplaneURL
	watch := func(cred string) <-chan closeInfo {
		c := dialRaw(t, url, cred)
		c.ws.SetReadDeadline(time.Time{}) // only the broker ends it
		return closeWatch(c)
	}
	conns := map[string]<-chan closeInfo{
		"a token denied":                watch(denied.Token),
		"a token of a revoked API key":  watch(byKey.Token),
		"an owner of a revoked API key": watch(dialer.APIKey()),
	}
	// An owner's event stream of the revoked key ends as well.
	req, _ := http.NewRequestWithContext(ctx, "GET", b.URL+"/v1/events", nil)
	req.Header.Set("Authorization", "Bearer "+owner.APIKey())
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("event stream: %v %v", err, resp)
	}
	streamEnded := make(chan closeInfo, 1)
	go func() {
		defer resp.Body.Close()
		_, err := io.Copy(io.Discard, resp.Body)
		streamEnded <- closeInfo{at: time.Now(), err: err}
	}()
	// Another broker's view of the same Redis, which the cut does not touch.
	direct := b.Redis.Client(t)
	other := store.NewWithOptions(direct, store.Options{})
	defer other.Close()
	refuse.Store(true)
	killed, err := direct.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Int()
	if err != nil || killed == 0 {
		t.Fatalf("cutting the broker's subscriptions: %d cut, %v", killed, err)
	}
	if err := other.DenyToken(ctx, b.Org, denied.JTI, time.Hour); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{ownerKey, dialerKey} {
		if err := direct.HSet(ctx, store.APIKeyKey(id), "revoked", time.Now().UnixMilli()).Err(); err != nil {
			t.Fatal(err)
		}
	}
	conns["an event stream of a revoked API key"] = streamEnded
	for what, closed := range conns {
		select {
		case info := <-closed:
			t.Fatalf("%s: closed while the broker was cut from pub/sub (%v): the test did not test", what, info.err)
		default:
		}
	}
	refuse.Store(false)
	back := time.Now()
	for what, closed := range conns {
		select {
		case info := <-closed:
			if what != "an event stream of a revoked API key" && info.code != protocol.CloseCredentialEnded {
				t.Errorf("%s: closed with %d %q (%v), want %d", what, info.code, info.reason, info.err, protocol.CloseCredentialEnded)
			}
		case <-time.After(10*time.Second - time.Since(back)):
			t.Fatalf("%s: still open 10 s after the broker could subscribe again", what)
		}
	}
	t.Logf("every connection closed %s after Redis was reachable again", time.Since(back).Round(time.Millisecond))
	// The cache forgot the revoked token too: a new upgrade with it is refused at once.
	if code := upgradeCode(t, url, denied.Token); code != protocol.CodeTokenRevoked {
		t.Errorf("an upgrade with the token revoked in the gap: %q, want token_revoked", code)
	}
}
