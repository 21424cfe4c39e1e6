// Package delegation owns the broker's delegation credentials: the Ed25519 signing keyring and its
// JWKS, minting and verifying delegation tokens (JWT, alg EdDSA, typ protocol.TokenType), the map from
// dataplane operations to scopes, and the command allowlist policy a token may carry.
//
// Every token check in the broker goes through one function, (*Verifier).Verify, and every rejection it
// returns is a *protocol.Error whose code names the check that failed (see protocol/errors.go). The
// only other error it returns wraps ErrRevocationState, for a failure of the revocation State itself.
//
// The keyring, minting, verification and policy touch no HTTP, Redis or logging: revocation state
// (the jti deny-list and each sandbox's token generation) is consulted through the State interface.
// Service (service.go) is the one part on Redis: it implements State, records what was minted,
// revokes, and announces revocations to every broker. It also keeps the broker's one cache of
// tokens (recent.go): the revocation state read at most once per RecentTTL per token for the
// dataplane's upgrade, evicted at once by the revocations this broker makes or is told of.
// Nothing in this package ever puts a token or a key into an error message.
package delegation
