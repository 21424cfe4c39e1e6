package delegation

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// TestVerifyHostileTokens hand-crafts tokens with one defect each (not through Mint) and checks that
// each is rejected with the code of the check that failed, and that a valid one is accepted.
func TestVerifyHostileTokens(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	// A key that was active, then rotated out and is now past its window.
	retiredKid, retiredPriv := k.Signer()
	if _, err := k.Rotate(2 * time.Hour); err != nil {
		t.Fatal(err)
	}
	clk.Advance(3 * time.Hour)
	if err := k.Reload(); err != nil {
		t.Fatal(err)
	}
	kid, priv := k.Signer()
	pub := priv.Public().(ed25519.PublicKey)
	_, otherPriv, _ := ed25519.GenerateKey(rand.Reader)

	st := newMapState()
	st.gens["sb_1"] = 1
	st.gens["sb_bumped"] = 3
	st.revoked["revoked-jti"] = true
	_, v := newIssuerVerifier(t, k, clk, st)

	now := clk.Now()
	hdr := func(edit func(map[string]any)) map[string]any {
		h := map[string]any{"alg": "EdDSA", "typ": protocol.TokenType, "kid": kid}
		if edit != nil {
			edit(h)
		}
		return h
	}
	claims := func(edit func(map[string]any)) map[string]any {
		c := map[string]any{
			"iss": DefaultIssuer, "sub": "key:k1", "aud": []string{DefaultAudience},
			"exp": now.Add(time.Hour).Unix(), "nbf": now.Unix(), "iat": now.Unix(),
			"jti": "6f1c3a55-3b0e-4c51-9d1e-3f9c5d0b7a10", "org": "org_1", "sbx": "sb_1", "gen": 1,
			"scope": "fs:read fs:write exec",
		}
		if edit != nil {
			edit(c)
		}
		return c
	}
	set := func(k string, v any) func(map[string]any) { return func(m map[string]any) { m[k] = v } }
	del := func(k string) func(map[string]any) { return func(m map[string]any) { delete(m, k) } }
	ed := edSigner(priv)
	good := craft(t, hdr(nil), claims(nil), ed)
	h0, rest, _ := strings.Cut(good, ".")
	p0, s0, _ := strings.Cut(rest, ".")

	tampered := func() string {
		// The payload of another token (scope widened, sandbox changed) with the original signature.
		other := craft(t, hdr(nil), claims(set("sbx", "sb_other")), ed)
		_, r, _ := strings.Cut(other, ".")
		p, _, _ := strings.Cut(r, ".")
		return h0 + "." + p + "." + s0
	}()

	cases := []struct {
		name  string
		token string
		want  string // "" means accepted
	}{
		{"valid", good, ""},
		{"aud as a single string", craft(t, hdr(nil), claims(set("aud", DefaultAudience)), ed), ""},
		{"nbf within leeway", craft(t, hdr(nil), claims(set("nbf", now.Add(20*time.Second).Unix())), ed), ""},
		{"iat within leeway", craft(t, hdr(nil), claims(set("iat", now.Add(20*time.Second).Unix())), ed), ""},
		{"no nbf", craft(t, hdr(nil), claims(del("nbf")), ed), ""},
		{"lifetime the maximum", craft(t, hdr(nil), claims(func(m map[string]any) {
			m["iat"] = now.Add(-time.Hour).Unix()
			m["exp"] = now.Add(DefaultMaxTTL - time.Hour).Unix()
		}), ed), ""},

		// Size, then structure.
		{"1 MiB token", strings.Repeat("A", 1<<20), protocol.CodeTokenTooLarge},
		{"just over the cap", h0 + "." + p0 + "." + s0 + strings.Repeat("A", DefaultMaxTokenSize), protocol.CodeTokenTooLarge},
		{"empty", "", protocol.CodeTokenMalformed},
		{"two parts", "a.b", protocol.CodeTokenMalformed},
		{"only dots", "....", protocol.CodeTokenMalformed},
		{"two dots, empty parts", "..", protocol.CodeTokenMalformed},
		{"trailing dot", good + ".", protocol.CodeTokenMalformed},
		{"four parts", good + ".AAAA", protocol.CodeTokenMalformed},
		{"not base64", "ey!!.e30.AAAA", protocol.CodeTokenMalformed},
		{"padded header", h0 + "=." + p0 + "." + s0, protocol.CodeTokenMalformed},
		{"padded signature", h0 + "." + p0 + "." + s0 + "==", protocol.CodeTokenMalformed},
		{"standard base64 alphabet", strings.ReplaceAll(good, "_", "/") + "+", protocol.CodeTokenMalformed},
		{"newline inside", h0 + "." + p0[:4] + "\n" + p0[4:] + "." + s0, protocol.CodeTokenMalformed},
		{"space inside", h0 + ". " + p0 + "." + s0, protocol.CodeTokenMalformed},
		{"bad base64 length", h0 + "." + p0 + "A." + s0, protocol.CodeTokenMalformed},
		{"header not JSON", craft(t, json.RawMessage(`{"alg":`), claims(nil), ed), protocol.CodeTokenMalformed},
		{"header JSON array", craft(t, []string{"EdDSA"}, claims(nil), ed), protocol.CodeTokenMalformed},
		{"header null", craft(t, json.RawMessage(`null`), claims(nil), ed), protocol.CodeTokenMalformed},
		{"payload JSON array", craft(t, hdr(nil), []any{claims(nil)}, ed), protocol.CodeTokenMalformed},
		{"payload null", craft(t, hdr(nil), json.RawMessage(`null`), ed), protocol.CodeTokenMalformed},
		{"payload trailing garbage", craft(t, hdr(nil), json.RawMessage(`{"gen":1}x`), ed), protocol.CodeTokenMalformed},
		{"crit header", craft(t, hdr(set("crit", []string{"b64"})), claims(nil), ed), protocol.CodeTokenMalformed},

		// Algorithm: refused before any key is looked at.
		{"alg none, unsigned", craft(t, hdr(set("alg", "none")), claims(nil), nil), protocol.CodeTokenAlgorithm},
		{"alg none, signed", craft(t, hdr(set("alg", "none")), claims(nil), ed), protocol.CodeTokenAlgorithm},
		{"HS256 keyed with the public key", craft(t, hdr(set("alg", "HS256")), claims(nil), func(in []byte) []byte {
			m := hmac.New(sha256.New, pub)
			m.Write(in)
			return m.Sum(nil)
		}), protocol.CodeTokenAlgorithm},
		{"RS256 header, Ed25519 signature", craft(t, hdr(set("alg", "RS256")), claims(nil), ed), protocol.CodeTokenAlgorithm},
		{"alg lower case", craft(t, hdr(set("alg", "eddsa")), claims(nil), ed), protocol.CodeTokenAlgorithm},
		{"alg Ed25519", craft(t, hdr(set("alg", "Ed25519")), claims(nil), ed), protocol.CodeTokenAlgorithm},
		{"alg missing", craft(t, hdr(del("alg")), claims(nil), ed), protocol.CodeTokenAlgorithm},
		{"alg not a string", craft(t, hdr(set("alg", []string{"EdDSA"})), claims(nil), ed), protocol.CodeTokenAlgorithm},
		{"alg under another case", craft(t, hdr(func(m map[string]any) { delete(m, "alg"); m["ALG"] = "EdDSA" }), claims(nil), ed), protocol.CodeTokenAlgorithm},

		// Type.
		{"typ JWT", craft(t, hdr(set("typ", "JWT")), claims(nil), ed), protocol.CodeTokenType},
		{"typ missing", craft(t, hdr(del("typ")), claims(nil), ed), protocol.CodeTokenType},
		{"typ other case", craft(t, hdr(set("typ", strings.ToUpper(protocol.TokenType))), claims(nil), ed), protocol.CodeTokenType},

		// Key.
		{"kid missing", craft(t, hdr(del("kid")), claims(nil), ed), protocol.CodeTokenUnknownKey},
		{"kid empty", craft(t, hdr(set("kid", "")), claims(nil), ed), protocol.CodeTokenUnknownKey},
		{"kid not a string", craft(t, hdr(set("kid", 7)), claims(nil), ed), protocol.CodeTokenUnknownKey},
		{"kid unknown", craft(t, hdr(set("kid", "AAAAAAAAAAAAAAAA")), claims(nil), ed), protocol.CodeTokenUnknownKey},
		{"retired key past its window", craft(t, hdr(set("kid", retiredKid)), claims(nil), edSigner(retiredPriv)), protocol.CodeTokenUnknownKey},

		// Signature.
		{"tampered payload", tampered, protocol.CodeTokenSignature},
		{"signed by another key under our kid", craft(t, hdr(nil), claims(nil), edSigner(otherPriv)), protocol.CodeTokenSignature},
		{"empty signature", craft(t, hdr(nil), claims(nil), nil), protocol.CodeTokenSignature},
		{"truncated signature", craft(t, hdr(nil), claims(nil), func(in []byte) []byte { return ed(in)[:60] }), protocol.CodeTokenSignature},
		{"wrong claim type and bad signature", craft(t, hdr(nil), claims(set("gen", "1")), edSigner(otherPriv)), protocol.CodeTokenSignature},

		// Registered claims.
		{"expired", craft(t, hdr(nil), claims(set("exp", now.Add(-time.Minute).Unix())), ed), protocol.CodeTokenExpired},
		{"not yet valid", craft(t, hdr(nil), claims(set("nbf", now.Add(time.Minute).Unix())), ed), protocol.CodeTokenNotYet},
		{"issued in the future", craft(t, hdr(nil), claims(set("iat", now.Add(time.Minute).Unix())), ed), protocol.CodeTokenIssuedAt},
		{"wrong iss", craft(t, hdr(nil), claims(set("iss", "someone-else")), ed), protocol.CodeTokenIssuer},
		{"missing iss", craft(t, hdr(nil), claims(del("iss")), ed), protocol.CodeTokenIssuer},
		{"wrong aud", craft(t, hdr(nil), claims(set("aud", []string{"other-api"})), ed), protocol.CodeTokenAudience},
		{"missing aud", craft(t, hdr(nil), claims(del("aud")), ed), protocol.CodeTokenAudience},
		{"empty aud", craft(t, hdr(nil), claims(set("aud", "")), ed), protocol.CodeTokenAudience},
		{"missing exp", craft(t, hdr(nil), claims(del("exp")), ed), protocol.CodeTokenClaims},
		{"exp not a number", craft(t, hdr(nil), claims(set("exp", "tomorrow")), ed), protocol.CodeTokenClaims},
		// No leeway past exp: the dataplane and introspection agree that a token is dead at exp.
		{"exp a second ago", craft(t, hdr(nil), claims(set("exp", now.Add(-time.Second).Unix())), ed), protocol.CodeTokenExpired},
		{"exp now", craft(t, hdr(nil), claims(set("exp", now.Unix())), ed), protocol.CodeTokenExpired},
		// Time claims are JSON integers; golang-jwt alone would take these.
		{"exp a numeric string", craft(t, hdr(nil), claims(set("exp", strconv.FormatInt(now.Add(time.Hour).Unix(), 10))), ed), protocol.CodeTokenClaims},
		{"exp a fraction", craft(t, hdr(nil), claims(set("exp", float64(now.Add(time.Hour).Unix())+0.5)), ed), protocol.CodeTokenClaims},
		{"exp with an exponent", craft(t, hdr(nil), claims(set("exp", json.RawMessage("1.99e9"))), ed), protocol.CodeTokenClaims},
		{"nbf a numeric string", craft(t, hdr(nil), claims(set("nbf", strconv.FormatInt(now.Unix(), 10))), ed), protocol.CodeTokenClaims},
		{"iat a fraction", craft(t, hdr(nil), claims(set("iat", float64(now.Unix())+0.5)), ed), protocol.CodeTokenClaims},
		{"iat missing", craft(t, hdr(nil), claims(del("iat")), ed), protocol.CodeTokenClaims},
		{"time claim a string, bad signature", craft(t, hdr(nil), claims(set("exp", "1")), edSigner(otherPriv)), protocol.CodeTokenSignature},
		{"lifetime beyond the maximum", craft(t, hdr(nil), claims(set("exp", now.Add(DefaultMaxTTL+time.Second).Unix())), ed), protocol.CodeTokenClaims},

		// Our claims.
		{"missing gen", craft(t, hdr(nil), claims(del("gen")), ed), protocol.CodeTokenClaims},
		{"gen 0", craft(t, hdr(nil), claims(set("gen", 0)), ed), protocol.CodeTokenClaims},
		{"gen negative", craft(t, hdr(nil), claims(set("gen", -1)), ed), protocol.CodeTokenClaims},
		{"gen a string", craft(t, hdr(nil), claims(set("gen", "1")), ed), protocol.CodeTokenClaims},
		{"gen fractional", craft(t, hdr(nil), claims(set("gen", 1.5)), ed), protocol.CodeTokenClaims},
		{"missing jti", craft(t, hdr(nil), claims(del("jti")), ed), protocol.CodeTokenClaims},
		{"missing org", craft(t, hdr(nil), claims(del("org")), ed), protocol.CodeTokenClaims},
		{"missing sbx", craft(t, hdr(nil), claims(del("sbx")), ed), protocol.CodeTokenClaims},
		{"missing sub", craft(t, hdr(nil), claims(del("sub")), ed), protocol.CodeTokenClaims},
		{"sub naming no API key", craft(t, hdr(nil), claims(set("sub", "user:k1")), ed), protocol.CodeTokenClaims},
		{"sub with an empty key id", craft(t, hdr(nil), claims(set("sub", "key:")), ed), protocol.CodeTokenClaims},
		{"missing scope", craft(t, hdr(nil), claims(del("scope")), ed), protocol.CodeTokenClaims},
		{"unknown scope", craft(t, hdr(nil), claims(set("scope", "fs:read admin")), ed), protocol.CodeTokenClaims},
		{"scope with a double space", craft(t, hdr(nil), claims(set("scope", "fs:read  exec")), ed), protocol.CodeTokenClaims},
		{"scope with a tab", craft(t, hdr(nil), claims(set("scope", "fs:read\texec")), ed), protocol.CodeTokenClaims},
		{"scope twice", craft(t, hdr(nil), claims(set("scope", "exec exec")), ed), protocol.CodeTokenClaims},
		{"scope not a string", craft(t, hdr(nil), claims(set("scope", []string{"exec"})), ed), protocol.CodeTokenClaims},
		{"cmd with a shell command", craft(t, hdr(nil), claims(set("cmd", []string{"pytest; rm -rf /"})), ed), protocol.CodeTokenClaims},
		{"cmd naming a builtin", craft(t, hdr(nil), claims(set("cmd", []string{"eval"})), ed), protocol.CodeTokenClaims},
		{"cmd empty entry", craft(t, hdr(nil), claims(set("cmd", []string{""})), ed), protocol.CodeTokenClaims},

		// Revocation state.
		{"revoked jti", craft(t, hdr(nil), claims(set("jti", "revoked-jti")), ed), protocol.CodeTokenRevoked},
		{"generation bumped (revoke all)", craft(t, hdr(nil), claims(func(m map[string]any) { m["sbx"] = "sb_bumped"; m["gen"] = 2 }), ed), protocol.CodeTokenRevoked},
		{"sandbox gone", craft(t, hdr(nil), claims(set("sbx", "sb_deleted")), ed), protocol.CodeNotFound},
	}
	seen := map[string]bool{}
	for _, tc := range cases {
		if seen[tc.name] {
			t.Fatalf("duplicate case %q", tc.name)
		}
		seen[tc.name] = true
		t.Run(tc.name, func(t *testing.T) {
			c, err := v.Verify(t.Context(), tc.token)
			if got := code(t, err); got != tc.want {
				t.Fatalf("code = %q, want %q (message: %v)", got, tc.want, err)
			}
			assertNoToken(t, err, tc.token)
			if tc.want == "" && (c == nil || c.Sbx != "sb_1" || c.Gen != 1 || !c.HasScope(protocol.ScopeExec)) {
				t.Fatalf("accepted, but claims are %+v", c)
			}
			if tc.want != "" && c != nil {
				t.Fatal("rejected, but claims returned")
			}
		})
	}
}

func TestVerifyBound(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	st := newMapState()
	st.gens["sb_1"] = 1
	st.gens["sb_2"] = 1
	is, v := newIssuerVerifier(t, k, clk, st)
	tok, _, err := is.Mint(Grant{Org: "org_1", SandboxID: "sb_1", Gen: 1, Subject: "key:k1", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, org, sbx, want string
	}{
		{"same sandbox", "org_1", "sb_1", ""},
		{"same org, any sandbox", "org_1", "", ""},
		{"another org, any sandbox", "org_2", "", protocol.CodeTokenSandbox},
		{"another sandbox", "org_1", "sb_2", protocol.CodeTokenSandbox},
		{"another org", "org_2", "sb_1", protocol.CodeTokenSandbox},
		{"empty", "", "", protocol.CodeTokenSandbox},
	} {
		_, err := v.VerifyBound(t.Context(), tok, tc.org, tc.sbx)
		if got := code(t, err); got != tc.want {
			t.Errorf("%s: code = %q, want %q", tc.name, got, tc.want)
		}
		assertNoToken(t, err, tok)
	}
	// The sandbox binding is checked before the revocation state: a wrong sandbox costs no lookup.
	st.err = errRedisDown
	if _, err := v.VerifyBound(t.Context(), tok, "org_1", "sb_2"); code(t, err) != protocol.CodeTokenSandbox {
		t.Fatalf("wrong sandbox with the state down: %v", err)
	}
}

// Check answers only what the token itself says: it never consults the revocation state.
func TestCheckReadsNoState(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	st := newMapState()
	is, v := newIssuerVerifier(t, k, clk, st)
	tok, c, err := is.Mint(Grant{Org: "org_1", SandboxID: "sb_1", Gen: 1, Subject: "key:k1", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	st.revoked[c.ID] = true
	st.err = errRedisDown
	if got, err := v.Check(tok); err != nil || got.ID != c.ID {
		t.Fatalf("Check of a revoked token with the state down: %+v %v, want its claims", got, err)
	}
	if _, err := v.Check(tok + "x"); code(t, err) != protocol.CodeTokenSignature && code(t, err) != protocol.CodeTokenMalformed {
		t.Fatalf("Check of a damaged token: %v", err)
	}
	clk.Advance(2 * time.Hour)
	if _, err := v.Check(tok); code(t, err) != protocol.CodeTokenExpired {
		t.Fatalf("Check of an expired token: %v", err)
	}
}

func TestVerifyStateErrors(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	st := newMapState()
	st.gens["sb_1"] = 1
	is, v := newIssuerVerifier(t, k, clk, st)
	tok, c, err := is.Mint(Grant{Org: "org_1", SandboxID: "sb_1", Gen: 1, Subject: "key:k1", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(t.Context(), tok); err != nil {
		t.Fatalf("fresh token: %v", err)
	}

	// Revoke one token by jti.
	st.revoked[c.ID] = true
	if _, err := v.Verify(t.Context(), tok); code(t, err) != protocol.CodeTokenRevoked {
		t.Fatalf("after revoking the jti: %v", err)
	}
	delete(st.revoked, c.ID)

	// Revoke all: bump the generation. A token minted at the new generation verifies.
	st.gens["sb_1"] = 2
	if _, err := v.Verify(t.Context(), tok); code(t, err) != protocol.CodeTokenRevoked {
		t.Fatalf("after bumping the generation: %v", err)
	}
	tok2, _, err := is.Mint(Grant{Org: "org_1", SandboxID: "sb_1", Gen: 2, Subject: "key:k1", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(t.Context(), tok2); err != nil {
		t.Fatalf("token of the new generation: %v", err)
	}

	// An infrastructure failure is not a rejection: it wraps ErrRevocationState and the cause.
	st.err = errRedisDown
	_, err = v.Verify(t.Context(), tok2)
	if !errors.Is(err, ErrRevocationState) || !errors.Is(err, errRedisDown) {
		t.Fatalf("state down: got %v, want ErrRevocationState wrapping the cause", err)
	}
	var pe *protocol.Error
	if errors.As(err, &pe) {
		t.Fatalf("state down must not look like a token rejection, got code %s", pe.Code)
	}
	assertNoToken(t, err, tok2)

	// A State that wraps its *protocol.Error still yields that *protocol.Error.
	st.err = errors.Join(errors.New("context"), protocol.Errorf(protocol.CodeTokenRevoked, "revoked"))
	if _, err := v.Verify(t.Context(), tok2); code(t, err) != protocol.CodeTokenRevoked {
		t.Fatalf("wrapped rejection: %v", err)
	}
}

// TestVerifyNilState documents that a Verifier without State does every check but revocation.
func TestVerifyNilState(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	is, v := newIssuerVerifier(t, k, clk, nil)
	tok, want, err := is.Mint(Grant{Org: "o", SandboxID: "s", Gen: 9, Subject: "key:k", Scopes: []string{"fs:read"}, AllowCmd: []string{"pytest"}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := v.Verify(t.Context(), tok)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != want.ID || got.Gen != 9 || got.Scope != "fs:read" || len(got.Cmd) != 1 || got.Cmd[0] != "pytest" {
		t.Fatalf("claims = %+v, want %+v", got, want)
	}
	clk.Advance(DefaultTTL + DefaultLeeway + time.Second)
	if _, err := v.Verify(t.Context(), tok); code(t, err) != protocol.CodeTokenExpired {
		t.Fatalf("after expiry: %v", err)
	}
}

// TestVerifyIssuerAudienceConfig checks that a verifier configured for another issuer or audience
// refuses tokens minted for the default ones.
func TestVerifyIssuerAudienceConfig(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	is, _ := newIssuerVerifier(t, k, clk, nil)
	tok, _, err := is.Mint(Grant{Org: "o", SandboxID: "s", Gen: 1, Subject: "key:k", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	for cfg, want := range map[*Config]string{
		{Issuer: "other-broker", Now: clk.Now}:  protocol.CodeTokenIssuer,
		{Audience: "other-plane", Now: clk.Now}: protocol.CodeTokenAudience,
	} {
		v, err := NewVerifier(k, *cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Verify(t.Context(), tok); code(t, err) != want {
			t.Errorf("%+v: got %v, want %s", *cfg, err, want)
		}
	}
}

func TestNewVerifierConfig(t *testing.T) {
	t.Parallel()
	k := newKeyring(t, newClock())
	for _, cfg := range []Config{
		{Leeway: -time.Second},
		{MaxTokenSize: 100},
		{DefaultTTL: 48 * time.Hour},
		{MaxTTL: time.Millisecond},
	} {
		if _, err := NewVerifier(k, cfg, nil); err == nil {
			t.Errorf("NewVerifier(%+v) accepted", cfg)
		}
	}
	if _, err := NewVerifier(nil, Config{}, nil); err == nil {
		t.Error("NewVerifier without keyring accepted")
	}
}
