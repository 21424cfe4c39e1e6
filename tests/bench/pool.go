package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
)

var poolOnly = flag("pool-only", "only the create-to-ready and idle-memory rows (issue 17's pool targets)")

// poolTemplates is the templates file of the pooled broker: the default template, kept warm.
const poolTemplates = "default:\n  pool: {size: 4}\n"

// poolRows measures create to ready (cold, without isolation, and from a warm pool) and the host
// memory of idle running sandboxes, each beside issue 17's target. Each variant runs its own broker,
// so that one's sandboxes do not weigh on the next.
func poolRows(ctx context.Context) ([]row, error) {
	n := 60
	if *quick {
		n = 20
	}
	var rows []row
	// Cold: the namespace provider (isolated), then the dir provider (no isolation), no pool.
	for _, v := range []struct{ label, provider string }{{"namespace, isolated", "namespace"}, {"dir, no isolation", "dir"}} {
		br, err := startBroker("--provider", v.provider)
		if err != nil {
			return rows, err
		}
		c, err := client.New(br.url, br.key)
		if err != nil {
			br.stop()
			return rows, err
		}
		load := loadAvg()
		before, _ := readCreateCounters(br.url)
		s := createSamples(ctx, c, n, nil)
		after, _ := readCreateCounters(br.url)
		floor, err := restFloor(ctx, c, n)
		br.stop()
		if err != nil {
			return rows, err
		}
		rows = append(rows, row{"create to ready, cold (" + v.label + ")", s.ms99(), "p50 < 20 ms", "", "",
			"no pool; REST get of a sandbox " + floor.ms99() + "; " + createSplit(before, after, s) + "; load " + load})
	}

	// Idle memory: 100 running sandboxes that do nothing, measured after they settle.
	{
		br, err := startBroker()
		if err != nil {
			return rows, err
		}
		c, err := client.New(br.url, br.key)
		if err != nil {
			br.stop()
			return rows, err
		}
		const idle = 100
		for i := 0; i < idle; i++ {
			if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: fmt.Sprintf("idle-%d", i)}); err != nil {
				br.stop()
				return rows, fmt.Errorf("idle sandbox %d: %w", i, err)
			}
		}
		time.Sleep(2 * time.Second) // let the inits reach their idle state (the GC, thread parking)
		m, err := sandboxMemory(br.cmd.Process.Pid)
		if err != nil {
			br.stop()
			return rows, err
		}
		per := func(v int64) string { return fmt.Sprintf("%.2f MB", float64(v)/float64(m.procs/2)/1e6) }
		rows = append(rows, row{fmt.Sprintf("idle sandbox host memory (PSS, %d running)", m.procs/2),
			fmt.Sprintf("%s each, %.1f MB total", per(m.pss), float64(m.pss)/1e6), "< 3 MB each", "", "",
			fmt.Sprintf("USS %s each; init %s + bwrap %s (PSS); memory cgroup charge (processes + kernel) %s each; RSS, which counts shared pages in every process, %s each", per(m.uss), per(m.initPSS), per(m.bwrapPSS), per(m.charged), per(m.rss))})
		br.stop()
	}

	s, floor, err := warmPoolSamples(ctx, poolTemplates, 4, n)
	if err != nil {
		return rows, err
	}
	rows = append(rows, row{"create to ready, warm pool (namespace)", s.ms99(), "p50 < 5 ms", "", "", "pool of 4 per template, refilled between creates; REST get of a sandbox (any REST call's floor) " + floor.ms99()})

	return rows, nil
}

// warmPoolSamples times n creates from the warm pool of a broker started with the templates file
// body templates, whose default template keeps size sandboxes ready. Each create waits until the
// pool is full again, so it measures a claim, not a start that the pool had no time to make. floor
// is the same broker's REST get of a sandbox (any REST call's floor).
func warmPoolSamples(ctx context.Context, templates string, size, n int) (s, floor samples, err error) {
	dir, removeDir, err := tempDir("sbx-bench-tmpl-")
	if err != nil {
		return s, floor, err
	}
	defer removeDir()
	tmpl := filepath.Join(dir, "templates.yaml")
	if err := os.WriteFile(tmpl, []byte(templates), 0o644); err != nil {
		return s, floor, err
	}
	br, err := startBroker("--templates", tmpl)
	if err != nil {
		return s, floor, err
	}
	defer br.stop()
	c, err := client.New(br.url, br.key)
	if err != nil {
		return s, floor, err
	}
	full := func() error { return waitPoolFull(br.url, "default", size) }
	if err := full(); err != nil {
		return s, floor, err
	}
	s = createSamples(ctx, c, n, full)
	floor, err = restFloor(ctx, c, n)
	return s, floor, err
}

// createSamples creates and deletes n sandboxes, timing only each create (the REST call until the
// answer says running); between, when set, runs untimed before each create.
func createSamples(ctx context.Context, c *client.Client, n int, between func() error) samples {
	s := samples{d: make([]time.Duration, 0, n)}
	for i := 0; i < n; i++ {
		err := func() error {
			if between != nil {
				if err := between(); err != nil {
					return err
				}
			}
			name := fmt.Sprintf("ready-%d", i)
			t := time.Now()
			res, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name})
			took := time.Since(t)
			if err != nil {
				return err
			}
			defer c.DeleteSandbox(ctx, name)
			if res.Sandbox.Status != protocol.StatusRunning {
				return fmt.Errorf("created %s is %s", name, res.Sandbox.Status)
			}
			s.d = append(s.d, took)
			return nil
		}()
		if err != nil {
			if s.errs++; s.errs == 1 {
				fmt.Fprintln(os.Stderr, "  error:", err)
			}
		}
	}
	sort.Slice(s.d, func(i, j int) bool { return s.d[i] < s.d[j] })
	return s
}

// restFloor times a REST get of a sandbox: HTTP, authentication and one Redis read, under every
// REST call.
func restFloor(ctx context.Context, c *client.Client, n int) (samples, error) {
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "floor"}); err != nil {
		return samples{}, err
	}
	defer c.DeleteSandbox(ctx, "floor")
	return sample(n*5, func() error { _, err := c.GetSandbox(ctx, "floor"); return err }), nil
}

// createCounters are the broker's counters of its creates (/metrics): the provider's part, and the
// REST handling of POST /v1/sandboxes.
type createCounters struct{ starts, startSeconds, requests, requestSeconds float64 }

func readCreateCounters(base string) (createCounters, error) {
	var cc createCounters
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		return cc, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		v, _ := strconv.ParseFloat(value, 64)
		switch name {
		case "sbx_provider_starts_total":
			cc.starts = v
		case "sbx_provider_start_seconds_total":
			cc.startSeconds = v
		case `sbx_http_request_seconds_count{route="/v1/sandboxes"}`:
			cc.requests = v
		case `sbx_http_request_seconds_sum{route="/v1/sandboxes"}`:
			cc.requestSeconds = v
		}
	}
	return cc, sc.Err()
}

// createSplit says where the creates timed in s went, as means over those same creates (the
// broker's counters give sums, not percentiles): the provider's create and start, the broker's own
// work around it (HTTP handling, Redis, events, the answer), and what is outside the broker's
// handler (the loopback HTTP round trip and the client).
func createSplit(before, after createCounters, s samples) string {
	starts, requests := after.starts-before.starts, after.requests-before.requests
	if starts <= 0 || requests <= 0 || len(s.d) == 0 {
		return "no split (the broker's counters did not move)"
	}
	var sum time.Duration
	for _, d := range s.d {
		sum += d
	}
	client := sum.Seconds() * 1000 / float64(len(s.d))
	provider := (after.startSeconds - before.startSeconds) * 1000 / starts
	handler := (after.requestSeconds - before.requestSeconds) * 1000 / requests
	return fmt.Sprintf("means: %.2f ms = provider's create+start %.2f + broker around it (store, events, answer) %.2f + HTTP and client %.2f",
		client, provider, handler-provider, client-handler)
}

// ms99 is "p50 / p99 ms".
func (s samples) ms99() string {
	out := fmt.Sprintf("%.2f / %.2f ms (p50 / p99)", s.pct(.5).Seconds()*1000, s.pct(.99).Seconds()*1000)
	if s.errs > 0 {
		out += fmt.Sprintf(" (%d errors)", s.errs)
	}
	return out
}

// waitPoolFull polls /metrics until template's pool holds want ready sandboxes.
func waitPoolFull(base, template string, want int) error {
	line := fmt.Sprintf(`sbx_pool_ready{template=%q} %d`, template, want)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get(base + "/metrics")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(b), line) {
				return nil
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("the pool of %s never held %d ready sandboxes (see /metrics sbx_pool_ready)", template, want)
}

// memFigures sums the memory of every sandbox process under the broker: each bwrap (the broker's
// children) and each init (bwrap's child, pid 1 of the sandbox).
type memFigures struct {
	procs                            int
	pss, uss, rss, initPSS, bwrapPSS int64
	// charged is what the sandboxes' memory cgroups are charged: their processes' pages and the
	// kernel memory they hold (page tables, stacks, namespaces, mounts), summed once per sandbox.
	charged int64
}

// sandboxMemory reports PSS and USS from /proc/PID/smaps_rollup. PSS is the figure that adds up:
// a page shared by k processes counts 1/k in each, so the sum over all sandboxes is what they cost
// the host together, shared library and binary pages included once. USS (private pages only) is
// what one more sandbox costs at the margin.
func sandboxMemory(broker int) (memFigures, error) {
	var m memFigures
	for _, bw := range children(broker) {
		if !strings.HasSuffix(readComm(bw), "bwrap") {
			continue
		}
		pss, uss, rss, err := rollup(bw)
		if err != nil {
			continue
		}
		m.procs++
		m.pss, m.uss, m.rss, m.bwrapPSS = m.pss+pss, m.uss+uss, m.rss+rss, m.bwrapPSS+pss
		m.charged += cgroupCharge(bw)
		for _, in := range children(bw) {
			pss, uss, rss, err := rollup(in)
			if err != nil {
				continue
			}
			m.procs++
			m.pss, m.uss, m.rss, m.initPSS = m.pss+pss, m.uss+uss, m.rss+rss, m.initPSS+pss
		}
	}
	if m.procs == 0 {
		return m, fmt.Errorf("no sandbox processes found under broker pid %d", broker)
	}
	return m, nil
}

// cgroupCharge reads memory.usage_in_bytes of pid's memory cgroup (v1; v2's memory.current).
func cgroupCharge(pid int) int64 {
	raw, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	for _, l := range strings.Split(string(raw), "\n") {
		parts := strings.SplitN(l, ":", 3)
		if len(parts) != 3 {
			continue
		}
		var file string
		switch {
		case strings.Contains(","+parts[1]+",", ",memory,"):
			file = filepath.Join("/sys/fs/cgroup/memory", parts[2], "memory.usage_in_bytes")
		case parts[1] == "":
			file = filepath.Join("/sys/fs/cgroup", parts[2], "memory.current")
		default:
			continue
		}
		if b, err := os.ReadFile(file); err == nil {
			if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
				return v
			}
		}
	}
	return 0
}

func readComm(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return strings.TrimSpace(string(b))
}

// children lists pid's child processes (of every thread).
func children(pid int) []int {
	var out []int
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, t := range tasks {
		b, _ := os.ReadFile(t)
		for _, f := range strings.Fields(string(b)) {
			if p, err := strconv.Atoi(f); err == nil {
				out = append(out, p)
			}
		}
	}
	return out
}

// rollup reads Pss, Private_Clean+Private_Dirty (USS) and Rss in bytes.
func rollup(pid int) (pss, uss, rss int64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0, 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		kb, _ := strconv.ParseInt(fields[1], 10, 64)
		switch fields[0] {
		case "Pss:":
			pss = kb << 10
		case "Rss:":
			rss = kb << 10
		case "Private_Clean:", "Private_Dirty:":
			uss += kb << 10
		}
	}
	return pss, uss, rss, sc.Err()
}

// addPoolRows adds the pool rows to the full run; a failure is reported and the run goes on.
func addPoolRows(ctx context.Context, add func(row)) {
	fmt.Fprintln(os.Stderr, "create to ready and idle memory...")
	rows, err := poolRows(ctx)
	for _, r := range rows {
		add(r)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "  pool rows:", err)
	}
}

// printPoolRows is -pool-only: the pool rows alone.
func printPoolRows(ctx context.Context) error {
	rows, err := poolRows(ctx)
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "METRIC\tSBX BROKER\tTARGET (issue 17)\tBASELINE THIS RUN")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.metric, r.ours, r.budget, r.baseline)
	}
	tw.Flush()
	return err
}
