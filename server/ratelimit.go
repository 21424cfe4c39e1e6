package server

import (
	"context"
	"errors"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// retryError is a refusal that knows when a retry can succeed: its Retry-After.
type retryError struct {
	pe    *protocol.Error
	after time.Duration
	// limit and org name what refused, for the metrics.
	limit, org string
}

func (e *retryError) Error() string { return e.pe.Error() }
func (e *retryError) Unwrap() error { return e.pe }

// quotaRetryAfter is the Retry-After of a quota refusal: the limit frees only when the org stops or
// deletes a sandbox, so this is how often a waiting client may look again.
const quotaRetryAfter = 10 * time.Second

// seconds is d in whole seconds, at least 1: Retry-After's unit.
func seconds(d time.Duration) string { return strconv.Itoa(max(1, int(math.Ceil(d.Seconds())))) }

// retryAfter is the Retry-After header value (whole seconds, at least 1) of a 429 answer.
func retryAfter(err error) string {
	d := time.Second
	var re *retryError
	var pe *protocol.Error
	switch {
	case errors.As(err, &re):
		d = re.after
	case errors.As(err, &pe) && pe.Code == protocol.CodeQuotaExceeded:
		d = quotaRetryAfter
	}
	return seconds(d)
}

// newLimiters sets up the rate limits of cfg (called by New).
func (s *Server) newLimiters(cfg Config) {
	s.buckets = newCredBuckets(s.now)
	s.orgLimits = &orgLimitsCache{store: cfg.Store, now: s.now, m: map[string]cachedLimits{}}
	if cfg.AuthFailures > 0 {
		window := cfg.AuthFailureWindow
		if window <= 0 {
			window = time.Minute
		}
		s.authGuard = &authGuard{max: cfg.AuthFailures, window: window, now: s.now, m: map[string]*failures{}}
	}
}

// credBuckets are token buckets, one per credential (an API key id or a token's jti), in this
// broker's memory: an org's rps limit is per credential and per broker.
type credBuckets struct {
	now func() time.Time
	mu  sync.Mutex
	m   map[string]*bucket
}

type bucket struct {
	tokens float64
	last   time.Time
}

// maxBuckets bounds credBuckets; past it, buckets that have refilled (they hold no state a fresh
// one would not) are dropped, and if that is not enough, all of them.
const maxBuckets = 100_000

func newCredBuckets(now func() time.Time) *credBuckets {
	return &credBuckets{now: now, m: map[string]*bucket{}}
}

// take spends one token of cred's bucket (rps per second, up to burst) and answers how long to wait
// when there is none. rps 0 means no limit.
func (cb *credBuckets) take(cred string, rps, burst int) (time.Duration, bool) {
	return cb.takeN(cred, 1, rps, burst)
}

// takeN is take for n tokens at once (at most burst: more could never be had).
func (cb *credBuckets) takeN(cred string, n, rps, burst int) (time.Duration, bool) {
	if rps <= 0 {
		return 0, true
	}
	if burst < 1 {
		burst = rps
	}
	need := float64(min(max(n, 1), burst))
	now := cb.now()
	cb.mu.Lock()
	defer cb.mu.Unlock()
	b := cb.m[cred]
	if b == nil {
		if len(cb.m) >= maxBuckets {
			cb.sweep(now, rps, burst)
		}
		b = &bucket{tokens: float64(burst), last: now}
		cb.m[cred] = b
	}
	if el := now.Sub(b.last).Seconds(); el > 0 {
		b.tokens = min(float64(burst), b.tokens+el*float64(rps))
		b.last = now
	}
	if b.tokens >= need {
		b.tokens -= need
		return 0, true
	}
	return time.Duration((need - b.tokens) / float64(rps) * float64(time.Second)), false
}

// sweep drops the buckets that would be full by now; the caller holds mu.
func (cb *credBuckets) sweep(now time.Time, rps, burst int) {
	full := time.Duration(float64(burst) / float64(rps) * float64(time.Second))
	for k, b := range cb.m {
		if now.Sub(b.last) >= full {
			delete(cb.m, k)
		}
	}
	if len(cb.m) >= maxBuckets {
		cb.m = map[string]*bucket{}
	}
}

func (cb *credBuckets) size() int {
	cb.mu.Lock()
	defer cb.mu.Unlock()
	return len(cb.m)
}

// orgLimitsTTL is how long a broker uses an org's limits before reading them again: how long
// `broker orgs set-limits` takes to reach the rate limits of every broker.
const orgLimitsTTL = 5 * time.Second

// orgLimitsCache keeps each org's effective limits for orgLimitsTTL, so a request costs no Redis
// round trip for them. Only authenticated orgs enter it.
type orgLimitsCache struct {
	store *store.Store
	now   func() time.Time
	mu    sync.Mutex
	m     map[string]cachedLimits
}

type cachedLimits struct {
	l       store.Limits
	expires time.Time
}

func (oc *orgLimitsCache) get(ctx context.Context, org string) store.Limits {
	now := oc.now()
	oc.mu.Lock()
	c, ok := oc.m[org]
	oc.mu.Unlock()
	if ok && now.Before(c.expires) {
		return c.l
	}
	l, err := oc.store.EffectiveLimits(ctx, org)
	if err != nil {
		// Redis is away: keep what we knew, else the defaults; the request itself will say more.
		if ok {
			return c.l
		}
		return oc.store.DefaultLimits()
	}
	oc.mu.Lock()
	if len(oc.m) >= maxBuckets {
		oc.m = map[string]cachedLimits{}
	}
	oc.m[org] = cachedLimits{l: l, expires: now.Add(orgLimitsTTL)}
	oc.mu.Unlock()
	return l
}

// limitCredential spends one request of cred (an API key id or a token's jti) against its org's
// rps limit on this broker.
func (s *Server) limitCredential(ctx context.Context, org, cred string) error {
	return s.limitCredentialN(ctx, org, cred, 1)
}

// batchItemsPerRequest is how many items of a batch (a batch heartbeat's refs) count as one request
// against the rps limit: each is its own work in Redis.
const batchItemsPerRequest = 100

// limitBatch spends what a batch of n items costs beyond the one request its authentication spent.
func (s *Server) limitBatch(ctx context.Context, p Principal, n int) error {
	extra := (n+batchItemsPerRequest-1)/batchItemsPerRequest - 1
	if extra < 1 {
		return nil
	}
	return s.limitCredentialN(ctx, p.Org, "key:"+p.KeyID, extra)
}

// limitCredentialN is limitCredential for n requests' worth at once.
func (s *Server) limitCredentialN(ctx context.Context, org, cred string, n int) error {
	l := s.orgLimits.get(ctx, org)
	wait, ok := s.buckets.takeN(cred, n, l.RPS, l.Burst)
	if ok {
		return nil
	}
	return &retryError{after: wait, limit: limitRPS, org: org, pe: protocol.Errorf(protocol.CodeRateLimited,
		"this credential is over org %s's rps limit on this broker (rps %d): slow down and retry in %s s, or ask the broker's operator to raise it (broker orgs set-limits %s --rps N)",
		org, l.RPS, seconds(wait), org)}
}

// authGuard counts failed authentications per source address in a window; a source with max of
// them waits out the rest of its window, whatever it sends.
type authGuard struct {
	max    int
	window time.Duration
	now    func() time.Time
	mu     sync.Mutex
	m      map[string]*failures
	// swept is when ended windows were last dropped: a full table is swept at most once a second,
	// so a flood of new sources costs no scan per request.
	swept time.Time
}

type failures struct {
	n     int
	start time.Time
}

// maxSources bounds authGuard. Past it, windows that ended are dropped; if that is not enough, new
// sources are counted together under one shared entry, so a flood from many addresses is held
// back as a whole and memory stays bounded.
const maxSources = 10_000

const overflowSource = "overflow"

// blocked answers how long src must still wait, if it reached max failures in its window. A
// source the guard does not track is never blocked, even while the shared overflow entry is over
// its limit: the overflow holds back failures (failed answers them 429), never the clients that
// have not failed, so a flood of bad keys from many addresses cannot lock every org out.
func (g *authGuard) blocked(src string) (time.Duration, bool) {
	now := g.now()
	g.mu.Lock()
	defer g.mu.Unlock()
	f := g.m[src]
	if f == nil {
		return 0, false
	}
	if end := f.start.Add(g.window); f.n >= g.max && now.Before(end) {
		return end.Sub(now), true
	}
	return 0, false
}

// failed counts a failed authentication from src and answers whether it is past max (the answer
// then is a 429 like a blocked source's, not a verdict on the credential), and whether this is the
// failure that crossed it.
func (g *authGuard) failed(src string) (wait time.Duration, over, crossed bool) {
	now := g.now()
	g.mu.Lock()
	defer g.mu.Unlock()
	f := g.m[src]
	if f == nil {
		if len(g.m) >= maxSources && now.Sub(g.swept) >= time.Second {
			g.swept = now
			for k, v := range g.m {
				if !now.Before(v.start.Add(g.window)) {
					delete(g.m, k)
				}
			}
		}
		if len(g.m) >= maxSources {
			src = overflowSource
			f = g.m[src]
		}
	}
	if f == nil || !now.Before(f.start.Add(g.window)) {
		f = &failures{start: now}
		g.m[src] = f
	}
	f.n++
	if f.n > g.max {
		return f.start.Add(g.window).Sub(now), true, f.n == g.max+1
	}
	return 0, false, false
}

func (g *authGuard) size() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.m)
}

// provenToken are the refusals of delegation tokens that this broker's keys signed (expired,
// revoked, early): an agent server retrying a stale token is not guessing credentials, and counting
// it would lock out every other agent on its host.
var provenToken = map[string]bool{protocol.CodeTokenExpired: true, protocol.CodeTokenRevoked: true,
	protocol.CodeTokenNotYet: true, protocol.CodeTokenIssuedAt: true}

// sourceOf is the address a request came from: the peer's IP (never a forwarding header, which the
// client writes), an IPv6 peer's /64, since one host commonly holds a whole /64.
func sourceOf(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	ip = ip.Unmap()
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}

// guardAuth refuses every /v1 (and /metrics) request from a source that failed to authenticate too often, before
// its credential is looked at (so the answer says nothing about the credential), and counts the
// failures; a failure past the limit is answered like a refusal.
func (s *Server) guardAuth(next echo.HandlerFunc) echo.HandlerFunc {
	if s.authGuard == nil {
		return next
	}
	refuse := func(path string, wait time.Duration) error {
		with := "a valid API key (sbctl reads it from --api-key, SBX_API_KEY or its config file)"
		if path == "/metrics" {
			with = "the metrics token of the broker's --metrics-token-file, or no credentials"
		}
		return &retryError{after: wait, limit: limitAuthFailures, pe: protocol.Errorf(protocol.CodeRateLimited,
			"too many failed authentications from this address: retry in %s s with %s", seconds(wait), with)}
	}
	return func(c echo.Context) error {
		r := c.Request()
		if !strings.HasPrefix(r.URL.Path, "/v1/") && r.URL.Path != "/metrics" {
			return next(c)
		}
		src := sourceOf(r)
		if wait, blocked := s.authGuard.blocked(src); blocked {
			return refuse(r.URL.Path, wait)
		}
		err := next(c)
		status, guess := c.Response().Status, true
		if err != nil {
			var pe *protocol.Error
			status, pe = apiError(err)
			guess = !provenToken[pe.Code]
		}
		// A request whose key was accepted (a principal) was not guessing, whatever ended it.
		if status == http.StatusUnauthorized && guess && principal(c).Org == "" {
			wait, over, crossed := s.authGuard.failed(src)
			if crossed {
				s.log.Warn("too many failed authentications: refusing the source until its window ends",
					"source", src, "failures", s.authGuard.max, "retry_after_s", int(math.Ceil(wait.Seconds())), "request_id", requestID(c))
			}
			if over && !c.Response().Committed {
				return refuse(r.URL.Path, wait)
			}
		}
		return err
	}
}
