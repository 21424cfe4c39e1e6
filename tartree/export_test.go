package tartree

// SetMaxDirs lowers the directory cap for a test and returns the undo.
func SetMaxDirs(n int) func() {
	old := maxDirs
	maxDirs = n
	return func() { maxDirs = old }
}

// AfterLstat calls hook with an entry's name after Add has looked at it and before it opens (or
// reads) it: the moment a sandbox could swap it for something else. It returns the undo.
func AfterLstat(hook func(rel string)) func() {
	testHookAfterLstat = hook
	return func() { testHookAfterLstat = nil }
}

// SetMaxNamesHeld lowers the bound on the names one Add holds and returns the undo.
func SetMaxNamesHeld(n int64) func() {
	old := maxNamesHeld
	maxNamesHeld = n
	return func() { maxNamesHeld = old }
}

// SetMaxNamesRemembered lowers the bound on the names one Extract remembers and returns the undo.
func SetMaxNamesRemembered(n int64) func() {
	old := maxNamesRemembered
	maxNamesRemembered = n
	return func() { maxNamesRemembered = old }
}
