package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/store"
)

// serve runs the broker until SIGINT or SIGTERM, then shuts down gracefully: it stops accepting,
// lets requests in flight finish, stops sandbox processes (records stay "running": the next start
// brings them back), flushes events and stops the embedded Redis.
func serve(parent context.Context, c *config) error {
	log := newLogger(c)
	if w := c.advertiseWarning(); w != "" {
		log.Warn(w)
	}
	ctx, stop := signal.NotifyContext(parent, os.Interrupt, syscall.SIGTERM)
	defer stop()

	if err := checkSigningDir(c.signingDir()); err != nil {
		return err
	}
	st, err := openStorage(ctx, c, log, true)
	if err != nil {
		return err
	}
	defer st.close()
	node, err := nodeName(c)
	if err != nil {
		return err
	}
	templates := map[string]provider.Template{"default": provider.DefaultTemplate()}
	if c.Templates != "" {
		if templates, err = provider.LoadTemplates(c.Templates); err != nil {
			return fmt.Errorf("--templates (SBX_TEMPLATES): %w", err)
		}
	}
	metricsToken, err := readMetricsToken(c.MetricsTokenFile)
	if err != nil {
		return err
	}
	var prov provider.Provider
	var report provider.Report
	if c.Provider == "kubernetes" {
		prov, report, err = kubeProvider(ctx, c, node, log)
	} else {
		prov, report, err = chooseProvider(ctx, c, log)
	}
	if err != nil {
		return err
	}
	if closer, ok := prov.(interface{ Close() }); ok {
		defer closer.Close() // after the broker's shutdown: what the provider keeps for no sandbox
	}
	if prov.Name() == provider.ChoiceDir {
		shout(c, log, notIsolated(c, report))
	}
	uid := -1 // files the broker creates belong to the sandbox user when sandboxes run as one
	var uids store.UIDRange
	if os.Geteuid() == 0 {
		uid, uids = c.SandboxUID, c.uids
		if uids.Size() == 0 {
			log.Warn("--sandbox-uids shared: every sandbox runs as one host uid and shares its keyrings, inotify and process limits with the others; give them a range (the default is " + defaultSandboxUIDs + ")")
		}
	}
	b, err := server.NewBroker(ctx, server.BrokerConfig{
		Store: st.store, Provider: prov, Templates: templates, ProviderReport: report,
		Node: node, AdvertiseURL: c.advertise(), DataDir: c.DataDir, SigningKeys: c.signingDir(), WorkspaceUID: uid, SandboxUIDs: uids,
		Log: log, DefaultTTL: c.DefaultTTL, MaxTTL: c.MaxTTL, TokenTTL: c.TokenTTL, TokenMaxTTL: c.TokenMaxTTL,
		SweepInterval: c.SweepInterval, NodeHeartbeat: c.NodeHeartbeat, NodeLostAfter: c.NodeLostAfter, ExpiryWarning: c.ExpiryWarning, Retention: c.Retention, EventBuffer: c.EventBuffer,
		AllowedOrigins: c.AllowedOrigins, DataplaneRenewsLease: c.DataplaneRenews, Limits: c.orgDefaults(),
		AuthFailures: c.AuthFailures, AuthFailureWindow: c.AuthFailureWindow, MetricsTokenHash: metricsToken,
		Dataplane:          server.DataplaneLimits{MaxConnections: c.MaxDPConns, PerOrg: c.MaxDPConnsPerOrg, PerCredential: c.MaxDPConnsPerCredential},
		EventStreamsPerKey: c.MaxEventStreamsPerKey, ConnsPerSource: c.MaxConnsPerSource,
	})
	if err != nil {
		return err
	}
	if err := recordTokenMaxTTL(c.signingDir(), c.TokenMaxTTL); err != nil {
		log.Warn("cannot record --token-max-ttl in the signing-keys directory; `broker keys rotate-signing` will then need --token-max-ttl",
			"dir", c.signingDir(), "err", err)
	}
	if c.DebugListen != "" {
		go serveDebug(c.DebugListen, log)
	}
	l, err := net.Listen("tcp", c.Listen)
	if errors.Is(err, syscall.EADDRINUSE) {
		b.Shutdown(context.Background())
		return fmt.Errorf("--listen (SBX_LISTEN): another process listens on %s (a broker already running?): stop it, or give this one another address, e.g. --listen 127.0.0.1:7071", c.Listen)
	}
	if err != nil {
		b.Shutdown(context.Background())
		return fmt.Errorf("--listen (SBX_LISTEN): %w", err)
	}
	if st.embedded != nil {
		// Only now that the address is ours: a broker that cannot serve (port taken) must neither
		// create a key nobody will get, nor point sbctl away from the broker that does serve there.
		if err := bootstrap(ctx, c, st, log); err != nil {
			l.Close()
			b.Shutdown(context.Background())
			return err
		}
	}
	log.Info("broker ready", "listen", l.Addr().String(), "advertise", c.advertise(), "node", node,
		"provider", prov.Name(), "redis", st.where, "data_dir", c.DataDir)
	served := make(chan error, 1)
	go func() { served <- b.Serve(l) }()
	var redisExited <-chan struct{} // nil (never ready) unless the embedded Redis is ours
	if st.embedded != nil {
		redisExited = st.embedded.Exited()
	}
	select {
	case err := <-served:
		b.Shutdown(context.Background())
		return err
	case <-redisExited:
		b.Shutdown(context.Background())
		return fmt.Errorf("the embedded redis-server exited; see %s", filepath.Join(st.embedded.Dir, "redis.log"))
	case <-ctx.Done():
	}
	log.Info("shutting down", "timeout", c.ShutdownTimeout)
	sctx, cancel := context.WithTimeout(context.Background(), c.ShutdownTimeout)
	defer cancel()
	if err := b.Shutdown(sctx); err != nil {
		log.Warn("shutdown", "err", err)
	}
	return nil
}

// chooseProvider runs preflight. The data dir remembers the provider it was set up with, so that a
// broker never changes isolation under existing sandboxes by itself: "auto" keeps the remembered
// choice (and fails, saying what is wrong, if it stopped working); --provider-reset chooses again.
// A data dir set up for namespace sandboxes never lands on dir by any of that: only an explicit
// --provider dir confirmed with --allow-unisolated moves it there.
func chooseProvider(ctx context.Context, c *config, log *slog.Logger) (provider.Provider, provider.Report, error) {
	memo := filepath.Join(c.DataDir, "provider")
	recorded, fellBack := readMemo(memo)
	// A data dir from before the memo existed holds sandboxes of an unknown provider: they may be
	// namespace sandboxes, so they are treated as such.
	isolated := recorded == provider.ChoiceNamespace || (recorded == "" && hostsSandboxes(c.DataDir))
	choice := c.Provider
	switch {
	case choice == provider.ChoiceAuto && recorded != "" && !c.ProviderReset:
		choice = recorded
	case choice == provider.ChoiceAuto && isolated:
		choice = provider.ChoiceNamespace // never "auto": its fallback is dir
	}
	if choice == provider.ChoiceDir && isolated && !c.AllowUnisolated {
		return nil, provider.Report{}, fmt.Errorf("--provider dir (SBX_PROVIDER): the data dir %s was set up for namespace sandboxes, and the dir provider would run them with no isolation, as a user of this host; "+
			"to do that knowingly, confirm with --allow-unisolated (SBX_ALLOW_UNISOLATED=true)", c.DataDir)
	}
	cfg := provider.Config{DataDir: c.DataDir, UID: c.SandboxUID, GID: c.SandboxUID, InitPath: initPath(log), DiskReserve: c.diskReserve(), RunscPath: c.Runsc}
	prov, report, err := provider.Preflight(ctx, cfg, choice)
	if err != nil {
		switch {
		case errors.Is(err, provider.ErrResource):
			// Not a setting to change: the host ran out of something, and the error says what.
			return nil, report, fmt.Errorf("cannot start sandboxes: %w", err)
		case choice != c.Provider && isolated:
			return nil, report, fmt.Errorf("the data dir %s holds namespace sandboxes, and the namespace provider does not work here now: %w\n"+
				"fix that and start again (the broker never moves these sandboxes to a provider without isolation by itself)", c.DataDir, err)
		case choice != c.Provider:
			return nil, report, fmt.Errorf("the data dir %s was set up with the %s provider, which does not work here now: %w", c.DataDir, choice, err)
		}
		return nil, report, fmt.Errorf("--provider (SBX_PROVIDER): %w", err)
	}
	if report.Warning != "" {
		log.Warn(report.Warning, "provider", prov.Name())
	}
	if prov.Name() == provider.ChoiceDir && choice == recorded && report.Fallback == "" {
		// Still on the dir provider that an earlier start fell back to: say so on every start.
		report.Fallback = fellBack
	}
	if recorded == provider.ChoiceDir && choice == recorded && c.Provider == provider.ChoiceAuto {
		log.Warn("this data dir was set up with the dir provider and keeps it; once the namespace provider works here, start with --provider-reset to switch", "data_dir", c.DataDir)
	}
	log.Info("sandbox provider ready", "provider", prov.Name(), "isolation", sandbox.Isolation(prov.Name()), "limits_enforced", report.LimitsEnforced,
		"cgroups", report.Cgroups, "preflight_ms", report.Took.Milliseconds())
	// Which isolation levels templates may ask for here; one asking for another is refused at create.
	offered, missing := sandbox.IsolationLevels(prov)
	for level, why := range missing {
		log.Info("isolation level unavailable: templates asking for it are refused", "level", level, "missing", why)
	}
	log.Info("isolation levels offered", "levels", strings.Join(offered, ","))
	content := prov.Name() + "\n"
	if report.Fallback != "" {
		content += fallbackNote + strings.ReplaceAll(report.Fallback, "\n", " ") + "\n"
	}
	if err := os.WriteFile(memo, []byte(content), 0o600); err != nil {
		return nil, report, fmt.Errorf("--data-dir: %w", err)
	}
	return prov, report, nil
}

// fallbackNote starts the memo's second line when "auto" chose dir because the host could not run
// namespace sandboxes, so that every later start (its banner, /readyz, /metrics) still says why.
const fallbackNote = "# fell back: "

// readMemo reads the provider a data dir was set up with ("" if none) and, when that was a
// fallback, why.
func readMemo(path string) (recorded, fellBack string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", ""
	}
	first, rest, _ := strings.Cut(string(b), "\n")
	for _, l := range strings.Split(rest, "\n") {
		if why, ok := strings.CutPrefix(l, fallbackNote); ok {
			fellBack = strings.TrimSpace(why)
		}
	}
	return strings.TrimSpace(first), fellBack
}

// hostsSandboxes reports whether the data dir holds any sandbox.
func hostsSandboxes(dataDir string) bool {
	for _, sub := range []string{"sandboxes", "hosted"} {
		entries, _ := os.ReadDir(filepath.Join(dataDir, sub))
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), "sb_") {
				return true
			}
		}
	}
	return false
}

// bootstrap gives a fresh embedded broker an org and a key, and points sbctl at it. It runs once
// the broker holds its listen address.
func bootstrap(ctx context.Context, c *config, st *storage, log *slog.Logger) error {
	orgs, err := st.store.Orgs(ctx)
	if err != nil || len(orgs) > 0 {
		return err
	}
	key, k, err := st.store.CreateAPIKey(ctx, "default", "bootstrap", time.Now())
	if err != nil {
		return err
	}
	cfgPath := client.ConfigPath()
	existing, _ := client.LoadConfig(cfgPath)
	if existing.Broker != "" && existing.Broker != c.advertise() {
		// Never clobber a config that points at another broker. One that points at this address
		// holds no working key: this broker serves the address now, and it had no key until now.
		cfgPath = filepath.Join(c.DataDir, "sbctl-config.yaml")
	}
	if err := client.WriteConfig(cfgPath, client.Config{Broker: c.advertise(), APIKey: key}); err != nil {
		return fmt.Errorf("write sbctl config %s: %w", cfgPath, err)
	}
	msg := "first start: created org \"default\" with an API key; sbctl is configured to use it"
	if cfgPath != client.ConfigPath() {
		msg = "first start: created org \"default\" with an API key; sbctl's usual config points at another broker, so run sbctl with SBCTL_CONFIG=" + cfgPath
	}
	log.Info(msg, "key_id", k.ID, "credentials", cfgPath)
	return nil
}

// notIsolated is the banner a broker running the dir provider starts with: one log line is easy to
// miss, and every sandbox of this broker is open to the host.
func notIsolated(c *config, r provider.Report) []string {
	who := "the broker's user"
	if os.Geteuid() == 0 {
		who = fmt.Sprintf("uid %d", c.SandboxUID)
		if c.uids.Size() > 0 {
			who = fmt.Sprintf("a uid of its own (from %d-%d)", c.uids.First, c.uids.Last)
		}
	}
	var paras []string
	if r.Fallback != "" {
		paras = append(paras, "The namespace provider could not run on this host, so the broker fell back to the dir provider: "+r.Fallback)
	} else {
		paras = append(paras, "This broker runs the dir provider (--provider dir, or a data dir set up with it).")
	}
	paras = append(paras, "Sandboxes are plain directories on this host: their commands run as "+who+
		", see the host's files, processes and network, and have no resource limits. Do not lend them to code you do not trust.")
	if r.Fallback != "" {
		paras = append(paras, "Fix the above, then start the broker with --provider-reset to move to the namespace provider.")
	}
	paras = append(paras, `/readyz ("isolation": "none"), /metrics (sbx_provider_info{isolation="none"}) and every sandbox's "isolation" field say so too.`)
	rule := strings.Repeat("#", 100)
	lines := []string{rule, "#  SANDBOXES ARE NOT ISOLATED", "#"}
	for i, p := range paras {
		if i > 0 {
			lines = append(lines, "#")
		}
		for _, l := range wrap(p, 94) {
			lines = append(lines, "#  "+l)
		}
	}
	return append(lines, rule)
}

// shout writes a banner to stderr as it is in text logs, and as one warning per line in JSON logs
// (which a stray non-JSON line would break).
func shout(c *config, log *slog.Logger, lines []string) {
	if c.LogFormat == "json" {
		for _, l := range lines {
			log.Warn(l)
		}
		return
	}
	fmt.Fprintln(os.Stderr, strings.Join(lines, "\n"))
}

// wrap breaks s into lines of at most width bytes at spaces (a longer word gets a line of its own).
func wrap(s string, width int) []string {
	var lines []string
	line := ""
	for _, w := range strings.Fields(s) {
		if line != "" && len(line)+1+len(w) > width {
			lines = append(lines, line)
			line = ""
		}
		if line != "" {
			line += " "
		}
		line += w
	}
	return append(lines, line)
}

// serveDebug serves Go's profiler on a separate, loopback-only address.
func serveDebug(addr string, log *slog.Logger) {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	log.Info("profiles served", "debug_listen", addr)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		log.Error("debug listener", "err", err)
	}
}

// initPath picks the program each sandbox runs as its resident init: sbx-init next to this binary
// when it is there (it starts in a quarter of the time, and being static it also runs in a template
// rootfs without libc: it links nothing but the init), else this binary itself.
func initPath(log *slog.Logger) string {
	self, err := os.Executable()
	if err != nil {
		return ""
	}
	small := filepath.Join(filepath.Dir(self), "sbx-init")
	if fi, err := os.Stat(small); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
		return small
	}
	log.Info("sbx-init is not installed next to the broker; sandboxes use the broker binary as their init (each start takes ~10 ms longer, and templates with a rootfs need the host's libc in it); build it with CGO_ENABLED=0 go build -o DIR ./cmd/sbx-init", "want", small)
	return self
}

// diskReserve is --disk-reserve for the provider: 0 (the default) when unset, -1 (off) for "0".
func (c *config) diskReserve() provider.ByteSize {
	if c.DiskReserve == "" {
		return 0
	}
	v, _ := provider.ParseByteSize(c.DiskReserve) // validated with the other flags
	if v == 0 {
		return -1
	}
	return v
}

// readMetricsToken reads --metrics-token-file and keeps only the token's SHA-256 (nil without a
// file). The token itself is never kept, logged or echoed.
func readMetricsToken(path string) ([]byte, error) {
	if path == "" {
		return nil, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--metrics-token-file (SBX_METRICS_TOKEN_FILE): %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 4097))
	if err != nil {
		return nil, fmt.Errorf("--metrics-token-file (SBX_METRICS_TOKEN_FILE): %w", err)
	}
	token := strings.TrimSpace(string(b))
	switch {
	case len(b) > 4096:
		return nil, fmt.Errorf("--metrics-token-file %s: longer than 4096 bytes; it holds one token", path)
	case len(token) < 16:
		return nil, fmt.Errorf("--metrics-token-file %s: the token must be at least 16 characters (e.g. openssl rand -hex 32 > %s)", path, path)
	case strings.ContainsFunc(token, func(r rune) bool { return r <= ' ' || r == 0x7f }):
		return nil, fmt.Errorf("--metrics-token-file %s: the token must be one line of printable characters without spaces", path)
	}
	sum := sha256.Sum256([]byte(token))
	return sum[:], nil
}
