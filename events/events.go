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

// DefaultBuffer bounds the events a writer keeps while Redis is away (about 400 bytes each).
const DefaultBuffer = 20000

// Writer appends events to the org streams from one goroutine, in batches, in the order emitted.
// While Redis is away it keeps up to a buffer of events and writes them, in order, when Redis is
// back; past the buffer it counts what it loses, per sandbox, and writes one gap event each after
// the kept ones, so a pane knows.
type Writer struct {
	store   *store.Store
	log     *slog.Logger
	queue   chan queued
	buffer  int
	dropped atomic.Int64
	done    chan struct{}
	// mu orders Emit's send against Close's close of queue: Emits hold it shared (they never block
	// under it), Close exclusively, so no Emit sends on a closed queue.
	mu     sync.RWMutex
	closed bool

	// overflow counts, per sandbox, events Emit dropped because the queue was full; the writer
	// turns them into gap events like its own losses.
	overMu   sync.Mutex
	overflow map[lostKey]int64

	// closeBy is when Close gives up on what is left (unix ns; 0 until Close): closeWait after it.
	closeBy atomic.Int64

	onWrite func() // a test's hook: a write to Redis starts
}

type queued struct {
	org  string
	e    protocol.Event
	dead bool // lost to make room for another org (pending.evictOverShare); not written
}

// WriterOptions change a writer.
type WriterOptions struct {
	// Buffer is how many events it keeps while Redis is away (0: DefaultBuffer).
	Buffer int
}

// NewWriter starts a writer; Close flushes it.
func NewWriter(st *store.Store, log *slog.Logger) *Writer {
	return NewWriterWithOptions(st, log, WriterOptions{})
}

// NewWriterWithOptions starts a writer with o.
func NewWriterWithOptions(st *store.Store, log *slog.Logger, o WriterOptions) *Writer {
	if o.Buffer <= 0 {
		o.Buffer = DefaultBuffer
	}
	w := &Writer{store: st, log: log, queue: make(chan queued, 8192), buffer: o.Buffer, done: make(chan struct{}),
		overflow: map[lostKey]int64{}}
	go w.run()
	return w
}

// Emit queues e for org's stream. When the queue is full (the writer far behind) the event is
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
	case w.queue <- queued{org: org, e: e}:
	default:
		w.overMu.Lock()
		w.overflow[lostKey{org, e.SandboxID, e.Name}]++
		w.overMu.Unlock()
		if w.dropped.Add(1)%1000 == 1 {
			w.log.Warn("event queue full: dropping events", "dropped_total", w.dropped.Load())
		}
	}
}

// Close writes what is queued and stops the writer. Later Emits are dropped (and counted); a second
// Close waits like the first. With Redis away it tries for closeWait from the first Close, a write
// in flight included, then gives up on what is left (and logs how many).
func (w *Writer) Close() {
	w.mu.Lock()
	if !w.closed {
		w.closed = true
		w.closeBy.Store(time.Now().Add(closeWait).UnixNano())
		close(w.queue)
	}
	w.mu.Unlock()
	<-w.done
}

// givenUp reports whether Close's bound has passed, and how long is left of it otherwise (a long
// time before Close).
func (w *Writer) givenUp() (bool, time.Duration) {
	by := w.closeBy.Load()
	if by == 0 {
		return false, time.Hour
	}
	left := time.Until(time.Unix(0, by))
	return left <= 0, left
}

// closeWait is how long Close keeps trying to write what is buffered while Redis is away.
const closeWait = 5 * time.Second

// batchSize bounds one pipeline.
const batchSize = 256

// linger is how long the writer lets events gather after the first of a batch. Every dataplane write
// emits one, and written one by one each cost a Redis round trip and the wakeups of this goroutine
// and of Redis, on the path of the client's next request; gathered, a busy connection pays them once
// per linger. Panes see events that much later: 20 ms is below what a person watching one notices.
// Measured (broker throughput over 8 s loops, two runs each, interleaved): 4 KiB write+read and
// exec `true` are as fast or faster with 20 ms than with 2 ms, and both slower with none (each
// event its own round trip); Redis's CPU per operation falls with each step.
const linger = 20 * time.Millisecond

// lostKey names the events lost for one sandbox of one org.
type lostKey struct{ org, sandbox, name string }

// pending is the writer's buffer: events not yet written, oldest first, and the count of events
// lost past the buffer per sandbox, in the order they started to be lost. The buffer is shared by
// every org, so an org holds at most a quarter of it while another needs room (the per-org share of
// the broker's other budgets): one whose agents flood events during an outage loses its own newest
// ones, never the others'.
type pending struct {
	log       *slog.Logger
	max       int
	events    []queued // dead ones included until compact
	live      int      // events not dead
	dead      int
	lost      map[lostKey]int64
	lostOrder []lostKey
	held      map[string]int // live events per org, gap events included
	// over holds the orgs whose held is past their share (three at most): the only ones an
	// eviction looks at, so that an add to a full buffer costs the same with thousands of orgs.
	over   map[string]struct{}
	losing map[string]int // lost entries per org: an org losing keeps nothing until its gaps are in
	// newest is, per org, where its newest live event may be (no later one is its), so that
	// evictions scan each position once between compactions.
	newest map[string]int
}

func newPending(log *slog.Logger, max int) *pending {
	return &pending{log: log, max: max, lost: map[lostKey]int64{}, held: map[string]int{}, over: map[string]struct{}{},
		losing: map[string]int{}, newest: map[string]int{}}
}

// share is how many buffered events an org is sure of keeping.
func (p *pending) share() int { return max(p.max/4, 1) }

// hold sets org's count of live events, and whether it is past its share.
func (p *pending) hold(org string, n int) {
	p.held[org] = n
	if n > p.share() {
		p.over[org] = struct{}{}
	} else {
		delete(p.over, org)
	}
}

func (p *pending) add(q queued) {
	p.settle()
	// Later events of a losing org must not overtake the gap that stands for its earlier ones.
	if p.losing[q.org] == 0 && (p.live < p.max || p.held[q.org] < p.share() && p.evictOverShare()) {
		p.keep(q)
		return
	}
	p.lose(lostKey{q.org, q.e.SandboxID, q.e.Name}, 1)
}

func (p *pending) keep(q queued) {
	p.events = append(p.events, q)
	p.live++
	p.hold(q.org, p.held[q.org]+1)
	delete(p.newest, q.org)
}

// evictOverShare makes room in a full buffer by losing the newest event of the org that holds the
// most, when that is more than its share: the org's gap then stands after its kept events, in order.
// An org past its share with nothing but gap events to its name (they cannot go: they stand for
// what it lost) is passed over for the next. The event is marked dead, not removed: removing from
// the middle of a large buffer at each eviction would copy it each time.
func (p *pending) evictOverShare() bool {
	for {
		top := ""
		for org := range p.over {
			if n, ok := p.newest[org]; ok && n < 0 {
				continue // nothing it holds can go
			}
			if top == "" || p.held[org] > p.held[top] {
				top = org
			}
		}
		if top == "" {
			return false
		}
		i := len(p.events) - 1
		if n, ok := p.newest[top]; ok {
			i = min(i, n)
		}
		for ; i >= 0; i-- {
			if q := &p.events[i]; !q.dead && q.org == top && q.e.Type != protocol.EventGap {
				q.dead = true
				p.live--
				p.dead++
				p.hold(top, p.held[top]-1)
				p.newest[top] = i - 1
				p.lose(lostKey{q.org, q.e.SandboxID, q.e.Name}, 1)
				return true
			}
		}
		p.newest[top] = -1
	}
}

// compact drops the dead events, before a write.
func (p *pending) compact() {
	if p.dead == 0 {
		return
	}
	live := p.events[:0]
	for _, q := range p.events {
		if !q.dead {
			live = append(live, q)
		}
	}
	clear(p.events[len(live):]) // let the dropped events' strings go
	p.events, p.dead = live, 0
	clear(p.newest)
}

// recount sets the counts from the events still buffered, all live (after a write took some).
func (p *pending) recount() {
	clear(p.held)
	clear(p.over)
	clear(p.newest)
	for _, q := range p.events {
		p.held[q.org]++
	}
	for org, n := range p.held {
		p.hold(org, n)
	}
	p.live, p.dead = len(p.events), 0
}

func (p *pending) lose(k lostKey, n int64) {
	if _, ok := p.lost[k]; !ok {
		p.lostOrder = append(p.lostOrder, k)
		p.losing[k.org]++
	}
	p.lost[k] += n
}

// takeOverflow moves what Emit dropped into the writer's losses, at the current position.
func (w *Writer) takeOverflow(p *pending) {
	w.overMu.Lock()
	defer w.overMu.Unlock()
	for k, n := range w.overflow {
		p.lose(k, n)
	}
	clear(w.overflow)
}

// settle turns counted losses into gap events once the buffer has room for them: they follow
// every event kept before them and precede every event emitted after. An empty buffer takes them
// all, even more than it holds (losses on more sandboxes than that): waiting for more room than
// there will ever be would keep the gaps out, and every later event of their orgs, for good, and
// the writer would spin on an empty buffer (and its Close never return).
func (p *pending) settle() {
	if len(p.lost) == 0 || p.live > 0 && p.live+len(p.lostOrder) >= p.max {
		return
	}
	var total int64
	for _, k := range p.lostOrder {
		n := p.lost[k]
		total += n
		p.keep(queued{org: k.org, e: protocol.Event{Type: protocol.EventGap, SandboxID: k.sandbox, Name: k.name,
			Time: time.Now().UTC(), Actor: "broker", Missed: &n}})
	}
	clear(p.losing)
	p.log.Warn("events lost while Redis was away: the buffer was full; gap events say how many per sandbox", "lost", total)
	clear(p.lost)
	p.lostOrder = p.lostOrder[:0]
}

func (w *Writer) run() {
	defer close(w.done)
	p := newPending(w.log, w.buffer)
	closed := false
	retry := time.Duration(0)
	for {
		if len(p.events) == 0 && len(p.lost) == 0 {
			if closed {
				return
			}
			q, ok := <-w.queue
			if !ok {
				return
			}
			p.add(q)
			// Let the events that follow this one join its batch (see linger). The queue is not
			// watched meanwhile: a receive would wake this goroutine for each of them.
			time.Sleep(linger)
		}
		// Take what else is queued, without waiting.
	drain:
		for !closed {
			select {
			case q, ok := <-w.queue:
				if !ok {
					closed = true
					break drain
				}
				p.add(q)
			default:
				break drain
			}
		}
		w.takeOverflow(p)
		p.settle()
		p.compact()
		n := min(len(p.events), batchSize)
		failed := w.write(p.events[:n])
		rest := append(failed, p.events[n:]...)
		p.events = append(p.events[:0], rest...)
		p.recount()
		if len(failed) == 0 {
			retry = 0
			continue
		}
		if over, _ := w.givenUp(); over {
			w.dropped.Add(int64(len(p.events)))
			w.log.Error("event log unreachable at shutdown: buffered events lost", "events", len(p.events))
			return
		}
		// Redis is away: wait before trying again, taking new events meanwhile.
		retry = min(max(retry*2, 100*time.Millisecond), 2*time.Second)
		t := time.NewTimer(retry)
	wait:
		for {
			select {
			case q, ok := <-w.queue:
				if !ok {
					if !closed {
						closed = true
					}
					// A closed channel is always ready: wait out the timer alone, or Close's bound.
					_, left := w.givenUp()
					select {
					case <-t.C:
					case <-time.After(left):
					}
					break wait
				}
				p.add(q)
			case <-t.C:
				break wait
			}
		}
	}
}

// write appends batch in order and answers the events that were not written, in order, for a
// retry. (Those that were are not retried: they would be written twice. When Redis goes away the
// pipeline's commands fail together, so what is retried is the batch's tail.)
func (w *Writer) write(batch []queued) []queued {
	if w.onWrite != nil {
		w.onWrite()
	}
	// Each write gets 5 s, and none past Close's bound: the client's read of a hung Redis ends
	// at a deadline, not at a cancellation.
	_, left := w.givenUp()
	ctx, cancel := context.WithTimeout(context.Background(), min(5*time.Second, max(left, 0)))
	defer cancel()
	add := make([]store.StreamAppend, len(batch))
	for i, q := range batch {
		data, _ := json.Marshal(q.e)
		add[i] = store.StreamAppend{Org: q.org, Data: data}
	}
	ok, err := w.store.AppendEventsAndWake(ctx, add, StreamMaxLen, store.EventsChannel)
	var failed []queued
	for i, q := range batch {
		if !ok[i] {
			failed = append(failed, q)
		}
	}
	if len(failed) > 0 {
		w.log.Debug("event log write failed; kept for a retry", "events", len(failed), "err", err)
	} else if err != nil {
		w.log.Warn("event wake-up failed; readers will find the events on their next poll", "err", err)
	}
	return failed
}

// Dropped is how many events were lost: queue full, Redis failing past the retries, or emitted
// after Close.
func (w *Writer) Dropped() int64 { return w.dropped.Load() }
