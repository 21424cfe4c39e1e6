package server_test

import (
	"context"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

// upgradeCode dials url with token and answers "" when the upgrade is accepted, or the refusal's
// code.
func upgradeCode(t *testing.T, url, token string) string {
	t.Helper()
	status, eb := dialStatus(t, url, authHeader(token), []string{protocol.Subprotocol})
	if status == http.StatusSwitchingProtocols {
		return ""
	}
	if eb.Error.Code == "" {
		t.Fatalf("upgrade refused with %d and no error code", status)
	}
	return eb.Error.Code
}

// The upgrade reads a token's revocation state from Redis at most once per delegation.RecentTTL on
// a broker: a revocation written to Redis with no announcement (a broker that missed it while cut
// from pub/sub) still lets the token in until that bound has passed on the broker's clock, and not a
// moment longer. Before the cache, every upgrade read Redis, so the second dial here was refused.
func TestUpgradeReadsRevocationStateOncePerBound(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Provider: "dir", Now: clock.Now})
	ctx := t.Context()
	laptop, laptopID := keyClient(t, b)
	// Each case writes one kind of revocation straight into Redis, as another broker would, but
	// announces nothing.
	for _, tc := range []struct {
		name  string
		write func(org, id, jti string) error
	}{
		{"jti denied", func(org, _, jti string) error { return b.Store.DenyToken(ctx, org, jti, time.Hour) }},
		{"generation bumped", func(org, id, _ string) error { _, err := b.Store.BumpGen(ctx, org, id); return err }},
		{"minting key revoked", func(string, string, string) error {
			return b.RDB.HSet(ctx, store.APIKeyKey(laptopID), "revoked", clock.Now().UnixMilli()).Err()
		}},
	} {
		res, err := laptop.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: strings.ReplaceAll(tc.name, " ", "-")})
		if err != nil {
			t.Fatal(err)
		}
		m, err := laptop.Delegate(ctx, res.Sandbox.ID, protocol.MintRequest{Scopes: []string{"fs:read"}})
		if err != nil {
			t.Fatal(err)
		}
		url := m.Sandbox.DataplaneURL
		if code := upgradeCode(t, url, m.Token); code != "" {
			t.Fatalf("%s: first upgrade refused: %s", tc.name, code)
		}
		if err := tc.write(b.Org, res.Sandbox.ID, m.JTI); err != nil {
			t.Fatal(err)
		}
		clock.Advance(delegation.RecentTTL - time.Millisecond)
		if code := upgradeCode(t, url, m.Token); code != "" {
			t.Errorf("%s, unannounced: an upgrade within %s of the last read was refused (%s): it read Redis again", tc.name, delegation.RecentTTL, code)
		}
		clock.Advance(time.Millisecond)
		if code := upgradeCode(t, url, m.Token); code != protocol.CodeTokenRevoked {
			t.Errorf("%s, unannounced: an upgrade %s after the last read got %q, want token_revoked", tc.name, delegation.RecentTTL, code)
		}
	}
}

// Revocations the brokers announce reach a token's cached state at once on the broker that made
// them and within the announcement's delay on every other, whatever the cache's bound: the clock is
// frozen here, so only an eviction can make a refusal. Stopping or deleting the sandbox refuses the
// token at once everywhere (the upgrade reads the sandbox's record every time).
func TestUpgradeCacheFollowsRevocations(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	keys := filepath.Join(t.TempDir(), "signing")
	b1 := servertest.New(t, servertest.Options{Provider: "dir", SigningKeys: keys, Now: clock.Now})
	b2 := servertest.New(t, servertest.Options{Provider: "dir", Redis: b1.Redis, Node: "node-2", SigningKeys: keys, Now: clock.Now})
	ctx := t.Context()
	laptop, laptopID := keyClient(t, b1)
	for _, tc := range []struct {
		name string
		// via is the broker whose API (or store, for a key) revokes; the other learns by announcement.
		via    *servertest.Broker
		revoke func(id, jti string) error
		// want is the refusal's code; announced says whether the other broker learns it by
		// announcement (true) or at once, from the sandbox's record (false).
		want      string
		announced bool
	}{
		{"revoke one", b1, func(id, jti string) error { _, err := clientOn(t, b1, laptop).Revoke(ctx, id, jti); return err }, protocol.CodeTokenRevoked, true},
		{"revoke all", b2, func(id, _ string) error { _, err := clientOn(t, b2, laptop).RevokeAll(ctx, id); return err }, protocol.CodeTokenRevoked, true},
		{"stop", b2, func(id, _ string) error { _, err := clientOn(t, b2, laptop).StopSandbox(ctx, id); return err }, protocol.CodeNotRunning, false},
		{"delete", b1, func(id, _ string) error { _, err := clientOn(t, b1, laptop).DeleteSandbox(ctx, id); return err }, protocol.CodeTokenRevoked, false},
		// Last: it ends every token of the key. `broker keys revoke` writes through the store and
		// announces; no broker made it, so both learn by announcement.
		{"revoke the minting key", nil, func(string, string) error { _, err := b1.Store.RevokeAPIKey(ctx, laptopID, time.Now()); return err }, protocol.CodeTokenRevoked, true},
	} {
		// The sandbox is hosted by b1: b2 refuses its upgrades with wrong_node, after the token's
		// checks, so its answer still shows whether it holds the token as live.
		res, err := laptop.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: strings.ReplaceAll(tc.name, " ", "-")})
		if err != nil {
			t.Fatal(err)
		}
		id := res.Sandbox.ID
		m, err := laptop.Delegate(ctx, id, protocol.MintRequest{Scopes: []string{"fs:read"}})
		if err != nil {
			t.Fatal(err)
		}
		on := map[*servertest.Broker]string{b1: m.Sandbox.DataplaneURL, b2: strings.Replace(m.Sandbox.DataplaneURL, strings.TrimPrefix(b1.URL, "http"), strings.TrimPrefix(b2.URL, "http"), 1)}
		live := map[*servertest.Broker]string{b1: "", b2: protocol.CodeWrongNode}
		for br, url := range on {
			if code := upgradeCode(t, url, m.Token); code != live[br] {
				t.Fatalf("%s: before: %q on %s, want %q", tc.name, code, url, live[br])
			}
		}
		if err := tc.revoke(id, m.JTI); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		for br, url := range on {
			if br == tc.via || !tc.announced {
				if code := upgradeCode(t, url, m.Token); code != tc.want {
					t.Errorf("%s: at once on %s: %q, want %q", tc.name, br.URL, code, tc.want)
				}
				continue
			}
			var code string
			if !wait.Until(5*time.Second, func() bool { code = upgradeCode(t, url, m.Token); return code == tc.want }) {
				t.Errorf("%s: on the other broker %s (clock frozen): %q 5 s after, want %q", tc.name, br.URL, code, tc.want)
			}
		}
	}
}

// A cached state never outlives the token: at its exp on the broker's clock the upgrade is refused,
// though the state was read less than delegation.RecentTTL before.
func TestUpgradeCacheEndsAtExpiry(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Provider: "dir", Now: clock.Now})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "short"}); err != nil {
		t.Fatal(err)
	}
	ttl := int64(60)
	m, err := b.Client.Delegate(t.Context(), "short", protocol.MintRequest{Scopes: []string{"fs:read"}, TTLSeconds: &ttl})
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(m.ExpiresAt.Sub(clock.Now()) - delegation.RecentTTL/2)
	if code := upgradeCode(t, m.Sandbox.DataplaneURL, m.Token); code != "" {
		t.Fatalf("upgrade before exp refused: %s", code)
	}
	clock.Advance(m.ExpiresAt.Sub(clock.Now()))
	if code := upgradeCode(t, m.Sandbox.DataplaneURL, m.Token); code != protocol.CodeTokenExpired {
		t.Errorf("upgrade at exp, its state read %s before: %q, want token_expired", delegation.RecentTTL/2, code)
	}
}

// Only the exact token that was verified finds its cached state, and its signature is checked on
// every upgrade anyway: a token with the live one's claims and a forged signature, or the live one's
// signature under other claims, is refused as before.
func TestUpgradeCacheForgedTokenNeverHits(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "forged"}); err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(t.Context(), "forged", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	url := m.Sandbox.DataplaneURL
	if code := upgradeCode(t, url, m.Token); code != "" {
		t.Fatalf("live token refused: %s", code)
	}
	parts := strings.Split(m.Token, ".")
	flip := func(s string, i int) string {
		c := byte('A')
		if s[i] == 'A' {
			c = 'B'
		}
		return s[:i] + string(c) + s[i+1:]
	}
	other, err := b.Client.Delegate(t.Context(), "forged", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	for name, tok := range map[string]string{
		"signature changed":          parts[0] + "." + parts[1] + "." + flip(parts[2], 10),
		"claims of another token":    parts[0] + "." + strings.Split(other.Token, ".")[1] + "." + parts[2],
		"claims changed in one byte": parts[0] + "." + flip(parts[1], 20) + "." + parts[2],
	} {
		if code := upgradeCode(t, url, tok); code == "" || !strings.HasPrefix(code, "token_") {
			t.Errorf("%s: upgrade answered %q, want a token_ refusal", name, code)
		}
	}
	if code := upgradeCode(t, url, m.Token); code != "" {
		t.Errorf("live token refused after the forgeries: %s", code)
	}
}

// A Redis outage never opens the door: with Redis hung, a token whose state is cached and one
// never seen are both refused 503 unavailable, as before the cache (the upgrade still reads the
// sandbox's record, and an unread revocation state is never taken as live).
func TestUpgradeCacheRedisOutageRefuses(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "outage"}); err != nil {
		t.Fatal(err)
	}
	seen, err := b.Client.Delegate(ctx, "outage", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	unseen, err := b.Client.Delegate(ctx, "outage", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	url := seen.Sandbox.DataplaneURL
	if code := upgradeCode(t, url, seen.Token); code != "" {
		t.Fatalf("live token refused: %s", code)
	}
	b.Redis.Pause()
	thawed := false
	defer func() {
		if !thawed {
			b.Redis.Continue()
		}
	}()
	for name, tok := range map[string]string{"cached": seen.Token, "never seen": unseen.Token} {
		if code := upgradeCode(t, url, tok); code != protocol.CodeUnavailable {
			t.Errorf("%s token with Redis hung: %q, want unavailable", name, code)
		}
	}
	b.Redis.Continue()
	thawed = true
	if err := wait.For(5*time.Second, func() error {
		if code := upgradeCode(t, url, unseen.Token); code != "" {
			return context.DeadlineExceeded
		}
		return nil
	}); err != nil {
		t.Fatalf("upgrades still refused 5 s after Redis thawed")
	}
}
