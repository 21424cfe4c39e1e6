package sbxinit

import (
	"io"
	"runtime"
	"testing"
)

// The relay runs the Mux on the host against frames from inside the sandbox: whatever those frames
// are, what the host holds for a channel is bounded by its window, not by how the peer cuts it up.
// These drive Handle directly, as the relay's reader does, with frames no well-behaved writer sends.

// A window of one-byte frames costs about a window of memory, not a slice per frame: the window
// counts payload bytes, so before the queue was one buffer a peer sending 1-byte frames to a
// channel whose consumer stalls held some 32x its window in slice headers and allocations.
func TestMuxTinyFramesHoldAboutTheirWindow(t *testing.T) {
	const channels = 8
	m := NewMux(NewFrameWriter(io.Discard), nil)
	for ch := uint32(1); ch <= channels; ch++ {
		m.NewReceiver(ch) // never consumed
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	one := []byte{'x'}
	for ch := uint32(1); ch <= channels; ch++ {
		for range Window {
			if _, err := m.Handle(FrameData, ch, one); err != nil {
				t.Fatalf("byte within the window refused: %v", err)
			}
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(m)
	held := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	if limit := int64(channels * 4 * Window); held > limit {
		t.Fatalf("%d channels of one-byte frames, each a full window of %d, hold %d bytes (more than %d)",
			channels, Window, held, limit)
	}
}

// An empty data frame is nothing a writer sends (Write sends only what it has), and one took a
// queue slot without counting against the window: a peer could grow a stalled channel's queue
// without bound. It is the peer breaking the protocol.
func TestMuxEmptyDataFrameIsRefused(t *testing.T) {
	m := NewMux(NewFrameWriter(io.Discard), nil)
	m.NewReceiver(1)
	if _, err := m.Handle(FrameData, 1, nil); err == nil {
		t.Fatal("an empty data frame was taken")
	}
}

// A receiver let go (Close) stays registered until its writer's FrameEOF, so that data on its way
// is dropped quietly; a peer that never sends the EOF must not grow the table beyond the bound the
// relay enforces with Open, so Open counts it.
func TestMuxClosedReceiverCountsUntilItsEOF(t *testing.T) {
	m := NewMux(NewFrameWriter(io.Discard), nil)
	r := m.NewReceiver(1)
	r.Close()
	if n := m.Open(); n != 1 {
		t.Fatalf("a closed channel whose writer has not ended: Open %d, want 1", n)
	}
	if _, err := m.Handle(FrameEOF, 1, nil); err != nil {
		t.Fatal(err)
	}
	if n := m.Open(); n != 0 {
		t.Fatalf("after its writer's EOF: Open %d, want 0", n)
	}
}

// A terminal's channel is one channel, both ways; Has sees either way.
func TestMuxOpenCountsATerminalOnce(t *testing.T) {
	m := NewMux(NewFrameWriter(io.Discard), nil)
	const ch = TerminalChannel | 1
	m.NewReceiver(ch)
	m.NewSender(ch, nil)
	m.NewSender(2, nil)
	if n := m.Open(); n != 2 {
		t.Fatalf("a terminal's channel and a stdin's: Open %d, want 2", n)
	}
	if !m.Has(ch) || !m.Has(2) || m.Has(3) {
		t.Fatal("Has is wrong")
	}
}
