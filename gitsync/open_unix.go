//go:build unix

package gitsync

import (
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// noFollow opens a working tree's file without following a link swapped in since the snapshot;
// dirFlag opens only a directory.
const (
	noFollow = syscall.O_NOFOLLOW | syscall.O_NONBLOCK
	dirFlag  = syscall.O_DIRECTORY
)

// openIn opens the file name in dir (opened through the root), never following a link at name.
func openIn(_ *os.Root, dir *os.File, p, name string) (*os.File, error) {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), p), nil
}
