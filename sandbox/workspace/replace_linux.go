package workspace

import (
	"errors"
	"os"
	"path"

	"golang.org/x/sys/unix"
)

// replace puts temp (a new file) at target, which exists, atomically for readers.
//
// On Linux it swaps the two names with renameat2(RENAME_EXCHANGE) and unlinks the old copy, instead
// of renaming over target: ext4 (auto_da_alloc) starts writeback of the new file on every rename
// that replaces one, which costs ~1 ms and would dominate each write. The price: ext4's implicit
// "old or new content after a power loss" for the very latest write is gone (a broker or sandbox
// crash still leaves old or new, never a torn file). Both names live in one directory, opened
// through the os.Root, so nothing resolves outside the workspace.
func (w *Workspace) replace(temp, target string) error {
	if path.Dir(target) == "." && path.Dir(temp) == "." {
		// Both names in the workspace root: swap them on the root's own descriptor, sparing the
		// open of the directory (through os.Root, with its fcntl and epoll_ctl calls) and its close.
		var err error
		ran := w.withRootDir(func(fd int) { err = exchange(fd, temp, target) })
		if ran && (err == nil || errors.Is(err, unix.EISDIR)) {
			return err
		}
	}
	dir, err := w.root.OpenFile(path.Dir(target), os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer dir.Close()
	if err := exchange(int(dir.Fd()), path.Base(temp), path.Base(target)); err == nil || errors.Is(err, unix.EISDIR) {
		return err
	}
	// No RENAME_EXCHANGE here (old kernel, some file systems): a plain rename is still atomic.
	return w.root.Rename(temp, target)
}

// exchange swaps tb and xb, two names in the directory fd, and unlinks tb (the old content). A
// directory found at xb (put there after the caller's checks) is swapped back and refused with
// EISDIR, as rename(2) refuses a file over a directory: left under tb, a hidden temporary name,
// it would vanish with everything in it.
func exchange(fd int, tb, xb string) error {
	if err := unix.Renameat2(fd, tb, fd, xb, unix.RENAME_EXCHANGE); err != nil {
		return err
	}
	if err := unix.Unlinkat(fd, tb, 0); err == unix.EISDIR {
		unix.Renameat2(fd, tb, fd, xb, unix.RENAME_EXCHANGE)
		return &os.PathError{Op: "replace", Path: xb, Err: unix.EISDIR}
	}
	return nil
}
