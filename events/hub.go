package events

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// Hub fans the org streams out to subscribers in this broker: one reader per org stream that has
// subscribers, however many subscribers it has.
//
// Readers do not block on Redis (XREAD BLOCK would hold a pooled connection per followed org, and
// past the pool's size stall every other command of the broker). They read with XRANGE when the
// writer's wake-up for their org arrives on one pub/sub connection (EventsChannel), and every
// feedPoll in case a wake-up was lost (a pub/sub reconnect): the stream stays the one source of
// truth, so nothing is lost or repeated either way.
type Hub struct {
	store *store.Store
	log   *slog.Logger
	mu    sync.Mutex
	orgs  map[string]*orgFeed
	// stopListen ends the wake-up subscription; nil while no org is followed.
	stopListen func()
}

// feedPoll is how often a reader looks at its stream without a wake-up: the delay an event has at
// worst when its wake-up is lost.
const feedPoll = 2 * time.Second

// feedPage is how many events a reader takes per XRANGE.
const feedPage = 256

// NewHub makes a hub; readers start with the first subscriber of an org and stop with the last.
func NewHub(st *store.Store, log *slog.Logger) *Hub {
	return &Hub{store: st, log: log, orgs: map[string]*orgFeed{}}
}

// orgFeed is the reader of one org stream and its subscribers.
type orgFeed struct {
	cancel context.CancelFunc
	subs   map[*Subscription]struct{}
	wake   chan struct{} // a wake-up for the reader (buffered: wake-ups while it reads merge)
}

// Subscription receives one org's events (or one sandbox's) in stream order, each once.
type Subscription struct {
	// C delivers events; it is never closed. Done is closed when the subscription ends: Close,
	// its context ending, or Redis failing during a catch-up (reconnect with the last event id).
	C         chan protocol.Event
	done      chan struct{}
	sandboxID string
	hub       *Hub
	org       string
	ctx       context.Context
	mu        sync.Mutex
	closed    bool
	// live is set while the subscriber keeps up with the hub. Until the first catch-up is over, and
	// whenever the subscriber falls a buffer behind, it is unset and the subscription reads from
	// Redis at the subscriber's own pace instead (catchUp), then goes live again.
	live bool
	// last is the id of the last event delivered: anything at or before it is a duplicate.
	last string
}

// subscriberBuffer is how far a live subscriber may lag before it reads from Redis instead.
const subscriberBuffer = 512

// catchUpPage is how many events one catch-up read takes.
const catchUpPage = 256

// SubscribeOptions choose where a subscription starts.
type SubscribeOptions struct {
	// SandboxID limits the subscription to one sandbox ("" = the whole org).
	SandboxID string
	// After resumes after this event id (an SSE Last-Event-ID): every later event is delivered,
	// once, in order. "" starts with new events (after Backlog).
	After string
	// Backlog, when After is "", first delivers up to this many recent events.
	Backlog int
}

// Subscribe starts a subscription. When opts.After names a position whose successors were trimmed
// from the stream, the first event is a reset: events were lost before what follows.
func (h *Hub) Subscribe(ctx context.Context, org string, opts SubscribeOptions) (*Subscription, error) {
	if opts.After != "" && !validID(opts.After) {
		return nil, badEventID(opts.After)
	}
	s := &Subscription{C: make(chan protocol.Event, subscriberBuffer), done: make(chan struct{}), sandboxID: opts.SandboxID,
		hub: h, org: org, ctx: ctx}
	// Register before reading anything, so nothing that happens meanwhile escapes both the
	// catch-up and the live feed.
	if err := h.add(org, s); err != nil {
		return nil, err
	}
	after := opts.After
	var first []protocol.Event
	switch {
	case after != "":
		reset, from, err := h.trimmedSince(ctx, org, after)
		if err != nil {
			s.Close()
			return nil, err
		}
		if reset != nil {
			first = append(first, *reset)
		}
		after = from
	default:
		recent, end, err := h.recent(ctx, org, opts.Backlog, opts.SandboxID)
		if err != nil {
			s.Close()
			return nil, err
		}
		first, after = recent, end
	}
	for _, e := range first {
		s.C <- e // fits: at most subscriberBuffer-1 events
	}
	go s.catchUp(after)
	return s, nil
}

// Done is closed when the subscription ends.
func (s *Subscription) Done() <-chan struct{} { return s.done }

// catchUp delivers the stream from after to its end, page by page at the subscriber's pace, then
// switches to live events. The switch re-reads under the lock, so events the hub delivered during
// the catch-up (and that the subscription ignored) are not lost.
func (s *Subscription) catchUp(after string) {
	ctx, org := s.ctx, s.org
	for {
		msgs, err := s.hub.store.EventsAfter(ctx, org, after, catchUpPage)
		if err != nil {
			s.Close()
			return
		}
		for _, m := range msgs {
			after = m.ID
			if !s.sendWait(m) {
				return
			}
		}
		if len(msgs) < catchUpPage {
			break
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	msgs, err := s.hub.store.EventsAfter(ctx, org, after, 0)
	if err != nil {
		s.closeLocked()
		return
	}
	s.last = after
	s.live = true
	for _, m := range msgs {
		if e, ok := decode(m); ok {
			s.offerLocked(e)
		}
	}
}

// sendWait delivers a catch-up event, waiting for the subscriber to read.
func (s *Subscription) sendWait(m store.StreamEntry) bool {
	e, ok := decode(m)
	if !ok || (s.sandboxID != "" && e.SandboxID != s.sandboxID) {
		return true
	}
	select {
	case s.C <- e:
		return true
	case <-s.done:
		return false
	case <-s.ctx.Done():
		s.Close()
		return false
	}
}

// trimmedSince says whether events after `after` may have been trimmed from the bounded log, or
// whether `after` lies past the log's end (the stream was recreated, or the caller made the id up),
// and returns the reset event and the position to continue from. A position past the end would
// otherwise swallow every later event, each of which has a smaller id.
//
// Trimming drops the oldest entries; Redis 7.0 does not record their ids (max-deleted-entry-id
// only counts XDEL), so the test is: the position is older than the oldest entry left, and some
// entries were trimmed. (When the position was exactly the last entry trimmed, nothing was lost and
// the reset is a false alarm; it says "may".)
func (h *Hub) trimmedSince(ctx context.Context, org, after string) (*protocol.Event, string, error) {
	info, err := h.store.EventsInfo(ctx, org)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			if after == "0-0" {
				return nil, after, nil
			}
			return aheadReset(after, "0-0"), "0-0", nil
		}
		return nil, "", err
	}
	if last := info.LastGeneratedID; idLess(last, after) {
		return aheadReset(after, last), last, nil
	}
	first := info.FirstID
	if first == "" || info.EntriesAdded <= info.Length || !idLess(after, first) {
		return nil, after, nil
	}
	// The reset carries the id just before the oldest entry left: resuming from it starts there
	// without a second reset.
	return &protocol.Event{ID: before(first), Type: protocol.EventReset, Time: time.Now().UTC(),
		Reason: "the log no longer reaches back to " + after + ": events after it may have been lost; what follows is the oldest that remain"}, before(first), nil
}

// aheadReset is the reset for a position past the log's end: what follows is new events.
func aheadReset(after, end string) *protocol.Event {
	return &protocol.Event{ID: end, Type: protocol.EventReset, Time: time.Now().UTC(),
		Reason: "the log has no event " + clip(after) + " yet: it was reset or the id is not one of its own; what follows is new events"}
}

// before is the stream id just before id.
func before(id string) string {
	ms, seq := splitID(id)
	if seq > 0 {
		return strconv.FormatUint(ms, 10) + "-" + strconv.FormatUint(seq-1, 10)
	}
	return strconv.FormatUint(ms-1, 10) + "-18446744073709551615"
}

// recent returns up to n of the latest events (for one sandbox, or all) and the stream's end, from
// which the subscription continues.
func (h *Hub) recent(ctx context.Context, org string, n int, sandboxID string) ([]protocol.Event, string, error) {
	n = min(n, subscriberBuffer-1)
	// Read more than n when filtering by sandbox: other sandboxes' events share the stream.
	scan := int64(max(n, 1))
	if sandboxID != "" {
		scan = int64(max(n*20, 1))
	}
	msgs, err := h.store.LatestEvents(ctx, org, scan)
	if err != nil {
		return nil, "", err
	}
	end := "0-0"
	if len(msgs) > 0 {
		end = msgs[0].ID
	}
	var out []protocol.Event
	for _, m := range msgs {
		if len(out) == n {
			break
		}
		if e, ok := decode(m); ok && (sandboxID == "" || e.SandboxID == sandboxID) {
			out = append(out, e)
		}
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out, end, nil
}

func decode(m store.StreamEntry) (protocol.Event, bool) {
	var e protocol.Event
	if json.Unmarshal([]byte(m.Data), &e) != nil {
		return e, false
	}
	e.ID = m.ID
	return e, true
}

func (h *Hub) add(org string, s *Subscription) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopListen == nil {
		if err := h.listen(); err != nil {
			return err
		}
	}
	f := h.orgs[org]
	if f == nil {
		// Start the reader at the stream's current end, before the subscriber's catch-up reads:
		// together they leave no gap.
		ctx, cancel := context.WithCancel(context.Background())
		start := "0-0"
		last, err := h.store.LatestEvents(ctx, org, 1)
		if err != nil {
			cancel()
			if len(h.orgs) == 0 {
				h.stopListen()
				h.stopListen = nil
			}
			return err
		}
		if len(last) == 1 {
			start = last[0].ID
		}
		f = &orgFeed{cancel: cancel, subs: map[*Subscription]struct{}{}, wake: make(chan struct{}, 1)}
		h.orgs[org] = f
		go h.read(ctx, org, f, start)
	}
	f.subs[s] = struct{}{}
	return nil
}

// listen subscribes to the writers' wake-ups and hands each to its org's reader. The subscription
// is confirmed before it returns, so a write after it is never missed. Called with h.mu held.
func (h *Hub) listen() error {
	ctx, cancel := context.WithCancel(context.Background())
	// The follow reconnects and resubscribes by itself; wake-ups lost meanwhile are covered by the
	// readers' feedPoll.
	err := h.store.Follow(ctx, store.EventsChannel, func(org string) {
		h.mu.Lock()
		if f := h.orgs[org]; f != nil {
			select {
			case f.wake <- struct{}{}:
			default:
			}
		}
		h.mu.Unlock()
	})
	if err != nil {
		cancel()
		return err
	}
	h.stopListen = cancel
	return nil
}

// read follows one org stream, from the event after `from`, and hands each event to the org's
// subscribers.
func (h *Hub) read(ctx context.Context, org string, f *orgFeed, from string) {
	poll := time.NewTicker(feedPoll)
	defer poll.Stop()
	backoff := 100 * time.Millisecond
	for {
		msgs, err := h.store.EventsAfter(ctx, org, from, feedPage)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			h.log.Warn("event stream read failed; retrying", "org", org, "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(backoff*2, 5*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
		for _, m := range msgs {
			from = m.ID
			if e, ok := decode(m); ok {
				h.deliver(org, f, e)
			}
		}
		if len(msgs) == feedPage {
			continue // more is there already
		}
		select {
		case <-ctx.Done():
			return
		case <-f.wake:
		case <-poll.C:
		}
	}
}

func (h *Hub) deliver(org string, f *orgFeed, e protocol.Event) {
	h.mu.Lock()
	subs := make([]*Subscription, 0, len(f.subs))
	for s := range f.subs {
		subs = append(subs, s)
	}
	h.mu.Unlock()
	for _, s := range subs {
		s.offer(e)
	}
}

// offer delivers a live event unless it is filtered out, a duplicate, or the catch-up is still on
// (which reads it from Redis). A subscriber whose buffer is full is cut off rather than allowed to
// hold up the others.
func (s *Subscription) offer(e protocol.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.live {
		s.offerLocked(e)
	}
}

func (s *Subscription) offerLocked(e protocol.Event) {
	if s.closed || !s.live || (s.last != "" && !idLess(s.last, e.ID)) {
		return
	}
	if s.sandboxID != "" && e.SandboxID != s.sandboxID {
		s.last = e.ID
		return
	}
	select {
	case s.C <- e:
		s.last = e.ID
	default:
		// A buffer behind: stop taking live events and read the rest from Redis at the
		// subscriber's pace. Nobody waits for a slow subscriber, and it loses nothing.
		s.live = false
		go s.catchUp(s.last)
	}
}

// Close ends the subscription.
func (s *Subscription) Close() {
	s.mu.Lock()
	s.closeLocked()
	s.mu.Unlock()
}

func (s *Subscription) closeLocked() {
	if s.closed {
		return
	}
	s.closed = true
	close(s.done)
	h := s.hub
	go func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		f := h.orgs[s.org]
		if f == nil {
			return
		}
		delete(f.subs, s)
		if len(f.subs) == 0 {
			f.cancel()
			delete(h.orgs, s.org)
		}
		if len(h.orgs) == 0 && h.stopListen != nil {
			h.stopListen()
			h.stopListen = nil
		}
	}()
}

// idLess compares stream ids "ms-seq" numerically.
func idLess(a, b string) bool {
	am, as := splitID(a)
	bm, bs := splitID(b)
	return am < bm || (am == bm && as < bs)
}

func splitID(id string) (uint64, uint64) {
	ms, seq, _ := strings.Cut(id, "-")
	m, _ := strconv.ParseUint(ms, 10, 64)
	s, _ := strconv.ParseUint(seq, 10, 64)
	return m, s
}

func validID(id string) bool {
	ms, seq, ok := strings.Cut(id, "-")
	if !ok || len(id) > 42 {
		return false
	}
	_, e1 := strconv.ParseUint(ms, 10, 64)
	_, e2 := strconv.ParseUint(seq, 10, 64)
	return e1 == nil && e2 == nil
}

// badEventID is the answer to a resume position that is no stream id.
func badEventID(id string) error {
	return protocol.Errorf(protocol.CodeInvalidEventID,
		"Last-Event-ID %q is not an event id (two decimal numbers, MS-SEQ, as sent in the stream's id: lines); drop it to start with new events", clip(id))
}

func clip(s string) string {
	if len(s) > 60 {
		s = s[:60]
	}
	return strings.ToValidUTF8(s, "?")
}

// History returns the events after opts.After (or the last opts.Backlog), without following: a
// one-shot read for clients that do not stream. At most subscriberBuffer-1 events.
func (h *Hub) History(ctx context.Context, org string, opts SubscribeOptions) ([]protocol.Event, error) {
	if opts.After == "" {
		out, _, err := h.recent(ctx, org, max(opts.Backlog, 0), opts.SandboxID)
		return out, err
	}
	if !validID(opts.After) {
		return nil, badEventID(opts.After)
	}
	reset, from, err := h.trimmedSince(ctx, org, opts.After)
	if err != nil {
		return nil, err
	}
	var out []protocol.Event
	if reset != nil {
		out = append(out, *reset)
	}
	msgs, err := h.store.EventsAfter(ctx, org, from, subscriberBuffer-1)
	if err != nil {
		return nil, err
	}
	for _, m := range msgs {
		if e, ok := decode(m); ok && (opts.SandboxID == "" || e.SandboxID == opts.SandboxID) {
			out = append(out, e)
		}
	}
	return out, nil
}
