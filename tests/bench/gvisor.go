package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
)

var gvisorOnly = flag("gvisor", "only the isolation levels side by side: namespace and gvisor (issue 22)")

// The broker the bench starts has a HOME of its own; it finds runsc through SBX_RUNSC.
func init() {
	if os.Getenv("SBX_RUNSC") == "" {
		if p, err := provider.FindRunsc(""); err == nil {
			os.Setenv("SBX_RUNSC", p)
		}
	}
}

// levelFigures are one isolation level's measurements.
type levelFigures struct {
	create, pooled, execTrue, rw4k, rw1m samples
	// inside is the same-run floor of exec: a shell's fork+exec of /bin/true inside the sandbox.
	inside  time.Duration
	idle    int64 // host bytes per idle sandbox
	idleHow string
}

// gvisorRows measures both isolation levels on the one broker and prints them side by side, with
// `runsc exec` (what exec would cost without the resident init) beside them.
func gvisorRows(ctx context.Context, c *client.Client, br *brokerProc) error {
	if os.Getenv("SBX_RUNSC") == "" {
		return fmt.Errorf("no runsc: build it with scripts/runsc.sh")
	}
	n := 300
	if *quick {
		n = 100
	}
	figs := map[string]*levelFigures{}
	var runscExec samples
	for _, level := range []string{protocol.IsolationNamespace, protocol.IsolationGvisor} {
		fmt.Fprintln(os.Stderr, level+"...")
		f := &levelFigures{}
		figs[level] = f
		f.create = sample(map[string]int{"namespace": 20, "gvisor": 10}[level], func() error {
			name := fmt.Sprintf("cold-%s-%d", level, time.Now().UnixNano())
			_, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name, Isolation: level})
			if err == nil {
				defer c.DeleteSandbox(ctx, name)
			}
			return err
		})
		name := "level-" + level
		sb, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name, Isolation: level})
		if err != nil {
			return err
		}
		if sb.Sandbox.Isolation != level {
			return fmt.Errorf("asked for %s, got %s", level, sb.Sandbox.Isolation)
		}
		m, err := c.Delegate(ctx, name, protocol.MintRequest{Scopes: protocol.Scopes})
		if err != nil {
			return err
		}
		r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
		if err != nil {
			return err
		}
		for i := 0; i < 20; i++ { // warm up
			r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Argv: []string{"true"}}})
		}
		f.execTrue = sample(n, func() error {
			res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Argv: []string{"true"}}})
			if err == nil && res.ExitCode != 0 {
				err = fmt.Errorf("true exited %d", res.ExitCode)
			}
			return err
		})
		var out bytes.Buffer
		res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "s=$(date +%s%N); for i in $(seq 100); do /bin/true; done; e=$(date +%s%N); echo $(( (e - s) / 100 ))"}, Stdout: &out})
		if err != nil || res.ExitCode != 0 {
			return fmt.Errorf("exec floor: %v %+v", err, res)
		}
		ns, _ := strconv.ParseInt(strings.TrimSpace(out.String()), 10, 64)
		f.inside = time.Duration(ns)
		for _, sz := range []int{4 << 10, 1 << 20} {
			content := strings.Repeat("x", sz)
			s := sample(map[int]int{4 << 10: n, 1 << 20: n / 5}[sz], func() error {
				if _, err := r.Write(ctx, protocol.WriteArgs{Path: "rw.txt", Content: content}); err != nil {
					return err
				}
				got, err := r.Read(ctx, protocol.ReadArgs{Path: "rw.txt", Length: int64(sz)})
				if err == nil && len(got.Content) != sz {
					err = fmt.Errorf("read %d bytes of %d", len(got.Content), sz)
				}
				return err
			})
			if sz == 4<<10 {
				f.rw4k = s
			} else {
				f.rw1m = s
			}
		}
		if level == protocol.IsolationGvisor {
			root := filepath.Join(br.dir, "data", "sandboxes", sb.Sandbox.ID, "state", "gvisor", "root")
			runscExec = sample(10, func() error {
				return exec.Command(os.Getenv("SBX_RUNSC"), "--root", root, "exec", sb.Sandbox.ID, "true").Run()
			})
		}
		r.Close()
		if f.idle, f.idleHow, err = idleMemory(ctx, c, br, level, 20); err != nil {
			return err
		}
		c.DeleteSandbox(ctx, name)
	}
	// From a warm pool: each level's default template keeping 2 ready on a broker of its own.
	for _, level := range []string{protocol.IsolationNamespace, protocol.IsolationGvisor} {
		fmt.Fprintln(os.Stderr, level+" warm pool...")
		var err error
		if figs[level].pooled, _, err = warmPoolSamples(ctx, "default:\n  isolation: "+level+"\n  pool: {size: 2}\n", 2, 10); err != nil {
			return err
		}
	}
	ns, gv := figs[protocol.IsolationNamespace], figs[protocol.IsolationGvisor]
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "METRIC (p50 / p90 ms)\tNAMESPACE\tGVISOR\tGVISOR / NAMESPACE\tBESIDE")
	ratio := func(a, b samples) string {
		return fmt.Sprintf("%.1fx", float64(b.pct(.5))/float64(max(a.pct(.5), 1)))
	}
	fmt.Fprintf(tw, "create to ready (cold)\t%s\t%s\t%s\tissue 22: gVisor ~600 ms to start\n", ns.create.ms(), gv.create.ms(), ratio(ns.create, gv.create))
	fmt.Fprintf(tw, "create to ready (warm pool of 2)\t%s\t%s\t%s\tissue 17: under 5 ms from a pool\n", ns.pooled.ms(), gv.pooled.ms(), ratio(ns.pooled, gv.pooled))
	fmt.Fprintf(tw, "exec `true` (resident init)\t%s\t%s\t%s\ttarget gvisor within 3x; `runsc exec true` %s\n", ns.execTrue.ms(), gv.execTrue.ms(), ratio(ns.execTrue, gv.execTrue), runscExec.ms())
	fmt.Fprintf(tw, "fork+exec of /bin/true inside (a shell loop)\t%.3f ms\t%.3f ms\t%.1fx\tthe floor under exec `true`: the guest kernel's own cost\n",
		ns.inside.Seconds()*1000, gv.inside.Seconds()*1000, float64(gv.inside)/float64(max(ns.inside, 1)))
	fmt.Fprintf(tw, "4 KiB write+read\t%s\t%s\t%s\thost-side file path at both levels\n", ns.rw4k.ms(), gv.rw4k.ms(), ratio(ns.rw4k, gv.rw4k))
	fmt.Fprintf(tw, "1 MiB write+read\t%s\t%s\t%s\t\n", ns.rw1m.ms(), gv.rw1m.ms(), ratio(ns.rw1m, gv.rw1m))
	fmt.Fprintf(tw, "idle host memory per sandbox (20 idle)\t%.1f MiB\t%.1f MiB\t%.1fx\tissue 22: gVisor 45-70 MB; %s\n",
		float64(ns.idle)/(1<<20), float64(gv.idle)/(1<<20), float64(gv.idle)/float64(max(ns.idle, 1)), gv.idleHow)
	return tw.Flush()
}

// idleMemory starts k idle sandboxes at level and returns the host memory each holds: the memory
// charged to its cgroups plus the proportional set size of its processes outside them (gvisor's
// `runsc run`), averaged.
func idleMemory(ctx context.Context, c *client.Client, br *brokerProc, level string, k int) (int64, string, error) {
	var ids []string
	for i := 0; i < k; i++ {
		name := fmt.Sprintf("idle-%s-%d", level, i)
		sb, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: name, Isolation: level})
		if err != nil {
			return 0, "", err
		}
		defer c.DeleteSandbox(ctx, name)
		ids = append(ids, sb.Sandbox.ID)
	}
	time.Sleep(2 * time.Second) // let them settle: this is what idle costs, not what starting does
	parent := map[string]string{protocol.IsolationNamespace: "sbx-broker", protocol.IsolationGvisor: "sbx-broker"}[level]
	var cg, outside int64
	for _, id := range ids {
		b, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", parent, id, "memory.usage_in_bytes"))
		v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		cg += v
		if level == protocol.IsolationGvisor {
			outside += runscRunPss(id)
		}
	}
	how := fmt.Sprintf("cgroup memory %.1f MiB + runsc run PSS %.1f MiB each", float64(cg)/float64(k)/(1<<20), float64(outside)/float64(k)/(1<<20))
	return (cg + outside) / int64(k), how, nil
}

// runscRunPss is the proportional set size of the `runsc run` process of sandbox id (it stays in
// the broker's cgroup, not the sandbox's).
func runscRunPss(id string) int64 {
	ents, _ := os.ReadDir("/proc")
	var total int64
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if !bytes.HasPrefix(cmdline, []byte("runsc\x00")) || !bytes.Contains(cmdline, []byte(id)) {
			continue
		}
		raw, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "smaps_rollup"))
		for _, l := range strings.Split(string(raw), "\n") {
			if v, ok := strings.CutPrefix(l, "Pss:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				total += kb << 10
			}
		}
	}
	return total
}
