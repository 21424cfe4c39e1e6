//go:build unix

package backend

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

func signalName(sig syscall.Signal) string {
	if name := unix.SignalName(sig); name != "" {
		return name
	}
	return fmt.Sprint(int(sig))
}
