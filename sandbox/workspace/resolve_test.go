package workspace

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

func TestResolve(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in, want string // want "" means invalid_path
	}{
		{"/workspace", "."},
		{"/workspace/", "."},
		{".", "."},
		{"./", "."},
		{"/workspace/a/b.txt", "a/b.txt"},
		{"a/b.txt", "a/b.txt"},
		{"a//b/./c/", "a/b/c"},
		{"/workspace/a/../b", "b"},
		{"/workspace/../workspace/x", "x"},
		{"a/../../workspace", ""},
		{"workspace/x", "workspace/x"},
		{"..", ""},
		{"../x", ""},
		{"a/../../x", ""},
		{"/workspace/..", ""},
		{"/workspace/../../etc/passwd", ""},
		{"/etc/passwd", ""},
		{"/", ""},
		{"/workspacex/y", ""},
		{"/work", ""},
		{"", ""},
		{"a\x00b", ""},
		{"\xff\xfe", ""},
		{strings.Repeat("a", 5000), ""},
		{strings.Repeat("a/", 2048), strings.Repeat("a/", 2047) + "a"},
		{"..foo", "..foo"},
		{"a\\..\\..\\x", "a\\..\\..\\x"}, // backslash is a name character on Unix
	}
	for _, tt := range tests {
		got, err := protocol.ResolvePath(tt.in)
		if tt.want == "" {
			if codeOf(err) != protocol.CodeInvalidPath {
				t.Errorf("ResolvePath(%q) = %q, %v; want invalid_path", tt.in, got, err)
			}
			if err != nil && len(err.Error()) > 400 {
				t.Errorf("ResolvePath(%q): message is %d bytes long", tt.in, len(err.Error()))
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ResolvePath(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

// FuzzResolve checks that whatever Resolve accepts is a clean relative path that stays inside.
func FuzzResolve(f *testing.F) {
	for _, s := range []string{
		"/workspace", "/workspace/a", "a/b", "..", "../x", "/workspace/../etc", "/etc/passwd",
		"a/../..", "./../x", "/workspace/./../workspace/y", "a\x00", "\xff", "//workspace//x",
		"/workspace/a/../../..", "....", ".../x", "a/./b/../../c", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		rel, err := protocol.ResolvePath(in)
		if err != nil {
			if codeOf(err) != protocol.CodeInvalidPath {
				t.Fatalf("ResolvePath(%q): error code %q, want invalid_path", in, codeOf(err))
			}
			return
		}
		switch {
		case rel == "":
			t.Fatalf("ResolvePath(%q) = empty", in)
		case path.IsAbs(rel):
			t.Fatalf("ResolvePath(%q) = %q is absolute", in, rel)
		case rel == ".." || strings.HasPrefix(rel, "../"):
			t.Fatalf("ResolvePath(%q) = %q escapes", in, rel)
		case path.Clean(rel) != rel:
			t.Fatalf("ResolvePath(%q) = %q is not clean", in, rel)
		case strings.IndexByte(rel, 0) >= 0:
			t.Fatalf("ResolvePath(%q) = %q contains NUL", in, rel)
		}
		// The round trip names the same place.
		if back, err := protocol.ResolvePath(sandboxPath(rel)); err != nil || back != rel {
			t.Fatalf("ResolvePath(sandboxPath(%q)) = %q, %v", rel, back, err)
		}
	})
}

// fsErr is the one place raw errors become protocol errors; a root user cannot provoke EACCES or
// ENOSPC on demand, so the mapping is checked directly.
func TestFSErr(t *testing.T) {
	t.Parallel()
	w, _ := newWS(t, Options{}) // Open captures os.Root's escape error
	_, escErr := w.root.Lstat("../x")
	tests := []struct {
		err  error
		code string
	}{
		{&fs.PathError{Op: "openat", Path: "/host/secret/dir/x", Err: syscall.ENOENT}, protocol.CodeFileNotFound},
		{&fs.PathError{Op: "openat", Path: "/host/secret/dir/x", Err: syscall.EACCES}, protocol.CodePermissionDenied},
		{syscall.EPERM, protocol.CodePermissionDenied},
		{syscall.EROFS, protocol.CodePermissionDenied},
		{syscall.ENOTDIR, protocol.CodeNotDirectory},
		{syscall.EISDIR, protocol.CodeIsDirectory},
		{&os.LinkError{Op: "renameat", Old: "/host/a", New: "/host/b", Err: syscall.EEXIST}, protocol.CodeFileExists},
		{syscall.ENOTEMPTY, protocol.CodeInvalidArgument},
		{syscall.ELOOP, protocol.CodeInvalidPath},
		{syscall.ENAMETOOLONG, protocol.CodeInvalidPath},
		{syscall.ENOSPC, protocol.CodeTooLarge},
		{syscall.EDQUOT, protocol.CodeTooLarge},
		{syscall.EXDEV, protocol.CodeInvalidArgument},
		{syscall.EIO, protocol.CodeInternal},
		{escErr, protocol.CodeInvalidPath},
		{errOutside, protocol.CodeInvalidPath},
		{os.ErrClosed, protocol.CodeUnavailable},
		{fmt.Errorf("wrapped: %w", fs.ErrNotExist), protocol.CodeFileNotFound},
		{errors.New("something odd at /host/secret/dir"), protocol.CodeInternal},
		{protocol.Errorf(protocol.CodeNoMatch, "kept"), protocol.CodeNoMatch},
	}
	for _, tt := range tests {
		err := fsErr("/workspace/x", tt.err)
		if codeOf(err) != tt.code {
			t.Errorf("fsErr(%v) = %v, want code %s", tt.err, err, tt.code)
		}
		if strings.Contains(err.Error(), "/host") {
			t.Errorf("fsErr(%v) = %v shows the host path", tt.err, err)
		}
		if tt.code != protocol.CodeNoMatch && !strings.Contains(err.Error(), "/workspace/x") && tt.code != protocol.CodeUnavailable {
			t.Errorf("fsErr(%v) = %v does not name the sandbox path", tt.err, err)
		}
	}
	if fsErr("/workspace/x", nil) != nil {
		t.Error("fsErr(nil) is not nil")
	}
}
