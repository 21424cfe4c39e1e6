package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// DefaultTimeout bounds one Redis call, retries included: a hung Redis (frozen, a dead peer behind a
// silent network) costs a caller about this long and then a clear "unavailable", not the 5-20 s
// that go-redis' own defaults and retries add up to.
const DefaultTimeout = time.Second

// ErrUnavailable is a Redis call that failed for want of Redis: refused, cut, or no answer within
// the call bound. Callers answer 503 (retry).
var ErrUnavailable = errors.New("store: Redis is unavailable")

// ErrClientClosed is a call on a closed Redis client: the broker is shutting down.
var ErrClientClosed = redis.ErrClosed

// BoundOptions sets the socket-level bounds of a client to timeout: dial, read, write and waiting
// for a pooled connection, and makes the client honour context deadlines. Store adds the bound on
// the whole call (retries included) on top; call this before redis.NewUniversalClient.
func BoundOptions(o *redis.UniversalOptions, timeout time.Duration) {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = timeout, timeout, timeout, timeout
	o.ContextTimeoutEnabled = true
}

// Unavailable reports an error that says Redis is away (as opposed to an answer Redis gave, or a
// caller that gave up): a connection refused or cut, a timeout, a pool that cannot get a
// connection, a server still loading its data or without a master.
func Unavailable(err error) bool {
	if err == nil || errors.Is(err, redis.Nil) || errors.Is(err, context.Canceled) || errors.Is(err, redis.ErrClosed) {
		return false
	}
	if errors.Is(err, ErrUnavailable) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return true
	}
	// A server loading its data after a restart, a replica without its master, a cluster without
	// quorum, a failover in progress, a script running too long: Redis is there but cannot serve.
	for _, p := range []string{"LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "BUSY"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// RefusesWrites reports an error that says Redis refused a write and changed nothing: it is at its
// maxmemory (OOM), it has fewer replicas than min-replicas-to-write (NOREPLICAS), or it cannot
// write to its disk (MISCONF: a failed save, or a full disk under its append-only file). A script
// that hits one aborts before its first write, so unlike Unavailable the outcome is known: callers
// answer 503 without sending the call again.
func RefusesWrites(err error) bool {
	return WriteRefusal(err) != ""
}

// WriteRefusal names, for a person, why Redis refused a write ("" when err is no such refusal).
func WriteRefusal(err error) string {
	switch {
	case err == nil:
		return ""
	case redis.HasErrorPrefix(err, "OOM"):
		return "it is full (maxmemory)"
	case redis.HasErrorPrefix(err, "NOREPLICAS"):
		return "it has fewer replicas than its min-replicas-to-write"
	case redis.HasErrorPrefix(err, "MISCONF"):
		return "it cannot write to its disk (a failed save, or a full disk under its append-only file)"
	}
	return ""
}

// health watches every call of the store's client through a go-redis hook. It bounds each call to
// the timeout, and notices outages: a call that failed for want of Redis, then one that succeeded.
// After an outage it owes every lease a full TTL of grace (see GrantGrace): the owners' heartbeats
// failed through no fault of theirs.
type health struct {
	timeout time.Duration
	log     *slog.Logger
	// onRecover runs (in its own goroutine) when a call succeeds after an outage.
	onRecover func()

	mu   sync.Mutex
	down bool
	// outages counts the outages observed; granted is the count the last completed grace covered.
	outages, granted int
	since            time.Time // when the current outage was first seen
}

func (h *health) observe(err error) {
	switch {
	case Unavailable(err):
		h.mu.Lock()
		if !h.down {
			h.down, h.since = true, time.Now()
			h.outages++
			h.mu.Unlock()
			h.log.Warn("Redis is unavailable: requests answer 503 until it returns; leases get a full TTL of grace when it does", "err", err)
			return
		}
		h.mu.Unlock()
	case RefusesWrites(err) && !redis.HasErrorPrefix(err, "OOM"):
		// Every write fails, heartbeats among them, while reads may succeed: an outage owed its
		// grace, paid by the sweeper's next GrantGrace once one succeeds (it writes too), never
		// counted twice while owed, and with no "reachable again" at the next successful read. A
		// full Redis (OOM) is not one: it refuses only scripts whose first write takes memory, so
		// heartbeats still renew leases, and its sweeps (stops, retention deletes) free memory.
		h.mu.Lock()
		owed := h.outages > h.granted
		if !owed {
			h.outages++
		}
		h.mu.Unlock()
		if !owed {
			h.log.Warn("Redis refuses writes: writes answer 503 until it takes them again; leases get a full TTL of grace when it does", "err", err)
		}
	case err == nil || !errors.Is(err, context.Canceled):
		h.mu.Lock()
		was, since := h.down, h.since
		h.down = false
		h.mu.Unlock()
		if was {
			h.log.Warn("Redis is reachable again", "outage", time.Since(since).Round(time.Millisecond))
			go h.onRecover()
		}
	}
}

// owed reports whether an outage was observed that no completed grace pass covers, and its count.
// (Redis may still look down: the pass's own first call tells.)
func (h *health) owed() (bool, int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.outages > h.granted, h.outages
}

func (h *health) paid(upTo int) {
	h.mu.Lock()
	h.granted = max(h.granted, upTo)
	h.mu.Unlock()
}

// bound gives ctx the call timeout unless it has an earlier deadline already.
func (h *health) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if h.timeout < 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, h.timeout)
}

// timedOut turns the error of a call whose bound ran out into ErrUnavailable with the bound in it,
// so the answer says what happened rather than "context deadline exceeded".
func (h *health) timedOut(ctx context.Context, err error) error {
	if err != nil && !errors.Is(err, redis.Nil) && ctx.Err() != nil && errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
		return fmt.Errorf("%w: no answer within %s", ErrUnavailable, h.timeout)
	}
	return err
}

func (h *health) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := next(ctx, network, addr)
		if err != nil {
			h.observe(err)
		}
		return c, err
	}
}

func (h *health) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		bctx, cancel := h.bound(ctx)
		defer cancel()
		err := next(bctx, cmd)
		if e := h.timedOut(bctx, err); e != err {
			err = e
			cmd.SetErr(err)
		}
		h.observe(err)
		return err
	}
}

func (h *health) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		bctx, cancel := h.bound(ctx)
		defer cancel()
		err := next(bctx, cmds)
		if e := h.timedOut(bctx, err); e != err {
			err = e
			for _, c := range cmds {
				if c.Err() != nil {
					c.SetErr(err)
				}
			}
		}
		h.observe(err)
		return err
	}
}

// graceScript gives one chunk of an org's leases a full TTL from now: expires = max(expires,
// now + ttl) for running sandboxes, forgetting the expiry warning of every deadline it moves (a new
// deadline is warned about anew). Idempotent: brokers that all saw one outage may all run it.
// ZSCAN returns every member present for the whole scan at least once, whatever moves meanwhile;
// one seen twice is a no-op.
// KEYS: 1 deadlines, 2 warned. ARGV: 1 sandbox key prefix, 2 now ("" = Redis TIME), 3 cursor,
// 4 count. Answers {next cursor, leases moved}.
var graceScript = redis.NewScript(luaClock + `
local prefix, now = ARGV[1], clock(ARGV[2])
local res = redis.call('ZSCAN', KEYS[1], ARGV[3], 'COUNT', ARGV[4])
local items, moved = res[2], 0
for i = 1, #items, 2 do
  local id, exp = items[i], tonumber(items[i + 1])
  local key = prefix .. id
  local h = redis.call('HMGET', key, 'status', 'ttl')
  local ttl = tonumber(h[2]) or 0
  if h[1] == 'running' and ttl > 0 and now + ttl * 1000 > exp then
    local new = now + ttl * 1000
    redis.call('HSET', key, 'expires', new)
    redis.call('ZADD', KEYS[1], new, id)
    redis.call('ZREM', KEYS[2], id)
    moved = moved + 1
  end
end
return {res[1], moved}
`)

// graceChunk bounds the deadline entries one grace call looks at, so no call holds Redis long.
const graceChunk = 500

// GrantGrace gives every running lease of every org a full TTL from now (expires = max(expires,
// now + ttl)) when this store observed a Redis outage since the last grace pass; otherwise it does
// nothing. The sweeper calls it before every sweep, and the store starts it by itself when Redis
// answers again, so no lease expires because of an outage a broker saw: Nomad resets its node
// heartbeat timers after a leader failover for the same reason. One pass at a time; a pass cut by
// another outage is owed again.
func (s *Store) GrantGrace(ctx context.Context) error {
	s.graceMu.Lock()
	defer s.graceMu.Unlock()
	owed, upTo := s.health.owed()
	if !owed {
		return nil
	}
	orgs, err := s.Orgs(ctx)
	if err != nil {
		return err
	}
	moved := 0
	for _, org := range orgs {
		cursor := "0"
		for {
			v, err := graceScript.Run(ctx, s.rdb, []string{DeadlinesKey(org), WarnedKey(org)},
				sandboxPrefix(org), s.nowArg(), cursor, graceChunk).Slice()
			if err != nil {
				return fmt.Errorf("store: lease grace after an outage: %w", err)
			}
			n, _ := v[1].(int64)
			moved += int(n)
			if cursor = str(v[0]); cursor == "0" {
				break
			}
		}
	}
	s.health.paid(upTo)
	s.health.log.Warn("Redis outage over: every running lease got a full TTL of grace from now", "leases_extended", moved)
	return nil
}
