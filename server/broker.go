package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"time"

	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/heartbeat"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// BrokerConfig is what a broker is made of, given its storage and its sandbox provider.
type BrokerConfig struct {
	Store     *store.Store
	Provider  sandbox.Provider
	Templates map[string]sandbox.Template
	// ProviderReport is what preflight found: /readyz and /metrics report the provider, its
	// isolation, whether limits are enforced, a fallback and the warning (zero: only the name).
	ProviderReport sandbox.ProviderReport
	// Node names this broker; AdvertiseURL is how clients reach it (dataplane URLs are built from it).
	Node         string
	AdvertiseURL string
	// DataDir holds the index of hosted sandboxes; SigningKeys the token keys.
	DataDir     string
	SigningKeys string
	// WorkspaceUID owns the files the broker creates in workspaces (-1: leave ownership alone).
	WorkspaceUID int
	// SandboxUIDs is the host uid range each sandbox gets its own uid from (zero: none, sandboxes
	// share the provider's uid).
	SandboxUIDs store.UIDRange
	Log         *slog.Logger
	// Now is the clock of every lease, deadline and token (nil: time.Now).
	Now                                       func() time.Time
	DefaultTTL, MaxTTL, TokenTTL, TokenMaxTTL time.Duration
	// SweepInterval runs the sweeper in the background; 0 leaves it to the caller (tests call
	// Sweeper.SweepOnce).
	SweepInterval, ExpiryWarning, Retention time.Duration
	// EventBuffer is how many events the broker keeps while Redis is away (0: events.DefaultBuffer).
	EventBuffer          int
	AllowedOrigins       []string
	DataplaneRenewsLease bool
	// NodeHeartbeat is how often this broker renews its node record (its URL and liveness) in
	// Redis; NodeLostAfter is how long a node may be silent before another broker declares it
	// lost. Zero: DefaultNodeHeartbeat, DefaultNodeLostAfter.
	NodeHeartbeat, NodeLostAfter time.Duration
	// Limits are the default limits of orgs without their own (docs/operations.md).
	Limits store.Limits
	// AuthFailures failed authentications from one source within AuthFailureWindow make it wait
	// out the window (0: no limit).
	AuthFailures      int
	AuthFailureWindow time.Duration
	// MetricsTokenHash is the SHA-256 of the operator's metrics token, which unlocks /metrics'
	// per-org series (nil: never served).
	MetricsTokenHash []byte
	// Dataplane bounds dataplane connections (zero values: the defaults).
	Dataplane DataplaneLimits
	// EventStreamsPerKey bounds one API key's open event streams (0: the default).
	EventStreamsPerKey int
	// ConnsPerSource bounds one source address's open connections (0: the default).
	ConnsPerSource int
}

// Node liveness defaults: a broker renews its node record every DefaultNodeHeartbeat, and one
// silent for DefaultNodeLostAfter is declared lost (Nomad's default heartbeat grace is of the same
// order; Kubernetes waits 40 s).
const (
	DefaultNodeHeartbeat = 5 * time.Second
	DefaultNodeLostAfter = 30 * time.Second
)

// Broker is one running broker: its lifecycle manager, delegation, sweeper, event writer and HTTP
// server, wired together once, here, for cmd/broker and for servertest alike.
type Broker struct {
	Server     *Server
	Sandboxes  *sandbox.Manager
	Delegation *delegation.Service
	Keys       *delegation.Keyring
	Sweeper    *heartbeat.Sweeper
	events     *events.Writer
	stop       context.CancelFunc
	loops      sync.WaitGroup
}

// NewBroker wires a broker, recovers the sandboxes this node hosts, registers the node, and starts
// its background loops (node commands and reconcile, signing key reloads, the sweeper).
func NewBroker(ctx context.Context, cfg BrokerConfig) (*Broker, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Limits.Connections == 0 {
		// The per-org connection cap always has a default: the dataplane's.
		cfg.Limits.Connections = cfg.Dataplane.withDefaults().PerOrg
	}
	cfg.Store.SetDefaultLimits(cfg.Limits)
	b := &Broker{events: events.NewWriterWithOptions(cfg.Store, cfg.Log, events.WriterOptions{Buffer: cfg.EventBuffer})}
	// Once Recover has restarted sandboxes, a failure must stop them again: nothing else would.
	fail := func(err error) (*Broker, error) {
		if b.Sandboxes != nil {
			b.Sandboxes.Close(context.WithoutCancel(ctx))
		}
		b.events.Close()
		return nil, err
	}
	var err error
	// What can fail without starting anything comes first, before Recover starts sandboxes.
	if b.Keys, err = delegation.LoadOrCreateKeyring(cfg.SigningKeys, cfg.Now); err != nil {
		return fail(fmt.Errorf("signing keys: %w", err))
	}
	b.Delegation, err = delegation.NewService(delegation.ServiceConfig{
		Keys: b.Keys, Store: cfg.Store, Events: b.events.Emit, Log: cfg.Log,
		Token:        delegation.Config{DefaultTTL: cfg.TokenTTL, MaxTTL: cfg.TokenMaxTTL, Now: cfg.Now},
		DataplaneURL: dataplaneURL(cfg.Store, cfg.Node, cfg.AdvertiseURL),
	})
	if err != nil {
		return fail(err)
	}
	b.Sandboxes, err = sandbox.NewManager(sandbox.Config{
		Store: cfg.Store, Provider: cfg.Provider, Templates: cfg.Templates, Node: cfg.Node, Events: b.events.Emit,
		Log: cfg.Log, Now: cfg.Now, DefaultTTL: cfg.DefaultTTL, MaxTTL: cfg.MaxTTL,
		IndexDir: filepath.Join(cfg.DataDir, "hosted"), Workspace: sandbox.WorkspaceOptions{UID: cfg.WorkspaceUID, GID: cfg.WorkspaceUID},
		UIDs: cfg.SandboxUIDs,
	})
	if err != nil {
		return fail(err)
	}
	// Before Recover, which claims places for the sandboxes it restarts.
	if err := cfg.Store.RecountRunning(ctx); err != nil {
		cfg.Log.Error("counting the orgs' running sandboxes for their max_running limits", "err", err)
	}
	if err := b.Sandboxes.Recover(ctx); err != nil {
		cfg.Log.Error("recovering this node's sandboxes", "err", err)
	}
	advertise, err := protocol.BrokerBaseURL(cfg.AdvertiseURL)
	if err != nil {
		return fail(fmt.Errorf("advertise URL: %w", err))
	}
	// The node record is renewed every beat from here on, so one lost with Redis' data comes back.
	live := &sandbox.Liveness{URL: advertise, Every: cmp.Or(cfg.NodeHeartbeat, DefaultNodeHeartbeat),
		LostAfter: cmp.Or(cfg.NodeLostAfter, DefaultNodeLostAfter)}
	if err := b.Sandboxes.Beat(ctx, live); err != nil {
		return fail(err)
	}
	prov := ProviderInfo{Name: cfg.Provider.Name(), Isolation: sandbox.Isolation(cfg.Provider.Name()),
		LimitsEnforced: cfg.ProviderReport.LimitsEnforced, DiskQuota: cfg.ProviderReport.DiskQuota, Fallback: cfg.ProviderReport.Fallback,
		Levels: isolationLevels(cfg.Provider)}
	var warnings []string
	if cfg.ProviderReport.Warning != "" {
		warnings = []string{cfg.ProviderReport.Warning}
	}
	b.Server = New(Config{
		Store: cfg.Store, Sandboxes: b.Sandboxes, Delegation: b.Delegation, Keys: b.Keys, Events: b.events,
		Log: cfg.Log, Now: cfg.Now, AllowedOrigins: cfg.AllowedOrigins, DataplaneRenewsLease: cfg.DataplaneRenewsLease,
		Provider: prov, Dataplane: cfg.Dataplane, EventStreamsPerKey: cfg.EventStreamsPerKey, ConnsPerSource: cfg.ConnsPerSource, DataplaneURL: dataplaneURL(cfg.Store, cfg.Node, advertise),
		AuthFailures: cfg.AuthFailures, AuthFailureWindow: cfg.AuthFailureWindow, MetricsTokenHash: cfg.MetricsTokenHash,
		Ready: func(ctx context.Context) ReadyReport {
			r := ReadyReport{Ready: true, ProviderInfo: prov, Redis: "ok", Node: cfg.Node, Warnings: warnings, Pool: b.Sandboxes.PoolStats()}
			if err := cfg.Store.Ping(ctx); err != nil {
				r.Ready, r.Redis = false, "unreachable"
			}
			return r
		},
	})
	b.Sweeper = heartbeat.NewSweeper(heartbeat.Config{Store: cfg.Store, Sandboxes: b.Sandboxes, Events: b.events.Emit, Log: cfg.Log,
		Now: cfg.Now, Interval: cfg.SweepInterval, Warning: cfg.ExpiryWarning, Retention: cfg.Retention})

	loopCtx, stop := context.WithCancel(context.Background())
	b.stop = stop
	b.loop(func() { b.Sandboxes.Run(loopCtx, 5*time.Second) })
	b.loop(func() { reloadKeys(loopCtx, b.Keys, cfg.Log) })
	b.loop(func() { b.Sandboxes.RunLiveness(loopCtx, live) })
	b.loop(func() { b.Sandboxes.RunPool(loopCtx) })
	if cfg.SweepInterval > 0 {
		b.loop(func() { b.Sweeper.Run(loopCtx) })
	}
	return b, nil
}

func (b *Broker) loop(fn func()) {
	b.loops.Add(1)
	go func() { defer b.loops.Done(); fn() }()
}

// Serve serves the API, dataplane and events on l until Shutdown.
func (b *Broker) Serve(l net.Listener) error { return b.Server.Serve(l) }

// Shutdown stops accepting, lets requests in flight finish until ctx ends, closes dataplane and
// event streams, stops the background loops and every sandbox's processes (their records stay
// running: the next start brings them back; runtimes that outlive the broker, pods, are let go of
// and taken back instead) and flushes the event log.
func (b *Broker) Shutdown(ctx context.Context) error {
	err := b.Server.Shutdown(ctx)
	b.stop()
	b.loops.Wait()
	b.Sandboxes.Close(context.WithoutCancel(ctx))
	b.events.Close()
	if errors.Is(err, context.DeadlineExceeded) {
		return nil // the remaining connections were closed
	}
	return err
}

// reloadKeys picks up a signing key rotation done by `broker keys rotate-signing` (another process).
func reloadKeys(ctx context.Context, keys *delegation.Keyring, log *slog.Logger) {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := keys.Reload(); err != nil {
				log.Error("reloading signing keys", "err", err)
			}
		}
	}
}

// dataplaneURL builds a sandbox's dataplane URL from the base URL of the broker hosting it: this
// broker's own without asking Redis (so a node record lost with Redis' data costs nothing here),
// another's from its node record, which that broker renews every node heartbeat.
func dataplaneURL(st *store.Store, self, selfURL string) func(ctx context.Context, rec store.Record) (string, error) {
	return func(ctx context.Context, rec store.Record) (string, error) {
		base := selfURL
		if rec.Node != self {
			var err error
			if base, err = st.NodeURL(ctx, rec.Node); errors.Is(err, store.ErrNotFound) {
				// Its record went with Redis' data; that broker writes it again within a node beat.
				return "", protocol.Errorf(protocol.CodeUnavailable, "the broker hosting sandbox %s (%s) has no node record in Redis yet; retry shortly", rec.Name, rec.Node)
			} else if err != nil {
				return "", fmt.Errorf("the broker hosting sandbox %s (%s) is unknown: %w", rec.ID, rec.Node, err)
			}
		}
		// Built, scheme case and all, by the one function; a record written by an older broker
		// with HTTPS:// in capitals still gives wss://.
		u, err := protocol.DataplaneURL(base, rec.ID)
		if err != nil {
			return "", fmt.Errorf("the broker hosting sandbox %s (%s) registered a bad URL: %w", rec.ID, rec.Node, err)
		}
		return u, nil
	}
}

// isolationLevels is what /readyz and /metrics say of each isolation level on this host.
func isolationLevels(p sandbox.Provider) []IsolationLevel {
	offered, missing := sandbox.IsolationLevels(p)
	var out []IsolationLevel
	for _, l := range offered {
		out = append(out, IsolationLevel{Level: l, Available: true})
	}
	for _, l := range []string{protocol.IsolationNamespace, protocol.IsolationGvisor, protocol.IsolationMicroVM} {
		if why, ok := missing[l]; ok {
			out = append(out, IsolationLevel{Level: l, Missing: why})
		}
	}
	return out
}
