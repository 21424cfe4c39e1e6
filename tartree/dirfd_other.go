//go:build !linux

package tartree

import "os"

// newTree: outside Linux (sbctl on a person's machine) every operation walks from the os.Root.
func newTree(root *os.Root, opt ExtractOptions) tree { return newRootTree(root, opt) }
