// Package servertest starts a real broker in-process for tests: a real redis-server (via
// redistest), a real sandbox provider with its resident init, the real HTTP server on a loopback
// port, and an org with an API key. It returns SDK clients. Nothing is mocked.
//
// A test binary that uses it must let the sandbox init run: its TestMain calls Main.
package servertest

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/heartbeat"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// Main is TestMain for packages that start brokers: the test binary doubles as the sandbox init.
// When every test passed it also fails the run if goroutines outlive the tests (goleak): a broker
// that Shutdown does not fully stop, a subscription nobody closes.
func Main(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == provider.InitArg {
		provider.RunInit()
	}
	code := m.Run()
	if code == 0 {
		// Keep-alive connections of tests' plain HTTP requests are the client's, not a leak.
		http.DefaultClient.CloseIdleConnections()
		if err := goleak.Find(leakOptions...); err != nil {
			fmt.Fprintf(os.Stderr, "servertest: goroutines outlived the tests:\n%v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// leakOptions are the goroutines that may outlive a package's tests: the provider's spawner, which
// lives as long as the process by design (sandbox/provider's spawn), and go-redis' redial of a
// Redis a test killed, which sleeps a second between attempts and only then sees its pool closed.
var leakOptions = []goleak.Option{
	goleak.IgnoreTopFunction("github.com/sbxbroker/broker/sandbox/provider.spawn.func1.1"),
	goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
}

// Options change the broker a test gets.
type Options struct {
	// Provider is "dir" (default: fast, no isolation) or "namespace" (real bubblewrap).
	Provider string
	// ProviderImpl, when set, is the provider itself (the kubernetes provider on a test cluster);
	// Provider is then ignored.
	ProviderImpl provider.Provider
	// Redis reuses a server (two brokers on one Redis); nil starts a new one.
	Redis *redistest.Server
	// Now is the broker's clock (nil = time.Now). When set, it is the store's lease clock too, in
	// place of Redis TIME, so tests move leases by hand (see store.Options.Clock).
	Now func() time.Time
	// RedisTime keeps Redis TIME as the lease clock even when Now is set: a broker whose own clock
	// is wrong, as in production.
	RedisTime bool
	// RedisTimeout bounds each Redis call (0: store.DefaultTimeout).
	RedisTimeout time.Duration
	// DataDir reuses a data dir (a broker restart); "" makes a new one.
	DataDir string
	// SigningKeys is the token keyring's directory; "" keeps it in DataDir. Two brokers given the
	// same one verify each other's tokens, as brokers sharing a keyring do in production.
	SigningKeys string
	// Node names the broker (default "node-test").
	Node string
	// NodeHeartbeat is how often the broker renews its node record (0: the broker's default);
	// NodeLostAfter is how long a silent node has before it is declared lost (0: the default).
	NodeHeartbeat, NodeLostAfter time.Duration
	Templates                    map[string]provider.Template
	// Log receives the broker's logs (default: discarded unless -v).
	Log *slog.Logger
	// SandboxUIDs is the range sandboxes get their own host uid from under a root broker; nil
	// means the broker's default (DefaultSandboxUIDs), a zero range none (they share
	// provider.DefaultUID, as before each got its own).
	SandboxUIDs *store.UIDRange
	// Limits are the broker's default org limits (zero: none).
	Limits store.Limits
	// AuthFailures per AuthFailureWindow from one source are allowed (0: no limit).
	AuthFailures      int
	AuthFailureWindow time.Duration
	// MetricsToken unlocks /metrics' per-org series ("": none does).
	MetricsToken string
	// Dataplane bounds dataplane connections (zero values: the broker's defaults).
	Dataplane server.DataplaneLimits
	// EventStreamsPerKey bounds one API key's open event streams (0: the broker's default).
	EventStreamsPerKey int
	// ConnsPerSource bounds one source address's open connections (0: the broker's default).
	ConnsPerSource int
	// RedisDialer, when set, opens the broker's connections to Redis (a test's faulty network in
	// front of the real server).
	RedisDialer func(ctx context.Context, network, addr string) (net.Conn, error)
	// Listener, when set, wraps the broker's API listener (a test that watches its clients'
	// connections from the broker's side).
	Listener func(net.Listener) net.Listener
}

// DefaultSandboxUIDs is cmd/broker's default --sandbox-uids, without its shared --sandbox-uid.
var DefaultSandboxUIDs = store.UIDRange{First: 100000, Last: 165535, Skip: provider.DefaultUID}

// Broker is a running in-process broker.
type Broker struct {
	URL     string
	Client  *client.Client // an owner of Org
	Org     string
	Redis   *redistest.Server
	RDB     redis.UniversalClient
	Store   *store.Store
	Manager *sandbox.Manager
	Keys    *delegation.Keyring
	Server  *server.Server
	// Sweeper runs on the broker's clock; tests call SweepOnce (it is not started in the background).
	Sweeper *heartbeat.Sweeper
	now     func() time.Time
	DataDir string
	t       testing.TB
	stop    func()
	// stopWithin is the shutdown timeout Stop gives the broker.
	stopWithin time.Duration
}

// New starts a broker and stops it when t ends.
func New(t testing.TB, opts Options) *Broker {
	t.Helper()
	if opts.Redis == nil {
		opts.Redis = redistest.Start(t)
	}
	if opts.DataDir == "" {
		opts.DataDir = DataDir(t)
	}
	if opts.Node == "" {
		opts.Node = "node-test"
	}
	if opts.SigningKeys == "" {
		opts.SigningKeys = filepath.Join(opts.DataDir, "signing")
	}
	if opts.Provider == "" {
		opts.Provider = "dir"
	}
	var leaseClock func() time.Time
	if opts.Now == nil {
		opts.Now = time.Now
	} else if !opts.RedisTime {
		leaseClock = opts.Now
	}
	if opts.Templates == nil {
		opts.Templates = map[string]provider.Template{"default": provider.DefaultTemplate()}
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
		if testing.Verbose() {
			log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		}
	}
	// The client is bounded as cmd/broker's is.
	ropts := &redis.UniversalOptions{Addrs: []string{opts.Redis.Addr}, Dialer: opts.RedisDialer}
	store.BoundOptions(ropts, opts.RedisTimeout)
	rdb := redis.NewUniversalClient(ropts)
	t.Cleanup(func() { rdb.Close() })
	st := store.NewWithOptions(rdb, store.Options{Timeout: opts.RedisTimeout, Clock: leaseClock, Log: log})
	prov, report := opts.ProviderImpl, provider.Report{}
	if prov == nil {
		var err error
		prov, report, err = provider.Preflight(context.Background(), provider.Config{DataDir: opts.DataDir}, opts.Provider)
		if err != nil {
			t.Fatalf("servertest: provider %s: %v", opts.Provider, err)
		}
	} else {
		report.Provider = prov.Name()
	}
	uid := -1
	var uids store.UIDRange
	if os.Geteuid() == 0 { // both providers run sandboxes as their own uid under a root broker
		uid = provider.DefaultUID
		uids = DefaultSandboxUIDs
		if opts.SandboxUIDs != nil {
			uids = *opts.SandboxUIDs
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if opts.Listener != nil {
		l = opts.Listener(l)
	}
	url := "http://" + l.Addr().String()
	// The same wiring as cmd/broker; the sweeper is left to the test (SweepOnce on its clock).
	br, err := server.NewBroker(context.Background(), server.BrokerConfig{
		Store: st, Provider: prov, ProviderReport: report, Templates: opts.Templates, Node: opts.Node, AdvertiseURL: url,
		DataDir: opts.DataDir, SigningKeys: opts.SigningKeys, WorkspaceUID: uid, SandboxUIDs: uids,
		Log: log, Now: opts.Now, DefaultTTL: 30 * time.Minute, MaxTTL: 7 * 24 * time.Hour,
		NodeHeartbeat: opts.NodeHeartbeat, NodeLostAfter: opts.NodeLostAfter,
		Limits: opts.Limits, AuthFailures: opts.AuthFailures, AuthFailureWindow: opts.AuthFailureWindow,
		MetricsTokenHash: metricsTokenHash(opts.MetricsToken), Dataplane: opts.Dataplane, EventStreamsPerKey: opts.EventStreamsPerKey, ConnsPerSource: opts.ConnsPerSource,
	})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { defer close(served); br.Serve(l) }()

	b := &Broker{URL: url, Redis: opts.Redis, RDB: rdb, Store: st, Manager: br.Sandboxes, Keys: br.Keys, Server: br.Server,
		Sweeper: br.Sweeper, DataDir: opts.DataDir, t: t, now: opts.Now, stopWithin: 10 * time.Second}
	var once sync.Once
	b.stop = func() {
		once.Do(func() {
			sctx, cancel := context.WithTimeout(context.Background(), b.stopWithin)
			defer cancel()
			br.Shutdown(sctx)
			<-served
			st.Close()
		})
	}
	t.Cleanup(b.stop)
	b.Org = "test-org"
	b.Client = b.NewClient(b.Org)
	return b
}

// DataDir makes a temp data dir that namespace sandboxes can use: bubblewrap, running as the sandbox
// uid, must be able to reach it, and t.TempDir() and its parent are 0700.
func DataDir(t testing.TB) string {
	d := t.TempDir()
	t.Cleanup(func() { provider.UnmountUnder(d) }) // runs before TempDir's removal
	for _, p := range []string{filepath.Dir(d), d} {
		if err := os.Chmod(p, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	return d
}

// Stop stops the broker now (a restart test starts another on the same DataDir and Redis), with a
// shutdown timeout of 10 s.
func (b *Broker) Stop() { b.stop() }

// StopWithin is Stop with shutdown timeout d: how long requests in flight may take to finish.
func (b *Broker) StopWithin(d time.Duration) {
	b.stopWithin = d
	b.stop()
}

// NewClient makes an API key for org (created if new) and returns a client using it.
func (b *Broker) NewClient(org string) *client.Client {
	b.t.Helper()
	key, _, err := b.Store.CreateAPIKey(context.Background(), org, "test", time.Now())
	if err != nil {
		b.t.Fatal(err)
	}
	c, err := client.New(b.URL, key)
	if err != nil {
		b.t.Fatal(err)
	}
	spec, err := LoadSpec()
	if err != nil {
		b.t.Fatalf("servertest: docs/openapi.yaml: %v", err)
	}
	// Every answer the SDK gets is checked against docs/openapi.yaml.
	c.SetHTTPClient(&http.Client{Transport: &checkingTransport{t: b.t, spec: spec, next: http.DefaultTransport}})
	return c
}

// RedisSnapshot returns every key with a dump of its value, to assert that a refused request changed
// nothing. Event streams are left out: they record attempts, not state.
func (b *Broker) RedisSnapshot() map[string]string {
	b.t.Helper()
	ctx := context.Background()
	keys, err := b.RDB.Keys(ctx, "*").Result()
	if err != nil {
		b.t.Fatal(err)
	}
	snap := make(map[string]string, len(keys))
	for _, k := range keys {
		if typ, _ := b.RDB.Type(ctx, k).Result(); typ == "stream" {
			continue
		}
		v, _ := b.RDB.Dump(ctx, k).Result()
		snap[k] = v
	}
	return snap
}

// Clock is a clock tests move by hand.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock starts a clock at t.
func NewClock(t time.Time) *Clock { return &Clock{t: t} }

// Now reads the clock.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock forward.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// RetentionSweeper is a sweeper like b.Sweeper that also deletes sandboxes stopped longer than
// retention.
func RetentionSweeper(b *Broker, retention time.Duration) *heartbeat.Sweeper {
	return heartbeat.NewSweeper(heartbeat.Config{Store: b.Store, Sandboxes: b.Manager, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Now: b.now, Retention: retention})
}

func metricsTokenHash(token string) []byte {
	if token == "" {
		return nil
	}
	sum := sha256.Sum256([]byte(token))
	return sum[:]
}
