package tartree

// UseRootWalk makes Extract walk every name from the os.Root, as it does outside Linux, and
// returns the undo: the hostile archives run on both ways of writing.
func UseRootWalk() func() {
	old := forceRoot
	forceRoot = true
	return func() { forceRoot = old }
}

// MaxInFlight is the bytes the writers may hold.
const MaxInFlight = maxInFlight

// HoldWrites makes the writers wait for gate before each file, and calls full (with the bytes of
// file buffers held at that moment) whenever the reading loop waits for room; it returns the undo.
func HoldWrites(gate <-chan struct{}, full func(held int64)) func() {
	testHookWrite = func() { <-gate }
	testHookFull = func() { full(bufHeld.Load()) }
	return func() { testHookWrite, testHookFull = nil, nil }
}

// BufHeld is the capacity of the file buffers given out and not given back.
func BufHeld() int64 { return bufHeld.Load() }
