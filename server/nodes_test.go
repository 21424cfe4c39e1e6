package server_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// After Redis lost its data (FLUSHALL), a broker's node record is written again: delegations and
// run-configs work through the hosting broker at once and through another broker within a node
// heartbeat, without restarting either.
func TestDelegateAfterRedisDataLoss(t *testing.T) {
	t.Parallel()
	a := servertest.New(t, servertest.Options{Node: "node-a", NodeHeartbeat: 100 * time.Millisecond})
	b := servertest.New(t, servertest.Options{Node: "node-b", Redis: a.Redis, NodeHeartbeat: 100 * time.Millisecond})
	ctx := t.Context()
	if err := a.RDB.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	viaA := a.NewClient(a.Org) // the API keys went with the flush
	viaB := b.NewClient(a.Org)
	if _, err := viaA.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	mint := protocol.MintRequest{Scopes: []string{protocol.ScopeFSRead}}
	if _, err := viaA.Delegate(ctx, "dev", mint); err != nil {
		t.Fatalf("delegate through the hosting broker after FLUSHALL: %v", err)
	}
	if err := wait.For(5*time.Second, func() error { _, err := viaB.Delegate(ctx, "dev", mint); return err }); err != nil {
		t.Fatalf("delegate through another broker after FLUSHALL: %v", err)
	}
}

// A broker that stops beating (here: shut down, as a crash leaves its records) is declared lost by
// another: its sandboxes say node_status lost in get and in heartbeats, with one node_lost event,
// and its return clears that with a node_returned event. A live broker's sandboxes are never
// marked.
func TestSilentBrokerIsDeclaredLost(t *testing.T) {
	t.Parallel()
	fast := servertest.Options{Node: "node-a", NodeHeartbeat: 200 * time.Millisecond, NodeLostAfter: 2 * time.Second}
	a := servertest.New(t, fast)
	fastB := fast
	fastB.Node, fastB.Redis = "node-b", a.Redis
	b := servertest.New(t, fastB)
	viaB := b.NewClient(a.Org)
	ctx := t.Context()
	if _, err := a.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "on-a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := viaB.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "on-b"}); err != nil {
		t.Fatal(err)
	}
	a.Stop()
	err := wait.For(10*time.Second, func() error {
		got, err := viaB.GetSandbox(ctx, "on-a")
		if err != nil {
			return err
		}
		if got.NodeStatus != protocol.NodeLost || got.NodeLostAt == nil {
			return fmt.Errorf("node_status %q", got.NodeStatus)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("sandbox of a silent broker: %v, want node_status lost", err)
	}
	if hb, err := viaB.Heartbeat(ctx, "on-a"); err != nil || hb.NodeStatus != protocol.NodeLost {
		t.Fatalf("heartbeat of a sandbox whose broker is lost: %+v %v, want node_status lost", hb, err)
	}
	if got, err := viaB.GetSandbox(ctx, "on-b"); err != nil || got.NodeStatus != "" {
		t.Fatalf("sandbox of the live broker: %+v %v, want no node_status", got, err)
	}
	if hb, err := viaB.Heartbeat(ctx, "on-b"); err != nil || hb.NodeStatus != "" {
		t.Fatalf("heartbeat on the live broker: %+v %v, want no node_status", hb, err)
	}

	// Broker A comes back on its data dir: the mark goes, with a node_returned event.
	fast.DataDir, fast.Redis = a.DataDir, a.Redis
	a2 := servertest.New(t, fast)
	viaA2 := a2.NewClient(a.Org)
	err = wait.For(10*time.Second, func() error {
		got, err := viaB.GetSandbox(ctx, "on-a")
		if err == nil && got.NodeStatus != "" {
			err = fmt.Errorf("node_status %q", got.NodeStatus)
		}
		return err
	})
	if err != nil {
		t.Fatalf("after the broker returned: %v, want no node_status", err)
	}
	if _, err := viaA2.Heartbeat(ctx, "on-a"); err != nil {
		t.Fatal(err)
	}
	// node_returned reaches the log after the mark it reports is cleared: wait for it.
	counts := map[string]int{}
	wait.Until(10*time.Second, func() bool {
		counts = map[string]int{}
		viaB.Events(ctx, client.EventOptions{Ref: "on-a", Backlog: 100}, func(e protocol.Event) error {
			counts[e.Type]++
			return nil
		})
		return counts[protocol.EventNodeReturned] > 0
	})
	if counts[protocol.EventNodeLost] != 1 || counts[protocol.EventNodeReturned] != 1 {
		t.Fatalf("events of on-a: %v, want one node_lost and one node_returned", counts)
	}
}
