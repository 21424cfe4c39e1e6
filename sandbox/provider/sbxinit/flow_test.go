package sbxinit

import (
	"bytes"
	"errors"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// The Mux's rules on a real stream (two pipes), without a sandbox: the provider's gVisor tests
// (gvisor_flow_test.go) hold the same rules end to end through runsc.

// muxPair is the two ends of a stream: host and bridge, each reading the other's frames.
type muxPair struct {
	host, bridge *Mux
	unknown      chan [3]int // frames the bridge discarded: kind, channel, bytes
	errs         chan error  // protocol errors either side's reader met
}

func newMuxPair(t *testing.T) *muxPair {
	t.Helper()
	h2bR, h2bW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	b2hR, b2hW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &muxPair{unknown: make(chan [3]int, 16), errs: make(chan error, 2)}
	p.host = NewMux(NewFrameWriter(h2bW), nil)
	p.bridge = NewMux(NewFrameWriter(b2hW), func(kind byte, ch uint32, n int) { p.unknown <- [3]int{int(kind), int(ch), n} })
	serve := func(m *Mux, r *os.File) {
		buf := make([]byte, MaxFrame)
		for {
			kind, ch, b, err := ReadFrame(r, buf)
			if err == nil {
				_, err = m.Handle(kind, ch, b)
			}
			if err != nil {
				if !errors.Is(err, io.EOF) && !errors.Is(err, os.ErrClosed) {
					p.errs <- err
				}
				m.End()
				return
			}
		}
	}
	go serve(p.bridge, h2bR)
	go serve(p.host, b2hR)
	t.Cleanup(func() {
		h2bW.Close()
		b2hW.Close()
		h2bR.Close()
		b2hR.Close()
	})
	return p
}

// blockedWriter never takes its first write until released.
type blockedWriter struct {
	once    sync.Once
	writing chan struct{}
	release chan struct{}
}

func (w *blockedWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.writing) })
	<-w.release
	return len(p), nil
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

func within(t *testing.T, d time.Duration, done <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("not within %s: %s", d, what)
	}
}

// A channel whose consumer stalls holds its queue to one window and stops nothing else.
func TestMuxStalledChannelStopsNoOther(t *testing.T) {
	p := newMuxPair(t)
	stalled := p.bridge.NewReceiver(1)
	w := &blockedWriter{writing: make(chan struct{}), release: make(chan struct{})}
	defer close(w.release)
	go stalled.Deliver(w)
	sendR, sendW := io.Pipe()
	defer sendW.Close()
	go p.host.NewSender(1, sendR).Pump(sendR)
	go io.Copy(sendW, zeros{})
	<-w.writing

	other := p.bridge.NewReceiver(2)
	var got bytes.Buffer
	done := make(chan struct{})
	var eof bool
	go func() { eof = other.Deliver(&got); close(done) }()
	s := p.host.NewSender(2, nil)
	if _, err := s.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	s.Finish()
	within(t, 10*time.Second, done, "the second channel's data beside a stalled one")
	if !eof || got.String() != "hello" {
		t.Fatalf("second channel: eof %v, %q", eof, got.String())
	}
	stalled.mu.Lock()
	held := stalled.queued + stalled.ungranted
	stalled.mu.Unlock()
	if held > Window {
		t.Fatalf("the stalled channel holds %d bytes, more than its window %d", held, Window)
	}
	select {
	case err := <-p.errs:
		t.Fatal(err)
	default:
	}
}

// A reader that goes away stops its writer, which still ends the channel; what was on its way is
// dropped quietly (it was for the reader that left), not reported as unknown.
func TestMuxCloseStopsWriter(t *testing.T) {
	p := newMuxPair(t)
	r := p.bridge.NewReceiver(3)
	s := p.host.NewSender(3, nil)
	failing := writerFunc(func([]byte) (int, error) { return 0, errors.New("gone") })
	delivered := make(chan bool, 1)
	go func() { delivered <- r.Deliver(failing) }()
	written := make(chan error, 1)
	go func() {
		for {
			if _, err := s.Write(bytes.Repeat([]byte("x"), 4096)); err != nil {
				written <- err
				return
			}
		}
	}()
	select {
	case err := <-written:
		if !errors.Is(err, ErrChannelClosed) {
			t.Fatalf("the writer after its reader left: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the writer did not stop when its reader left")
	}
	if <-delivered {
		t.Fatal("a failed consumer reported the end of file")
	}
	s.Finish()
	// The bridge forgets the channel at the EOF: a later frame on it is unknown, and reported.
	p.host.out.Write(FrameData, 3, []byte("late"))
	select {
	case u := <-p.unknown:
		if u != [3]int{FrameData, 3, 4} {
			t.Fatalf("reported %v", u)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("data for a channel not open was not reported")
	}
	select {
	case u := <-p.unknown:
		t.Fatalf("frames on their way to a closed channel were reported as unknown: %v", u)
	default:
	}
}

// Data past a channel's window is the peer breaking the protocol: an error, never queued.
func TestMuxWindowIsEnforced(t *testing.T) {
	p := newMuxPair(t)
	p.bridge.NewReceiver(4) // never consumed
	chunkOf := []byte(strings.Repeat("y", chunk))
	for sent := 0; sent <= Window; sent += chunk {
		if err := p.host.out.Write(FrameData, 4, chunkOf); err != nil {
			break // the bridge's reader ended at the violation
		}
	}
	select {
	case err := <-p.errs:
		if !strings.Contains(err.Error(), "beyond its window") {
			t.Fatalf("got %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("data past the window was taken")
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
