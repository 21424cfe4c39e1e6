//go:build !unix

package tartree

// readFlags: Windows has neither O_NOFOLLOW nor FIFOs; os.Root still keeps every open inside the
// tree, and the Stat after the open skips anything that is not a regular file.
const readFlags = 0

// dirFlags: see readFlags; Readdirnames fails on what is not a directory.
const dirFlags = 0
