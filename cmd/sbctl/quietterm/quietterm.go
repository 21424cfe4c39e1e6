// Package quietterm keeps sbctl from querying the terminal when it starts. Bubble Tea v1's
// package init asks the terminal for its background colour (lipgloss.HasDarkBackground: OSC 11
// and a cursor report) on every run of the binary, not only `sbctl watch`, and reads the
// terminal's input for up to 5 s waiting for the answer: a terminal that does not answer
// (script, expect, an editor's shell buffer) made every command take 5 s and swallowed what was
// typed meanwhile, and one that answers had replies written at a script's stdout by a program
// that printed an id.
//
// Its init sets CI, which termenv reads as "not a terminal", so that query does nothing; sbctl's
// main calls Restore first thing. It must import nothing but os: Go initialises packages in
// import-path order as their imports are ready, so this one, ready once os is, runs before Bubble
// Tea, which also waits for os/signal (tests/term_test.go checks the built binary). sbctl watch
// loses nothing: it uses fixed colours, and its colour profile is read when it first draws.
package quietterm

import "os"

var prevCI string
var hadCI bool

func init() {
	prevCI, hadCI = os.LookupEnv("CI")
	os.Setenv("CI", "1")
}

// Restore puts CI back as it was before this package's init.
func Restore() {
	if hadCI {
		os.Setenv("CI", prevCI)
	} else {
		os.Unsetenv("CI")
	}
}
