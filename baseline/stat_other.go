//go:build !unix

package baseline

import (
	"os"
)

// Windows has no O_NOFOLLOW; os.Root keeps every open inside the tree.
const (
	noFollow = 0
	dirFlag  = 0
	nonBlock = 0
)

// lstatAt has no ctime here: the mtime stands in, so a file is trusted on size and mtime alone.
func lstatAt(_ *os.File, root *os.Root, p, _ string) (statInfo, error) {
	fi, err := root.Lstat(p)
	if err != nil {
		return statInfo{}, err
	}
	return statInfo{mode: fi.Mode(), size: fi.Size(), mtimeNS: fi.ModTime().UnixNano(), ctimeNS: 0}, nil
}

func openAt(_ *os.File, root *os.Root, p, _ string) (*os.File, error) { return root.Open(p) }

func readlinkAt(_ *os.File, root *os.Root, p, _ string) (string, error) { return root.Readlink(p) }
