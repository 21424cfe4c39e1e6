package main

import (
	"bytes"
	"context"
	goflag "flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/gitsync"
	"github.com/sbxbroker/broker/protocol"
)

var pushOnly = flag("push-only", "only sbctl push / diff on a generated 10,000-file repository (issue 13's budgets)")

var pushProfile = goflag.String("push-profile", "", "with -push-only: write CPU profiles of the first push to this directory (push-client.pprof; push-broker.pprof when the broker serves pprof, SBX_DEBUG_LISTEN=127.0.0.1:PORT in the environment)")

// pushReport pushes a generated repository (the tree bench's 10,000 files, ~105 MB, committed)
// into a fresh sandbox, beside GNU tar over loopback TCP (the floor) and `tar c | sbctl exec -i tar
// x`; then times an incremental push after touching one file and a diff after the sandbox changed
// one, and prints the rows.
func pushReport(ctx context.Context, c *client.Client, br *brokerProc) error {
	data, content := repoTar()
	mb := float64(content) / 1e6
	repo := filepath.Join(br.dir, "push-repo")
	fmt.Fprintln(os.Stderr, "push: committing the generated repository...")
	if err := os.MkdirAll(repo, 0o755); err != nil {
		return err
	}
	for _, args := range [][]string{{"init", "-q"}, {"config", "user.email", "b@x"}, {"config", "user.name", "bench"}} {
		if err := gitIn(repo, nil, args...); err != nil {
			return err
		}
	}
	if err := runIn(repo, bytes.NewReader(data), "tar", "x", "--strip-components=1"); err != nil {
		return err
	}
	if err := gitIn(repo, nil, "add", "-A"); err != nil {
		return err
	}
	if err := gitIn(repo, nil, "commit", "-q", "-m", "generated"); err != nil {
		return err
	}
	g, err := gitsync.Open(ctx, repo)
	if err != nil {
		return err
	}
	sb, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "push-bench"})
	if err != nil {
		return err
	}
	dial := func() (*backend.Remote, error) {
		return backend.Dial(ctx, backend.Config{URL: c.DataplaneURL(sb.Sandbox.ID), Credential: c.APIKey()})
	}
	r, err := dial()
	if err != nil {
		return err
	}
	defer r.Close()

	fmt.Fprintln(os.Stderr, "push: first push beside tar over TCP...")
	defer extracted.removeAll()
	// Each timed copy starts with the disk's dirty pages written back: otherwise the one before
	// pays for its predecessor's 100 MB.
	ws := workspaceDir(br.dir, sb.Sandbox.ID) // the floors extract into the same file system as the push
	syscall.Sync()
	floor1, err := tarOverTCP(data, ws)
	if err != nil {
		return err
	}
	syscall.Sync()
	pipe1, err := tarPipeOverTCP(repo, ws)
	if err != nil {
		return err
	}
	syscall.Sync()
	stopProfile, err := profilePush()
	if err != nil {
		return err
	}
	start := time.Now()
	res, err := gitsync.Push(ctx, r, g, gitsync.PushOptions{SandboxID: sb.Sandbox.ID})
	if err != nil {
		return err
	}
	first := time.Since(start)
	if err := stopProfile(); err != nil {
		return err
	}
	syscall.Sync()
	floor2, err := tarOverTCP(data, ws)
	if err != nil {
		return err
	}
	floor := min(floor1, floor2)
	// The same with tar c reading the repository's files (what a person would pipe), not bytes
	// made in memory beforehand.
	syscall.Sync()
	pipe, err := tarPipeOverTCP(repo, ws)
	if err != nil {
		return err
	}
	pipe = min(pipe, pipe1)
	extracted.removeAll() // before the diffs, which would see them

	// The peer: what a person could do before push, if exec -i carried binary input of any size.
	peer := "refused"
	sbctl := filepath.Join(br.dir, "sbctl")
	root, _ := moduleRoot()
	build := exec.Command("go", "build", "-o", sbctl, "./cmd/sbctl")
	build.Dir, build.Stderr = root, os.Stderr
	if err := runGuarded(build); err != nil {
		return err
	}
	pc := exec.Command("sh", "-c", fmt.Sprintf("tar c -C %q . | %q exec push-bench -i -- tar x -C /tmp", repo, sbctl))
	pc.Env = append(os.Environ(), "SBX_BROKER_URL="+br.url, "SBX_API_KEY="+br.key, "HOME="+br.dir)
	ps := time.Now()
	out, perr := pc.CombinedOutput()
	if perr == nil {
		peer = fmt.Sprintf("%.0f ms", ms(time.Since(ps)))
	} else {
		peer = "refused: " + strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
		if len(peer) > 90 {
			peer = peer[:90] + "..."
		}
	}

	// Incremental: one file touched, pushed; five times, the median.
	fmt.Fprintln(os.Stderr, "push: incremental pushes and diffs...")
	var incr, noop, diffs []time.Duration
	target := filepath.Join(repo, "d200", "f10.dat")
	for i := 0; i < 5; i++ {
		if err := os.WriteFile(target, []byte(fmt.Sprintf("edit %d\n", i)), 0o644); err != nil {
			return err
		}
		s := time.Now()
		pr, err := gitsync.Push(ctx, r, g, gitsync.PushOptions{SandboxID: sb.Sandbox.ID})
		if err != nil {
			return err
		}
		incr = append(incr, time.Since(s))
		if pr.Sent != 1 {
			return fmt.Errorf("an incremental push sent %d files, want 1", pr.Sent)
		}
		s = time.Now()
		if _, err := gitsync.Push(ctx, r, g, gitsync.PushOptions{SandboxID: sb.Sandbox.ID}); err != nil {
			return err
		}
		noop = append(noop, time.Since(s))
		// The agent changes one file; diff as sbctl diff does (changes, fetch, git diff).
		if _, err := r.Write(ctx, protocol.WriteArgs{Path: "d100/f05.dat", Content: fmt.Sprintf("agent %d\n", i)}); err != nil {
			return err
		}
		s = time.Now()
		f, err := gitsync.Fetch(ctx, r, g)
		if err != nil {
			return err
		}
		var patch bytes.Buffer
		if err := g.Diff(ctx, f, "", false, &patch); err != nil {
			return err
		}
		diffs = append(diffs, time.Since(s))
		if len(f.Changes) != 1 {
			return fmt.Errorf("diff saw %d changes, want 1", len(f.Changes))
		}
	}
	med := func(d []time.Duration) float64 { slices.Sort(d); return ms(d[len(d)/2]) }
	rows := []row{
		{fmt.Sprintf("push, first (%d files, %.0f MB)", res.Sent, mb), fmt.Sprintf("%.0f ms, %.0f MB/s (%.0f%% of the floor)", ms(first), mb/first.Seconds(), 100*floor.Seconds()/first.Seconds()),
			">= 80% of tar over TCP", "", "", fmt.Sprintf("tar x of in-memory bytes over TCP: %.0f ms; tar c | TCP | tar x: %.0f ms (push at %.0f%% of it); tar c | sbctl exec -i tar x: %s", ms(floor), ms(pipe), 100*pipe.Seconds()/first.Seconds(), peer)},
		{"push, one file touched (median of 5)", fmt.Sprintf("%.0f ms", med(incr)), "< 200 ms", "", "", fmt.Sprintf("nothing changed: %.0f ms", med(noop))},
		{"diff, one file changed by the agent (median of 5)", fmt.Sprintf("%.0f ms", med(diffs)), "< 300 ms", "", "", ""},
	}
	for _, r := range rows {
		fmt.Printf("%s: %s (budget %s; %s)\n", r.metric, r.ours, r.budget, r.baseline)
	}
	return nil
}

// profilePush starts the CPU profiles -push-profile asks for (nothing without it) and returns what
// ends them: the client's is this process's, the broker's comes from its /debug/pprof, asked for
// a few seconds that cover the push (a CPU profile only holds samples of CPU used, so the idle
// rest costs nothing but the wait).
func profilePush() (func() error, error) {
	if *pushProfile == "" {
		return func() error { return nil }, nil
	}
	if err := os.MkdirAll(*pushProfile, 0o755); err != nil {
		return nil, err
	}
	cf, err := os.Create(filepath.Join(*pushProfile, "push-client.pprof"))
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(cf); err != nil {
		return nil, err
	}
	broker := make(chan error, 1)
	if addr := os.Getenv("SBX_DEBUG_LISTEN"); addr != "" {
		started := make(chan struct{})
		go func() {
			req, _ := http.NewRequest("GET", "http://"+addr+"/debug/pprof/profile?seconds=4", nil)
			close(started)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				broker <- err
				return
			}
			defer resp.Body.Close()
			f, err := os.Create(filepath.Join(*pushProfile, "push-broker.pprof"))
			if err == nil {
				_, err = io.Copy(f, resp.Body)
				f.Close()
			}
			broker <- err
		}()
		<-started
	} else {
		broker <- nil
	}
	return func() error {
		pprof.StopCPUProfile()
		cf.Close()
		return <-broker
	}, nil
}

func gitIn(dir string, env []string, args ...string) error {
	cmd := exec.Command("git", args...)
	cmd.Dir, cmd.Env = dir, append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("git %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func runIn(dir string, stdin *bytes.Reader, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir, cmd.Stdin = dir, stdin
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %v: %s", name, err, out)
	}
	return nil
}

// tarPipeOverTCP times tar c of the repository (its .git left out) piped over a loopback TCP
// connection into tar x in a new directory under dir.
func tarPipeOverTCP(repo, dir string) (time.Duration, error) {
	target, err := os.MkdirTemp(dir, "tar-pipe-")
	if err != nil {
		return 0, err
	}
	extracted.add(target)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	start := time.Now()
	sent := make(chan error, 1)
	go func() {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			sent <- err
			return
		}
		cmd := exec.Command("tar", "c", "--exclude=./.git", "-C", repo, ".")
		cmd.Stdout = c
		err = cmd.Run()
		c.Close()
		sent <- err
	}()
	c, err := l.Accept()
	if err != nil {
		return 0, err
	}
	defer c.Close()
	cmd := exec.Command("tar", "x", "-C", target)
	cmd.Stdin = c
	if out, err := cmd.CombinedOutput(); err != nil {
		return 0, fmt.Errorf("tar x: %v: %s", err, out)
	}
	if err := <-sent; err != nil {
		return 0, fmt.Errorf("tar c: %v", err)
	}
	return time.Since(start), nil
}
