package main

// watchResize does nothing on Windows, which has no SIGWINCH: the window keeps its starting size.
func watchResize(func()) (stop func()) { return func() {} }
