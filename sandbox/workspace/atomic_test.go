package workspace

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// Readers racing many writers see one writer's whole file or another's, never a mix or a prefix.
func TestConcurrentWritesAreNeverTorn(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	const size = 256 << 10
	content := func(i int) string { return string(bytes.Repeat([]byte{byte('a' + i)}, size)) }
	if _, err := w.Write(protocol.WriteArgs{Path: "f", Content: content(0)}); err != nil {
		t.Fatal(err)
	}

	var writers, readers sync.WaitGroup
	stop := make(chan struct{})
	for i := range 6 {
		writers.Go(func() {
			for range 30 {
				if _, err := w.Write(protocol.WriteArgs{Path: "f", Content: content(i)}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	for range 4 {
		readers.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, err := w.Read(protocol.ReadArgs{Path: "f"})
				if err != nil {
					t.Error(err)
					return
				}
				c := r.Content
				if len(c) != size || c != content(int(c[0]-'a')) {
					t.Errorf("torn read: %d bytes starting %q", len(c), c[:min(len(c), 8)])
					return
				}
			}
		})
	}
	writers.Wait()
	close(stop)
	readers.Wait()
	noTemps(t, dir)
}

// Concurrent edits through the broker are serialized: none is lost.
func TestConcurrentEditsAreNotLost(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	var want bytes.Buffer
	for i := range 20 {
		fmt.Fprintf(&want, "line %02d\n", i)
	}
	put(t, dir, "f", want.String())
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			_, err := w.Edit(protocol.EditArgs{Path: "f", Old: fmt.Sprintf("line %02d", i), New: fmt.Sprintf("done %02d", i)})
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	got := hostRead(t, filepath.Join(dir, "f"))
	if bytes.Contains([]byte(got), []byte("line")) {
		t.Errorf("an edit was lost:\n%s", got)
	}
}

func TestOwnership(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	const uid, gid = 12345, 12346
	w, dir := newWS(t, Options{UID: uid, GID: gid})
	put(t, dir, "existing.txt", "x")

	_, err := w.Write(protocol.WriteArgs{Path: "a/b/new.txt", Content: "x"})
	wantCode(t, err, "", dir)
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: "m/n", Parents: true}), "", dir)
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: "single"}), "", dir)
	_, err = w.Write(protocol.WriteArgs{Path: "existing.txt", Content: "y"})
	wantCode(t, err, "", dir)
	_, err = w.Edit(protocol.EditArgs{Path: "existing.txt", Old: "y", New: "z"})
	wantCode(t, err, "", dir)
	u, err := w.Create("up/load.bin", "")
	wantCode(t, err, "", dir)
	u.Write([]byte("data"))
	_, err = u.Commit()
	wantCode(t, err, "", dir)
	wantCode(t, w.Move(protocol.MoveArgs{From: "single", To: "moved/single"}), "", dir)

	for _, p := range []string{"a", "a/b", "a/b/new.txt", "m", "m/n", "existing.txt", "up", "up/load.bin", "moved", "moved/single"} {
		fi, err := os.Lstat(filepath.Join(dir, p))
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if st.Uid != uid || st.Gid != gid {
			t.Errorf("%s is owned by %d:%d, want %d:%d", p, st.Uid, st.Gid, uid, gid)
		}
	}

	// The zero Options leave ownership to the process.
	w0, dir0 := newWS(t, Options{})
	_, err = w0.Write(protocol.WriteArgs{Path: "d/f", Content: "x"})
	wantCode(t, err, "", dir0)
	fi, _ := os.Lstat(filepath.Join(dir0, "d/f"))
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 {
		t.Errorf("zero Options chowned to %d", st.Uid)
	}
}

func BenchmarkWriteRead4KiB(b *testing.B) {
	w, _ := newWS(b, Options{})
	content := string(bytes.Repeat([]byte("0123456789abcdef"), 256))
	b.SetBytes(4096)
	for b.Loop() {
		if _, err := w.Write(protocol.WriteArgs{Path: "dir/bench.txt", Content: content}); err != nil {
			b.Fatal(err)
		}
		r, err := w.Read(protocol.ReadArgs{Path: "dir/bench.txt"})
		if err != nil || len(r.Content) != 4096 {
			b.Fatal(err)
		}
	}
}

func BenchmarkStat(b *testing.B) {
	w, dir := newWS(b, Options{})
	put(b, dir, "a/b/c.txt", "x")
	for b.Loop() {
		if _, err := w.Stat("/workspace/a/b/c.txt"); err != nil {
			b.Fatal(err)
		}
	}
}
