package workspace

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// Resolve cleans a path lexically, so "project/typo/.." names "project" whether or not typo
// exists. A delete or move of such a path acted on the cleaned name: a recursive delete of
// "project/typo/.." removed all of project, and a delete of "main.go/" removed the file main.go,
// where rm(1) refuses "." and ".." and the kernel answers ENOTDIR for a file named with a slash.
// Bad input changes nothing: both are refused and the tree is as it was.
func TestDeleteAndMoveRefuseDotTails(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "project/main.go", "code")
	put(t, dir, "project/sub/keep.txt", "keep")
	for _, p := range []string{"project/typo/..", "project/sub/..", "project/.", "project/sub/./", "project/main.go/.."} {
		err := w.Delete(protocol.DeleteArgs{Path: p, Recursive: true})
		wantCode(t, err, protocol.CodeInvalidPath, dir)
	}
	err := w.Delete(protocol.DeleteArgs{Path: "project/main.go/"})
	wantCode(t, err, protocol.CodeNotDirectory, dir)
	for _, a := range []protocol.MoveArgs{
		{From: "project/typo/..", To: "elsewhere"},
		{From: "project/main.go", To: "project/typo/.."},
		{From: "project/main.go", To: "project/sub/."},
	} {
		err := w.Move(a)
		wantCode(t, err, protocol.CodeInvalidPath, dir)
	}
	err = w.Move(protocol.MoveArgs{From: "project/main.go/", To: "moved.go"})
	wantCode(t, err, protocol.CodeNotDirectory, dir)
	if c := hostRead(t, filepath.Join(dir, "project/main.go")); c != "code" {
		t.Errorf("main.go: %q", c)
	}
	if c := hostRead(t, filepath.Join(dir, "project/sub/keep.txt")); c != "keep" {
		t.Errorf("keep.txt: %q", c)
	}
	if _, err := os.Lstat(filepath.Join(dir, "elsewhere")); err == nil {
		t.Error("a refused move made its destination")
	}
	// A directory named with a trailing slash is still itself.
	err = w.Delete(protocol.DeleteArgs{Path: "project/sub/", Recursive: true})
	wantCode(t, err, "", dir)
	if _, err := os.Lstat(filepath.Join(dir, "project/sub")); !os.IsNotExist(err) {
		t.Errorf("delete project/sub/: %v", err)
	}
}

// A file moved to a destination named as a directory ("f.txt/", "new/") is not_directory, as
// rename(2) answers ENOTDIR: the cleaned name replaced the file f.txt (with overwrite) or made a
// file named new. A directory may be so named, as rename(2) allows.
func TestMoveFileToADirectoryName(t *testing.T) {
	t.Parallel()
	w, dir := newWS(t, Options{})
	put(t, dir, "a.txt", "A")
	put(t, dir, "f.txt", "F")
	for _, to := range []string{"f.txt/", "new/", "f.txt//"} {
		err := w.Move(protocol.MoveArgs{From: "a.txt", To: to, Overwrite: true})
		wantCode(t, err, protocol.CodeNotDirectory, dir)
	}
	if c := hostRead(t, filepath.Join(dir, "f.txt")); c != "F" {
		t.Errorf("f.txt became %q", c)
	}
	if c := hostRead(t, filepath.Join(dir, "a.txt")); c != "A" {
		t.Errorf("a.txt became %q", c)
	}
	if _, err := os.Lstat(filepath.Join(dir, "new")); !os.IsNotExist(err) {
		t.Errorf("a file named new was made: %v", err)
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	wantCode(t, w.Move(protocol.MoveArgs{From: "d", To: "d2/"}), "", dir)
	if fi, err := os.Lstat(filepath.Join(dir, "d2")); err != nil || !fi.IsDir() {
		t.Errorf("d2: %v %v", fi, err)
	}
}
