package server

import (
	"context"
	"crypto/subtle"
	"sync"
	"time"

	"github.com/sbxbroker/broker/store"
)

// keyCacheTTL bounds how long a revoked key can still work on a broker that missed the revocation
// announcement (normally eviction is immediate).
const keyCacheTTL = 2 * time.Second

// keyCache remembers recently verified API keys, saving a Redis round trip on every owner request
// (heartbeats above all). It holds only what Redis holds: the key's SHA-256 and its record.
type keyCache struct {
	store *store.Store
	now   func() time.Time
	mu    sync.Mutex
	byID  map[string]cachedKey
	// epoch counts evictions: a lookup that read Redis before one is not kept, since the
	// revocation it evicts for may have landed after the read.
	epoch uint64
}

type cachedKey struct {
	hash    string
	key     store.APIKey
	expires time.Time
	readAt  time.Time // when the read began (k.now)
}

func newKeyCache(st *store.Store) *keyCache {
	return &keyCache{store: st, now: time.Now, byID: map[string]cachedKey{}}
}

// authenticate is store.Authenticate behind the cache.
func (k *keyCache) authenticate(ctx context.Context, presented string) (store.APIKey, error) {
	key, _, err := k.authenticateAt(ctx, presented)
	return key, err
}

// authenticateAt is authenticate, and says when (on k.now) the read that answered began: before
// the call, the answer came from the cache.
func (k *keyCache) authenticateAt(ctx context.Context, presented string) (store.APIKey, time.Time, error) {
	id := store.KeyID(presented)
	if id == "" {
		return store.APIKey{}, time.Time{}, store.ErrBadKey
	}
	now := k.now()
	k.mu.Lock()
	c, ok := k.byID[id]
	epoch := k.epoch
	k.mu.Unlock()
	if ok && now.Before(c.expires) {
		if subtle.ConstantTimeCompare([]byte(store.HashKey(presented)), []byte(c.hash)) == 1 {
			return c.key, c.readAt, nil
		}
		return store.APIKey{}, time.Time{}, store.ErrBadKey
	}
	key, err := k.store.Authenticate(ctx, presented)
	if err != nil {
		return key, now, err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.epoch != epoch {
		return key, now, nil // answered as read, but not kept: an eviction came meanwhile
	}
	if len(k.byID) > 100000 {
		k.byID = map[string]cachedKey{} // bounded: many distinct keys only cost a few extra lookups
	}
	k.byID[id] = cachedKey{hash: store.HashKey(presented), key: key, expires: now.Add(keyCacheTTL), readAt: now}
	return key, now, nil
}

func (k *keyCache) evict(id string) {
	k.mu.Lock()
	k.epoch++
	delete(k.byID, id)
	k.mu.Unlock()
}

// evictAll forgets every key: revocations may have been missed (a pub/sub gap).
func (k *keyCache) evictAll() {
	k.mu.Lock()
	k.epoch++
	k.byID = map[string]cachedKey{}
	k.mu.Unlock()
}
