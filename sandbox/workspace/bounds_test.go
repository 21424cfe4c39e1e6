package workspace

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// sparse creates a host file of size bytes that starts with head and is a hole after it: 200 GiB
// of it costs no disk.
func sparse(t testing.TB, dir, rel, head string, size int64) {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, rel))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(head); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
}

// countdownCtx is a context that turns cancelled after its Err has been asked n times, so a test
// proves an operation checks for cancel while it works, not only before it starts.
type countdownCtx struct {
	context.Context
	left atomic.Int64
}

func newCountdownCtx(n int64) *countdownCtx {
	c := &countdownCtx{Context: context.Background()}
	c.left.Store(n)
	return c
}

func (c *countdownCtx) Err() error {
	if c.left.Add(-1) < 0 {
		return context.Canceled
	}
	return nil
}

const hugeSparse = 200 << 30

// A line window deep in a huge file stops at the scan cap with an error that says where it stopped
// and what to do, instead of reading 200 GiB of holes (92 s before the cap).
func TestReadLineWindowScanCap(t *testing.T) {
	w, dir := newWS(t, Options{})
	sparse(t, dir, "huge", "one\ntwo\n", hugeSparse)

	var err error
	within(t, 20*time.Second, func() {
		_, err = w.ReadContext(t.Context(), protocol.ReadArgs{Path: "huge", LineOffset: 1_000_000, LineLimit: 10})
	})
	wantCode(t, err, protocol.CodeTooLarge, dir)
	for _, want := range []string{"64 MiB", "line_offset", "offset"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}

	// A window near the start is answered; the count stops at the cap and says so.
	var res protocol.ReadResult
	within(t, 20*time.Second, func() {
		res, err = w.ReadContext(t.Context(), protocol.ReadArgs{Path: "huge", LineOffset: 1, LineLimit: 1})
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Content != "two\n" || res.Truncated || !res.TotalLinesPartial || res.TotalLines < 2 || res.Size != hugeSparse {
		t.Fatalf("read = %+v, want line two, not truncated, a partial count of at least 2", res)
	}

	// A window that starts inside the cap and runs past it is cut there: truncated.
	w2, dir2 := newWS(t, Options{MaxScanBytes: 1 << 20})
	put(t, dir2, "lines", strings.Repeat("0123456789abcde\n", 1<<17)) // 2 MiB, 131072 lines
	res, err = w2.ReadContext(t.Context(), protocol.ReadArgs{Path: "lines", LineOffset: 10, LineLimit: 100_000})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Truncated || !res.TotalLinesPartial || res.TotalLines != 1<<16 || len(res.Content) != (1<<16-10)*16 {
		t.Fatalf("read = total %d partial %v truncated %v, %d bytes; want cut at 1 MiB (65536 lines)", res.TotalLines, res.TotalLinesPartial, res.Truncated, len(res.Content))
	}
	// Under the cap the count is exact.
	put(t, dir2, "small", "a\nb\nc")
	res, err = w2.ReadContext(t.Context(), protocol.ReadArgs{Path: "small", LineOffset: 1, LineLimit: 1})
	if err != nil || res.TotalLines != 3 || res.TotalLinesPartial || res.Content != "b\n" {
		t.Fatalf("read = %+v, %v; want line b of exactly 3", res, err)
	}
}

// A line-window read checks for cancel as it scans: a client that hangs up or cancels stops it.
func TestReadLineWindowCancel(t *testing.T) {
	// No scan cap to speak of, so only cancel can stop the read.
	w, dir := newWS(t, Options{MaxScanBytes: 1 << 50})
	sparse(t, dir, "huge", "x\n", hugeSparse)

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	var err error
	within(t, 5*time.Second, func() {
		_, err = w.ReadContext(ctx, protocol.ReadArgs{Path: "huge", LineOffset: 5, LineLimit: 1})
	})
	wantCode(t, err, protocol.CodeCancelled, dir)

	// Cancelled after a few chunks: the scan stops there, not at the end of 200 GiB.
	within(t, 5*time.Second, func() {
		_, err = w.ReadContext(newCountdownCtx(10), protocol.ReadArgs{Path: "huge", LineOffset: 5, LineLimit: 1})
	})
	wantCode(t, err, protocol.CodeCancelled, dir)
}
