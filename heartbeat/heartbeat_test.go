package heartbeat_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/tests/wait"
)

func TestMain(m *testing.M) { servertest.Main(m) }

func ttl(s int64) *int64 { return &s }

// history reads a sandbox's events (or the org's, ref "") as they are in the log now.
func history(t *testing.T, c *client.Client, ref string) []protocol.Event {
	t.Helper()
	var out []protocol.Event
	err := c.Events(t.Context(), client.EventOptions{Ref: ref, Backlog: 500}, func(e protocol.Event) error {
		out = append(out, e)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// eventually waits for the event writer (asynchronous by design) to land events.
func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	wait.Eventually(t, 10*time.Second, cond, "the events awaited reached the log")
}

func types(evs []protocol.Event, typ string) []protocol.Event {
	var out []protocol.Event
	for _, e := range evs {
		if e.Type == typ {
			out = append(out, e)
		}
	}
	return out
}

// A 2 s lease with no heartbeat: warned, then stopped with ttl_expired, files intact, resumable.
// One that is heartbeated stays running. The clock is moved by hand; nothing sleeps for time to pass.
func TestLeaseExpiry(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	ctx, c := t.Context(), b.Client
	quiet, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "quiet", TTLSeconds: ttl(2)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "alive", TTLSeconds: ttl(2)}); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(b.DataDir, "sandboxes", quiet.Sandbox.ID, "workspace", "work.txt")
	os.WriteFile(file, []byte("precious"), 0o644)

	clock.Advance(1500 * time.Millisecond)
	if _, err := c.Heartbeat(ctx, "alive"); err != nil {
		t.Fatal(err)
	}
	// The warning window is half the lease here (1 s): quiet, 0.5 s from its deadline, is warned;
	// alive, 2 s from its new one, is not.
	r, err := b.Sweeper.SweepOnce(ctx)
	if err != nil || r.Stopped != 0 || r.Warned != 1 {
		t.Fatalf("first sweep: %+v %v", r, err)
	}
	clock.Advance(time.Second) // quiet is 0.5 s past its deadline and warned 1 s ago; alive has 1 s left
	if r, err = b.Sweeper.SweepOnce(ctx); err != nil || r.Stopped != 1 || r.Warned != 1 {
		t.Fatalf("second sweep: %+v %v", r, err)
	}
	got, _ := c.GetSandbox(ctx, "quiet")
	if got.Status != "stopped" || got.StopReason != protocol.StopTTLExpired {
		t.Fatalf("quiet: %+v", got)
	}
	if a, _ := c.GetSandbox(ctx, "alive"); a.Status != "running" {
		t.Fatalf("a heartbeated sandbox was stopped: %+v", a)
	}
	if data, _ := os.ReadFile(file); string(data) != "precious" {
		t.Fatalf("files lost on a ttl stop: %q", data)
	}
	eventually(t, func() bool { return len(types(history(t, c, "quiet"), "stopped")) == 1 })
	evs := history(t, c, "quiet")
	warn, stop := -1, -1
	for i, e := range evs {
		switch e.Type {
		case "expiring":
			warn = i
			if e.SecondsLeft == nil || *e.SecondsLeft > 1 {
				t.Errorf("expiring: %+v", e)
			}
		case "stopped":
			stop = i
			if e.Reason != protocol.StopTTLExpired || e.Actor != "sweeper" {
				t.Errorf("stopped: %+v", e)
			}
		}
	}
	if warn < 0 || stop < 0 || warn > stop {
		t.Fatalf("want expiring before stopped, got %+v", evs)
	}
	// A second sweep over the same moment does not warn or stop again.
	if r, _ := b.Sweeper.SweepOnce(ctx); r.Stopped+r.Warned != 0 {
		t.Fatalf("a repeated sweep acted again: %+v", r)
	}
	if rs, err := c.ResumeSandbox(ctx, "quiet"); err != nil || rs.Status != "running" {
		t.Fatalf("resume: %v %+v", err, rs)
	}
	if data, _ := os.ReadFile(file); string(data) != "precious" {
		t.Fatalf("files lost on resume: %q", data)
	}
}

// Two brokers on one Redis: an expired sandbox is stopped once, and events cross brokers.
func TestTwoBrokers(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	a := servertest.New(t, servertest.Options{Now: clock.Now, Node: "node-a"})
	b := servertest.New(t, servertest.Options{Now: clock.Now, Node: "node-b", Redis: a.Redis})
	ctx := t.Context()
	onB := b.NewClient(a.Org)

	// A subscriber on broker B sees what happens on broker A.
	seen := make(chan protocol.Event, 16)
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	opened := make(chan struct{}, 1)
	go onB.Events(sctx, client.EventOptions{Follow: true, OnOpen: func() { opened <- struct{}{} }},
		func(e protocol.Event) error { seen <- e; return nil })
	select {
	case <-opened:
	case <-time.After(10 * time.Second):
		t.Fatal("the event stream on broker B did not open")
	}
	res, err := a.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "shared", TTLSeconds: ttl(2)})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-seen:
		if e.Type != "created" || e.SandboxID != res.Sandbox.ID {
			t.Fatalf("broker B's subscriber got %+v", e)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("an event on broker A did not reach a subscriber on broker B")
	}

	clock.Advance(3 * time.Second)
	a.Sweeper.SweepOnce(ctx) // the warning; a stop waits a window (1 s) after it
	clock.Advance(time.Second)
	var wg sync.WaitGroup
	for _, br := range []*servertest.Broker{a, b, a, b} {
		wg.Add(1)
		go func() { defer wg.Done(); br.Sweeper.SweepOnce(ctx) }()
	}
	wg.Wait()
	// A barrier: an event emitted through each broker's writer after every sweep returned. Each
	// writer appends in order, so once both are in the log, any second stop is there too.
	var barrier []string
	for _, c := range []*client.Client{a.Client, onB} {
		m, err := c.Delegate(ctx, "shared", protocol.MintRequest{Scopes: []string{protocol.ScopeExec}})
		if err != nil {
			t.Fatal(err)
		}
		barrier = append(barrier, m.JTI)
	}
	eventually(t, func() bool {
		seen := 0
		for _, e := range types(history(t, a.Client, "shared"), protocol.EventTokenMinted) {
			if slices.Contains(barrier, e.JTI) {
				seen++
			}
		}
		return seen == len(barrier)
	})
	if n := len(types(history(t, a.Client, "shared"), "stopped")); n != 1 {
		t.Fatalf("want one stopped event from four racing sweeps on two brokers, got %d", n)
	}
	// The stop reached broker A, which hosts the sandbox, even when broker B's sweep did it.
	rec, _ := a.Store.Get(ctx, a.Org, "shared")
	if _, err := a.Manager.Instance(rec); err == nil {
		t.Fatal("the hosting broker still runs a stopped sandbox")
	}
}

// A heartbeat racing the sweep: whichever lands first wins, and a sandbox whose heartbeat
// succeeded is never stopped by that sweep.
func TestHeartbeatRacesSweep(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	ctx := t.Context()
	for i := 0; i < 40; i++ {
		res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "race", TTLSeconds: ttl(1)})
		if err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Second) // at the deadline: warned now, stoppable half a lease later
		b.Sweeper.SweepOnce(ctx)
		clock.Advance(500 * time.Millisecond)
		var hbErr error
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); _, hbErr = b.Client.Heartbeat(ctx, res.Sandbox.ID) }()
		go func() { defer wg.Done(); b.Sweeper.SweepOnce(ctx) }()
		wg.Wait()
		got, _ := b.Client.GetSandbox(ctx, res.Sandbox.ID)
		if hbErr == nil && got.Status != "running" {
			t.Fatalf("round %d: the heartbeat succeeded but the sandbox is %s", i, got.Status)
		}
		if hbErr != nil && got.Status != "stopped" {
			t.Fatalf("round %d: the heartbeat failed (%v) yet the sandbox is %s", i, hbErr, got.Status)
		}
		b.Client.DeleteSandbox(ctx, res.Sandbox.ID)
	}
}

func TestRetentionAndOrphans(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	b := servertest.New(t, servertest.Options{Now: clock.Now})
	ctx := t.Context()
	b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "old", TTLSeconds: ttl(60), Tags: map[string]string{"ci": "1"}})
	b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "fresh", TTLSeconds: ttl(600)})
	clock.Advance(2 * time.Minute)
	o, err := b.Client.Orphans(ctx)
	if err != nil || len(o.Items) != 1 || o.Items[0].Sandbox.Name != "old" {
		t.Fatalf("orphans before the sweep: %v %+v", err, o)
	}
	b.Sweeper.SweepOnce(ctx) // warns; the stop comes a window (half the lease) later
	clock.Advance(30 * time.Second)
	b.Sweeper.SweepOnce(ctx)
	o, _ = b.Client.Orphans(ctx)
	if len(o.Items) != 1 || o.Items[0].Sandbox.Status != "stopped" || len(o.Items[0].Reasons) == 0 {
		t.Fatalf("orphans after the sweep: %+v", o)
	}
	// Retention deletes what has been stopped longer than it, and nothing else.
	clock.Advance(2 * time.Hour)
	b.Client.Heartbeat(ctx, "fresh") // keep fresh's lease
	ret := servertest.RetentionSweeper(b, time.Hour)
	r, err := ret.SweepOnce(ctx)
	if err != nil || r.Deleted != 1 {
		t.Fatalf("retention: %+v %v", r, err)
	}
	if _, err := b.Store.Get(ctx, b.Org, "old"); err != store.ErrNotFound {
		t.Fatalf("old should be gone: %v", err)
	}
}
