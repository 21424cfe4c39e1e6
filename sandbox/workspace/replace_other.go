//go:build !linux

package workspace

// replace puts temp at target, which exists, atomically for readers.
func (w *Workspace) replace(temp, target string) error { return w.root.Rename(temp, target) }
