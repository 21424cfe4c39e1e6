//go:build unix

package gitsync

import "syscall"

// noFollow opens a working tree's file without following a link swapped in since the snapshot.
const noFollow = syscall.O_NOFOLLOW | syscall.O_NONBLOCK
