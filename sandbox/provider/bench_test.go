package provider

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The exec benchmarks print p50/p90 next to each other so the resident init can be judged against
// its peers on the same machine in the same run:
//
//	go test -bench . -run XXX ./sandbox/provider/
//
// BenchmarkExecBareOSExec is the floor (a fork/exec from this process, no isolation at all);
// BenchmarkExecBwrapPerCommand is the naive design (a fresh bwrap sandbox per command); the
// budget for BenchmarkExecNamespace is p50 < 0.8 ms.

// percentiles collects per-iteration durations and reports p50/p90 in milliseconds.
type percentiles struct{ d []time.Duration }

func (p *percentiles) time(f func()) {
	t0 := time.Now()
	f()
	p.d = append(p.d, time.Since(t0))
}

// p50 is the median in milliseconds.
func (p *percentiles) p50() float64 {
	slices.Sort(p.d)
	return float64(p.d[(len(p.d)-1)/2]) / float64(time.Millisecond)
}

func (p *percentiles) report(b *testing.B) {
	if len(p.d) == 0 {
		return
	}
	slices.Sort(p.d)
	at := func(q float64) float64 {
		return float64(p.d[int(q*float64(len(p.d)-1))]) / float64(time.Millisecond)
	}
	b.ReportMetric(at(0.5), "p50-ms")
	b.ReportMetric(at(0.9), "p90-ms")
}

func BenchmarkExecBareOSExec(b *testing.B) {
	var p percentiles
	for b.Loop() {
		p.time(func() {
			if err := exec.Command("/usr/bin/true").Run(); err != nil {
				b.Fatal(err)
			}
		})
	}
	p.report(b)
}

func BenchmarkExecBwrapPerCommand(b *testing.B) {
	n := newNamespace(b, Config{})
	spec := Spec{ID: NewID(), Template: DefaultTemplate()}
	if err := n.Create(context.Background(), spec); err != nil {
		b.Fatal(err)
	}
	var p percentiles
	for b.Loop() {
		// The same flags and files as a sandbox start, running `true` instead of the init.
		cmd, err := n.command(spec, nil, []string{"/usr/bin/true"})
		if err != nil {
			b.Fatal(err)
		}
		p.time(func() {
			files, err := n.startFiles(spec)
			if err != nil {
				b.Fatal(err)
			}
			// fds 3 and 4 are the control socket and the init binary in a real start.
			cmd.ExtraFiles = append([]*os.File{os.Stdin, os.Stdin}, files...)
			err = cmd.Run()
			for _, f := range files {
				f.Close()
			}
			if err != nil {
				b.Fatal(err)
			}
		})
	}
	p.report(b)
}

func benchExec(b *testing.B, prov Provider) { benchExecIn(b, prov, Template{}) }

func benchExecIn(b *testing.B, prov Provider, tmpl Template) {
	in, _ := startSandbox(b, prov, tmpl)
	req := ExecRequest{Argv: []string{"true"}, Stdout: io.Discard}
	ctx := context.Background()
	for range 20 { // warm up: page cache, the init's threads
		in.Exec(ctx, req)
	}
	var p percentiles
	for b.Loop() {
		p.time(func() {
			res, err := in.Exec(ctx, req)
			if err != nil || res.ExitCode != 0 {
				b.Fatal(res, err)
			}
		})
	}
	p.report(b)
}

func BenchmarkExecNamespace(b *testing.B) { benchExec(b, newNamespace(b, Config{})) }

func BenchmarkExecDir(b *testing.B) { benchExec(b, newDir(b)) }

// BenchmarkExecVsBare is issue 17's exec row at the provider: exec `true` through the namespace
// level's init with its output taken as the dataplane takes it (stdout and stderr apart), and a
// bare os/exec of `true` from this process, one after the other in each iteration so that both see
// the same load. It reports both medians, their ratio (the target: 1.3 at most) and the load.
func BenchmarkExecVsBare(b *testing.B) {
	in, _ := startSandbox(b, newNamespace(b, Config{}), Template{})
	req := ExecRequest{Argv: []string{"true"}, Stdout: io.Discard, Stderr: io.Discard}
	ctx := context.Background()
	bare := func() {
		if err := exec.Command("true").Run(); err != nil {
			b.Fatal(err)
		}
	}
	for range 20 {
		in.Exec(ctx, req)
		bare()
	}
	load := loadAverage()
	var pn, pb percentiles
	for b.Loop() {
		pn.time(func() {
			if res, err := in.Exec(ctx, req); err != nil || res.ExitCode != 0 {
				b.Fatal(res, err)
			}
		})
		pb.time(bare)
	}
	b.StopTimer()
	n, bb := pn.p50(), pb.p50()
	b.ReportMetric(n, "ns-p50-ms")
	b.ReportMetric(bb, "bare-p50-ms")
	b.ReportMetric(n/bb, "ns/bare")
	b.ReportMetric((load+loadAverage())/2, "load")
}

// BenchmarkExecGvisor is the same exec at the gvisor level: its request, its output's channel and
// its reply ride the bridge's one stream (gvisor_relay.go).
func BenchmarkExecGvisor(b *testing.B) { benchExecIn(b, newGvisor(b), gvisorTemplate) }

// BenchmarkExecLevels is exec `true` through the init at the namespace and the gvisor level, one
// after the other in each iteration so that both see the same load, each beside its floor measured
// in the same sandbox just after: a shell's fork+exec of /bin/true, inside. It reports the ratios
// (issue 22's target: gvisor within 3x of namespace) and the load average, which on this shared
// 2-core machine moves every absolute figure.
func BenchmarkExecLevels(b *testing.B) {
	ns, _ := startSandbox(b, newNamespace(b, Config{}), Template{})
	gv, _ := startSandbox(b, newGvisor(b), gvisorTemplate)
	req := ExecRequest{Argv: []string{"true"}, Stdout: io.Discard}
	ctx := context.Background()
	for range 20 {
		ns.Exec(ctx, req)
		gv.Exec(ctx, req)
	}
	load := loadAverage()
	var pn, pg percentiles
	for b.Loop() {
		for _, s := range []struct {
			in Instance
			p  *percentiles
		}{{ns, &pn}, {gv, &pg}} {
			s.p.time(func() {
				if res, err := s.in.Exec(ctx, req); err != nil || res.ExitCode != 0 {
					b.Fatal(res, err)
				}
			})
		}
	}
	b.StopTimer()
	n, g := pn.p50(), pg.p50()
	fn, fg := insideFloor(b, ns), insideFloor(b, gv)
	b.ReportMetric(n, "ns-p50-ms")
	b.ReportMetric(g, "gvisor-p50-ms")
	b.ReportMetric(g/n, "gvisor/ns")
	b.ReportMetric(fn, "ns-inside-ms")
	b.ReportMetric(fg, "gvisor-inside-ms")
	b.ReportMetric(g/fg, "gvisor/inside")
	b.ReportMetric((load+loadAverage())/2, "load")
}

// insideFloor is a shell loop's fork+exec of /bin/true inside the sandbox, in ms per command.
func insideFloor(b *testing.B, in Instance) float64 {
	var out bytes.Buffer
	res, err := in.Exec(context.Background(), ExecRequest{Command: "s=$(date +%s%N); for i in $(seq 100); do /bin/true; done; e=$(date +%s%N); echo $(( (e - s) / 100 ))", Stdout: &out})
	if err != nil || res.ExitCode != 0 {
		b.Fatal(res, err, out.String())
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(out.String()), 10, 64)
	if err != nil {
		b.Fatal(err)
	}
	return float64(ns) / 1e6
}

func loadAverage() float64 {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

// BenchmarkGvisorStdio is 8 MiB into a command's stdin and back out of its stdout at the gvisor
// level: every byte crosses the bridge's stream twice, each way within its channel's window.
func BenchmarkGvisorStdio(b *testing.B) {
	in, _ := startSandbox(b, newGvisor(b), gvisorTemplate)
	data := bytes.Repeat([]byte("x"), 8<<20)
	ctx := context.Background()
	b.SetBytes(int64(len(data)))
	var p percentiles
	for b.Loop() {
		p.time(func() {
			var n countingWriter
			res, err := in.Exec(ctx, ExecRequest{Command: "cat", Stdin: bytes.NewReader(data), Stdout: &n})
			if err != nil || res.ExitCode != 0 || int(n) != len(data) {
				b.Fatal(res, err, n)
			}
		})
	}
	p.report(b)
}

type countingWriter int

func (c *countingWriter) Write(p []byte) (int, error) {
	*c += countingWriter(len(p))
	return len(p), nil
}

// BenchmarkCreateToReady is Create + Start (bwrap up, init ready, cgroups attached, environment
// snapshot taken) and then Stop; the budget is p50 < 20 ms.
func BenchmarkCreateToReady(b *testing.B) { benchCreateToReady(b, DefaultTemplate()) }

// BenchmarkCreateToReadyNetwork is BenchmarkCreateToReady for a network: true template: the same
// plus pasta attached to the sandbox's network namespace and the namespace configured.
func BenchmarkCreateToReadyNetwork(b *testing.B) {
	benchCreateToReady(b, Template{Name: "net", Network: NetworkOn})
}

func benchCreateToReady(b *testing.B, tmpl Template) {
	n := newNamespace(b, Config{})
	ctx := context.Background()
	var p percentiles
	for b.Loop() {
		spec := Spec{ID: NewID(), Template: tmpl}
		p.time(func() {
			if err := n.Create(ctx, spec); err != nil {
				b.Fatal(err)
			}
			in, err := n.Start(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			if err := in.Stop(ctx); err != nil {
				b.Fatal(err)
			}
		})
		if err := n.Destroy(ctx, spec); err != nil {
			b.Fatal(err)
		}
	}
	p.report(b)
}

// BenchmarkPreflight is the whole auto preflight of a host where the namespace provider works (a
// throwaway sandbox started, `true` run, stopped, removed); the budget is p50 < 50 ms.
func BenchmarkPreflight(b *testing.B) {
	requireBwrap(b)
	dir := testDataDir(b)
	var p percentiles
	for b.Loop() {
		p.time(func() {
			prov, _, err := Preflight(context.Background(), Config{DataDir: dir, CgroupParent: testCgroupParent}, ChoiceAuto)
			if err != nil || prov.Name() != kindNamespace {
				b.Fatal(prov, err)
			}
		})
	}
	p.report(b)
}
