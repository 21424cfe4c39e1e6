package delegation

import (
	"strings"

	"github.com/golang-jwt/jwt/v5"

	"github.com/sbxbroker/broker/protocol"
)

// Claims are a delegation token's claims. The registered ones carry iss, sub (the owner principal,
// e.g. "key:<keyid>"), aud, exp, nbf, iat and jti; the rest bind the token to one sandbox.
type Claims struct {
	jwt.RegisteredClaims
	// Org is the owner's organization.
	Org string `json:"org"`
	// Sbx is the id of the one sandbox the token may act on.
	Sbx string `json:"sbx"`
	// Gen is the sandbox's token generation when the token was minted; bumping the sandbox's
	// generation revokes every token minted before. Generations start at 1.
	Gen int64 `json:"gen"`
	// Scope is the space-separated list of granted scopes (protocol.Scopes).
	Scope string `json:"scope"`
	// Cmd, when non-empty, is the only programs the token may run (see CheckCommand).
	Cmd []string `json:"cmd,omitempty"`
}

// KeySubjectPrefix starts the sub claim of every token: "key:" and the id of the API key that minted
// it. Revoking that key ends the token (Service.CheckRevocation).
const KeySubjectPrefix = "key:"

// KeyID is the id of the API key that minted the token, or "" if sub does not name one.
func (c *Claims) KeyID() string {
	id, ok := strings.CutPrefix(c.Subject, KeySubjectPrefix)
	if !ok {
		return ""
	}
	return id
}

// Scopes returns the granted scopes as a list.
func (c *Claims) Scopes() []string { return protocol.SplitScopes(c.Scope) }

// HasScope reports whether the token grants scope s.
func (c *Claims) HasScope(s string) bool {
	if s == "" {
		return false
	}
	for rest := c.Scope; rest != ""; {
		var word string
		word, rest, _ = strings.Cut(rest, " ")
		if word == s {
			return true
		}
	}
	return false
}

// canonicalScopes checks a scope list (known, no duplicates, not empty) and returns it in the order of
// protocol.Scopes, or a reason it is not valid.
func canonicalScopes(scopes []string) ([]string, string) {
	if len(scopes) == 0 {
		return nil, "no scope given; choose from " + protocol.JoinScopes(protocol.Scopes)
	}
	seen := make(map[string]bool, len(scopes))
	for _, s := range scopes {
		if !isKnownScope(s) {
			return nil, "unknown scope " + quoteShort(s) + "; choose from " + protocol.JoinScopes(protocol.Scopes)
		}
		if seen[s] {
			return nil, "scope " + s + " given twice"
		}
		seen[s] = true
	}
	out := make([]string, 0, len(scopes))
	for _, s := range protocol.Scopes {
		if seen[s] {
			out = append(out, s)
		}
	}
	return out, ""
}

func isKnownScope(s string) bool {
	for _, k := range protocol.Scopes {
		if s == k {
			return true
		}
	}
	return false
}
