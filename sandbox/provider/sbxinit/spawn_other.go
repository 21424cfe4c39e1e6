//go:build !amd64

package sbxinit

import "syscall"

// spawnSupported is false where spawn has no assembly: commands start with syscall.ForkExec.
func spawnSupported() bool { return false }

func spawnable([3]uintptr) bool { return false }

func spawn(string, []string, []string, string, [3]uintptr, *syscall.Credential) (int, error) {
	return 0, syscall.ENOSYS
}
