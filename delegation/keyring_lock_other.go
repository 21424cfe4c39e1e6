//go:build !unix

package delegation

// lockDir is a no-op where flock(2) does not exist: there, run key rotation only while no other
// process writes the same keyring directory.
func lockDir(string) (func(), error) { return func() {}, nil }
