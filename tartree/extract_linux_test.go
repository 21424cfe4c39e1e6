package tartree_test

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/tartree"
)

// bothWays runs f with Extract writing through open directory descriptors (Linux) and walking
// every name from the os.Root (elsewhere): the two must keep the same promises.
func bothWays(t *testing.T, f func(t *testing.T)) {
	t.Run("dirfd", f)
	t.Run("rootwalk", func(t *testing.T) {
		defer tartree.UseRootWalk()()
		f(t)
	})
}

func openRoot(t *testing.T, dir string) *os.Root {
	t.Helper()
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { root.Close() })
	return root
}

// hookReader runs fn when the stream reaches it, between two entries of an archive.
type hookReader func()

func (h hookReader) Read([]byte) (int, error) { h(); return 0, io.EOF }

// TestExtractDirSwappedForLinkBetweenEntries: a sandbox that replaces a directory Extract is
// writing into by a link out of the workspace, between two of its files, gets nothing written
// through the link: Extract keeps the directory it opened (or walks the name again without
// following links), so the outside stays untouched.
func TestExtractDirSwappedForLinkBetweenEntries(t *testing.T) {
	bothWays(t, func(t *testing.T) {
		outside := t.TempDir()
		dst := t.TempDir()
		root := openRoot(t, dst)
		first := archive(t,
			tar.Header{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755},
			tar.Header{Typeflag: tar.TypeReg, Name: "d/a", Mode: 0o644},
		)
		first = first[:len(first)-1024] // without the end-of-archive blocks
		rest := archive(t,
			tar.Header{Typeflag: tar.TypeReg, Name: "d/b", Mode: 0o644},
			tar.Header{Typeflag: tar.TypeReg, Name: "d/sub/c", Mode: 0o644},
			tar.Header{Typeflag: tar.TypeReg, Name: "e/f", Mode: 0o644},
		)
		swapped := false
		swap := hookReader(func() {
			if swapped {
				return
			}
			swapped = true
			if err := os.Rename(filepath.Join(dst, "d"), filepath.Join(dst, "moved")); err != nil {
				t.Error(err)
			}
			if err := os.Symlink(outside, filepath.Join(dst, "d")); err != nil {
				t.Error(err)
			}
			if err := os.Symlink(outside, filepath.Join(dst, "e")); err != nil {
				t.Error(err)
			}
		})
		_, err := tartree.Extract(t.Context(), root, io.MultiReader(bytes.NewReader(first), swap, bytes.NewReader(rest)), tartree.ExtractOptions{})
		if !swapped {
			t.Fatal("the hook did not run between the entries")
		}
		if err != nil {
			t.Logf("extract: %v (an error is fine; writing outside is not)", err)
		}
		left, _ := os.ReadDir(outside)
		if len(left) != 0 {
			t.Fatalf("files were written through the swapped-in link, outside the root: %v", left)
		}
		if fi, lerr := os.Lstat(filepath.Join(dst, "e")); err == nil && lerr == nil && fi.Mode()&os.ModeSymlink != 0 {
			t.Fatal("e/f went through the link at e instead of replacing it")
		}
	})
}

// TestExtractHostileChangesNothingOutside: the refusals of Extract itself, on both ways of
// writing, each with a clear error and the outside untouched.
func TestExtractHostileChangesNothingOutside(t *testing.T) {
	type ent struct {
		h    tar.Header
		body string
	}
	mk := func(t *testing.T, es ...ent) []byte {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for _, e := range es {
			e.h.Size = int64(len(e.body))
			if e.h.Mode == 0 {
				e.h.Mode = 0o644
			}
			if err := tw.WriteHeader(&e.h); err != nil {
				t.Fatal(err)
			}
			io.WriteString(tw, e.body)
		}
		tw.Close()
		return buf.Bytes()
	}
	bothWays(t, func(t *testing.T) {
		parent := t.TempDir()
		dst := filepath.Join(parent, "dst")
		os.Mkdir(dst, 0o755)
		canary := filepath.Join(parent, "canary")
		os.WriteFile(canary, []byte("old"), 0o644)
		cases := []struct {
			name string
			a    []byte
			want string
		}{
			{"dotdot", mk(t, ent{tar.Header{Typeflag: tar.TypeReg, Name: "../canary"}, "x"}), "climbs out"},
			{"absolute", mk(t, ent{tar.Header{Typeflag: tar.TypeReg, Name: canary}, "x"}), "absolute"},
			{"symlink-then-file", mk(t, ent{tar.Header{Typeflag: tar.TypeSymlink, Name: "l", Linkname: ".."}, ""}, ent{tar.Header{Typeflag: tar.TypeReg, Name: "l/canary"}, "x"}), "symbolic link created earlier"},
			{"symlink-then-deep-file", mk(t, ent{tar.Header{Typeflag: tar.TypeDir, Name: "p/"}, ""}, ent{tar.Header{Typeflag: tar.TypeSymlink, Name: "p/l", Linkname: "../.."}, ""}, ent{tar.Header{Typeflag: tar.TypeReg, Name: "p/l/canary"}, "x"}), "symbolic link created earlier"},
			{"hardlink-out", mk(t, ent{tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "../canary"}, ""}), `hard link to "../canary", which is not in the archive's tree: the name climbs out`},
			{"hardlink-absolute", mk(t, ent{tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: canary}, ""}), "which is not in the archive's tree: the name is absolute"},
			{"hardlink-through-link", mk(t, ent{tar.Header{Typeflag: tar.TypeSymlink, Name: "l2", Linkname: ".."}, ""}, ent{tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "l2/canary"}, ""}), "hard link"},
			{"device", mk(t, ent{tar.Header{Typeflag: tar.TypeChar, Name: "null", Devmajor: 1, Devminor: 3}, ""}), "device nodes"},
			{"fifo", mk(t, ent{tar.Header{Typeflag: tar.TypeFifo, Name: "pipe"}, ""}), "FIFOs"},
			{"control", mk(t, ent{tar.Header{Typeflag: tar.TypeReg, Name: "a\x1bb"}, "x"}), "control characters"},
			{"huge-name", mk(t, ent{tar.Header{Typeflag: tar.TypeReg, Name: strings.Repeat("n", 5000)}, "x"}), "limit is 4096"},
		}
		for _, c := range cases {
			_, err := tartree.Extract(t.Context(), openRoot(t, dst), bytes.NewReader(c.a), tartree.ExtractOptions{})
			if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "<nil>") {
				t.Errorf("%s: err = %v, want %q", c.name, err, c.want)
			}
			if b, _ := os.ReadFile(canary); string(b) != "old" {
				t.Fatalf("%s: the file outside the target was changed: %q", c.name, b)
			}
			if ents, _ := os.ReadDir(parent); len(ents) != 2 {
				t.Fatalf("%s: something appeared beside the target: %v", c.name, ents)
			}
		}
	})
}

// TestExtractKeepsModesTimesAndReplaces: what a push relies on, on both ways of writing: files'
// and directories' modes and mtimes, symlinks as symlinks, hard links, and an existing file, link
// or link-to-a-directory at an entry's name replaced rather than written through.
func TestExtractKeepsModesTimesAndReplaces(t *testing.T) {
	bothWays(t, func(t *testing.T) {
		dst := t.TempDir()
		outside := t.TempDir()
		os.WriteFile(filepath.Join(dst, "old"), []byte("previous content, longer"), 0o600)
		os.Symlink(outside, filepath.Join(dst, "top"))
		mt := time.Date(2021, 5, 6, 7, 8, 9, 0, time.UTC)
		dt := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
		a := archive(t,
			tar.Header{Typeflag: tar.TypeDir, Name: "top/", Mode: 0o750, ModTime: dt},
			tar.Header{Typeflag: tar.TypeDir, Name: "top/sub/", Mode: 0o700, ModTime: dt},
			tar.Header{Typeflag: tar.TypeReg, Name: "top/sub/x", Mode: 0o640, ModTime: mt},
			tar.Header{Typeflag: tar.TypeReg, Name: "top/y", Mode: 0o755, ModTime: mt},
			tar.Header{Typeflag: tar.TypeSymlink, Name: "top/l", Linkname: "sub/x", ModTime: mt},
			tar.Header{Typeflag: tar.TypeLink, Name: "top/sub/hx", Linkname: "top/sub/x"},
			tar.Header{Typeflag: tar.TypeReg, Name: "old", Mode: 0o644, ModTime: mt},
			tar.Header{Typeflag: tar.TypeReg, Name: "deep/a/b/c", Mode: 0o644, ModTime: mt},
		)
		st, err := tartree.Extract(t.Context(), openRoot(t, dst), bytes.NewReader(a), tartree.ExtractOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if st.Files != 5 || st.Dirs != 2 || st.Symlinks != 1 {
			t.Fatalf("stats %+v", st)
		}
		if left, _ := os.ReadDir(outside); len(left) != 0 {
			t.Fatalf("written through the link at top: %v", left)
		}
		for _, c := range []struct {
			p    string
			mode os.FileMode
			mt   time.Time
		}{
			{"top", os.ModeDir | 0o750, dt}, {"top/sub", os.ModeDir | 0o700, dt},
			{"top/sub/x", 0o640, mt}, {"top/y", 0o755, mt}, {"old", 0o644, mt}, {"deep/a/b/c", 0o644, mt},
			{"deep/a", os.ModeDir | 0o755, time.Time{}},
		} {
			fi, err := os.Lstat(filepath.Join(dst, c.p))
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode() != c.mode || (!c.mt.IsZero() && !fi.ModTime().Equal(c.mt)) {
				t.Errorf("%s: %v %v, want %v %v", c.p, fi.Mode(), fi.ModTime(), c.mode, c.mt)
			}
		}
		if b, _ := os.ReadFile(filepath.Join(dst, "old")); string(b) != "new" {
			t.Errorf("old = %q", b)
		}
		if l, _ := os.Readlink(filepath.Join(dst, "top/l")); l != "sub/x" {
			t.Errorf("top/l -> %q", l)
		}
		x, _ := os.Stat(filepath.Join(dst, "top/sub/x"))
		hx, _ := os.Stat(filepath.Join(dst, "top/sub/hx"))
		if x == nil || hx == nil || !os.SameFile(x, hx) {
			t.Error("top/sub/hx is not a hard link of top/sub/x")
		}
	})
}

// BenchmarkExtract unpacks a 2,000-file tree (80 directories of 25 files of 256 B to 32 KiB, the
// shape of the push benchmark's repository) into a new directory each time.
func BenchmarkExtract(b *testing.B) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	body := bytes.Repeat([]byte("0123456789abcdef"), 2048)
	mt := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)
	var size int64
	for d := range 80 {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("repo/d%03d/", d), Mode: 0o755, ModTime: mt})
		for f := range 25 {
			n := 256 << ((d + f) % 8)
			tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("repo/d%03d/f%02d", d, f), Mode: 0o644, Size: int64(n), ModTime: mt})
			tw.Write(body[:n])
			size += int64(n)
		}
	}
	tw.Close()
	data := buf.Bytes()
	for _, way := range []string{"dirfd", "rootwalk"} {
		b.Run(way, func(b *testing.B) {
			if way == "rootwalk" {
				defer tartree.UseRootWalk()()
			}
			b.SetBytes(size)
			for b.Loop() {
				b.StopTimer()
				dir, err := os.MkdirTemp(b.TempDir(), "x")
				if err != nil {
					b.Fatal(err)
				}
				root, err := os.OpenRoot(dir)
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := tartree.Extract(b.Context(), root, bytes.NewReader(data), tartree.ExtractOptions{}); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				root.Close()
				os.RemoveAll(dir)
				b.StartTimer()
			}
		})
	}
}

// TestExtractWritesBehindInOrder: files are written behind the reading of the stream (by a few
// goroutines, writers_linux.go), and the archive's order still decides: a name given twice ends as
// its last entry, a directory made after a file of that name fails as it did, a symbolic link and a
// hard link see the files before them, a file larger than what is held in memory follows the
// small ones before it, and a file that cannot be written stops the extraction with its name.
func TestExtractWritesBehindInOrder(t *testing.T) {
	type ent struct {
		h    tar.Header
		body []byte
	}
	mk := func(t *testing.T, es ...ent) []byte {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for _, e := range es {
			e.h.Size = int64(len(e.body))
			if e.h.Mode == 0 {
				e.h.Mode = 0o644
			}
			if err := tw.WriteHeader(&e.h); err != nil {
				t.Fatal(err)
			}
			tw.Write(e.body)
		}
		tw.Close()
		return buf.Bytes()
	}
	reg := func(name, body string) ent { return ent{tar.Header{Typeflag: tar.TypeReg, Name: name}, []byte(body)} }
	big := bytes.Repeat([]byte("B"), 3<<20) // over maxQueued: written by the reading loop
	bothWays(t, func(t *testing.T) {
		dst := t.TempDir()
		var es []ent
		// Many files in many directories, so that every writer has some, then names again.
		for d := range 20 {
			for f := range 20 {
				es = append(es, reg(fmt.Sprintf("d%02d/f%02d", d, f), fmt.Sprintf("first %d %d", d, f)))
			}
		}
		es = append(es,
			reg("d00/f00", "second"),
			ent{tar.Header{Typeflag: tar.TypeLink, Name: "d01/hard", Linkname: "d00/f00"}, nil},
			ent{tar.Header{Typeflag: tar.TypeSymlink, Name: "d02/f00", Linkname: "f01"}, nil},
			reg("d03/f00", "small, then big"),
			ent{tar.Header{Typeflag: tar.TypeReg, Name: "d03/f00"}, big},
			reg("d04/f00", "then a directory of that name"),
			ent{tar.Header{Typeflag: tar.TypeDir, Name: "d04/f00/", Mode: 0o755}, nil},
		)
		_, err := tartree.Extract(t.Context(), openRoot(t, dst), bytes.NewReader(mk(t, es...)), tartree.ExtractOptions{})
		if err == nil || !strings.Contains(err.Error(), "d04/f00") {
			t.Fatalf("a directory over a file: err = %v, want an error naming d04/f00", err)
		}
		read := func(p string) string { b, _ := os.ReadFile(filepath.Join(dst, p)); return string(b) }
		if read("d00/f00") != "second" || read("d19/f19") != "first 19 19" || read("d01/hard") != "second" {
			t.Fatalf("d00/f00 %q, d19/f19 %q, d01/hard %q", read("d00/f00"), read("d19/f19"), read("d01/hard"))
		}
		if l, _ := os.Readlink(filepath.Join(dst, "d02/f00")); l != "f01" {
			t.Fatalf("d02/f00 -> %q, want the link of the later entry", l)
		}
		if read("d03/f00") != string(big) {
			t.Fatalf("d03/f00 is %d bytes, want the big entry's %d", len(read("d03/f00")), len(big))
		}

		// A file whose name a directory holds: the error names it, and the extraction stops.
		dst = t.TempDir()
		os.MkdirAll(filepath.Join(dst, "a/taken"), 0o755)
		es = []ent{reg("a/one", "1"), reg("a/taken", "x")}
		for f := range 100 {
			es = append(es, reg(fmt.Sprintf("b/f%03d", f), "later"))
		}
		_, err = tartree.Extract(t.Context(), openRoot(t, dst), bytes.NewReader(mk(t, es...)), tartree.ExtractOptions{})
		if err == nil || !strings.Contains(err.Error(), "a/taken") {
			t.Fatalf("a file over a directory: err = %v", err)
		}
		if read("a/one") != "1" {
			t.Fatal("the file before the failing one was not written")
		}
	})
}
