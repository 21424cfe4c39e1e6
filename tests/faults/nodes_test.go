package faults

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
)

// Two brokers on one Redis. `sbctl exec` through the broker that does not host a sandbox runs on
// the one that does. Broker B is killed with SIGKILL: A declares it lost after --node-lost-after,
// and `sbctl get`, heartbeats and the events say so (one node_lost event); A's own sandbox is never
// marked. B's sandbox processes died with it (none is left running on the host). B restarted on
// its data dir comes back: node_returned, the mark cleared, its sandbox running with its files.
func TestBrokerKilledAmongTwo(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key := r.apiKey("acme")
	fast := []string{"--node-heartbeat", "200ms", "--node-lost-after", "2s", "--sweep-interval", "200ms"}
	a := startBroker(t, r, "a", fast...)
	b := startBroker(t, r, "b", fast...)
	ca, cb := a.client(key), b.client(key)
	onA := create(t, ca, "on-a", time.Hour)
	onB := create(t, cb, "on-b", time.Hour)

	// exec through the broker that does not host the sandbox.
	if out := a.ok(key, "exec", "on-b", "--", "sh", "-c", "echo hello > /workspace/f; cat /workspace/f"); strings.TrimSpace(out) != "hello" {
		t.Fatalf("sbctl exec through the other broker: %q", out)
	}
	if sb := get(t, ca, "on-b"); !strings.Contains(sb.DataplaneURL, strings.TrimPrefix(b.URL, "http://")) {
		t.Fatalf("the view through a names dataplane_url %q, not the hosting broker %s", sb.DataplaneURL, b.URL)
	}
	marker := filepath.Join(b.DataDir, "sandboxes", onB.ID, "workspace", "f")
	if data, err := os.ReadFile(marker); err != nil || string(data) != "hello\n" {
		t.Fatalf("the file exec wrote on B: %q %v", data, err)
	}
	pids := markedProcesses(t, b.DataDir)
	if len(pids) == 0 {
		t.Fatal("no process of B's sandbox found before the kill: the check below would prove nothing")
	}

	b.kill9()
	eventually(t, 10*time.Second, "B's sandbox processes outlived its kill -9", func() bool {
		return len(markedProcesses(t, b.DataDir)) == 0
	})
	eventually(t, 15*time.Second, "A did not declare B lost", func() bool {
		return get(t, ca, "on-b").NodeStatus == protocol.NodeLost
	})
	if got := a.ok(key, "get", "on-b"); !strings.Contains(got, "Broker lost") || !strings.Contains(got, "only on that host") {
		t.Fatalf("sbctl get of a lost node's sandbox does not say so plainly:\n%s", got)
	}
	hb, err := ca.Heartbeat(context.Background(), onB.ID)
	if err != nil || hb.NodeStatus != protocol.NodeLost {
		t.Fatalf("a heartbeat of a lost node's sandbox: %+v %v", hb, err)
	}
	if s := get(t, ca, "on-a"); s.NodeStatus != "" {
		t.Fatalf("a live broker's sandbox is marked %q", s.NodeStatus)
	}
	if r := a.sbctl(key, "exec", "on-b", "--", "true"); r.code == 0 {
		t.Fatalf("exec on a lost node's sandbox succeeded: %+v", r)
	}

	b.start()
	eventually(t, 15*time.Second, "B's return did not clear the lost mark", func() bool {
		return get(t, ca, "on-b").NodeStatus == ""
	})
	if s := get(t, ca, "on-b"); s.Status != protocol.StatusRunning {
		t.Fatalf("B's sandbox after its return: %s (%s)", s.Status, s.StopReason)
	}
	if out := a.ok(key, "exec", "on-b", "--", "cat", "/workspace/f"); out != "hello\n" {
		t.Fatalf("B's sandbox's file after its return: %q", out)
	}
	// node_returned is written after the mark is cleared: wait for it before counting.
	var evs []protocol.Event
	eventually(t, 10*time.Second, "B's node_returned event never reached the log", func() bool {
		evs = r.orgEvents("acme")
		return len(of(evs, onB.ID, protocol.EventNodeReturned)) > 0
	})
	if l, ret := of(evs, onB.ID, protocol.EventNodeLost), of(evs, onB.ID, protocol.EventNodeReturned); len(l) != 1 || len(ret) != 1 {
		t.Fatalf("node_lost %d, node_returned %d events; want one each", len(l), len(ret))
	}
	if l := of(evs, onA.ID, protocol.EventNodeLost); len(l) != 0 {
		t.Fatalf("A's sandbox got node_lost: %+v", l)
	}
}

// After Redis loses its data (FLUSHALL), each broker writes its node record again without a
// restart: once the operator has created a key again, delegations and run-configs work through
// both brokers.
func TestRedisDataLossReregisters(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key := r.apiKey("acme")
	fast := []string{"--node-heartbeat", "200ms", "--node-lost-after", "2s"}
	a := startBroker(t, r, "a", fast...)
	b := startBroker(t, r, "b", fast...)
	before := create(t, a.client(key), "before", time.Hour)
	ws := filepath.Join(a.DataDir, "sandboxes", before.ID, "workspace")
	if err := os.WriteFile(filepath.Join(ws, "work.txt"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}

	r.flushAll()
	// Verified keys are cached for 2 s (docs/operations.md, Security notes).
	eventually(t, 10*time.Second, "the old key still worked after FLUSHALL", func() bool {
		return a.sbctl(key, "list").code == 4
	})
	key = r.apiKey("acme")
	a.ok(key, "create", "after")
	// Through the hosting broker at once, through the other within a node beat.
	if out := a.ok(key, "run-config", "after"); !strings.Contains(out, strings.TrimPrefix(a.URL, "http://")) {
		t.Fatalf("run-config through the hosting broker: %s", out)
	}
	eventually(t, 10*time.Second, "delegate through the other broker kept failing after FLUSHALL", func() bool {
		return b.sbctl(key, "delegate", "after", "--scope", "fs:read").code == 0
	})
	if out := b.ok(key, "run-config", "after"); !strings.Contains(out, strings.TrimPrefix(a.URL, "http://")) {
		t.Fatalf("run-config through the other broker names another dataplane: %s", out)
	}
	// Redis' word alone never deletes work: the sandbox whose record is gone keeps its files.
	if data, err := os.ReadFile(filepath.Join(ws, "work.txt")); err != nil || string(data) != "kept" {
		t.Fatalf("the files of a sandbox whose record Redis lost: %q %v", data, err)
	}
}

// markedProcesses lists the processes whose environment carries the marker of a broker's data dir
// (SBX_SANDBOX_OF, see sandbox/provider): its bwraps and sandbox inits.
func markedProcesses(t *testing.T, dataDir string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	want := "SBX_SANDBOX_OF=" + markerOf(dataDir)
	var pids []int
	for _, e := range entries {
		pid := 0
		for _, ch := range e.Name() {
			if ch < '0' || ch > '9' {
				pid = -1
				break
			}
			pid = pid*10 + int(ch-'0')
		}
		if pid <= 0 {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil {
			continue
		}
		for _, kv := range strings.Split(string(env), "\x00") {
			if kv == want {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// markerOf is the marker value a namespace provider gives the processes of a data dir (a hash of
// its path, as sandbox/provider's orphanValue makes it).
func markerOf(dataDir string) string {
	sum := sha256.Sum256([]byte(filepath.Clean(dataDir)))
	return hex.EncodeToString(sum[:8])
}

// Every answer that shows a sandbox names its dataplane on the broker hosting it, so a client that
// created or listed it through any broker dials the right one: create, list and get.
func TestViewsNameTheHostingDataplane(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	key := r.apiKey("acme")
	a := startBroker(t, r, "a")
	b := startBroker(t, r, "b")
	ca, cb := a.client(key), b.client(key)
	onA, onB := create(t, ca, "on-a", time.Hour), create(t, cb, "on-b", time.Hour)
	want := map[string]string{}
	for _, sb := range []protocol.Sandbox{onA, onB} {
		want[sb.ID] = get(t, ca, sb.ID).DataplaneURL
		if want[sb.ID] == "" {
			t.Fatalf("GET of %s names no dataplane", sb.Name)
		}
		if sb.DataplaneURL != want[sb.ID] {
			t.Errorf("the create answer of %s names dataplane %q, want %q", sb.Name, sb.DataplaneURL, want[sb.ID])
		}
	}
	if !strings.Contains(want[onB.ID], strings.TrimPrefix(b.URL, "http://")) {
		t.Fatalf("on-b's dataplane %q is not on B (%s)", want[onB.ID], b.URL)
	}
	for _, c := range []*client.Client{ca, cb} {
		items, err := c.ListAllSandboxes(context.Background(), client.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, it := range items {
			if it.DataplaneURL != want[it.ID] {
				t.Errorf("list names dataplane %q for %s, want %q", it.DataplaneURL, it.Name, want[it.ID])
			}
		}
	}
	// A reuse, a stop and a resume answer name it too.
	res, err := ca.CreateSandbox(context.Background(), protocol.CreateSandboxRequest{Name: "on-b"})
	if err != nil || res.Outcome != protocol.OutcomeReused || res.Sandbox.DataplaneURL != want[onB.ID] {
		t.Errorf("reuse through A: %v %s %q", err, res.Outcome, res.Sandbox.DataplaneURL)
	}
	if _, err := ca.StopSandbox(context.Background(), "on-a"); err != nil {
		t.Fatal(err)
	}
	if sb, err := ca.ResumeSandbox(context.Background(), "on-a"); err != nil || sb.DataplaneURL != want[onA.ID] {
		t.Errorf("resume answer: %v %q", err, sb.DataplaneURL)
	}
}
