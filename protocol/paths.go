package protocol

import (
	"fmt"
	"path"
	"strings"
	"unicode/utf8"
)

// The lexical rules of a sandbox path, which the broker applies to every path it is given and a
// client may apply before it sends one (sbctl does, so that only a path wrong whatever the sandbox
// holds is a usage error). They live here, not in sandbox/workspace, because clients build for
// every platform and the workspace's file operations only for Linux.

// MaxPathBytes is the longest sandbox path ResolvePath accepts.
const MaxPathBytes = 4096

// MaxNameBytes is the longest name of one path element ResolvePath accepts: NAME_MAX, what ext4 and
// tmpfs take. Refused lexically, a name too long changes nothing; found by the kernel, it would fail
// an operation after the missing parents it makes.
const MaxNameBytes = 255

// ResolvePath turns a sandbox path (absolute under /workspace, or relative to it) into the clean path
// relative to the workspace directory ("." for /workspace itself), or an invalid_path error. It is
// purely lexical: symlinks are the business of the operation that uses the result, which must go
// through an os.Root.
func ResolvePath(sandboxPath string) (string, error) {
	switch {
	case sandboxPath == "":
		return "", Errorf(CodeInvalidPath, "the path is empty; give a path under %s", WorkspaceRoot)
	case len(sandboxPath) > MaxPathBytes:
		return "", Errorf(CodeInvalidPath, "the path is %d bytes long; the limit is %d", len(sandboxPath), MaxPathBytes)
	case strings.IndexByte(sandboxPath, 0) >= 0:
		return "", Errorf(CodeInvalidPath, "the path %s contains a NUL byte", QuotePath(sandboxPath))
	case !utf8.ValidString(sandboxPath):
		return "", Errorf(CodeInvalidPath, "the path %s is not valid UTF-8", QuotePath(sandboxPath))
	}
	if n := longestName(sandboxPath); n > MaxNameBytes {
		return "", Errorf(CodeInvalidPath, "a name in the path %s is %d bytes long; the limit is %d", QuotePath(sandboxPath), n, MaxNameBytes)
	}
	p := path.Clean(sandboxPath)
	if path.IsAbs(p) {
		if p == WorkspaceRoot {
			return ".", nil
		}
		if rel, ok := strings.CutPrefix(p, WorkspaceRoot+"/"); ok {
			return rel, nil
		}
		return "", Errorf(CodeInvalidPath, "%s is outside %s; give a path under %s or relative to it", QuotePath(sandboxPath), WorkspaceRoot, WorkspaceRoot)
	}
	if p == ".." || strings.HasPrefix(p, "../") {
		return "", Errorf(CodeInvalidPath, "%s leaves %s; give a path under %s or relative to it", QuotePath(sandboxPath), WorkspaceRoot, WorkspaceRoot)
	}
	return p, nil
}

// longestName is the length of p's longest element.
func longestName(p string) int {
	longest := 0
	for name := range strings.SplitSeq(p, "/") {
		longest = max(longest, len(name))
	}
	return longest
}

// QuotePath shows a caller's raw path in a message: escaped, and cut so that a hostile path cannot make
// the message huge.
func QuotePath(s string) string {
	const shown = 200
	if len(s) > shown {
		return fmt.Sprintf("%q...", s[:shown])
	}
	return fmt.Sprintf("%q", s)
}
