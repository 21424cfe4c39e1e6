package events_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
	"github.com/sbxbroker/broker/tests/wait"
)

func TestMain(m *testing.M) { servertest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// A subscriber that was away while 10 events happened reconnects with Last-Event-ID and gets
// exactly those 10, in order, once.
func TestSSEResume(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "pane"})

	// Follow until the first event, remember its id, drop the connection.
	var last string
	sctx, cancel := context.WithCancel(ctx)
	err := b.Client.Events(sctx, client.EventOptions{Ref: "pane", Backlog: 1, Follow: true}, func(e protocol.Event) error {
		last = e.ID
		cancel()
		return nil
	})
	if last == "" {
		t.Fatalf("no first event: %v", err)
	}
	var want []string
	for i := 0; i < 10; i++ {
		m, err := b.Client.Delegate(ctx, "pane", protocol.MintRequest{Scopes: []string{"exec"}})
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, m.JTI)
	}
	// Another sandbox's events share the org stream but not this sandbox's: wait until its
	// created event is in the log (the writer is asynchronous), after all ten.
	b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "other"})
	octx, ocancel := context.WithTimeout(ctx, 10*time.Second)
	defer ocancel()
	b.Client.Events(octx, client.EventOptions{After: last, Follow: true}, func(e protocol.Event) error {
		if e.Type == protocol.EventCreated && e.Name == "other" {
			ocancel()
		}
		return nil
	})
	if errors.Is(octx.Err(), context.DeadlineExceeded) {
		t.Fatal("the other sandbox's created event never reached the org's log")
	}

	var got []protocol.Event
	rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
	defer rcancel()
	b.Client.Events(rctx, client.EventOptions{Ref: "pane", After: last, Follow: true}, func(e protocol.Event) error {
		got = append(got, e)
		if len(got) == len(want) {
			rcancel()
		}
		return nil
	})
	if len(got) != len(want) {
		t.Fatalf("want %d events after %s, got %d: %+v", len(want), last, len(got), got)
	}
	for i, e := range got {
		if e.Type != protocol.EventTokenMinted || e.JTI != want[i] {
			t.Fatalf("event %d: want token_minted %s, got %+v", i, want[i], e)
		}
	}
	// Without following, the same resume returns the same ten and ends.
	var again []protocol.Event
	b.Client.Events(ctx, client.EventOptions{Ref: "pane", After: last}, func(e protocol.Event) error { again = append(again, e); return nil })
	if len(again) != len(want) {
		t.Fatalf("history: got %d", len(again))
	}
}

func emit(t *testing.T, rdb redis.UniversalClient, org string, n int) []string {
	t.Helper()
	var ids []string
	pipe := rdb.Pipeline()
	cmds := make([]*redis.StringCmd, n)
	for i := 0; i < n; i++ {
		data, _ := json.Marshal(protocol.Event{Type: "exec", SandboxID: "sb_x", Command: fmt.Sprint(i)})
		cmds[i] = pipe.XAdd(context.Background(), &redis.XAddArgs{Stream: store.EventsKey(org), MaxLen: events.StreamMaxLen, Approx: true,
			Values: []any{"sandbox_id", "sb_x", "data", data}})
	}
	if _, err := pipe.Exec(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, c := range cmds {
		ids = append(ids, c.Val())
	}
	return ids
}

// storeOf wraps a test's client in a store, closed with the test.
func storeOf(t testing.TB, rdb redis.UniversalClient) *store.Store {
	st := store.New(rdb)
	t.Cleanup(st.Close)
	return st
}

// A position trimmed from the bounded log gets a reset event first, then what remains, in order.
func TestResetWhenTrimmed(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t).Client(t)
	hub := events.NewHub(storeOf(t, rdb), quiet)
	ids := emit(t, rdb, "acme", events.StreamMaxLen+3000)
	sub, err := hub.Subscribe(t.Context(), "acme", events.SubscribeOptions{After: ids[0]})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	first := <-sub.C
	if first.Type != protocol.EventReset || first.ID == "" {
		t.Fatalf("want a reset first, got %+v", first)
	}
	prev := first.ID
	count := 0
	for count < events.StreamMaxLen-200 {
		select {
		case e := <-sub.C:
			if !less(prev, e.ID) {
				t.Fatalf("out of order: %s after %s", e.ID, prev)
			}
			prev = e.ID
			count++
		case <-time.After(5 * time.Second):
			t.Fatalf("stalled after %d events", count)
		}
	}
	if prev > ids[len(ids)-1] && len(prev) == len(ids[len(ids)-1]) {
		t.Fatalf("delivered beyond the end")
	}
	// Resuming from a position still in the log gives no reset.
	sub2, _ := hub.Subscribe(t.Context(), "acme", events.SubscribeOptions{After: ids[len(ids)-2]})
	defer sub2.Close()
	if e := <-sub2.C; e.Type == protocol.EventReset || e.ID != ids[len(ids)-1] {
		t.Fatalf("resume within the log: %+v", e)
	}
}

// A burst bigger than a subscriber's buffer, and a subscriber that does not read at all, hold up
// nobody and lose nothing: a lagging subscription reads from Redis at its own pace, then goes live.
func TestLaggingSubscriber(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t).Client(t)
	hub := events.NewHub(storeOf(t, rdb), quiet)
	ctx := t.Context()
	slow, err := hub.Subscribe(ctx, "acme", events.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	fast, _ := hub.Subscribe(ctx, "acme", events.SubscribeOptions{})
	defer fast.Close()
	wait.Eventually(t, 10*time.Second, func() bool { return events.Live(slow) && events.Live(fast) }, "both subscriptions live")
	ids := emit(t, rdb, "acme", 3000) // one burst, six buffers' worth
	read := func(name string, sub *events.Subscription) {
		for i, want := range ids {
			select {
			case e := <-sub.C:
				if e.ID != want {
					t.Fatalf("%s subscriber: event %d is %s, want %s", name, i, e.ID, want)
				}
			case <-sub.Done():
				t.Fatalf("%s subscriber ended after %d events", name, i)
			case <-time.After(5 * time.Second):
				t.Fatalf("%s subscriber stalled after %d events", name, i)
			}
		}
	}
	read("fast", fast)
	// The slow one read nothing during the burst; it still gets every event, in order, once.
	read("slow", slow)
	more := emit(t, rdb, "acme", 3)
	for _, want := range more {
		if e := <-slow.C; e.ID != want {
			t.Fatalf("after catching up, live: got %s want %s", e.ID, want)
		}
	}
}

func less(a, b string) bool {
	var am, as, bm, bs uint64
	fmt.Sscanf(a, "%d-%d", &am, &as)
	fmt.Sscanf(b, "%d-%d", &bm, &bs)
	return am < bm || (am == bm && as < bs)
}

// Subscribers of many orgs do not hold the broker's Redis pool: with more orgs followed than the
// pool has connections, every org still gets its events promptly and other commands still run.
func TestManyOrgsDoNotExhaustThePool(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	const pool, orgs = 4, 12
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: pool, PoolTimeout: 10 * time.Second})
	defer rdb.Close()
	st := storeOf(t, rdb)
	w := events.NewWriter(st, quiet)
	defer w.Close()
	hub := events.NewHub(st, quiet)
	subs := make([]*events.Subscription, orgs)
	for i := range subs {
		s, err := hub.Subscribe(t.Context(), fmt.Sprintf("org-%d", i), events.SubscribeOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		subs[i] = s
	}
	// Every org's reader is up: each subscription is live and got an event through its reader,
	// which then went back to waiting for the next.
	wait.Eventually(t, 10*time.Second, func() bool {
		for _, s := range subs {
			if !events.Live(s) {
				return false
			}
		}
		return true
	}, "every subscription live")
	for i := range subs {
		w.Emit(fmt.Sprintf("org-%d", i), protocol.Event{Type: protocol.EventCreated, SandboxID: "sb_warmup"})
	}
	for i, s := range subs {
		select {
		case <-s.C:
		case <-time.After(10 * time.Second):
			t.Fatalf("org-%d: the warm-up event did not arrive", i)
		}
	}
	start := time.Now()
	if err := rdb.Ping(t.Context()).Err(); err != nil || time.Since(start) > time.Second {
		t.Fatalf("PING with %d orgs followed on a pool of %d took %s: %v", orgs, pool, time.Since(start), err)
	}
	for i := range subs {
		w.Emit(fmt.Sprintf("org-%d", i), protocol.Event{Type: protocol.EventCreated, SandboxID: fmt.Sprintf("sb_%d", i)})
	}
	for i, s := range subs {
		select {
		case e := <-s.C:
			if e.SandboxID != fmt.Sprintf("sb_%d", i) {
				t.Fatalf("org-%d got %+v", i, e)
			}
		case <-time.After(3 * time.Second):
			t.Fatalf("org-%d: no event within 3s of its write", i)
		}
	}
}

// BenchmarkEventDelivery is one event from Emit to a subscriber of its org: the writer's append and
// wake-up, then the reader's XRANGE.
func BenchmarkEventDelivery(b *testing.B) {
	rdb := redistest.Start(b).Client(b)
	st := storeOf(b, rdb)
	w := events.NewWriter(st, quiet)
	defer w.Close()
	sub, err := events.NewHub(st, quiet).Subscribe(b.Context(), "bench", events.SubscribeOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	if !wait.Until(10*time.Second, func() bool { return events.Live(sub) }) {
		b.Fatal("the subscription did not go live")
	}
	for b.Loop() {
		w.Emit("bench", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1"})
		<-sub.C
	}
}

// Emit after Close (a slow shutdown's stragglers) drops the event and counts it instead of
// panicking on the closed queue; Emits racing Close are safe too, and Close twice is harmless.
func TestWriterEmitAfterClose(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t).Client(t)
	w := events.NewWriter(storeOf(t, rdb), quiet)
	w.Emit("acme", protocol.Event{Type: protocol.EventCreated, SandboxID: "sb_1"})
	var emitters sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < 8; i++ {
		emitters.Add(1)
		go func() {
			defer emitters.Done()
			<-start
			for j := 0; j < 2000; j++ {
				w.Emit("acme", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1"})
			}
		}()
	}
	close(start)
	w.Close()
	emitters.Wait()
	before := w.Dropped()
	w.Emit("acme", protocol.Event{Type: protocol.EventDeleted, SandboxID: "sb_1"})
	if got := w.Dropped(); got != before+1 {
		t.Fatalf("an Emit after Close counted %d drops, want 1", got-before)
	}
	w.Close()
	// What was queued before Close was written.
	if n, err := rdb.XLen(t.Context(), store.EventsKey("acme")).Result(); err != nil || n < 1 {
		t.Fatalf("events queued before Close were not written: %d %v", n, err)
	}
}

// Close writes every event emitted before it, each once and in the order emitted, also those that
// arrive while the writer lingers over a batch's first event, and across orgs.
func TestWriterCloseFlushesInOrder(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t).Client(t)
	w := events.NewWriter(storeOf(t, rdb), quiet)
	const n = 3000 // more than one pipeline's batch
	for i := range n {
		w.Emit([]string{"acme", "beta"}[i%2], protocol.Event{Type: protocol.EventFileWritten, SandboxID: "sb_1", Path: fmt.Sprint(i)})
	}
	w.Close()
	for o, org := range []string{"acme", "beta"} {
		msgs, err := rdb.XRange(t.Context(), store.EventsKey(org), "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(msgs) != n/2 {
			t.Fatalf("%s: %d events written by Close, want %d", org, len(msgs), n/2)
		}
		for j, m := range msgs {
			var e protocol.Event
			if err := json.Unmarshal([]byte(m.Values["data"].(string)), &e); err != nil {
				t.Fatal(err)
			}
			if want := fmt.Sprint(2*j + o); e.Path != want {
				t.Fatalf("%s: event %d is %s, want %s: out of order or repeated", org, j, e.Path, want)
			}
		}
	}
	if d := w.Dropped(); d != 0 {
		t.Fatalf("%d events dropped with Redis up", d)
	}
}
