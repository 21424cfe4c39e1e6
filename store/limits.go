package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Limits are an org's fair-share limits. Zero means no limit.
type Limits struct {
	// MaxRunning bounds the org's sandboxes that are provisioning or running at once, across every
	// broker sharing the Redis (enforced inside the create and resume scripts).
	MaxRunning int
	// MaxSandboxes bounds the org's sandboxes in any state (enforced inside the create script):
	// stopped ones keep their files and their host uid, so without it one org could take every
	// uid of the broker's range, and every other org's creates would fail.
	MaxSandboxes int
	// RPS is the requests per second each credential of the org may make, per broker.
	RPS int
	// Burst is how many requests a credential may make at once before RPS paces it.
	Burst int
	// Connections bounds the org's open dataplane connections, per broker.
	Connections int
}

// Limit names: the fields of the org's limits hash, the flags' and the API's names.
const (
	LimitMaxRunning   = "max_running"
	LimitMaxSandboxes = "max_sandboxes"
	LimitRPS          = "rps"
	LimitBurst        = "burst"
	LimitConnections  = "connections"
)

// LimitNames lists the limits an org can have, in display order.
var LimitNames = []string{LimitMaxRunning, LimitMaxSandboxes, LimitRPS, LimitBurst, LimitConnections}

// MaxLimit bounds any one limit's value, so that a typo cannot overflow anything downstream.
const MaxLimit = 1_000_000

// Get reads the limit named name (one of LimitNames).
func (l Limits) Get(name string) int {
	switch name {
	case LimitMaxRunning:
		return l.MaxRunning
	case LimitMaxSandboxes:
		return l.MaxSandboxes
	case LimitRPS:
		return l.RPS
	case LimitBurst:
		return l.Burst
	case LimitConnections:
		return l.Connections
	}
	return 0
}

// With is l with an org's own limits (OrgLimits) in place of its values.
func (l Limits) With(own map[string]int) Limits {
	for name, v := range own {
		l.set(name, v)
	}
	return l
}

func (l *Limits) set(name string, v int) {
	switch name {
	case LimitMaxRunning:
		l.MaxRunning = v
	case LimitMaxSandboxes:
		l.MaxSandboxes = v
	case LimitRPS:
		l.RPS = v
	case LimitBurst:
		l.Burst = v
	case LimitConnections:
		l.Connections = v
	}
}

// ErrQuota means an org is at one of its limits; QuotaError says which.
var ErrQuota = errors.New("store: org limit reached")

// QuotaError is a create or resume refused because the org already has Limit sandboxes
// provisioning or running (Name max_running), or Limit sandboxes at all (Name max_sandboxes).
type QuotaError struct {
	Org   string
	Name  string
	Limit int
}

func (e *QuotaError) Error() string {
	return fmt.Sprintf("store: org %s is at its %s limit (%d)", e.Org, e.Name, e.Limit)
}

// Is lets errors.Is(err, ErrQuota) match.
func (e *QuotaError) Is(target error) bool { return target == ErrQuota }

func quotaOrScriptErr(org, code, detail string) error {
	switch code {
	case "quota":
		n, _ := strconv.Atoi(detail)
		return &QuotaError{Org: org, Name: LimitMaxRunning, Limit: n}
	case "quota_sandboxes":
		n, _ := strconv.Atoi(detail)
		return &QuotaError{Org: org, Name: LimitMaxSandboxes, Limit: n}
	}
	return scriptErr(code, detail)
}

// luaClaim adds id to the org's active set unless the set is at the org's max_running (its own
// limit in the limits hash, else the broker's default; 0 = none), and answers the limit when it is.
// Scripts that use it check before they change anything, so a refused claim changes nothing.
const luaClaim = `
local function claim(active, limits, default, id)
  local max = tonumber(redis.call('HGET', limits, 'max_running') or default) or 0
  if max > 0 and redis.call('SISMEMBER', active, id) == 0 and redis.call('SCARD', active) >= max then
    return tostring(max)
  end
  redis.call('SADD', active, id)
  return nil
end
`

// SetDefaultLimits sets the limits of orgs that have none of their own: the broker's flags. Call it
// once, before serving.
func (s *Store) SetDefaultLimits(l Limits) { s.defaults.Store(&l) }

// DefaultLimits are the limits of orgs that have none of their own (none at all until
// SetDefaultLimits).
func (s *Store) DefaultLimits() Limits {
	if l := s.defaults.Load(); l != nil {
		return *l
	}
	return Limits{}
}

// OrgLimits reads the limits the org has of its own (set by `broker orgs set-limits`): a value per
// limit name; a name absent takes the default.
func (s *Store) OrgLimits(ctx context.Context, org string) (map[string]int, error) {
	m, err := s.rdb.HGetAll(ctx, LimitsKey(org)).Result()
	if err != nil {
		return nil, fmt.Errorf("store: org limits: %w", err)
	}
	out := make(map[string]int, len(m))
	for _, name := range LimitNames {
		if v, ok := m[name]; ok {
			if n, err := strconv.Atoi(v); err == nil {
				out[name] = n
			}
		}
	}
	return out, nil
}

// EffectiveLimits are the org's limits: its own where it has them, else the defaults.
func (s *Store) EffectiveLimits(ctx context.Context, org string) (Limits, error) {
	own, err := s.OrgLimits(ctx, org)
	if err != nil {
		return Limits{}, err
	}
	return s.DefaultLimits().With(own), nil
}

// SetOrgLimits gives org limits of its own (set) and returns the names in clear to the defaults.
// The org must exist (have had an API key). Values are 0 (no limit) to MaxLimit.
func (s *Store) SetOrgLimits(ctx context.Context, org string, set map[string]int, clear []string) error {
	known := map[string]bool{}
	for _, n := range LimitNames {
		known[n] = true
	}
	args := []any{}
	for name, v := range set {
		if !known[name] {
			return fmt.Errorf("store: unknown limit %q", name)
		}
		if v < 0 || v > MaxLimit {
			return fmt.Errorf("store: limit %s = %d is outside 0..%d", name, v, MaxLimit)
		}
		args = append(args, name, v)
	}
	for _, name := range clear {
		if !known[name] {
			return fmt.Errorf("store: unknown limit %q", name)
		}
	}
	ok, err := s.rdb.SIsMember(ctx, OrgsKey, org).Result()
	if err != nil {
		return fmt.Errorf("store: org limits: %w", err)
	}
	if !ok {
		return ErrNotFound
	}
	_, err = s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		if len(clear) > 0 {
			p.HDel(ctx, LimitsKey(org), clear...)
		}
		if len(args) > 0 {
			p.HSet(ctx, LimitsKey(org), args...)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("store: set org limits: %w", err)
	}
	return nil
}

// Running counts the org's sandboxes that are provisioning or running: what max_running bounds.
func (s *Store) Running(ctx context.Context, org string) (int, error) {
	n, err := s.rdb.SCard(ctx, ActiveKey(org)).Result()
	if err != nil {
		return 0, fmt.Errorf("store: running count: %w", err)
	}
	return int(n), nil
}

// Sandboxes counts the org's sandboxes in any state: what max_sandboxes bounds (the create script
// counts the same set).
func (s *Store) Sandboxes(ctx context.Context, org string) (int, error) {
	n, err := s.rdb.ZCard(ctx, AllKey(org)).Result()
	if err != nil {
		return 0, fmt.Errorf("store: sandbox count: %w", err)
	}
	return int(n), nil
}

// recountScript rebuilds the org's active set from the records' statuses, which are the truth.
// KEYS: 1 all, 2 active. ARGV: 1 sandbox key prefix. Answers the count.
// It makes the set right for records written before the set existed; it is atomic, so running it
// beside creates and resumes on other brokers is safe.
var recountScript = redis.NewScript(`
redis.call('DEL', KEYS[2])
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local st = redis.call('HGET', ARGV[1] .. id, 'status')
  if st == 'provisioning' or st == 'running' then redis.call('SADD', KEYS[2], id) end
end
return redis.call('SCARD', KEYS[2])
`)

// RecountRunning rebuilds every org's count of provisioning and running sandboxes from their
// records. A broker runs it at start, so sandboxes recorded by an older broker count.
func (s *Store) RecountRunning(ctx context.Context) error {
	orgs, err := s.rdb.SMembers(ctx, OrgsKey).Result()
	if err != nil {
		return fmt.Errorf("store: recount running: %w", err)
	}
	for _, org := range orgs {
		if err := recountScript.Run(ctx, s.rdb, []string{AllKey(org), ActiveKey(org)}, sandboxPrefix(org)).Err(); err != nil {
			return fmt.Errorf("store: recount running of %s: %w", org, err)
		}
	}
	return nil
}

// RunningByOrg counts the sandboxes provisioning or running of every org (of at most maxOrgs), in
// one pipeline.
func (s *Store) RunningByOrg(ctx context.Context, maxOrgs int) (map[string]int, error) {
	orgs, err := s.rdb.SRandMemberN(ctx, OrgsKey, int64(maxOrgs)).Result()
	if err != nil {
		return nil, fmt.Errorf("store: orgs: %w", err)
	}
	cmds := make([]*redis.IntCmd, len(orgs))
	_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, org := range orgs {
			cmds[i] = p.SCard(ctx, ActiveKey(org))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: running by org: %w", err)
	}
	out := make(map[string]int, len(orgs))
	for i, org := range orgs {
		out[org] = int(cmds[i].Val())
	}
	return out, nil
}
