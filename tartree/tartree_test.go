package tartree_test

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

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
			defer tartree.BeforeDirOpen(func(rel string) {
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
