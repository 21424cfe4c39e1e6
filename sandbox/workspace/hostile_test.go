package workspace

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

const secret = "TOP-SECRET-7f3a9c-never-leak"

// hostileWS lays out a workspace next to an "outside" directory holding a secret, with every kind
// of symlink a sandbox process could plant to reach it. base is the host directory holding both:
// it must never appear in an error, and the secret never in a result or an error.
func hostileWS(t *testing.T) (w *Workspace, base, ws, outside string) {
	t.Helper()
	base = t.TempDir()
	ws, outside = filepath.Join(base, "ws"), filepath.Join(base, "outside")
	put(t, outside, "secret.txt", secret)
	put(t, outside, "sub/deeper.txt", secret)
	put(t, ws, "inside.txt", "inside")
	symlink(t, outside, filepath.Join(ws, "abs"))                                  // absolute, to a directory
	symlink(t, filepath.Join(outside, "secret.txt"), filepath.Join(ws, "absfile")) // absolute, to a file
	symlink(t, "/etc", filepath.Join(ws, "etc"))                                   // ln -s /etc etc
	symlink(t, "../outside", filepath.Join(ws, "rel"))                             // relative, one level up
	symlink(t, "../outside/secret.txt", filepath.Join(ws, "relfile"))
	symlink(t, "chain2", filepath.Join(ws, "chain1")) // a chain of two links
	symlink(t, "../outside", filepath.Join(ws, "chain2"))
	symlink(t, "chain2/secret.txt", filepath.Join(ws, "chainfile"))
	symlink(t, "../../../outside", filepath.Join(ws, "d/deep/up")) // relative, deep
	symlink(t, "loop2", filepath.Join(ws, "loop1"))                // a loop
	symlink(t, "loop1", filepath.Join(ws, "loop2"))
	symlink(t, "/workspace/inside.txt", filepath.Join(ws, "wsabs")) // absolute in sandbox terms: refused too
	var err error
	if w, err = Open(ws, Options{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w, base, ws, outside
}

// snapshot is every path and content under dir, to prove the outside was not touched.
func snapshot(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		b.WriteString(p + "\n")
		if d.Type().IsRegular() {
			b.WriteString(hostRead(t, p) + "\n")
		}
		return nil
	})
	return b.String()
}

// Paths that reach outside through a link in one of their directories, or lexically, or are not
// valid paths at all. Every operation must refuse them with invalid_path.
var throughLinks = []string{
	"/workspace/abs/secret.txt", "abs/secret.txt", "abs/sub/deeper.txt", "abs/new.txt", "abs/sub",
	"etc/passwd", "/workspace/etc/shadow", "rel/secret.txt", "rel/sub", "chain1/secret.txt",
	"d/deep/up/secret.txt", "loop1/x",
	"../x", "/workspace/../../etc/passwd", "/etc/passwd", "/workspace/../outside/secret.txt",
	"a\x00b", "\xff\xfe", strings.Repeat("a/", 2500),
}

// Links that are themselves inside the workspace but resolve outside (or nowhere). Operations that
// follow them must refuse; the ones that act on the link itself may.
var leadingOut = []string{"abs", "absfile", "etc", "rel", "relfile", "chain1", "chainfile", "d/deep/up", "loop1", "wsabs"}

func TestHostilePaths(t *testing.T) {
	t.Parallel()
	w, base, ws, outside := hostileWS(t)
	before := snapshot(t, outside)

	// check runs one operation: it must fail with invalid_path, name no host path and show no
	// secret; a result, if any, must not show the secret either.
	check := func(t *testing.T, op, p string, result any, err error) {
		t.Helper()
		if codeOf(err) != protocol.CodeInvalidPath {
			t.Errorf("%s(%q) = %+v, %v; want invalid_path", op, p, result, err)
		}
		if err != nil && (strings.Contains(err.Error(), base) || strings.Contains(err.Error(), secret)) {
			t.Errorf("%s(%q): error leaks: %v", op, p, err)
		}
		b, _ := json.Marshal(result)
		if strings.Contains(string(b), secret) {
			t.Errorf("%s(%q): result leaks the secret: %s", op, p, b)
		}
	}
	type op struct {
		name string
		run  func(p string) (any, error)
	}
	follow := []op{ // operations that follow a final symlink, or create through it
		{"Read", func(p string) (any, error) { return w.Read(protocol.ReadArgs{Path: p}) }},
		{"ReadLines", func(p string) (any, error) { return w.Read(protocol.ReadArgs{Path: p, LineLimit: 5}) }},
		{"Write", func(p string) (any, error) { return w.Write(protocol.WriteArgs{Path: p, Content: "pwned"}) }},
		{"WriteCreate", func(p string) (any, error) {
			return w.Write(protocol.WriteArgs{Path: p, Content: "pwned", Mode: protocol.WriteCreate})
		}},
		{"Edit", func(p string) (any, error) { return w.Edit(protocol.EditArgs{Path: p, Old: "TOP", New: "pwned"}) }},
		{"OpenRead", func(p string) (any, error) {
			rc, fi, err := w.OpenRead(p)
			if err == nil {
				b, _ := io.ReadAll(rc)
				rc.Close()
				return string(b), nil
			}
			return fi, err
		}},
		{"Create", func(p string) (any, error) {
			u, err := w.Create(p, "")
			if err == nil {
				u.Write([]byte("pwned"))
				return u.Commit()
			}
			return nil, err
		}},
		{"List", func(p string) (any, error) { return w.List(p) }},
		{"MkdirParents", func(p string) (any, error) { return nil, w.Mkdir(protocol.MkdirArgs{Path: p, Parents: true}) }},
		{"Glob", func(p string) (any, error) { return w.Glob(protocol.GlobArgs{Pattern: "**", Path: p}) }},
		{"GlobPattern", func(p string) (any, error) {
			rel, err := protocol.ResolvePath(p)
			if err != nil {
				return nil, err
			}
			return w.Glob(protocol.GlobArgs{Pattern: rel + "/*"})
		}},
		{"Grep", func(p string) (any, error) { return w.Grep(t.Context(), protocol.GrepArgs{Pattern: "TOP", Path: p}) }},
	}
	nofollow := []op{ // operations on the final component itself
		{"Stat", func(p string) (any, error) { return w.Stat(p) }},
		{"Mkdir", func(p string) (any, error) { return nil, w.Mkdir(protocol.MkdirArgs{Path: p}) }},
		{"Delete", func(p string) (any, error) { return nil, w.Delete(protocol.DeleteArgs{Path: p, Recursive: true}) }},
		{"MoveFrom", func(p string) (any, error) { return nil, w.Move(protocol.MoveArgs{From: p, To: "stolen"}) }},
		{"MoveTo", func(p string) (any, error) {
			return nil, w.Move(protocol.MoveArgs{From: "inside.txt", To: p, Overwrite: true})
		}},
	}
	for _, o := range append(slices.Clone(follow), nofollow...) {
		for _, p := range throughLinks {
			res, err := o.run(p)
			check(t, o.name, p, res, err)
		}
	}
	for _, o := range follow {
		for _, p := range leadingOut {
			if o.name == "GlobPattern" {
				continue
			}
			res, err := o.run(p)
			if o.name == "WriteCreate" {
				// The link itself exists, which is all mode "create" needs to refuse.
				wantCode(t, err, protocol.CodeFileExists, base)
				continue
			}
			check(t, o.name, p, res, err)
		}
	}
	// A whole-workspace search lists the links but never what is behind them.
	g, err := w.Glob(protocol.GlobArgs{Pattern: "**"})
	wantCode(t, err, "", base)
	for _, f := range g.Files {
		if strings.Contains(f.Path, "secret") || strings.Contains(f.Path, "deeper") {
			t.Errorf("Glob ** reached outside: %s", f.Path)
		}
	}
	for _, pat := range []string{"**/secret.txt", "*/secret.txt", "**/sub/*", "etc/*"} {
		g, err := w.Glob(protocol.GlobArgs{Pattern: pat})
		if len(g.Files) > 0 {
			t.Errorf("Glob %s = %s, %v", pat, paths(g.Files), err)
		}
	}
	gr, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "TOP-SECRET"})
	wantCode(t, err, "", base)
	if len(gr.Matches) != 0 {
		t.Errorf("Grep found the secret: %+v", gr.Matches)
	}
	if after := snapshot(t, outside); after != before {
		t.Fatalf("the outside directory changed:\nbefore %s\nafter %s", before, after)
	}
	if c := hostRead(t, filepath.Join(ws, "inside.txt")); c != "inside" {
		t.Errorf("inside.txt = %q (moved or overwritten)", c)
	}

	// Acting on the links themselves is fine and stays inside: Stat describes the link, Delete
	// removes it and not its target, Move renames it.
	fi, err := w.Stat("absfile")
	wantCode(t, err, "", base)
	if fi.Type != protocol.FileTypeSymlink {
		t.Errorf("Stat(absfile) = %+v", fi)
	}
	wantCode(t, w.Move(protocol.MoveArgs{From: "relfile", To: "moved/relfile"}), "", base)
	for _, p := range []string{"absfile", "abs", "moved/relfile", "chain1", "loop1"} {
		wantCode(t, w.Delete(protocol.DeleteArgs{Path: p, Recursive: true}), "", base)
		if _, err := os.Lstat(filepath.Join(ws, p)); !os.IsNotExist(err) {
			t.Errorf("Delete(%s) left it", p)
		}
	}
	if after := snapshot(t, outside); after != before {
		t.Fatalf("deleting links changed the outside directory")
	}
}

// A symlink swapped in while a write is under way can only redirect it inside the workspace.
func TestWriteThroughLinkInsideOnly(t *testing.T) {
	t.Parallel()
	w, base, ws, outside := hostileWS(t)
	// Write and Edit through a link inside the workspace work; through a link chain that leaves,
	// they do not, even when the final hop is relative.
	symlink(t, "inside.txt", filepath.Join(ws, "ok"))
	_, err := w.Write(protocol.WriteArgs{Path: "ok", Content: "changed"})
	wantCode(t, err, "", base)
	symlink(t, "d/../../outside/secret.txt", filepath.Join(ws, "sneaky"))
	_, err = w.Write(protocol.WriteArgs{Path: "sneaky", Content: "pwned"})
	wantCode(t, err, protocol.CodeInvalidPath, base)
	symlink(t, "d/deep/up/secret.txt", filepath.Join(ws, "viadeep"))
	_, err = w.Edit(protocol.EditArgs{Path: "viadeep", Old: "TOP", New: "x"})
	wantCode(t, err, protocol.CodeInvalidPath, base)
	if c := hostRead(t, filepath.Join(outside, "secret.txt")); c != secret {
		t.Fatalf("secret changed: %q", c)
	}
}

func mkfifo(t *testing.T, p string) {
	t.Helper()
	if err := syscall.Mkfifo(p, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestFIFO(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	mkfifo(t, filepath.Join(dir, "fifo"))
	mkfifo(t, filepath.Join(dir, "fifo2"))
	symlink(t, "fifo", filepath.Join(dir, "fifolink"))
	put(t, dir, "sub/text.txt", "needle\n")

	for _, p := range []string{"fifo", "fifolink"} {
		within(t, 2*time.Second, func() {
			_, err := w.Read(protocol.ReadArgs{Path: p})
			wantCode(t, err, protocol.CodeInvalidArgument, dir)
			_, err = w.Read(protocol.ReadArgs{Path: p, LineLimit: 1})
			wantCode(t, err, protocol.CodeInvalidArgument, dir)
			_, _, err = w.OpenRead(p)
			wantCode(t, err, protocol.CodeInvalidArgument, dir)
			_, err = w.Edit(protocol.EditArgs{Path: p, Old: "a", New: "b"})
			wantCode(t, err, protocol.CodeInvalidArgument, dir)
			_, err = w.Write(protocol.WriteArgs{Path: p, Content: "x"})
			wantCode(t, err, protocol.CodeInvalidArgument, dir)
			_, err = w.List(p)
			wantCode(t, err, protocol.CodeNotDirectory, dir)
			_, err = w.Grep(t.Context(), protocol.GrepArgs{Pattern: "x", Path: p})
			wantCode(t, err, protocol.CodeInvalidArgument, dir)
			// A FIFO named as the tree to compare or to unpack into is never opened (an open for
			// reading would wait for a writer, holding the broker's thread and slot for good).
			_, err = w.Changes(t.Context(), protocol.ChangesArgs{Path: p})
			wantCode(t, err, protocol.CodeNotDirectory, dir)
			_, err = w.Extract(t.Context(), p, bytes.NewReader(nil))
			wantCode(t, err, protocol.CodeNotDirectory, dir)
		})
	}
	within(t, 2*time.Second, func() {
		g, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "needle"})
		wantCode(t, err, "", dir)
		if grepLines(g) != "sub/text.txt:1:needle" {
			t.Errorf("Grep = %q", grepLines(g))
		}
		gl, err := w.Glob(protocol.GlobArgs{Pattern: "**"})
		wantCode(t, err, "", dir)
		if paths(gl.Files) != "fifo fifo2 fifolink sub sub/text.txt" || gl.Files[0].Type != protocol.FileTypeOther {
			t.Errorf("Glob = %s %+v", paths(gl.Files), gl.Files)
		}
		fi, err := w.Stat("fifo")
		wantCode(t, err, "", dir)
		if fi.Type != protocol.FileTypeOther {
			t.Errorf("Stat(fifo) = %+v", fi)
		}
		wantCode(t, w.Delete(protocol.DeleteArgs{Path: "fifo2"}), "", dir)
	})
}

// A sandbox process retargeting links and swapping directories for links while operations run can
// never get one of them outside: every lookup goes through the root.
func TestHostileRaces(t *testing.T) {
	t.Parallel()
	w, base, ws, outside := hostileWS(t)
	before := snapshot(t, outside)
	put(t, ws, "realdir/f.txt", "inside TOP")
	put(t, ws, "sub/f.txt", "inside TOP")

	stop := make(chan struct{})
	var swapper sync.WaitGroup
	swapper.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			// "swap" flips between a link inside and one outside.
			target := "realdir"
			if i%2 == 1 {
				target = outside
				if i%4 == 3 {
					target = "../outside"
				}
			}
			tmp := filepath.Join(ws, "swap.tmp")
			os.Remove(tmp)
			os.Symlink(target, tmp)
			os.Rename(tmp, filepath.Join(ws, "swap"))
			// "sub" flips between a directory and a link outside.
			if i%2 == 0 {
				os.Rename(filepath.Join(ws, "sub"), filepath.Join(ws, "sub.away"))
				os.Symlink(outside, filepath.Join(ws, "sub"))
			} else {
				os.Remove(filepath.Join(ws, "sub"))
				os.Rename(filepath.Join(ws, "sub.away"), filepath.Join(ws, "sub"))
			}
		}
	})

	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		for _, p := range []string{"swap/f.txt", "swap/secret.txt", "sub/f.txt", "sub/secret.txt"} {
			var results []any
			r, err := w.Read(protocol.ReadArgs{Path: p})
			results = append(results, r, err)
			wr, err := w.Write(protocol.WriteArgs{Path: p, Content: "pwned"})
			results = append(results, wr, err)
			e, err := w.Edit(protocol.EditArgs{Path: p, Old: "TOP", New: "pwned"})
			results = append(results, e, err)
			g, err := w.Glob(protocol.GlobArgs{Pattern: "**", Path: path.Dir(p)})
			results = append(results, g, err)
			gr, err := w.Grep(t.Context(), protocol.GrepArgs{Pattern: "TOP"})
			results = append(results, gr, err)
			err = w.Delete(protocol.DeleteArgs{Path: p})
			results = append(results, err)
			err = w.Mkdir(protocol.MkdirArgs{Path: p + ".d", Parents: true})
			results = append(results, err)
			b, _ := json.Marshal(results)
			for _, r := range results {
				if err, ok := r.(error); ok && err != nil {
					if c := codeOf(err); c[0] == 'U' || c == protocol.CodeInternal || strings.Contains(err.Error(), base) {
						t.Fatalf("%s: bad error %v", p, err)
					}
				}
			}
			if strings.Contains(string(b), secret) || strings.Contains(string(b), "deeper") {
				t.Fatalf("%s: leaked: %s", p, b)
			}
		}
	}
	close(stop)
	swapper.Wait()
	if after := snapshot(t, outside); after != before {
		t.Fatalf("the outside directory changed:\nbefore %s\nafter %s", before, after)
	}
}
