package store

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base32"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// API keys look like sbk_<id>_<secret>. The id finds the record in one lookup; only a SHA-256 of the
// whole key is stored and it is compared in constant time. Keys are 256-bit random, so a fast hash
// is enough (a slow KDF would only slow down every request).
const apiKeyPrefix = "sbk_"

var (
	// ErrBadKey is an API key that is malformed, unknown or revoked. Callers must not say which.
	ErrBadKey = errors.New("store: invalid API key")
	// ErrInvalidOrg is an org name outside the allowed syntax.
	ErrInvalidOrg = errors.New("store: invalid org name")
)

var orgNameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// ValidOrg reports whether org is a lowercase DNS label (it becomes part of every Redis key).
func ValidOrg(org string) bool { return orgNameRE.MatchString(org) }

// APIKey is an API key's record; the secret itself is never stored.
type APIKey struct {
	ID        string
	Org       string
	Name      string
	CreatedAt time.Time
	RevokedAt time.Time // zero while valid
}

// KeyID extracts the id part of a presented key, or "" if it does not look like one of ours. It is
// safe to log.
func KeyID(key string) string {
	rest, ok := strings.CutPrefix(key, apiKeyPrefix)
	if !ok {
		return ""
	}
	id, secret, ok := strings.Cut(rest, "_")
	if !ok || len(id) != 16 || len(secret) < 32 {
		return ""
	}
	return id
}

// LooksLikeAPIKey reports whether a bearer credential is an API key rather than a token.
func LooksLikeAPIKey(s string) bool { return strings.HasPrefix(s, apiKeyPrefix) }

func hashKey(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}

// CreateAPIKey makes a key for org (creating the org if new) and returns the key in clear, the only
// time it exists outside the caller.
func (s *Store) CreateAPIKey(ctx context.Context, org, name string, now time.Time) (string, APIKey, error) {
	if !ValidOrg(org) {
		return "", APIKey{}, fmt.Errorf("%w %q: use lowercase letters, digits and '-', at most 63", ErrInvalidOrg, org)
	}
	idb := make([]byte, 10)
	secret := make([]byte, 32)
	rand.Read(idb)
	rand.Read(secret)
	id := strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(idb))
	key := apiKeyPrefix + id + "_" + base64.RawURLEncoding.EncodeToString(secret)
	k := APIKey{ID: id, Org: org, Name: name, CreatedAt: now.UTC().Truncate(time.Millisecond)}
	// The three keys live in different Cluster slots, so no MULTI: the indexes go first and the key
	// itself last, which is all Authenticate reads. A failure between them leaves an index entry
	// without a key, which listing skips.
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.SAdd(ctx, OrgsKey, org)
		p.SAdd(ctx, OrgAPIKeysKey(org), id)
		return nil
	})
	if err == nil {
		err = s.rdb.HSet(ctx, APIKeyKey(id), "org", org, "name", name, "hash", hashKey(key), "created", ms(now), "revoked", 0).Err()
	}
	if err != nil {
		return "", APIKey{}, fmt.Errorf("store: create API key: %w", err)
	}
	return key, k, nil
}

// HashKey is the stored form of a key: a hex SHA-256. Safe to keep in memory and to compare.
func HashKey(key string) string { return hashKey(key) }

// Authenticate checks a presented key and returns its record. Any failure is ErrBadKey.
func (s *Store) Authenticate(ctx context.Context, key string) (APIKey, error) {
	id := KeyID(key)
	if id == "" {
		return APIKey{}, ErrBadKey
	}
	m, err := s.rdb.HGetAll(ctx, APIKeyKey(id)).Result()
	if err != nil {
		return APIKey{}, fmt.Errorf("store: authenticate: %w", err)
	}
	want := m["hash"]
	if subtle.ConstantTimeCompare([]byte(hashKey(key)), []byte(want)) != 1 || want == "" || atoi(m["revoked"]) != 0 {
		return APIKey{}, ErrBadKey
	}
	return apiKeyFromMap(id, m), nil
}

func apiKeyFromMap(id string, m map[string]string) APIKey {
	return APIKey{ID: id, Org: m["org"], Name: m["name"], CreatedAt: fromMS(m["created"]), RevokedAt: fromMS(m["revoked"])}
}

// APIKeyByID reads a key's record (revoked ones included).
func (s *Store) APIKeyByID(ctx context.Context, id string) (APIKey, error) {
	m, err := s.rdb.HGetAll(ctx, APIKeyKey(id)).Result()
	if err != nil {
		return APIKey{}, fmt.Errorf("store: read API key: %w", err)
	}
	if m["org"] == "" {
		return APIKey{}, ErrNotFound
	}
	return apiKeyFromMap(id, m), nil
}

// ListAPIKeys lists the keys of org, or of every org when org is "", sorted by org then creation.
func (s *Store) ListAPIKeys(ctx context.Context, org string) ([]APIKey, error) {
	orgs := []string{org}
	if org == "" {
		var err error
		if orgs, err = s.Orgs(ctx); err != nil {
			return nil, err
		}
	}
	var out []APIKey
	for _, o := range orgs {
		ids, err := s.rdb.SMembers(ctx, OrgAPIKeysKey(o)).Result()
		if err != nil {
			return nil, fmt.Errorf("store: list API keys: %w", err)
		}
		for _, id := range ids {
			k, err := s.APIKeyByID(ctx, id)
			if err != nil {
				continue // removed between the two reads
			}
			out = append(out, k)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Org != out[j].Org {
			return out[i].Org < out[j].Org
		}
		return out[i].CreatedAt.Before(out[j].CreatedAt)
	})
	return out, nil
}

// RevokeAPIKey revokes a key by id. Revoking twice is not an error.
func (s *Store) RevokeAPIKey(ctx context.Context, id string, now time.Time) (APIKey, error) {
	k, err := s.APIKeyByID(ctx, id)
	if err != nil {
		return APIKey{}, err
	}
	if k.RevokedAt.IsZero() {
		if err := s.rdb.HSet(ctx, APIKeyKey(id), "revoked", ms(now)).Err(); err != nil {
			return APIKey{}, fmt.Errorf("store: revoke API key: %w", err)
		}
		// Brokers cache verified keys briefly; tell them now (the cache's short TTL covers a lost message).
		s.Publish(ctx, APIKeyRevokedChannel, id)
		k.RevokedAt = now.UTC().Truncate(time.Millisecond)
	}
	return k, nil
}

// Orgs lists every org, sorted.
func (s *Store) Orgs(ctx context.Context) ([]string, error) {
	orgs, err := s.rdb.SMembers(ctx, OrgsKey).Result()
	if err != nil {
		return nil, fmt.Errorf("store: list orgs: %w", err)
	}
	sort.Strings(orgs)
	return orgs, nil
}
