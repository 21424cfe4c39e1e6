package store

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// The sweep lock: one broker at a time sweeps. It is held with a token (the holder's) and an expiry,
// so a broker that dies without releasing it gives it up after ttl, and only its holder renews or
// releases it. Everything the sweeper does is re-checked in Lua anyway: two sweepers (a lock lost
// to a slow renewal) repeat idempotent work, nothing worse.

// lockScript takes the lock or renews it for its holder.
// KEYS: 1 lock. ARGV: 1 token, 2 ttl (ms). Answers 1 when the caller holds the lock.
var lockScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if cur == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
`)

// unlockScript releases the lock only if the caller holds it. KEYS: 1 lock. ARGV: 1 token.
var unlockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
`)

// HoldSweepLock takes the sweep lock for token, or renews it if token holds it already, for ttl.
// It answers whether token holds the lock now.
func (s *Store) HoldSweepLock(ctx context.Context, token string, ttl time.Duration) (bool, error) {
	n, err := lockScript.Run(ctx, s.rdb, []string{SweepLockKey}, token, ttl.Milliseconds()).Int()
	if err != nil {
		return false, fmt.Errorf("store: sweep lock: %w", err)
	}
	return n == 1, nil
}

// ReleaseSweepLock gives the sweep lock up if token holds it; otherwise it does nothing.
func (s *Store) ReleaseSweepLock(ctx context.Context, token string) error {
	if err := unlockScript.Run(ctx, s.rdb, []string{SweepLockKey}, token).Err(); err != nil {
		return fmt.Errorf("store: release the sweep lock: %w", err)
	}
	return nil
}

// Ping checks that Redis answers.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("store: ping: %w", err)
	}
	return nil
}

// OrgExists reports whether org has ever had an API key (orgs are made by their first key).
func (s *Store) OrgExists(ctx context.Context, org string) (bool, error) {
	ok, err := s.rdb.SIsMember(ctx, OrgsKey, org).Result()
	if err != nil {
		return false, fmt.Errorf("store: read orgs: %w", err)
	}
	return ok, nil
}
