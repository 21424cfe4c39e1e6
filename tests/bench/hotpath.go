package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
)

var hotpathOnly = flag("hotpath", "only the hot-path rows of issue 17 (1 MiB read/write, 4 KiB, ping, exec, bulk, 1,000 clients)")

var clientsOnly = flag("clients-only", "only the 1,000-client row of issue 17 (1,000 connections dialled at once with one token, each doing rounds of write/read/exec), with the load average")

// clientsRows runs the 1,000-client row alone and prints it with the machine's load average before
// and after, since on a shared machine the figure means little without it.
func clientsRows(ctx context.Context, blk protocol.SandboxBlock) error {
	load0 := loadAvg()
	cd, cw, cr, ce, errs, took := concurrentClients(ctx, blk, 1000, 3)
	load1 := loadAvg()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "1,000 CLIENTS (issue 17)\tBROKER (p50 / p99)\tTARGET")
	fmt.Fprintf(tw, "1,000 clients: dial (upgrade)\t%s\t0 errors\n", p50p99(cd))
	fmt.Fprintf(tw, "1,000 clients: 4 KiB write\t%s\t0 errors\n", p50p99(cw))
	fmt.Fprintf(tw, "1,000 clients: 4 KiB read\t%s\t0 errors\n", p50p99(cr))
	fmt.Fprintf(tw, "1,000 clients: exec `true`\t%s\t0 errors\n", p50p99(ce))
	tw.Flush()
	fmt.Printf("%d errors, %.1f s in all; load average before %s, after %s\n", errs, took.Seconds(), load0, load1)
	return nil
}

// loadAvg is the 1, 5 and 15 minute load averages.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// hotpath measures the dataplane's hot path (issue 17) and prints each figure beside its floor in
// this run and the peers' figures from the issue (E2B envd and the Daytona daemon built from their
// sources, run without isolation, on this machine type).
func hotpath(ctx context.Context, r *backend.Remote, br *brokerProc, blk protocol.SandboxBlock, tcp, tcpAcross, bare samples, n int) error {
	fmt.Fprintln(os.Stderr, "hot path (issue 17)...")
	var rows []row
	add := func(r row) { rows = append(rows, r); fmt.Fprintf(os.Stderr, "  %s: %s\n", r.metric, r.ours) }
	big := n / 3
	mib := make([]byte, 1<<20)
	rand.Read(mib)
	// Text, as the source files and lockfiles an agent reads are; the broker's answer for binary
	// content differs only in its encoding flag.
	text := bytes.Repeat([]byte("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde\n"), 1<<14)

	// Floors: the same bytes through the local file system of the data dir's disk.
	floorDir, err := os.MkdirTemp(br.dir, "floor-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(floorDir)
	local := filepath.Join(floorDir, "f")
	if err := os.WriteFile(local, text, 0o644); err != nil {
		return err
	}
	localRead := sample(big, func() error { _, err := os.ReadFile(local); return err })
	readAcross, err := tcpFileReadsAcross(big, local)
	if err != nil {
		return err
	}
	localWrite := sample(big, func() error { return atomicWrite(filepath.Join(floorDir, "w"), text) })
	// The same on the sandbox's own workspace file system (an ext4 image on a loop device under a
	// root broker, for its disk quota), which every dataplane write goes through.
	wsDir := filepath.Join(br.dir, "data", "sandboxes", blk.SandboxID, "workspace")
	wsFloor, err := os.MkdirTemp(wsDir, ".floor-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(wsFloor)
	wsWrite := sample(big, func() error { return atomicWrite(filepath.Join(wsFloor, "w"), text) })

	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "mib.txt", Content: string(text)}); err != nil {
		return err
	}
	read1 := sample(big, func() error {
		got, err := r.Read(ctx, protocol.ReadArgs{Path: "mib.txt"})
		if err == nil && len(got.Content) != len(text) {
			err = fmt.Errorf("read %d bytes", len(got.Content))
		}
		return err
	})
	textS := string(text)
	write1 := sample(big, func() error {
		_, err := r.Write(ctx, protocol.WriteArgs{Path: "mibw.txt", Content: textS})
		return err
	})
	add(row{"1 MiB read", p50p99(read1), "faster than envd, <= 3x floor", "0.97", "1.06", "local read " + p50p99(localRead) + ratio(read1, localRead) +
		"; from another process over TCP " + p50p99(readAcross) + ratio(read1, readAcross)})
	add(row{"1 MiB write", p50p99(write1), "faster than envd, <= 3x floor", "1.8", "4.7", "local write+rename " + p50p99(localWrite) + ratio(write1, localWrite) +
		"; on the workspace's fs " + p50p99(wsWrite) + ratio(write1, wsWrite)})

	small := string(text[:4096])
	rw := sample(n, func() error {
		if _, err := r.Write(ctx, protocol.WriteArgs{Path: "small.txt", Content: small}); err != nil {
			return err
		}
		got, err := r.Read(ctx, protocol.ReadArgs{Path: "small.txt"})
		if err == nil && len(got.Content) != 4096 {
			err = fmt.Errorf("read %d bytes", len(got.Content))
		}
		return err
	})
	rwAcross, err := tcpWriteReadsAcross(n, wsFloor)
	if err != nil {
		return err
	}
	add(row{"4 KiB write+read", p50p99(rw), "p50 < 0.25 ms", "0.73", "", "the same by another process asked over TCP, on the workspace's fs " + p50p99(rwAcross) + ratio(rw, rwAcross)})
	ping := sample(n*3, func() error { return r.Ping(ctx) })
	add(row{"dataplane ping", p50p99(ping), "<= 3x TCP round trip", "0.158", "0.190", "TCP round trip to another process " + p50p99(tcpAcross) + ratio(ping, tcpAcross) +
		"; within one process " + p50p99(tcp) + ratio(ping, tcp)})
	execTrue := sample(n, func() error {
		res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Argv: []string{"true"}}})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("true exited %d", res.ExitCode)
		}
		return err
	})
	execAcross, err := tcpExecsAcross(n)
	if err != nil {
		return err
	}
	add(row{"exec `true`", p50p99(execTrue), "<= 1.3x os/exec", "3.4", "", "bare os/exec " + p50p99(bare) + ratio(execTrue, bare) +
		"; by another process asked over TCP " + p50p99(execAcross) + ratio(execTrue, execAcross)})

	// Bulk: 100 MiB each way, beside floors that met the same memory (bulk.go).
	bulk, err := bulkRows(ctx, r, blk, br, wsDir)
	if err != nil {
		return err
	}
	for _, b := range bulk {
		add(b)
	}

	fmt.Fprintln(os.Stderr, "  1000 concurrent clients...")
	cd, cw, cr, ce, errs, took := concurrentClients(ctx, blk, 1000, 3)
	add(row{"1,000 clients: dial (upgrade)", p50p99(cd), "0 errors", "", "", ""})
	add(row{"1,000 clients: 4 KiB write", p50p99(cw), "0 errors", "", "", fmt.Sprintf("%d errors, %.1f s in all", errs, took.Seconds())})
	add(row{"1,000 clients: 4 KiB read", p50p99(cr), "0 errors", "", "", ""})
	add(row{"1,000 clients: exec `true`", p50p99(ce), "0 errors", "", "", ""})

	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "HOT PATH (issue 17)\tBROKER (p50 / p99)\tTARGET\tE2B ENVD\tDAYTONA\tFLOOR THIS RUN")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.metric, r.ours, r.budget, r.e2b, r.daytona, r.baseline)
	}
	tw.Flush()
	fmt.Println()
	return nil
}

// atomicWrite is what a file write that readers never see half of costs locally: a temporary file
// in the same directory, then a rename.
func atomicWrite(path string, b []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".tmp-")
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

func p50p99(s samples) string {
	out := fmt.Sprintf("%.3f / %.3f ms", s.pct(.5).Seconds()*1000, s.pct(.99).Seconds()*1000)
	if s.errs > 0 {
		out += fmt.Sprintf(" (%d errors)", s.errs)
	}
	return out
}

// ratio is ours/floor at p50, as the targets state them.
func ratio(ours, floor samples) string {
	if floor.pct(.5) == 0 {
		return ""
	}
	return fmt.Sprintf(" (x%.1f)", float64(ours.pct(.5))/float64(floor.pct(.5)))
}

// concurrentClients opens n connections at once; each does rounds of a 4 KiB write, its read and an
// exec of `true`. It returns the latencies of the dials (each a WebSocket upgrade with the one
// token) and of each op over all clients, and the errors.
func concurrentClients(ctx context.Context, blk protocol.SandboxBlock, n, rounds int) (d, w, r, e samples, errs int64, took time.Duration) {
	var mu sync.Mutex
	var ds, ws, rs, es []time.Duration
	var nerr atomic.Int64
	fail := func(err error) {
		if nerr.Add(1) <= 3 {
			fmt.Fprintln(os.Stderr, "  error:", err)
		}
	}
	content := string(bytes.Repeat([]byte("x"), 4096))
	var wg sync.WaitGroup
	start := time.Now()
	remotes := make([]*backend.Remote, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.Now()
			rem, err := backend.Dial(ctx, backend.Config{URL: blk.DataplaneURL, Credential: blk.Credential, Reconnects: 3})
			if err != nil {
				fail(err)
				return
			}
			dial := time.Since(t)
			remotes[i] = rem
			p := fmt.Sprintf("clients/%d.txt", i)
			var lw, lr, le []time.Duration
			for range rounds {
				t = time.Now()
				if _, err := rem.Write(ctx, protocol.WriteArgs{Path: p, Content: content}); err != nil {
					fail(err)
					continue
				}
				lw = append(lw, time.Since(t))
				t = time.Now()
				if got, err := rem.Read(ctx, protocol.ReadArgs{Path: p}); err != nil || len(got.Content) != len(content) {
					fail(fmt.Errorf("read %d bytes: %v", len(got.Content), err))
					continue
				}
				lr = append(lr, time.Since(t))
				t = time.Now()
				if res, err := rem.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Argv: []string{"true"}}}); err != nil || res.ExitCode != 0 {
					fail(fmt.Errorf("exec true: exit %d, %v", res.ExitCode, err))
					continue
				}
				le = append(le, time.Since(t))
			}
			mu.Lock()
			ds, ws, rs, es = append(ds, dial), append(ws, lw...), append(rs, lr...), append(es, le...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	took = time.Since(start)
	for _, rem := range remotes {
		if rem != nil {
			rem.Close()
		}
	}
	sorted := func(d []time.Duration) samples {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return samples{d: d}
	}
	return sorted(ds), sorted(ws), sorted(rs), sorted(es), nerr.Load(), took
}
