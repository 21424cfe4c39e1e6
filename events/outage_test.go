package events_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
	"github.com/sbxbroker/broker/tests/wait"
)

// streamEvents reads org's whole stream once it holds want entries (or the deadline passes).
func streamEvents(t *testing.T, rdb redis.UniversalClient, org string, want int) []protocol.Event {
	t.Helper()
	var msgs []redis.XMessage
	var err error
	wait.Until(15*time.Second, func() bool {
		msgs, err = rdb.XRange(t.Context(), store.EventsKey(org), "-", "+").Result()
		return err == nil && len(msgs) >= want
	})
	if err != nil {
		t.Fatalf("reading the stream: %v", err)
	}
	out := make([]protocol.Event, 0, len(msgs))
	for _, m := range msgs {
		var e protocol.Event
		json.Unmarshal([]byte(m.Values["data"].(string)), &e)
		out = append(out, e)
	}
	return out
}

// failures counts the event writer's failed writes, from its log: the signal that it has met the
// outage.
type failures struct {
	slog.Handler
	n atomic.Int64
}

func (f *failures) Enabled(context.Context, slog.Level) bool { return true }

func (f *failures) Handle(_ context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, "event log write failed") {
		f.n.Add(1)
	}
	return nil
}

// outageWriter is an event writer with an outage buffer of buffer events over a real redis-server
// (srv, for a test to stop and restart), its client bounded as the broker's is (each call gives up
// within --redis-timeout); failed counts the writes it logs as failed.
func outageWriter(t *testing.T, buffer int) (srv *redistest.Server, rdb redis.UniversalClient, w *events.Writer, failed *failures) {
	t.Helper()
	srv = redistest.Start(t)
	ropts := &redis.UniversalOptions{Addrs: []string{srv.Addr}}
	store.BoundOptions(ropts, 0)
	rdb = redis.NewUniversalClient(ropts)
	t.Cleanup(func() { rdb.Close() })
	st := store.NewWithOptions(rdb, store.Options{Log: quiet})
	t.Cleanup(st.Close)
	failed = &failures{Handler: quiet.Handler()}
	w = events.NewWriterWithOptions(st, slog.New(failed), events.WriterOptions{Buffer: buffer})
	return srv, rdb, w, failed
}

// Events emitted while Redis is down are kept and written, in order, when it is back; past the
// buffer, one gap event per sandbox says how many were lost.
func TestEventsSurviveARedisOutage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name          string
		buffer, emits int
	}{{"within the buffer", 100, 60}, {"past the buffer", 20, 50}} {
		t.Run(tc.name, func(t *testing.T) {
			srv, rdb, w, failed := outageWriter(t, tc.buffer)
			defer w.Close()
			org := "o"
			w.Emit(org, protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: "before"})
			streamEvents(t, rdb, org, 1)
			srv.Stop(t)
			for i := range tc.emits {
				w.Emit(org, protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: fmt.Sprint(i)})
			}
			// The outage: the writer tries, and fails, meanwhile. Two failed writes that start after
			// the last Emit: the write before the second took everything queued (it drains the
			// queue first), so every event above met the outage in the writer's buffer.
			after := failed.n.Load()
			wait.Eventually(t, 15*time.Second, func() bool { return failed.n.Load() >= after+2 }, "two failed writes while Redis is away")
			srv.Restart(t)
			kept := min(tc.buffer, tc.emits)
			want := 1 + kept + 1
			if kept < tc.emits {
				want++ // the gap
			}
			// Once what the writer kept is written, a new event is written after it. (Before that,
			// a full buffer counts it into the gap: nothing overtakes the gap.)
			streamEvents(t, rdb, org, want-1)
			w.Emit(org, protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: "after"})
			got := streamEvents(t, rdb, org, want)
			if len(got) != want {
				t.Fatalf("%d events in the stream, want %d: %+v", len(got), want, got)
			}
			if got[0].Command != "before" || got[len(got)-1].Command != "after" {
				t.Fatalf("first and last: %q %q", got[0].Command, got[len(got)-1].Command)
			}
			for i := range kept {
				if got[1+i].Command != fmt.Sprint(i) {
					t.Fatalf("event %d after the outage: %+v, want command %d (in order)", i, got[1+i], i)
				}
			}
			if kept < tc.emits {
				gap := got[1+kept]
				if gap.Type != protocol.EventGap || gap.SandboxID != "sb_1" || gap.Missed == nil || *gap.Missed != int64(tc.emits-kept) {
					t.Fatalf("after the kept events: %+v, want a gap of %d", gap, tc.emits-kept)
				}
			}
		})
	}
}

// A broker stopping while Redis hangs (a paused server: connections open, nothing answered) gives
// up on the events it still holds closeWait after Close, and counts them lost. It waited for the
// write in flight (up to 5 s), then counted closeWait from when it next looked at its queue and
// tried again (5 s more): 10 s and more, on top of the rest of a broker's shutdown.
func TestCloseWithRedisHungGivesUpInTime(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ropts := &redis.UniversalOptions{Addrs: []string{srv.Addr}}
	store.BoundOptions(ropts, 4*time.Second) // --redis-timeout 4s: each write hangs that long
	raw := redis.NewUniversalClient(ropts)
	t.Cleanup(func() { raw.Close() })
	st := store.NewWithOptions(raw, store.Options{Log: quiet, Timeout: 4 * time.Second})
	t.Cleanup(st.Close)
	w := events.NewWriterWithOptions(st, quiet, events.WriterOptions{})
	w.Emit("o", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: "before"})
	streamEvents(t, raw, "o", 1)
	writing := make(chan struct{}, 1)
	events.OnWrite(w, func() {
		select {
		case writing <- struct{}{}:
		default:
		}
	})
	srv.Pause()
	t.Cleanup(srv.Continue)
	for i := range 10 {
		w.Emit("o", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: fmt.Sprint(i)})
	}
	<-writing // Close comes while a write hangs: the worst moment
	start := time.Now()
	closed := make(chan struct{})
	go func() { w.Close(); close(closed) }()
	// closeWait is 5 s; a second more for the last attempt's own end.
	select {
	case <-closed:
		if took := time.Since(start); took > 7*time.Second {
			t.Fatalf("Close took %v with Redis hung; want closeWait (5 s)", took.Round(time.Millisecond))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Close with Redis hung did not return within 30 s")
	}
	if w.Dropped() != 10 {
		t.Fatalf("dropped %d events, want the 10 still held", w.Dropped())
	}
}

// One org whose agents flood events while Redis is away cannot take the whole buffer from the
// others: an org within its share (a quarter of the buffer) keeps its events, which push out the
// newest of an org past its share; the flooding org's stream says what it lost with a gap, in order.
func TestOneOrgCannotTakeTheOutageBuffer(t *testing.T) {
	t.Parallel()
	const buffer, flood, share = 20, 50, 5
	srv, raw, w, failed := outageWriter(t, buffer)
	defer w.Close()
	w.Emit("flood", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_f", Command: "before"})
	streamEvents(t, raw, "flood", 1)
	srv.Stop(t)
	for i := range flood {
		w.Emit("flood", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_f", Command: fmt.Sprint(i)})
	}
	after := failed.n.Load()
	wait.Eventually(t, 15*time.Second, func() bool { return failed.n.Load() >= after+2 }, "two failed writes while Redis is away")
	for i := range share {
		w.Emit("quiet", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_q", Command: fmt.Sprint(i)})
	}
	after = failed.n.Load()
	wait.Eventually(t, 15*time.Second, func() bool { return failed.n.Load() >= after+2 }, "two failed writes while Redis is away")
	srv.Restart(t)

	got := streamEvents(t, raw, "quiet", share)
	if len(got) != share {
		t.Fatalf("the quiet org's stream after the outage: %+v, want its %d events", got, share)
	}
	for i, e := range got {
		if e.Type != protocol.EventExec || e.Command != fmt.Sprint(i) {
			t.Fatalf("the quiet org's event %d: %+v, want command %d (in order, none lost)", i, e, i)
		}
	}
	kept := buffer - share
	f := streamEvents(t, raw, "flood", 1+kept+1)
	if len(f) != 1+kept+1 {
		t.Fatalf("the flooding org's stream: %d events, want %d: %+v", len(f), 1+kept+1, f)
	}
	for i := range kept {
		if f[1+i].Command != fmt.Sprint(i) {
			t.Fatalf("the flooding org's event %d: %+v, want command %d", i, f[1+i], i)
		}
	}
	if gap := f[1+kept]; gap.Type != protocol.EventGap || gap.Missed == nil || *gap.Missed != flood-int64(kept) {
		t.Fatalf("after the flooding org's kept events: %+v, want a gap of %d", gap, flood-kept)
	}
}

// Losses on more sandboxes than the buffer holds events: once Redis is back and the kept events are
// written, the gaps go in, all of them, and the org's later events follow. Before, the gaps waited
// for a buffer with room for every one of them beside what it held, which an empty buffer of this
// size never has: the writer spun writing nothing, and every later event of the org was counted
// into gaps that were never written.
func TestGapsOfMoreSandboxesThanTheBufferGoIn(t *testing.T) {
	t.Parallel()
	const buffer, sandboxes = 4, 10
	srv, raw, w, failed := outageWriter(t, buffer)
	defer w.Close()
	w.Emit("o", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_x", Command: "before"})
	streamEvents(t, raw, "o", 1)
	srv.Stop(t)
	for i := range sandboxes {
		w.Emit("o", protocol.Event{Type: protocol.EventExec, SandboxID: fmt.Sprint("sb_", i), Command: fmt.Sprint(i)})
	}
	after := failed.n.Load()
	wait.Eventually(t, 15*time.Second, func() bool { return failed.n.Load() >= after+2 }, "two failed writes while Redis is away")
	srv.Restart(t)
	want := 1 + buffer + (sandboxes - buffer)
	got := streamEvents(t, raw, "o", want)
	if len(got) != want {
		t.Fatalf("%d events in the stream after the outage, want %d (the kept ones and a gap per sandbox that lost): %+v", len(got), want, got)
	}
	for i := buffer; i < sandboxes; i++ {
		if e := got[1+i]; e.Type != protocol.EventGap || e.SandboxID != fmt.Sprint("sb_", i) || e.Missed == nil || *e.Missed != 1 {
			t.Fatalf("event %d: %+v, want sb_%d's gap of 1", 1+i, e, i)
		}
	}
	w.Emit("o", protocol.Event{Type: protocol.EventExec, SandboxID: "sb_x", Command: "after"})
	if got := streamEvents(t, raw, "o", want+1); len(got) != want+1 || got[want].Command != "after" {
		t.Fatalf("the event after the gaps: %+v", got)
	}
}
