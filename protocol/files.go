package protocol

import (
	"encoding/base64"
	"time"
	"unicode/utf8"
)

// File operation arguments and results: the dataplane's file ops, also returned by backend.Local, so
// that the remote and local backends answer alike. Paths are sandbox paths: absolute under /workspace,
// or relative to it.

// WorkspaceRoot is the sandbox path of the workspace: the root of every file operation's path and
// exec's default working directory, in every kind of sandbox.
const WorkspaceRoot = "/workspace"

// File types in FileInfo.Type.
const (
	FileTypeFile    = "file"
	FileTypeDir     = "dir"
	FileTypeSymlink = "symlink"
	FileTypeOther   = "other"
)

// FileInfo describes one file. A symlink is described itself (lstat), with its target.
type FileInfo struct {
	Path    string    `json:"path"`
	Name    string    `json:"name"`
	Type    string    `json:"type"`
	Size    int64     `json:"size"`
	Mode    uint32    `json:"mode"` // permission bits, e.g. 0o644 = 420
	ModTime time.Time `json:"mod_time"`
	Target  string    `json:"target,omitempty"`
}

// Content encodings for file bodies carried in JSON.
const (
	EncodingUTF8   = "utf-8"
	EncodingBase64 = "base64"
)

// StatArgs asks for one file's FileInfo.
type StatArgs struct {
	Path string `json:"path"`
}

// LsArgs lists a directory (not recursive). Entries come sorted by name.
type LsArgs struct {
	Path string `json:"path"`
}

// LsResult is a directory listing: at most the broker's cap (10,000) of entries, the first by name.
type LsResult struct {
	Entries []FileInfo `json:"entries"`
	// Truncated says the directory has more entries than the answer holds (or more than the broker
	// reads for one listing); narrow it with glob.
	Truncated bool `json:"truncated,omitempty"`
}

// ReadArgs reads a regular file, either a byte range (Offset, Length) or a line window (LineOffset,
// LineLimit); not both. With neither, the whole file, up to the broker's read cap.
type ReadArgs struct {
	Path string `json:"path"`
	// Offset and Length select bytes; Length 0 means to the end (capped).
	Offset int64 `json:"offset,omitempty"`
	Length int64 `json:"length,omitempty"`
	// LineOffset (0-based) and LineLimit (0 = all, capped) select lines.
	LineOffset int `json:"line_offset,omitempty"`
	LineLimit  int `json:"line_limit,omitempty"`
}

// ReadResult is file content. Content is UTF-8 text unless Encoding is "base64" (binary content).
type ReadResult struct {
	Path     string `json:"path"`
	Content  string `json:"content"`
	Encoding string `json:"encoding"`
	// Size is the whole file's size in bytes.
	Size int64 `json:"size"`
	// TotalLines is the file's line count; set for line-window reads.
	TotalLines int `json:"total_lines,omitempty"`
	// TotalLinesPartial says the broker stopped counting at its scan cap (a line window scans at
	// most the first 64 MiB of a file): the file has at least TotalLines lines.
	TotalLinesPartial bool `json:"total_lines_partial,omitempty"`
	// Truncated says the answer stopped at the read cap (or, for a line window, the scan cap)
	// before the requested end.
	Truncated bool `json:"truncated,omitempty"`
}

// ReadHead is a read's answer on the wire: the content is the answer frame's body
// (FrameAnswerBody), raw bytes, never JSON text. Clients that show text check it is UTF-8 themselves
// (the Go backend turns other content into base64, as ReadResult says).
type ReadHead struct {
	Path              string `json:"path"`
	Size              int64  `json:"size"`
	TotalLines        int    `json:"total_lines,omitempty"`
	TotalLinesPartial bool   `json:"total_lines_partial,omitempty"`
	Truncated         bool   `json:"truncated,omitempty"`
}

// Result is the ReadResult that head and content make, as the Go backends answer it: content that
// is not UTF-8 comes base64-encoded. content is not copied: it must not change afterwards.
func (h ReadHead) Result(content string) ReadResult {
	r := ReadResult{Path: h.Path, Size: h.Size, TotalLines: h.TotalLines, TotalLinesPartial: h.TotalLinesPartial, Truncated: h.Truncated,
		Content: content, Encoding: EncodingUTF8}
	if !utf8.ValidString(content) {
		r.Content, r.Encoding = base64.StdEncoding.EncodeToString([]byte(content)), EncodingBase64
	}
	return r
}

// WriteHead is a write's args on the wire: the content is the request frame's body
// (FrameRequestBody), raw bytes.
type WriteHead struct {
	Path string `json:"path"`
	Mode string `json:"mode,omitempty"` // "overwrite" (default) or "create"
}

// Write modes.
const (
	WriteOverwrite = "overwrite" // create or replace (the default)
	WriteCreate    = "create"    // fail with file_exists if the path exists
)

// WriteArgs writes a whole file atomically (a reader never sees half of it). Parents are created.
type WriteArgs struct {
	Path     string `json:"path"`
	Content  string `json:"content"`
	Encoding string `json:"encoding,omitempty"` // "utf-8" (default) or "base64"
	Mode     string `json:"mode,omitempty"`     // "overwrite" (default) or "create"
}

// Body splits a write into what travels as its request frame's JSON and what travels as the frame's
// body: the content as raw bytes (base64 content decoded). An unknown encoding or bad base64 is
// invalid_argument.
func (a WriteArgs) Body() (WriteHead, string, error) {
	head := WriteHead{Path: a.Path, Mode: a.Mode}
	switch a.Encoding {
	case "", EncodingUTF8:
		return head, a.Content, nil
	case EncodingBase64:
		b, err := base64.StdEncoding.DecodeString(a.Content)
		if err != nil {
			return head, "", Errorf(CodeInvalidArgument, "content is not valid base64: %v", err)
		}
		return head, string(b), nil
	}
	return head, "", Errorf(CodeInvalidArgument, "unknown encoding %q; use %q or %q", a.Encoding, EncodingUTF8, EncodingBase64)
}

// WriteResult reports the written file.
type WriteResult struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	Created bool   `json:"created"`
}

// EditArgs replaces an exact string. Old must occur exactly once unless ReplaceAll.
type EditArgs struct {
	Path       string `json:"path"`
	Old        string `json:"old"`
	New        string `json:"new"`
	ReplaceAll bool   `json:"replace_all,omitempty"`
}

// EditResult says how many occurrences were replaced.
type EditResult struct {
	Path        string `json:"path"`
	Occurrences int    `json:"occurrences"`
}

// DeleteArgs removes a file, a symlink (not its target) or, with Recursive, a directory tree. An empty
// directory is removed without Recursive.
type DeleteArgs struct {
	Path      string `json:"path"`
	Recursive bool   `json:"recursive,omitempty"`
}

// MkdirArgs creates a directory; with Parents, missing parents too and no error if it exists.
type MkdirArgs struct {
	Path    string `json:"path"`
	Parents bool   `json:"parents,omitempty"`
}

// MoveArgs renames a file or directory. Without Overwrite an existing destination is file_exists.
type MoveArgs struct {
	From      string `json:"from"`
	To        string `json:"to"`
	Overwrite bool   `json:"overwrite,omitempty"`
}

// PathResult is the answer of operations that only name the path they acted on.
type PathResult struct {
	Path string `json:"path"`
}

// GlobArgs matches Pattern (with ** for any number of directories) under Path (default /workspace).
type GlobArgs struct {
	Pattern string `json:"pattern"`
	Path    string `json:"path,omitempty"`
}

// GlobResult lists matches sorted by path.
type GlobResult struct {
	Files     []FileInfo `json:"files"`
	Truncated bool       `json:"truncated,omitempty"`
}

// GrepArgs searches file contents under Path (a file or a directory, default /workspace).
type GrepArgs struct {
	Pattern string `json:"pattern"`
	Path    string `json:"path,omitempty"`
	// Glob filters files by name pattern relative to Path (e.g. "*.go", "**/*.py").
	Glob string `json:"glob,omitempty"`
	// Regex makes Pattern an RE2 regular expression; otherwise it is a literal string.
	Regex      bool `json:"regex,omitempty"`
	IgnoreCase bool `json:"ignore_case,omitempty"`
	// MaxCount caps the matches returned (0 = the broker's cap).
	MaxCount int `json:"max_count,omitempty"`
}

// GrepMatch is one matching line.
type GrepMatch struct {
	Path string `json:"path"`
	Line int    `json:"line"` // 1-based
	Text string `json:"text"`
}

// GrepResult lists matches in path order, then line order. Binary files are skipped.
type GrepResult struct {
	Matches   []GrepMatch `json:"matches"`
	Truncated bool        `json:"truncated,omitempty"`
}
