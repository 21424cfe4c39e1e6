//go:build !unix

package gitsync

import "os"

// noFollow: Windows has no O_NOFOLLOW; os.Root keeps the open inside the working tree.
const (
	noFollow = 0
	dirFlag  = 0
)

// openIn opens p through the root (no directory-relative open here).
func openIn(root *os.Root, _ *os.File, p, _ string) (*os.File, error) { return root.Open(p) }
