package server

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/sbxbroker/broker/tests/wait"
)

// TestAheadPipeCarriesTheStreamThroughTheRing: bytes come out as they went in, across many
// wraps of a small ring, with writes and reads of odd sizes.
func TestAheadPipeCarriesTheStreamThroughTheRing(t *testing.T) {
	p := newAheadPipe(37)
	want := make([]byte, 100_000)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range want {
		want[i] = byte(rng.Uint32())
	}
	go func() {
		rest := want
		for len(rest) > 0 {
			k := min(len(rest), 1+rng.IntN(90))
			if _, err := p.Write(rest[:k]); err != nil {
				t.Error(err)
				return
			}
			rest = rest[k:]
		}
		p.CloseWrite()
	}()
	got, err := io.ReadAll(readerOnly{p})
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes, %v; want the %d written", len(got), err, len(want))
	}
}

type readerOnly struct{ r io.Reader }

func (r readerOnly) Read(b []byte) (int, error) { return r.r.Read(b) }

// TestAheadPipeBlocksWhenFullAndEnds: a full buffer holds the writer (backpressure) until the
// reader takes bytes; the reader's end makes writes fail; an abort reaches the reader at once.
func TestAheadPipeBlocksWhenFullAndEnds(t *testing.T) {
	p := newAheadPipe(8)
	done := make(chan error, 1)
	go func() { _, err := p.Write(make([]byte, 12)); done <- err }()
	wait.Eventually(t, 10*time.Second, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.n == 8
	}, "the writer filling the buffer")
	select {
	case err := <-done:
		t.Fatalf("a write past the full buffer returned (%v) with nobody reading", err)
	default:
	}
	if n, err := p.Read(make([]byte, 6)); n != 6 || err != nil {
		t.Fatalf("read %d, %v", n, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	stop := errors.New("stopped")
	p.CloseRead(stop)
	if _, err := p.Write([]byte("x")); err != stop {
		t.Fatalf("write after the reader ended: %v, want its error", err)
	}
	q := newAheadPipe(8)
	q.Write([]byte("abc"))
	q.AbortWrite(stop)
	if n, err := q.Read(make([]byte, 8)); n != 0 || err != stop {
		t.Fatalf("read after an abort: %d, %v; want nothing and the abort", n, err)
	}
}
