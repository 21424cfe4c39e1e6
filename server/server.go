// Package server is the broker's HTTP face on echo: the REST API, the dataplane WebSocket and the SSE
// event streams, with authentication, request ids, access logs and the one mapping from errors to
// answers. Middleware loads and authorizes; handlers act through the domain packages (sandbox,
// delegation, heartbeat, events). It holds no state of its own beyond open connections.
package server

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"sort"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// Config wires a Server.
type Config struct {
	Store     *store.Store
	Sandboxes *sandbox.Manager
	// Delegation mints, lists, revokes and verifies delegation tokens; Keys publishes their JWKS.
	Delegation *delegation.Service
	Keys       *delegation.Keyring
	Events     events.Sink
	Log        *slog.Logger
	// AllowedOrigins may open the dataplane from a browser (an Origin header); none by default.
	AllowedOrigins []string
	// Now is the clock for reports (nil = time.Now).
	Now func() time.Time
	// DataplaneRenewsLease lets dataplane activity renew a sandbox's lease (off by default: a lease
	// is the owner's heartbeat, and an agent left running must not keep a sandbox alive).
	DataplaneRenewsLease bool
	// AuthFailures failed authentications from one source address within AuthFailureWindow make
	// that source wait out the window (429 rate_limited); 0 = no limit.
	AuthFailures      int
	AuthFailureWindow time.Duration
	// Dataplane bounds the dataplane connections this broker serves.
	Dataplane DataplaneLimits
	// EventStreamsPerKey bounds the event streams (SSE, followed) one API key may have open on this
	// broker (0: DefaultEventStreamsPerKey); past it a stream is 429 too_many_connections.
	EventStreamsPerKey int
	// ConnsPerSource bounds the connections one source address may hold open on this broker (0:
	// DefaultConnsPerSource); past it a new connection is answered 429 too_many_connections and
	// closed (sourceLimiter).
	ConnsPerSource int
	// Ready reports whether the broker can serve (Redis reachable, provider up), for /readyz.
	Ready func(ctx context.Context) ReadyReport
	// Provider is the sandbox provider this broker runs, for /metrics.
	Provider ProviderInfo
	// MetricsTokenHash is the SHA-256 of the bearer token that unlocks /metrics' per-org series
	// (nil: they are never served; see metrics.handler).
	MetricsTokenHash []byte
	// DataplaneURL is a sandbox's dataplane URL on the broker hosting it, for the sandbox view
	// (nil: views carry none).
	DataplaneURL func(ctx context.Context, rec store.Record) (string, error)
}

// ProviderInfo says which provider runs this broker's sandboxes and what it holds.
type ProviderInfo struct {
	// Name is the provider ("namespace" or "dir"); Isolation its level (protocol.Isolation*).
	Name      string `json:"provider"`
	Isolation string `json:"isolation"`
	// LimitsEnforced says whether memory, pids and cpu limits apply to sandboxes.
	LimitsEnforced bool `json:"limits_enforced"`
	// DiskQuota says whether each sandbox's workspace is a filesystem of its own size.
	DiskQuota bool `json:"disk_quota"`
	// Fallback is why preflight fell back to the dir provider (on this start or the one that set up
	// the data dir), empty if it did not.
	Fallback string `json:"fallback,omitempty"`
	// Levels are the isolation levels a template may ask for, and whether this host offers each.
	Levels []IsolationLevel `json:"isolation_levels,omitempty"`
}

// IsolationLevel is one isolation level and whether this broker's host can run it.
type IsolationLevel struct {
	Level     string `json:"level"`
	Available bool   `json:"available"`
	// Missing says what the host lacks, when it is not available.
	Missing string `json:"missing,omitempty"`
}

// DataplaneLimits bound the dataplane connections one broker serves, so that one credential or one
// org cannot take them all (0: the default).
type DataplaneLimits struct {
	// MaxConnections bounds them all (default 4096); past it an upgrade is 503 unavailable.
	MaxConnections int
	// PerOrg and PerCredential bound one org's, and one API key's or delegation token's (default
	// 1024 and 256); past them an upgrade is 429 too_many_connections.
	PerOrg, PerCredential int
}

// DefaultEventStreamsPerKey is how many followed event streams one API key may have open on a
// broker unless Config.EventStreamsPerKey says otherwise.
const DefaultEventStreamsPerKey = 256

// Default dataplane connection limits.
const (
	DefaultMaxDataplaneConnections     = 4096
	DefaultDataplaneConnsPerOrg        = 1024
	DefaultDataplaneConnsPerCredential = 256
)

func (l DataplaneLimits) withDefaults() DataplaneLimits {
	if l.MaxConnections <= 0 {
		l.MaxConnections = DefaultMaxDataplaneConnections
	}
	if l.PerOrg <= 0 {
		l.PerOrg = DefaultDataplaneConnsPerOrg
	}
	if l.PerCredential <= 0 {
		l.PerCredential = DefaultDataplaneConnsPerCredential
	}
	return l
}

// ReadyReport is the /readyz body.
type ReadyReport struct {
	Ready bool `json:"ready"`
	ProviderInfo
	Redis    string   `json:"redis"`
	Node     string   `json:"node"`
	Warnings []string `json:"warnings,omitempty"`
	// Pool is each template's warm pool on this broker (templates without one are not listed).
	Pool []sandbox.PoolStat `json:"pool,omitempty"`
}

// Server is the HTTP server.
type Server struct {
	e          *echo.Echo
	store      *store.Store
	sandboxes  *sandbox.Manager
	delegation *delegation.Service
	keys       *delegation.Keyring
	events     events.Sink
	log        *slog.Logger
	hub        *hub
	// connsPerSource bounds each source address's open connections (sourceLimiter).
	connsPerSource int
	// allowedOrigins may open the dataplane from a browser.
	allowedOrigins []string
	ready          func(ctx context.Context) ReadyReport
	metrics        *metrics
	http           *http.Server
	// bgCtx scopes what Serve starts besides the HTTP server; stopBackground ends it. Shutdown
	// ends it first, which also ends long-lived responses (SSE) that http.Server.Shutdown would
	// otherwise wait for.
	bgCtx          context.Context
	stopBackground context.CancelFunc
	eventsHub      *events.Hub
	clock          func() time.Time
	dpRenews       bool
	apiKeys        *keyCache
	// streams are the open SSE streams, ended when their API key is revoked.
	streams *streams
	// Rate limits (ratelimit.go): per credential, and failed authentications per source.
	buckets      *credBuckets
	orgLimits    *orgLimitsCache
	authGuard    *authGuard
	limitMetrics *limitMetrics
	// dpHeavy bounds operations with large answers broker-wide, with a share per org.
	dpHeavy *quota
	// dpExecOutput is the output of non-streamed execs held in memory broker-wide, with a share
	// per org.
	dpExecOutput *quota
	// dpQueued is the bytes waiting for dataplane clients, every connection's queue together,
	// with a share per org.
	dpQueued *quota
	// dpShellInput is the keystrokes waiting for shells' terminals, every connection's together.
	dpShellInput *quota
	// dpOpMemory is what operations build in memory (names a tar walk holds, an untar remembers,
	// the answers ls, glob, grep and changes assemble, an edit's file), every request's together,
	// with a share per org.
	dpOpMemory *quota
	// routes are the registered route paths (echo's c.Path() form), the only route labels.
	routes map[string]bool
	// dpLimits bound open dataplane connections (counted by hub).
	dpLimits DataplaneLimits
	// uploadIdle is how long an upload's body may send nothing (dataplane_put.go): dpPongWait,
	// shorter in tests.
	uploadIdle time.Duration
	// readerHook, set only by tests (SetReaderHook), runs on a dataplane connection's reader for
	// each request before it is dispatched: a test's way to make the reader's own code fail.
	readerHook func(op string)
	// bodyWait is how long a request's body may take to arrive (bodywait.go): bodyWait, shorter in
	// tests.
	bodyWait time.Duration

	// dataplaneURL is Config.DataplaneURL.
	dataplaneURL func(ctx context.Context, rec store.Record) (string, error)
	// mcp is the Streamable HTTP MCP endpoint (mcp.go).
	mcp *mcpFront
}

// mcpRoute is the MCP endpoint's route (echo's c.Path() form).
const mcpRoute = "/v1/sandboxes/:ref/mcp"

// maxBody bounds every REST request body.
const maxBody = 1 << 20

// New builds the server and its routes.
func New(cfg Config) *Server {
	h := newHub()
	s := &Server{store: cfg.Store, sandboxes: cfg.Sandboxes, delegation: cfg.Delegation, keys: cfg.Keys,
		events: cfg.Events, log: cfg.Log, ready: cfg.Ready, metrics: newMetrics(h.count, cfg.Provider), hub: h,
		allowedOrigins: cfg.AllowedOrigins, eventsHub: events.NewHub(cfg.Store, cfg.Log), clock: cfg.Now,
		dpRenews: cfg.DataplaneRenewsLease, apiKeys: newKeyCache(cfg.Store), streams: newStreams(cmp.Or(max(cfg.EventStreamsPerKey, 0), DefaultEventStreamsPerKey)), connsPerSource: cmp.Or(max(cfg.ConnsPerSource, 0), DefaultConnsPerSource), dpHeavy: newQuota(dpHeavyPerBroker, dpHeavyPerOrg),
		dpExecOutput: newQuota(dpExecOutputBudget, dpExecOutputPerOrg), dpQueued: newQuota(dpQueuedBudget, dpQueuedPerOrg),
		dpShellInput: newQuota(dpShellInputBudget, dpShellInputPerOrg), dpOpMemory: newQuota(dpOpMemoryBudget, dpOpMemoryPerOrg), dpLimits: cfg.Dataplane.withDefaults(), uploadIdle: dpPongWait, bodyWait: bodyWait}
	s.dataplaneURL = cfg.DataplaneURL
	s.newMCP()
	s.metrics.reg.MustRegister(s.dataplaneGauges()...)
	if s.events == nil {
		s.events = events.Discard
	}
	s.newLimiters(cfg)
	s.registerLimitMetrics(s.metrics.reg)
	if cfg.Sandboxes != nil {
		s.metrics.reg.MustRegister(&poolCollector{m: cfg.Sandboxes})
		s.metrics.reg.MustRegister(providerStartCounters(cfg.Sandboxes)...)
	}
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = s.errorHandler
	e.Use(withRequestID, s.boundBody, s.withAccessLog, s.recoverPanics, s.guardAuth, oneAuthorization, checkQuery)
	s.e = e
	s.bgCtx, s.stopBackground = context.WithCancel(context.Background())
	s.http = &http.Server{
		Handler:           e,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		ErrorLog:          slog.NewLogLogger(cfg.Log.Handler(), slog.LevelDebug),
	}

	// get registers a GET route and its HEAD, answered by the same handler: the GET's status and
	// headers, its body dropped by net/http. Load balancers' health checks and `curl -I` send HEAD.
	// Handlers that would hold a stream answer a HEAD at once (streamEvents, dataplane).
	get := func(path string, h echo.HandlerFunc, m ...echo.MiddlewareFunc) {
		e.GET(path, h, m...)
		e.HEAD(path, h, m...)
	}
	get("/healthz", s.healthz)
	get("/readyz", s.readyz)
	get("/metrics", s.metrics.handler(cfg.MetricsTokenHash))
	get("/.well-known/jwks.json", s.jwks)

	// Middleware is attached per route, not per group: echo's group middleware adds catch-all
	// routes that would turn 405 into 404.
	owner := []echo.MiddlewareFunc{s.requireOwner}
	ownerOne := []echo.MiddlewareFunc{s.requireOwner, s.loadSandbox}
	e.POST("/v1/sandboxes", s.createSandbox, owner...)
	get("/v1/sandboxes", s.listSandboxes, owner...)
	e.DELETE("/v1/sandboxes", s.deleteSandboxes, owner...)
	// Heartbeats resolve the ref inside their one Redis script: no loader on the hottest route.
	e.POST("/v1/sandboxes/:ref/heartbeat", s.heartbeat, owner...)
	e.POST("/v1/heartbeats", s.heartbeats, owner...)
	get("/v1/sandboxes/:ref", s.getSandbox, ownerOne...)
	e.DELETE("/v1/sandboxes/:ref", s.deleteSandbox, ownerOne...)
	e.POST("/v1/sandboxes/:ref/stop", s.stopSandbox, ownerOne...)
	e.POST("/v1/sandboxes/:ref/resume", s.resumeSandbox, ownerOne...)
	e.POST("/v1/sandboxes/:ref/ttl", s.setTTL, ownerOne...)
	get("/v1/sandboxes/:ref/environment", s.environment, ownerOne...)
	e.POST("/v1/sandboxes/:ref/delegations", s.mintDelegation, ownerOne...)
	get("/v1/sandboxes/:ref/delegations", s.listDelegations, ownerOne...)
	e.DELETE("/v1/sandboxes/:ref/delegations", s.revokeAllDelegations, ownerOne...)
	e.DELETE("/v1/sandboxes/:ref/delegations/:jti", s.revokeDelegation, ownerOne...)
	e.POST("/v1/tokens/introspect", s.introspect, owner...)
	// The dataplane authenticates API keys and delegation tokens itself (docs/dataplane.md).
	get("/v1/sandboxes/:ref/dataplane", s.dataplane)
	// Its upload operation over plain HTTP, for bulk bytes (dataplane_put.go).
	e.PUT(uploadRoute, s.uploadPut)
	// MCP (Streamable HTTP) takes a delegation token only, checked by its handler (mcp.go).
	e.POST(mcpRoute, s.mcpEndpoint)
	e.GET(mcpRoute, s.mcpEndpoint) // no HEAD: a HEAD cannot open an MCP stream (405)
	e.DELETE(mcpRoute, s.mcpEndpoint)
	get("/v1/sandboxes/:ref/events", s.sandboxEvents, ownerOne...)
	get("/v1/events", s.orgEvents, owner...)
	get("/v1/orphans", s.orphans, owner...)
	get("/v1/limits", s.getLimits, owner...)
	s.routes = map[string]bool{}
	for _, r := range e.Routes() {
		s.routes[r.Path] = true
	}
	return s
}

// Routes lists "METHOD /path/{param}" for every route, in OpenAPI path syntax.
func (s *Server) Routes() []string {
	var out []string
	for _, r := range s.e.Routes() {
		parts := strings.Split(r.Path, "/")
		for i, p := range parts {
			if strings.HasPrefix(p, ":") {
				parts[i] = "{" + p[1:] + "}"
			}
		}
		out = append(out, r.Method+" "+strings.Join(parts, "/"))
	}
	sort.Strings(out)
	return out
}

// Handler is the server's http.Handler (tests serve it with httptest).
func (s *Server) Handler() http.Handler { return s.e }

// Serve serves on l until Shutdown. It also follows revocations announced by every broker, to close
// the dataplane connections they concern. Call it once.
func (s *Server) Serve(l net.Listener) error {
	// Subscribed before the first request is served, so no revocation can slip past a cache or an
	// open connection.
	// Caches first, then connections: by the time a connection closes on a revocation, a new
	// upgrade with its credential is refused too.
	err := delegation.Subscribe(s.bgCtx, s.store, func(r delegation.Revocation) {
		s.delegation.Forget(r)
		s.hub.revoked(r)
	}, s.revocationsMissed)
	if err != nil {
		return err
	}
	err = delegation.FollowKeyRevocations(s.bgCtx, s.store, func(id string) {
		s.apiKeys.evict(id)
		s.delegation.ForgetKey(id)
		s.hub.keyRevoked(id)
		s.streams.keyRevoked(id)
	}, s.revocationsMissed)
	if err != nil {
		s.stopBackground() // ends the revocation subscription started above
		return err
	}
	err = s.http.Serve(newSourceLimiter(l, s.connsPerSource, s.limitMetrics.sourceRefusals))
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// revocationsMissed catches up after a revocation subscription was made again: what was announced
// while it was down is lost, so every cached credential is read again at its next use and every
// open connection (MCP sessions' included) and event stream re-checks its credential now rather
// than at its periodic re-check. Caches first, then connections, as for an announcement.
func (s *Server) revocationsMissed() {
	s.log.Warn("the revocation subscription was cut and is back: revocations announced meanwhile were missed; forgetting cached credentials and re-checking every dataplane connection")
	s.apiKeys.evictAll()
	s.delegation.ForgetAll()
	s.hub.recheckAll()
	s.recheckStreams()
}

// Shutdown stops accepting, lets in-flight requests finish until ctx ends, then closes the rest.
func (s *Server) Shutdown(ctx context.Context) error {
	// http.Server.Shutdown does not touch hijacked (WebSocket) connections: the hub drains them,
	// meanwhile. Revocations are still followed while they drain; event streams (which
	// http.Server.Shutdown would wait for) end after.
	httpDone := make(chan error, 1)
	go func() { httpDone <- s.http.Shutdown(ctx) }()
	s.hub.drain(ctx)
	s.stopBackground()
	s.hub.closeAll()
	return <-httpDone
}

func (s *Server) healthz(c echo.Context) error {
	return c.JSON(http.StatusOK, map[string]string{"status": "ok"})
}

func (s *Server) readyz(c echo.Context) error {
	r := s.ready(c.Request().Context())
	status := http.StatusOK
	if !r.Ready {
		status = http.StatusServiceUnavailable
	}
	return c.JSON(status, r)
}

// recoverPanics turns a handler panic into a 500 (logged with its stack) instead of a dead broker.
func (s *Server) recoverPanics(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) (err error) {
		defer func() {
			if r := recover(); r != nil {
				if r == http.ErrAbortHandler {
					panic(r)
				}
				s.log.Error("handler panic", "request_id", requestID(c), "route", c.Path(), "panic", r, "stack", string(debug.Stack()))
				err = errors.New("panic")
			}
		}()
		return next(c)
	}
}
