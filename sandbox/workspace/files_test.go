package workspace

import (
	"bytes"
	"encoding/base64"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

func TestStat(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "a/f.txt", "hello")
	symlink(t, "a/f.txt", filepath.Join(dir, "link"))
	if err := os.Chmod(filepath.Join(dir, "a/f.txt"), 0o600); err != nil {
		t.Fatal(err)
	}

	fi, err := w.Stat("/workspace/a/f.txt")
	wantCode(t, err, "", dir)
	if fi.Path != "/workspace/a/f.txt" || fi.Name != "f.txt" || fi.Type != protocol.FileTypeFile || fi.Size != 5 || fi.Mode != 0o600 || fi.ModTime.IsZero() {
		t.Errorf("Stat file = %+v", fi)
	}
	fi, err = w.Stat("link")
	wantCode(t, err, "", dir)
	if fi.Type != protocol.FileTypeSymlink || fi.Target != "a/f.txt" || fi.Path != "/workspace/link" {
		t.Errorf("Stat symlink = %+v", fi)
	}
	fi, err = w.Stat("/workspace")
	wantCode(t, err, "", dir)
	if fi.Type != protocol.FileTypeDir || fi.Path != "/workspace" || fi.Name != "workspace" {
		t.Errorf("Stat root = %+v", fi)
	}
	_, err = w.Stat("nope")
	wantCode(t, err, protocol.CodeFileNotFound, dir)
	if !strings.Contains(err.Error(), "/workspace/nope") {
		t.Errorf("message does not name the sandbox path: %v", err)
	}
	_, err = w.Stat("a/f.txt/x")
	wantCode(t, err, protocol.CodeNotDirectory, dir)
	_, err = w.Stat("../x")
	wantCode(t, err, protocol.CodeInvalidPath, dir)
}

func TestList(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "d/b.txt", "bb")
	put(t, dir, "d/a.txt", "a")
	put(t, dir, "d/.hidden", "")
	if err := os.Mkdir(filepath.Join(dir, "d/sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	symlink(t, "a.txt", filepath.Join(dir, "d/link"))
	symlink(t, "d", filepath.Join(dir, "dlink"))

	for _, p := range []string{"d", "/workspace/dlink"} {
		got, err := w.List(p)
		wantCode(t, err, "", dir)
		var names []string
		for _, fi := range got {
			names = append(names, fi.Name+":"+fi.Type)
		}
		want := ".hidden:file a.txt:file b.txt:file link:symlink sub:dir"
		if strings.Join(names, " ") != want {
			t.Errorf("List(%s) = %v, want %s", p, names, want)
		}
		if got[3].Target != "a.txt" || !strings.HasPrefix(got[0].Path, "/workspace/") {
			t.Errorf("List(%s) entries = %+v", p, got)
		}
	}
	got, err := w.List("/workspace")
	wantCode(t, err, "", dir)
	if len(got) != 2 || got[0].Path != "/workspace/d" {
		t.Errorf("List root = %+v", got)
	}
	_, err = w.List("d/a.txt")
	wantCode(t, err, protocol.CodeNotDirectory, dir)
	_, err = w.List("d/link") // a symlink to a file
	wantCode(t, err, protocol.CodeNotDirectory, dir)
	_, err = w.List("missing")
	wantCode(t, err, protocol.CodeFileNotFound, dir)
}

func TestRead(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "f.txt", "hello\nworld\n")
	put(t, dir, "abc", "a\nb\nc")
	put(t, dir, "crlf", "a\r\nb\r\n")
	put(t, dir, "empty", "")
	put(t, dir, "bin", "\x00\x01\xffabc")
	put(t, dir, "long", strings.Repeat("x", 100<<10)+"\nshort\n")
	symlink(t, "f.txt", filepath.Join(dir, "link"))
	if err := os.Mkdir(filepath.Join(dir, "dir"), 0o755); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name  string
		args  protocol.ReadArgs
		want  string
		enc   string
		total int
		trunc bool
		code  string
	}{
		{name: "whole", args: protocol.ReadArgs{Path: "f.txt"}, want: "hello\nworld\n"},
		{name: "absolute", args: protocol.ReadArgs{Path: "/workspace/f.txt"}, want: "hello\nworld\n"},
		{name: "symlink followed", args: protocol.ReadArgs{Path: "link"}, want: "hello\nworld\n"},
		{name: "range", args: protocol.ReadArgs{Path: "f.txt", Offset: 6, Length: 5}, want: "world"},
		{name: "range to end", args: protocol.ReadArgs{Path: "f.txt", Offset: 6}, want: "world\n"},
		{name: "range past end", args: protocol.ReadArgs{Path: "f.txt", Offset: 100, Length: 5}, want: ""},
		{name: "range cuts utf-8", args: protocol.ReadArgs{Path: "bin", Offset: 1, Length: 2}, want: base64.StdEncoding.EncodeToString([]byte("\x01\xff")), enc: protocol.EncodingBase64},
		{name: "binary", args: protocol.ReadArgs{Path: "bin"}, want: base64.StdEncoding.EncodeToString([]byte("\x00\x01\xffabc")), enc: protocol.EncodingBase64},
		{name: "line window", args: protocol.ReadArgs{Path: "abc", LineOffset: 1, LineLimit: 1}, want: "b\n", total: 3},
		{name: "first lines", args: protocol.ReadArgs{Path: "abc", LineLimit: 2}, want: "a\nb\n", total: 3},
		{name: "last line without newline", args: protocol.ReadArgs{Path: "abc", LineOffset: 2}, want: "c", total: 3},
		{name: "lines past end", args: protocol.ReadArgs{Path: "abc", LineOffset: 7}, want: "", total: 3},
		{name: "crlf kept", args: protocol.ReadArgs{Path: "crlf", LineLimit: 1}, want: "a\r\n", total: 2},
		{name: "empty file has no lines", args: protocol.ReadArgs{Path: "empty", LineLimit: 5}, want: "", total: 0},
		{name: "line longer than the reader buffer", args: protocol.ReadArgs{Path: "long", LineOffset: 1, LineLimit: 1}, want: "short\n", total: 2},
		{name: "directory", args: protocol.ReadArgs{Path: "dir"}, code: protocol.CodeIsDirectory},
		{name: "root", args: protocol.ReadArgs{Path: "/workspace"}, code: protocol.CodeIsDirectory},
		{name: "missing", args: protocol.ReadArgs{Path: "nope"}, code: protocol.CodeFileNotFound},
		{name: "under a file", args: protocol.ReadArgs{Path: "f.txt/x"}, code: protocol.CodeNotDirectory},
		{name: "both modes", args: protocol.ReadArgs{Path: "f.txt", Offset: 1, LineLimit: 1}, code: protocol.CodeInvalidArgument},
		{name: "negative offset", args: protocol.ReadArgs{Path: "f.txt", Offset: -1}, code: protocol.CodeInvalidArgument},
		{name: "negative line limit", args: protocol.ReadArgs{Path: "f.txt", LineLimit: -1}, code: protocol.CodeInvalidArgument},
		{name: "escape", args: protocol.ReadArgs{Path: "../f.txt"}, code: protocol.CodeInvalidPath},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := w.Read(tt.args)
			wantCode(t, err, tt.code, dir)
			if tt.code != "" {
				return
			}
			enc := tt.enc
			if enc == "" {
				enc = protocol.EncodingUTF8
			}
			if got.Content != tt.want || got.Encoding != enc || got.TotalLines != tt.total || got.Truncated != tt.trunc {
				t.Errorf("Read = %+v, want content %q enc %s total %d truncated %v", got, tt.want, enc, tt.total, tt.trunc)
			}
			if !strings.HasPrefix(got.Path, "/workspace/") {
				t.Errorf("Path = %q", got.Path)
			}
			rel, _ := protocol.ResolvePath(tt.args.Path)
			fi, _ := os.Stat(filepath.Join(dir, rel))
			if got.Size != fi.Size() {
				t.Errorf("Size = %d, want the file's %d", got.Size, fi.Size())
			}
		})
	}
}

func TestReadCap(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxReadBytes: 10})
	put(t, dir, "alpha", "abcdefghijklmnopqrstuvwxyz")
	put(t, dir, "lines", "aaaa\nbbbb\ncccc\n")
	put(t, dir, "oneline", strings.Repeat("z", 20)+"\nx\n")
	put(t, dir, "utf8", "ééééééé\n") // 2 bytes each
	put(t, dir, "utf8b", "aééééééé\n")

	tests := []struct {
		args  protocol.ReadArgs
		want  string
		total int
		trunc bool
	}{
		{protocol.ReadArgs{Path: "alpha"}, "abcdefghij", 0, true},
		{protocol.ReadArgs{Path: "alpha", Offset: 20}, "uvwxyz", 0, false},
		{protocol.ReadArgs{Path: "alpha", Offset: 5, Length: 10}, "fghijklmno", 0, false},
		{protocol.ReadArgs{Path: "alpha", Offset: 5, Length: 11}, "fghijklmno", 0, true},
		{protocol.ReadArgs{Path: "lines", LineLimit: 3}, "aaaa\nbbbb\n", 3, true},
		{protocol.ReadArgs{Path: "lines", LineLimit: 2}, "aaaa\nbbbb\n", 3, false},
		{protocol.ReadArgs{Path: "lines", LineOffset: 1, LineLimit: 9}, "bbbb\ncccc\n", 3, false},
		{protocol.ReadArgs{Path: "oneline", LineLimit: 1}, strings.Repeat("z", 10), 2, true},
		{protocol.ReadArgs{Path: "utf8", LineLimit: 1}, "ééééé", 1, true},
		{protocol.ReadArgs{Path: "utf8b"}, "aéééé", 0, true}, // the cap splits a character: trimmed, still text
	}
	for _, tt := range tests {
		got, err := w.Read(tt.args)
		wantCode(t, err, "", dir)
		if got.Content != tt.want || got.TotalLines != tt.total || got.Truncated != tt.trunc || got.Encoding != protocol.EncodingUTF8 {
			t.Errorf("Read(%+v) = %+v, want %q total %d truncated %v", tt.args, got, tt.want, tt.total, tt.trunc)
		}
	}
}

func TestWrite(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "old.txt", "old")
	if err := os.Chmod(filepath.Join(dir, "old.txt"), 0o600); err != nil {
		t.Fatal(err)
	}
	put(t, dir, "suid", "x")
	if err := os.Chmod(filepath.Join(dir, "suid"), 0o4755); err != nil {
		t.Fatal(err)
	}
	put(t, dir, "real.txt", "real")
	symlink(t, "real.txt", filepath.Join(dir, "link"))
	symlink(t, "made/by/link.txt", filepath.Join(dir, "dangling"))
	symlink(t, "nowhere.txt", filepath.Join(dir, "dangling2"))
	if err := os.Mkdir(filepath.Join(dir, "dir"), 0o755); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name    string
		args    protocol.WriteArgs
		code    string
		file    string // host file to check, default args.Path
		want    string
		perm    fs.FileMode
		created bool
	}{
		{name: "new", args: protocol.WriteArgs{Path: "new.txt", Content: "hi"}, want: "hi", perm: 0o644, created: true},
		{name: "parents", args: protocol.WriteArgs{Path: "/workspace/x/y/z.txt", Content: "deep"}, file: "x/y/z.txt", want: "deep", perm: 0o644, created: true},
		{name: "overwrite keeps perm", args: protocol.WriteArgs{Path: "old.txt", Content: "new"}, want: "new", perm: 0o600},
		{name: "setuid is dropped", args: protocol.WriteArgs{Path: "suid", Content: "y"}, want: "y", perm: 0o755},
		{name: "base64", args: protocol.WriteArgs{Path: "b.bin", Content: base64.StdEncoding.EncodeToString([]byte{0, 1, 2}), Encoding: "base64"}, want: "\x00\x01\x02", perm: 0o644, created: true},
		{name: "explicit utf-8", args: protocol.WriteArgs{Path: "u.txt", Content: "é", Encoding: "utf-8", Mode: "overwrite"}, want: "é", perm: 0o644, created: true},
		{name: "create new", args: protocol.WriteArgs{Path: "c.txt", Content: "c", Mode: "create"}, want: "c", perm: 0o644, created: true},
		{name: "empty content", args: protocol.WriteArgs{Path: "e.txt"}, want: "", perm: 0o644, created: true},
		{name: "through symlink", args: protocol.WriteArgs{Path: "link", Content: "via link"}, file: "real.txt", want: "via link", perm: 0o644},
		{name: "through dangling symlink", args: protocol.WriteArgs{Path: "dangling", Content: "made"}, file: "made/by/link.txt", want: "made", perm: 0o644, created: true},
		{name: "create existing", args: protocol.WriteArgs{Path: "real.txt", Content: "no", Mode: "create"}, code: protocol.CodeFileExists},
		{name: "create over symlink", args: protocol.WriteArgs{Path: "link", Content: "no", Mode: "create"}, code: protocol.CodeFileExists},
		{name: "create over dangling symlink", args: protocol.WriteArgs{Path: "dangling2", Content: "no", Mode: "create"}, code: protocol.CodeFileExists},
		{name: "bad base64", args: protocol.WriteArgs{Path: "x.bin", Content: "!!!", Encoding: "base64"}, code: protocol.CodeInvalidArgument},
		{name: "bad encoding", args: protocol.WriteArgs{Path: "x.bin", Content: "a", Encoding: "latin1"}, code: protocol.CodeInvalidArgument},
		{name: "bad mode", args: protocol.WriteArgs{Path: "x.bin", Content: "a", Mode: "append"}, code: protocol.CodeInvalidArgument},
		{name: "directory", args: protocol.WriteArgs{Path: "dir", Content: "a"}, code: protocol.CodeIsDirectory},
		{name: "root", args: protocol.WriteArgs{Path: "/workspace", Content: "a"}, code: protocol.CodeIsDirectory},
		{name: "under a file", args: protocol.WriteArgs{Path: "real.txt/x", Content: "a"}, code: protocol.CodeNotDirectory},
		{name: "escape", args: protocol.WriteArgs{Path: "/workspace/../x", Content: "a"}, code: protocol.CodeInvalidPath},
		// A path ending in /, /. or /.. names a directory, as open(2) with O_CREAT says (EISDIR):
		// never a file of the cleaned name.
		{name: "trailing slash", args: protocol.WriteArgs{Path: "slash/", Content: "a"}, code: protocol.CodeIsDirectory},
		{name: "trailing slash create", args: protocol.WriteArgs{Path: "/workspace/slash/", Content: "a", Mode: "create"}, code: protocol.CodeIsDirectory},
		{name: "trailing dot", args: protocol.WriteArgs{Path: "slash/.", Content: "a"}, code: protocol.CodeIsDirectory},
		{name: "trailing dot-dot", args: protocol.WriteArgs{Path: "sub/slash/..", Content: "a"}, code: protocol.CodeIsDirectory},
		{name: "file with trailing slash", args: protocol.WriteArgs{Path: "real.txt/", Content: "a"}, code: protocol.CodeIsDirectory},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := w.Write(tt.args)
			wantCode(t, err, tt.code, dir)
			if tt.code != "" {
				return
			}
			file := tt.file
			if file == "" {
				file = tt.args.Path
			}
			host := filepath.Join(dir, strings.TrimPrefix(file, "/workspace"))
			if c := hostRead(t, host); c != tt.want {
				t.Errorf("content = %q, want %q", c, tt.want)
			}
			fi, _ := os.Stat(host)
			if fi.Mode() != tt.perm {
				t.Errorf("mode = %v, want %v", fi.Mode(), tt.perm)
			}
			rel, _ := protocol.ResolvePath(tt.args.Path)
			if got.Path != sandboxPath(rel) || got.Size != int64(len(tt.want)) || got.Created != tt.created {
				t.Errorf("result = %+v, want size %d created %v", got, len(tt.want), tt.created)
			}
		})
	}
	if fi, err := os.Lstat(filepath.Join(dir, "link")); err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		t.Errorf("the symlink written through is no longer a symlink")
	}
	if c := hostRead(t, filepath.Join(dir, "real.txt")); c != "via link" {
		t.Errorf("create over an existing file changed it: %q", c)
	}
	for _, name := range []string{"slash", "sub"} {
		if _, err := os.Lstat(filepath.Join(dir, name)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("a refused write to a path naming a directory made %s: %v", name, err)
		}
	}
	noTemps(t, dir)
}

func TestEdit(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxEditBytes: 100})
	put(t, dir, "big", strings.Repeat("x", 101))
	if err := os.Mkdir(filepath.Join(dir, "dir"), 0o755); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name, content string
		args          protocol.EditArgs
		want          string
		n             int
		code          string
	}{
		{name: "once", content: "a foo b", args: protocol.EditArgs{Old: "foo", New: "bar"}, want: "a bar b", n: 1},
		{name: "delete text", content: "a foo b", args: protocol.EditArgs{Old: " foo", New: ""}, want: "a b", n: 1},
		{name: "replace all", content: "foo foo foo", args: protocol.EditArgs{Old: "foo", New: "x", ReplaceAll: true}, want: "x x x", n: 3},
		{name: "multiline", content: "l1\nl2\nl3\n", args: protocol.EditArgs{Old: "l2\nl3", New: "L"}, want: "l1\nL\n", n: 1},
		{name: "not unique", content: "foo foo", args: protocol.EditArgs{Old: "foo", New: "x"}, want: "foo foo", code: protocol.CodeNotUnique},
		{name: "no match", content: "abc", args: protocol.EditArgs{Old: "zzz", New: "x"}, want: "abc", code: protocol.CodeNoMatch},
		{name: "empty old", content: "abc", args: protocol.EditArgs{Old: "", New: "x"}, want: "abc", code: protocol.CodeInvalidArgument},
		{name: "same", content: "abc", args: protocol.EditArgs{Old: "a", New: "a"}, want: "abc", code: protocol.CodeInvalidArgument},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name := "f" + string(rune('a'+i))
			put(t, dir, name, tt.content)
			if err := os.Chmod(filepath.Join(dir, name), 0o640); err != nil {
				t.Fatal(err)
			}
			tt.args.Path = name
			got, err := w.Edit(tt.args)
			wantCode(t, err, tt.code, dir)
			if c := hostRead(t, filepath.Join(dir, name)); c != tt.want {
				t.Errorf("content = %q, want %q", c, tt.want)
			}
			if tt.code == protocol.CodeNotUnique && !strings.Contains(err.Error(), "2 times") {
				t.Errorf("not_unique message lacks the count: %v", err)
			}
			if tt.code != "" {
				return
			}
			if got.Occurrences != tt.n || got.Path != "/workspace/"+name {
				t.Errorf("result = %+v", got)
			}
			if fi, _ := os.Stat(filepath.Join(dir, name)); fi.Mode() != 0o640 {
				t.Errorf("mode = %v, want 0640 kept", fi.Mode())
			}
		})
	}

	put(t, dir, "target.txt", "one two")
	symlink(t, "target.txt", filepath.Join(dir, "elink"))
	_, err := w.Edit(protocol.EditArgs{Path: "elink", Old: "one", New: "1"})
	wantCode(t, err, "", dir)
	if c := hostRead(t, filepath.Join(dir, "target.txt")); c != "1 two" {
		t.Errorf("edit through symlink: target = %q", c)
	}
	_, err = w.Edit(protocol.EditArgs{Path: "big", Old: "x", New: "y", ReplaceAll: true})
	wantCode(t, err, protocol.CodeTooLarge, dir)
	_, err = w.Edit(protocol.EditArgs{Path: "dir", Old: "x", New: "y"})
	wantCode(t, err, protocol.CodeIsDirectory, dir)
	_, err = w.Edit(protocol.EditArgs{Path: "missing", Old: "x", New: "y"})
	wantCode(t, err, protocol.CodeFileNotFound, dir)
	noTemps(t, dir)
}

func TestDelete(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "f.txt", "x")
	put(t, dir, "target.txt", "keep")
	symlink(t, "target.txt", filepath.Join(dir, "link"))
	put(t, dir, "full/a/b.txt", "x")
	if err := os.Mkdir(filepath.Join(dir, "empty"), 0o755); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		args protocol.DeleteArgs
		code string
		gone string
	}{
		{protocol.DeleteArgs{Path: "f.txt"}, "", "f.txt"},
		{protocol.DeleteArgs{Path: "/workspace/link"}, "", "link"},
		{protocol.DeleteArgs{Path: "empty"}, "", "empty"},
		{protocol.DeleteArgs{Path: "full"}, protocol.CodeInvalidArgument, ""},
		{protocol.DeleteArgs{Path: "full", Recursive: true}, "", "full"},
		{protocol.DeleteArgs{Path: "missing"}, protocol.CodeFileNotFound, ""},
		{protocol.DeleteArgs{Path: "/workspace"}, protocol.CodeInvalidPath, ""},
		{protocol.DeleteArgs{Path: ".", Recursive: true}, protocol.CodeInvalidPath, ""},
		{protocol.DeleteArgs{Path: "../x"}, protocol.CodeInvalidPath, ""},
	}
	for _, tt := range tests {
		err := w.Delete(tt.args)
		wantCode(t, err, tt.code, dir)
		if tt.code == protocol.CodeInvalidArgument && !strings.Contains(err.Error(), "recursive") {
			t.Errorf("message does not say to pass recursive: %v", err)
		}
		if tt.gone != "" {
			if _, err := os.Lstat(filepath.Join(dir, tt.gone)); !os.IsNotExist(err) {
				t.Errorf("Delete(%+v): %s still exists", tt.args, tt.gone)
			}
		}
	}
	if c := hostRead(t, filepath.Join(dir, "target.txt")); c != "keep" {
		t.Errorf("deleting the link touched its target")
	}
}

func TestMkdir(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "f.txt", "x")
	if err := os.Mkdir(filepath.Join(dir, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	symlink(t, "real", filepath.Join(dir, "dlink"))

	tests := []struct {
		args protocol.MkdirArgs
		code string
	}{
		{protocol.MkdirArgs{Path: "a"}, ""},
		{protocol.MkdirArgs{Path: "a"}, protocol.CodeFileExists},
		{protocol.MkdirArgs{Path: "a", Parents: true}, ""},
		{protocol.MkdirArgs{Path: "x/y/z"}, protocol.CodeFileNotFound},
		{protocol.MkdirArgs{Path: "/workspace/x/y/z", Parents: true}, ""},
		{protocol.MkdirArgs{Path: "x/y/z", Parents: true}, ""},
		{protocol.MkdirArgs{Path: "f.txt"}, protocol.CodeFileExists},
		{protocol.MkdirArgs{Path: "f.txt", Parents: true}, protocol.CodeFileExists},
		{protocol.MkdirArgs{Path: "f.txt/sub", Parents: true}, protocol.CodeNotDirectory},
		{protocol.MkdirArgs{Path: "dlink", Parents: true}, ""},
		{protocol.MkdirArgs{Path: "dlink/inner", Parents: true}, ""},
		{protocol.MkdirArgs{Path: "/workspace", Parents: true}, ""},
		{protocol.MkdirArgs{Path: "/workspace"}, protocol.CodeFileExists},
		{protocol.MkdirArgs{Path: "../x"}, protocol.CodeInvalidPath},
	}
	for _, tt := range tests {
		wantCode(t, w.Mkdir(tt.args), tt.code, dir)
	}
	for _, d := range []string{"a", "x/y/z", "real/inner"} {
		if fi, err := os.Stat(filepath.Join(dir, d)); err != nil || !fi.IsDir() {
			t.Errorf("%s is not a directory: %v", d, err)
		}
	}
}

func TestMove(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "a.txt", "A")
	put(t, dir, "b.txt", "B")
	put(t, dir, "c.txt", "C")
	put(t, dir, "d/inner.txt", "I")
	put(t, dir, "e/x", "")
	put(t, dir, "target.txt", "T")
	symlink(t, "target.txt", filepath.Join(dir, "link"))

	tests := []struct {
		args protocol.MoveArgs
		code string
	}{
		{protocol.MoveArgs{From: "a.txt", To: "moved/deep/a.txt"}, ""},
		{protocol.MoveArgs{From: "b.txt", To: "c.txt"}, protocol.CodeFileExists},
		{protocol.MoveArgs{From: "b.txt", To: "/workspace/c.txt", Overwrite: true}, ""},
		{protocol.MoveArgs{From: "d", To: "d2"}, ""},
		{protocol.MoveArgs{From: "d2", To: "d2/sub"}, protocol.CodeInvalidArgument},
		{protocol.MoveArgs{From: "d2", To: "e", Overwrite: true}, protocol.CodeIsDirectory},
		{protocol.MoveArgs{From: "d2", To: "c.txt", Overwrite: true}, protocol.CodeNotDirectory},
		{protocol.MoveArgs{From: "link", To: "link2"}, ""},
		{protocol.MoveArgs{From: "missing", To: "x"}, protocol.CodeFileNotFound},
		{protocol.MoveArgs{From: "/workspace", To: "x"}, protocol.CodeInvalidPath},
		{protocol.MoveArgs{From: "c.txt", To: "/workspace"}, protocol.CodeInvalidPath},
		{protocol.MoveArgs{From: "c.txt", To: "../c.txt"}, protocol.CodeInvalidPath},
		{protocol.MoveArgs{From: "c.txt", To: "c.txt"}, ""},
	}
	for _, tt := range tests {
		wantCode(t, w.Move(tt.args), tt.code, dir)
	}
	checks := map[string]string{"moved/deep/a.txt": "A", "c.txt": "B", "d2/inner.txt": "I", "target.txt": "T"}
	for p, want := range checks {
		if c := hostRead(t, filepath.Join(dir, p)); c != want {
			t.Errorf("%s = %q, want %q", p, c, want)
		}
	}
	for _, gone := range []string{"a.txt", "b.txt", "d", "link"} {
		if _, err := os.Lstat(filepath.Join(dir, gone)); !os.IsNotExist(err) {
			t.Errorf("%s still exists after the move", gone)
		}
	}
	if target, err := os.Readlink(filepath.Join(dir, "link2")); err != nil || target != "target.txt" {
		t.Errorf("the moved symlink is %q, %v", target, err)
	}
}

func TestOpenRead(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxReadBytes: 4}) // streaming ignores the read cap
	put(t, dir, "f.txt", "streamed content")
	rc, fi, err := w.OpenRead("/workspace/f.txt")
	wantCode(t, err, "", dir)
	b, err := io.ReadAll(rc)
	if err != nil || string(b) != "streamed content" {
		t.Fatalf("read %q, %v", b, err)
	}
	if err := rc.Close(); err != nil {
		t.Error(err)
	}
	if fi.Size != 16 || fi.Type != protocol.FileTypeFile || fi.Path != "/workspace/f.txt" {
		t.Errorf("FileInfo = %+v", fi)
	}
	if _, ok := rc.(*os.File); ok {
		t.Error("OpenRead exposes the *os.File (its Name is the host path)")
	}
	_, _, err = w.OpenRead("/workspace")
	wantCode(t, err, protocol.CodeIsDirectory, dir)
	_, _, err = w.OpenRead("nope")
	wantCode(t, err, protocol.CodeFileNotFound, dir)
}

func TestUpload(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "old.txt", "old content")

	u, err := w.Create("up/new.bin", "")
	wantCode(t, err, "", dir)
	for range 3 {
		if _, err := u.Write([]byte("chunk;")); err != nil {
			t.Fatal(err)
		}
	}
	res, err := u.Commit()
	wantCode(t, err, "", dir)
	if res != (protocol.WriteResult{Path: "/workspace/up/new.bin", Size: 18, Created: true}) {
		t.Errorf("Commit = %+v", res)
	}
	if c := hostRead(t, filepath.Join(dir, "up/new.bin")); c != "chunk;chunk;chunk;" {
		t.Errorf("content = %q", c)
	}
	wantCode(t, u.Abort(), "", dir) // a no-op after Commit
	_, err = u.Write([]byte("late"))
	wantCode(t, err, protocol.CodeInvalidArgument, dir)

	// Abort leaves the old content.
	u, err = w.Create("old.txt", protocol.WriteOverwrite)
	wantCode(t, err, "", dir)
	u.Write([]byte("half of the new"))
	wantCode(t, u.Abort(), "", dir)
	if c := hostRead(t, filepath.Join(dir, "old.txt")); c != "old content" {
		t.Errorf("after Abort: %q", c)
	}
	_, err = u.Commit()
	wantCode(t, err, protocol.CodeInvalidArgument, dir)

	// Mode create: a file that appears during the upload is never clobbered.
	u, err = w.Create("race.txt", protocol.WriteCreate)
	wantCode(t, err, "", dir)
	u.Write([]byte("mine"))
	put(t, dir, "race.txt", "theirs")
	_, err = u.Commit()
	wantCode(t, err, protocol.CodeFileExists, dir)
	if c := hostRead(t, filepath.Join(dir, "race.txt")); c != "theirs" {
		t.Errorf("create clobbered a concurrent file: %q", c)
	}

	// An upload that never commits leaves nothing behind, not even the parents it would have made.
	for _, mode := range []string{protocol.WriteOverwrite, protocol.WriteCreate} {
		u, err = w.Create("never/made/f.bin", mode)
		wantCode(t, err, "", dir)
		u.Write([]byte("cut short"))
		wantCode(t, u.Abort(), "", dir)
		if _, err := os.Lstat(filepath.Join(dir, "never")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("an aborted upload (mode %s) left its parents: %v", mode, err)
		}
	}
	// Committed, it makes them, owned like any, and the file lands where asked.
	u, err = w.Create("late/parents/f.bin", protocol.WriteCreate)
	wantCode(t, err, "", dir)
	u.Write([]byte("made"))
	_, err = u.Commit()
	wantCode(t, err, "", dir)
	if c := hostRead(t, filepath.Join(dir, "late/parents/f.bin")); c != "made" {
		t.Errorf("late parents: %q", c)
	}
	// A file put in the parents' way meanwhile fails the commit, and it is left alone.
	u, err = w.Create("blocked/f.bin", "")
	wantCode(t, err, "", dir)
	u.Write([]byte("mine"))
	put(t, dir, "blocked", "theirs")
	_, err = u.Commit()
	wantCode(t, err, protocol.CodeNotDirectory, dir)
	if c := hostRead(t, filepath.Join(dir, "blocked")); c != "theirs" {
		t.Errorf("the file in the parents' way: %q", c)
	}

	_, err = w.Create("old.txt", protocol.WriteCreate)
	wantCode(t, err, protocol.CodeFileExists, dir)
	_, err = w.Create("up", "")
	wantCode(t, err, protocol.CodeIsDirectory, dir)
	_, err = w.Create("x", "append")
	wantCode(t, err, protocol.CodeInvalidArgument, dir)
	noTemps(t, dir)
}

func TestClosed(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	put(t, dir, "f", "x")
	w, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if w.opts.MaxReadBytes != DefaultMaxReadBytes || w.opts.MaxGrepMatches != DefaultMaxGrepMatches {
		t.Errorf("defaults not applied: %+v", w.opts)
	}
	w.Close()
	_, err = w.Read(protocol.ReadArgs{Path: "f"})
	wantCode(t, err, protocol.CodeUnavailable, dir)
	_, err = w.Write(protocol.WriteArgs{Path: "g", Content: "x"})
	wantCode(t, err, protocol.CodeUnavailable, dir)

	if _, err := Open(filepath.Join(dir, "f"), Options{}); err == nil {
		t.Error("Open on a file succeeded")
	}
}

// A name longer than a file system takes (NAME_MAX, 255 bytes) is refused before anything is done:
// a write to missing/parents/<long name> would otherwise make the parents at its commit, then fail
// on the name and leave them.
func TestLongNameChangesNothing(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	long := strings.Repeat("n", protocol.MaxNameBytes+1)
	for _, p := range []string{"made/at/commit/" + long, "made/" + long + "/f.txt"} {
		_, err := w.Write(protocol.WriteArgs{Path: p, Content: "x"})
		wantCode(t, err, protocol.CodeInvalidPath, dir)
		if !strings.Contains(err.Error(), "255") {
			t.Errorf("the refusal does not say the limit: %v", err)
		}
		_, err = w.Create(p, protocol.WriteCreate)
		wantCode(t, err, protocol.CodeInvalidPath, dir)
		err = w.Mkdir(protocol.MkdirArgs{Path: p, Parents: true})
		wantCode(t, err, protocol.CodeInvalidPath, dir)
		put(t, dir, "src.txt", "s")
		err = w.Move(protocol.MoveArgs{From: "src.txt", To: p})
		wantCode(t, err, protocol.CodeInvalidPath, dir)
	}
	if _, err := os.Lstat(filepath.Join(dir, "made")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused long name left parents: %v", err)
	}
	// 255 bytes is a name like any.
	if _, err := w.Write(protocol.WriteArgs{Path: "ok/" + long[1:], Content: "x"}); err != nil {
		t.Fatal(err)
	}
	noTemps(t, dir)
}

// A regular file named with a trailing / (or /.) is not_directory for read, download and edit, as
// open(2) answers ENOTDIR, never the file under its cleaned name; a directory so named stays
// is_directory.
func TestFileNamedAsADirectory(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "f.txt", "content\n")
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"f.txt/", "/workspace/f.txt/.", "f.txt//"} {
		_, err := w.Read(protocol.ReadArgs{Path: p})
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		_, _, err = w.OpenRead(p)
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		_, err = w.Edit(protocol.EditArgs{Path: p, Old: "content", New: "changed"})
		wantCode(t, err, protocol.CodeNotDirectory, dir)
	}
	_, err := w.Read(protocol.ReadArgs{Path: "d/"})
	wantCode(t, err, protocol.CodeIsDirectory, dir)
	// Stat, grep and tar answer the same, never describing, searching or archiving the file.
	symlink(t, "f.txt", filepath.Join(dir, "lf"))
	symlink(t, "d", filepath.Join(dir, "ld"))
	for _, p := range []string{"f.txt/", "f.txt/.", "lf/", "lf/."} {
		// A link named with a trailing / is followed, as stat(2) follows "link/": a link to a
		// file so named is ENOTDIR.
		_, err = w.Stat(p)
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		_, err = w.List(p)
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		_, err = w.Read(protocol.ReadArgs{Path: p})
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		_, _, err = w.OpenRead(p)
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		_, err = w.Grep(t.Context(), protocol.GrepArgs{Path: p, Pattern: "content"})
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		var tarred bytes.Buffer
		_, err = w.Archive(t.Context(), p, &tarred)
		wantCode(t, err, protocol.CodeNotDirectory, dir)
		if tarred.Len() != 0 {
			t.Errorf("tar of %q wrote %d bytes", p, tarred.Len())
		}
	}
	// Without the slash, stat describes the link itself.
	if fi, err := w.Stat("lf"); err != nil || fi.Type != protocol.FileTypeSymlink || fi.Target != "f.txt" {
		t.Errorf("stat lf = %+v, %v; want the link itself", fi, err)
	}
	// A link to a directory named with a trailing / is the directory, for stat and ls too.
	for _, p := range []string{"ld/", "ld/."} {
		if fi, err := w.Stat(p); err != nil || fi.Type != protocol.FileTypeDir || fi.Path != "/workspace/ld" {
			t.Errorf("stat %s = %+v, %v; want the directory ld points to", p, fi, err)
		}
		if _, err := w.List(p); err != nil {
			t.Errorf("ls %s: %v; want the directory's entries", p, err)
		}
	}
	// Followed within the workspace only: a link leading out is refused as ever, and a dangling
	// one named so does not exist.
	symlink(t, "../"+filepath.Base(dir)+"-outside", filepath.Join(dir, "lout"))
	symlink(t, "/etc", filepath.Join(dir, "labs"))
	symlink(t, "gone", filepath.Join(dir, "ldangling"))
	for _, tc := range []struct{ p, code string }{{"lout/", protocol.CodeInvalidPath}, {"labs/", protocol.CodeInvalidPath}, {"ldangling/", protocol.CodeFileNotFound}} {
		_, err = w.Stat(tc.p)
		wantCode(t, err, tc.code, dir)
		if fi, err := w.Stat(strings.TrimSuffix(tc.p, "/")); err != nil || fi.Type != protocol.FileTypeSymlink {
			t.Errorf("stat %s = %+v, %v; want the link itself", tc.p, fi, err)
		}
	}
	for _, p := range []string{"ld/", "d/", "d/."} {
		_, err = w.Stat(p)
		wantCode(t, err, "", dir)
		_, err = w.Grep(t.Context(), protocol.GrepArgs{Path: p, Pattern: "content"})
		wantCode(t, err, "", dir)
		_, err = w.Archive(t.Context(), p, io.Discard)
		wantCode(t, err, "", dir)
	}
	// changes of a file is not_directory, not an internal error.
	_, err = w.Changes(t.Context(), protocol.ChangesArgs{Path: "f.txt"})
	wantCode(t, err, protocol.CodeNotDirectory, dir)
	if c := hostRead(t, filepath.Join(dir, "f.txt")); c != "content\n" {
		t.Errorf("an edit through f.txt/ changed the file: %q", c)
	}
	if r, err := w.Read(protocol.ReadArgs{Path: "f.txt"}); err != nil || r.Content != "content\n" {
		t.Fatalf("the file itself: %+v %v", r, err)
	}
}

// TestEditResultBounded: an edit whose result would pass MaxEditBytes is payload_too_large and
// changes nothing. The result was built whole in memory first: a one-byte old text replaced
// everywhere in a file of 8 MiB by a new text of 1 MiB asked the broker for 8 TiB at once, a fatal
// out-of-memory that no recover catches, ending the broker with every sandbox on it.
func TestEditResultBounded(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{MaxEditBytes: 1 << 20})
	content := strings.Repeat("a", 64<<10)
	put(t, dir, "f.txt", content)
	_, err := w.Edit(protocol.EditArgs{Path: "f.txt", Old: "a", New: strings.Repeat("b", 1<<10), ReplaceAll: true})
	wantCode(t, err, protocol.CodeTooLarge, dir)
	if got := hostRead(t, filepath.Join(dir, "f.txt")); got != content {
		t.Fatalf("the file changed (%d bytes)", len(got))
	}
	// A result of exactly the bound is fine.
	put(t, dir, "g.txt", strings.Repeat("a", 1<<10))
	if res, err := w.Edit(protocol.EditArgs{Path: "g.txt", Old: "a", New: strings.Repeat("b", 1<<10), ReplaceAll: true}); err != nil || res.Occurrences != 1<<10 {
		t.Fatalf("a result of exactly MaxEditBytes: %+v %v", res, err)
	}
	noTemps(t, dir)
}
