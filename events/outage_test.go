package events_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/events"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
	"github.com/sbxbroker/broker/store/redistest"
)

// streamEvents reads org's whole stream once it holds want entries (or the deadline passes).
func streamEvents(t *testing.T, rdb redis.UniversalClient, org string, want int) []protocol.Event {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		msgs, err := rdb.XRange(t.Context(), store.EventsKey(org), "-", "+").Result()
		if err == nil && (len(msgs) >= want || time.Now().After(deadline)) {
			out := make([]protocol.Event, 0, len(msgs))
			for _, m := range msgs {
				var e protocol.Event
				json.Unmarshal([]byte(m.Values["data"].(string)), &e)
				out = append(out, e)
			}
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("reading the stream: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
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
			srv := redistest.Start(t)
			// Bounded as the broker's client is (each call gives up within --redis-timeout).
			ropts := &redis.UniversalOptions{Addrs: []string{srv.Addr}}
			store.BoundOptions(ropts, 0)
			raw := redis.NewUniversalClient(ropts)
			t.Cleanup(func() { raw.Close() })
			st := store.NewWithOptions(raw, store.Options{Log: quiet})
			t.Cleanup(st.Close)
			rdb := raw
			w := events.NewWriterWithOptions(st, quiet, events.WriterOptions{Buffer: tc.buffer})
			defer w.Close()
			org := "o"
			w.Emit(org, protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: "before"})
			streamEvents(t, rdb, org, 1)
			srv.Stop(t)
			for i := range tc.emits {
				w.Emit(org, protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: fmt.Sprint(i)})
			}
			time.Sleep(4 * time.Second) // the outage: the writer tries, and fails, meanwhile
			srv.Restart(t)
			w.Emit(org, protocol.Event{Type: protocol.EventExec, SandboxID: "sb_1", Command: "after"})
			kept := min(tc.buffer, tc.emits)
			want := 1 + kept + 1
			if kept < tc.emits {
				want++ // the gap
			}
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
