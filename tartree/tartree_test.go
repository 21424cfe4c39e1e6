package tartree_test

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/membudget/membudgettest"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tartree"
)

func archive(t *testing.T, hdrs ...tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range hdrs {
		body := []byte("new")
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(body))
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write(body)
		}
	}
	tw.Close()
	return buf.Bytes()
}

// TestExtractNeverFollowsExistingLinksOut: links already in the destination that lead out of it
// (planted by a sandbox, or a person's own) are replaced by what the archive has, never written
// through, so the file they point to is untouched.
func TestExtractNeverFollowsExistingLinksOut(t *testing.T) {
	outside := t.TempDir()
	victim := filepath.Join(outside, "victim")
	if err := os.WriteFile(victim, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	dst := t.TempDir()
	os.Symlink(victim, filepath.Join(dst, "f"))
	os.Symlink(outside, filepath.Join(dst, "d"))
	root, err := os.OpenRoot(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	a := archive(t,
		tar.Header{Typeflag: tar.TypeReg, Name: "f", Mode: 0o600},
		tar.Header{Typeflag: tar.TypeReg, Name: "d/victim", Mode: 0o600},
	)
	st, err := tartree.Extract(t.Context(), root, bytes.NewReader(a), tartree.ExtractOptions{})
	if err != nil || st.Files != 2 {
		t.Fatalf("extract: %v %+v", err, st)
	}
	if b, _ := os.ReadFile(victim); string(b) != "old" {
		t.Fatalf("a link in the destination was written through: %q", b)
	}
	for _, p := range []string{"f", "d/victim"} {
		fi, err := os.Lstat(filepath.Join(dst, p))
		if err != nil || !fi.Mode().IsRegular() {
			t.Fatalf("%s: %v %v", p, err, fi)
		}
	}
}

// TestExtractAs renames the archive's top: copying a tree "as" a new name.
func TestExtractAs(t *testing.T) {
	dst := t.TempDir()
	root, _ := os.OpenRoot(dst)
	defer root.Close()
	a := archive(t,
		tar.Header{Typeflag: tar.TypeDir, Name: "proj/", Mode: 0o755},
		tar.Header{Typeflag: tar.TypeReg, Name: "proj/a", Mode: 0o644},
		tar.Header{Typeflag: tar.TypeLink, Name: "proj/b", Linkname: "proj/a"},
	)
	if _, err := tartree.Extract(t.Context(), root, bytes.NewReader(a), tartree.ExtractOptions{As: "copy"}); err != nil {
		t.Fatal(err)
	}
	a1, err1 := os.Stat(filepath.Join(dst, "copy/a"))
	b1, err2 := os.Stat(filepath.Join(dst, "copy/b"))
	if err1 != nil || err2 != nil || !os.SameFile(a1, b1) {
		t.Fatalf("as: %v %v", err1, err2)
	}
	if _, err := os.Stat(filepath.Join(dst, "proj")); err == nil {
		t.Fatal("the original top name was extracted too")
	}
}

// TestExtractRepeatedDirIsRememberedOnce: an archive naming one directory 20,000 times uses no
// disk, so no quota stops it; the broker must keep one entry for it (the last one's mode), not one
// per header, or a stream of repeats grows its memory without bound.
func TestExtractRepeatedDirIsRememberedOnce(t *testing.T) {
	dst := t.TempDir()
	root, err := os.OpenRoot(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	hdrs := make([]tar.Header, 20_000)
	for i := range hdrs {
		hdrs[i] = tar.Header{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755}
	}
	hdrs[len(hdrs)-1].Mode = 0o700
	st, err := tartree.Extract(t.Context(), root, bytes.NewReader(archive(t, hdrs...)), tartree.ExtractOptions{})
	if err != nil || st.Dirs != 1 {
		t.Fatalf("extract: %v, %d directories remembered for one named 20,000 times", err, st.Dirs)
	}
	if fi, err := os.Stat(filepath.Join(dst, "d")); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("d: %v %v, want the last entry's mode 0700", err, fi)
	}
}

// TestExtractRefusesTooManyDirs: past the cap the archive is refused with a clear error.
func TestExtractRefusesTooManyDirs(t *testing.T) {
	defer tartree.SetMaxDirs(3)()
	root, err := os.OpenRoot(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	var hdrs []tar.Header
	for _, n := range []string{"a/", "b/", "c/", "d/", "e/"} {
		hdrs = append(hdrs, tar.Header{Typeflag: tar.TypeDir, Name: n, Mode: 0o755})
	}
	_, err = tartree.Extract(t.Context(), root, bytes.NewReader(archive(t, hdrs...)), tartree.ExtractOptions{})
	if err == nil || !strings.Contains(err.Error(), "more than 3 directories") {
		t.Fatalf("err = %v, want a refusal naming the cap", err)
	}
}

// TestAddStopsAtTheNameLimit: a tree deeper than the longest name the other side accepts is an
// error naming the limit, not a walk as deep as the tree (a sandbox chooses its tree's shape).
func TestAddStopsAtTheNameLimit(t *testing.T) {
	dst := t.TempDir()
	// Level by level through directory fds: the host's own calls refuse paths over PATH_MAX.
	fd, err := unix.Open(dst, unix.O_DIRECTORY|unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("d", 255)
	for range 17 { // 17 × 256 = 4,352 bytes of name
		if err := unix.Mkdirat(fd, long, 0o755); err != nil {
			t.Fatal(err)
		}
		next, err := unix.Openat(fd, long, unix.O_DIRECTORY|unix.O_RDONLY, 0)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		fd = next
	}
	unix.Close(fd)
	root, err := os.OpenRoot(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	tw := tar.NewWriter(io.Discard)
	_, err = tartree.Add(t.Context(), tw, root, long, long)
	if err == nil || !strings.Contains(err.Error(), "over 4096 bytes") {
		t.Fatalf("err = %v, want the name limit", err)
	}
}

// TestAddDirSwappedForFIFOOrLink: a directory the sandbox swaps for a FIFO, or for a link, after Add
// looked at it is never archived as what came in its place: an open for reading of a FIFO would
// wait for a writer for good (the broker's thread and the tar's slot with it), and a link would be
// archived as the directory it leads to. It is an error or skipped.
func TestAddDirSwappedForFIFOOrLink(t *testing.T) {
	for _, swapIn := range []string{"fifo", "link"} {
		t.Run(swapIn, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.MkdirAll(filepath.Join(dir, "d"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.MkdirAll(filepath.Join(dir, "other"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "other", "secret.txt"), []byte("not under d"), 0o644); err != nil {
				t.Fatal(err)
			}
			root, err := os.OpenRoot(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer root.Close()
			defer tartree.AfterLstat(func(rel string) {
				if rel != "d" {
					return
				}
				if err := os.Remove(filepath.Join(dir, "d")); err != nil {
					t.Error(err)
				}
				if swapIn == "fifo" {
					err = unix.Mkfifo(filepath.Join(dir, "d"), 0o644)
				} else {
					err = os.Symlink("other", filepath.Join(dir, "d"))
				}
				if err != nil {
					t.Error(err)
				}
			})()
			done := make(chan error, 1)
			var out bytes.Buffer
			var st tartree.Stats
			go func() {
				var err error
				st, err = tartree.Add(t.Context(), tar.NewWriter(&out), root, "d", "d")
				done <- err
			}()
			select {
			case err = <-done:
			case <-t.Context().Done():
			}
			if err == nil && st.Dirs+st.Files != 0 {
				t.Fatalf("a directory swapped for a %s was archived: %+v", swapIn, st)
			}
			if strings.Contains(out.String(), "not under d") {
				t.Fatalf("the archive holds what the link leads to")
			}
		})
	}
}

// rawBlock is a tar header block built by hand, for the forms archive/tar's writer no longer makes.
func rawBlock(name string, typeflag byte, size int64, magic string, fill func(blk []byte)) []byte {
	blk := make([]byte, 512)
	copy(blk[0:], name)
	copy(blk[100:], "0000644\x00")
	copy(blk[108:], "0000000\x00")
	copy(blk[116:], "0000000\x00")
	copy(blk[124:], fmt.Sprintf("%011o\x00", size))
	copy(blk[136:], "00000000000\x00")
	blk[156] = typeflag
	copy(blk[257:], magic)
	if fill != nil {
		fill(blk)
	}
	copy(blk[148:], "        ")
	sum := 0
	for _, b := range blk {
		sum += int(b)
	}
	copy(blk[148:], fmt.Sprintf("%06o\x00 ", sum))
	return blk
}

func padBlock(b []byte) []byte { return append(b, make([]byte, (512-len(b)%512)%512)...) }

// TestExtractRefusesSparseFiles: a sparse entry (GNU's old 'S' type, or PAX's GNU.sparse records)
// of a kilobyte can declare a terabyte of holes, which archive/tar hands over as zeros: the broker
// would write them all, filling the workspace's disk quota (a sparse image on the host's disk) from
// a few bytes of upload. They are refused, and nothing is written.
func TestExtractRefusesSparseFiles(t *testing.T) {
	const holes = 64 << 20
	gnu := rawBlock("gnu.bin", 'S', 0, "ustar  \x00", func(blk []byte) {
		copy(blk[386:], fmt.Sprintf("%011o\x00", holes)) // one empty fragment, at the end
		copy(blk[398:], "00000000000\x00")
		copy(blk[483:], fmt.Sprintf("%011o\x00", holes)) // the real size
	})
	gnu = append(gnu, make([]byte, 1024)...)

	var records []byte
	for _, kv := range [][2]string{{"GNU.sparse.major", "1"}, {"GNU.sparse.minor", "0"}, {"GNU.sparse.name", "pax.bin"}, {"GNU.sparse.realsize", fmt.Sprint(holes)}} {
		rec := " " + kv[0] + "=" + kv[1] + "\n"
		n := len(rec) + 1
		for len(fmt.Sprint(n))+len(rec) != n {
			n++
		}
		records = append(records, fmt.Sprint(n)+rec...)
	}
	sparseMap := padBlock([]byte(fmt.Sprintf("1\n%d\n0\n", holes)))
	var pax []byte
	pax = append(pax, rawBlock("PaxHeaders/pax.bin", 'x', int64(len(records)), "ustar\x0000", nil)...)
	pax = append(pax, padBlock(records)...)
	pax = append(pax, rawBlock("pax.bin", '0', int64(len(sparseMap)), "ustar\x0000", nil)...)
	pax = append(pax, sparseMap...)
	pax = append(pax, make([]byte, 1024)...)

	for name, a := range map[string][]byte{"gnu.bin": gnu, "pax.bin": pax} {
		t.Run(name, func(t *testing.T) {
			// The archive is what the test means: archive/tar reads it as that many bytes of holes.
			tr := tar.NewReader(bytes.NewReader(a))
			if _, err := tr.Next(); err != nil {
				t.Fatal(err)
			}
			if n, err := io.Copy(io.Discard, tr); err != nil || n != holes {
				t.Fatalf("the archive reads as %d bytes (%v), want %d", n, err, holes)
			}
			dir := t.TempDir()
			root, err := os.OpenRoot(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer root.Close()
			st, err := tartree.Extract(t.Context(), root, bytes.NewReader(a), tartree.ExtractOptions{})
			var pe *protocol.Error
			if !errors.As(err, &pe) || pe.Code != protocol.CodeInvalidArgument || !strings.Contains(pe.Message, "sparse") {
				t.Fatalf("Extract = %+v, %v; want invalid_argument naming the sparse entry", st, err)
			}
			if _, err := os.Lstat(filepath.Join(dir, name)); !os.IsNotExist(err) {
				t.Fatalf("the sparse file was written: %v", err)
			}
		})
	}
}

// TestAddBoundsTheNamesItHolds: a directory's names are read whole (to sort them) while those of
// the directories above it are held: past a bound, Add stops with an error that says to archive
// the parts, instead of holding whatever a sandbox's tree makes it read. Names of a directory done
// are given back, so siblings that each fit do.
func TestAddBoundsTheNamesItHolds(t *testing.T) {
	defer tartree.SetMaxNamesHeld(16 << 10)()
	dir := t.TempDir()
	for _, sub := range []string{"a", "b"} {
		for i := range 300 { // 300 × (10 + 16) bytes: about half the bound each
			p := filepath.Join(dir, "fits", sub, fmt.Sprintf("file-%05d", i))
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range 1000 {
		if err := os.MkdirAll(filepath.Join(dir, "huge", fmt.Sprintf("entry-%05d", i)), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	st, err := tartree.Add(t.Context(), tar.NewWriter(io.Discard), root, "fits", "fits")
	if err != nil || st.Files != 600 {
		t.Fatalf("two directories that each fit: %+v, %v", st, err)
	}
	_, err = tartree.Add(t.Context(), tar.NewWriter(io.Discard), root, "huge", "huge")
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeInvalidArgument || !strings.Contains(pe.Message, "archive its parts") {
		t.Fatalf("a directory past the bound: %v; want invalid_argument saying to archive its parts", err)
	}
}

// TestExtractBoundsTheNamesItRemembers: the directories (for their modes and mtimes at the end) and
// the symlinks (to refuse entries below them) an extraction remembers are bounded in bytes, not
// only in count: a name may be 4096 bytes and a symlink costs the archive only an inode, so an
// archive of long-named ones made the broker hold GBs. Past the bound the archive is refused with
// a clear error; names of links replaced are given back.
func TestExtractBoundsTheNamesItRemembers(t *testing.T) {
	defer tartree.SetMaxNamesRemembered(4 << 10)()
	long := strings.Repeat("n", 250)
	for kind, typeflag := range map[string]byte{"dirs": tar.TypeDir, "symlinks": tar.TypeSymlink} {
		t.Run(kind, func(t *testing.T) {
			root, err := os.OpenRoot(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			defer root.Close()
			var hdrs []tar.Header
			for i := range 40 { // 40 × 266 bytes, past 4 KiB
				hdrs = append(hdrs, tar.Header{Typeflag: typeflag, Name: fmt.Sprintf("%s%02d", long, i), Linkname: "target", Mode: 0o755})
			}
			_, err = tartree.Extract(t.Context(), root, bytes.NewReader(archive(t, hdrs...)), tartree.ExtractOptions{})
			var pe *protocol.Error
			if !errors.As(err, &pe) || pe.Code != protocol.CodeInvalidArgument || !strings.Contains(pe.Message, "copy the tree in parts") {
				t.Fatalf("40 long names: %v; want invalid_argument saying to copy in parts", err)
			}
		})
	}
	// One link replaced 40 times by a file and made again is remembered once.
	root, err := os.OpenRoot(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	var hdrs []tar.Header
	for range 40 {
		hdrs = append(hdrs, tar.Header{Typeflag: tar.TypeSymlink, Name: long, Linkname: "target"}, tar.Header{Typeflag: tar.TypeReg, Name: long})
	}
	if _, err := tartree.Extract(t.Context(), root, bytes.NewReader(archive(t, hdrs...)), tartree.ExtractOptions{}); err != nil {
		t.Fatalf("one name replaced 40 times: %v", err)
	}
}

// TestAddSkipsASubdirectorySwappedForANonDirectory: a directory inside the tree that the sandbox
// swaps for a FIFO or a file after Add looked at it is skipped, as a swapped file is
// (docs/dataplane.md): it ended the whole tar with an error, the rest of the tree unsent.
func TestAddSkipsASubdirectorySwappedForANonDirectory(t *testing.T) {
	for _, swapIn := range []string{"fifo", "file", "link to a file"} {
		t.Run(swapIn, func(t *testing.T) {
			dir := t.TempDir()
			for _, d := range []string{"t/d", "t/e"} {
				if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			for _, f := range []string{"t/e/kept.txt", "t/z.txt"} {
				if err := os.WriteFile(filepath.Join(dir, f), []byte("kept"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			root, err := os.OpenRoot(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer root.Close()
			defer tartree.AfterLstat(func(rel string) {
				if rel != "t/d" {
					return
				}
				p := filepath.Join(dir, "t/d")
				if err := os.Remove(p); err != nil {
					t.Error(err)
				}
				switch swapIn {
				case "fifo":
					err = unix.Mkfifo(p, 0o644)
				case "file":
					err = os.WriteFile(p, []byte("x"), 0o644)
				default:
					err = os.Symlink("z.txt", p)
				}
				if err != nil {
					t.Error(err)
				}
			})()
			var out bytes.Buffer
			st, err := tartree.Add(t.Context(), tar.NewWriter(&out), root, "t", "t")
			if err != nil {
				t.Fatalf("a subdirectory swapped for a %s: %v; want it skipped", swapIn, err)
			}
			if st.Skipped != 1 || st.Files != 2 || st.Dirs != 2 {
				t.Fatalf("stats %+v; want t and t/e, their two files, t/d skipped", st)
			}
		})
	}
}

// TestAddSkipsAFileOrLinkSwappedSinceItsLstat: a file the sandbox swaps for a link out of the tree
// (which the root refuses to open), or a link it swaps for a file (which has no target to read),
// after Add looked at it is skipped, as other swaps are: either ended the whole tar with an error.
func TestAddSkipsAFileOrLinkSwappedSinceItsLstat(t *testing.T) {
	for _, tc := range []struct{ name, entry string }{
		{"file for a link out of the tree", "t/f.txt"},
		{"link for a file", "t/l"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.MkdirAll(filepath.Join(dir, "t"), 0o755); err != nil {
				t.Fatal(err)
			}
			for _, f := range []string{"t/f.txt", "t/z.txt"} {
				if err := os.WriteFile(filepath.Join(dir, f), []byte("kept"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.Symlink("z.txt", filepath.Join(dir, "t/l")); err != nil {
				t.Fatal(err)
			}
			root, err := os.OpenRoot(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer root.Close()
			defer tartree.AfterLstat(func(rel string) {
				if rel != tc.entry {
					return
				}
				p := filepath.Join(dir, rel)
				if err := os.Remove(p); err != nil {
					t.Error(err)
				}
				if rel == "t/f.txt" {
					err = os.Symlink("/etc/passwd", p)
				} else {
					err = os.WriteFile(p, []byte("x"), 0o644)
				}
				if err != nil {
					t.Error(err)
				}
			})()
			var out bytes.Buffer
			st, err := tartree.Add(t.Context(), tar.NewWriter(&out), root, "t", "t")
			if err != nil {
				t.Fatalf("%s: %v; want it skipped", tc.name, err)
			}
			if st.Skipped != 1 || st.Files+st.Symlinks != 2 {
				t.Fatalf("stats %+v; want the swapped entry skipped and the other two archived", st)
			}
			if strings.Contains(out.String(), "root:") {
				t.Fatalf("the archive holds what the link leads to")
			}
		})
	}
}

// TestAddAndExtractDrawOnTheCallersBudget: the names Add holds and Extract remembers are drawn
// from the budget the caller puts in the context (shared, in the broker, by every request), all
// given back by the time they return; one that would pass it stops with the budget's own error.
func TestAddAndExtractDrawOnTheCallersBudget(t *testing.T) {
	dir := t.TempDir()
	for i := range 200 {
		p := filepath.Join(dir, "tree", fmt.Sprintf("d%03d", i%4), fmt.Sprintf("file-%05d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	var out bytes.Buffer
	m := &membudgettest.Meter{Limit: 1 << 20}
	if _, err := tartree.Add(membudget.With(t.Context(), m), tar.NewWriter(&out), root, "tree", "tree"); err != nil {
		t.Fatal(err)
	}
	if m.Peak == 0 || m.Held != 0 {
		t.Fatalf("Add drew %d at its peak and holds %d after it, want some and then nothing", m.Peak, m.Held)
	}
	small := &membudgettest.Meter{Limit: m.Peak / 2}
	if _, err := tartree.Add(membudget.With(t.Context(), small), tar.NewWriter(io.Discard), root, "tree", "tree"); !errors.Is(err, membudgettest.ErrSpent) {
		t.Fatalf("Add past its caller's budget: %v, want the budget's error", err)
	}
	if small.Held != 0 {
		t.Fatalf("a refused Add holds %d after it returns", small.Held)
	}

	dest, err := os.OpenRoot(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dest.Close()
	m = &membudgettest.Meter{Limit: 1 << 20}
	if _, err := tartree.Extract(membudget.With(t.Context(), m), dest, bytes.NewReader(out.Bytes()), tartree.ExtractOptions{}); err != nil {
		t.Fatal(err)
	}
	if m.Peak == 0 || m.Held != 0 {
		t.Fatalf("Extract drew %d at its peak and holds %d after it, want some and then nothing", m.Peak, m.Held)
	}
	dest2, err := os.OpenRoot(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dest2.Close()
	small = &membudgettest.Meter{Limit: m.Peak / 2}
	if _, err := tartree.Extract(membudget.With(t.Context(), small), dest2, bytes.NewReader(out.Bytes()), tartree.ExtractOptions{}); !errors.Is(err, membudgettest.ErrSpent) {
		t.Fatalf("Extract past its caller's budget: %v, want the budget's error", err)
	}
	if small.Held != 0 {
		t.Fatalf("a refused Extract holds %d after it returns", small.Held)
	}
}
