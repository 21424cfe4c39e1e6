// Package tartree moves file trees as tar streams: Add writes a tree found through an os.Root into
// a tar stream, and Extract unpacks a tar stream into an os.Root, refusing hostile archives. The
// broker (into and out of a sandbox's workspace) and sbctl (into and out of a local directory) both
// use it, so the two ends of a copy follow the same rules: modes and mtimes kept, symlinks copied as
// symlinks and never followed out of the root, no device nodes, FIFOs or hard links leaving the
// target, memory flat whatever the size. It owns no paths of its own: every name it touches is
// relative to the os.Root it is given, and it imports nothing of ours but protocol and membudget
// (what it holds in memory is drawn from a budget its caller may give it).
package tartree

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/protocol"
)

// MaxNameBytes is the longest entry name or link target Extract accepts (PATH_MAX).
const MaxNameBytes = 4096

// Stats count what a copy moved.
type Stats struct {
	Files    int   `json:"files"`
	Dirs     int   `json:"dirs"`
	Symlinks int   `json:"symlinks"`
	Bytes    int64 `json:"bytes"` // file content
	// Skipped counts what Add left out: FIFOs, sockets and devices.
	Skipped int `json:"skipped,omitempty"`
}

// EntryError is a file system error on one entry: Name is its archive name (relative to the root),
// Err the cause, which may carry a host path and is for the caller to translate.
type EntryError struct {
	Name string
	Err  error
}

func (e *EntryError) Error() string { return fmt.Sprintf("%s: %v", e.Name, e.Err) }
func (e *EntryError) Unwrap() error { return e.Err }

// refuse is the answer to a hostile or unusable archive: invalid_argument, naming the entry.
func refuse(name, format string, args ...any) error {
	return protocol.Errorf(protocol.CodeInvalidArgument, "the archive was refused at entry %s: %s; nothing outside the target directory was changed",
		quote(name), fmt.Sprintf(format, args...))
}

// quote shows an archive's name in a message: escaped (so control characters cannot reach a
// terminal) and cut, so that a huge name cannot make the message huge.
func quote(s string) string {
	const shown = 200
	if len(s) > shown {
		return fmt.Sprintf("%q...", s[:shown])
	}
	return fmt.Sprintf("%q", s)
}

// ExtractOptions tune Extract.
type ExtractOptions struct {
	// UID and GID own what Extract creates when positive (the sandbox's host user); the archive's
	// owners are ignored.
	UID, GID int
	// As, when set, replaces the first component of every name (and of hard links' targets):
	// copying a tree "as" another name, the way cp does when the destination does not exist.
	As string
}

// maxDirs bounds the directories one extraction remembers (their modes and mtimes are applied at
// the end): each is a real directory on disk, but the list lives in the broker's memory.
var maxDirs = 200_000

// maxNamesRemembered bounds the bytes of names one extraction remembers: its directories' and the
// symlinks it created (an entry below one is refused). maxDirs counts directories, but a name may
// be 4096 bytes, and each symlink costs only an inode: without it one archive made the broker hold
// a few GB of names.
var maxNamesRemembered int64 = 32 << 20

// What an extraction keeps beside each name it remembers, drawn from its caller's budget with the
// name: a directory's dirMeta in dirs and its dirAt entry, with the spare capacity a growing slice
// and map carry (about 120 bytes of heap per directory of short names,
// TestExtractDrawsWhatItRemembersOfEachDirectory); a symbolic link's entry in links.
const (
	dirKept  = 144
	linkKept = 64
)

// dirMeta is a directory's mode and mtime, applied once everything inside it is written.
type dirMeta struct {
	name  string
	mode  fs.FileMode
	mtime time.Time
}

// Extract unpacks the tar stream r into root. Every name is relative to root; an entry that is
// absolute, climbs with "..", has control characters or invalid UTF-8 in its name, is a device
// node, a FIFO or a sparse file, is a hard link leaving the archive's tree, or goes through a
// symbolic link the archive itself created is refused with an invalid_argument error, and
// extraction stops there. Whatever the archive says, nothing outside root changes: every operation goes through the os.Root, which
// never follows a link out of it, or (on Linux) through directories opened from it one component
// at a time without following any link. Entries before a refused one stay extracted. Regular files and
// symlinks replace what is at their name (a directory is never replaced); the archive's owners are
// ignored. Symlinks keep their target text verbatim and their own mtime is not set.
func Extract(ctx context.Context, root *os.Root, r io.Reader, opt ExtractOptions) (Stats, error) {
	var st Stats
	tr := tar.NewReader(r)
	// links are the symlinks this archive created: an entry below one of them would be written
	// through it (the classic "link, then a file through the link" attack).
	links := map[string]bool{}
	var remembered int64 // bytes of the names in links and dirs (maxNamesRemembered)
	// The caller's budget, shared with other operations, may be spent before this one's is: it
	// is drawn for each name and what is kept beside it (kept), which is most of it for short
	// names.
	meter := membudget.From(ctx)
	var drawn int64
	defer func() { meter.Shrink(drawn) }()
	remember := func(name string, kept int64) error {
		cost := nameCost(name)
		if remembered+cost > maxNamesRemembered {
			return refuse(name, "the archive has more directories and symbolic links than one extraction remembers (%d MiB of their names); copy the tree in parts", maxNamesRemembered>>20)
		}
		if err := meter.Grow(cost + kept); err != nil {
			return err
		}
		remembered += cost
		drawn += cost + kept
		return nil
	}
	forgetLink := func(name string) {
		if links[name] {
			delete(links, name)
			remembered -= nameCost(name)
			drawn -= nameCost(name) + linkKept
			meter.Shrink(nameCost(name) + linkKept)
		}
	}
	var dirs []dirMeta
	// dirAt indexes dirs by name: an archive that names one directory a million times (no disk
	// used, so no quota stops it) keeps one entry, the last one's mode and mtime, like tar.
	dirAt := map[string]int{}
	// t does the writing: on Linux through open directory descriptors, elsewhere through root.
	t := newTree(root, opt)
	defer t.close()
	buf := make([]byte, copyBuffer)
	for {
		if err := ctx.Err(); err != nil {
			return st, err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil && !errors.Is(err, tar.ErrInsecurePath) {
			if ctx.Err() != nil {
				return st, ctx.Err()
			}
			return st, readErr(err)
		}
		name, err := entryName(hdr.Name, opt.As)
		if err != nil {
			return st, err
		}
		if name == "." {
			continue // the archive's own top ("./"): root exists already
		}
		if through := underLink(name, links); through != "" {
			return st, refuse(hdr.Name, "it lies under %s, a symbolic link created earlier in the same archive", quote(through))
		}
		if isSparse(hdr) {
			return st, refuse(hdr.Name, "it is a sparse file, whose holes would be written out as zeros (a few bytes of archive can declare terabytes); archive it without --sparse")
		}
		perm := fs.FileMode(hdr.Mode) & fs.ModePerm
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := t.dir(name); err != nil {
				return st, err
			}
			forgetLink(name)
			if i, ok := dirAt[name]; ok {
				dirs[i] = dirMeta{name, perm, hdr.ModTime}
				continue
			}
			if len(dirs) >= maxDirs {
				return st, refuse(hdr.Name, "the archive has more than %d directories; copy the tree in parts", maxDirs)
			}
			if err := remember(name, dirKept); err != nil {
				return st, err
			}
			dirAt[name] = len(dirs)
			dirs = append(dirs, dirMeta{name, perm, hdr.ModTime})
			st.Dirs++
		case tar.TypeReg, '\x00':
			n, err := t.file(ctx, name, tr, hdr.Size, perm, hdr.ModTime, buf)
			st.Bytes += n
			if err != nil {
				return st, err
			}
			forgetLink(name)
			st.Files++
		case tar.TypeSymlink:
			if err := checkText(hdr.Linkname); err != nil {
				return st, refuse(hdr.Name, "its link target %s", err)
			}
			if hdr.Linkname == "" {
				return st, refuse(hdr.Name, "the symbolic link has an empty target")
			}
			if err := t.symlink(hdr.Linkname, name); err != nil {
				return st, err
			}
			if !links[name] {
				if err := remember(name, linkKept); err != nil {
					return st, err
				}
			}
			links[name] = true
			st.Symlinks++
		case tar.TypeLink:
			old, problem := cleanName(hdr.Linkname, opt.As)
			if problem != "" {
				return st, refuse(hdr.Name, "it is a hard link to %s, which is not in the archive's tree: %s", quote(hdr.Linkname), problem)
			}
			if old == "." || underLink(old, links) != "" || links[old] {
				return st, refuse(hdr.Name, "it is a hard link to %s, which is not a file of the archive", quote(hdr.Linkname))
			}
			// The target must be on disk (written, not still queued) before it is looked at.
			if err := t.flush(); err != nil {
				return st, err
			}
			if fi, err := root.Lstat(old); err != nil || !fi.Mode().IsRegular() {
				return st, refuse(hdr.Name, "it is a hard link to %s, which is not a regular file extracted before it", quote(hdr.Linkname))
			}
			if err := t.link(old, name); err != nil {
				return st, err
			}
			st.Files++
		case tar.TypeChar, tar.TypeBlock:
			return st, refuse(hdr.Name, "device nodes are never extracted")
		case tar.TypeFifo:
			return st, refuse(hdr.Name, "FIFOs are never extracted")
		case tar.TypeXGlobalHeader:
			continue
		default:
			return st, refuse(hdr.Name, "entries of tar type %q are not supported (only files, directories, symbolic links and hard links)", hdr.Typeflag)
		}
	}
	// Every file written (and the first error of writing one), then the directories, last and
	// deepest first: writing inside a directory changes its mtime, and a read-only mode would
	// stop the writes.
	if err := t.flush(); err != nil {
		return st, err
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		if err := root.Chmod(d.name, d.mode); err != nil {
			return st, &EntryError{d.name, err}
		}
		if !d.mtime.IsZero() {
			if err := root.Chtimes(d.name, d.mtime, d.mtime); err != nil {
				return st, &EntryError{d.name, err}
			}
		}
	}
	return st, nil
}

// isSparse reports a sparse entry: GNU's old type 'S', or PAX's GNU.sparse records (formats 0.0 to
// 1.0), which archive/tar reads back as the file's full size with its holes as zeros.
func isSparse(hdr *tar.Header) bool {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

// readErr is the answer for a stream archive/tar cannot read.
func readErr(err error) error {
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF):
		return protocol.Errorf(protocol.CodeInvalidArgument, "the archive ends in the middle of an entry (truncated); send the whole tar stream")
	case errors.Is(err, tar.ErrFieldTooLong):
		return protocol.Errorf(protocol.CodeInvalidArgument, "the archive has a header over 1 MiB (a name or extended header too large); it was refused")
	case errors.Is(err, tar.ErrHeader):
		return protocol.Errorf(protocol.CodeInvalidArgument, "the stream is not a valid tar archive (bad header); send an uncompressed tar stream")
	}
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return pe
	}
	// archive/tar's own errors name no path; a reader's error (the connection) is its cause.
	return fmt.Errorf("reading the archive: %w", err)
}

// entryName checks an archive name and returns it clean and relative ("." for the top), with its
// first component replaced by as when set.
func entryName(raw, as string) (string, error) {
	name, problem := cleanName(raw, as)
	if problem != "" {
		return "", refuse(raw, "%s", problem)
	}
	return name, nil
}

// cleanName is entryName's name, or what is wrong with raw (a hard link's target is named by
// the same rules, and its refusal names the link, not the target).
func cleanName(raw, as string) (name, problem string) {
	if raw == "" {
		return "", "the name is empty"
	}
	if err := checkText(raw); err != nil {
		return "", "its name " + err.Error()
	}
	if strings.HasPrefix(raw, "/") {
		return "", "the name is absolute; names must be relative to the target directory"
	}
	var parts []string
	for _, c := range strings.Split(raw, "/") {
		switch c {
		case "", ".":
			continue
		case "..":
			return "", "the name climbs out with \"..\""
		}
		parts = append(parts, c)
	}
	if len(parts) == 0 {
		return ".", ""
	}
	if as != "" {
		parts[0] = as
	}
	return strings.Join(parts, "/"), ""
}

// checkText refuses what no name here may hold: invalid UTF-8, control characters (which would
// reach a person's terminal in listings and messages), or more than MaxNameBytes.
func checkText(s string) error {
	if len(s) > MaxNameBytes {
		return fmt.Errorf("is %d bytes long; the limit is %d", len(s), MaxNameBytes)
	}
	if !utf8.ValidString(s) {
		return errors.New("is not valid UTF-8")
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return errors.New("contains control characters")
		}
	}
	return nil
}

// underLink returns the symlink of links that is a proper parent of name, or "".
func underLink(name string, links map[string]bool) string {
	if len(links) == 0 {
		return ""
	}
	for p := path.Dir(name); p != "."; p = path.Dir(p) {
		if links[p] {
			return p
		}
	}
	return ""
}

// tree is where Extract writes: every name is relative to the root and already checked by
// entryName and underLink. A directory is never replaced; a file or a symlink replaces what is at
// its name; nothing is ever written through a symbolic link.
type tree interface {
	// dir makes name a directory (with its parents), replacing a symlink there.
	dir(name string) error
	// file writes the size bytes r holds to a new file at name, then its owner, mode and mtime.
	// It may return before the file is on disk (see flush), once r's bytes are taken.
	file(ctx context.Context, name string, r io.Reader, size int64, perm fs.FileMode, mtime time.Time, buf []byte) (int64, error)
	// symlink makes name a symbolic link to target, owned like the rest.
	symlink(target, name string) error
	// link makes name a hard link to old, an earlier regular file of the archive.
	link(old, name string) error
	// flush returns once every file is on disk, with the first error of writing one.
	flush() error
	close()
}

// rootTree writes through the os.Root, each operation walking its path from the root: the
// portable way, used where open directory descriptors are not (see dirfd_linux.go).
type rootTree struct {
	root *os.Root
	opt  ExtractOptions
	// known are the directories this extraction made or checked, so that the thousands of files of
	// one directory do not each check their parents again. A directory the sandbox swaps for a link
	// meanwhile still cannot lead out: every operation goes through the root.
	known map[string]bool
}

func newRootTree(root *os.Root, opt ExtractOptions) *rootTree {
	return &rootTree{root: root, opt: opt, known: map[string]bool{}}
}

func (t *rootTree) dir(name string) error {
	if err := mkdirAll(t.root, name, t.opt); err != nil {
		return err
	}
	markKnown(t.known, name)
	return nil
}

func (t *rootTree) file(ctx context.Context, name string, r io.Reader, _ int64, perm fs.FileMode, mtime time.Time, buf []byte) (int64, error) {
	if err := parents(t.root, name, t.opt, t.known); err != nil {
		return 0, err
	}
	return writeFile(ctx, t.root, name, r, perm, mtime, t.opt, buf)
}

func (t *rootTree) symlink(target, name string) error {
	if err := parents(t.root, name, t.opt, t.known); err != nil {
		return err
	}
	if err := create(t.root, name, func() error { return t.root.Symlink(target, name) }); err != nil {
		return err
	}
	return lchown(t.root, name, t.opt)
}

func (t *rootTree) link(old, name string) error {
	if err := parents(t.root, name, t.opt, t.known); err != nil {
		return err
	}
	return create(t.root, name, func() error { return t.root.Link(old, name) })
}

func (t *rootTree) flush() error { return nil }

func (t *rootTree) close() {}

// mkdirAll creates name and its parents through the root; an existing directory is fine.
func mkdirAll(root *os.Root, name string, opt ExtractOptions) error {
	err := root.Mkdir(name, 0o700)
	if errors.Is(err, fs.ErrNotExist) && path.Dir(name) != "." {
		if err := mkdirAll(root, path.Dir(name), opt); err != nil {
			return err
		}
		err = root.Mkdir(name, 0o700)
	}
	switch {
	case err == nil:
		if err := root.Chmod(name, 0o755); err != nil {
			return &EntryError{name, err}
		}
		return lchown(root, name, opt)
	case errors.Is(err, fs.ErrExist):
		fi, serr := root.Lstat(name)
		if serr != nil {
			return &EntryError{name, serr}
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			// A link where the archive has a directory: the directory replaces it, so that nothing
			// below is written through the link.
			if err := root.Remove(name); err != nil {
				return &EntryError{name, err}
			}
			return mkdirAll(root, name, opt)
		}
		if !fi.IsDir() {
			return &EntryError{name, syscall.ENOTDIR}
		}
		return nil
	}
	return &EntryError{name, err}
}

// parents makes sure name's parent directories exist.
func parents(root *os.Root, name string, opt ExtractOptions, known map[string]bool) error {
	d := path.Dir(name)
	if d == "." || known[d] {
		return nil
	}
	if err := mkdirAll(root, d, opt); err != nil {
		return err
	}
	markKnown(known, d)
	return nil
}

func markKnown(known map[string]bool, d string) {
	for ; d != "." && !known[d]; d = path.Dir(d) {
		known[d] = true
	}
}

// create runs mk, which creates name exclusively (O_EXCL, symlink, link: none follows a link at
// name); when something is there already it is removed, unless it is a directory, and mk runs
// once more. So a link at name is replaced, never written through.
func create(root *os.Root, name string, mk func() error) error {
	err := mk()
	if errors.Is(err, fs.ErrExist) {
		fi, lerr := root.Lstat(name)
		switch {
		case lerr == nil && fi.IsDir():
			return &EntryError{name, syscall.EISDIR}
		case lerr == nil:
			if rerr := root.Remove(name); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
				return &EntryError{name, rerr}
			}
		case !errors.Is(lerr, fs.ErrNotExist):
			return &EntryError{name, lerr}
		}
		err = mk()
	}
	if err != nil {
		return &EntryError{name, err}
	}
	return nil
}

// writeFile creates name exclusively (O_EXCL never follows a link, planted before or meanwhile)
// and copies the entry's bytes into it.
func writeFile(ctx context.Context, root *os.Root, name string, r io.Reader, perm fs.FileMode, mtime time.Time, opt ExtractOptions, buf []byte) (int64, error) {
	var f *os.File
	if err := create(root, name, func() (err error) {
		f, err = root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		return err
	}); err != nil {
		return 0, err
	}
	n, err := copyCtx(ctx, f, r, buf)
	if err == nil && (opt.UID > 0 || opt.GID > 0) {
		err = f.Chown(owner(opt.UID), owner(opt.GID))
	}
	if err == nil {
		err = f.Chmod(perm)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && !mtime.IsZero() {
		err = root.Chtimes(name, mtime, mtime)
	}
	return n, fileErr(ctx, name, err)
}

// fileErr sorts an error of writing one file: the archive's or the context's as they are, the
// file system's as an EntryError naming the entry.
func fileErr(ctx context.Context, name string, err error) error {
	if err == nil {
		return nil
	}
	var pe *protocol.Error
	if errors.As(err, &pe) || ctx.Err() != nil {
		return err
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return readErr(err)
	}
	return &EntryError{name, err}
}

// copyCtx copies r to w in buf-sized steps, stopping when ctx ends.
func copyCtx(ctx context.Context, w io.Writer, r io.Reader, buf []byte) (int64, error) {
	var n int64
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		k, rerr := r.Read(buf)
		if k > 0 {
			m, werr := w.Write(buf[:k])
			n += int64(m)
			if werr != nil {
				return n, werr
			}
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, readErr(rerr)
		}
	}
}

func lchown(root *os.Root, name string, opt ExtractOptions) error {
	if opt.UID <= 0 && opt.GID <= 0 {
		return nil
	}
	if err := root.Lchown(name, owner(opt.UID), owner(opt.GID)); err != nil {
		return &EntryError{name, err}
	}
	return nil
}

func owner(id int) int {
	if id <= 0 {
		return -1
	}
	return id
}

// copyBuffer is the buffer Add and Extract copy file contents through.
const copyBuffer = 256 << 10

// nameCost is what holding one name costs: its bytes and its string header.
func nameCost(n string) int64 { return membudget.StringCost(n) }

func join(dir, name string) string {
	if dir == "." || dir == "" {
		return name
	}
	return dir + "/" + name
}
