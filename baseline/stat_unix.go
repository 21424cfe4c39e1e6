//go:build unix

package baseline

import (
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// noFollow and dirFlag open without following a link at the last component, and only a directory;
// nonBlock opens a FIFO without waiting for a writer (the file's type is checked after the open).
const (
	noFollow = unix.O_NOFOLLOW
	dirFlag  = unix.O_DIRECTORY
	nonBlock = unix.O_NONBLOCK
)

// lstatAt lstats name in the directory d (opened through the root), without following it.
func lstatAt(d *os.File, _ *os.Root, _, name string) (statInfo, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(int(d.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return statInfo{}, err
	}
	var m fs.FileMode
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		m = fs.ModeDir
	case unix.S_IFLNK:
		m = fs.ModeSymlink
	case unix.S_IFREG:
	default:
		m = fs.ModeIrregular
	}
	m |= fs.FileMode(st.Mode & 0o777)
	return statInfo{mode: m, size: st.Size, mtimeNS: st.Mtim.Nano(), ctimeNS: st.Ctim.Nano()}, nil
}

// openAt opens the regular file name in d for reading, never following a link nor blocking on a
// FIFO swapped in since the lstat.
func openAt(d *os.File, _ *os.Root, _, name string) (*os.File, error) {
	fd, err := unix.Openat(int(d.Fd()), name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), name), nil
}

// readlinkAt reads the symlink name in d.
func readlinkAt(d *os.File, _ *os.Root, _, name string) (string, error) {
	buf := make([]byte, 4097)
	n, err := unix.Readlinkat(int(d.Fd()), name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}
