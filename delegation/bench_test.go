package delegation

import (
	"testing"
)

// Benchmarks of the token path. Verification runs at every dataplane upgrade and introspection;
// Ed25519 verification dominates it.

func benchSetup(b *testing.B, st State) (*Issuer, *Verifier, string) {
	b.Helper()
	clk := newClock()
	k := newKeyring(b, clk)
	is, v := newIssuerVerifier(b, k, clk, st)
	tok, _, err := is.Mint(Grant{Org: "org_1", SandboxID: "sb_1", Gen: 1, Subject: "key:k1",
		Scopes: []string{"fs:read", "fs:write", "exec"}, AllowCmd: []string{"pytest", "python"}})
	if err != nil {
		b.Fatal(err)
	}
	return is, v, tok
}

func BenchmarkVerify(b *testing.B) {
	_, v, tok := benchSetup(b, nil)
	ctx := b.Context()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := v.Verify(ctx, tok); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkVerifyWithState(b *testing.B) {
	st := newMapState()
	st.gens["sb_1"] = 1
	st.revoked["some-other-jti"] = true
	_, v, tok := benchSetup(b, st)
	ctx := b.Context()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := v.Verify(ctx, tok); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkVerifyRejectAlgorithm is the cost of refusing a forged header: no key is touched.
func BenchmarkVerifyRejectAlgorithm(b *testing.B) {
	_, v, _ := benchSetup(b, nil)
	tok := craft(b, map[string]any{"alg": "none", "typ": "sbx-delegation+jwt"}, map[string]any{"sub": "x"}, nil)
	ctx := b.Context()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := v.Verify(ctx, tok); err == nil {
			b.Fatal("accepted")
		}
	}
}

func BenchmarkMint(b *testing.B) {
	is, _, _ := benchSetup(b, nil)
	g := Grant{Org: "org_1", SandboxID: "sb_1", Gen: 1, Subject: "key:k1", Scopes: []string{"fs:read", "exec"}}
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := is.Mint(g); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkCheckCommand(b *testing.B) {
	allow := []string{"pytest", "python"}
	b.ReportAllocs()
	for b.Loop() {
		if err := CheckCommand(allow, `pytest -q -k "a and not b" tests/unit`, nil, nil); err != nil {
			b.Fatal(err)
		}
	}
}
