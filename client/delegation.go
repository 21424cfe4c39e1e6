package client

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/url"
	"regexp"
)

import "github.com/sbxbroker/broker/protocol"

// Delegate mints a delegation token for one sandbox.
func (c *Client) Delegate(ctx context.Context, ref string, req protocol.MintRequest) (protocol.MintResponse, error) {
	var out protocol.MintResponse
	return out, c.do(ctx, http.MethodPost, sandboxPath(ref, "delegations"), nil, req, &out)
}

// ListDelegations lists the metadata of a sandbox's unexpired tokens.
func (c *Client) ListDelegations(ctx context.Context, ref string) (protocol.ListDelegationsResponse, error) {
	var out protocol.ListDelegationsResponse
	return out, c.do(ctx, http.MethodGet, sandboxPath(ref, "delegations"), nil, nil, &out)
}

// Revoke revokes one token by jti; open dataplane connections using it close within a second.
func (c *Client) Revoke(ctx context.Context, ref, jti string) (protocol.RevokeResponse, error) {
	var out protocol.RevokeResponse
	return out, c.do(ctx, http.MethodDelete, sandboxPath(ref, "delegations", url.PathEscape(jti)), nil, nil, &out)
}

// RevokeAll revokes every token of a sandbox.
func (c *Client) RevokeAll(ctx context.Context, ref string) (protocol.RevokeResponse, error) {
	var out protocol.RevokeResponse
	return out, c.do(ctx, http.MethodDelete, sandboxPath(ref, "delegations"), nil, nil, &out)
}

// Introspect asks whether a delegation token is active, and for which sandbox and scopes. Agent
// servers call it with their own API key before trusting a run-config block: a token of another org
// is inactive.
func (c *Client) Introspect(ctx context.Context, token string) (protocol.IntrospectResponse, error) {
	var out protocol.IntrospectResponse
	return out, c.do(ctx, http.MethodPost, "/v1/tokens/introspect", nil, protocol.IntrospectRequest{Token: token}, &out)
}

var threadIDRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,54}[a-z0-9])?$`)

// ThreadSandboxName is the name of a thread's own sandbox: "thread-<id>" when the thread id is a
// short lowercase label, else "thread-" and a hash of it. One thread, one name, always.
func ThreadSandboxName(threadID string) string {
	if threadIDRE.MatchString(threadID) {
		return "thread-" + threadID
	}
	h := sha256.Sum256([]byte(threadID))
	return "thread-" + hex.EncodeToString(h[:12])
}
