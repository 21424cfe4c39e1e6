package tests

import (
	"archive/tar"
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tests/wait"
)

// cpTree builds a local tree with what a copy must keep: modes, mtimes, symlinks (relative, absolute
// and climbing), an empty directory and a binary file over several dataplane chunks.
func cpTree(t *testing.T, dir string) {
	t.Helper()
	bin := make([]byte, 5<<20+7)
	rand.Read(bin)
	for _, f := range []struct {
		name string
		data []byte
		mode fs.FileMode
	}{
		{"proj/README.md", []byte("# proj\n"), 0o644},
		{"proj/build.sh", []byte("#!/bin/sh\necho built\n"), 0o755},
		{"proj/private", []byte("p"), 0o600},
		{"proj/assets/blob.bin", bin, 0o644},
		{"proj/src/a/b/main.go", []byte("package main\n"), 0o644},
	} {
		p := filepath.Join(dir, f.name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, f.data, f.mode); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, f.mode)
	}
	for _, l := range [][2]string{{"README.md", "proj/docs"}, {"/etc/hostname", "proj/abs"}, {"../../..", "proj/src/up"}} {
		if err := os.Symlink(l[0], filepath.Join(dir, l[1])); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "proj/empty"), 0o700); err != nil {
		t.Fatal(err)
	}
	tm := time.Date(2021, 6, 7, 8, 9, 10, 0, time.UTC)
	for i, p := range []string{"proj/README.md", "proj/build.sh", "proj/assets/blob.bin", "proj/src/a/b", "proj/empty", "proj/src", "proj"} {
		at := tm.Add(time.Duration(i) * time.Minute)
		if err := os.Chtimes(filepath.Join(dir, p), at, at); err != nil {
			t.Fatal(err)
		}
	}
}

// listing describes a tree: names, types and modes, mtimes (not symlinks'), sizes and contents.
func listing(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		line := fmt.Sprintf("%s %s", rel, fi.Mode())
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			line += " -> " + target
		case fi.IsDir():
			line += " " + fi.ModTime().UTC().String()
		default:
			b, _ := os.ReadFile(p)
			line += fmt.Sprintf(" %s %d %x", fi.ModTime().UTC(), len(b), b[len(b)-min(len(b), 32):])
		}
		out = append(out, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestCpThroughSbctl copies a tree into a real sandbox and back with the real binaries, by every
// form of sbctl cp, and sends it a hostile archive.
func TestCpThroughSbctl(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "box")
	src, out := t.TempDir(), t.TempDir()
	cpTree(t, src)

	// In: the tree lands inside an existing directory under its own name; quiet when not a TTY.
	if r := b.sbctl("cp", filepath.Join(src, "proj"), "box:/workspace/"); r.code != 0 || r.stdout != "" || r.stderr != "" {
		t.Fatalf("cp in: %+v", r)
	}
	got := b.ok("exec", "box", "-c", "cd proj && stat -c '%n %a %Y' build.sh private empty && readlink abs src/up && ./build.sh && cmp -s docs README.md && echo same")
	if !strings.Contains(got, "build.sh 755 1623053410\n") || !strings.Contains(got, "private 600 ") ||
		!strings.Contains(got, "empty 700 1623053590\n") || !strings.HasSuffix(got, "/etc/hostname\n../../..\nbuilt\nsame\n") {
		t.Fatalf("in the sandbox:\n%s", got)
	}

	// Out, as a new name: the same tree comes back.
	if r := b.sbctl("cp", "box:proj", filepath.Join(out, "back")); r.code != 0 || r.stdout != "" || r.stderr != "" {
		t.Fatalf("cp out: %+v", r)
	}
	if got, want := listing(t, filepath.Join(out, "back")), listing(t, filepath.Join(src, "proj")); !slices.Equal(got, want) {
		t.Fatalf("round trip differs:\n got %q\nwant %q", got, want)
	}
	// A single file into an existing local directory; several sources into a new sandbox directory.
	b.ok("cp", "box:/workspace/proj/README.md", out)
	if b, err := os.ReadFile(filepath.Join(out, "README.md")); err != nil || string(b) != "# proj\n" {
		t.Fatalf("file out: %v %q", err, b)
	}
	b.ok("cp", filepath.Join(src, "proj/README.md"), filepath.Join(src, "proj/build.sh"), "box:multi")
	if got := b.ok("exec", "box", "-c", "ls multi"); got != "README.md\nbuild.sh\n" {
		t.Fatalf("several sources: %q", got)
	}

	// "-": a tar stream on stdin and on stdout.
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "s/in.txt", Mode: 0o640, Size: 6, Typeflag: tar.TypeReg, ModTime: time.Unix(1e9, 0)})
	tw.Write([]byte("stdin\n"))
	tw.Close()
	if r := b.sbctlIn(buf.String(), "cp", "-", "box:fromstdin"); r.code != 0 {
		t.Fatalf("cp - : %+v", r)
	}
	if got := b.ok("exec", "box", "-c", "stat -c '%a %Y' fromstdin/s/in.txt && cat fromstdin/s/in.txt"); got != "640 1000000000\nstdin\n" {
		t.Fatalf("from stdin: %q", got)
	}
	r := b.sbctl("cp", "box:fromstdin/s", "-")
	if r.code != 0 {
		t.Fatalf("cp to - : %+v", r)
	}
	tr := tar.NewReader(strings.NewReader(r.stdout))
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("stdout is not a tar stream: %v", err)
		}
		names = append(names, h.Name)
	}
	if !slices.Equal(names, []string{"s/", "s/in.txt"}) {
		t.Fatalf("tar to stdout: %q", names)
	}

	// A hostile archive is refused with a clear error and changes nothing outside its target.
	buf.Reset()
	tw = tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "l", Linkname: "..", Typeflag: tar.TypeSymlink})
	tw.WriteHeader(&tar.Header{Name: "l/evil", Mode: 0o644, Size: 1, Typeflag: tar.TypeReg})
	tw.Write([]byte("x"))
	tw.Close()
	r = b.sbctlIn(buf.String(), "cp", "-", "box:target")
	if r.code == 0 || !strings.Contains(r.stderr, "refused") || !strings.Contains(r.stderr, "symbolic link created earlier") {
		t.Fatalf("hostile archive: %+v", r)
	}
	if got := b.ok("exec", "box", "-c", "test ! -e evil && test ! -e target/l/evil && echo clean"); got != "clean\n" {
		t.Fatalf("after a hostile archive: %q", got)
	}

	// On a terminal (script(1) gives sbctl one) a summary of what moved goes to stderr.
	if _, err := exec.LookPath("script"); err == nil {
		cmd := exec.Command("script", "-qec", filepath.Join(bin, "sbctl")+" cp box:proj "+filepath.Join(out, "tty"), "/dev/null")
		cmd.Env = append(os.Environ(), "HOME="+b.Home, "XDG_CONFIG_HOME=", "SBCTL_CONFIG=", "SBX_API_KEY=", "SBX_BROKER_URL=")
		got, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(got), "5 files, 6 dirs, 3 symlinks, 5.0 MiB in ") {
			t.Fatalf("cp on a terminal: %v %q", err, got)
		}
	}

	// Each copy is one synced event on the sandbox's stream, with what it moved.
	wait.Eventually(t, 15*time.Second, func() bool {
		in, outs := 0, 0
		for _, l := range strings.Split(strings.TrimSpace(b.ok("events", "box", "-o", "json", "--backlog", "500")), "\n") {
			var e protocol.Event
			if err := json.Unmarshal([]byte(l), &e); err != nil {
				t.Fatalf("events -o json line %q: %v", l, err)
			}
			switch {
			case e.Type != protocol.EventSynced:
			case e.Direction == "in" && e.Path == "/workspace" && *e.Files == 5 && *e.Bytes == 5<<20+7+7+21+1+13:
				in++
			case e.Direction == "out" && e.Path == "/workspace/proj" && *e.Files == 5:
				outs++
			}
		}
		return in == 1 && outs >= 1
	}, "one synced event in (/workspace, 5 files) and one out (/workspace/proj) on the stream")

	// Usage errors say what to do.
	if r := b.sbctl("cp", filepath.Join(src, "nope"), "box:x"); r.code == 0 || !strings.Contains(r.stderr, "nope") {
		t.Fatalf("missing source: %+v", r)
	}
	if r := b.sbctl("cp", "a", "b"); r.code == 0 || !strings.Contains(r.stderr, "REF:PATH") {
		t.Fatalf("no sandbox side: %+v", r)
	}
	if h := b.ok("cp", "--help"); !strings.Contains(h, "sbctl cp ./src dev:/workspace/") {
		t.Fatalf("cp --help has no examples:\n%s", h)
	}
}

// A destination that is a symbolic link is followed as cp follows one: a link to a directory takes
// the file in (with a trailing / too), one to a file is written through and stays a link, one
// leading out of /workspace or to nothing is refused with the reason, and exits 1: the sandbox's
// content refuses it, the command line is right (it exited 2, a usage error). sbctl replaced the
// link itself with the copy, and refused "LINK/" as "not a directory; several sources go into a
// directory" for one source.
func TestCpIntoASymlinkedDestination(t *testing.T) {
	t.Parallel()
	b := startBroker(t)
	b.ok("create", "box")
	b.ok("exec", "box", "-c", "mkdir real && echo old > real/target && ln -s real dirlink && ln -s target real/filelink && ln -s /etc out && ln -s nowhere dangling")
	f := filepath.Join(t.TempDir(), "f.txt")
	if err := os.WriteFile(f, []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	b.ok("cp", f, "box:dirlink")
	b.ok("cp", f, "box:/workspace/dirlink/")
	b.ok("cp", f, "box:dirlink/filelink")
	got := b.ok("exec", "box", "-c", "stat -c '%N' dirlink real/filelink && cat real/f.txt real/target")
	if got != "'dirlink' -> 'real'\n'real/filelink' -> 'target'\nnew\nnew\n" {
		t.Fatalf("after copying onto links:\n%s", got)
	}
	// A link the sandbox holds refuses the copy, which is no wrong command line: exit 1, not 2.
	for _, tc := range []struct {
		dst  string
		code int
		want string
	}{
		{"box:out", 1, "box:out leads out of the workspace: out is a symbolic link to /etc"},
		{"box:out/", 1, "resolves outside the workspace through a symbolic link"},
		{"box:dangling", 1, "is a symbolic link to nowhere, which does not exist"},
		{"box:real/target/", 1, "is not a directory (a trailing / names one)"},
		{"box:/etc", 2, "outside /workspace"},
	} {
		if r := b.sbctl("cp", f, tc.dst); r.code != tc.code || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("cp to %s: exit %d %q, want %d %q", tc.dst, r.code, r.stderr, tc.code, tc.want)
		}
	}
	// Several sources onto a file the sandbox holds: the same, exit 1.
	if r := b.sbctl("cp", f, f, "box:real/target"); r.code != 1 || !strings.Contains(r.stderr, "several sources go into a directory") {
		t.Errorf("cp of two sources onto a file: exit %d %q, want 1 saying several sources go into a directory", r.code, r.stderr)
	}
	if got := b.ok("exec", "box", "-c", "stat -c '%N' out dangling; ls /etc/f.txt 2>&1; true"); !strings.HasPrefix(got, "'out' -> '/etc'\n'dangling' -> 'nowhere'\n") || !strings.Contains(got, "No such file") {
		t.Fatalf("a refused copy changed something:\n%s", got)
	}
}
