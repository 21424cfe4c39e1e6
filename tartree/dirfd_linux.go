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
	fd := int(top.Fd())
	return &fdTree{root: root, top: top, topFd: fd, curName: ".", cur: fd, opt: opt}
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
// At most the root's, cur's and one walking descriptor are open at once, whatever the tree.
type fdTree struct {
	root    *os.Root // hard links' targets are resolved through it
	top     *os.File // the root directory itself; topFd is its descriptor
	topFd   int
	curName string
	cur     int
	opt     ExtractOptions
}

func (t *fdTree) close() {
	t.setCur(".", t.topFd)
	t.top.Close()
}

// setCur makes fd, the directory name, the current one, closing the one before.
func (t *fdTree) setCur(name string, fd int) {
	if t.cur != t.topFd && t.cur != fd {
		unix.Close(t.cur)
	}
	t.curName, t.cur = name, fd
}

// open returns a descriptor of the directory name, making it and its parents where missing
// (replacing symbolic links in the way), and keeps it as the current directory.
func (t *fdTree) open(name string) (int, error) {
	if name == "." {
		return t.topFd, nil
	}
	if name == t.curName {
		return t.cur, nil
	}
	base, rest, done := t.topFd, name, "."
	if t.curName != "." && strings.HasPrefix(name, t.curName+"/") {
		base, rest, done = t.cur, name[len(t.curName)+1:], t.curName
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
			return -1, err
		}
		fd = next
	}
	t.setCur(name, fd)
	return fd, nil
}

// step opens the directory c inside dirfd (named name from the root), creating it when missing
// and replacing a symbolic link there by a new directory. Something else that is not a directory
// is an ENOTDIR error. The tries are bounded: a sandbox swapping things at c meanwhile gets an error,
// never a loop.
func (t *fdTree) step(dirfd int, c, name string) (int, error) {
	const flags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	var err error
	for range 3 {
		var fd int
		fd, err = openat(dirfd, c, flags, 0)
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

func (t *fdTree) file(ctx context.Context, name string, r io.Reader, perm fs.FileMode, mtime time.Time, buf []byte) (int64, error) {
	dirfd, err := t.open(path.Dir(name))
	if err != nil {
		return 0, err
	}
	base := path.Base(name)
	var fd int
	if err := t.create(dirfd, base, name, func() (err error) {
		fd, err = openat(dirfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		return err
	}); err != nil {
		return 0, err
	}
	n, err := copyCtx(ctx, fdWriter(fd), r, buf)
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
	dirfd, err := t.open(path.Dir(name))
	if err != nil {
		return err
	}
	base := path.Base(name)
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
