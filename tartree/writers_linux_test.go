package tartree_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/tartree"
	"github.com/sbxbroker/broker/tests/wait"
)

// files is an archive of dirs directories of n files of size bytes each ("dNN/fNNN").
func files(t *testing.T, dirs, n, size int) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	body := bytes.Repeat([]byte("x"), size)
	for d := range dirs {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("d%02d/", d), Mode: 0o755})
		for f := range n {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("d%02d/f%03d", d, f), Mode: 0o644, Size: int64(size)}); err != nil {
				t.Fatal(err)
			}
			tw.Write(body)
		}
	}
	tw.Close()
	return buf.Bytes()
}

// TestExtractWhileTheSandboxSwapsDirectories: a process in the workspace that keeps moving the
// directories Extract writes into away and putting links out of the workspace (and links to a file
// outside) at their names, while files are queued behind the reading, gets nothing written
// outside: every write is relative to a directory opened without following links, and creates its
// file exclusively.
func TestExtractWhileTheSandboxSwapsDirectories(t *testing.T) {
	a := files(t, 20, 40, 64)
	bothWays(t, func(t *testing.T) {
		for round := range 5 {
			outside := t.TempDir()
			canary := filepath.Join(outside, "canary")
			os.WriteFile(canary, []byte("old"), 0o644)
			dst := t.TempDir()
			stop := make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					// Only real directories are moved (the test itself must not write through a link).
					d := filepath.Join(dst, fmt.Sprintf("d%02d", i%20))
					moved := filepath.Join(dst, fmt.Sprintf("moved-%d", i))
					if fi, err := os.Lstat(d); err != nil || !fi.IsDir() || os.Rename(d, moved) != nil {
						continue
					}
					os.Symlink(outside, d)
					f := filepath.Join(moved, fmt.Sprintf("f%03d", i%40))
					os.Remove(f)
					os.Symlink(canary, f)
				}
			}()
			_, err := tartree.Extract(t.Context(), openRoot(t, dst), bytes.NewReader(a), tartree.ExtractOptions{})
			close(stop)
			wg.Wait()
			if err != nil {
				t.Logf("round %d: %v (an error is fine; writing outside is not)", round, err)
			}
			if left, _ := os.ReadDir(outside); len(left) != 1 {
				t.Fatalf("round %d: written outside the root: %v", round, left)
			}
			if b, _ := os.ReadFile(canary); string(b) != "old" {
				t.Fatalf("round %d: the file outside was written through a link: %q", round, b)
			}
		}
	})
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(es)
}

// cutReader gives the first n bytes of data, then fn's answer (a hang-up, or a cancel and EOF).
type cutReader struct {
	data []byte
	n    int
	fn   func() error
}

func (c *cutReader) Read(p []byte) (int, error) {
	if c.n == 0 {
		return 0, c.fn()
	}
	k := copy(p, c.data[:min(len(p), c.n)])
	c.data, c.n = c.data[k:], c.n-k
	return k, nil
}

// TestExtractCutShortReleasesEverything: a hang-up in the middle of an entry, or the context
// cancelled, while files are queued in many directories, ends Extract with that error, and its
// writers, buffers and directory descriptors are all gone when it returns.
func TestExtractCutShortReleasesEverything(t *testing.T) {
	a := files(t, 40, 50, 3000)
	hangup := errors.New("connection reset by peer")
	for _, c := range []struct {
		name string
		cut  func(cancel context.CancelFunc) error
		want error
	}{
		{"hangup", func(context.CancelFunc) error { return hangup }, hangup},
		{"cancel", func(cancel context.CancelFunc) error { cancel(); return io.ErrUnexpectedEOF }, context.Canceled},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Warm up whatever the runtime and the test start once.
			tartree.Extract(t.Context(), openRoot(t, t.TempDir()), bytes.NewReader(files(t, 2, 2, 10)), tartree.ExtractOptions{})
			goroutines, fds := runtime.NumGoroutine(), openFDs(t)
			held := tartree.BufHeld()
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			dst := t.TempDir()
			root := openRoot(t, dst)
			fds++ // the root
			// Cut in the middle of the 1,500th file's content.
			r := &cutReader{data: a, n: 1500*(512+3584) + 1000, fn: func() error { return c.cut(cancel) }}
			_, err := tartree.Extract(ctx, root, r, tartree.ExtractOptions{})
			if !errors.Is(err, c.want) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
			// Extract returns once every writer is done; a writer may still be between its last
			// deferred call and its exit (runnable in goexit), counted until it is scheduled.
			if !wait.Until(5*time.Second, func() bool { return runtime.NumGoroutine() <= goroutines }) {
				buf := make([]byte, 1<<16)
				t.Fatalf("%d goroutines before, %d after:\n%s", goroutines, runtime.NumGoroutine(), buf[:runtime.Stack(buf, true)])
			}
			if n := openFDs(t); n != fds {
				t.Fatalf("%d descriptors open before, %d after", fds, n)
			}
			if n := tartree.BufHeld(); n != held {
				t.Fatalf("%d bytes of buffers held before, %d after", held, n)
			}
		})
	}
}

// TestExtractHoldsAtMostMaxInFlight: however the archive's files are sized, the buffers the
// writers hold stay within maxInFlight while they are stuck (the reading loop waits instead).
func TestExtractHoldsAtMostMaxInFlight(t *testing.T) {
	for _, size := range []int{1 << 20, 512<<10 + 1} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			a := files(t, 1, 3*tartree.MaxInFlight/size+1, size) // one directory: no flush between files
			gate := make(chan struct{})
			var once sync.Once
			var peak int64
			defer tartree.HoldWrites(gate, func(held int64) {
				peak = max(peak, held)
				once.Do(func() { close(gate) })
			})()
			if _, err := tartree.Extract(t.Context(), openRoot(t, t.TempDir()), bytes.NewReader(a), tartree.ExtractOptions{}); err != nil {
				t.Fatal(err)
			}
			if peak == 0 {
				t.Fatal("the reading loop never waited for room")
			}
			if peak > tartree.MaxInFlight {
				t.Fatalf("%d bytes of buffers held, over the %d bound", peak, tartree.MaxInFlight)
			}
		})
	}
}

// TestExtractOnAFullDisk: a file system that fills up in the middle of the files ends Extract with
// ENOSPC on an entry (what the workspace answers as no space left), and leaves no more partial
// files than writing one file at a time did: at most the one being written.
func TestExtractOnAFullDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	bothWays(t, func(t *testing.T) {
		dst := t.TempDir()
		if err := unix.Mount("tmpfs", dst, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=1m,mode=0755"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(dst, unix.MNT_DETACH) })
		const size = 24 << 10
		_, err := tartree.Extract(t.Context(), openRoot(t, dst), bytes.NewReader(files(t, 8, 16, size)), tartree.ExtractOptions{})
		var ee *tartree.EntryError
		if !errors.As(err, &ee) || !errors.Is(err, unix.ENOSPC) {
			t.Fatalf("err = %v, want an EntryError with ENOSPC", err)
		}
		var partial []string
		filepath.Walk(dst, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.Mode().IsRegular() && fi.Size() != size {
				partial = append(partial, fmt.Sprintf("%s (%d bytes)", p[len(dst):], fi.Size()))
			}
			return nil
		})
		if len(partial) > 1 {
			t.Fatalf("%d partial files left: %v", len(partial), partial)
		}
	})
}

// TestExtractOrderingsAroundQueuedFiles: entries that change what a queued file's name or parent
// is, right after it: a link named like its parent (refused, the file written where the archive
// put it, nothing through the link), a hard link to it (sees it written), and a tree 600
// directories deep with a file at every level (every file written, no descriptor left).
func TestExtractOrderingsAroundQueuedFiles(t *testing.T) {
	bothWays(t, func(t *testing.T) {
		outside := t.TempDir()
		dst := t.TempDir()
		a := archive(t,
			tar.Header{Typeflag: tar.TypeReg, Name: "p/f", Mode: 0o644},
			tar.Header{Typeflag: tar.TypeSymlink, Name: "p", Linkname: outside},
			tar.Header{Typeflag: tar.TypeReg, Name: "p/g", Mode: 0o644},
		)
		_, err := tartree.Extract(t.Context(), openRoot(t, dst), bytes.NewReader(a), tartree.ExtractOptions{})
		if err == nil || !strings.Contains(err.Error(), "p: is a directory") {
			t.Fatalf("a link over a queued file's directory: err = %v", err)
		}
		if left, _ := os.ReadDir(outside); len(left) != 0 {
			t.Fatalf("written through the link: %v", left)
		}
		if b, _ := os.ReadFile(filepath.Join(dst, "p/f")); string(b) != "new" {
			t.Fatalf("p/f = %q", b)
		}

		dst = t.TempDir()
		fds := openFDs(t)
		var hdrs []tar.Header
		name := "d"
		for range 600 {
			hdrs = append(hdrs, tar.Header{Typeflag: tar.TypeReg, Name: name + "/f", Mode: 0o644})
			name += "/d"
		}
		hdrs = append(hdrs, tar.Header{Typeflag: tar.TypeLink, Name: "top", Linkname: name[:len(name)-2] + "/f"})
		root := openRoot(t, dst)
		st, err := tartree.Extract(t.Context(), root, bytes.NewReader(archive(t, hdrs...)), tartree.ExtractOptions{})
		if err != nil || st.Files != 601 {
			t.Fatalf("a deep tree: %+v, %v", st, err)
		}
		if n := openFDs(t); n != fds+1 {
			t.Fatalf("%d descriptors before, %d after (and the root)", fds, n)
		}
		if b, _ := os.ReadFile(filepath.Join(dst, "top")); string(b) != "new" {
			t.Fatalf("top = %q", b)
		}
	})
}
