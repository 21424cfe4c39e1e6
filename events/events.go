// Package events is the broker's event log: one Redis stream per org, bounded in length, written by
// lifecycle, delegation, heartbeat and dataplane code through the Sink interface, and read by SSE
// subscribers. It owns the stream keys' contents and the fan-out; it must not decide anything about
// sandboxes.
package events

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// Sink receives events. Emit must not block the caller: it is called on hot paths (every dataplane
// write) and must never slow them down.
type Sink interface {
	Emit(org string, e protocol.Event)
}

// Discard is a Sink that drops everything (tests of packages that do not look at events).
var Discard Sink = discard{}

type discard struct{}

func (discard) Emit(string, protocol.Event) {}

// StreamMaxLen bounds each org's stream (approximately: XADD MAXLEN ~).
const StreamMaxLen = 10000

// Writer appends events to the org streams from one goroutine, in batches, in the order emitted.
type Writer struct {
	rdb     redis.UniversalClient
	log     *slog.Logger
	queue   chan queued
	dropped atomic.Int64
	done    chan struct{}
	// mu orders Emit's send against Close's close of queue: Emits hold it shared (they never block
	// under it), Close exclusively, so no Emit sends on a closed queue.
	mu     sync.RWMutex
	closed bool
}

type queued struct {
	org string
	e   protocol.Event
}

// NewWriter starts a writer; Close flushes it.
func NewWriter(rdb redis.UniversalClient, log *slog.Logger) *Writer {
	w := &Writer{rdb: rdb, log: log, queue: make(chan queued, 8192), done: make(chan struct{})}
	go w.run()
	return w
}

// Emit queues e for org's stream. When the queue is full (Redis down or far behind) the event is
// dropped and counted; the caller is never blocked.
func (w *Writer) Emit(org string, e protocol.Event) {
	if e.Time.IsZero() {
		e.Time = time.Now().UTC()
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.closed {
		// A straggler of a slow shutdown (a dataplane call finishing after the writer closed):
		// dropped and counted, like an event that finds the queue full.
		if w.dropped.Add(1)%1000 == 1 {
			w.log.Warn("event emitted after the event log closed: dropped", "type", e.Type, "dropped_total", w.dropped.Load())
		}
		return
	}
	select {
	case w.queue <- queued{org, e}:
	default:
		if w.dropped.Add(1)%1000 == 1 {
			w.log.Warn("event queue full: dropping events", "dropped_total", w.dropped.Load())
		}
	}
}

// Close writes what is queued and stops the writer. Later Emits are dropped (and counted); a second
// Close waits like the first.
func (w *Writer) Close() {
	w.mu.Lock()
	if !w.closed {
		w.closed = true
		close(w.queue)
	}
	w.mu.Unlock()
	<-w.done
}

func (w *Writer) run() {
	defer close(w.done)
	batch := make([]queued, 0, 256)
	for q := range w.queue {
		batch = append(batch[:0], q)
	fill:
		for len(batch) < cap(batch) {
			select {
			case q, ok := <-w.queue:
				if !ok {
					break fill
				}
				batch = append(batch, q)
			default:
				break fill
			}
		}
		w.write(batch)
	}
}

func (w *Writer) write(batch []queued) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	pending := batch
	appended := map[string]bool{}
	for attempt := 0; ; attempt++ {
		pipe := w.rdb.Pipeline()
		cmds := make([]*redis.StringCmd, len(pending))
		for i, q := range pending {
			data, _ := json.Marshal(q.e)
			cmds[i] = pipe.XAdd(ctx, &redis.XAddArgs{
				Stream: store.EventsKey(q.org), MaxLen: StreamMaxLen, Approx: true, Values: []any{"data", data}})
		}
		_, err := pipe.Exec(ctx)
		// Retry only the events that were not appended: the others would be appended twice.
		failed := pending[:0:0]
		for i, c := range cmds {
			if c.Err() != nil {
				failed = append(failed, pending[i])
			} else {
				appended[pending[i].org] = true
			}
		}
		pending = failed
		if len(pending) == 0 {
			break
		}
		if attempt == 2 || ctx.Err() != nil {
			w.log.Error("event log write failed: events lost", "events", len(pending), "err", err)
			w.dropped.Add(int64(len(pending)))
			break
		}
		time.Sleep(100 * time.Millisecond << attempt)
	}
	w.wake(ctx, appended)
}

// wake tells every broker's event readers which org streams grew (store.EventsChannel). It is sent
// after the appends have returned: on Cluster a pipeline's commands run on several nodes at once, and
// a wake-up that overtook its append would find nothing new. A lost wake-up delays events by the
// readers' poll interval at most.
func (w *Writer) wake(ctx context.Context, orgs map[string]bool) {
	if len(orgs) == 0 {
		return
	}
	pipe := w.rdb.Pipeline()
	for org := range orgs {
		pipe.Publish(ctx, store.EventsChannel, org)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		w.log.Warn("event wake-up failed; readers will find the events on their next poll", "err", err)
	}
}

// Dropped is how many events were lost: queue full, Redis failing past the retries, or emitted
// after Close.
func (w *Writer) Dropped() int64 { return w.dropped.Load() }
