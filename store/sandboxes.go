package store

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Store is the Redis state. It is safe for concurrent use.
type Store struct {
	rdb     redis.UniversalClient
	leases  *leaseBatcher
	clock   func() time.Time
	health  *health
	graceMu sync.Mutex
	// defaults are the limits of orgs that have none of their own (SetDefaultLimits).
	defaults atomic.Pointer[Limits]
}

// Options tune a Store.
type Options struct {
	// Timeout bounds every Redis call, retries included (0: DefaultTimeout; negative: unbounded).
	// Give the client's options the same bound with BoundOptions.
	Timeout time.Duration
	// Clock replaces Redis TIME as the lease clock. Tests only: see nowArg.
	Clock func() time.Time
	// Log receives outage and recovery notices (nil: discarded).
	Log *slog.Logger
}

// New wraps a client with the default options. The client may point at one Redis, a Sentinel group
// or a Cluster.
func New(rdb redis.UniversalClient) *Store { return NewWithOptions(rdb, Options{}) }

// NewWithOptions wraps a client. It adds a hook to the client that bounds every call and watches
// for outages (see GrantGrace).
func NewWithOptions(rdb redis.UniversalClient, o Options) *Store {
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Log == nil {
		o.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s := &Store{rdb: rdb, clock: o.Clock}
	s.health = &health{timeout: o.Timeout, log: o.Log, onRecover: func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := s.GrantGrace(ctx); err != nil {
			o.Log.Error("granting leases their grace after a Redis outage; the sweeper tries again before it sweeps", "err", err)
		}
	}}
	rdb.AddHook(s.health)
	s.leases = newLeaseBatcher(rdb, o.Timeout)
	return s
}

// Close stops the store's heartbeat sender (New starts it); heartbeats after it fail with
// ErrClosed. It does not close the Redis client, which the caller owns. Call it once nothing uses
// the store any more (after the broker's Shutdown).
func (s *Store) Close() { s.leases.close() }

// One clock for every lease. Deadlines, the sweeper's "has it expired" and expiry warnings are all
// decided by Redis' clock, read with TIME inside the scripts that decide them, so every broker on
// one Redis agrees and a broker with a wrong clock can neither cut a lease short nor stop a sandbox
// early. (On a Cluster it is the clock of the node holding the org's keys.) Tests that move time by
// hand give the store a Clock instead: the scripts then take "now" from ARGV, and nothing else
// changes, so such tests stay deterministic.
const luaClock = `
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
`

// nowArg is the "now" ARGV of the lease scripts: "" (Redis TIME) unless a test clock is set.
func (s *Store) nowArg() string {
	if s.clock == nil {
		return ""
	}
	return strconv.FormatInt(ms(s.clock()), 10)
}

// Now reads the lease clock: Redis TIME (or the test clock). The sweeper reads it once per sweep;
// every decision is re-checked in a script on the same clock.
func (s *Store) Now(ctx context.Context) (time.Time, error) {
	if s.clock != nil {
		return s.clock().UTC(), nil
	}
	t, err := s.rdb.Time(ctx).Result()
	if err != nil {
		return time.Time{}, fmt.Errorf("store: read Redis' clock: %w", err)
	}
	return t.UTC(), nil
}

// luaWindow is how long before a deadline its expiring warning comes: the configured warning, but
// at most half the lease, so that an owner heartbeating at a sane pace (more often than every
// ttl/2) never sees one, and a lease shorter than the warning does not warn on every heartbeat.
const luaWindow = `
local function window(warning, ttl)
  return math.min(warning, math.floor(ttl * 1000 / 2))
end
`

// Scripts take the org's key prefix in ARGV when they must reach a sandbox hash whose id they only
// learn inside the script (a name lookup). Every such key carries the org's hash tag, so it lives in
// the same cluster slot as the declared KEYS.
func sandboxPrefix(org string) string { return orgKey(org, "sb", "") }

// luaResolve resolves ARGV-given ref (an id "sb_..." or a name) to a sandbox hash key.
// Expects KEYS[1] = names hash and the sandbox key prefix in the variable `prefix`.
const luaResolve = `
local function resolve(ref)
  local id = ref
  if string.sub(ref, 1, 3) ~= 'sb_' then
    id = redis.call('HGET', KEYS[1], ref)
    if not id then return nil end
  end
  if redis.call('EXISTS', prefix .. id) == 0 then return nil end
  return id
end
`

// luaLease (re)computes a running sandbox's deadline: expires = now + ttl (seconds), in the
// deadline set, and forgets any expiry warning sent for the previous deadline. ttl 0 means no lease.
const luaLease = `
local function lease(key, id, now, ttl, deadlines, warned)
  redis.call('ZREM', warned, id)
  if ttl > 0 then
    local exp = now + ttl * 1000
    redis.call('HSET', key, 'heartbeat', now, 'expires', exp)
    redis.call('ZADD', deadlines, exp, id)
    return exp
  end
  redis.call('HSET', key, 'heartbeat', now, 'expires', 0)
  redis.call('ZREM', deadlines, id)
  return 0
end
`

// luaRenew renews one ref's lease (a heartbeat), optionally setting a new ttl first, and answers
// {"ok", id, status, ttl, expires, node_lost} or {"err", code, detail, "", "", ""}. Expects KEYS[1] names,
// KEYS[2] deadlines, KEYS[3] warned, and the sandbox key prefix in the variable prefix.
// A heartbeat only renews running sandboxes: a stopped one must be resumed explicitly.
const luaRenew = luaLease + `
local function renew(ref, now, newttl)
  local id = ref
  if string.sub(ref, 1, 3) ~= 'sb_' then
    id = redis.call('HGET', KEYS[1], ref)
    if not id then return {'err', 'not_found', '', '', '', ''} end
  end
  local key = prefix .. id
  local cur = redis.call('HMGET', key, 'status', 'ttl', 'node_lost')
  local status = cur[1]
  if not status then return {'err', 'not_found', '', '', '', ''} end
  local ttl, nodelost = tonumber(cur[2]) or 0, cur[3] or '0'
  if newttl ~= '' then
    redis.call('HSET', key, 'ttl', newttl)
    ttl = tonumber(newttl)
  end
  if status ~= 'running' then
    if newttl ~= '' and status ~= 'deleting' then return {'ok', id, status, tostring(ttl), '0', nodelost} end
    return {'err', 'state', status, '', '', ''}
  end
  return {'ok', id, status, tostring(ttl), tostring(lease(key, id, now, ttl, KEYS[2], KEYS[3])), nodelost}
end
`

// createScript is create-or-reuse by name, atomic so that racing creates of one name make one sandbox.
// KEYS: 1 names, 2 new sandbox hash, 3 all, 4 stopped, 5 active, 6 limits, 7 the new sandbox's
// created mark (CreatedKey), 8.. tag indexes of the new sandbox.
// ARGV: 1 name, 2 new id, 3 now (ms), 4 reuse ("1"/"0"), 5 sandbox key prefix, 6 template,
// 7 the broker's default max_running, 8 the broker's default max_sandboxes, 9.. field/value pairs
// of the new record.
// Answers {"created"|"reused"|"resumed", id, HGETALL of the record} (the record as a Get would
// read it, without a second round trip) or {"err", code, detail}. A stopped sandbox found by
// reuse is claimed for resuming (status provisioning) here, so only one caller resumes it.
// Invariant: names[name] = id iff the record exists with that name and is not deleting; a create or
// a resume claims a place in the org's active set (luaClaim) in the same step, so racing callers
// never take the org past its max_running; a new record is refused when the org already has its
// max_sandboxes records (all), in the same step. A call sent again after its answer was lost is
// answered as the first time (the name already names the new id; a resume already claimed by it),
// and one whose sandbox was deleted in between is answered gone (the created mark outlives the
// record), never made again: the delete gave back the uid the record held.
var createScript = redis.NewScript(luaClaim + `
local name, newid, now, reuse, prefix, template = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local id = redis.call('HGET', KEYS[1], name)
-- This very call, sent again by the client after Redis' answer was lost: answer as the first time.
if id and id == newid then return {'created', newid, redis.call('HGETALL', KEYS[2])} end
-- The same, whose sandbox was deleted before it came again: it must not be made twice.
if redis.call('EXISTS', KEYS[7]) == 1 then
  local st = redis.call('HGET', KEYS[2], 'status')
  if st and st ~= 'deleting' then return {'created', newid, redis.call('HGETALL', KEYS[2])} end
  return {'err', 'gone', newid}
end
if id then
  if reuse ~= '1' then return {'err', 'conflict', id} end
  local key = prefix .. id
  local cur = redis.call('HMGET', key, 'status', 'template', 'claim')
  if cur[2] ~= template then return {'err', 'mismatch', cur[2]} end
  if cur[1] == 'provisioning' and cur[3] == newid then return {'resumed', id, redis.call('HGETALL', key)} end
  if cur[1] == 'stopped' then
    local over = claim(KEYS[5], KEYS[6], ARGV[7], id)
    if over then return {'err', 'quota', over} end
    -- The resume is this call's: its new id marks it (claim), should the call come again.
    redis.call('HSET', key, 'status', 'provisioning', 'stop_reason', '', 'stopped', 0, 'heartbeat', now, 'claim', newid)
    redis.call('ZREM', KEYS[4], id)
    return {'resumed', id, redis.call('HGETALL', key)}
  end
  if cur[1] == 'failed' then return {'err', 'state', 'failed'} end
  return {'reused', id, redis.call('HGETALL', key)}
end
local maxs = tonumber(redis.call('HGET', KEYS[6], 'max_sandboxes') or ARGV[8]) or 0
if maxs > 0 and redis.call('ZCARD', KEYS[3]) >= maxs then return {'err', 'quota_sandboxes', tostring(maxs)} end
local over = claim(KEYS[5], KEYS[6], ARGV[7], newid)
if over then return {'err', 'quota', over} end
redis.call('HSET', KEYS[1], name, newid)
local fields = {}
for i = 9, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('ZADD', KEYS[3], now, newid)
redis.call('SET', KEYS[7], '1', 'PX', 60000)
for i = 8, #KEYS do redis.call('ZADD', KEYS[i], now, newid) end
return {'created', newid, redis.call('HGETALL', KEYS[2])}
`)

// Outcome says what CreateOrReuse did: created, reused or resumed (protocol.Outcome*).
type Outcome string

// CreateOrReuse inserts rec (status provisioning) unless rec.Name is taken. When it is taken and reuse
// is set, it returns the existing record: "reused", or "resumed" when it was stopped, in which case
// this caller owns the resume (the record is now provisioning).
func (s *Store) CreateOrReuse(ctx context.Context, rec Record, reuse bool) (Record, Outcome, error) {
	keys := []string{NamesKey(rec.Org), SandboxKey(rec.Org, rec.ID), AllKey(rec.Org), StoppedKey(rec.Org),
		ActiveKey(rec.Org), LimitsKey(rec.Org), CreatedKey(rec.Org, rec.ID)}
	for k, v := range rec.Tags {
		keys = append(keys, TagKey(rec.Org, k, v))
	}
	args := append([]any{rec.Name, rec.ID, ms(rec.CreatedAt), boolArg(reuse), sandboxPrefix(rec.Org), rec.Template,
		s.DefaultLimits().MaxRunning, s.DefaultLimits().MaxSandboxes}, rec.fields()...)
	res, err := createScript.Run(ctx, s.rdb, keys, args...).Slice()
	if err == nil && len(res) != 3 {
		err = fmt.Errorf("unexpected answer of %d values", len(res))
	}
	if err != nil {
		return Record{}, "", fmt.Errorf("store: create %s: %w", rec.Name, err)
	}
	outcome, _ := res[0].(string)
	if outcome == "err" {
		code, _ := res[1].(string)
		detail, _ := res[2].(string)
		return Record{}, "", quotaOrScriptErr(rec.Org, code, detail)
	}
	got, err := parseRecord(res[2])
	if err != nil {
		return Record{}, "", err
	}
	return got, Outcome(outcome), nil
}

// getScript resolves a ref and reads the record in one round trip.
// KEYS: 1 names. ARGV: 1 ref, 2 sandbox key prefix. Answers the HGETALL array, or nil.
var getScript = redis.NewScript(`local prefix = ARGV[2]` + luaResolve + `
local id = resolve(ARGV[1])
if not id then return nil end
return redis.call('HGETALL', prefix .. id)
`)

// Get reads a sandbox by id or name. A sandbox of another org is simply not found: every key is
// scoped to the caller's org.
func (s *Store) Get(ctx context.Context, org, ref string) (Record, error) {
	v, err := getScript.Run(ctx, s.rdb, []string{NamesKey(org)}, ref, sandboxPrefix(org)).Result()
	if isNil(err) {
		return Record{}, ErrNotFound
	}
	if err != nil {
		return Record{}, fmt.Errorf("store: get %s: %w", ref, err)
	}
	return parseRecord(v)
}

// transitionScript moves a sandbox between statuses if its current status is one of the allowed
// ones, keeping the deadline and stopped indexes in step with the status.
// KEYS: 1 names, 2 deadlines, 3 stopped, 4 warned, 5 active, 6 limits.
// ARGV: 1 ref, 2 sandbox key prefix, 3 allowed current statuses ("a,b"), 4 new status, 5 now (ms;
// "" = Redis TIME), 6 only-if-expired ("1": the lease ran out by now, so a heartbeat that moved the
// deadline first wins), 7 with 6, the warning (ms; 0 = none) whose window must have passed since the
// expiring warning for this deadline was claimed, 8 only-if-stopped-by (ms; 0 = unconditional:
// retention passes its cutoff, so a resume that lands first wins), 9 the broker's default
// max_running, 10 the caller's claim on a move into provisioning (Transition.Claim; "" = none),
// 11 only-if-claimed ("1": the record's claim must be ARGV[10], "" matching one never claimed),
// 12.. extra field/value pairs.
// Answers {"ok", HGETALL...} or {"err", code, detail}.
// Invariant: a sandbox is in deadlines iff it is running with ttl > 0; in stopped iff stopped; in
// active iff provisioning or running, and entering active (a resume) is refused at max_running. A
// sweeper's stop (6 and 7 set) comes at least the warning window after the sandbox's expiring
// warning, whatever the deadline says: an outage or another broker's sweep can delay a stop, never
// make one come unannounced.
var transitionScript = redis.NewScript(`local prefix = ARGV[2]` + luaResolve + luaLease + luaClock + luaWindow + luaClaim + `
local id = resolve(ARGV[1])
if not id then return {'err', 'not_found', ''} end
local key = prefix .. id
local status = redis.call('HGET', key, 'status')
local allowed = false
for s in string.gmatch(ARGV[3], '[^,]+') do if s == status then allowed = true end end
if not allowed then
  -- This caller's own move into provisioning, sent again after Redis' answer was lost (ARGV[10]).
  if status == ARGV[4] and status == 'provisioning' and ARGV[10] ~= '' and redis.call('HGET', key, 'claim') == ARGV[10] then
    local out = {'ok'}
    for _, v in ipairs(redis.call('HGETALL', key)) do out[#out + 1] = v end
    return out
  end
  return {'err', 'state', status}
end
-- A settle decided on a read of the record: it must still be the move into provisioning it read.
if ARGV[11] == '1' and (redis.call('HGET', key, 'claim') or '') ~= ARGV[10] then return {'err', 'state', status} end
local now, to, ifexp, warning, ifstop = clock(ARGV[5]), ARGV[4], ARGV[6] == '1', tonumber(ARGV[7]), tonumber(ARGV[8])
if ifexp then
  local h = redis.call('HMGET', key, 'expires', 'ttl')
  local exp = tonumber(h[1]) or 0
  if exp == 0 or exp > now then return {'err', 'state', 'renewed'} end
  if warning > 0 then
    local warned = redis.call('ZSCORE', KEYS[4], id)
    if not warned or tonumber(warned) > now - window(warning, tonumber(h[2]) or 0) then
      return {'err', 'state', 'unwarned'}
    end
  end
end
if ifstop > 0 then
  local stopped = tonumber(redis.call('HGET', key, 'stopped')) or 0
  if status ~= 'stopped' or stopped == 0 or stopped > ifstop then return {'err', 'state', status} end
end
local active = {provisioning = true, running = true}
if active[to] and not active[status] then
  local over = claim(KEYS[5], KEYS[6], ARGV[9], id)
  if over then return {'err', 'quota', over} end
elseif active[to] then
  redis.call('SADD', KEYS[5], id) -- idempotent; heals a record an older broker moved
else
  redis.call('SREM', KEYS[5], id)
end
redis.call('HSET', key, 'status', to)
for i = 12, #ARGV, 2 do redis.call('HSET', key, ARGV[i], ARGV[i + 1]) end
if to == 'provisioning' then redis.call('HSET', key, 'claim', ARGV[10]) end
if to == 'running' then
  lease(key, id, now, tonumber(redis.call('HGET', key, 'ttl')) or 0, KEYS[2], KEYS[4])
  if (tonumber(redis.call('HGET', key, 'started')) or 0) == 0 then redis.call('HSET', key, 'started', now) end
else
  redis.call('HSET', key, 'expires', 0)
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZREM', KEYS[4], id)
end
if to == 'stopped' then
  redis.call('HSET', key, 'stopped', now)
  redis.call('ZADD', KEYS[3], now, id)
else
  redis.call('HSET', key, 'stopped', 0)
  redis.call('ZREM', KEYS[3], id)
end
if to == 'deleting' then
  local name = redis.call('HGET', key, 'name')
  if redis.call('HGET', KEYS[1], name) == id then redis.call('HDEL', KEYS[1], name) end
  redis.call('HINCRBY', key, 'gen', 1)
end
local out = {'ok'}
for _, v in ipairs(redis.call('HGETALL', key)) do out[#out + 1] = v end
return out
`)

// Transition is one status change.
type Transition struct {
	From []string // allowed current statuses
	To   string
	// Fields are extra record fields to set (stop_reason, failure, lost, provider, node...).
	Fields map[string]string
	// IfExpired makes the change conditional on the sandbox's lease having run out by the lease
	// clock (see Now): the sweeper's re-check, so that a heartbeat that lands first wins.
	IfExpired bool
	// Warning, with IfExpired, also requires the sandbox's expiring warning for this deadline to have
	// been claimed (WarnExpiring) at least its window earlier (the warning, or half the lease when
	// that is shorter), so that a stop always follows its warning.
	Warning time.Duration
	// IfStoppedBy makes the change conditional on the sandbox being stopped since this time or
	// earlier: retention's re-check, so that a resume that lands first wins.
	IfStoppedBy time.Time
	// Claim names this caller's move into provisioning (a resume): the record keeps it, and the same
	// call seen again (the client resent it after losing Redis' answer) succeeds instead of finding
	// the sandbox "already being started" by someone else and waiting for itself.
	Claim string
	// IfClaim makes the change conditional on the record's claim being Claim ("" for a record
	// never claimed): a settle of a start cut short (sandbox/settle.go) read the record, and must
	// not settle a newer move into provisioning made since.
	IfClaim bool
}

// Field names callers may set through Transition.Fields.
const (
	FieldStopReason = fStopReason
	FieldFailure    = fFailure
	FieldLost       = fLost
	FieldProvider   = fProvider
	FieldUID        = fUID
	FieldPlacement  = fPlacement
	FieldSearchPath = fSearchPath
)

// Transition applies t to the sandbox ref and returns the updated record; its times come from the
// lease clock. Moving to running starts a lease (expires = now + ttl); moving to deleting frees the
// name and bumps the token generation, which revokes every delegation token of the sandbox.
func (s *Store) Transition(ctx context.Context, org, ref string, t Transition) (Record, error) {
	args := []any{ref, sandboxPrefix(org), strings.Join(t.From, ","), t.To, s.nowArg(), boolArg(t.IfExpired),
		t.Warning.Milliseconds(), ms(t.IfStoppedBy), s.DefaultLimits().MaxRunning, t.Claim, boolArg(t.IfClaim)}
	for k, v := range t.Fields {
		args = append(args, k, v)
	}
	keys := []string{NamesKey(org), DeadlinesKey(org), StoppedKey(org), WarnedKey(org), ActiveKey(org), LimitsKey(org)}
	v, err := transitionScript.Run(ctx, s.rdb, keys, args...).Slice()
	if err != nil {
		return Record{}, fmt.Errorf("store: %s -> %s: %w", ref, t.To, err)
	}
	if v[0] == "err" {
		return Record{}, quotaOrScriptErr(org, str(v[1]), str(v[2]))
	}
	return parseRecord(v[1:])
}

// leaseScript renews one lease (see luaRenew).
// KEYS: 1 names, 2 deadlines, 3 warned. ARGV: 1 ref, 2 sandbox key prefix, 3 now (ms; "" = Redis
// TIME), 4 new ttl in seconds ("" keeps it).
var leaseScript = redis.NewScript(`local prefix = ARGV[2]` + luaRenew + luaClock + `
return renew(ARGV[1], clock(ARGV[3]), ARGV[4])
`)

// leaseManyScript renews many leases of one org in one call (see luaRenew).
// KEYS: 1 names, 2 deadlines, 3 warned. ARGV: 1 sandbox key prefix, 2 now (ms; "" = Redis TIME),
// 3.. refs. Answers the five-element answers of every ref, concatenated in order.
var leaseManyScript = redis.NewScript(`local prefix = ARGV[1]` + luaRenew + luaClock + `
local now, out = clock(ARGV[2]), {}
for i = 3, #ARGV do
  for _, v in ipairs(renew(ARGV[i], now, '')) do out[#out + 1] = v end
end
return out
`)

// Lease is the state of a sandbox's lease after a heartbeat.
type Lease struct {
	ID        string
	Status    string
	TTL       time.Duration
	ExpiresAt time.Time // zero: no lease
	// NodeLostAt is when the hosting node was declared lost (zero: it was not).
	NodeLostAt time.Time
}

// Heartbeat renews the lease of a running sandbox: expires = now + ttl on the lease clock. It is
// one round trip.
func (s *Store) Heartbeat(ctx context.Context, org, ref string) (Lease, error) {
	return s.lease(ctx, org, ref, "")
}

// SetTTL changes a sandbox's lease length; a running sandbox's deadline moves to now + ttl.
func (s *Store) SetTTL(ctx context.Context, org, ref string, ttl time.Duration) (Lease, error) {
	return s.lease(ctx, org, ref, strconv.FormatInt(int64(ttl/time.Second), 10))
}

// HeartbeatMany renews many leases of one org in one Redis call. The answers and errors are in
// the order of refs.
func (s *Store) HeartbeatMany(ctx context.Context, org string, refs []string) ([]Lease, []error) {
	leases, errs := make([]Lease, len(refs)), make([]error, len(refs))
	args := make([]any, 0, len(refs)+2)
	args = append(args, sandboxPrefix(org), s.nowArg())
	for _, r := range refs {
		args = append(args, r)
	}
	keys := []string{NamesKey(org), DeadlinesKey(org), WarnedKey(org)}
	v, err := leaseManyScript.Run(ctx, s.rdb, keys, args...).StringSlice()
	if err == nil && len(v) != renewAnswer*len(refs) {
		err = fmt.Errorf("store: %d answers for %d refs", len(v)/renewAnswer, len(refs))
	}
	for i := range refs {
		if err != nil {
			errs[i] = fmt.Errorf("store: lease %s: %w", refs[i], err)
			continue
		}
		leases[i], errs[i] = leaseFrom(v[renewAnswer*i : renewAnswer*i+renewAnswer])
	}
	return leases, errs
}

// renewAnswer is the length of one renew answer (see luaRenew).
const renewAnswer = 6

// leaseFrom reads one renew answer.
func leaseFrom(v []string) (Lease, error) {
	if v[0] == "err" {
		return Lease{}, scriptErr(v[1], v[2])
	}
	return Lease{ID: v[1], Status: v[2], TTL: time.Duration(atoi(v[3])) * time.Second, ExpiresAt: fromMS(v[4]),
		NodeLostAt: fromMS(v[5])}, nil
}

func (s *Store) lease(ctx context.Context, org, ref string, ttl string) (Lease, error) {
	keys := []string{NamesKey(org), DeadlinesKey(org), WarnedKey(org)}
	v, err := s.leases.do(ctx, keys, []any{ref, sandboxPrefix(org), s.nowArg(), ttl})
	if err != nil {
		return Lease{}, fmt.Errorf("store: lease %s: %w", ref, err)
	}
	if len(v) != renewAnswer {
		return Lease{}, fmt.Errorf("store: lease %s: malformed answer", ref)
	}
	return leaseFrom(v)
}

// purgeScript removes a deleting sandbox's record and every index entry. Idempotent.
// KEYS: 1 sandbox hash, 2 all, 3 delegations, 4 active, 5.. tag indexes. ARGV: 1 id.
var purgeScript = redis.NewScript(`
if redis.call('HGET', KEYS[1], 'status') ~= 'deleting' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
for i = 5, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
return 1
`)

// Purge removes a record that Transition moved to deleting, once its files are gone.
func (s *Store) Purge(ctx context.Context, rec Record) error {
	keys := []string{SandboxKey(rec.Org, rec.ID), AllKey(rec.Org), DelegationsKey(rec.Org, rec.ID), ActiveKey(rec.Org)}
	for k, v := range rec.Tags {
		keys = append(keys, TagKey(rec.Org, k, v))
	}
	n, err := purgeScript.Run(ctx, s.rdb, keys, rec.ID).Int()
	if err != nil {
		return fmt.Errorf("store: purge %s: %w", rec.ID, err)
	}
	if n == 0 {
		return &StateError{Status: "not deleting"}
	}
	return nil
}

func boolArg(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

func str(v any) string { s, _ := v.(string); return s }

// bumpGenScript increments a sandbox's token generation if the sandbox exists.
// KEYS: 1 sandbox hash. Answers the new generation, or 0 when the sandbox is gone.
var bumpGenScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HINCRBY', KEYS[1], 'gen', 1)
`)

// BumpGen increments a sandbox's token generation, which revokes every delegation token minted
// before, and returns the new generation.
func (s *Store) BumpGen(ctx context.Context, org, id string) (int64, error) {
	gen, err := bumpGenScript.Run(ctx, s.rdb, []string{SandboxKey(org, id)}).Int64()
	if err != nil {
		return 0, fmt.Errorf("store: bump gen: %w", err)
	}
	if gen == 0 {
		return 0, ErrNotFound
	}
	return gen, nil
}

// warnScript claims the expiry warnings due in one org: running sandboxes whose deadline is within
// their warning window of now (the warning, or half the lease when shorter; overdue ones included:
// a deadline that passed during an outage is warned about before any stop) and that were not
// warned about it yet, in deadline order, up to limit. Warned ones are skipped inside the script,
// so however many were warned already, the next ones are reached (at most maxWarnScan entries are
// looked at per call).
// KEYS: 1 deadlines, 2 warned. ARGV: 1 now (ms; "" = Redis TIME), 2 warning (ms), 3 limit,
// 4 sandbox key prefix, 5 scan cap. Answers {now, id, name, deadline, window, ...}.
// Invariant: the warned set holds, scored by when it was claimed, the sandboxes warned about their
// current deadline; whatever moves a deadline (luaLease, grace) removes the entry, so each deadline
// warns once, and a sweeper's stop needs the entry (transitionScript).
var warnScript = redis.NewScript(luaClock + luaWindow + `
local now, warning, limit, prefix, cap = clock(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local out, offset = {now}, 0
while #out < 1 + 4 * limit and offset < cap do
  local zs = redis.call('ZRANGE', KEYS[1], '-inf', now + warning, 'BYSCORE', 'LIMIT', offset, 500, 'WITHSCORES')
  if #zs == 0 then break end
  offset = offset + #zs / 2
  for i = 1, #zs, 2 do
    local id, deadline = zs[i], tonumber(zs[i + 1])
    local h = redis.call('HMGET', prefix .. id, 'expires', 'name', 'ttl')
    local w = window(warning, tonumber(h[3]) or 0)
    if tonumber(h[1]) == deadline and deadline - now <= w and redis.call('ZADD', KEYS[2], 'NX', now, id) == 1 then
      out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = id, h[2], deadline, w
      if #out == 1 + 4 * limit then break end
    end
  end
end
return out
`)

// maxWarnScan bounds the deadline entries one WarnExpiring call looks at.
const maxWarnScan = 20000

// Warning is an expiry warning to send: a running sandbox and the deadline it is about.
type Warning struct {
	ID, Name  string
	ExpiresAt time.Time
	// StopAt is the earliest a sweeper may stop it: the deadline, or the warning window from now
	// when that is later (a warning claimed late, after an outage, still gives the whole window).
	StopAt time.Time
}

// WarnExpiring claims the expiry warnings due in org on the lease clock: running sandboxes whose
// deadline is at most their warning window away (warning, or half the lease when that is shorter)
// or already past, and that nobody warned about it yet, up to limit, in deadline order. Each
// deadline is claimed once across every broker; the caller sends what it gets. A sweeper's stop
// (Transition with Warning) waits out the window from the claim.
func (s *Store) WarnExpiring(ctx context.Context, org string, warning time.Duration, limit int) ([]Warning, error) {
	v, err := warnScript.Run(ctx, s.rdb, []string{DeadlinesKey(org), WarnedKey(org)},
		s.nowArg(), warning.Milliseconds(), limit, sandboxPrefix(org), maxWarnScan).Slice()
	if err != nil {
		return nil, fmt.Errorf("store: warn expiring: %w", err)
	}
	now, _ := v[0].(int64)
	out := make([]Warning, 0, len(v)/4)
	for i := 1; i+3 < len(v); i += 4 {
		deadline, _ := v[i+2].(int64)
		w, _ := v[i+3].(int64)
		out = append(out, Warning{ID: str(v[i]), Name: str(v[i+1]), ExpiresAt: time.UnixMilli(deadline).UTC(),
			StopAt: time.UnixMilli(max(deadline, now+w)).UTC()})
	}
	return out, nil
}
