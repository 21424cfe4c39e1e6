package protocol

import (
	"strings"
	"time"
)

// Delegation scopes. A token carries a space-separated subset in its "scope" claim.
const (
	ScopeFSRead  = "fs:read"  // stat, ls, read, glob, grep, download, tar, changes, env
	ScopeFSWrite = "fs:write" // write, edit, delete, mkdir, move, upload, untar
	ScopeExec    = "exec"     // exec, shell
)

// Scopes lists every scope a token may carry.
var Scopes = []string{ScopeFSRead, ScopeFSWrite, ScopeExec}

// TokenType is the JWT "typ" header of delegation tokens, so that no other kind of JWT (an ID token,
// a session token) ever validates as a delegation.
const TokenType = "sbx-delegation+jwt"

// SandboxBlock is the run-config block an agent server receives, under config.configurable.sandbox.
// Its keys are fixed: agent servers and the TypeScript backend read exactly these.
type SandboxBlock struct {
	SandboxID string `json:"sandbox_id"`
	// Credential is opaque to the agent server: today a delegation token.
	Credential   string `json:"credential"`
	DataplaneURL string `json:"dataplane_url"`
	// MCPURL is the sandbox's MCP endpoint (Streamable HTTP) on the same broker, for agent servers
	// with an MCP client; the same credential opens it. Readers that do not know it ignore it.
	MCPURL string `json:"mcp_url,omitempty"`
}

// RunConfig is the whole object an agent run request merges in:
// {"config":{"configurable":{"sandbox":{...}}}}.
type RunConfig struct {
	Config struct {
		Configurable struct {
			Sandbox SandboxBlock `json:"sandbox"`
		} `json:"configurable"`
	} `json:"config"`
}

// NewRunConfig wraps a block in the run-config object.
func NewRunConfig(b SandboxBlock) RunConfig {
	var rc RunConfig
	rc.Config.Configurable.Sandbox = b
	return rc
}

// MintRequest is the body of POST /v1/sandboxes/{ref}/delegations.
type MintRequest struct {
	Scopes []string `json:"scopes"`
	// AllowCmd, when set, names the only programs the token may run (see docs/dataplane.md). An
	// empty list is sent as one (omitzero), for the broker to refuse: dropped, it would allow any.
	AllowCmd []string `json:"allow_cmd,omitzero"`
	// TTLSeconds is the token's lifetime; nil means the broker's default (1 h), capped by its maximum.
	TTLSeconds *int64 `json:"ttl_seconds,omitempty"`
}

// MintResponse carries the token once; the broker keeps only its metadata.
type MintResponse struct {
	Token     string       `json:"token"`
	JTI       string       `json:"jti"`
	ExpiresAt time.Time    `json:"expires_at"`
	Sandbox   SandboxBlock `json:"sandbox"`
}

// Delegation is a minted token's metadata, as listed; it never includes the token.
type Delegation struct {
	JTI       string    `json:"jti"`
	SandboxID string    `json:"sandbox_id"`
	Scopes    []string  `json:"scopes"`
	AllowCmd  []string  `json:"allow_cmd,omitempty"`
	IssuedAt  time.Time `json:"issued_at"`
	ExpiresAt time.Time `json:"expires_at"`
	IssuedBy  string    `json:"issued_by"`
	Revoked   bool      `json:"revoked"`
}

// ListDelegationsResponse is GET /v1/sandboxes/{ref}/delegations.
type ListDelegationsResponse struct {
	Items []Delegation `json:"items"`
}

// RevokeResponse answers DELETE .../delegations/{jti} and DELETE .../delegations.
type RevokeResponse struct {
	SandboxID string `json:"sandbox_id"`
	// JTI is set when one token was revoked; All when every token of the sandbox was.
	JTI string `json:"jti,omitempty"`
	All bool   `json:"all,omitempty"`
}

// IntrospectRequest is the body of POST /v1/tokens/introspect.
type IntrospectRequest struct {
	Token string `json:"token"`
}

// IntrospectResponse says whether a token is usable now. An inactive answer carries nothing else but
// a reason code, so that it leaks nothing about tokens of other orgs.
type IntrospectResponse struct {
	Active    bool     `json:"active"`
	SandboxID string   `json:"sandbox_id,omitempty"`
	Org       string   `json:"org,omitempty"`
	Scopes    []string `json:"scopes,omitempty"`
	AllowCmd  []string `json:"allow_cmd,omitempty"`
	JTI       string   `json:"jti,omitempty"`
	Exp       int64    `json:"exp,omitempty"`
	// Reason is the error code of the failed check when Active is false.
	Reason string `json:"reason,omitempty"`
}

// JoinScopes and SplitScopes convert between a scope list and the claim's space-separated form.
func JoinScopes(s []string) string { return strings.Join(s, " ") }

// SplitScopes splits a space-separated scope claim.
func SplitScopes(s string) []string { return strings.Fields(s) }
