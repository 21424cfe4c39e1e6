package server_test

import (
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// The broker that revokes a token ends its own connections of it at once, whatever becomes of the
// announcement: here Redis refuses the PUBLISH (an ACL; as when its answer to the revocation's write
// came and the connection broke before the announcement), so no broker hears of it. Before, the
// revoking broker itself kept serving the revoked token on its open connections until their 30 s
// re-check, though it had just written the revocation.
func TestARevocationWhoseAnnouncementFailsEndsTheRevokingBrokersConnections(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	ctx := t.Context()
	res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "unannounced"})
	if err != nil {
		t.Fatal(err)
	}
	for _, all := range []bool{false, true} {
		m, err := b.Client.Delegate(ctx, res.Sandbox.ID, protocol.MintRequest{Scopes: []string{"fs:read"}})
		if err != nil {
			t.Fatal(err)
		}
		closed := closeWatch(dialRaw(t, m.Sandbox.DataplaneURL, m.Token))
		if err := b.RDB.Do(ctx, "ACL", "SETUSER", "default", "-publish").Err(); err != nil {
			t.Fatal(err)
		}
		if all {
			_, err = b.Client.RevokeAll(ctx, res.Sandbox.ID)
		} else {
			_, err = b.Client.Revoke(ctx, res.Sandbox.ID, m.JTI)
		}
		if err != nil {
			t.Fatal(err)
		}
		revoked := time.Now()
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatalf("revoke all %v: the revoking broker's connection of the token is open 5 s after the revocation", all)
		}
		t.Logf("revoke all %v: closed %s after the revocation", all, time.Since(revoked).Round(time.Millisecond))
		if err := b.RDB.Do(ctx, "ACL", "SETUSER", "default", "+publish").Err(); err != nil {
			t.Fatal(err)
		}
	}
}
