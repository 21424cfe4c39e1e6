package workspace

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// deepPath is n levels of the one-letter name c: the deepest paths fit in 4096 bytes this way.
func deepPath(c string, n int) string {
	return strings.TrimSuffix(strings.Repeat(c+"/", n), "/")
}

// countLookupsOf makes w count the path components its mkdirAll looks up.
func countLookupsOf(w *Workspace) *int {
	n := new(int)
	w.countLookups = func(components int) { *n += components }
	return n
}

// ownedBy fails unless every level of rel under dir, rel's own included, is owned by uid:gid. It
// walks down on directory handles, so it costs one lookup a level however deep rel is.
func ownedBy(t *testing.T, dir, rel string, uid, gid uint32) {
	t.Helper()
	r, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i, name := range strings.Split(rel, "/") {
		sub, err := r.OpenRoot(name)
		r.Close()
		if err != nil {
			t.Fatalf("level %d: %v", i+1, err)
		}
		r = sub
		fi, err := r.Stat(".")
		if err != nil {
			t.Fatal(err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != uid || st.Gid != gid {
			r.Close()
			t.Fatalf("level %d is owned by %d:%d, want %d:%d", i+1, st.Uid, st.Gid, uid, gid)
		}
	}
	r.Close()
}

// Creating the missing parents of a deep path walks it once: the components looked up grow with
// the depth, not with its square (retrying from the root level by level looked up millions for
// these 2,000 levels, 6-7 s of CPU). That holds with half the path there already, and for a
// write's and a move's parents too. Every new level belongs to the sandbox user.
func TestMkdirParentsOfADeepPathWalksItOnce(t *testing.T) {
	t.Parallel()
	const depth = 2000
	var uid, gid uint32 = 12345, 12346
	opts := Options{UID: int(uid), GID: int(gid)}
	if os.Geteuid() != 0 {
		opts, uid, gid = Options{}, uint32(os.Geteuid()), uint32(os.Getegid())
	}
	w, dir := newWS(t, opts)
	looked := countLookupsOf(w)

	deep := deepPath("d", depth)
	half := deep[:depth-1]
	for _, p := range []string{half, deep} { // half of it first, then the rest
		*looked = 0
		wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: p, Parents: true}), "", dir)
		if *looked > 5*depth {
			t.Errorf("mkdir -p of %d levels looked up %d components; want at most %d", depth, *looked, 5*depth)
		}
	}
	fi, err := w.Stat(deep)
	wantCode(t, err, "", dir)
	if fi.Type != protocol.FileTypeDir {
		t.Fatalf("Stat(deep) = %+v", fi)
	}
	ownedBy(t, dir, deep, uid, gid)

	for _, tc := range []struct {
		name string
		run  func() error
	}{
		{"write", func() error {
			_, err := w.Write(protocol.WriteArgs{Path: half + "/" + deepPath("w", depth/2-1) + "/f", Content: "x"})
			return err
		}},
		{"move", func() error {
			return w.Move(protocol.MoveArgs{From: "src", To: half + "/" + deepPath("v", depth/2-1) + "/f"})
		}},
	} {
		put(t, dir, "src", "x")
		*looked = 0
		wantCode(t, tc.run(), "", dir)
		if *looked > 5*depth {
			t.Errorf("%s: creating %d levels under %d looked up %d components; want at most %d", tc.name, depth/2-1, depth/2, *looked, 5*depth)
		}
	}
	ownedBy(t, dir, half+"/"+deepPath("w", depth/2-1), uid, gid)
	if c, err := w.Read(protocol.ReadArgs{Path: half + "/" + deepPath("v", depth/2-1) + "/f"}); err != nil || c.Content != "x" {
		t.Errorf("the moved file reads %+v, %v", c, err)
	}
}

// hostChain makes n nested directories named c under dir on the host and returns their path
// relative to dir.
func hostChain(t *testing.T, dir, c string, n int) string {
	t.Helper()
	rel := deepPath(c, n)
	if err := os.MkdirAll(filepath.Join(dir, rel), 0o755); err != nil {
		t.Fatal(err)
	}
	return rel
}

// A symlink leading out, planted at some level of a deep path, stops the creation of its parents
// there: invalid_path, whether the link is absolute or climbs out with "..", and nothing is made
// outside. A dangling one is file_not_found, and its target is not made either.
func TestMkdirParentsDeepPathThroughLinkOut(t *testing.T) {
	t.Parallel()
	w, base, ws, outside := hostileWS(t)
	before := snapshot(t, outside)
	mid := hostChain(t, ws, "h", 500)
	symlink(t, outside, filepath.Join(ws, mid, "abs"))
	symlink(t, strings.Repeat("../", 501)+"outside", filepath.Join(ws, mid, "rel"))
	symlink(t, "up/sub", filepath.Join(ws, mid, "via")) // a link to a link out
	symlink(t, strings.Repeat("../", 500)+"d/deep/up", filepath.Join(ws, mid, "up"))
	symlink(t, "nowhere", filepath.Join(ws, mid, "dangling"))
	rest := deepPath("x", 700)

	for _, link := range []string{"abs", "rel", "via"} {
		for _, p := range []string{mid + "/" + link + "/" + rest, mid + "/" + link + "/sub/" + rest, mid + "/" + link} {
			wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: p, Parents: true}), protocol.CodeInvalidPath, base)
			_, err := w.Write(protocol.WriteArgs{Path: p + "/f", Content: "pwned"})
			wantCode(t, err, protocol.CodeInvalidPath, base)
			put(t, ws, "src", "pwned")
			wantCode(t, w.Move(protocol.MoveArgs{From: "src", To: p + "/f"}), protocol.CodeInvalidPath, base)
		}
	}
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: mid + "/dangling/" + rest, Parents: true}), protocol.CodeFileNotFound, base)
	if _, err := os.Lstat(filepath.Join(ws, mid, "nowhere")); !os.IsNotExist(err) {
		t.Errorf("the dangling link's target was made: %v", err)
	}
	if after := snapshot(t, outside); after != before {
		t.Fatalf("the outside directory changed:\nbefore %s\nafter %s", before, after)
	}
	if _, err := os.Lstat(filepath.Join(ws, "x")); !os.IsNotExist(err) {
		t.Errorf("something was made at the root: %v", err)
	}
	noTemps(t, base)
}

// A symlink to a directory inside the workspace, at some level of a deep path, is followed: the
// missing levels are made where it leads and it stays a link. So are a chain of links, a link that
// climbs with ".." and comes back down, and a link as the last level.
func TestMkdirParentsDeepPathThroughLinkInside(t *testing.T) {
	t.Parallel()
	w, ws := newWS(t, Options{})
	looked := countLookupsOf(w)
	mid := hostChain(t, ws, "h", 300)
	if err := os.Mkdir(filepath.Join(ws, "target"), 0o755); err != nil {
		t.Fatal(err)
	}
	up := strings.Repeat("../", 300)
	symlink(t, up+"target", filepath.Join(ws, mid, "in"))
	symlink(t, "in", filepath.Join(ws, mid, "chain"))
	symlink(t, "../"+filepath.Base(mid)+"/in", filepath.Join(ws, mid, "around"))
	rest := deepPath("y", 400)

	for _, link := range []string{"in", "chain", "around"} {
		*looked = 0
		p := mid + "/" + link + "/" + link + "/" + rest
		wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: p, Parents: true}), "", ws)
		if *looked > 10*(300+400) {
			t.Errorf("through %s: looked up %d components for %d levels", link, *looked, 300+400)
		}
		created := "target/" + link + "/" + rest
		if fi, err := w.Stat(created); err != nil || fi.Type != protocol.FileTypeDir {
			t.Errorf("through %s: %s = %+v, %v", link, created, fi, err)
		}
		if fi, err := os.Lstat(filepath.Join(ws, mid, link)); err != nil || fi.Mode()&os.ModeSymlink == 0 {
			t.Errorf("%s is no longer a link: %v, %v", link, fi, err)
		}
	}
	// Already there through a link, the last level a link too: nothing to do.
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: mid + "/in", Parents: true}), "", ws)
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: mid + "/chain/in/" + rest, Parents: true}), "", ws)

	// A file in the way is still not_directory, at any level; as the last level, file_exists.
	put(t, ws, mid+"/file", "x")
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: mid + "/file/" + rest, Parents: true}), protocol.CodeNotDirectory, ws)
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: mid + "/file", Parents: true}), protocol.CodeFileExists, ws)
	symlink(t, "file", filepath.Join(ws, mid, "tofile"))
	wantCode(t, w.Mkdir(protocol.MkdirArgs{Path: mid + "/tofile/" + rest, Parents: true}), protocol.CodeNotDirectory, ws)
}

// A sandbox process swapping the directories a deep mkdir -p has just made for links out, while it
// runs, can make it fail but never makes it create anything outside.
func TestMkdirParentsRaceWithLinkSwaps(t *testing.T) {
	t.Parallel()
	w, base, ws, outside := hostileWS(t)
	before := snapshot(t, outside)
	const depth = 30
	rel := deepPath("r", depth)

	stop := make(chan struct{})
	var swapper sync.WaitGroup
	swapper.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			// Swap the deepest level made so far for a link out, absolute or relative.
			p := filepath.Join(ws, "r")
			for k := 1; k < depth; k++ {
				if fi, err := os.Lstat(filepath.Join(p, "r")); err != nil || !fi.IsDir() {
					break
				}
				p = filepath.Join(p, "r")
			}
			target := outside
			if i%2 == 1 {
				target = strings.Repeat("../", strings.Count(strings.TrimPrefix(p, ws), "/")) + "outside"
			}
			if os.Rename(p, p+".away") == nil {
				os.Symlink(target, p)
			}
		}
	})
	for range 100 {
		err := w.Mkdir(protocol.MkdirArgs{Path: rel, Parents: true})
		if c := codeOf(err); c != "" && (c[0] == 'U' || c == protocol.CodeInternal || strings.Contains(err.Error(), base)) {
			t.Fatalf("bad error %v", err)
		}
		os.RemoveAll(filepath.Join(ws, "r"))
		os.RemoveAll(filepath.Join(ws, "r.away"))
	}
	close(stop)
	swapper.Wait()
	if after := snapshot(t, outside); after != before {
		t.Fatalf("the outside directory changed:\nbefore %s\nafter %s", before, after)
	}
}
