package workspace

import (
	"fmt"
	"hash/maphash"
	"io/fs"
	"os"
	"path"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// Root is the sandbox path of the workspace directory itself.
const Root = protocol.WorkspaceRoot

// Defaults for the zero values of Options.
const (
	DefaultMaxReadBytes     = 8 << 20
	DefaultMaxEditBytes     = 8 << 20
	DefaultMaxGlobResults   = 10000
	DefaultMaxGrepMatches   = 1000
	DefaultMaxGrepFileBytes = 8 << 20
	DefaultMaxScanBytes     = 64 << 20
	DefaultMaxListEntries   = 10000
	DefaultMaxScanEntries   = 250000
	DefaultMaxGrepScanBytes = 256 << 20
	DefaultMaxMatchWork     = 1 << 32
	DefaultMaxGrepTime      = 10 * time.Second
)

// Options configures a Workspace. The zero value is usable: no ownership change and the default caps.
type Options struct {
	// UID and GID own every file and directory the package creates (the sandbox's host user). Zero
	// or negative leaves that id as the process created it: the broker runs as root, so root-owned
	// is what it gets anyway, and a zero-value Options never tries to chown to root on a
	// developer's machine.
	UID, GID int
	// MaxReadBytes caps one Read answer (default 8 MiB).
	MaxReadBytes int64
	// MaxEditBytes is the largest file Edit accepts (default 8 MiB).
	MaxEditBytes int64
	// MaxGlobResults caps a Glob answer (default 10000).
	MaxGlobResults int
	// MaxGrepMatches is the default and the upper bound of GrepArgs.MaxCount (default 1000).
	MaxGrepMatches int
	// MaxGrepFileBytes: Grep skips larger files (default 8 MiB).
	MaxGrepFileBytes int64
	// MaxScanBytes bounds the bytes a line-window Read scans to find its window and count lines
	// (default 64 MiB): a window deep in a huge (or sparse) file is refused instead of read through.
	MaxScanBytes int64
	// MaxListEntries caps a List answer (default 10000).
	MaxListEntries int
	// MaxScanEntries bounds the directory entries one List, Glob or Grep reads (default 250000).
	MaxScanEntries int
	// MaxGrepScanBytes bounds the file bytes one Grep reads (default 256 MiB).
	MaxGrepScanBytes int64
	// MaxMatchWork bounds the glob matching one Glob or Grep does, counted for each name tested
	// as the bytes of each pattern tried times the name's (default 2^32, about a second of a core):
	// path.Match costs about that, and a pattern of many stars and brace alternatives made each
	// name cost milliseconds.
	MaxMatchWork int64
	// MaxGrepTime bounds one Grep's time from its start, its walk and reads included, the clock
	// read as matching goes (default 10 s): a regular expression costs per byte about its compiled
	// size in Go's RE2, which has no DFA, so bytes read do not bound it.
	MaxGrepTime time.Duration
}

func (o Options) withDefaults() Options {
	if o.MaxReadBytes <= 0 {
		o.MaxReadBytes = DefaultMaxReadBytes
	}
	if o.MaxEditBytes <= 0 {
		o.MaxEditBytes = DefaultMaxEditBytes
	}
	if o.MaxGlobResults <= 0 {
		o.MaxGlobResults = DefaultMaxGlobResults
	}
	if o.MaxGrepMatches <= 0 {
		o.MaxGrepMatches = DefaultMaxGrepMatches
	}
	if o.MaxGrepFileBytes <= 0 {
		o.MaxGrepFileBytes = DefaultMaxGrepFileBytes
	}
	if o.MaxScanBytes <= 0 {
		o.MaxScanBytes = DefaultMaxScanBytes
	}
	if o.MaxListEntries <= 0 {
		o.MaxListEntries = DefaultMaxListEntries
	}
	if o.MaxScanEntries <= 0 {
		o.MaxScanEntries = DefaultMaxScanEntries
	}
	if o.MaxGrepScanBytes <= 0 {
		o.MaxGrepScanBytes = DefaultMaxGrepScanBytes
	}
	if o.MaxMatchWork <= 0 {
		o.MaxMatchWork = DefaultMaxMatchWork
	}
	if o.MaxGrepTime <= 0 {
		o.MaxGrepTime = DefaultMaxGrepTime
	}
	return o
}

// Workspace serves file operations on one workspace directory. It is safe for concurrent use.
type Workspace struct {
	root *os.Root
	opts Options
	// dir is the root directory itself, for the fast path of fastOpen (Linux); dirConn holds its
	// descriptor while it is used (withRootDir).
	dir     *os.File
	dirConn syscall.RawConn
	dirOnce sync.Once

	// locks serialize the broker's own read-modify-write cycles (Edit) against each other and
	// against commits of whole-file writes to the same path, so two agents editing one file never
	// lose an edit silently. Processes in the sandbox do not take them; they are a courtesy among
	// broker callers, not a security boundary.
	locks [64]sync.Mutex
	seed  maphash.Seed

	// live holds the relative paths of this Workspace's temporary files in use, so SweepTemps
	// never removes an upload in progress.
	liveMu sync.Mutex
	live   map[string]struct{}

	// countLookups, when a test sets it, is told of each lookup mkdirAll makes: how many path
	// components it resolves, the measure of its work on a deep path.
	countLookups func(components int)
}

// Open opens the workspace at hostDir. The directory must exist. Its error names hostDir (the
// caller's own configuration), unlike the errors of the operations, which never do.
func Open(hostDir string, opts Options) (*Workspace, error) {
	r, err := os.OpenRoot(hostDir)
	if err != nil {
		return nil, fmt.Errorf("workspace: open %s: %w", hostDir, err)
	}
	captureEscapeErr(r)
	return &Workspace{root: r, opts: opts.withDefaults(), seed: maphash.MakeSeed()}, nil
}

// Close releases the workspace directory. Operations after Close fail with code unavailable.
func (w *Workspace) Close() error {
	w.dirOnce.Do(func() {}) // waits for a first open of dir under way, and prevents a later one
	if w.dir != nil {
		w.dir.Close()
	}
	return w.root.Close()
}

// protocol.ResolvePath cleans a path lexically, so "f/", "d/." and "d/x/.." name f, d and d. The operations that
// act on what a path names check the raw path against these rules too (open(2) would refuse it),
// instead of acting on the cleaned name.

// namesDir reports whether a raw sandbox path names a directory by its last element ("", "." or
// "..").
func namesDir(p string) bool {
	switch p[strings.LastIndexByte(p, '/')+1:] {
	case "", ".", "..":
		return true
	}
	return false
}

// fileByName refuses a raw path that names a directory when what it names (fi) is not one: open(2)
// answers ENOTDIR for "f.txt/".
func fileByName(raw, sp string, fi fs.FileInfo) error {
	if !fi.IsDir() && namesDir(raw) {
		return protocol.Errorf(protocol.CodeNotDirectory, "%s is a file, named as a directory (%s ends in /, /. or /..)", sp, quote(raw))
	}
	return nil
}

// dotTail refuses a raw path whose last element, trailing slashes aside, is "." or "..", for the
// operations that remove or move what a path names: "project/typo/.." is "project", whether typo
// exists or not, and rm(1) refuses them too.
func dotTail(p string) error {
	if namesDir(strings.TrimRight(p, "/")) {
		return protocol.Errorf(protocol.CodeInvalidPath, "%s ends in /. or /..; name the directory itself", quote(p))
	}
	return nil
}

// quote shows a caller's raw path in a message (protocol.QuotePath).
func quote(s string) string { return protocol.QuotePath(s) }

// sandboxPath is the inverse of protocol.ResolvePath for a clean relative path.
func sandboxPath(rel string) string {
	if rel == "." {
		return Root
	}
	return Root + "/" + rel
}

// join appends a name to a clean relative path.
func join(dir, name string) string {
	if dir == "." {
		return name
	}
	return dir + "/" + name
}

// resolve is Resolve plus the sandbox path the messages name.
func resolve(p string) (rel, sp string, err error) {
	rel, err = protocol.ResolvePath(p)
	if err != nil {
		return "", "", err
	}
	return rel, sandboxPath(rel), nil
}

// lock takes the stripe lock of one relative path; see Workspace.locks.
func (w *Workspace) lock(rel string) func() {
	m := &w.locks[maphash.String(w.seed, rel)%uint64(len(w.locks))]
	m.Lock()
	return m.Unlock
}

// info converts an lstat result to the wire shape. target is the symlink's target, if it is one.
func info(sp string, fi fs.FileInfo, target string) protocol.FileInfo {
	out := protocol.FileInfo{
		Path:    sp,
		Name:    path.Base(sp),
		Size:    fi.Size(),
		Mode:    uint32(fi.Mode().Perm()),
		ModTime: fi.ModTime(),
	}
	switch m := fi.Mode(); {
	case m.IsRegular():
		out.Type = protocol.FileTypeFile
	case m.IsDir():
		out.Type = protocol.FileTypeDir
	case m&fs.ModeSymlink != 0:
		out.Type = protocol.FileTypeSymlink
		out.Target = target
	default:
		out.Type = protocol.FileTypeOther
	}
	return out
}

// describe is the FileInfo of rel itself (lstat), with a symlink's target read through the root.
func (w *Workspace) describe(rel, sp string, fi fs.FileInfo) protocol.FileInfo {
	var target string
	if fi.Mode()&fs.ModeSymlink != 0 {
		// A link that vanished since the lstat reports an empty target rather than failing a listing.
		target, _ = w.root.Readlink(rel)
	}
	return info(sp, fi, target)
}
