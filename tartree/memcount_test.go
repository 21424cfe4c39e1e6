package tartree_test

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"runtime"
	"testing"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/tartree"
)

// heapMeter measures, at its last Grow, the heap the extraction holds beyond what it held at its
// first: everything remembered up to then is live, and nothing else of the extraction grows.
type heapMeter struct {
	held, heldAt, grows, last int64
	base, at                  uint64
}

func (m *heapMeter) Grow(n int64) error {
	m.grows++
	if m.grows == 1 || m.grows == m.last {
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		if m.grows == 1 {
			m.base = ms.HeapAlloc
		} else {
			m.at, m.heldAt = ms.HeapAlloc, m.held
		}
	}
	m.held += n
	return nil
}

func (m *heapMeter) Shrink(n int64) { m.held -= n }

// What an extraction remembers of each directory (its mode and mtime to set at the end, its index)
// is drawn from the caller's budget with its name, not its name alone: an archive of many short
// directory names made an extraction hold several times what it drew, and so one org's untars
// held several times the share of the broker's op memory budget they were given.
func TestExtractDrawsWhatItRemembersOfEachDirectory(t *testing.T) {
	const n = 10_000
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := range n {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("d%05d/", i), Mode: 0o755}); err != nil {
			t.Fatal(err)
		}
	}
	tw.Close()
	dest, err := os.OpenRoot(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dest.Close()
	m := &heapMeter{last: n}
	if _, err := tartree.Extract(membudget.With(t.Context(), m), dest, bytes.NewReader(buf.Bytes()), tartree.ExtractOptions{}); err != nil {
		t.Fatal(err)
	}
	grown := int64(m.at) - int64(m.base)
	t.Logf("%d directories: the heap grew %d bytes (%d each), %d were drawn (%d each)", n, grown, grown/n, m.heldAt, m.heldAt/n)
	if m.heldAt < grown {
		t.Fatalf("an extraction remembering %d directories held %d bytes more and drew %d: the budget under-counts it", n-1, grown, m.heldAt)
	}
	if m.held != 0 {
		t.Fatalf("the extraction holds %d of its budget after it returned", m.held)
	}
}

// peakMeter records the most an operation drew at once.
type peakMeter struct{ held, peak int64 }

func (m *peakMeter) Grow(n int64) error { m.held += n; m.peak = max(m.peak, m.held); return nil }
func (m *peakMeter) Shrink(n int64)     { m.held -= n }

// A tar walk holds its copy buffer (256 KiB) from its start to its end, whatever the tree: it is
// drawn with the names. A client may have two tars on each of its connections, each waiting for it
// to read, and the buffers of one org's were counted nowhere.
func TestAddDrawsItsCopyBuffer(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(dir+"/f", []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	m := &peakMeter{}
	if _, err := tartree.Add(membudget.With(t.Context(), m), tar.NewWriter(io.Discard), root, ".", "tree"); err != nil {
		t.Fatal(err)
	}
	if m.peak < 256<<10 || m.held != 0 {
		t.Fatalf("a tar of one file drew %d at its peak and holds %d after it, want its 256 KiB buffer and then nothing", m.peak, m.held)
	}
}
