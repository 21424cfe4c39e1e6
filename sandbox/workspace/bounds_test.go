package workspace

import (
	"context"
	"encoding/json"
	"fmt"
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

// bigDir creates n empty files f000000... in a new directory rel under dir.
func bigDir(t testing.TB, dir, rel string, n int) {
	t.Helper()
	d := filepath.Join(dir, rel)
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for i := range n {
		f, err := os.Create(filepath.Join(d, fmt.Sprintf("f%06d", i)))
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	t.Logf("created %d files in %v", n, time.Since(start))
}

// A directory bigger than the listing cap lists its first names, says truncated, and stops on
// cancel. (Before the cap ls answered every entry: 300,000 of them made a 39 MB answer in 3.8 s.)
// The caps are lowered here, because creating 120,000 files takes some 17 s on a busy machine.
func TestListBounded(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxListEntries: 1000})
	const n = 12_000
	bigDir(t, dir, "big", n)

	start := time.Now()
	res, err := w.ListContext(t.Context(), "big")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(res)
	t.Logf("ls of %d entries: %v, %d entries, %d bytes of JSON", n, time.Since(start), len(res.Entries), len(b))
	if !res.Truncated || len(res.Entries) != 1000 {
		t.Fatalf("ls = %d entries, truncated %v; want 1000, truncated", len(res.Entries), res.Truncated)
	}
	for i, e := range res.Entries { // the first names in sort order, described as usual
		if want := fmt.Sprintf("f%06d", i); e.Name != want || e.Type != protocol.FileTypeFile || e.Path != "/workspace/big/"+want {
			t.Fatalf("entry %d = %+v, want %s", i, e, want)
		}
	}

	// A scan cap under the directory's size: the listing says truncated too.
	w2, err := Open(dir, Options{MaxScanEntries: 1000, MaxListEntries: 5000})
	if err != nil {
		t.Fatal(err)
	}
	defer w2.Close()
	res, err = w2.ListContext(t.Context(), "big")
	if err != nil || !res.Truncated || len(res.Entries) != 1000 {
		t.Fatalf("ls under a scan cap of 1000 = %d entries, truncated %v, %v", len(res.Entries), res.Truncated, err)
	}

	// A small directory is whole.
	put(t, dir, "small/a", "")
	put(t, dir, "small/b", "")
	res, err = w.ListContext(t.Context(), "small")
	if err != nil || res.Truncated || len(res.Entries) != 2 {
		t.Fatalf("ls small = %+v, %v", res, err)
	}

	// Cancelled part way through reading the directory.
	_, err = w.ListContext(newCountdownCtx(3), "big")
	wantCode(t, err, protocol.CodeCancelled, dir)
}

// Glob and grep stop at the entries they may visit and the bytes grep may scan, say truncated, and
// stop on cancel even inside one huge directory.
func TestSearchBounded(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxScanEntries: 1000, MaxGrepScanBytes: 1 << 20})
	bigDir(t, dir, "big", 5000)
	for i := range 8 {
		put(t, dir, fmt.Sprintf("text/t%d", i), strings.Repeat("nothing to see here\n", 256<<10/20))
	}
	put(t, dir, "text/t9", "needle\n")

	g, err := w.GlobContext(t.Context(), protocol.GlobArgs{Pattern: "**/nomatch"})
	if err != nil || !g.Truncated || len(g.Files) != 0 {
		t.Fatalf("glob past the scan cap = %+v, %v; want no match, truncated", g, err)
	}
	g, err = w.GlobContext(t.Context(), protocol.GlobArgs{Pattern: "text/*"})
	if err != nil || g.Truncated || len(g.Files) != 9 {
		t.Fatalf("glob under the scan cap = %d files, truncated %v, %v", len(g.Files), g.Truncated, err)
	}

	r, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "needle", Path: "big"})
	if err != nil || !r.Truncated {
		t.Fatalf("grep past the scan cap = %+v, %v; want truncated", r, err)
	}
	// 8 files of 256 KiB before the needle: the 1 MiB byte budget ends the search first.
	r, err = w.Grep(t.Context(), protocol.GrepArgs{Pattern: "needle", Path: "text"})
	if err != nil || !r.Truncated || len(r.Matches) != 0 {
		t.Fatalf("grep past the byte cap = %+v, %v; want no match, truncated", r, err)
	}
	r, err = w.Grep(t.Context(), protocol.GrepArgs{Pattern: "needle", Path: "text", Glob: "t9"})
	if err != nil || r.Truncated || len(r.Matches) != 1 {
		t.Fatalf("grep under the caps = %+v, %v; want one match", r, err)
	}

	// Cancel is honoured inside one directory, not only between directories.
	w3, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer w3.Close()
	_, err = w3.GlobContext(newCountdownCtx(3), protocol.GlobArgs{Pattern: "big/nomatch*"})
	wantCode(t, err, protocol.CodeCancelled, dir)
	_, err = w3.Grep(newCountdownCtx(3), protocol.GrepArgs{Pattern: "needle", Path: "big"})
	wantCode(t, err, protocol.CodeCancelled, dir)
}
