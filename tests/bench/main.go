// Command bench measures the broker against its budgets (DESIGN.md §8) on this machine and prints
// each figure beside this run's baselines (bare os/exec, loopback TCP) and the peers' figures
// measured on this machine type (E2B envd and the Daytona daemon, without isolation).
//
//	go run ./tests/bench            # everything (about a minute)
//	go run ./tests/bench -quick     # fewer samples
//
// It builds and starts the real broker binary on its embedded defaults (a managed redis-server, the
// namespace provider when bubblewrap works) in a temp data dir, talks to it over loopback like an
// agent server would, and stops everything it started.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	goflag "flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/heartbeat"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

var quick = goflag.Bool("quick", false, "fewer samples, shorter runs")

func flag(name, usage string) *bool { return goflag.Bool(name, false, usage) }

func main() {
	if os.Getenv(tcpEchoEnv) != "" {
		tcpEcho()
		return
	}
	goflag.Parse()
	undoOnInterrupt()
	err := run()
	// An interrupt being undone holds the lock and exits once done; its run's error is no news.
	undo.mu.Lock()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// row is one line of the report.
type row struct{ metric, ours, budget, e2b, daytona, baseline string }

func run() error {
	raiseFileLimit()
	if *poolOnly {
		return printPoolRows(context.Background())
	}
	n := 3000
	if *quick {
		n = 500
	}
	var rows []row
	add := func(r row) { rows = append(rows, r); fmt.Fprintf(os.Stderr, "  %s: %s\n", r.metric, r.ours) }

	fmt.Fprintln(os.Stderr, "baselines...")
	bare := sample(n/3, func() error { return exec.Command("true").Run() })
	tcp, err := tcpRoundTrips(n * 3)
	if err != nil {
		return err
	}
	tcpAcross, err := tcpRoundTripsAcross(n * 3)
	if err != nil {
		return err
	}

	fmt.Fprintln(os.Stderr, "starting the broker (embedded defaults)...")
	br, err := startBroker()
	if err != nil {
		return err
	}
	defer br.stop()
	ctx := context.Background()
	c, err := client.New(br.url, br.key)
	if err != nil {
		return err
	}
	created := sample(min(n/30, 50), func() error {
		name := fmt.Sprintf("ready-%d", time.Now().UnixNano())
		_, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name})
		if err == nil {
			defer c.DeleteSandbox(ctx, name)
		}
		return err
	})
	sb, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "bench"})
	if err != nil {
		return err
	}
	m, err := c.Delegate(ctx, "bench", protocol.MintRequest{Scopes: protocol.Scopes})
	if err != nil {
		return err
	}
	r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		return err
	}
	defer r.Close()

	if *gvisorOnly {
		return gvisorRows(ctx, c, br)
	}
	if *pushOnly {
		return pushReport(ctx, c, br)
	}
	if *treeOnly {
		fmt.Fprintln(os.Stderr, "tree copy...")
		rows, err := treeRows(ctx, r, workspaceDir(br.dir, sb.Sandbox.ID), br.peakRSS)
		if err != nil {
			return err
		}
		for _, r := range rows {
			fmt.Printf("%s: %s (budget %s; %s)\n", r.metric, r.ours, r.budget, r.baseline)
		}
		return nil
	}

	if *mcpOnly {
		return mcpOnlyRun(ctx, m, n, br)
	}
	if *bulkOnly {
		return bulkReport(ctx, r, m.Sandbox, br, workspaceDir(br.dir, sb.Sandbox.ID))
	}
	if *clientsOnly {
		return clientsRows(ctx, m.Sandbox)
	}
	if err := hotpath(ctx, r, br, m.Sandbox, tcp, tcpAcross, bare, n); *hotpathOnly || err != nil {
		return err
	}

	fmt.Fprintln(os.Stderr, "dataplane...")
	for i := 0; i < 200; i++ { // warm up
		r.Ping(ctx)
	}
	ping := sample(n*3, func() error { return r.Ping(ctx) })
	execTrue := sample(n, func() error {
		res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Argv: []string{"true"}}})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("true exited %d", res.ExitCode)
		}
		return err
	})
	content := strings.Repeat("x", 4096)
	rw := sample(n, func() error {
		if _, err := r.Write(ctx, protocol.WriteArgs{Path: "bench.txt", Content: content}); err != nil {
			return err
		}
		got, err := r.Read(ctx, protocol.ReadArgs{Path: "bench.txt"})
		if err == nil && len(got.Content) != 4096 {
			err = fmt.Errorf("read %d bytes", len(got.Content))
		}
		return err
	})
	add(row{"dataplane ping", ping.ms(), "p50 < 0.040 ms", "0.049", "0.088", "TCP round trip to another process " + tcpAcross.ms() + "; within one process " + tcp.ms()})
	add(row{"exec `true` (" + sb.Sandbox.Provider + " sandbox)", execTrue.ms(), "p50 < 1.0 ms", "2.12", "2.20", "os/exec " + bare.ms() + "; bwrap per command ~3.9"})
	add(row{"4 KiB write+read", rw.ms(), "p50 < 0.2 ms", "0.30", "0.38", ""})

	mcpRows(ctx, m, n, br, add)

	const size = 100 << 20
	data := make([]byte, size)
	rand.Read(data)
	rssBefore := br.peakRSS()
	up := time.Now()
	if _, err := r.Upload(ctx, "big.bin", bytes.NewReader(data)); err != nil {
		return err
	}
	upRate := float64(size) / (1 << 20) / time.Since(up).Seconds()
	down := time.Now()
	if got, err := r.Download(ctx, "big.bin", io.Discard); err != nil || got != size {
		return fmt.Errorf("download: %d bytes, %v", got, err)
	}
	downRate := float64(size) / (1 << 20) / time.Since(down).Seconds()
	rssAfter := br.peakRSS()
	toFile, fromFile := tcpFileBaselines(br.dir, size)
	add(row{"100 MiB upload", fmt.Sprintf("%.0f MiB/s", upRate), "> 2000 MiB/s", "1669", "476",
		fmt.Sprintf("raw TCP into a new file on this disk %.0f MiB/s; broker peak RSS %d -> %d MiB", toFile, rssBefore>>20, rssAfter>>20)})
	add(row{"100 MiB download", fmt.Sprintf("%.0f MiB/s", downRate), "> 2500 MiB/s", "2467", "3155",
		fmt.Sprintf("raw file out over TCP %.0f MiB/s", fromFile)})

	fmt.Fprintln(os.Stderr, "tree copy...")
	if tr, err := treeRows(ctx, r, workspaceDir(br.dir, sb.Sandbox.ID), br.peakRSS); err != nil {
		fmt.Fprintln(os.Stderr, "  tree copy:", err)
	} else {
		for _, r := range tr {
			add(r)
		}
	}

	fmt.Fprintln(os.Stderr, "1000 concurrent connections...")
	conns, errs, took := concurrentConnections(ctx, m.Sandbox, 1000)
	add(row{"concurrent connections", fmt.Sprintf("%d, %d errors, %.2f s", conns, errs, took.Seconds()), "1000, 0 errors", "", "", "each: ping, write, read, stat, ls"})

	fmt.Fprintln(os.Stderr, "heartbeats...")
	hbDur := 5 * time.Second
	if *quick {
		hbDur = 2 * time.Second
	}
	cpu0 := br.cpuTime()
	rate, hbErrs, generator := heartbeats(br.url, br.key, sb.Sandbox.ID, hbDur)
	perBeat := (br.cpuTime() - cpu0) / time.Duration(max(rate*hbDur.Seconds(), 1))
	add(row{"heartbeats through the HTTP API", fmt.Sprintf("%.0f/s (%d errors)", rate, hbErrs), "> 20,000/s", "", "",
		fmt.Sprintf("%s, real redis-server; broker CPU %.0f us/beat", generator, float64(perBeat.Microseconds()))})
	if rate, err := batchedHeartbeats(ctx, c, br, hbDur, 50); err != nil {
		fmt.Fprintln(os.Stderr, "  batched heartbeats:", err)
	} else {
		add(row{"heartbeats, 50 per request (POST /v1/heartbeats)", fmt.Sprintf("%.0f/s", rate), "> 20,000/s", "", "", "same load generator"})
	}
	add(row{"create to ready (REST)", created.ms(), "p50 < 20 ms", "", "", ""})

	fmt.Fprintln(os.Stderr, "sweep...")
	sweepTook, stopped, tracked, err := sweep(1000, 100000)
	if err != nil {
		return err
	}
	add(row{"sweep of expired leases", fmt.Sprintf("%.3f s for %d expired among %d", sweepTook.Seconds(), stopped, tracked), "< 1 s for 1,000 of 100,000", "", "", ""})

	addPoolRows(ctx, add)

	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "METRIC\tSBX BROKER (p50 / p90)\tBUDGET\tE2B ENVD\tDAYTONA\tBASELINE THIS RUN")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.metric, r.ours, r.budget, r.e2b, r.daytona, r.baseline)
	}
	tw.Flush()
	fmt.Println("\nPeers: measured on this machine type without isolation (issue #5); times in ms unless marked.")
	return nil
}

// samples are latencies of repeated calls.
type samples struct {
	d    []time.Duration
	errs int
}

func sample(n int, fn func() error) samples {
	s := samples{d: make([]time.Duration, 0, n)}
	for i := 0; i < n; i++ {
		t := time.Now()
		if err := fn(); err != nil {
			s.errs++
			if s.errs == 1 {
				fmt.Fprintln(os.Stderr, "  error:", err)
			}
			continue
		}
		s.d = append(s.d, time.Since(t))
	}
	s.sort()
	return s
}

func (s *samples) sort() { sort.Slice(s.d, func(i, j int) bool { return s.d[i] < s.d[j] }) }

// add appends o's latencies and errors (sort again before reading percentiles).
func (s *samples) add(o samples) {
	s.d = append(s.d, o.d...)
	s.errs += o.errs
}

func (s samples) pct(p float64) time.Duration {
	if len(s.d) == 0 {
		return 0
	}
	return s.d[int(float64(len(s.d)-1)*p)]
}

func (s samples) ms() string {
	out := fmt.Sprintf("%.3f / %.3f ms", s.pct(.5).Seconds()*1000, s.pct(.9).Seconds()*1000)
	if s.errs > 0 {
		out += fmt.Sprintf(" (%d errors)", s.errs)
	}
	return out
}

// brokerProc is the broker under test.
type brokerProc struct {
	cmd      *exec.Cmd
	url, key string
	dir      string
	// forget drops the interrupt's copy of end, removeDir the directory and its copy (interrupt.go).
	forget, removeDir func()
	once              sync.Once
}

func startBroker(extra ...string) (*brokerProc, error) {
	root, err := moduleRoot()
	if err != nil {
		return nil, err
	}
	dir, removeDir, err := tempDir("sbx-bench-")
	if err != nil {
		return nil, err
	}
	os.Chmod(dir, 0o711) // the sandbox uid must reach the data dir
	for _, name := range []string{"broker", "sbx-init"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), "./cmd/"+name)
		cmd.Dir, cmd.Stderr = root, os.Stderr
		if name == "sbx-init" {
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0") // as scripts/broker.sh builds it: static
		}
		if err := runGuarded(cmd); err != nil {
			removeDir()
			return nil, fmt.Errorf("build %s: %w", name, err)
		}
	}
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := l.Addr().String()
	l.Close()
	b := &brokerProc{url: "http://" + addr, dir: dir, removeDir: removeDir}
	b.cmd = exec.Command(filepath.Join(dir, "broker"), "--listen", addr, "--data-dir", filepath.Join(dir, "data"), "--log-level", "warn",
		// The bench measures the broker's capacity, not one org's or one credential's fair share of it.
		"--org-max-running", "0", "--org-max-sandboxes", "0", "--org-rps", "0",
		"--max-dataplane-connections-per-org", "4096", "--max-dataplane-connections-per-credential", "4096")
	b.cmd.Args = append(b.cmd.Args, extra...)
	b.cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=")
	logf, _ := os.Create(filepath.Join(dir, "broker.log"))
	b.cmd.Stdout, b.cmd.Stderr = logf, logf
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if b.forget, err = guard(b.cmd.Start, b.end); err != nil {
		removeDir()
		return nil, err
	}
	for i := 0; ; i++ {
		resp, err := http.Get(b.url + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if i == 600 {
			b.stop()
			return nil, fmt.Errorf("broker not ready; see %s", filepath.Join(dir, "broker.log"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	cfg, err := client.LoadConfig(filepath.Join(dir, ".config", "sbctl", "config.yaml"))
	if err != nil || cfg.APIKey == "" {
		b.stop()
		return nil, fmt.Errorf("no bootstrap key: %v", err)
	}
	b.key = cfg.APIKey
	return b, nil
}

// stop ends the broker and removes its directory.
func (b *brokerProc) stop() {
	b.forget()
	b.end()
	b.removeDir()
}

// end stops the broker (SIGTERM, its process group SIGKILLed 30 s later) and unmounts what its
// sandboxes left mounted under its directory. The run and an interrupt may both call it: one ends
// the broker, the other waits for that.
func (b *brokerProc) end() {
	b.once.Do(func() {
		b.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { b.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
		provider.UnmountUnder(b.dir)
	})
}

// cpuTime is the CPU time the broker process has used (user + system).
func (b *brokerProc) cpuTime() time.Duration {
	raw, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", b.cmd.Process.Pid))
	fields := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	var user, sys int64
	fmt.Sscan(fields[11], &user)
	fmt.Sscan(fields[12], &sys)
	return time.Duration(user+sys) * (time.Second / 100) // clock ticks (USER_HZ = 100)
}

// peakRSS is the broker's resident-set high-water mark.
func (b *brokerProc) peakRSS() int64 {
	raw, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", b.cmd.Process.Pid))
	for _, l := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			var kb int64
			fmt.Sscanf(strings.TrimSpace(v), "%d", &kb)
			return kb << 10
		}
	}
	return 0
}

func moduleRoot() (string, error) {
	dir, _ := os.Getwd()
	for ; dir != "/"; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
	}
	return "", fmt.Errorf("run bench inside the repository")
}

// concurrentConnections opens n dataplane connections at once, each doing a round of operations.
func concurrentConnections(ctx context.Context, blk protocol.SandboxBlock, n int) (int, int64, time.Duration) {
	var errs atomic.Int64
	var opened atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	remotes := make([]*backend.Remote, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := backend.Dial(ctx, backend.Config{URL: blk.DataplaneURL, Credential: blk.Credential, Reconnects: 3})
			if err != nil {
				if errs.Add(1) == 1 {
					fmt.Fprintln(os.Stderr, "  dial error:", err)
				}
				return
			}
			opened.Add(1)
			remotes[i] = r
			p := fmt.Sprintf("conn/%d.txt", i)
			steps := []func() error{
				func() error { return r.Ping(ctx) },
				func() error { _, err := r.Write(ctx, protocol.WriteArgs{Path: p, Content: "hello"}); return err },
				func() error { _, err := r.Read(ctx, protocol.ReadArgs{Path: p}); return err },
				func() error { _, err := r.Stat(ctx, p); return err },
				func() error { _, err := r.Ls(ctx, "conn"); return err },
			}
			for _, step := range steps {
				if err := step(); err != nil {
					if errs.Add(1) == 1 {
						fmt.Fprintln(os.Stderr, "  op error:", err)
					}
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	for _, r := range remotes {
		if r != nil {
			r.Close()
		}
	}
	return int(opened.Load()), errs.Load(), took
}

// heartbeats drives POST .../heartbeat for d and returns the rate, the errors and what generated
// the load. With wrk installed (apt-get install wrk) the load comes from it: a C client leaves more
// of the machine's two cores to the broker and Redis than a Go one. Otherwise 64 Go clients.
func heartbeats(base, key, id string, d time.Duration) (float64, int64, string) {
	if _, err := exec.LookPath("wrk"); err == nil {
		if rate, errs, err := wrkHeartbeats(base, key, id, d); err == nil {
			return rate, errs, "wrk, 2 threads x 32 connections"
		} else {
			fmt.Fprintln(os.Stderr, "  wrk failed, using the Go client:", err)
		}
	}
	rate, errs := goHeartbeats(base, key, id, d)
	return rate, errs, "64 Go clients (install wrk for a lighter load generator)"
}

// batchedHeartbeats creates n sandboxes and renews all their leases per request for d: the way a
// client keeping many sandboxes alive beats them. It returns heartbeats (not requests) per second.
func batchedHeartbeats(ctx context.Context, c *client.Client, br *brokerProc, d time.Duration, n int) (float64, error) {
	var refs []string
	for i := 0; i < n; i++ {
		res, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: fmt.Sprintf("beat-%d", i)})
		if err != nil {
			return 0, err
		}
		refs = append(refs, res.Sandbox.ID)
	}
	defer func() {
		for _, r := range refs {
			c.DeleteSandbox(ctx, r)
		}
	}()
	body, _ := json.Marshal(protocol.HeartbeatsRequest{Refs: refs})
	if _, err := exec.LookPath("wrk"); err == nil {
		rate, _, err := wrkPost(br.url+"/v1/heartbeats", br.key, string(body), d)
		return rate * float64(n), err
	}
	var ok atomic.Int64
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				if _, err := c.Heartbeats(ctx, refs); err == nil {
					ok.Add(int64(n))
				}
			}
		}()
	}
	wg.Wait()
	return float64(ok.Load()) / d.Seconds(), nil
}

// wrkHeartbeats runs wrk with a script that POSTs with the key; the key goes through the
// environment, never onto the command line.
func wrkHeartbeats(base, key, id string, d time.Duration) (float64, int64, error) {
	return wrkPost(base+"/v1/sandboxes/"+id+"/heartbeat", key, "", d)
}

// wrkPost drives POSTs of body to url with wrk for d and returns successful requests per second.
func wrkPost(url, key, body string, d time.Duration) (float64, int64, error) {
	dir, removeDir, err := tempDir("sbx-wrk-")
	if err != nil {
		return 0, 0, err
	}
	defer removeDir()
	script := filepath.Join(dir, "hb.lua")
	lua := `wrk.method = "POST"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("SBX_BENCH_KEY")
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("SBX_BENCH_BODY")
done = function(summary, latency, requests)
  io.write(string.format("RESULT %d %d %d\n", summary.requests, summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout, summary.duration))
end
`
	if err := os.WriteFile(script, []byte(lua), 0o600); err != nil {
		return 0, 0, err
	}
	cmd := exec.Command("wrk", "-t2", "-c32", "-d", fmt.Sprintf("%ds", int(d.Seconds())), "-s", script, url)
	cmd.Env = append(os.Environ(), "SBX_BENCH_KEY="+key, "SBX_BENCH_BODY="+body)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, 0, fmt.Errorf("%v: %s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		var reqs, errs, us int64
		if n, _ := fmt.Sscanf(l, "RESULT %d %d %d", &reqs, &errs, &us); n == 3 && us > 0 {
			return float64(reqs-errs) / (float64(us) / 1e6), errs, nil
		}
	}
	return 0, 0, fmt.Errorf("no result in wrk output: %s", out)
}

// goHeartbeats drives the heartbeats from 64 keep-alive Go clients.
func goHeartbeats(base, key, id string, d time.Duration) (float64, int64) {
	tr := &http.Transport{MaxIdleConnsPerHost: 128, MaxConnsPerHost: 128}
	hc := &http.Client{Transport: tr}
	defer tr.CloseIdleConnections()
	url := base + "/v1/sandboxes/" + id + "/heartbeat"
	var ok, bad atomic.Int64
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				req, _ := http.NewRequest(http.MethodPost, url, nil)
				req.Header.Set("Authorization", "Bearer "+key)
				resp, err := hc.Do(req)
				if err != nil {
					bad.Add(1)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == 200 {
					ok.Add(1)
				} else {
					bad.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	return float64(ok.Load()) / time.Since(start).Seconds(), bad.Load()
}

// sweep times one sweep that stops `expired` sandboxes among `total` tracked ones, in-process on a
// redis-server of its own (records only: the sandboxes have no processes to stop).
func sweep(expired, total int) (time.Duration, int, int, error) {
	dir, removeDir, err := tempDir("sbx-sweep-")
	if err != nil {
		return 0, 0, 0, err
	}
	defer removeDir()
	os.Chmod(dir, 0o711) // the sandbox uid must reach the data dir
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()
	emb, err := store.StartEmbedded(ctx, dir, log)
	if err != nil {
		return 0, 0, 0, err
	}
	defer emb.Stop()
	rdb := redis.NewUniversalClient(emb.Options())
	defer rdb.Close()
	// The lease clock is moved by hand, as the tests do: one sweep warns, the timed one stops.
	now := time.Now()
	var at atomic.Int64
	at.Store(now.UnixNano())
	clock := func() time.Time { return time.Unix(0, at.Load()) }
	st := store.NewWithOptions(rdb, store.Options{Clock: clock})
	if _, _, err := st.CreateAPIKey(ctx, "sweep", "bench", time.Now()); err != nil {
		return 0, 0, 0, err
	}
	prov, err := provider.NewDir(provider.Config{DataDir: dir})
	if err != nil {
		return 0, 0, 0, err
	}
	evw := events.NewWriter(st, log)
	defer evw.Close()
	mgr, err := sandbox.NewManager(sandbox.Config{Store: st, Provider: prov, Templates: map[string]provider.Template{"default": provider.DefaultTemplate()},
		Node: "bench", Events: evw.Emit, Log: log, Now: func() time.Time { return now }, DefaultTTL: time.Hour, MaxTTL: 24 * time.Hour,
		IndexDir: filepath.Join(dir, "hosted")})
	if err != nil {
		return 0, 0, 0, err
	}
	// Records straight into the store, as many brokers' worth of running sandboxes.
	for i := 0; i < total; i++ {
		ttl := time.Hour
		if i%(total/expired) == 0 {
			ttl = time.Second
		}
		rec := store.Record{ID: "sb_" + uuidish(i), Org: "sweep", Name: fmt.Sprintf("s%d", i), Template: "default", Provider: "dir",
			Node: "bench", Status: protocol.StatusProvisioning, TTL: ttl, CreatedAt: now, Heartbeat: now}
		if _, _, err := st.CreateOrReuse(ctx, rec, true); err != nil {
			return 0, 0, 0, err
		}
		if _, err := st.Transition(ctx, "sweep", rec.ID, store.Transition{From: []string{"provisioning"}, To: "running"}); err != nil {
			return 0, 0, 0, err
		}
	}
	at.Add(int64(time.Minute))
	sw := heartbeat.NewSweeper(heartbeat.Config{Store: st, Sandboxes: mgr, Events: evw.Emit, Log: log, Now: clock})
	if _, err := sw.SweepOnce(ctx); err != nil { // warns the expired ones; a stop waits out the warning window
		return 0, 0, 0, err
	}
	at.Add(int64(time.Minute))
	start := time.Now()
	rep, err := sw.SweepOnce(ctx)
	return time.Since(start), rep.Stopped, total, err
}

func uuidish(i int) string {
	return fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i)
}

// raiseFileLimit lifts the soft fd limit to the hard one: a thousand connections need it.
func raiseFileLimit() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) == nil {
		l.Cur = l.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l)
	}
}
