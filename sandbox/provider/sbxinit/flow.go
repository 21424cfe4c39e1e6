package sbxinit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
)

// Flow control on the bridge's stream. Every command's stdio shares the one stream, so the side
// that reads it must never wait for one channel's consumer: a command whose output nobody reads,
// or one that never reads its stdin, would stop every other command of the sandbox. Instead each
// channel has a window: its writer may have at most Window bytes sent and not yet given back, and
// its reader gives bytes back (FrameCredit) as its consumer takes them. A channel's queue on the
// reading side therefore never holds more than Window bytes, the stream's reader only ever appends
// to it, and a stalled consumer stalls its own channel's writer and nothing else.
//
// Both ends of the stream (the relay on the host, the bridge in the sandbox) use the same Mux: each
// side is a Sender on the channels it writes and a Receiver on those it reads; a terminal's channel
// is both, one per direction.

// Window is how many bytes of one channel's data may be in flight: sent and not yet given back with
// FrameCredit. Both sides know it; a channel starts with this much credit.
const Window = 128 << 10

// grantAt: a receiver gives credit back once this much was consumed, not after every frame, so a
// small exchange (an `echo`) costs no credit frame at all. A writer waits only with no credit left,
// and then the reader has at least grantAt unreturned once it drained its queue, so it always
// grants: no channel can wait on itself.
const grantAt = Window / 2

// ErrChannelClosed is a Sender's write after its reader went away (FrameClose) or the stream ended.
var ErrChannelClosed = errors.New("bridge channel closed by its reader")

// Mux is one end's channels on the bridge's stream: it sends their data through out within each
// channel's credit, and takes the peer's channel frames (Handle) without ever blocking on a
// consumer.
type Mux struct {
	out *FrameWriter
	// unknown is told of data or an end of file for a channel this side does not have. That is
	// never expected (a channel is opened before its first frame can arrive, and kept until its
	// writer's FrameEOF), so it is a defect to surface: a dropped end of file once hid a hang.
	unknown func(kind byte, ch uint32, n int)

	mu      sync.Mutex
	senders map[uint32]*Sender
	recvs   map[uint32]*Receiver
	ended   bool
}

// NewMux sends its channels' frames through out; unknown is told of the peer's frames for a
// channel this side does not have (they are discarded).
func NewMux(out *FrameWriter, unknown func(kind byte, ch uint32, n int)) *Mux {
	return &Mux{out: out, unknown: unknown, senders: make(map[uint32]*Sender), recvs: make(map[uint32]*Receiver)}
}

// Open counts the channels open on this side (a terminal's, both ways, once): those it writes, and
// those it reads, including one whose consumer is gone but whose writer has not yet sent its
// FrameEOF. What its queues hold is at most Open times Window. A closed channel holds no data but
// stays registered until that FrameEOF (so that what was on its way is dropped quietly); counted, a
// peer that never sends it cannot grow this side's table past the bound its user enforces with
// Open.
func (m *Mux) Open() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := len(m.recvs)
	for ch := range m.senders {
		if m.recvs[ch] == nil {
			n++
		}
	}
	return n
}

// Has reports whether ch is open on this side, either way: a channel the peer names for a new one
// must not be (opening it again would orphan the one there, never ended).
func (m *Mux) Has(ch uint32) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.senders[ch] != nil || m.recvs[ch] != nil
}

// Handle takes one of the peer's channel frames (FrameData, FrameEOF, FrameClose, FrameCredit) and
// answers whether kind was one. It never waits for a consumer. An error is the peer breaking the
// protocol (data beyond a window, credit beyond it): nothing on the stream can be trusted after.
func (m *Mux) Handle(kind byte, ch uint32, p []byte) (bool, error) {
	switch kind {
	case FrameData, FrameEOF:
		m.mu.Lock()
		r := m.recvs[ch]
		if r != nil && kind == FrameEOF {
			delete(m.recvs, ch) // its writer is done: nothing more may come on it
		}
		m.mu.Unlock()
		if r == nil {
			if m.unknown != nil {
				m.unknown(kind, ch, len(p))
			}
			return true, nil
		}
		if kind == FrameEOF {
			r.finish()
			return true, nil
		}
		return true, r.push(p)
	case FrameCredit:
		if len(p) != 4 {
			return true, fmt.Errorf("credit frame of %d bytes on channel %d", len(p), ch)
		}
		if s := m.sender(ch); s != nil {
			return true, s.grant(int(binary.BigEndian.Uint32(p)))
		}
		return true, nil // the writer finished while its credit was on the way
	case FrameClose:
		if s := m.sender(ch); s != nil {
			s.stop()
		}
		return true, nil
	}
	return false, nil
}

func (m *Mux) sender(ch uint32) *Sender {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.senders[ch]
}

// End ends every channel: the stream is gone. Senders stop; receivers deliver what they hold and
// return.
func (m *Mux) End() {
	m.mu.Lock()
	m.ended = true
	senders, recvs := m.senders, m.recvs
	m.senders, m.recvs = map[uint32]*Sender{}, map[uint32]*Receiver{}
	m.mu.Unlock()
	for _, s := range senders {
		s.stop()
	}
	for _, r := range recvs {
		r.end()
	}
}

// Drop forgets the channel this side reads as ch at once, without waiting for its writer's end of
// file: the peer has said it sends nothing more on it (a terminal the host let go).
func (m *Mux) Drop(ch uint32) {
	m.mu.Lock()
	r := m.recvs[ch]
	delete(m.recvs, ch)
	m.mu.Unlock()
	if r != nil {
		r.end()
	}
}

// Sender is the writing side of one channel.
type Sender struct {
	m  *Mux
	ch uint32
	// closer is closed when the reader goes away (FrameClose) or the stream ends, so that a Read
	// blocked on the source returns (and, in the sandbox, the command's next write fails with
	// EPIPE as on the host).
	closer io.Closer

	mu      sync.Mutex
	cond    sync.Cond
	credit  int
	stopped bool
	done    bool
}

// NewSender opens ch for writing: register it before the peer can answer on it.
func (m *Mux) NewSender(ch uint32, closer io.Closer) *Sender {
	s := &Sender{m: m, ch: ch, closer: closer, credit: Window}
	s.cond.L = &s.mu
	m.mu.Lock()
	if m.ended {
		s.stopped = true
	} else {
		m.senders[ch] = s
	}
	m.mu.Unlock()
	return s
}

// Write sends p as data frames, each as large as the credit allows, waiting for credit when there
// is none. Only this channel waits.
func (s *Sender) Write(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		s.mu.Lock()
		for s.credit == 0 && !s.stopped {
			s.cond.Wait()
		}
		if s.stopped {
			s.mu.Unlock()
			return n, ErrChannelClosed
		}
		k := min(len(p)-n, s.credit, chunk)
		s.credit -= k
		s.mu.Unlock()
		if err := s.m.out.Write(FrameData, s.ch, p[n:n+k]); err != nil {
			return n, err
		}
		n += k
	}
	return n, nil
}

// Pump copies r to the channel until r ends or fails, the reader goes away, or the stream fails,
// then ends the channel with its FrameEOF. It is the one copy loop of both sides: a command's
// output in the sandbox, a command's stdin on the host.
func (s *Sender) Pump(r io.Reader) {
	buf := make([]byte, chunk)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if _, werr := s.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	s.Finish()
}

// Finish ends the channel with its FrameEOF (once): its reader forgets it when it arrives.
func (s *Sender) Finish() {
	if s.end() {
		s.m.out.Write(FrameEOF, s.ch, nil)
	}
}

// Abandon ends the channel without a FrameEOF, when the writer has told its peer otherwise that
// nothing more comes (a terminal's FrameClose from the host).
func (s *Sender) Abandon() { s.end() }

func (s *Sender) end() (first bool) {
	s.m.mu.Lock()
	if s.m.senders[s.ch] == s {
		delete(s.m.senders, s.ch)
	}
	s.m.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	first = !s.done
	s.done, s.stopped = true, true
	s.cond.Broadcast()
	return first
}

func (s *Sender) grant(n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n <= 0 || s.credit+n > Window {
		return fmt.Errorf("credit of %d on channel %d, which has %d of a %d window", n, s.ch, s.credit, Window)
	}
	s.credit += n
	s.cond.Broadcast()
	return nil
}

// Stop ends the writer as its reader's FrameClose does: a Write waiting for credit returns, the
// source (closer) is closed, and Pump ends the channel with its FrameEOF after any frame it had on
// its way. For a writer whose reader will never take the rest (its command has exited).
func (s *Sender) Stop() { s.stop() }

func (s *Sender) stop() {
	s.mu.Lock()
	s.stopped = true
	s.cond.Broadcast()
	s.mu.Unlock()
	if s.closer != nil {
		s.closer.Close()
	}
}

// Receiver is the reading side of one channel: the stream's reader queues its data, its consumer
// (Deliver) writes it out and gives credit back.
type Receiver struct {
	m  *Mux
	ch uint32

	mu sync.Mutex
	// q is the data queued, in one buffer: the window counts payload bytes, so a slice per frame
	// would let a peer that sends one-byte frames make a window cost some 32 times its size.
	q []byte
	// queued is what q holds and Deliver has taken but not yet written; ungranted is what was
	// written and not yet given back. Their sum is what the writer may not exceed (Window).
	queued, ungranted int
	eof               bool // the writer's FrameEOF came: q is the rest
	ended             bool // the stream or Drop ended it: deliver q, then stop
	closed            bool // the consumer is gone: what comes is discarded until the FrameEOF
	wake              chan struct{}
}

// NewReceiver opens ch for reading: register it before the peer can write on it.
func (m *Mux) NewReceiver(ch uint32) *Receiver {
	r := &Receiver{m: m, ch: ch, wake: make(chan struct{}, 1)}
	m.mu.Lock()
	if m.ended {
		r.ended = true
	} else {
		m.recvs[ch] = r
	}
	m.mu.Unlock()
	return r
}

func (r *Receiver) push(p []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(p) == 0 {
		// No writer sends one (Write sends what it has); taken, it would cost a queue slot
		// and count for nothing against the window.
		return fmt.Errorf("channel %d: an empty data frame", r.ch)
	}
	if r.closed {
		return nil // the writer was told to stop (FrameClose); this was on its way
	}
	if r.queued+r.ungranted+len(p) > Window {
		return fmt.Errorf("channel %d: %d bytes beyond its window of %d", r.ch, r.queued+r.ungranted+len(p)-Window, Window)
	}
	r.q = append(r.q, p...)
	r.queued += len(p)
	r.notify()
	return nil
}

func (r *Receiver) notify() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *Receiver) finish() {
	r.mu.Lock()
	r.eof = true
	r.notify()
	r.mu.Unlock()
}

func (r *Receiver) end() {
	r.mu.Lock()
	r.ended = true
	r.notify()
	r.mu.Unlock()
}

// Deliver writes the channel's data to w as it comes, giving credit back as w takes it. It answers
// true once the writer's end of file was reached with everything written; false when w failed (the
// writer is told to stop, and the rest is discarded) or the channel ended without one (the stream
// ended, or Drop).
func (r *Receiver) Deliver(w io.Writer) (eof bool) {
	for {
		r.mu.Lock()
		q := r.q
		r.q = nil
		eof, ended := r.eof, r.ended || r.closed
		r.mu.Unlock()
		if len(q) == 0 {
			if eof {
				return true
			}
			if ended {
				return false
			}
			<-r.wake
			continue
		}
		if _, err := w.Write(q); err != nil {
			r.Close()
			return false
		}
		r.consumed(len(q))
	}
}

func (r *Receiver) consumed(n int) {
	r.mu.Lock()
	r.queued -= n
	r.ungranted += n
	g := 0
	if r.ungranted >= grantAt && !r.eof && !r.closed && !r.ended {
		g, r.ungranted = r.ungranted, 0
	}
	r.mu.Unlock()
	if g > 0 {
		r.m.out.Write(FrameCredit, r.ch, binary.BigEndian.AppendUint32(nil, uint32(g)))
	}
}

// Close lets the channel go from this side: the writer is told to stop (FrameClose) and what it had
// on the way is discarded as it comes, until its FrameEOF. It answers whether it told the writer:
// not when the writer had finished, the stream ended, or the channel was closed already.
func (r *Receiver) Close() (told bool) {
	r.mu.Lock()
	told = !r.closed && !r.eof && !r.ended
	r.closed = true
	r.q, r.queued = nil, 0
	r.notify()
	r.mu.Unlock()
	if told {
		r.m.out.Write(FrameClose, r.ch, nil)
	}
	return told
}
