package delegation

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sbxbroker/broker/protocol"
)

func TestMint(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	is, v := newIssuerVerifier(t, k, clk, nil)
	tok, c, err := is.Mint(Grant{
		Org: "org_1", SandboxID: "sb_1", Gen: 4, Subject: "key:k1",
		Scopes: []string{"exec", "fs:read"}, AllowCmd: []string{"pytest", "/usr/bin/python3"}, TTL: 10 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	kid, _ := k.Signer()
	h := headerOf(t, tok)
	if h["alg"] != "EdDSA" || h["typ"] != protocol.TokenType || h["kid"] != kid || len(h) != 3 {
		t.Fatalf("header %v", h)
	}
	now := clk.Now()
	switch {
	case c.Issuer != DefaultIssuer, c.Subject != "key:k1", !slices.Equal(c.Audience, []string{DefaultAudience}):
		t.Fatalf("registered claims %+v", c.RegisteredClaims)
	case !c.IssuedAt.Equal(now), !c.NotBefore.Equal(now), !c.ExpiresAt.Equal(now.Add(10 * time.Minute)):
		t.Fatalf("times iat=%v nbf=%v exp=%v, now %v", c.IssuedAt, c.NotBefore, c.ExpiresAt, now)
	case c.Org != "org_1", c.Sbx != "sb_1", c.Gen != 4:
		t.Fatalf("claims %+v", c)
	case c.Scope != "fs:read exec":
		t.Fatalf("scope %q, want the canonical order", c.Scope)
	case !slices.Equal(c.Cmd, []string{"pytest", "/usr/bin/python3"}):
		t.Fatalf("cmd %v", c.Cmd)
	}
	id, err := uuid.Parse(c.ID)
	if err != nil || id.Version() != 4 {
		t.Fatalf("jti %q is not a UUID v4", c.ID)
	}
	got, err := v.Verify(t.Context(), tok)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != c.ID || got.Scope != c.Scope || !slices.Equal(got.Cmd, c.Cmd) {
		t.Fatalf("verified claims %+v differ from minted %+v", got, c)
	}

	// Each mint has its own jti; the default lifetime applies when TTL is 0.
	_, c2, err := is.Mint(Grant{Org: "o", SandboxID: "s", Gen: 1, Subject: "key:k", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	if c2.ID == c.ID {
		t.Fatal("two tokens share a jti")
	}
	if !c2.ExpiresAt.Equal(now.Add(DefaultTTL)) {
		t.Fatalf("default exp %v", c2.ExpiresAt)
	}
	if c2.Cmd != nil {
		t.Fatal("cmd set without an allowlist")
	}
}

func TestMintRejects(t *testing.T) {
	t.Parallel()
	clk := newClock()
	is, _ := newIssuerVerifier(t, newKeyring(t, clk), clk, nil)
	base := func(edit func(*Grant)) Grant {
		g := Grant{Org: "o", SandboxID: "s", Gen: 1, Subject: "key:k", Scopes: []string{"exec"}}
		edit(&g)
		return g
	}
	many := make([]string, MaxAllowCmd+1)
	for i := range many {
		many[i] = fmt.Sprintf("prog%d", i)
	}
	cases := []struct {
		name    string
		g       Grant
		want    string
		message string // a piece the message must contain
	}{
		{"no scopes", base(func(g *Grant) { g.Scopes = nil }), protocol.CodeInvalidScope, "fs:read fs:write exec"},
		{"unknown scope", base(func(g *Grant) { g.Scopes = []string{"exec", "admin"} }), protocol.CodeInvalidScope, `"admin"`},
		{"empty scope", base(func(g *Grant) { g.Scopes = []string{""} }), protocol.CodeInvalidScope, "unknown scope"},
		{"duplicate scope", base(func(g *Grant) { g.Scopes = []string{"exec", "exec"} }), protocol.CodeInvalidScope, "twice"},
		{"scope with spaces", base(func(g *Grant) { g.Scopes = []string{"fs:read exec"} }), protocol.CodeInvalidScope, "unknown scope"},
		{"negative ttl", base(func(g *Grant) { g.TTL = -time.Second }), protocol.CodeInvalidTTL, "24h0m0s"},
		{"ttl above max", base(func(g *Grant) { g.TTL = DefaultMaxTTL + time.Second }), protocol.CodeInvalidTTL, "24h0m0s"},
		{"ttl under a second", base(func(g *Grant) { g.TTL = 500 * time.Millisecond }), protocol.CodeInvalidTTL, "1s"},
		// An allowlist given empty names no program; read as absent it would allow every one.
		{"empty allowlist", base(func(g *Grant) { g.AllowCmd = []string{} }), protocol.CodeInvalidArgument, "omit allow_cmd"},
		{"empty cmd", base(func(g *Grant) { g.AllowCmd = []string{""} }), protocol.CodeInvalidArgument, "empty"},
		{"cmd with space", base(func(g *Grant) { g.AllowCmd = []string{"py test"} }), protocol.CodeInvalidArgument, "' '"},
		{"cmd with tab", base(func(g *Grant) { g.AllowCmd = []string{"py\ttest"} }), protocol.CodeInvalidArgument, `'\t'`},
		{"cmd with ;", base(func(g *Grant) { g.AllowCmd = []string{"pytest;rm"} }), protocol.CodeInvalidArgument, "';'"},
		{"cmd with $", base(func(g *Grant) { g.AllowCmd = []string{"$HOME"} }), protocol.CodeInvalidArgument, "'$'"},
		{"cmd with quote", base(func(g *Grant) { g.AllowCmd = []string{`"pytest"`} }), protocol.CodeInvalidArgument, "contains"},
		{"cmd with glob", base(func(g *Grant) { g.AllowCmd = []string{"py*"} }), protocol.CodeInvalidArgument, "contains"},
		{"cmd with NUL", base(func(g *Grant) { g.AllowCmd = []string{"py\x00"} }), protocol.CodeInvalidArgument, "contains"},
		{"cmd relative path", base(func(g *Grant) { g.AllowCmd = []string{"./pytest"} }), protocol.CodeInvalidArgument, "relative"},
		{"cmd bin/x", base(func(g *Grant) { g.AllowCmd = []string{"bin/pytest"} }), protocol.CodeInvalidArgument, "relative"},
		{"cmd dot-dot path", base(func(g *Grant) { g.AllowCmd = []string{"/usr/../tmp/x"} }), protocol.CodeInvalidArgument, "clean"},
		{"cmd double slash", base(func(g *Grant) { g.AllowCmd = []string{"/usr//bin/x"} }), protocol.CodeInvalidArgument, "clean"},
		{"cmd directory", base(func(g *Grant) { g.AllowCmd = []string{"/usr/bin/"} }), protocol.CodeInvalidArgument, "file"},
		{"cmd root", base(func(g *Grant) { g.AllowCmd = []string{"/"} }), protocol.CodeInvalidArgument, "file"},
		{"cmd dot", base(func(g *Grant) { g.AllowCmd = []string{".."} }), protocol.CodeInvalidArgument, "program"},
		{"cmd option", base(func(g *Grant) { g.AllowCmd = []string{"-rf"} }), protocol.CodeInvalidArgument, "'-'"},
		{"cmd eval", base(func(g *Grant) { g.AllowCmd = []string{"eval"} }), protocol.CodeInvalidArgument, "/usr/bin/eval"},
		{"cmd printf builtin", base(func(g *Grant) { g.AllowCmd = []string{"printf"} }), protocol.CodeInvalidArgument, "builtin"},
		{"cmd time keyword", base(func(g *Grant) { g.AllowCmd = []string{"time"} }), protocol.CodeInvalidArgument, "keyword"},
		{"cmd too long", base(func(g *Grant) { g.AllowCmd = []string{strings.Repeat("a", MaxAllowCmdLen+1)} }), protocol.CodeInvalidArgument, "255"},
		{"cmd too many", base(func(g *Grant) { g.AllowCmd = many }), protocol.CodeInvalidArgument, "at most 32"},
		{"cmd twice", base(func(g *Grant) { g.AllowCmd = []string{"pytest", "pytest"} }), protocol.CodeInvalidArgument, "twice"},
		// A program the same token may rewrite (fs:write reaches everything under /workspace)
		// allows every program: the allowlist would be void.
		{"cmd in the workspace with fs:write", base(func(g *Grant) {
			g.Scopes, g.AllowCmd = []string{"exec", "fs:write"}, []string{"pytest", "/workspace/run.sh"}
		}), protocol.CodeInvalidArgument, "fs:write"},
		{"cmd deep in the workspace with fs:write", base(func(g *Grant) {
			g.Scopes, g.AllowCmd = []string{"exec", "fs:write"}, []string{"/workspace/.venv/bin/pytest"}
		}), protocol.CodeInvalidArgument, "/workspace"},
		// /proc reaches the workspace by other names: exec's cwd, the sandbox's root.
		{"cmd through /proc/self/cwd with fs:write", base(func(g *Grant) {
			g.Scopes, g.AllowCmd = []string{"exec", "fs:write"}, []string{"/proc/self/cwd/run.sh"}
		}), protocol.CodeInvalidArgument, "/proc"},
		{"cmd through /proc/self/root with fs:write", base(func(g *Grant) {
			g.Scopes, g.AllowCmd = []string{"exec", "fs:write"}, []string{"/proc/self/root/workspace/run.sh"}
		}), protocol.CodeInvalidArgument, "/proc"},
		// /dev/fd is /proc/self/fd in every sandbox: a directory descriptor the exec inherits
		// (the kubernetes agent holds one on /workspace) reaches the workspace through it.
		{"cmd through /dev/fd with fs:write", base(func(g *Grant) {
			g.Scopes, g.AllowCmd = []string{"exec", "fs:write"}, []string{"/dev/fd/3/run.sh"}
		}), protocol.CodeInvalidArgument, "/dev/fd"},
		{"no org", base(func(g *Grant) { g.Org = "" }), protocol.CodeInvalidArgument, "org"},
		{"no sandbox", base(func(g *Grant) { g.SandboxID = "" }), protocol.CodeInvalidArgument, "sandbox"},
		{"no subject", base(func(g *Grant) { g.Subject = "" }), protocol.CodeInvalidArgument, "subject"},
		{"subject names no key", base(func(g *Grant) { g.Subject = "user:alice" }), protocol.CodeInvalidArgument, "key:<id>"},
		{"subject with an empty key id", base(func(g *Grant) { g.Subject = "key:" }), protocol.CodeInvalidArgument, "key:<id>"},
		{"gen 0", base(func(g *Grant) { g.Gen = 0 }), protocol.CodeInvalidArgument, "start at 1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tok, _, err := is.Mint(tc.g)
			if tok != "" {
				t.Fatal("a token was returned with an error")
			}
			if got := code(t, err); got != tc.want {
				t.Fatalf("code %q, want %q (%v)", got, tc.want, err)
			}
			if !strings.Contains(err.Error(), tc.message) {
				t.Fatalf("message %q does not say %q", err.Error(), tc.message)
			}
		})
	}

	// Limits are inclusive, and these are all fine.
	for _, allow := range [][]string{
		many[:MaxAllowCmd],
		{strings.Repeat("a", MaxAllowCmdLen)},
		{"pytest", "python3.12", "g++", "x86_64-linux-gnu-gcc", "/usr/bin/printf", "/opt/venv/bin/pytest", "echo", "true"},
	} {
		if _, _, err := is.Mint(base(func(g *Grant) { g.AllowCmd = allow })); err != nil {
			t.Errorf("AllowCmd %v refused: %v", allow, err)
		}
	}
	// A workspace program without fs:write (the token cannot rewrite it), and paths that only
	// look like the workspace's, are fine.
	for _, g := range []Grant{
		base(func(g *Grant) { g.AllowCmd = []string{"/workspace/run.sh"} }),
		base(func(g *Grant) {
			g.Scopes, g.AllowCmd = []string{"exec", "fs:write"}, []string{"/workspaces/x", "/opt/workspace/x", "/usr/bin/pytest"}
		}),
	} {
		if _, _, err := is.Mint(g); err != nil {
			t.Errorf("%v with %v refused: %v", g.AllowCmd, g.Scopes, err)
		}
	}
	for _, ttl := range []time.Duration{time.Second, DefaultMaxTTL} {
		if _, _, err := is.Mint(base(func(g *Grant) { g.TTL = ttl })); err != nil {
			t.Errorf("TTL %v refused: %v", ttl, err)
		}
	}
}

func TestNewIssuerConfig(t *testing.T) {
	t.Parallel()
	k := newKeyring(t, newClock())
	if _, err := NewIssuer(k, Config{DefaultTTL: 2 * time.Hour, MaxTTL: time.Hour}); err == nil || !strings.Contains(err.Error(), "DefaultTTL") {
		t.Fatalf("DefaultTTL above MaxTTL: %v", err)
	}
	if _, err := NewIssuer(nil, Config{}); err == nil {
		t.Fatal("NewIssuer without keyring accepted")
	}
	clk := newClock()
	is, err := NewIssuer(k, Config{Issuer: "b2", Audience: "dp2", MaxTTL: 2 * time.Hour, DefaultTTL: time.Minute, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	_, c, err := is.Mint(Grant{Org: "o", SandboxID: "s", Gen: 1, Subject: "key:k", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	if c.Issuer != "b2" || c.Audience[0] != "dp2" || !c.ExpiresAt.Equal(clk.Now().Add(time.Minute)) {
		t.Fatalf("config not applied: %+v", c.RegisteredClaims)
	}
	if _, _, err := is.Mint(Grant{Org: "o", SandboxID: "s", Gen: 1, Subject: "key:k", Scopes: []string{"exec"}, TTL: 3 * time.Hour}); code(t, err) != protocol.CodeInvalidTTL || !strings.Contains(err.Error(), "2h0m0s") {
		t.Fatalf("TTL above a configured max: %v", err)
	}
}

func TestClaimsScopes(t *testing.T) {
	t.Parallel()
	c := &Claims{Scope: "fs:read exec"}
	if !slices.Equal(c.Scopes(), []string{"fs:read", "exec"}) {
		t.Fatalf("Scopes() = %v", c.Scopes())
	}
	for s, want := range map[string]bool{"fs:read": true, "exec": true, "fs:write": false, "": false, "fs": false, "fs:read exec": false} {
		if got := c.HasScope(s); got != want {
			t.Errorf("HasScope(%q) = %v, want %v", s, got, want)
		}
	}
	if (&Claims{}).HasScope("exec") || len((&Claims{}).Scopes()) != 0 {
		t.Fatal("empty scope grants something")
	}
}
