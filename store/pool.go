package store

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// PoolOrg is the owner org of a warm-pool sandbox's host uid while it waits in a broker's pool
// (sandbox/pool.go): no org's, and no org can have this name (org names are lowercase letters,
// digits and '-'). A claim moves the uid to the claiming org's sandbox with TransferUID.
const PoolOrg = "~pool"

// transferUIDScript moves the uid that owner ARGV[1] holds to owner ARGV[2].
// KEYS: 1 owners, 2 by-owner. Answers the uid ARGV[2] holds now, or -1 when neither holds one.
// Same invariant as allocUIDScript (owners[uid] = o iff by-owner[o] = uid): the uid is never free
// in between, so no other sandbox can be given it while it changes hands, and a retry after a lost
// answer finds it moved and answers the same.
var transferUIDScript = redis.NewScript(`
local have = redis.call('HGET', KEYS[2], ARGV[2])
if have then return tonumber(have) end
local u = redis.call('HGET', KEYS[2], ARGV[1])
if not u then return -1 end
redis.call('HSET', KEYS[1], u, ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], u)
return tonumber(u)
`)

// TransferUID gives the host uid that sandbox id holds under fromOrg to the same sandbox under
// toOrg, atomically: a pooled sandbox's uid goes to the org that claimed it, or back to the pool
// when the claim did not happen. It answers the uid; a sandbox holding none under either org is an
// error.
func (s *Store) TransferUID(ctx context.Context, fromOrg, toOrg, id string) (int, error) {
	uid, err := transferUIDScript.Run(ctx, s.rdb, []string{uidOwnersKey, uidByOwnerKey}, uidOwner(fromOrg, id), uidOwner(toOrg, id)).Int()
	if err != nil {
		return 0, fmt.Errorf("store: move the uid of %s to %s: %w", id, toOrg, err)
	}
	if uid < 0 {
		return 0, fmt.Errorf("store: sandbox %s holds no uid under %s to move to %s", id, fromOrg, toOrg)
	}
	return uid, nil
}
