package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Delegation tokens' state in Redis: what was minted for a sandbox (metadata by jti, never the
// token), the jti deny-list, and the one pipelined read that verification makes. The metadata is
// opaque here: delegation encodes and decodes it.

// ErrTokensFull means a sandbox's token record holds as many entries as a mint allowed.
var ErrTokensFull = errors.New("store: the sandbox's token record is full")

// recordTokenScript records a minted token's metadata unless the sandbox's record holds most
// entries already: the bound is checked and the entry written in one step, so mints racing at the
// bound cannot all pass it (each read the count below it before any wrote). A jti recorded already
// is written again whatever the count (a resend of this very call, its answer lost).
// KEYS: 1 the sandbox's delegations. ARGV: 1 jti, 2 metadata, 3 most entries (0: no bound).
// Answers the record's size after the write, or -1 when it was full and nothing was written.
var recordTokenScript = redis.NewScript(`
local most = tonumber(ARGV[3])
if most > 0 and redis.call('HLEN', KEYS[1]) >= most and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return -1
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HLEN', KEYS[1])
`)

// RecordToken records a minted token's metadata under its sandbox and answers how many tokens the
// sandbox's record now holds (one round trip). With most > 0, a record that holds most entries
// already takes no more: ErrTokensFull, and nothing is written.
func (s *Store) RecordToken(ctx context.Context, org, sandboxID, jti string, meta []byte, most int64) (int64, error) {
	size, err := recordTokenScript.Run(ctx, s.rdb, []string{DelegationsKey(org, sandboxID)}, jti, meta, most).Int64()
	if err != nil {
		return 0, fmt.Errorf("store: record token: %w", err)
	}
	if size < 0 {
		return 0, ErrTokensFull
	}
	return size, nil
}

// TokenCount answers how many tokens a sandbox's record holds, expired ones included.
func (s *Store) TokenCount(ctx context.Context, org, sandboxID string) (int64, error) {
	n, err := s.rdb.HLen(ctx, DelegationsKey(org, sandboxID)).Result()
	if err != nil {
		return 0, fmt.Errorf("store: count tokens: %w", err)
	}
	return n, nil
}

// Tokens reads the metadata of every token recorded for a sandbox, by jti.
func (s *Store) Tokens(ctx context.Context, org, sandboxID string) (map[string]string, error) {
	all, err := s.rdb.HGetAll(ctx, DelegationsKey(org, sandboxID)).Result()
	if err != nil {
		return nil, fmt.Errorf("store: read tokens: %w", err)
	}
	return all, nil
}

// Token reads one token's metadata; ErrNotFound when the sandbox has no such token recorded.
func (s *Store) Token(ctx context.Context, org, sandboxID, jti string) (string, error) {
	raw, err := s.rdb.HGet(ctx, DelegationsKey(org, sandboxID), jti).Result()
	if errors.Is(err, redis.Nil) {
		return "", ErrNotFound
	}
	if err != nil {
		return "", fmt.Errorf("store: read token: %w", err)
	}
	return raw, nil
}

// ForgetTokens removes tokens' metadata from a sandbox's record (expired ones: a revoked token's
// deny-list entry stays until it would have expired).
func (s *Store) ForgetTokens(ctx context.Context, org, sandboxID string, jtis ...string) error {
	if len(jtis) == 0 {
		return nil
	}
	if err := s.rdb.HDel(ctx, DelegationsKey(org, sandboxID), jtis...).Err(); err != nil {
		return fmt.Errorf("store: forget tokens: %w", err)
	}
	return nil
}

// DenyToken puts a jti on the org's deny-list for ttl (until the token would have expired anyway).
func (s *Store) DenyToken(ctx context.Context, org, jti string, ttl time.Duration) error {
	if err := s.rdb.Set(ctx, RevokedKey(org, jti), 1, ttl).Err(); err != nil {
		return fmt.Errorf("store: deny token: %w", err)
	}
	return nil
}

// TokensRevoked reads, in one round trip, which of an org's jtis are on the deny-list and which of
// the API keys (by id) exist in org unrevoked. Listing uses it.
func (s *Store) TokensRevoked(ctx context.Context, org string, jtis, keyIDs []string) (denied, liveKeys map[string]bool, err error) {
	denied, liveKeys = make(map[string]bool, len(jtis)), make(map[string]bool, len(keyIDs))
	if len(jtis)+len(keyIDs) == 0 {
		return denied, liveKeys, nil
	}
	pipe := s.rdb.Pipeline()
	ex := make([]*redis.IntCmd, len(jtis))
	for i, jti := range jtis {
		ex[i] = pipe.Exists(ctx, RevokedKey(org, jti))
	}
	keys := make([]*redis.SliceCmd, len(keyIDs))
	for i, id := range keyIDs {
		keys[i] = pipe.HMGet(ctx, APIKeyKey(id), "org", "revoked")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, nil, fmt.Errorf("store: read token revocations: %w", err)
	}
	for i, jti := range jtis {
		denied[jti] = ex[i].Val() == 1
	}
	for i, id := range keyIDs {
		liveKeys[id] = keyLive(keys[i], org)
	}
	return denied, liveKeys, nil
}

// TokenState is what decides whether a verified token is still good: its deny-list entry, its
// sandbox's token generation and status, and the state of the API key that minted it.
type TokenState struct {
	Denied bool
	// SandboxGone is set when the sandbox has no record (deleted, purged).
	SandboxGone bool
	Gen         int64
	Status      string
	// KeyLive: the minting key exists in the token's org and is not revoked.
	KeyLive bool
}

// TokenState reads a token's state in one pipelined round trip (verification does it at every
// dataplane upgrade, re-check and introspection). keyID names the API key that minted it ("" or an
// unknown id: not live).
func (s *Store) TokenState(ctx context.Context, org, sandboxID, jti, keyID string) (TokenState, error) {
	pipe := s.rdb.Pipeline()
	denied := pipe.Exists(ctx, RevokedKey(org, jti))
	state := pipe.HMGet(ctx, SandboxKey(org, sandboxID), "gen", "status")
	key := pipe.HMGet(ctx, APIKeyKey(keyID), "org", "revoked")
	if _, err := pipe.Exec(ctx); err != nil {
		return TokenState{}, err
	}
	vals := state.Val()
	genStr, _ := vals[0].(string)
	status, _ := vals[1].(string)
	gen, _ := strconv.ParseInt(genStr, 10, 64)
	return TokenState{Denied: denied.Val() == 1, SandboxGone: genStr == "", Gen: gen, Status: status, KeyLive: keyLive(key, org)}, nil
}

// keyLive reads an HMGET of an API key's org and revocation time: whether the key exists in org and
// is not revoked.
func keyLive(cmd *redis.SliceCmd, org string) bool {
	v := cmd.Val()
	if len(v) != 2 {
		return false
	}
	keyOrg, _ := v[0].(string)
	revoked, _ := v[1].(string)
	return keyOrg == org && (revoked == "" || revoked == "0")
}
