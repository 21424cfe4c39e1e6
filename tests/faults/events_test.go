package faults

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
)

// follower is a running `sbctl events REF -f -o json`.
type follower struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	events []protocol.Event
	stderr strings.Builder
	done   chan struct{}
}

func follow(t *testing.T, b *broker, key, ref string) *follower {
	t.Helper()
	f := &follower{done: make(chan struct{})}
	f.cmd = exec.Command(filepath.Join(bin, "sbctl"), "events", ref, "-f", "-o", "json")
	f.cmd.Env = append(os.Environ(), "HOME="+t.TempDir(), "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY="+key, "SBX_BROKER_URL="+b.URL)
	out, err := f.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	f.cmd.Stderr = &lockedBuilder{mu: &f.mu, b: &f.stderr}
	if err := f.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(f.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var e protocol.Event
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				f.mu.Lock()
				f.events = append(f.events, e)
				f.mu.Unlock()
			}
		}
		f.cmd.Wait()
	}()
	t.Cleanup(func() { f.cmd.Process.Kill(); <-f.done })
	return f
}

type lockedBuilder struct {
	mu *sync.Mutex
	b  *strings.Builder
}

func (w *lockedBuilder) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// paths lists the paths of the file_written events the follower printed.
func (f *follower) paths() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, e := range f.events {
		if e.Type == protocol.EventFileWritten {
			out = append(out, e.Path)
		}
	}
	return out
}

func (f *follower) stderrText() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stderr.String()
}

// agentOn dials a sandbox's dataplane with a delegation token, as an agent server does.
func agentOn(t *testing.T, c *client.Client, ref string) *backend.Remote {
	t.Helper()
	mint, err := c.Delegate(context.Background(), ref, protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	if err != nil {
		t.Fatal(err)
	}
	agent, err := backend.Dial(context.Background(), backend.Config{URL: mint.Sandbox.DataplaneURL, Credential: mint.Token})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Close() })
	return agent
}

func write(t *testing.T, agent *backend.Remote, path string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := agent.Write(ctx, protocol.WriteArgs{Path: path, Content: "x"}); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// `sbctl events -f` follows a sandbox through a Redis outage and a broker restart: when the stream
// drops it says so, reconnects with backoff, and prints every event once, in order, the ones an agent
// caused during the outage included. Pointed at a broker that never answered, it stops at once
// with an error that says so.
func TestEventsFollowAcrossOutageAndRestart(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key := r.apiKey("acme")
	b := startBroker(t, r, "n1")
	c := b.client(key)
	create(t, c, "dev", time.Hour)
	agent := agentOn(t, c, "dev")
	f := follow(t, b, key, "dev")

	// The backlog (created, token_minted, connected) shows the stream is open.
	eventually(t, 10*time.Second, "the follower showed no backlog", func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.events) > 0
	})
	var want []string
	step := func(p string) { write(t, agent, p); want = append(want, p) }
	step("/workspace/before")
	eventually(t, 10*time.Second, "the follower did not show the first event", func() bool { return len(f.paths()) == 1 })

	r.stop()
	for i := 0; i < 5; i++ {
		step(fmt.Sprintf("/workspace/outage-%d", i))
	}
	r.start()
	step("/workspace/after-redis")
	b.stop()
	b.start()
	step("/workspace/after-restart")
	eventually(t, 30*time.Second, "the follower did not show every event", func() bool { return len(f.paths()) >= len(want) })
	if got := f.paths(); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("the follower printed\n%v\nwant, once each and in order,\n%v", got, want)
	}
	if !strings.Contains(f.stderrText(), "reconnecting") {
		t.Errorf("the follower did not say its stream dropped when the broker restarted: %q", f.stderrText())
	}
	select {
	case <-f.done:
		t.Fatalf("the follower exited: %s", f.stderrText())
	default:
	}

	// A broker that was never reachable: a clear error at once, no retrying for ever.
	res := runSbctl(t, "http://"+freeAddr(t), key, "events", "dev", "-f")
	if res.code != 6 || !strings.Contains(res.stderr, "cannot reach the broker") || res.took > 10*time.Second {
		t.Fatalf("events -f on a broker never reachable: exit %d after %s: %q", res.code, res.took, res.stderr)
	}
}

// Events emitted while Redis is away are kept up to --event-buffer (and the batch being sent when
// Redis went) and written when it returns; past it, one gap event per sandbox says how many were
// lost, after the kept ones.
func TestEventsPastTheBufferLeaveAGap(t *testing.T) {
	t.Parallel()
	const buffer, writes = 10, 25
	r := startRedis(t)
	key := r.apiKey("acme")
	b := startBroker(t, r, "n1", "--event-buffer", fmt.Sprint(buffer))
	c := b.client(key)
	sb := create(t, c, "dev", time.Hour)
	agent := agentOn(t, c, "dev")
	// The events before the outage must be written before it: the writer lingers over a batch's
	// first event, and ones still waiting when Redis goes take room in the buffer that the count
	// below gives to the outage's.
	eventually(t, 20*time.Second, "the connection's event was not written before the outage", func() bool {
		return len(of(r.orgEvents("acme"), sb.ID, protocol.EventConnected)) > 0
	})
	r.stop()
	for i := 0; i < writes; i++ {
		write(t, agent, fmt.Sprintf("/workspace/outage-%02d", i))
	}
	r.start()
	var evs []protocol.Event
	defer func() {
		if t.Failed() {
			t.Logf("events: %+v\nbroker log:\n%s", r.orgEvents("acme"), b.Log())
		}
	}()
	// Until the writer's next retry finds Redis back (up to 2 s), an event emitted now still
	// counts as lost in the gap: wait for the gap to be written, then emit the one that must follow.
	eventually(t, 20*time.Second, "the gap was not written after the outage", func() bool {
		return len(of(r.orgEvents("acme"), sb.ID, protocol.EventGap)) > 0
	})
	write(t, agent, "/workspace/after")
	eventually(t, 20*time.Second, "the event after the outage did not arrive", func() bool {
		evs = of(r.orgEvents("acme"), sb.ID, protocol.EventFileWritten, protocol.EventGap)
		return len(evs) > 0 && evs[len(evs)-1].Path == "/workspace/after"
	})
	// The kept events (the buffer, and the batch the writer was sending when Redis went, itself at
	// most the buffer: the events that gathered in the writer's linger), in order, then the gap
	// that counts the rest.
	kept := len(evs) - 2
	if kept < buffer || kept > 2*buffer {
		t.Fatalf("%d events kept of %d with --event-buffer %d: %+v", kept, writes, buffer, evs)
	}
	for i := 0; i < kept; i++ {
		if want := fmt.Sprintf("/workspace/outage-%02d", i); evs[i].Path != want {
			t.Fatalf("kept event %d is %+v, want %s", i, evs[i], want)
		}
	}
	if g := evs[kept]; g.Type != protocol.EventGap || g.Missed == nil || *g.Missed != int64(writes-kept) {
		t.Fatalf("after the kept events: %+v; want a gap of %d", g, writes-kept)
	}
}
