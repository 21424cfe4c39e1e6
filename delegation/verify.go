package delegation

import (
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/sbxbroker/broker/protocol"
)

// State is the revocation state: the jti deny-list and each sandbox's current token generation.
//
// CheckRevocation returns nil when the token is still live; a *protocol.Error when it is not
// (token_revoked for a denied jti or a generation older than the sandbox's current one; not_found
// when the sandbox is gone), which Verify returns unchanged; or any other error when the state could
// not be read, which Verify wraps in ErrRevocationState. It is called only for tokens that passed
// every other check, so c is fully verified.
type State interface {
	CheckRevocation(ctx context.Context, c *Claims) error
}

// ErrRevocationState is wrapped around an infrastructure error from State (Redis unreachable, ...).
// It is the only Verify error that is not a *protocol.Error: the caller answers it as unavailable
// (and logs the cause), never as a rejection of the token.
var ErrRevocationState = errors.New("delegation: revocation state unavailable")

// Verifier checks delegation tokens. It is safe for concurrent use.
type Verifier struct {
	keys   *Keyring
	cfg    Config
	state  State
	parser *jwt.Parser
}

// NewVerifier returns a Verifier for the tokens an Issuer with the same Config mints. state may be nil:
// then Verify does every check except revocation, which is only right for tests of the pure checks
// and for tools that never act on a token.
func NewVerifier(keys *Keyring, cfg Config, state State) (*Verifier, error) {
	if keys == nil {
		return nil, errors.New("delegation: NewVerifier needs a keyring")
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Verifier{
		keys:  keys,
		cfg:   cfg,
		state: state,
		parser: jwt.NewParser(
			jwt.WithValidMethods([]string{jwt.SigningMethodEdDSA.Alg()}),
			jwt.WithExpirationRequired(),
			jwt.WithIssuedAt(),
			jwt.WithIssuer(cfg.Issuer),
			jwt.WithAudience(cfg.Audience),
			jwt.WithLeeway(cfg.Leeway),
			jwt.WithStrictDecoding(),
			jwt.WithTimeFunc(cfg.Now),
		),
	}, nil
}

// Verify is the one check of a delegation token, used at dataplane upgrade and in introspection.
// It returns the token's claims, or an error: a *protocol.Error whose code names the first check
// that failed, in this order — token_too_large, token_malformed, token_bad_algorithm,
// token_bad_type, token_unknown_key, token_bad_signature, then token_expired, token_not_yet_valid,
// token_issued_in_future, token_bad_issuer, token_bad_audience, token_bad_claims, and finally what
// State.CheckRevocation says (see State) — or an error wrapping ErrRevocationState. No error
// message contains the token.
func (v *Verifier) Verify(ctx context.Context, token string) (*Claims, error) {
	return v.verify(ctx, token, "", "", false, v.state)
}

// verifyWith is Verify consulting state for revocation instead of the verifier's own.
func (v *Verifier) verifyWith(ctx context.Context, token string, state State) (*Claims, error) {
	return v.verify(ctx, token, "", "", false, state)
}

// Check does every check of Verify that needs no revocation state (signature, expiry, claims), and
// no more: what it says about a token, the token says itself. Use it where a token is refused
// anyway and only the reason matters (an owner route), so that its answer tells a holder nothing
// of revocations, sandboxes or other orgs.
func (v *Verifier) Check(token string) (*Claims, error) {
	c, perr := v.check(token)
	if perr != nil {
		return nil, perr
	}
	return c, nil
}

// VerifyBound is Verify for a request of one org and, unless sandboxID is empty, about one of its
// sandboxes: a token of any other org or sandbox is refused with token_wrong_sandbox before the
// revocation state is consulted, so that state never leaks across orgs.
func (v *Verifier) VerifyBound(ctx context.Context, token, org, sandboxID string) (*Claims, error) {
	return v.verify(ctx, token, org, sandboxID, true, v.state)
}

func (v *Verifier) verify(ctx context.Context, token, org, sandboxID string, bound bool, state State) (*Claims, error) {
	c, perr := v.check(token)
	if perr != nil {
		return nil, perr
	}
	if bound && (c.Org != org || (sandboxID != "" && c.Sbx != sandboxID)) {
		return nil, protocol.Errorf(protocol.CodeTokenSandbox, "the token was issued for another sandbox")
	}
	if state == nil {
		return c, nil
	}
	if err := state.CheckRevocation(ctx, c); err != nil {
		var pe *protocol.Error
		if errors.As(err, &pe) {
			return nil, pe
		}
		return nil, fmt.Errorf("%w: %w", ErrRevocationState, err)
	}
	return c, nil
}

var b64url = base64.RawURLEncoding.Strict()

// check does every check that needs no revocation state.
func (v *Verifier) check(token string) (*Claims, *protocol.Error) {
	// Size first: nothing is parsed from an oversized token.
	if len(token) > v.cfg.MaxTokenSize {
		return nil, protocol.Errorf(protocol.CodeTokenTooLarge, "token is %d bytes; the limit is %d", len(token), v.cfg.MaxTokenSize)
	}

	// Structure. encoding/base64 skips CR and LF even in strict mode, so the alphabet is checked
	// here: exactly three parts of [A-Za-z0-9_-], no padding, no whitespace.
	if strings.Count(token, ".") != 2 {
		return nil, errMalformed("a token is three base64url parts separated by two dots")
	}
	for i := 0; i < len(token); i++ {
		if c := token[i]; c != '.' && !isB64URL(c) {
			return nil, errMalformed("the token contains a character outside the base64url alphabet (padding and whitespace are not allowed)")
		}
	}
	h, rest, _ := strings.Cut(token, ".")
	p, s, _ := strings.Cut(rest, ".")
	headerJSON, err := b64url.DecodeString(h)
	if err != nil {
		return nil, errMalformed("the header is not valid base64url")
	}
	payloadJSON, err := b64url.DecodeString(p)
	if err != nil {
		return nil, errMalformed("the payload is not valid base64url")
	}
	// An empty signature part stays structurally valid, so that an unsigned (alg none) token is
	// reported as what it is, a bad algorithm.
	sig, err := b64url.DecodeString(s)
	if err != nil {
		return nil, errMalformed("the signature is not valid base64url")
	}
	// A map, not a struct: encoding/json matches struct fields case-insensitively, and golang-jwt
	// reads the header as a map, so both must see the same "alg".
	var header map[string]json.RawMessage
	if err := json.Unmarshal(headerJSON, &header); err != nil || header == nil {
		return nil, errMalformed("the header is not a JSON object")
	}
	if !isJSONObject(payloadJSON) {
		return nil, errMalformed("the payload is not a JSON object")
	}
	// RFC 7515 §4.1.11: a critical extension we do not understand means reject; we understand none.
	if _, ok := header["crit"]; ok {
		return nil, errMalformed("the header lists critical extensions (crit); none is supported")
	}

	// Header checks, all before any key is touched.
	if alg, _ := headerString(header, "alg"); alg != jwt.SigningMethodEdDSA.Alg() {
		return nil, protocol.Errorf(protocol.CodeTokenAlgorithm, "the token's algorithm must be EdDSA")
	}
	if typ, _ := headerString(header, "typ"); typ != protocol.TokenType {
		return nil, protocol.Errorf(protocol.CodeTokenType, "the token's type (typ) must be %s", protocol.TokenType)
	}
	kid, ok := headerString(header, "kid")
	if !ok || kid == "" {
		return nil, protocol.Errorf(protocol.CodeTokenUnknownKey, "the token names no signing key (kid)")
	}
	now := v.cfg.Now()
	pub, ok := v.keys.PublicKey(kid, now)
	if !ok {
		v.keys.reloadOnMiss()
		if pub, ok = v.keys.PublicKey(kid, now); !ok {
			return nil, protocol.Errorf(protocol.CodeTokenUnknownKey, "the token's signing key is unknown or retired")
		}
	}

	// NumericDate claims must be JSON integers: golang-jwt also takes fractions and numeric strings,
	// so a token could say "9999999999" where every other verifier would refuse it.
	if name, ok := nonIntegerTime(payloadJSON); !ok {
		if !ed25519.Verify(pub, []byte(token[:len(h)+1+len(p)]), sig) {
			return nil, protocol.Errorf(protocol.CodeTokenSignature, "the token's signature is not valid")
		}
		return nil, errClaims("the token's " + name + " must be an integer number of seconds")
	}

	// Signature and registered claims, by golang-jwt.
	c := new(Claims)
	_, err = v.parser.ParseWithClaims(token, c, func(t *jwt.Token) (any, error) {
		// Only ever Ed25519, whatever else may be registered under the name "EdDSA".
		if t.Method != jwt.SigningMethodEdDSA {
			return nil, errors.New("unexpected signing method")
		}
		return pub, nil
	})
	if err != nil {
		return nil, v.mapParseError(err, c, pub, token[:len(h)+1+len(p)], sig)
	}

	// One expiry rule for every use of a token (dataplane, introspection): dead from exp on, on this
	// broker's clock. The leeway covers clock skew on nbf and iat only: a token minted on a broker
	// whose clock is ahead is usable at once, but no token outlives its exp anywhere.
	if !now.Before(c.ExpiresAt.Time) {
		return nil, protocol.Errorf(protocol.CodeTokenExpired, "the token expired at %s", c.ExpiresAt.UTC().Format(time.RFC3339))
	}
	// The lifetime a token claims is bounded like the one Mint grants: a token living longer was not
	// minted under this configuration (or its MaxTTL was lowered since, which then applies).
	if c.IssuedAt == nil {
		return nil, errClaims("the token has no issue time (iat)")
	}
	if life := c.ExpiresAt.Sub(c.IssuedAt.Time); life > v.cfg.MaxTTL {
		return nil, errClaims(fmt.Sprintf("the token's lifetime (exp - iat) is %v, longer than this broker's maximum token lifetime %v", life, v.cfg.MaxTTL))
	}

	// Our claims. Mint never makes a token that fails these; one that does was not made by Mint.
	switch {
	case c.ID == "":
		return nil, errClaims("the token has no id (jti)")
	case c.Subject == "":
		return nil, errClaims("the token has no subject (sub)")
	case c.KeyID() == "":
		// Revocation of the minting key is checked by this id: a token naming none could not be.
		return nil, errClaims("the token's subject (sub) names no API key")
	case c.Org == "":
		return nil, errClaims("the token has no org")
	case c.Sbx == "":
		return nil, errClaims("the token has no sandbox (sbx)")
	case c.Gen < 1:
		return nil, errClaims("the token has no valid generation (gen must be 1 or more)")
	case c.Scope == "":
		return nil, errClaims("the token grants no scope")
	}
	// Single spaces only, so that Scopes and HasScope read the claim the same way.
	words := strings.Split(c.Scope, " ")
	if _, why := canonicalScopes(words); why != "" {
		return nil, errClaims("the token's scope claim is not valid")
	}
	if why := checkAllowCmd(c.Cmd); why != "" {
		return nil, errClaims("the token's command allowlist (cmd) is not valid")
	}
	return c, nil
}

// mapParseError maps a golang-jwt error to the code of the check that failed. signed is the signing
// input (header.payload) and sig the decoded signature.
func (v *Verifier) mapParseError(err error, c *Claims, pub ed25519.PublicKey, signed string, sig []byte) *protocol.Error {
	switch {
	case errors.Is(err, jwt.ErrTokenMalformed):
		// Our structural checks passed, so golang-jwt failed decoding the payload into Claims (a claim
		// of the wrong type), which it does before checking the signature. Keep our order: a bad
		// signature is reported as such.
		if !ed25519.Verify(pub, []byte(signed), sig) {
			return protocol.Errorf(protocol.CodeTokenSignature, "the token's signature is not valid")
		}
		return errClaims("a claim of the token has the wrong type")
	case errors.Is(err, jwt.ErrTokenSignatureInvalid):
		return protocol.Errorf(protocol.CodeTokenSignature, "the token's signature is not valid")
	case errors.Is(err, jwt.ErrTokenUnverifiable):
		return protocol.Errorf(protocol.CodeTokenAlgorithm, "the token's algorithm must be EdDSA")
	case errors.Is(err, jwt.ErrTokenInvalidClaims):
		return v.mapClaimsError(err, c)
	}
	return errMalformed("the token could not be parsed")
}

// mapClaimsError picks one code when golang-jwt reports one or more registered-claim failures (it
// joins them all). A missing iss or aud is reported as a bad issuer or audience, since that check is
// what failed.
func (v *Verifier) mapClaimsError(err error, c *Claims) *protocol.Error {
	switch {
	case c.ExpiresAt == nil:
		return errClaims("the token has no expiry (exp)")
	case errors.Is(err, jwt.ErrTokenExpired):
		return protocol.Errorf(protocol.CodeTokenExpired, "the token expired at %s", c.ExpiresAt.UTC().Format(time.RFC3339))
	case errors.Is(err, jwt.ErrTokenNotValidYet):
		return protocol.Errorf(protocol.CodeTokenNotYet, "the token is not valid before %s", c.NotBefore.UTC().Format(time.RFC3339))
	case errors.Is(err, jwt.ErrTokenUsedBeforeIssued):
		return protocol.Errorf(protocol.CodeTokenIssuedAt, "the token is issued in the future (%s); check the brokers' clocks",
			c.IssuedAt.UTC().Format(time.RFC3339))
	case c.Issuer == "" || errors.Is(err, jwt.ErrTokenInvalidIssuer):
		return protocol.Errorf(protocol.CodeTokenIssuer, "the token was not issued by %s", v.cfg.Issuer)
	case len(c.Audience) == 0 || len(c.Audience) == 1 && c.Audience[0] == "" || errors.Is(err, jwt.ErrTokenInvalidAudience):
		return protocol.Errorf(protocol.CodeTokenAudience, "the token is not for %s", v.cfg.Audience)
	}
	return errClaims("the token's registered claims are not valid")
}

func errMalformed(msg string) *protocol.Error {
	return &protocol.Error{Code: protocol.CodeTokenMalformed, Message: msg}
}

func errClaims(msg string) *protocol.Error {
	return &protocol.Error{Code: protocol.CodeTokenClaims, Message: msg}
}

// nonIntegerTime checks that exp, nbf and iat, where present, are JSON integers (no fraction, no
// exponent, not strings). It returns the first offending claim's name and false, or "", true. The
// payload is a valid JSON object (isJSONObject).
func nonIntegerTime(payload []byte) (string, bool) {
	var m map[string]json.RawMessage
	if json.Unmarshal(payload, &m) != nil {
		return "payload", false
	}
	for _, name := range []string{"exp", "nbf", "iat"} {
		raw, ok := m[name]
		if ok && !isJSONInteger(raw) {
			return name, false
		}
	}
	return "", true
}

// isJSONInteger reports whether b is a JSON number with neither fraction nor exponent.
func isJSONInteger(b []byte) bool {
	if len(b) > 0 && b[0] == '-' {
		b = b[1:]
	}
	if len(b) == 0 || len(b) > 1 && b[0] == '0' {
		return false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// headerString returns a string header parameter; ok is false when it is absent or not a string.
func headerString(h map[string]json.RawMessage, name string) (string, bool) {
	raw, ok := h[name]
	if !ok {
		return "", false
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

func isJSONObject(b []byte) bool {
	for _, c := range b {
		switch c {
		case ' ', '\t', '\n', '\r':
			continue
		case '{':
			return json.Valid(b)
		}
		return false
	}
	return false
}

func isB64URL(c byte) bool {
	return c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}
