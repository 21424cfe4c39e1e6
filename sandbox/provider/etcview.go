package provider

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// etcView is the host /etc that a sandbox on the host's root sees (etcFiles), copied into one
// directory that bwrap binds read-only on /etc: one bind instead of one per entry. bwrap 0.8 reads
// and parses /proc/self/mountinfo after every bind (to set its flags), and that file lists every
// mount on the host, each running sandbox's workspace among them: the 13 binds cost ~3.5 ms of a
// start at ~50 host mounts and ~10 ms at ~250.
//
// A copy must not go stale, so every start first compares the sources' stat (the top-level entries
// followed as bwrap followed them, the directories and regular files below them) with what they were
// when the copy was made (~40 stats), and copies them afresh if anything changed: a new sandbox sees
// the host's /etc of its start, as with a bind. A running sandbox keeps the copy it started with
// (a bind showed it an in-place edit of a file; a replaced file, the usual way /etc changes, it did
// not see either). Each copy is a generation, removed once the current one is newer and no running
// sandbox uses it; a broker's start removes them all (its sandboxes are gone by then).
//
// Under a root broker the copies live on a tmpfs of their own (private, ~2 MB per generation), so
// that the sandbox's mount table shows the /etc bind's root as /<n>/etc, not a path in the data
// dir; a broker that cannot mount keeps them in a directory, whose path its sandboxes then see.
type etcView struct {
	src string // "/etc"; a test's directory in tests
	dir string // <data-dir>/host-etc; a generation is <dir>/<n>/{etc,etc-net}

	mu     sync.Mutex
	n      int
	cur    *etcGen
	stamps []etcStamp // the sources when cur was copied
}

type etcGen struct {
	dir  string
	refs int
}

// etcStamp is what tells a changed source: an add, removal or rename in a directory changes its
// mtime, an edit in place a file's ctime, a replacement its inode.
type etcStamp struct {
	path         string
	follow       bool // stat, not lstat: a top-level entry
	dev, ino     uint64
	size         int64
	mtime, ctime unix.Timespec
	mode         uint32
	missing      bool
}

func newEtcView(src, dataDir string, asRoot bool) (*etcView, error) {
	v := &etcView{src: src, dir: filepath.Join(dataDir, "host-etc")}
	for unix.Unmount(v.dir, unix.MNT_DETACH) == nil { // an earlier broker's
	}
	if err := os.RemoveAll(v.dir); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrUnavailable, v.dir, err)
	}
	if err := os.Mkdir(v.dir, 0o711); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if asRoot {
		if err := unix.Mount("sbx-etc", v.dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0711"); err != nil {
			return nil, fmt.Errorf("%w: mount a tmpfs on %s: %v", ErrUnavailable, v.dir, err)
		}
		if err := unix.Mount("", v.dir, "", unix.MS_PRIVATE, ""); err != nil {
			_ = unix.Unmount(v.dir, unix.MNT_DETACH)
			return nil, fmt.Errorf("%w: make %s private: %v", ErrUnavailable, v.dir, err)
		}
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.refreshLocked(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return v, nil
}

// acquire returns the current copy to bind on /etc (with a mount point for /etc/resolv.conf when
// network) and the release that the sandbox's end must call.
func (v *etcView) acquire(network bool) (string, func(), error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.refreshLocked(); err != nil {
		return "", nil, fmt.Errorf("host /etc: %w", err)
	}
	g := v.cur
	g.refs++
	var once sync.Once
	release := func() {
		once.Do(func() {
			v.mu.Lock()
			defer v.mu.Unlock()
			if g.refs--; g.refs == 0 && g != v.cur {
				os.RemoveAll(g.dir)
			}
		})
	}
	if network {
		return filepath.Join(g.dir, "etc-net"), release, nil
	}
	return filepath.Join(g.dir, "etc"), release, nil
}

func (v *etcView) refreshLocked() error {
	if v.cur != nil && !stampsChanged(v.stamps) {
		return nil
	}
	v.n++
	dir := filepath.Join(v.dir, strconv.Itoa(v.n))
	stamps, err := copyEtc(v.src, dir)
	if err != nil {
		os.RemoveAll(dir)
		return err
	}
	if old := v.cur; old != nil && old.refs == 0 {
		os.RemoveAll(old.dir)
	}
	v.cur, v.stamps = &etcGen{dir: dir}, stamps
	return nil
}

func stampsChanged(stamps []etcStamp) bool {
	for _, s := range stamps {
		if now := stampOf(s.path, s.follow); now != s {
			return true
		}
	}
	return false
}

func stampOf(p string, follow bool) etcStamp {
	var st unix.Stat_t
	var err error
	if follow {
		err = unix.Stat(p, &st)
	} else {
		err = unix.Lstat(p, &st)
	}
	if err != nil {
		return etcStamp{path: p, follow: follow, missing: true}
	}
	return etcStamp{path: p, follow: follow, dev: st.Dev, ino: st.Ino, size: st.Size,
		mtime: st.Mtim, ctime: st.Ctim, mode: st.Mode}
}

// copyEtc makes a generation: etc holds etcFiles as bwrap's binds showed them (a top-level symlink
// followed, symlinks below kept as links, modes and mtimes kept; devices, fifos and sockets left
// out) and empty /etc/passwd and /etc/group for the sandbox's own to be bound on; etc-net the same
// and an empty /etc/resolv.conf for the host's. It returns the sources' stamps, taken before each
// is read, so that a change during the copy is seen at the next start.
func copyEtc(src, gen string) ([]etcStamp, error) {
	if err := os.Mkdir(gen, 0o711); err != nil {
		return nil, err
	}
	etc, etcNet := filepath.Join(gen, "etc"), filepath.Join(gen, "etc-net")
	if err := mkdirParents(gen, etc); err != nil {
		return nil, err
	}
	var stamps []etcStamp
	for _, name := range etcFiles {
		name = name[len("/etc/"):]
		f := filepath.Join(src, name)
		s := stampOf(f, true)
		stamps = append(stamps, s)
		if s.missing || !reachable(f) {
			continue
		}
		dst := filepath.Join(etc, name)
		if err := mkdirParents(etc, filepath.Dir(dst)); err != nil {
			return nil, err
		}
		var err error
		if stamps, err = copyEntry(f, dst, true, stamps); err != nil {
			return nil, err
		}
	}
	for _, name := range []string{"passwd", "group"} {
		if err := os.WriteFile(filepath.Join(etc, name), nil, 0o644); err != nil {
			return nil, err
		}
	}
	// etc-net from etc, which does not change while it is copied.
	if _, err := copyEntry(etc, etcNet, true, nil); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(etcNet, "resolv.conf"), nil, 0o644); err != nil {
		return nil, err
	}
	return stamps, nil
}

// reachable reports whether a path's target lies under directories every user may search: bwrap
// resolved a bind's source as the sandbox's uid, and the broker (root) must not copy what that uid
// could not have reached through a symlink to a private directory.
func reachable(p string) bool {
	target, err := filepath.EvalSymlinks(p)
	if err != nil {
		return false
	}
	for d := filepath.Dir(target); ; d = filepath.Dir(d) {
		var st unix.Stat_t
		if unix.Stat(d, &st) != nil || st.Mode&0o001 == 0 {
			return false
		}
		if d == "/" {
			return true
		}
	}
}

// mkdirParents makes the directories between root and dir (etc/ssl) as the host's /etc has them: 0755.
func mkdirParents(root, dir string) error {
	if dir == root {
		return nil
	}
	if err := mkdirParents(root, filepath.Dir(dir)); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return os.Chmod(dir, 0o755)
}

// copyEntry copies src to dst and appends the stamps of src and of the directories and regular
// files below it. A file the broker may not read is left out: the sandbox could not read it either.
func copyEntry(src, dst string, follow bool, stamps []etcStamp) ([]etcStamp, error) {
	s := stampOf(src, follow)
	if !follow {
		// Symlinks below the top are links in the copy: their own change changes the directory.
		if s.missing || s.mode&unix.S_IFMT == unix.S_IFLNK {
			if !s.missing {
				target, err := os.Readlink(src)
				if err != nil {
					return stamps, err
				}
				return stamps, os.Symlink(target, dst)
			}
			return stamps, nil
		}
		stamps = append(stamps, s)
	}
	perm := os.FileMode(s.mode & 0o777)
	switch s.mode & unix.S_IFMT {
	case unix.S_IFDIR:
		entries, err := os.ReadDir(src)
		if errors.Is(err, fs.ErrPermission) {
			return stamps, nil
		}
		if err != nil {
			return stamps, err
		}
		if err := os.Mkdir(dst, 0o700); err != nil {
			return stamps, err
		}
		for _, e := range entries {
			if stamps, err = copyEntry(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name()), false, stamps); err != nil {
				return stamps, err
			}
		}
		if err := os.Chmod(dst, perm); err != nil {
			return stamps, err
		}
	case unix.S_IFREG:
		in, err := os.Open(src)
		if errors.Is(err, fs.ErrPermission) {
			return stamps, nil
		}
		if err != nil {
			return stamps, err
		}
		defer in.Close()
		out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return stamps, err
		}
		_, err = io.Copy(out, in)
		if err == nil {
			err = out.Chmod(perm)
		}
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return stamps, err
		}
	default:
		return stamps, nil
	}
	return stamps, unix.UtimesNanoAt(unix.AT_FDCWD, dst, []unix.Timespec{s.mtime, s.mtime}, unix.AT_SYMLINK_NOFOLLOW)
}
