package store

import (
	"context"
	"fmt"

	"time"

	"github.com/redis/go-redis/v9"
)

// Nodes: every broker renews its node record (the URL it is reached at and its last beat on the
// lease clock) every few seconds, so a record lost with Redis' data comes back by itself, and a
// node that stops beating can be declared lost by any other broker, once.

// beatScript records one liveness beat of a node and its URL.
// KEYS: 1 urls, 2 seen, 3 lost. ARGV: 1 node, 2 url, 3 now (ms; "" = Redis TIME).
// Answers 1 when the node had been declared lost (it is back now), else 0.
var beatScript = redis.NewScript(luaClock + `
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], clock(ARGV[3]), ARGV[1])
return redis.call('SREM', KEYS[3], ARGV[1])
`)

// RegisterNode records a broker's URL and a liveness beat; back reports that the node had been
// declared lost and is not any more.
func (s *Store) RegisterNode(ctx context.Context, node, url string) (back bool, err error) {
	n, err := beatScript.Run(ctx, s.rdb, []string{NodesKey, NodesSeenKey, NodesLostKey}, node, url, s.nowArg()).Int()
	if err != nil {
		return false, fmt.Errorf("store: register node: %w", err)
	}
	return n == 1, nil
}

// declareScript declares lost every node other than the caller whose last beat is older than the
// silence allowed, each once: a node already declared is not answered again.
// KEYS: 1 seen, 2 lost. ARGV: 1 caller's node, 2 silence allowed (ms), 3 now ("" = Redis TIME).
// Answers the nodes declared lost by this call.
var declareScript = redis.NewScript(luaClock + `
local cutoff = clock(ARGV[3]) - tonumber(ARGV[2])
local out = {}
for _, node in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. cutoff)) do
  if node ~= ARGV[1] and redis.call('SADD', KEYS[2], node) == 1 then out[#out + 1] = node end
end
return out
`)

// DeclareLostNodes declares lost the nodes (other than self) silent for longer than silence, and
// answers those this call declared: exactly one broker gets each.
func (s *Store) DeclareLostNodes(ctx context.Context, self string, silence time.Duration) ([]string, error) {
	v, err := declareScript.Run(ctx, s.rdb, []string{NodesSeenKey, NodesLostKey}, self, silence.Milliseconds(), s.nowArg()).StringSlice()
	if err != nil {
		return nil, fmt.Errorf("store: declare lost nodes: %w", err)
	}
	return v, nil
}

// NodeLost reports whether node is declared lost now.
func (s *Store) NodeLost(ctx context.Context, node string) (bool, error) {
	lost, err := s.rdb.SIsMember(ctx, NodesLostKey, node).Result()
	if err != nil {
		return false, fmt.Errorf("store: node lost: %w", err)
	}
	return lost, nil
}

// markScript sets or clears the node-lost mark of one sandbox hosted by node.
// KEYS: 1 sandbox hash. ARGV: 1 node, 2 "1" to mark or "" to clear, 3 now ("" = Redis TIME).
// Answers 1 when it changed the mark. Invariant: only a record still hosted by node changes.
var markScript = redis.NewScript(luaClock + `
local cur = redis.call('HMGET', KEYS[1], 'node', 'node_lost', 'status')
if cur[1] ~= ARGV[1] or cur[3] == 'deleting' then return 0 end
local marked = (tonumber(cur[2]) or 0) > 0
if ARGV[2] == '1' then
  if marked then return 0 end
  redis.call('HSET', KEYS[1], 'node_lost', clock(ARGV[3]))
  return 1
end
if not marked then return 0 end
redis.call('HSET', KEYS[1], 'node_lost', 0)
return 1
`)

// MarkNodeLost sets (lost) or clears the node-lost mark of a sandbox still hosted by node, and
// answers the record after it when the mark changed.
func (s *Store) MarkNodeLost(ctx context.Context, org, id, node string, lost bool) (Record, bool, error) {
	arg := ""
	if lost {
		arg = "1"
	}
	n, err := markScript.Run(ctx, s.rdb, []string{SandboxKey(org, id)}, node, arg, s.nowArg()).Int()
	if err != nil {
		return Record{}, false, fmt.Errorf("store: mark node lost %s: %w", id, err)
	}
	if n == 0 {
		return Record{}, false, nil
	}
	rec, err := s.Get(ctx, org, id)
	return rec, err == nil, err
}

// NodeURL is the base URL of a broker, or ErrNotFound.
func (s *Store) NodeURL(ctx context.Context, node string) (string, error) {
	u, err := s.rdb.HGet(ctx, NodesKey, node).Result()
	if isNil(err) {
		return "", ErrNotFound
	}
	if err != nil {
		return "", fmt.Errorf("store: node url: %w", err)
	}
	return u, nil
}
