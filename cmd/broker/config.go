package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/store"
)

// config is the broker's whole configuration, read once at start from flags with SBX_* env fallbacks.
type config struct {
	Listen          string
	RedisURL        string
	RedisTimeout    time.Duration
	DataDir         string
	Provider        string
	Runsc           string
	ProviderReset   bool
	AllowUnisolated bool
	Kube            kubeConfig
	AdvertiseURL    string
	LogFormat       string
	LogLevel        string
	Templates       string
	Node            string
	DefaultTTL      time.Duration
	MaxTTL          time.Duration
	SandboxUID      int
	SandboxUIDs     string
	uids            store.UIDRange // SandboxUIDs parsed by validate; zero for "shared"
	DiskReserve     string
	ShutdownTimeout time.Duration
	SigningKeys     string
	TokenTTL        time.Duration
	TokenMaxTTL     time.Duration
	SweepInterval   time.Duration
	NodeHeartbeat   time.Duration
	NodeLostAfter   time.Duration
	ExpiryWarning   time.Duration
	Retention       time.Duration
	EventBuffer     int
	DataplaneRenews bool
	AllowedOrigins  []string
	DebugListen     string
	// MetricsTokenFile holds the token that unlocks /metrics' per-org series.
	MetricsTokenFile string
	// Limits are the default org limits (limitFlags).
	Limits store.Limits
	// AuthFailures per AuthFailureWindow from one source address are allowed (authFlags).
	AuthFailures      int
	AuthFailureWindow time.Duration
	// MaxDPConns, MaxDPConnsPerOrg and MaxDPConnsPerCredential bound dataplane connections.
	MaxDPConns, MaxDPConnsPerOrg, MaxDPConnsPerCredential int
	// MaxEventStreamsPerKey bounds one API key's open event streams.
	MaxEventStreamsPerKey int
	// MaxConnsPerSource bounds one source address's open connections.
	MaxConnsPerSource int
}

// envOf maps each flag to its environment fallback.
var envOf = map[string]string{
	"listen": "SBX_LISTEN", "redis-url": "SBX_REDIS_URL", "redis-timeout": "SBX_REDIS_TIMEOUT",
	"data-dir": "SBX_DATA_DIR", "provider": "SBX_PROVIDER", "runsc": "SBX_RUNSC",
	"provider-reset": "SBX_PROVIDER_RESET", "allow-unisolated": "SBX_ALLOW_UNISOLATED",
	"advertise-url": "SBX_ADVERTISE_URL", "log-format": "SBX_LOG_FORMAT", "log-level": "SBX_LOG_LEVEL",
	"templates": "SBX_TEMPLATES", "node": "SBX_NODE", "default-ttl": "SBX_DEFAULT_TTL", "max-ttl": "SBX_MAX_TTL",
	"sandbox-uid": "SBX_SANDBOX_UID", "sandbox-uids": "SBX_SANDBOX_UIDS", "disk-reserve": "SBX_DISK_RESERVE", "shutdown-timeout": "SBX_SHUTDOWN_TIMEOUT",
	"signing-keys": "SBX_SIGNING_KEYS", "token-ttl": "SBX_TOKEN_TTL", "token-max-ttl": "SBX_TOKEN_MAX_TTL",
	"sweep-interval": "SBX_SWEEP_INTERVAL", "node-heartbeat": "SBX_NODE_HEARTBEAT", "node-lost-after": "SBX_NODE_LOST_AFTER",
	"expiry-warning": "SBX_EXPIRY_WARNING", "retention": "SBX_RETENTION", "event-buffer": "SBX_EVENT_BUFFER",
	"dataplane-renews-lease": "SBX_DATAPLANE_RENEWS_LEASE", "allowed-origins": "SBX_ALLOWED_ORIGINS",
	"debug-listen": "SBX_DEBUG_LISTEN", "metrics-token-file": "SBX_METRICS_TOKEN_FILE", "org-max-running": "SBX_ORG_MAX_RUNNING", "org-max-sandboxes": "SBX_ORG_MAX_SANDBOXES",
	"org-rps": "SBX_ORG_RPS", "org-burst": "SBX_ORG_BURST", "auth-failures": "SBX_AUTH_FAILURES",
	"auth-failure-window":                      "SBX_AUTH_FAILURE_WINDOW",
	"max-dataplane-connections":                "SBX_MAX_DATAPLANE_CONNECTIONS",
	"max-dataplane-connections-per-org":        "SBX_MAX_DATAPLANE_CONNECTIONS_PER_ORG",
	"max-dataplane-connections-per-credential": "SBX_MAX_DATAPLANE_CONNECTIONS_PER_CREDENTIAL",
	"max-event-streams-per-key":                "SBX_MAX_EVENT_STREAMS_PER_KEY",
	"max-connections-per-source":               "SBX_MAX_CONNECTIONS_PER_SOURCE",
}

// defaultDataDir is /var/lib/sbx-broker for root (a daemon's state; namespace sandboxes run as an
// unprivileged uid that must be able to reach it, which /root would forbid), else the user's XDG
// data dir.
func defaultDataDir() string {
	if os.Geteuid() == 0 {
		return "/var/lib/sbx-broker"
	}
	if d := os.Getenv("XDG_DATA_HOME"); d != "" {
		return filepath.Join(d, "sbx-broker")
	}
	if home, err := os.UserHomeDir(); err == nil {
		return filepath.Join(home, ".local", "share", "sbx-broker")
	}
	return "sbx-broker-data"
}

// storageFlags are shared by serve and the admin commands (they reach the same Redis).
func storageFlags(fs *pflag.FlagSet, c *config) {
	fs.StringVar(&c.RedisURL, "redis-url", "", "Redis to keep state in: redis://host:port, a comma list (Cluster), redis-cluster://h1,h2 or redis-sentinel://h1,h2/master; empty = an embedded redis-server with its data in --data-dir")
	fs.DurationVar(&c.RedisTimeout, "redis-timeout", store.DefaultTimeout, "longest a Redis call may take, retries included; a Redis that does not answer in time makes requests answer 503 (retry) instead of hanging")
	fs.StringVar(&c.DataDir, "data-dir", defaultDataDir(), "directory for sandboxes' files, the embedded Redis and signing keys (with the namespace provider it and its parents must be searchable, o+x, by the sandbox uids)")
	fs.StringVar(&c.LogFormat, "log-format", "text", "log format: text or json")
	fs.StringVar(&c.LogLevel, "log-level", "info", "log level: debug, info, warn or error (request logs are debug)")
	fs.StringVar(&c.SigningKeys, "signing-keys", "", "directory of the Ed25519 keys that sign delegation tokens (default <data-dir>/signing; brokers sharing one Redis must share it)")
}

// annotateEnv appends "(env SBX_...)" to the help of every flag of cmd and its subcommands that
// has an environment fallback, so --help lists the variables from envOf, the one place they live.
func annotateEnv(cmd *cobra.Command) {
	seen := map[*pflag.Flag]bool{}
	var walk func(*cobra.Command)
	walk = func(c *cobra.Command) {
		for _, fs := range []*pflag.FlagSet{c.PersistentFlags(), c.LocalNonPersistentFlags()} {
			fs.VisitAll(func(f *pflag.Flag) {
				if env, ok := envOf[f.Name]; ok && !seen[f] {
					seen[f] = true
					f.Usage += " (env " + env + ")"
				}
			})
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(cmd)
}

// signingDir is where the token signing keys live.
func (c *config) signingDir() string {
	if c.SigningKeys != "" {
		return c.SigningKeys
	}
	return filepath.Join(c.DataDir, "signing")
}

func serveFlags(fs *pflag.FlagSet, c *config) {
	fs.StringVar(&c.Listen, "listen", "127.0.0.1:7070", "address to serve the API, dataplane and events on")
	fs.StringVar(&c.Runsc, "runsc", "", "gVisor's runsc for templates with isolation: gvisor (default: runsc in PATH, else the one scripts/runsc.sh built into ~/.cache/sbx-broker); it must be a static build")
	fs.StringVar(&c.Provider, "provider", "auto", "sandbox provider: auto (namespace where it works, else dir), namespace (bubblewrap isolation), dir (no isolation) or kubernetes (pods on a cluster: --kubeconfig, --namespace, --kube-image)")
	fs.BoolVar(&c.ProviderReset, "provider-reset", false, "forget the provider this data dir was set up with and choose again (a data dir set up for namespace sandboxes is never moved to dir this way)")
	fs.BoolVar(&c.AllowUnisolated, "allow-unisolated", false, "confirm --provider dir on a data dir set up for namespace sandboxes: they then run with no isolation")
	kubeFlags(fs, c)
	fs.StringVar(&c.AdvertiseURL, "advertise-url", "", "base URL clients and agent servers reach this broker at, used to build dataplane_url (default http://<listen>; set it when --listen is 0.0.0.0 or :PORT)")
	fs.StringVar(&c.Templates, "templates", "", "YAML or JSON file of sandbox templates (a built-in \"default\" always exists)")
	fs.StringVar(&c.Node, "node", "", "this broker's node name, recorded on the sandboxes it hosts (default: generated once and kept in --data-dir)")
	fs.DurationVar(&c.DefaultTTL, "default-ttl", 30*time.Minute, "lease of a sandbox created without ttl_seconds: no heartbeat for this long and it is stopped")
	fs.DurationVar(&c.MaxTTL, "max-ttl", 7*24*time.Hour, "largest lease a client may ask for")
	fs.StringVar(&c.SandboxUIDs, "sandbox-uids", defaultSandboxUIDs, "host uids, FIRST-LAST, that sandboxes get one each (its gid is the same number) when the broker runs as root: per-uid kernel objects (keyrings, inotify, process counts) are then no sandbox's but its own; the range must belong to no user or group of the host; \"shared\" runs every sandbox as --sandbox-uid (deprecated: sandboxes then share those objects)")
	fs.IntVar(&c.SandboxUID, "sandbox-uid", 100000, "the uid sandboxes shared before each got its own from --sandbox-uids: never handed out, and what sandboxes run as with --sandbox-uids shared (deprecated; inside namespace sandboxes every uid appears as 1000; dir sandboxes run as it too, never as root)")
	fs.StringVar(&c.DiskReserve, "disk-reserve", "", "free space the data dir's filesystem keeps for the broker and Redis: below it a create or resume is refused (e.g. 2GiB; 0 turns the check off; default the smaller of 1GiB and 5% of the filesystem)")
	fs.DurationVar(&c.TokenTTL, "token-ttl", time.Hour, "lifetime of a delegation token minted without ttl_seconds")
	fs.DurationVar(&c.TokenMaxTTL, "token-max-ttl", 24*time.Hour, "longest lifetime a delegation token may be minted with (recorded in the signing-keys directory for keys rotate-signing)")
	fs.DurationVar(&c.SweepInterval, "sweep-interval", 2*time.Second, "how often the sweeper looks for expired leases (one broker sweeps at a time)")
	fs.DurationVar(&c.NodeHeartbeat, "node-heartbeat", server.DefaultNodeHeartbeat, "how often this broker renews its node record (its URL and liveness) in Redis")
	fs.DurationVar(&c.NodeLostAfter, "node-lost-after", server.DefaultNodeLostAfter, "a broker silent this long is declared lost by another: its sandboxes say node_status lost until it is back")
	fs.DurationVar(&c.ExpiryWarning, "expiry-warning", time.Minute, "send an expiring event this long before a sandbox's lease runs out")
	fs.IntVar(&c.EventBuffer, "event-buffer", events.DefaultBuffer, "events this broker keeps (about 400 bytes each) while Redis is away, written when it returns; past it a gap event per sandbox says how many were lost")
	fs.Var(client.Duration{D: &c.Retention}, "retention", "delete sandboxes stopped longer than this, e.g. 7d; 0, the default, keeps them until deleted")
	fs.BoolVar(&c.DataplaneRenews, "dataplane-renews-lease", false, "let dataplane activity renew a sandbox's lease (off: only the owner's heartbeats and calls do, so an agent left running cannot keep a sandbox alive)")
	fs.StringSliceVar(&c.AllowedOrigins, "allowed-origins", nil, "browser origins allowed to open the dataplane (comma-separated); none by default")
	fs.StringVar(&c.MetricsTokenFile, "metrics-token-file", "", "file holding a token (16 characters or more) that /metrics callers send as Authorization: Bearer to get the series that name orgs; without it /metrics serves only the series that name none")
	fs.StringVar(&c.DebugListen, "debug-listen", "", "serve Go's /debug/pprof profiles on this address (keep it on loopback); off by default")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "how long a graceful shutdown waits for requests in flight")
	fs.IntVar(&c.MaxDPConns, "max-dataplane-connections", server.DefaultMaxDataplaneConnections, "dataplane connections this broker serves at once; past it an upgrade is 503")
	fs.IntVar(&c.MaxConnsPerSource, "max-connections-per-source", server.DefaultConnsPerSource, "connections one source address (an IPv6 peer's /64) may hold open on this broker, of every kind (REST kept alive, event streams, dataplane); past it a new one is answered 429 too_many_connections and closed. Behind a proxy that hides clients' addresses every client is the proxy's: raise it, and cap clients at the proxy")
	fs.IntVar(&c.MaxEventStreamsPerKey, "max-event-streams-per-key", server.DefaultEventStreamsPerKey, "event streams (sbctl events -f, sbctl watch, GET .../events) one API key may have open on this broker; past it a stream is 429 too_many_connections")
	fs.IntVar(&c.MaxDPConnsPerCredential, "max-dataplane-connections-per-credential", server.DefaultDataplaneConnsPerCredential, "dataplane connections one API key or delegation token may have open on this broker; past it an upgrade is 429 too_many_connections")
}

// applyEnv fills every flag not given on the command line from its SBX_* variable.
func applyEnv(cmd *cobra.Command) error {
	var errs []error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		env, ok := envOf[f.Name]
		if !ok || f.Changed {
			return
		}
		if v, set := os.LookupEnv(env); set && v != "" {
			if err := f.Value.Set(v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %v", env, v, err))
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		return usage.Errorf("%v", err) // a setting is wrong: exit 2, as for a flag
	}
	return nil
}

// validate checks the settings serve uses; each error names the setting and how to fix it.
func (c *config) validate() error {
	var errs []error
	bad := func(flag, format string, args ...any) {
		errs = append(errs, fmt.Errorf("--%s (%s): %s", flag, envOf[flag], fmt.Sprintf(format, args...)))
	}
	if _, port, err := net.SplitHostPort(c.Listen); err != nil || port == "" {
		bad("listen", "%q is not host:port, e.g. 127.0.0.1:7070", c.Listen)
	}
	switch c.Provider {
	case "auto", "namespace", "dir", "kubernetes":
	default:
		bad("provider", "%q is not one of auto, namespace, dir, kubernetes", c.Provider)
	}
	c.validateKube(bad)
	if c.AllowUnisolated && c.Provider != "dir" {
		bad("allow-unisolated", "confirms --provider dir and goes with nothing else (the provider is %q)", c.Provider)
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		bad("log-format", "%q is not text or json", c.LogFormat)
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		bad("log-level", "%v", err)
	}
	if c.AdvertiseURL != "" {
		if _, err := protocol.BrokerBaseURL(c.AdvertiseURL); err != nil {
			bad("advertise-url", "%v", err)
		}
	}
	if c.DataDir == "" {
		bad("data-dir", "must not be empty")
	}
	if c.RedisTimeout < 50*time.Millisecond || c.RedisTimeout > time.Minute {
		bad("redis-timeout", "%s must be between 50ms and 1m", c.RedisTimeout)
	}
	if c.MaxTTL < time.Second {
		bad("max-ttl", "must be at least 1s")
	}
	if c.DefaultTTL < time.Second || c.DefaultTTL > c.MaxTTL {
		bad("default-ttl", "%s must be between 1s and --max-ttl (%s)", c.DefaultTTL, c.MaxTTL)
	}
	if c.SandboxUID < 1 || c.SandboxUID > 1<<31 {
		bad("sandbox-uid", "%d is not a valid non-root uid", c.SandboxUID)
	}
	if r, err := parseUIDRange(c.SandboxUIDs); err != nil {
		bad("sandbox-uids", "%v", err)
	} else {
		r.Skip = c.SandboxUID
		c.uids = r
	}
	if c.DiskReserve != "" {
		if _, err := provider.ParseByteSize(c.DiskReserve); err != nil {
			bad("disk-reserve", "%v", err)
		}
	}
	if c.Node != "" && !nodeRE.MatchString(c.Node) {
		bad("node", "%q must be 1-63 letters, digits, '-' or '_'", c.Node)
	}
	if c.TokenMaxTTL < time.Minute {
		bad("token-max-ttl", "must be at least 1m")
	}
	if c.TokenTTL < time.Second || c.TokenTTL > c.TokenMaxTTL {
		bad("token-ttl", "%s must be between 1s and --token-max-ttl (%s)", c.TokenTTL, c.TokenMaxTTL)
	}
	if c.SweepInterval < 100*time.Millisecond {
		bad("sweep-interval", "must be at least 100ms")
	}
	if c.NodeHeartbeat < 100*time.Millisecond || c.NodeHeartbeat > time.Minute {
		bad("node-heartbeat", "%s must be between 100ms and 1m", c.NodeHeartbeat)
	}
	if c.NodeLostAfter < 3*c.NodeHeartbeat {
		bad("node-lost-after", "%s must be at least three --node-heartbeat intervals (%s), so one late beat does not declare a live broker lost", c.NodeLostAfter, 3*c.NodeHeartbeat)
	}
	if c.ExpiryWarning <= 0 {
		bad("expiry-warning", "must be positive")
	}
	if c.EventBuffer < 1 || c.EventBuffer > 10_000_000 {
		bad("event-buffer", "%d must be between 1 and 10000000", c.EventBuffer)
	}
	if c.Retention < 0 || (c.Retention > 0 && c.Retention < time.Minute) {
		bad("retention", "must be 0 (off) or at least 1m")
	}
	if c.DebugListen != "" {
		if host, _, err := net.SplitHostPort(c.DebugListen); err != nil {
			bad("debug-listen", "%q is not host:port", c.DebugListen)
		} else if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			bad("debug-listen", "%q must be a loopback address: profiles expose the broker's internals", c.DebugListen)
		}
	}
	c.validateLimits(bad)
	c.validateAuth(bad)
	if c.ShutdownTimeout <= 0 {
		bad("shutdown-timeout", "must be positive")
	}
	for _, l := range []struct {
		flag string
		n    int
	}{{"max-dataplane-connections", c.MaxDPConns}, {"max-dataplane-connections-per-org", c.MaxDPConnsPerOrg},
		{"max-dataplane-connections-per-credential", c.MaxDPConnsPerCredential}, {"max-event-streams-per-key", c.MaxEventStreamsPerKey}, {"max-connections-per-source", c.MaxConnsPerSource}} {
		if l.n < 1 {
			bad(l.flag, "must be at least 1 (it is %d)", l.n)
		}
	}
	if c.Templates != "" {
		if _, err := os.Stat(c.Templates); err != nil {
			bad("templates", "cannot read %s: %v", c.Templates, errors.Unwrap(err))
		}
	}
	return errors.Join(errs...)
}

// advertiseWarning is what to tell the operator when the advertised URL is a guess that remote
// agents cannot use: --listen on every interface (0.0.0.0:7070, [::]:7070 or :7070) and no
// --advertise-url make dataplane_url point at 127.0.0.1, which is each agent server's own host.
// Local use works, so it is a warning, not an error.
func (c *config) advertiseWarning() string {
	if c.AdvertiseURL != "" {
		return ""
	}
	host, _, err := net.SplitHostPort(c.Listen)
	if err != nil || (host != "" && host != "0.0.0.0" && host != "::") {
		return ""
	}
	return fmt.Sprintf("--listen %s serves every interface but --advertise-url (SBX_ADVERTISE_URL) is not set: "+
		"run-config blocks and dataplane_url point at %s, which only this host can reach; "+
		"set --advertise-url to the URL agent servers use, e.g. http://broker.internal:7070", c.Listen, c.advertise())
}

// advertise is the base URL of this broker as others reach it.
func (c *config) advertise() string {
	if c.AdvertiseURL != "" {
		if u, err := protocol.BrokerBaseURL(c.AdvertiseURL); err == nil {
			return u // validate refused anything else
		}
		return c.AdvertiseURL
	}
	host, port, _ := net.SplitHostPort(c.Listen)
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	err := l.UnmarshalText([]byte(s))
	if err != nil {
		return l, fmt.Errorf("%q is not debug, info, warn or error", s)
	}
	return l, nil
}

func newLogger(c *config) *slog.Logger {
	level, _ := parseLevel(c.LogLevel)
	opts := &slog.HandlerOptions{Level: level}
	if c.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

// defaultSandboxUIDs is 64 Ki uids above the usual /etc/subuid allocations' start, as many as one
// user namespace's subordinate range.
const defaultSandboxUIDs = "100000-165535"

// parseUIDRange reads --sandbox-uids: "FIRST-LAST", or "shared" for none. The range must hold no
// root, no nobody (65534) and no uid a host user or group has in /etc/passwd or /etc/group: a
// sandbox must never be someone.
func parseUIDRange(v string) (store.UIDRange, error) {
	if v == "shared" {
		return store.UIDRange{}, nil
	}
	lo, hi, ok := strings.Cut(v, "-")
	first, err1 := strconv.Atoi(strings.TrimSpace(lo))
	last, err2 := strconv.Atoi(strings.TrimSpace(hi))
	switch {
	case !ok || err1 != nil || err2 != nil:
		return store.UIDRange{}, fmt.Errorf("%q is not FIRST-LAST, e.g. %s (or shared)", v, defaultSandboxUIDs)
	case first < 1000 || last < first || last >= 1<<31:
		return store.UIDRange{}, fmt.Errorf("%q must run from at least 1000 up to below 2^31, first to last", v)
	case first <= 65534 && 65534 <= last:
		return store.UIDRange{}, fmt.Errorf("%q holds 65534, the host's nobody: choose a range above it, e.g. %s", v, defaultSandboxUIDs)
	}
	for _, f := range []string{"/etc/passwd", "/etc/group"} {
		if name, id := firstIDIn(f, first, last); name != "" {
			return store.UIDRange{}, fmt.Errorf("%q holds %d, which %s gives to %q: a sandbox would act as it; choose a range no user or group of the host has", v, id, f, name)
		}
	}
	return store.UIDRange{First: first, Last: last}, nil
}

// firstIDIn answers the first entry of a passwd or group file whose id (the third field) is in
// first..last, or "" when none is (or the file cannot be read).
func firstIDIn(file string, first, last int) (string, int) {
	b, err := os.ReadFile(file)
	if err != nil {
		return "", 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Split(line, ":")
		if len(f) < 3 {
			continue
		}
		if id, err := strconv.Atoi(f[2]); err == nil && id >= first && id <= last {
			return f[0], id
		}
	}
	return "", 0
}
