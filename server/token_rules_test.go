package server_test

import (
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"testing"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// Introspection and the dataplane apply one expiry rule: a token is dead from its exp on, on the
// broker's clock, with no leeway in either.
func TestIntrospectionExpiryMatchesDataplane(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Provider: "dir", Now: clock.Now})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "exp"}); err != nil {
		t.Fatal(err)
	}
	ttl := int64(60)
	m, err := b.Client.Delegate(t.Context(), "exp", protocol.MintRequest{Scopes: []string{"fs:read"}, TTLSeconds: &ttl})
	if err != nil {
		t.Fatal(err)
	}
	if in, err := b.Client.Introspect(t.Context(), m.Token); err != nil || !in.Active {
		t.Fatalf("fresh token: %+v %v", in, err)
	}
	for _, past := range []time.Duration{0, time.Second, 29 * time.Second} {
		// Clocks move to exact seconds past exp (JWT times are whole seconds).
		clock.Advance(m.ExpiresAt.Add(past).Sub(clock.Now()))
		in, err := b.Client.Introspect(t.Context(), m.Token)
		if err != nil {
			t.Fatal(err)
		}
		if in.Active || in.Reason != protocol.CodeTokenExpired {
			t.Errorf("introspection %s past exp: %+v, want inactive, token_expired", past, in)
		}
		status, eb := dialStatus(t, m.Sandbox.DataplaneURL, authHeader(m.Token), []string{protocol.Subprotocol})
		if status != 401 || eb.Error.Code != protocol.CodeTokenExpired {
			t.Errorf("dataplane %s past exp: %d %+v, want 401 token_expired", past, status, eb)
		}
	}
}

// signToken signs claims with the broker's active key, as only the broker can: what a verifier
// refuses here it refuses for its own signature, not for a forgery.
func signToken(t *testing.T, b *servertest.Broker, claims map[string]any) string {
	t.Helper()
	kid, key := b.Keys.Signer()
	h, _ := json.Marshal(map[string]any{"alg": "EdDSA", "typ": protocol.TokenType, "kid": kid})
	p, err := json.Marshal(claims)
	if err != nil {
		t.Fatal(err)
	}
	enc := base64.RawURLEncoding
	in := enc.EncodeToString(h) + "." + enc.EncodeToString(p)
	return in + "." + enc.EncodeToString(ed25519.Sign(key, []byte(in)))
}

// The verifier is strict about time claims: exp, nbf and iat are integers (not strings, not
// fractions), iat is present, and a lifetime (exp - iat) longer than the broker's maximum token
// lifetime is refused, even when the broker's own key signed it.
func TestVerifierStrictTimeClaims(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	res, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "strict"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(t.Context(), "strict", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if err != nil {
		t.Fatal(err)
	}
	// The claims of a real token, to change one at a time.
	in, err := b.Client.Introspect(t.Context(), m.Token)
	if err != nil || !in.Active {
		t.Fatalf("%+v %v", in, err)
	}
	var list protocol.ListDelegationsResponse
	if list, err = b.Client.ListDelegations(t.Context(), "strict"); err != nil || len(list.Items) != 1 {
		t.Fatalf("%+v %v", list, err)
	}
	now := time.Now().Unix()
	base := func(edit func(map[string]any)) map[string]any {
		c := map[string]any{
			"iss": delegation.DefaultIssuer, "sub": list.Items[0].IssuedBy, "aud": []string{delegation.DefaultAudience},
			"exp": now + 3600, "nbf": now, "iat": now, "jti": "0b6f9d2e-54c1-4bf4-a8a6-2f3f9d1c7e11",
			"org": b.Org, "sbx": res.Sandbox.ID, "gen": 1, "scope": "fs:read",
		}
		if edit != nil {
			edit(c)
		}
		return c
	}
	set := func(k string, v any) func(map[string]any) { return func(m map[string]any) { m[k] = v } }
	cases := []struct {
		name   string
		claims map[string]any
		want   string // "" = active
	}{
		{"as minted", base(nil), ""},
		{"lifetime exactly the maximum", base(set("exp", now+int64(delegation.DefaultMaxTTL/time.Second))), ""},
		{"exp a quoted number", base(set("exp", itoa(now+3600))), protocol.CodeTokenClaims},
		{"exp a fraction", base(set("exp", float64(now)+3600.5)), protocol.CodeTokenClaims},
		{"exp with an exponent", base(set("exp", json.RawMessage("2.0e9"))), protocol.CodeTokenClaims},
		{"exp an integral float", base(set("exp", json.RawMessage(itoa(now+3600)+".0"))), protocol.CodeTokenClaims},
		{"nbf a string", base(set("nbf", itoa(now))), protocol.CodeTokenClaims},
		{"nbf a fraction", base(set("nbf", float64(now)-0.5)), protocol.CodeTokenClaims},
		{"iat a string", base(set("iat", itoa(now))), protocol.CodeTokenClaims},
		{"iat a fraction", base(set("iat", float64(now)+0.25)), protocol.CodeTokenClaims},
		{"iat missing", base(func(m map[string]any) { delete(m, "iat") }), protocol.CodeTokenClaims},
		{"lifetime beyond the maximum", base(set("exp", now+int64(delegation.DefaultMaxTTL/time.Second)+1)), protocol.CodeTokenClaims},
		{"a year's lifetime", base(func(m map[string]any) {
			m["iat"] = now - 300*86400
			m["nbf"] = now - 300*86400
			m["exp"] = now + 65*86400
		}), protocol.CodeTokenClaims},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tok := signToken(t, b, tc.claims)
			in, err := b.Client.Introspect(t.Context(), tok)
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == "" {
				if !in.Active {
					t.Fatalf("introspection: %+v, want active", in)
				}
				return
			}
			if in.Active || in.Reason != tc.want {
				t.Errorf("introspection: %+v, want inactive, %s", in, tc.want)
			}
			status, eb := dialStatus(t, m.Sandbox.DataplaneURL, authHeader(tok), []string{protocol.Subprotocol})
			if status != 401 || eb.Error.Code != tc.want {
				t.Errorf("dataplane: %d %+v, want 401 %s", status, eb, tc.want)
			}
		})
	}
}

func itoa(n int64) string { b, _ := json.Marshal(n); return string(b) }
