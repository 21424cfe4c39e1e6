//go:build linux

package tartree

import (
	"context"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// forceRoot makes newTree walk from the os.Root instead (the tests run the hostile archives on both).
var forceRoot = false

// newTree: on Linux (the broker, and sbctl on Linux) Extract writes through open directory
// descriptors: a tar stream names the files of one directory one after another, and walking each
// name from the root (os.Root does, one openat per component, plus one more walk to set the mtime)
// was most of the broker's time on a 10,000-file push.
func newTree(root *os.Root, opt ExtractOptions) tree {
	if forceRoot {
		return newRootTree(root, opt)
	}
	top, err := root.Open(".")
	if err != nil {
		return newRootTree(root, opt)
	}
	// The os.File stays referenced (so not finalized) while its descriptor is in use.
	fd, err := unix.Dup(int(top.Fd()))
	top.Close()
	if err != nil {
		return newRootTree(root, opt)
	}
	d := newDirRef(fd)
	return &fdTree{root: root, top: d, curName: ".", cur: d.hold(), opt: opt}
}

// fdTree keeps the directory the last entry went into open (cur, named curName relative to the
// root) and creates the next entry's file relative to it: one openat for a file, none for its
// directory, and owner, mode and mtime set on the open file. A directory is reached from the root
// (or from cur when it lies below it) one component at a time, each opened with
// O_DIRECTORY|O_NOFOLLOW relative to the one before: a symbolic link is never followed, whether the
// archive, the sandbox or a person put it there, so every descriptor held is a directory that was
// inside the root when it was opened. A sandbox that renames a held directory elsewhere meanwhile
// gets the next files in it, where it is now: still inside its own workspace (a rename cannot leave
// a mount), so nothing it could not write itself. Files are created with O_CREAT|O_EXCL|O_NOFOLLOW
// and what is in the way is removed first (never a directory), so no link is written through.
// Files of up to maxQueued bytes are written by a few goroutines behind the stream's reading
// (writers_linux.go), each keeping its directory open until it is written; at most the root's,
// cur's, one walking descriptor and those of the directories with files in flight are open at once.
type fdTree struct {
	root    *os.Root // hard links' targets are resolved through it
	top     *dirRef  // the root directory itself
	curName string
	cur     *dirRef
	opt     ExtractOptions
	w       writers // the files' writing, behind the reading of the stream (writers_linux.go)
}

func (t *fdTree) close() {
	t.w.stop()
	t.cur.release()
	t.top.release()
}

// setCur makes d, the directory name, the current one, releasing the one before.
func (t *fdTree) setCur(name string, d *dirRef) {
	if t.cur != nil && t.cur != d {
		t.cur.release()
	}
	t.curName, t.cur = name, d
}

// open returns the directory name, making it and its parents where missing (replacing symbolic
// links in the way), and keeps it as the current directory.
func (t *fdTree) open(name string) (*dirRef, error) {
	if name == "." {
		return t.top, nil
	}
	if name == t.curName {
		return t.cur, nil
	}
	base, rest, done := t.top.fd, name, "."
	if t.curName != "." && strings.HasPrefix(name, t.curName+"/") {
		base, rest, done = t.cur.fd, name[len(t.curName)+1:], t.curName
	}
	fd := base
	for rest != "" {
		c := rest
		if i := strings.IndexByte(rest, '/'); i >= 0 {
			c, rest = rest[:i], rest[i+1:]
		} else {
			rest = ""
		}
		done = join(done, c)
		next, err := t.step(fd, c, done)
		if fd != base {
			unix.Close(fd)
		}
		if err != nil {
			return nil, err
		}
		fd = next
	}
	d := newDirRef(fd)
	t.setCur(name, d)
	return d, nil
}

// step opens the directory c inside dirfd (named name from the root), creating it when missing
// and replacing a symbolic link there by a new directory. Something else that is not a directory
// is an ENOTDIR error. The tries are bounded: a sandbox swapping things at c meanwhile gets an error,
// never a loop. Opening an existing directory needs nothing of the files still being written;
// anything else waits for them first, so that what the archive put at c before is there.
func (t *fdTree) step(dirfd int, c, name string) (int, error) {
	const flags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	var err error
	flushed := false
	for range 4 {
		var fd int
		fd, err = openat(dirfd, c, flags, 0)
		if err != nil && err != unix.EINTR && !flushed {
			flushed = true
			if ferr := t.w.flush(); ferr != nil {
				return -1, ferr
			}
			continue
		}
		switch err {
		case nil:
			return fd, nil
		case unix.ENOENT:
			switch err = unix.Mkdirat(dirfd, c, 0o700); err {
			case nil:
				if fd, err = openat(dirfd, c, flags, 0); err != nil {
					return -1, &EntryError{name, err}
				}
				// Made 0700 so that nothing else uses it half made; opened, it gets its mode.
				err = unix.Fchmod(fd, 0o755)
				if err == nil && (t.opt.UID > 0 || t.opt.GID > 0) {
					err = unix.Fchown(fd, owner(t.opt.UID), owner(t.opt.GID))
				}
				if err != nil {
					unix.Close(fd)
					return -1, &EntryError{name, err}
				}
				return fd, nil
			case unix.EEXIST:
				continue // made meanwhile: open it
			}
			return -1, &EntryError{name, err}
		case unix.ELOOP, unix.ENOTDIR:
			var st unix.Stat_t
			if serr := unix.Fstatat(dirfd, c, &st, unix.AT_SYMLINK_NOFOLLOW); serr != nil {
				if serr == unix.ENOENT {
					continue
				}
				return -1, &EntryError{name, serr}
			}
			if st.Mode&unix.S_IFMT != unix.S_IFLNK {
				return -1, &EntryError{name, unix.ENOTDIR}
			}
			// A link where the archive has a directory: the directory replaces it, so that nothing
			// below is written through the link.
			if rerr := unix.Unlinkat(dirfd, c, 0); rerr != nil && rerr != unix.ENOENT {
				return -1, &EntryError{name, rerr}
			}
		default:
			return -1, &EntryError{name, err}
		}
	}
	return -1, &EntryError{name, err}
}

func (t *fdTree) dir(name string) error {
	_, err := t.open(name)
	return err
}

// file hands a file of up to maxQueued bytes to the writers, read into memory; a larger one is
// written here once they are done (so that it follows whatever came before it).
func (t *fdTree) file(ctx context.Context, name string, r io.Reader, size int64, perm fs.FileMode, mtime time.Time, buf []byte) (int64, error) {
	if err := t.w.failed(); err != nil {
		return 0, err
	}
	d, err := t.open(path.Dir(name))
	if err != nil {
		return 0, err
	}
	if size <= maxQueued {
		return t.w.queue(ctx, t, d, name, r, size, perm, mtime)
	}
	if err := t.w.flush(); err != nil {
		return 0, err
	}
	return t.write(ctx, d.fd, name, r, nil, perm, mtime, buf)
}

// write creates name in dirfd (its directory) and copies r into it (or writes data, when r is
// nil), then sets its owner, mode and mtime.
func (t *fdTree) write(ctx context.Context, dirfd int, name string, r io.Reader, data []byte, perm fs.FileMode, mtime time.Time, buf []byte) (int64, error) {
	base := path.Base(name)
	var fd int
	if err := t.create(dirfd, base, name, func() (err error) {
		fd, err = openat(dirfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		return err
	}); err != nil {
		return 0, err
	}
	var n int64
	var err error
	if r != nil {
		n, err = copyCtx(ctx, fdWriter(fd), r, buf)
	} else {
		var k int
		k, err = fdWriter(fd).Write(data)
		n = int64(k)
	}
	if err == nil && (t.opt.UID > 0 || t.opt.GID > 0) {
		err = unix.Fchown(fd, owner(t.opt.UID), owner(t.opt.GID))
	}
	if err == nil {
		err = unix.Fchmod(fd, uint32(perm))
	}
	if err == nil && !mtime.IsZero() {
		err = futimens(fd, mtime)
	}
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	return n, fileErr(ctx, name, err)
}

func (t *fdTree) symlink(target, name string) error {
	d, err := t.open(path.Dir(name))
	if err != nil {
		return err
	}
	if err := t.w.flush(); err != nil {
		return err
	}
	dirfd, base := d.fd, path.Base(name)
	if err := t.create(dirfd, base, name, func() error { return unix.Symlinkat(target, dirfd, base) }); err != nil {
		return err
	}
	if t.opt.UID > 0 || t.opt.GID > 0 {
		if err := unix.Fchownat(dirfd, base, owner(t.opt.UID), owner(t.opt.GID), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return &EntryError{name, err}
		}
	}
	return nil
}

// link goes through the os.Root: old is a path of several components, which the root resolves
// without leaving it. Hard links are rare enough for the walk not to matter.
func (t *fdTree) link(old, name string) error {
	if _, err := t.open(path.Dir(name)); err != nil {
		return err
	}
	if err := t.w.flush(); err != nil {
		return err
	}
	return create(t.root, name, func() error { return t.root.Link(old, name) })
}

// create runs mk, which creates base in dirfd exclusively (O_EXCL, symlinkat: neither follows a
// link at base); when something is there already it is removed, unless it is a directory, and mk
// runs once more. So a link at name is replaced, never written through; and only a name that is
// taken costs a stat.
func (t *fdTree) create(dirfd int, base, name string, mk func() error) error {
	err := mk()
	if err == unix.EEXIST {
		var st unix.Stat_t
		lerr := unix.Fstatat(dirfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
		switch {
		case lerr == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR:
			return &EntryError{name, unix.EISDIR}
		case lerr == nil:
			if rerr := unix.Unlinkat(dirfd, base, 0); rerr != nil && rerr != unix.ENOENT {
				return &EntryError{name, rerr}
			}
		case lerr != unix.ENOENT:
			return &EntryError{name, lerr}
		}
		err = mk()
	}
	if err != nil {
		return &EntryError{name, err}
	}
	return nil
}

func openat(dirfd int, name string, flags int, mode uint32) (int, error) {
	for {
		fd, err := unix.Openat(dirfd, name, flags, mode)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

// fdWriter writes to a file descriptor without an os.File around it (one less allocation and
// fcntl per file).
type fdWriter int

func (w fdWriter) Write(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		k, err := unix.Write(int(w), p[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if k == 0 {
			return n, io.ErrShortWrite
		}
		n += k
	}
	return n, nil
}

// futimens sets fd's access and modification times to t (utimensat with a NULL path acts on fd
// itself): no path, so no walk and nothing to follow.
func futimens(fd int, t time.Time) error {
	ts := [2]unix.Timespec{unix.NsecToTimespec(t.UnixNano()), unix.NsecToTimespec(t.UnixNano())}
	_, _, e := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func (t *fdTree) flush() error { return t.w.flush() }
