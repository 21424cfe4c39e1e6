package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// ErrUIDsExhausted means every host uid of the configured range belongs to a sandbox.
var ErrUIDsExhausted = errors.New("store: every sandbox uid of the range is in use")

// UIDRange is the host uids (and gids, the same numbers) sandboxes get one each: First..Last
// inclusive. Skip, when inside the range, is never handed out (the shared uid of sandboxes recorded
// before each got its own: their files may still belong to it). The zero value means no allocation.
type UIDRange struct {
	First, Last, Skip int
}

// Size is how many uids the range can hand out.
func (r UIDRange) Size() int {
	if r.First <= 0 || r.Last < r.First {
		return 0
	}
	n := r.Last - r.First + 1
	if r.Skip >= r.First && r.Skip <= r.Last {
		n--
	}
	return n
}

// The uid allocation lives outside every org (a host uid is one per host, whichever org's sandbox
// holds it) under one hash tag, so the script's keys share a Cluster slot. Every broker on one Redis
// draws from the same table: two brokers never hand out the same uid, even with overlapping ranges.
const (
	// uidOwnersKey is a hash of uid -> "org/id" of the sandbox holding it.
	uidOwnersKey = "sbx:{uids}:owners"
	// uidByOwnerKey is a hash of "org/id" -> uid, so that a retried allocation for one sandbox
	// returns its uid instead of taking a second.
	uidByOwnerKey = "sbx:{uids}:by-owner"
	// uidNextKey is where the next allocation starts looking.
	uidNextKey = "sbx:{uids}:next"
)

// allocUIDScript hands the sandbox ARGV[4] a free uid of ARGV[1]..ARGV[2], never ARGV[3].
// KEYS: 1 owners, 2 by-owner, 3 next. Answers the uid, or -1 when the range is full.
// Invariant: owners[uid] = o iff by-owner[o] = uid; a uid has at most one owner. The search starts
// after the uid handed out last and wraps, so a released uid comes back only after every other free
// uid of the range was handed out: whatever of its old sandbox the kernel still holds (a keyring
// being garbage collected, a process being reaped) has had the whole cycle to go.
var allocUIDScript = redis.NewScript(`
local first, last, skip, owner = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local have = redis.call('HGET', KEYS[2], owner)
if have then return tonumber(have) end
local n = last - first + 1
local cur = tonumber(redis.call('GET', KEYS[3]) or first) or first
if cur < first or cur > last then cur = first end
for i = 0, n - 1 do
  local u = first + (cur - first + i) % n
  if u ~= skip and redis.call('HSETNX', KEYS[1], tostring(u), owner) == 1 then
    redis.call('HSET', KEYS[2], owner, u)
    redis.call('SET', KEYS[3], u + 1)
    return u
  end
end
return -1
`)

// releaseUIDScript frees the uid sandbox ARGV[1] holds. KEYS: 1 owners, 2 by-owner.
// Answers the uid it freed, or 0 when the sandbox held none (already released).
var releaseUIDScript = redis.NewScript(`
local u = redis.call('HGET', KEYS[2], ARGV[1])
if not u then return 0 end
if redis.call('HGET', KEYS[1], u) == ARGV[1] then redis.call('HDEL', KEYS[1], u) end
redis.call('HDEL', KEYS[2], ARGV[1])
return tonumber(u)
`)

// reserveUIDScript gives uid ARGV[1] to sandbox ARGV[2] unless another sandbox holds it.
// KEYS: 1 owners, 2 by-owner. Answers the uid the sandbox holds now, or -1 when another holds
// ARGV[1]. Same invariant as allocUIDScript.
var reserveUIDScript = redis.NewScript(`
local have = redis.call('HGET', KEYS[2], ARGV[2])
if have then return tonumber(have) end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
return tonumber(ARGV[1])
`)

// ReserveUID records that sandbox id of org holds uid: for files on disk that belong to it while
// Redis lost the table (flushed, replaced), so that the uid is not handed to another sandbox. It
// answers the uid the sandbox holds (its old one if the table still has it) and an error when
// another sandbox holds uid.
func (s *Store) ReserveUID(ctx context.Context, uid int, org, id string) (int, error) {
	got, err := reserveUIDScript.Run(ctx, s.rdb, []string{uidOwnersKey, uidByOwnerKey}, uid, uidOwner(org, id)).Int()
	if err != nil {
		return 0, fmt.Errorf("store: reserve uid %d for %s: %w", uid, id, err)
	}
	if got < 0 {
		return 0, fmt.Errorf("store: uid %d, which %s's files belong to, is held by another sandbox", uid, id)
	}
	return got, nil
}

func uidOwner(org, id string) string { return org + "/" + id }

// AllocateUID gives sandbox id of org a host uid of r that no other sandbox holds, atomically across
// every broker on this Redis. Asking again for the same sandbox answers the same uid. A full range
// is ErrUIDsExhausted.
func (s *Store) AllocateUID(ctx context.Context, r UIDRange, org, id string) (int, error) {
	if r.Size() == 0 {
		return 0, fmt.Errorf("store: the sandbox uid range %d-%d is empty", r.First, r.Last)
	}
	uid, err := allocUIDScript.Run(ctx, s.rdb, []string{uidOwnersKey, uidByOwnerKey, uidNextKey},
		r.First, r.Last, r.Skip, uidOwner(org, id)).Int()
	if err != nil {
		return 0, fmt.Errorf("store: allocate a uid for %s: %w", id, err)
	}
	if uid < 0 {
		return 0, fmt.Errorf("%w (%d-%d, %d uids)", ErrUIDsExhausted, r.First, r.Last, r.Size())
	}
	return uid, nil
}

// ReleaseUID frees the uid sandbox id of org holds, whether or not its record names it (a start
// that took one and crashed before recording it); it is idempotent. Call it only once nothing of the
// sandbox is left on its host (processes ended, files removed).
func (s *Store) ReleaseUID(ctx context.Context, org, id string) error {
	if err := releaseUIDScript.Run(ctx, s.rdb, []string{uidOwnersKey, uidByOwnerKey}, uidOwner(org, id)).Err(); err != nil {
		return fmt.Errorf("store: release the uid of %s: %w", id, err)
	}
	return nil
}

// UIDOwner answers "org/id" of the sandbox holding uid, or "" when it is free.
func (s *Store) UIDOwner(ctx context.Context, uid int) (string, error) {
	v, err := s.rdb.HGet(ctx, uidOwnersKey, fmt.Sprint(uid)).Result()
	if isNil(err) {
		return "", nil
	}
	return v, err
}
