package workspace

import (
	"errors"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// Opening a regular file through os.Root costs four fcntl calls and a failing epoll_ctl (Go tries
// to register every opened file with its poller); with the open, stat and close that is most of a
// small write or read. For files directly in the workspace root, which is where most writes go,
// fastOpen does the open itself: openat relative to the root directory with O_NOFOLLOW, and an
// *os.File that skips the poller. Anything else (a nested path, a symlink as the last element)
// takes the os.Root path, which alone follows symlinks safely.

// withRootDir runs fn with the descriptor of the workspace root, opened through the root on first
// use, and says whether it ran. fn runs inside RawConn.Control, which holds the descriptor: a Close
// meanwhile waits for fn before the number is freed, so it cannot be reused by another open (say,
// another sandbox's workspace) while fn resolves names against it. After Close it does not run.
func (w *Workspace) withRootDir(fn func(dirfd int)) bool {
	w.dirOnce.Do(func() {
		d, err := w.root.OpenFile(".", os.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return
		}
		if w.dirConn, err = d.SyscallConn(); err != nil {
			d.Close()
			return
		}
		w.dir = d
	})
	if w.dir == nil {
		return false
	}
	return w.dirConn.Control(func(fd uintptr) { fn(int(fd)) }) == nil
}

// fastOpen opens rel, a clean path with no directory part, without following a final symlink.
// ok is false when the fast path does not apply (rel is nested, or is a symlink): the caller then
// uses the os.Root path.
func (w *Workspace) fastOpen(rel string, flags int, perm uint32) (f *os.File, ok bool, err error) {
	if strings.IndexByte(rel, '/') >= 0 || rel == "." || rel == ".." {
		return nil, false, nil
	}
	ran := w.withRootDir(func(dirfd int) { f, ok, err = openAt(dirfd, rel, flags, perm) })
	return f, ran && ok, err
}

// openAt is fastOpen's work, on the root's descriptor.
func openAt(dirfd int, rel string, flags int, perm uint32) (*os.File, bool, error) {
	if flags&unix.O_CREAT == 0 {
		// Only regular files are opened for reading: a FIFO or device is never opened at all, and
		// a symlink goes to os.Root.
		var st unix.Stat_t
		if err := unix.Fstatat(dirfd, rel, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			return nil, false, nil
		}
	}
	fd, err := unix.Openat(dirfd, rel, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC, perm)
	switch {
	case errors.Is(err, unix.ELOOP): // a symlink: only os.Root may follow it
		return nil, false, nil
	case err != nil:
		return nil, true, &os.PathError{Op: "openat", Path: rel, Err: err}
	}
	// os.NewFile registers a descriptor with the poller only when it is non-blocking.
	if flags&unix.O_NONBLOCK != 0 {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT == unix.S_IFREG {
			unix.SetNonblock(fd, false)
		}
	}
	return os.NewFile(uintptr(fd), rel), true, nil
}
