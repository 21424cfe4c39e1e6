//go:build !unix

package gitsync

// noFollow: Windows has no O_NOFOLLOW; os.Root keeps the open inside the working tree.
const noFollow = 0
