//go:build !windows

package main

import (
	"os"
	"os/signal"
	"syscall"
)

// watchResize calls resize on each change of the terminal's window (SIGWINCH) until stop is called.
func watchResize(resize func()) (stop func()) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGWINCH)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-ch:
				resize()
			case <-done:
				return
			}
		}
	}()
	return func() {
		signal.Stop(ch)
		close(done)
	}
}
