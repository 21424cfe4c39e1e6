// Package baseline is the record a push leaves in a sandbox (sbctl push) and the comparison of a
// tree against it. The record lists every file and symlink the push sent, with its git mode, git
// blob id, size and mtime, and the commit it came from; Changes walks a tree through an os.Root
// and reports what differs from the record, by git blob id, without git: the broker runs it on a
// workspace for the dataplane's changes operation, so that a delegate with fs:read alone can see
// an agent's work, and no git binary (nor its configuration, which would run commands) is needed
// or trusted inside a sandbox. sbctl writes the record. The package owns no paths: every name is
// relative to the root it is given, and it imports nothing of ours but protocol.
package baseline

import (
	"bufio"
	"bytes"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/sbxbroker/broker/protocol"
)

// The git modes a record and a change use.
const (
	ModeFile    = "100644"
	ModeExec    = "100755"
	ModeSymlink = "120000"
)

// header starts every record; the version is the format's.
const header = "sbx-baseline 1"

// MaxRecordBytes bounds the record Changes reads (a sandbox can write anything there).
const MaxRecordBytes = 64 << 20

// Entry is one path of a record.
type Entry struct {
	Path string
	Mode string // ModeFile, ModeExec or ModeSymlink
	OID  string // the git blob id, 40 hex digits
	Size int64
	// MtimeNS is the mtime the push gave the file (unix nanoseconds); 0 when unknown (symlinks).
	MtimeNS int64
}

// Record is a push's baseline: the commit it came from and its entries, sorted by path.
type Record struct {
	Commit  string
	Entries []Entry
}

// ErrDamaged is wrapped by every error about a record that cannot be read: the sandbox can write
// anything at its place.
var ErrDamaged = errors.New("the push baseline recorded in the sandbox is damaged")

// Write writes r in the record format: a header line, a commit line, then one line per entry:
// "MODE OID SIZE MTIME_NS PATH". Paths are never quoted: ValidPath refuses what a line cannot
// hold.
func (r Record) Write(w io.Writer) error {
	bw := bufio.NewWriterSize(w, 64<<10)
	fmt.Fprintf(bw, "%s\ncommit %s\n", header, r.Commit)
	for _, e := range r.Entries {
		fmt.Fprintf(bw, "%s %s %d %d %s\n", e.Mode, e.OID, e.Size, e.MtimeNS, e.Path)
	}
	return bw.Flush()
}

// Parse reads a record, refusing anything Write would not have written (wrapping ErrDamaged).
func Parse(b []byte) (Record, error) {
	var r Record
	bad := func(line int, what string) (Record, error) {
		return Record{}, fmt.Errorf("%w (line %d: %s)", ErrDamaged, line, what)
	}
	// Lines are taken one at a time and entries grow as they are read: the record is the
	// sandbox's to write, and sizing anything by its line count before checking a line let a
	// record of newlines cost GBs.
	nlines := bytes.Count(b, []byte("\n")) + 1
	first, rest, _ := bytes.Cut(b, []byte("\n"))
	second, rest, _ := bytes.Cut(rest, []byte("\n"))
	if nlines < 3 || string(first) != header {
		return bad(1, "not a baseline record")
	}
	c, ok := strings.CutPrefix(string(second), "commit ")
	if !ok || !isOID(c) {
		return bad(2, "no commit id")
	}
	r.Commit = c
	if b[len(b)-1] != '\n' {
		return bad(nlines, "the record does not end with a newline")
	}
	for i := 0; len(rest) > 0; i++ {
		var l []byte
		l, rest, _ = bytes.Cut(rest, []byte("\n"))
		var f [5]string
		rest, ok := string(l), true
		for k := 0; k < 4 && ok; k++ {
			f[k], rest, ok = strings.Cut(rest, " ")
		}
		if !ok {
			return bad(i+3, "an entry needs mode, blob id, size, mtime and path")
		}
		f[4] = rest
		e := Entry{Mode: f[0], OID: f[1], Path: f[4]}
		var err1, err2 error
		e.Size, err1 = strconv.ParseInt(f[2], 10, 64)
		e.MtimeNS, err2 = strconv.ParseInt(f[3], 10, 64)
		switch {
		case e.Mode != ModeFile && e.Mode != ModeExec && e.Mode != ModeSymlink:
			return bad(i+3, "unknown mode")
		case !isOID(e.OID):
			return bad(i+3, "bad blob id")
		case err1 != nil || err2 != nil || e.Size < 0:
			return bad(i+3, "bad size or mtime")
		case ValidPath(e.Path) != nil:
			return bad(i+3, "bad path")
		case len(r.Entries) > 0 && r.Entries[len(r.Entries)-1].Path >= e.Path:
			return bad(i+3, "paths out of order")
		}
		r.Entries = append(r.Entries, e)
	}
	return r, nil
}

// Find returns the entry at path, if any.
func (r Record) Find(path string) (Entry, bool) {
	i, ok := slices.BinarySearchFunc(r.Entries, path, func(e Entry, p string) int { return strings.Compare(e.Path, p) })
	if !ok {
		return Entry{}, false
	}
	return r.Entries[i], true
}

func isOID(s string) bool {
	if len(s) != 40 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// ValidPath says whether p can be a path of a record (and of a tar entry, and of a git tree on
// every side): relative, slash-separated, clean, no ".git" component (nor a name that Windows or
// macOS reads as .git or as a way up: foreignName), no control characters, valid UTF-8, at most
// 4096 bytes.
func ValidPath(p string) error {
	switch {
	case p == "":
		return errors.New("the path is empty")
	case len(p) > 4096:
		return errors.New("the path is over 4096 bytes")
	case !utf8.ValidString(p):
		return errors.New("the path is not valid UTF-8")
	case strings.HasPrefix(p, "/"):
		return errors.New("the path is absolute")
	}
	for i := 0; i < len(p); i++ {
		if c := p[i]; c < 0x20 || c == 0x7f {
			return errors.New("the path has control characters")
		}
		if p[i] >= 0x80 { // multi-byte: C1 controls are U+0080..U+009F
			for _, r := range p[i:] {
				if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
					return errors.New("the path has control characters")
				}
			}
			break
		}
	}
	for rest := p; ; {
		c, more, found := strings.Cut(rest, "/")
		switch c {
		case "", ".", "..":
			return errors.New("the path is not clean (empty, . or .. components)")
		}
		if len(c) == 4 && strings.EqualFold(c, ".git") {
			return errors.New("the path goes into a .git directory")
		}
		if why := foreignName(c); why != "" {
			return errors.New(why)
		}
		if !found {
			return nil
		}
		rest = more
	}
}

// Hasher computes git blob ids: Start with the content's size, write exactly that many bytes, Sum.
type Hasher struct{ h hash.Hash }

// NewHasher returns a Hasher.
func NewHasher() *Hasher { return &Hasher{h: sha1.New()} }

// Start begins a blob of size bytes.
func (h *Hasher) Start(size int64) {
	h.h.Reset()
	fmt.Fprintf(h.h, "blob %d\x00", size)
}

func (h *Hasher) Write(p []byte) (int, error) { return h.h.Write(p) }

// Sum is the blob id of what was written since Start.
func (h *Hasher) Sum() string { return hex.EncodeToString(h.h.Sum(nil)) }

// BlobID is the git blob id of b.
func BlobID(b []byte) string {
	h := NewHasher()
	h.Start(int64(len(b)))
	h.Write(b)
	return h.Sum()
}

// errCut is the protocol error for a scan over its budget.
func errCut(what string) error {
	return protocol.Errorf(protocol.CodeTooLarge, "the tree's changes since the push pass %s; push again (or copy the tree with sbctl cp)", what)
}

// foreignName says why a path component, harmless as a Linux name, is not one on a file system
// where sbctl pull may write it into a person's repository, or "": NTFS drops trailing dots and
// spaces, reads "name:stream" as name and "GIT~1" as the short name of .git, and Windows takes a
// backslash for a separator (so "x\..\.git\hooks" climbs into .git); HFS+ ignores some invisible
// code points. A hook written into .git runs at the person's next commit. These are the names git
// itself refuses (core.protectNTFS, core.protectHFS); a backslash alone (a\b) stays valid.
func foreignName(c string) string {
	for part := range strings.SplitSeq(c, `\`) {
		if part != "" && strings.Contains(part, ".") && strings.TrimRight(part, ". ") == "" {
			return "the path has a component that Windows reads as . or .. (dots and spaces between backslashes)"
		}
		name, _, _ := strings.Cut(part, ":") // an NTFS stream of name
		name = strings.TrimRight(name, ". ")
		if strings.EqualFold(name, ".git") || strings.EqualFold(name, "git~1") {
			return "the path has a component that Windows reads as .git"
		}
		if strings.EqualFold(strings.Map(dropHFSIgnorable, part), ".git") {
			return "the path has a component that macOS reads as .git"
		}
	}
	return ""
}

// dropHFSIgnorable drops the code points HFS+ ignores in names (as git's is_hfs_dotgit does).
func dropHFSIgnorable(r rune) rune {
	switch {
	case r >= 0x200c && r <= 0x200f, r >= 0x202a && r <= 0x202e, r >= 0x206a && r <= 0x206f, r == 0xfeff:
		return -1
	}
	return r
}
