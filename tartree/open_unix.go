//go:build unix

package tartree

import "syscall"

// readFlags open a regular file for archiving without blocking on a FIFO swapped in since the
// lstat. (os.Root follows a link inside the tree whatever the flags: Add compares the open file
// with what it looked at.)
const readFlags = syscall.O_NOFOLLOW | syscall.O_NONBLOCK

// dirFlags open a directory for archiving only if it still is one: a FIFO swapped in since the
// lstat is refused (an open for reading would wait for a writer, for good).
const dirFlags = syscall.O_DIRECTORY | syscall.O_NOFOLLOW | syscall.O_NONBLOCK
