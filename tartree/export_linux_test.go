package tartree

// UseRootWalk makes Extract walk every name from the os.Root, as it does outside Linux, and
// returns the undo: the hostile archives run on both ways of writing.
func UseRootWalk() func() {
	old := forceRoot
	forceRoot = true
	return func() { forceRoot = old }
}
