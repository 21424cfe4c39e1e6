package tartree

// SetMaxDirs lowers the directory cap for a test and returns the undo.
func SetMaxDirs(n int) func() {
	old := maxDirs
	maxDirs = n
	return func() { maxDirs = old }
}
