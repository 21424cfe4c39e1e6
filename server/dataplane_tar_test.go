package server_test

import (
	"archive/tar"
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tartree"
)

// makeTree builds the tree every copy test moves: modes, mtimes, symlinks (one pointing out), an
// empty directory and a binary file over several dataplane chunks.
func makeTree(t *testing.T, dir string) {
	t.Helper()
	bin := make([]byte, 3<<20+12345)
	rand.Read(bin)
	files := []struct {
		name string
		data []byte
		mode fs.FileMode
	}{
		{"proj/README", []byte("hello\n"), 0o644},
		{"proj/run.sh", []byte("#!/bin/sh\necho run\n"), 0o755},
		{"proj/secret.key", []byte("k"), 0o600},
		{"proj/bin/blob.bin", bin, 0o640},
		{"proj/deep/a/b/c.txt", []byte("c"), 0o444},
	}
	for _, f := range files {
		p := filepath.Join(dir, f.name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, f.data, f.mode); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, f.mode)
	}
	must(t, os.Mkdir(filepath.Join(dir, "proj/empty"), 0o750))
	must(t, os.Symlink("README", filepath.Join(dir, "proj/link")))
	must(t, os.Symlink("/etc/passwd", filepath.Join(dir, "proj/outside")))
	must(t, os.Symlink("../..", filepath.Join(dir, "proj/bin/up")))
	must(t, os.Chmod(filepath.Join(dir, "proj/deep"), 0o700))
	old := time.Date(2020, 2, 3, 4, 5, 6, 789000000, time.UTC)
	for i, p := range []string{"proj/README", "proj/run.sh", "proj/bin/blob.bin", "proj/deep/a/b/c.txt", "proj/deep/a/b", "proj/empty", "proj/bin", "proj"} {
		tm := old.Add(time.Duration(i) * time.Hour)
		must(t, os.Chtimes(filepath.Join(dir, p), tm, tm))
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// tarOf archives dir/name through tartree, as sbctl does.
func tarOf(t *testing.T, dir, name string) []byte {
	t.Helper()
	root, err := os.OpenRoot(dir)
	must(t, err)
	defer root.Close()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if _, err := tartree.Add(t.Context(), tw, root, name, name); err != nil {
		t.Fatal(err)
	}
	must(t, tw.Close())
	return buf.Bytes()
}

// treeListing describes a tree for comparison: type, mode, mtime (not a symlink's), size, content
// hash, link target.
func treeListing(t *testing.T, dir string) []string {
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
			line += " " + fi.ModTime().UTC().Format(time.RFC3339Nano)
		default:
			b, _ := os.ReadFile(p)
			line += fmt.Sprintf(" %s %d %x", fi.ModTime().UTC().Format(time.RFC3339Nano), len(b), b[:min(len(b), 16)])
			if len(b) > 16 {
				line += fmt.Sprintf("..%x", b[len(b)-16:])
			}
		}
		out = append(out, line)
		return nil
	})
	must(t, err)
	return out
}

// TestTarRoundTrip copies a tree into a namespace sandbox with untar and back out with tar: what
// comes back is what went in, and the sandbox saw it as the sandbox user with its modes.
func TestTarRoundTrip(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	r, _ := dialToken(t, b, "tar", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	ctx := t.Context()
	src := t.TempDir()
	makeTree(t, src)
	archive := tarOf(t, src, "proj")

	res, err := r.Untar(ctx, "/workspace/in", bytes.NewReader(archive))
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "/workspace/in" || res.Files != 5 || res.Dirs != 6 || res.Symlinks != 3 || res.Bytes != 3<<20+12345+6+19+1+1 {
		t.Fatalf("untar result %+v", res)
	}
	// Inside the sandbox: modes, mtimes, links as links, owned by the sandbox's user.
	var out bytes.Buffer
	er, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: `cd in/proj && stat -c '%n %a %F %Y' README run.sh secret.key deep empty link && readlink outside bin/up && [ "$(stat -c %u README)" = "$(id -u)" ] && ./run.sh`}, Stdout: &out})
	if err != nil || er.ExitCode != 0 {
		t.Fatalf("exec: %v %+v %q", err, er, out.String())
	}
	want := "README 644 regular file 1580702706\nrun.sh 755 regular file 1580706306\nsecret.key 600 regular file"
	if !strings.HasPrefix(out.String(), want) || !strings.Contains(out.String(), "deep 700 directory") ||
		!strings.Contains(out.String(), "empty 750 directory 1580720706") || !strings.Contains(out.String(), "link 777 symbolic link") ||
		!strings.HasSuffix(out.String(), "/etc/passwd\n../..\nrun\n") {
		t.Fatalf("in the sandbox:\n%s", out.String())
	}

	var back bytes.Buffer
	tres, err := r.Tar(ctx, "in/proj", &back)
	if err != nil {
		t.Fatal(err)
	}
	if tres.Files != 5 || tres.Dirs != 6 || tres.Symlinks != 3 || tres.Bytes != res.Bytes {
		t.Fatalf("tar result %+v", tres)
	}
	dst := t.TempDir()
	root, err := os.OpenRoot(dst)
	must(t, err)
	defer root.Close()
	if _, err := tartree.Extract(ctx, root, &back, tartree.ExtractOptions{}); err != nil {
		t.Fatal(err)
	}
	if got, want := treeListing(t, filepath.Join(dst, "proj")), treeListing(t, filepath.Join(src, "proj")); !slices.Equal(got, want) {
		t.Fatalf("round trip differs:\n got %q\nwant %q", got, want)
	}

	// A single file, and a symlink, archive as themselves.
	back.Reset()
	if tres, err := r.Tar(ctx, "/workspace/in/proj/link", &back); err != nil || tres.Symlinks != 1 || tres.Files != 0 {
		t.Fatalf("tar of a link: %v %+v", err, tres)
	}
	hdr, err := tar.NewReader(&back).Next()
	if err != nil || hdr.Name != "link" || hdr.Typeflag != tar.TypeSymlink || hdr.Linkname != "README" {
		t.Fatalf("tar of a link: %v %+v", err, hdr)
	}
	// Errors name sandbox paths.
	if _, err := r.Tar(ctx, "nope", io.Discard); code(err) != protocol.CodeFileNotFound || !strings.Contains(err.Error(), "/workspace/nope") {
		t.Fatalf("tar of a missing path: %v", err)
	}
	if _, err := r.Untar(ctx, "../etc", bytes.NewReader(archive)); code(err) != protocol.CodeInvalidPath {
		t.Fatalf("untar outside the workspace: %v", err)
	}
	// Links the sandbox planted are never followed out: a target directory that is a link leading
	// out is refused, and a link inside the target is replaced by the archive's entry.
	if er, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "ln -s /etc out && mkdir t2 && ln -s /etc t2/x"}}); err != nil || er.ExitCode != 0 {
		t.Fatalf("plant: %v %+v", err, er)
	}
	planted := archiveOf(t, entry{tar.Header{Typeflag: tar.TypeReg, Name: "x/passwd"}, "pwned"})
	if _, err := r.Untar(ctx, "out", bytes.NewReader(planted)); code(err) != protocol.CodeInvalidPath {
		t.Fatalf("untar into a link leading out: %v", err)
	}
	if _, err := r.Untar(ctx, "t2", bytes.NewReader(planted)); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if er, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "cat t2/x/passwd; test -L t2/x || echo replaced; grep -c pwned /etc/passwd"}, Stdout: &out}); err != nil || out.String() != "pwnedreplaced\n0\n" {
		t.Fatalf("after a planted link: %v %+v %q", err, er, out.String())
	}
	if err := r.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

type entry struct {
	hdr  tar.Header
	body string
}

func archiveOf(t *testing.T, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		must(t, tw.WriteHeader(&h))
		if e.body != "" {
			tw.Write([]byte(e.body))
		}
	}
	must(t, tw.Close())
	return buf.Bytes()
}

// hugePAX is an archive whose first entry is a 2 MiB PAX extended header (archive/tar's writer
// refuses to write one, so its type byte is patched in).
func hugePAX(t *testing.T) []byte {
	t.Helper()
	val := strings.Repeat("x", 2<<20)
	rec := fmt.Sprintf(" comment=%s\n", val)
	rec = fmt.Sprintf("%d%s", len(rec)+7, rec) // 7 digits of length
	b := archiveOf(t, entry{tar.Header{Typeflag: tar.TypeReg, Name: "PaxHeaders/big"}, rec}, entry{tar.Header{Typeflag: tar.TypeReg, Name: "big"}, "x"})
	b[156] = tar.TypeXHeader
	copy(b[148:156], "        ")
	sum := 0
	for _, c := range b[:512] {
		sum += int(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

// TestUntarHostile sends hostile archives: each is refused with a clear error, and nothing outside
// its target directory changes, in the workspace or on the host.
func TestUntarHostile(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	r, _ := dialToken(t, b, "hostile", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write"}})
	ctx := t.Context()
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "canary", Content: "untouched"}); err != nil {
		t.Fatal(err)
	}
	hostEvil := filepath.Join(os.TempDir(), fmt.Sprintf("sbx-evil-%d", time.Now().UnixNano()))
	file := func(name, body string) entry {
		return entry{tar.Header{Typeflag: tar.TypeReg, Name: name}, body}
	}
	cases := []struct {
		name    string
		archive []byte
		want    string // in the message
	}{
		{"dotdot", archiveOf(t, file("ok", "x"), file("../evil", "x")), `climbs out with ".."`},
		{"dotdot-inner", archiveOf(t, file("a/../../evil", "x")), `climbs out`},
		{"absolute", archiveOf(t, file(hostEvil, "x")), "absolute"},
		{"symlink-then-file", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeSymlink, Name: "l", Linkname: ".."}, ""}, file("l/evil", "x")), "symbolic link created earlier"},
		{"symlink-abs-then-file", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeSymlink, Name: "l", Linkname: filepath.Dir(hostEvil)}, ""}, file("l/"+filepath.Base(hostEvil), "x")), "symbolic link created earlier"},
		{"symlink-then-dir", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeSymlink, Name: "d", Linkname: "../.."}, ""}, entry{tar.Header{Typeflag: tar.TypeDir, Name: "d/sub/"}, ""}), "symbolic link created earlier"},
		{"hardlink-outside", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "../canary"}, ""}), "hard link"},
		{"hardlink-absolute", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "/etc/passwd"}, ""}), "hard link"},
		{"hardlink-missing", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "nothing"}, ""}), "hard link"},
		{"char-device", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeChar, Name: "null", Devmajor: 1, Devminor: 3}, ""}), "device nodes"},
		{"block-device", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeBlock, Name: "sda", Devmajor: 8}, ""}), "device nodes"},
		{"fifo", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeFifo, Name: "pipe"}, ""}), "FIFOs"},
		{"control-chars", archiveOf(t, file("a\x1b[31mred", "x")), "control characters"},
		{"control-in-link", archiveOf(t, entry{tar.Header{Typeflag: tar.TypeSymlink, Name: "l", Linkname: "x\ny"}, ""}), "control characters"},
		{"huge-header", hugePAX(t), "header over 1 MiB"},
		{"long-name", archiveOf(t, file(strings.Repeat("n", 5000), "x")), "limit is 4096"},
		{"truncated", archiveOf(t, file("f", strings.Repeat("x", 4096)))[:1024], "truncated"},
		{"not-tar", bytes.Repeat([]byte("garbage!"), 200), "not a valid tar"},
	}
	for _, tc := range cases {
		target := "t-" + tc.name
		_, err := r.Untar(ctx, target, bytes.NewReader(tc.archive))
		if code(err) != protocol.CodeInvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want invalid_argument with %q", tc.name, err, tc.want)
			continue
		}
		if strings.ContainsAny(err.Error(), "\x1b\n") {
			t.Errorf("%s: the message carries control characters: %q", tc.name, err.Error())
		}
	}
	// Nothing outside the targets: the workspace holds the canary and the t-* directories only,
	// the canary is intact, and nothing reached the host.
	ls, err := r.Ls(ctx, "/workspace")
	must(t, err)
	for _, e := range ls {
		if e.Name != "canary" && !strings.HasPrefix(e.Name, "t-") {
			t.Errorf("an archive wrote %s outside its target", e.Path)
		}
	}
	if rr, err := r.Read(ctx, protocol.ReadArgs{Path: "canary"}); err != nil || rr.Content != "untouched" {
		t.Errorf("canary: %v %q", err, rr.Content)
	}
	if _, err := os.Lstat(hostEvil); err == nil {
		os.Remove(hostEvil)
		t.Errorf("an archive wrote %s on the host", hostEvil)
	}
	if _, err := r.Stat(ctx, "t-symlink-then-file/l/evil"); err == nil {
		t.Errorf("a file was written through a symlink")
	}
	// The connection serves on after every refusal.
	if err := r.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestTarScopes: untar needs fs:write and tar needs fs:read; a refused untar writes nothing.
func TestTarScopes(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	ro, _ := dialToken(t, b, "scopes", protocol.MintRequest{Scopes: []string{"fs:read"}})
	wo, _ := dialToken(t, b, "scopes", protocol.MintRequest{Scopes: []string{"fs:write"}})
	archive := archiveOf(t, entry{tar.Header{Typeflag: tar.TypeReg, Name: "f"}, "data"})
	if _, err := ro.Untar(ctx, "x", bytes.NewReader(archive)); code(err) != protocol.CodeScopeDenied {
		t.Fatalf("untar with fs:read only: %v", err)
	}
	if _, err := ro.Stat(ctx, "x"); code(err) != protocol.CodeFileNotFound {
		t.Fatalf("a refused untar wrote: %v", err)
	}
	if _, err := wo.Untar(ctx, "x", bytes.NewReader(archive)); err != nil {
		t.Fatal(err)
	}
	if _, err := wo.Tar(ctx, "x", io.Discard); code(err) != protocol.CodeScopeDenied {
		t.Fatalf("tar with fs:write only: %v", err)
	}
	var buf bytes.Buffer
	if _, err := ro.Tar(ctx, "x", &buf); err != nil || !bytes.Contains(buf.Bytes(), []byte("data")) {
		t.Fatalf("tar with fs:read: %v", err)
	}
}

// TestUntarCountsAgainstDiskQuota: an untar writes through the workspace like any write, so a
// sandbox's disk quota stops it with payload_too_large, and the sandbox serves on.
func TestUntarCountsAgainstDiskQuota(t *testing.T) {
	t.Parallel()
	tmpl := map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"small":   {Name: "small", Disk: 16 << 20},
	}
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: tmpl})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "small", Template: "small"}); err != nil {
		t.Fatal(err)
	}
	r, _ := dialToken(t, b, "small", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write"}})
	big := archiveOf(t, entry{tar.Header{Typeflag: tar.TypeReg, Name: "big.bin"}, strings.Repeat("z", 32<<20)})
	if _, err := r.Untar(ctx, "in", bytes.NewReader(big)); code(err) != protocol.CodeTooLarge || !strings.Contains(err.Error(), "no space left") {
		t.Fatalf("32 MiB into a 16 MiB sandbox: %v; want payload_too_large", err)
	}
	small := archiveOf(t, entry{tar.Header{Typeflag: tar.TypeReg, Name: "ok.txt"}, "fits"})
	if err := r.Delete(ctx, protocol.DeleteArgs{Path: "in", Recursive: true}); err != nil {
		t.Fatal(err)
	}
	if res, err := r.Untar(ctx, "in", bytes.NewReader(small)); err != nil || res.Files != 1 {
		t.Fatalf("after the quota refused a copy: %v %+v", err, res)
	}
}

// TestTarFiles: a tar with paths is a batch of downloads in one round trip. Each file asked for is
// one regular-file entry named as asked, with what a download gives (a symlink inside the
// workspace is followed, as a download follows it); every path a download refuses has no entry and
// its own error in the result, and the rest of the batch goes on.
func TestTarFiles(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	r, _ := dialToken(t, b, "batch", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	big := make([]byte, 2<<20+777)
	rand.Read(big)
	if _, err := r.Upload(ctx, "w/sub/big.bin", bytes.NewReader(big)); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "w/a.txt", Content: "alpha\n"}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "w/empty", Content: ""}); err != nil {
		t.Fatal(err)
	}
	if er, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "cd w && ln -s a.txt link && ln -s /etc/passwd out && ln -s sub lsub && mkdir d && mkfifo p"}}); err != nil || er.ExitCode != 0 {
		t.Fatalf("setup: %v %+v", err, er)
	}
	names := []string{"a.txt", "sub/big.bin", "nope", "link", "d", "out", "p", "lsub/big.bin", "empty", "sub/nope/x"}
	var buf bytes.Buffer
	res, err := r.TarFiles(ctx, "w", names, &buf)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{"a.txt": []byte("alpha\n"), "sub/big.bin": big, "link": []byte("alpha\n"), "lsub/big.bin": big, "empty": {}}
	var got []string
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(t, err)
		body, err := io.ReadAll(tr)
		must(t, err)
		if h.Typeflag != tar.TypeReg || !bytes.Equal(body, want[h.Name]) {
			t.Errorf("entry %q: type %c, %d bytes; want a file of %d", h.Name, h.Typeflag, len(body), len(want[h.Name]))
		}
		got = append(got, h.Name)
	}
	if wantNames := []string{"a.txt", "sub/big.bin", "link", "lsub/big.bin", "empty"}; !slices.Equal(got, wantNames) {
		t.Errorf("entries %q, want %q in the order asked", got, wantNames)
	}
	var codes []string
	for _, e := range res.Errors {
		codes = append(codes, e.Path+" "+e.Code)
		if e.Message == "" {
			t.Errorf("%s: no message", e.Path)
		}
	}
	wantCodes := []string{"nope file_not_found", "d is_directory", "out invalid_path", "p invalid_argument", "sub/nope/x file_not_found"}
	if !slices.Equal(codes, wantCodes) {
		t.Errorf("errors %q, want %q", codes, wantCodes)
	}
	if res.Path != "/workspace/w" || res.Files != 5 || res.Bytes != int64(2*len(big)+12) || res.Dirs != 0 || res.Symlinks != 0 {
		t.Errorf("result %+v", res)
	}
	// Each error is what a download of that path alone answers.
	for _, e := range res.Errors {
		if _, err := r.Download(ctx, "w/"+e.Path, io.Discard); code(err) != e.Code {
			t.Errorf("%s: download answers %v, the batch %s", e.Path, err, e.Code)
		}
	}
}

// TestTarFilesRefusesBadPaths: the names of a batch are checked before anything is read, and a
// bad one refuses the whole request: each must be a clean relative path inside the directory.
func TestTarFilesRefusesBadPaths(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	ctx := t.Context()
	r, _ := dialToken(t, b, "batchbad", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write"}})
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "w/a", Content: "a"}); err != nil {
		t.Fatal(err)
	}
	many := make([]string, protocol.MaxTarPaths+1)
	for i := range many {
		many[i] = fmt.Sprintf("f%d", i)
	}
	for _, c := range []struct {
		dir   string
		names []string
		code  string
	}{
		{"w", []string{"../a"}, protocol.CodeInvalidArgument},
		{"w", []string{"a", "x/../../a"}, protocol.CodeInvalidArgument},
		{"w", []string{"/workspace/w/a"}, protocol.CodeInvalidArgument},
		{"w", []string{""}, protocol.CodeInvalidArgument},
		{"w", []string{"."}, protocol.CodeInvalidArgument},
		{"w", []string{"./a"}, protocol.CodeInvalidArgument},
		{"w", []string{"x//a"}, protocol.CodeInvalidArgument},
		{"w", []string{"x/"}, protocol.CodeInvalidArgument},
		{"w", []string{"a\x00b"}, protocol.CodeInvalidArgument},
		{"w", []string{"a", "a"}, protocol.CodeInvalidArgument},
		{"w", []string{strings.Repeat("n", 4097)}, protocol.CodeInvalidArgument},
		{"w", many, protocol.CodeInvalidArgument},
		{"w/a", []string{"x"}, protocol.CodeNotDirectory},
		{"nowhere", []string{"x"}, protocol.CodeFileNotFound},
		{"/etc", []string{"passwd"}, protocol.CodeInvalidPath},
	} {
		var buf bytes.Buffer
		if _, err := r.TarFiles(ctx, c.dir, c.names, &buf); code(err) != c.code || buf.Len() != 0 {
			t.Errorf("%s %.40q (%d names): %v, %d bytes; want %s and nothing sent", c.dir, c.names[0], len(c.names), err, buf.Len(), c.code)
		}
	}
	// An empty list is refused on the wire too (the SDK refuses it before sending), as is a list
	// that is not one of strings.
	c := dialRaw(t, dataplaneURL(b, "batchbad"), b.Client.APIKey())
	for i, args := range []string{`{"path":"w","paths":[]}`, `{"path":"w","paths":"a"}`, `{"path":"w","paths":[1]}`, `{"path":"w","paths":null,"x":1}`} {
		if got := c.call(uint32(i+1), protocol.OpTar, json.RawMessage(args)); got.code() != protocol.CodeInvalidArgument {
			t.Errorf("tar %s: %s", args, got)
		}
	}
}
