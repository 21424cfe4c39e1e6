//go:build unix

package tartree

import "syscall"

// readFlags open a regular file for archiving without following a link swapped in since the
// lstat, and without blocking on a FIFO swapped in the same way.
const readFlags = syscall.O_NOFOLLOW | syscall.O_NONBLOCK
