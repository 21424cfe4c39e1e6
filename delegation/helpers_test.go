package delegation

import (
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// clock is an injectable clock: tests move time forward instead of sleeping.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Date(2031, 5, 4, 12, 0, 0, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func newKeyring(t testing.TB, clk *clock) *Keyring {
	t.Helper()
	k, err := LoadOrCreateKeyring(filepath.Join(t.TempDir(), "keys"), clk.Now)
	if err != nil {
		t.Fatalf("LoadOrCreateKeyring: %v", err)
	}
	return k
}

func newIssuerVerifier(t testing.TB, k *Keyring, clk *clock, st State) (*Issuer, *Verifier) {
	t.Helper()
	cfg := Config{Now: clk.Now}
	is, err := NewIssuer(k, cfg)
	if err != nil {
		t.Fatal(err)
	}
	v, err := NewVerifier(k, cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return is, v
}

// mapState is an in-memory State for the verifier's tests: a jti deny-list and each sandbox's current
// generation. The real State, on Redis, is tested in the server package against a real redis-server.
type mapState struct {
	mu      sync.Mutex
	revoked map[string]bool  // jti -> revoked
	gens    map[string]int64 // sandbox id -> current generation
	err     error            // when set, every check fails with it (an unreachable Redis)
}

func newMapState() *mapState {
	return &mapState{revoked: map[string]bool{}, gens: map[string]int64{}}
}

func (s *mapState) CheckRevocation(_ context.Context, c *Claims) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return s.err
	}
	gen, ok := s.gens[c.Sbx]
	switch {
	case !ok:
		return protocol.Errorf(protocol.CodeNotFound, "sandbox not found")
	case s.revoked[c.ID]:
		return protocol.Errorf(protocol.CodeTokenRevoked, "the token was revoked")
	case c.Gen != gen:
		return protocol.Errorf(protocol.CodeTokenRevoked, "every token of the sandbox was revoked")
	}
	return nil
}

// craft builds a token from raw JSON-able header and claims, signed by sign (nil: empty signature),
// so that a test can put exactly one defect in it.
func craft(t testing.TB, header, claims any, sign func(signingInput []byte) []byte) string {
	t.Helper()
	h := segment(t, header)
	p := segment(t, claims)
	var sig []byte
	if sign != nil {
		sig = sign([]byte(h + "." + p))
	}
	return h + "." + p + "." + base64.RawURLEncoding.EncodeToString(sig)
}

func segment(t testing.TB, v any) string {
	t.Helper()
	if raw, ok := v.(json.RawMessage); ok {
		return base64.RawURLEncoding.EncodeToString(raw)
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

func edSigner(priv ed25519.PrivateKey) func([]byte) []byte {
	return func(in []byte) []byte { return ed25519.Sign(priv, in) }
}

// code returns the *protocol.Error code of err, failing when err is of another type: every rejection
// Verify returns must be a *protocol.Error.
func code(t testing.TB, err error) string {
	t.Helper()
	if err == nil {
		return ""
	}
	pe, ok := err.(*protocol.Error)
	if !ok {
		t.Fatalf("error is %T, not *protocol.Error: %v", err, err)
	}
	return pe.Code
}

// assertNoToken fails when an error message carries the token or any sizeable piece of it. It never
// prints the token itself.
func assertNoToken(t testing.TB, err error, token string) {
	t.Helper()
	if err == nil || token == "" {
		return
	}
	msg := err.Error()
	if strings.Contains(msg, token) {
		t.Fatalf("error message contains the token")
	}
	for i, part := range strings.Split(token, ".") {
		if len(part) >= 8 && strings.Contains(msg, part) {
			t.Fatalf("error message contains part %d of the token", i)
		}
	}
}

// headerOf decodes a token's header, for tests of what Mint writes.
func headerOf(t testing.TB, token string) map[string]any {
	t.Helper()
	h, _, _ := strings.Cut(token, ".")
	b, err := base64.RawURLEncoding.DecodeString(h)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

var errRedisDown = errors.New("dial tcp 127.0.0.1:6379: connection refused")
