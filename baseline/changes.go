package baseline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"strings"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/protocol"
)

// Options bound a Changes scan: the broker's own file operations are bounded in entries, bytes and
// answers (docs/operations.md).
type Options struct {
	MaxEntries int   // files, symlinks and directories looked at
	MaxBytes   int64 // bytes read to hash
	MaxChanges int   // changes answered
	// Only, when set, limits the comparison to these paths instead of the whole tree.
	Only []string
}

// Defaults for Options left zero.
const (
	DefaultMaxEntries = 250_000
	DefaultMaxBytes   = 4 << 30
	DefaultMaxChanges = 100_000
)

// statInfo is what a scan needs of an lstat.
type statInfo struct {
	mode    fs.FileMode
	size    int64
	mtimeNS int64
	ctimeNS int64
}

// Changes compares the tree at root with its baseline record (root/.sbx/baseline) and returns the
// files and symlinks that differ, by git blob id: added, modified (content, mode or type) and
// deleted. It never follows a symbolic link (a link is compared by its target's text), skips .git
// entries, the tree's .sbx, and FIFOs, sockets and devices, and reads through root only.
//
// A file is taken as unchanged without reading it when its size and mtime are the record's and
// its ctime (which no process can set) is older than the record itself: so a change made after the
// push is always seen, even one that restores the mtime. Anything else is read and hashed.
//
// A missing record is a file_not_found error; a damaged one wraps ErrDamaged and is an
// invalid_argument error.
func Changes(ctx context.Context, root *os.Root, opt Options) (protocol.ChangesResult, error) {
	if opt.MaxEntries <= 0 {
		opt.MaxEntries = DefaultMaxEntries
	}
	if opt.MaxBytes <= 0 {
		opt.MaxBytes = DefaultMaxBytes
	}
	if opt.MaxChanges <= 0 {
		opt.MaxChanges = DefaultMaxChanges
	}
	res := protocol.ChangesResult{Changes: []protocol.Change{}}
	maxRecorded := opt.MaxEntries + opt.MaxChanges
	if len(opt.Only) > 0 {
		maxRecorded = 0 // no walk: the record is only looked up, and its size bounds it
	}
	// What the scan holds (the record, the names it reads, the paths to visit, the answer) is
	// drawn from the caller's budget, shared with other operations, as well as bounded here.
	mem := membudget.From(ctx)
	rec, recTime, err := readRecord(root, maxRecorded, mem)
	if err != nil {
		return res, err
	}
	res.Commit = rec.Commit
	s := &scanner{ctx: ctx, mem: mem, root: root, rec: rec, recTime: recTime, opt: opt, res: &res,
		seen: make([]bool, len(rec.Entries)), h: NewHasher(), buf: make([]byte, 256<<10)}
	if len(opt.Only) > 0 {
		return res, s.only(opt.Only)
	}
	if err := s.walk(); err != nil {
		return res, err
	}
	for i, e := range rec.Entries {
		if !s.seen[i] {
			if err := s.add(protocol.Change{Path: e.Path, Status: protocol.ChangeDeleted}); err != nil {
				return res, err
			}
		}
	}
	slices.SortFunc(res.Changes, func(a, b protocol.Change) int { return strings.Compare(a.Path, b.Path) })
	return res, nil
}

// readRecord reads the record without following a link at its place, and returns its mtime. The
// sandbox may have put anything there: a FIFO is opened without waiting for a writer, then refused.
// A record of more than maxEntries entries (when not 0) is refused before it is parsed: no walk
// could compare more (MaxEntries looked at, MaxChanges answered), and each costs the broker memory.
func readRecord(root *os.Root, maxEntries int, mem membudget.Meter) (Record, int64, error) {
	f, err := root.OpenFile(protocol.BaselineRecord, os.O_RDONLY|noFollow|nonBlock, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return Record{}, 0, protocol.Errorf(protocol.CodeFileNotFound, "nothing was pushed here: there is no push baseline (%s); push a repository first (sbctl push)", protocol.BaselineRecord)
	}
	if err != nil {
		return Record{}, 0, protocol.Errorf(protocol.CodeInvalidArgument, "%v: %s cannot be opened (%v); push again with --force", ErrDamaged, protocol.BaselineRecord, errors.Unwrap(err))
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return Record{}, 0, protocol.Errorf(protocol.CodeInvalidArgument, "%v: %s is not a file; push again with --force", ErrDamaged, protocol.BaselineRecord)
	}
	if fi.Size() > MaxRecordBytes {
		return Record{}, 0, protocol.Errorf(protocol.CodeInvalidArgument, "%v: %s is over %d MiB; push again with --force", ErrDamaged, protocol.BaselineRecord, MaxRecordBytes>>20)
	}
	// Its bytes, then what is parsed from them: about as much again.
	if err := mem.Grow(2 * fi.Size()); err != nil {
		return Record{}, 0, err
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxRecordBytes+1))
	if err != nil {
		return Record{}, 0, fmt.Errorf("reading %s: %w", protocol.BaselineRecord, err)
	}
	if n := bytes.Count(b, []byte("\n")) - 2; maxEntries > 0 && n > maxEntries {
		return Record{}, 0, errCut(fmt.Sprintf("%d recorded paths", maxEntries))
	}
	rec, err := Parse(b)
	if err != nil {
		return Record{}, 0, protocol.Errorf(protocol.CodeInvalidArgument, "%v; push again with --force to record a new one", err)
	}
	return rec, fi.ModTime().UnixNano(), nil
}

type scanner struct {
	ctx     context.Context
	mem     membudget.Meter
	root    *os.Root
	rec     Record
	recTime int64
	opt     Options
	res     *protocol.ChangesResult
	seen    []bool
	entries int
	answer  int // bytes of the answer built (maxAnswerBytes)
	h       *Hasher
	buf     []byte
}

func (s *scanner) add(c protocol.Change) error {
	if len(s.res.Changes) >= s.opt.MaxChanges {
		return errCut(fmt.Sprintf("%d paths", s.opt.MaxChanges))
	}
	if err := s.spend(len(c.Path) + len(c.OID) + len(c.Mode) + 64); err != nil {
		return err
	}
	s.res.Changes = append(s.res.Changes, c)
	return nil
}

// maxAnswerBytes bounds the answer one walk builds in memory, its changes and its skipped names
// together: their count is bounded, but a path may be 4096 bytes (and a skipped name, quoted, four
// times its bytes), so 100,000 changes could be 400 MB.
var maxAnswerBytes = 32 << 20

// spend counts n bytes of answer.
func (s *scanner) spend(n int) error {
	if s.answer += n; s.answer > maxAnswerBytes {
		return errCut(fmt.Sprintf("%d MiB of answer", maxAnswerBytes>>20))
	}
	return s.mem.Grow(int64(n))
}

// skip lists p among the names no git path can be.
func (s *scanner) skip(p string) error {
	q := fmt.Sprintf("%q", p)
	if err := s.spend(len(q) + 16); err != nil {
		return err
	}
	s.res.Skipped = append(s.res.Skipped, q)
	return nil
}

// maxPendingBytes bounds the paths of the directories a walk has found and not yet visited. Their
// count is bounded by MaxEntries, but a path may be 4096 bytes: a sandbox's tree of many
// directories deep down made one walk hold up to a GB of paths.
var maxPendingBytes = 32 << 20

// walk visits the tree depth first, a directory at a time.
func (s *scanner) walk() error {
	stack := []string{"."}
	pending := 0 // bytes of the paths in stack
	for len(stack) > 0 {
		rel := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		pending -= len(rel)
		if rel != "." {
			s.mem.Shrink(membudget.StringCost(rel))
		}
		if err := s.ctx.Err(); err != nil {
			return err
		}
		d, err := s.root.OpenFile(rel, os.O_RDONLY|noFollow|dirFlag, 0)
		if err != nil {
			if rel == "." {
				return fmt.Errorf("opening the tree: %w", err)
			}
			continue // swapped for something else since it was listed: its paths count as gone
		}
		names, err := s.names(d, rel)
		if err != nil {
			d.Close()
			return err
		}
		for _, name := range names {
			if strings.EqualFold(name, ".git") || (rel == "." && name == ".sbx") {
				continue
			}
			p := name
			if rel != "." {
				p = rel + "/" + name
			}
			st, err := lstatAt(d, s.root, p, name)
			if err != nil {
				continue // gone since the listing
			}
			switch {
			case st.mode.IsDir():
				if ValidPath(p) != nil {
					if err := s.skip(p); err != nil {
						d.Close()
						return err
					}
					continue
				}
				if pending += len(p); pending > maxPendingBytes {
					d.Close()
					return errCut(fmt.Sprintf("%d MiB of directory paths to visit", maxPendingBytes>>20))
				}
				if err := s.mem.Grow(membudget.StringCost(p)); err != nil {
					d.Close()
					return err
				}
				stack = append(stack, p)
			case st.mode.IsRegular(), st.mode&fs.ModeSymlink != 0:
				if ValidPath(p) != nil {
					if err := s.skip(p); err != nil {
						d.Close()
						return err
					}
					continue
				}
				if err := s.file(d, p, name, st); err != nil {
					d.Close()
					return err
				}
			}
		}
		d.Close()
	}
	return nil
}

// names reads the directory d's names, sorted, counting each against MaxEntries as it is read: in
// batches, so that a directory of far more entries than the bound (a sandbox chooses its tree) is
// never read whole first.
func (s *scanner) names(d *os.File, rel string) ([]string, error) {
	var names []string
	for {
		batch, err := d.Readdirnames(256)
		if s.entries += len(batch); s.entries > s.opt.MaxEntries {
			return nil, errCut(fmt.Sprintf("%d entries", s.opt.MaxEntries))
		}
		var cost int64
		for _, n := range batch {
			cost += membudget.StringCost(n)
		}
		if err := s.mem.Grow(cost); err != nil {
			return nil, err
		}
		names = append(names, batch...)
		switch {
		case errors.Is(err, io.EOF) || err == nil && len(batch) == 0:
			slices.Sort(names)
			return names, nil
		case err != nil:
			return nil, fmt.Errorf("listing %s: %w", rel, err)
		}
	}
}

// file compares one file or symlink with its entry.
func (s *scanner) file(d *os.File, p, name string, st statInfo) error {
	s.res.Scanned++
	mode := ModeFile
	switch {
	case st.mode&fs.ModeSymlink != 0:
		mode = ModeSymlink
	case st.mode&0o100 != 0:
		mode = ModeExec
	}
	i, found := slices.BinarySearchFunc(s.rec.Entries, p, func(e Entry, p string) int { return strings.Compare(e.Path, p) })
	var e Entry
	if found {
		s.seen[i] = true
		e = s.rec.Entries[i]
		if e.Mode == mode && e.Size == st.size && e.MtimeNS != 0 && e.MtimeNS == st.mtimeNS && st.ctimeNS < s.recTime {
			return nil
		}
	}
	oid, size, err := s.hash(d, p, name, mode)
	if err != nil {
		return err
	}
	if found && e.Mode == mode && e.OID == oid {
		return nil // touched, same content
	}
	status := protocol.ChangeAdded
	if found {
		status = protocol.ChangeModified
	}
	return s.add(protocol.Change{Path: p, Status: status, Mode: mode, OID: oid, Size: size})
}

// hash returns the blob id of a file's content or a symlink's target; "" when the file changed
// while it was read (the caller fetches it anyway).
func (s *scanner) hash(d *os.File, p, name, mode string) (string, int64, error) {
	if mode == ModeSymlink {
		target, err := readlinkAt(d, s.root, p, name)
		if err != nil {
			return "", 0, nil
		}
		return BlobID([]byte(target)), int64(len(target)), nil
	}
	f, err := openAt(d, s.root, p, name)
	if err != nil {
		return "", 0, nil // gone or swapped since the lstat
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return "", 0, nil
	}
	size := fi.Size()
	if s.res.Hashed+size > s.opt.MaxBytes {
		return "", 0, errCut(fmt.Sprintf("%d GiB of changed files to read", s.opt.MaxBytes>>30))
	}
	s.h.Start(size)
	var n int64
	for n < size {
		if err := s.ctx.Err(); err != nil {
			return "", 0, err
		}
		k, err := f.Read(s.buf[:min(int64(len(s.buf)), size-n)])
		s.h.Write(s.buf[:k])
		n += int64(k)
		if err != nil {
			break
		}
	}
	s.res.Hashed += n
	if n != size {
		return "", size, nil
	}
	return s.h.Sum(), size, nil
}

// only compares the given paths, each through its parent directory (which must be a directory all
// the way up, never a link: the walk would not reach the path either).
func (s *scanner) only(paths []string) error {
	if len(paths) > protocol.MaxChangesPaths {
		return protocol.Errorf(protocol.CodeInvalidArgument, "paths names %d paths; the limit is %d (leave it out to compare the whole tree)", len(paths), protocol.MaxChangesPaths)
	}
	for _, p := range paths {
		if err := ValidPath(p); err != nil {
			return protocol.Errorf(protocol.CodeInvalidArgument, "paths: %q: %v", p, err)
		}
	}
	sorted := slices.Clone(paths)
	slices.Sort(sorted)
	sorted = slices.Compact(sorted)
	for _, p := range sorted {
		if err := s.ctx.Err(); err != nil {
			return err
		}
		if p == ".sbx" || strings.HasPrefix(p, ".sbx/") {
			continue
		}
		present, err := s.onePath(p)
		if err != nil {
			return err
		}
		if !present {
			if _, ok := s.rec.Find(p); ok {
				if err := s.add(protocol.Change{Path: p, Status: protocol.ChangeDeleted}); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// onePath compares p when it is a file or a symlink below real directories; present false when it
// is not there as one.
func (s *scanner) onePath(p string) (bool, error) {
	dir, name := ".", p
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		dir, name = p[:i], p[i+1:]
		for d := dir; d != "."; {
			fi, err := s.root.Lstat(d)
			if err != nil || !fi.IsDir() {
				return false, nil
			}
			j := strings.LastIndexByte(d, '/')
			if j < 0 {
				break
			}
			d = d[:j]
		}
	}
	d, err := s.root.OpenFile(dir, os.O_RDONLY|noFollow|dirFlag, 0)
	if err != nil {
		return false, nil
	}
	defer d.Close()
	st, err := lstatAt(d, s.root, p, name)
	if err != nil || !(st.mode.IsRegular() || st.mode&fs.ModeSymlink != 0) {
		return false, nil
	}
	return true, s.file(d, p, name, st)
}
