package provider

import "golang.org/x/sys/unix"

// Alive reports whether inst's init is still running. It sees an init that has died but is not yet
// torn down (Done not closed yet: bwrap and the broker reap it a few milliseconds later), so that
// a sandbox that has just been killed is never handed out as running (the warm pool asks before a
// claim).
func Alive(inst Instance) bool {
	if a, ok := inst.(interface{ alive() bool }); ok {
		return a.alive()
	}
	select {
	case <-inst.Done():
		return false
	default:
		return true
	}
}

func (in *instance) alive() bool {
	select {
	case <-in.done:
		return false
	default:
	}
	in.mu.Lock()
	defer in.mu.Unlock() // wait closes the pidfd under mu
	if in.pidfd <= 0 {
		return !in.ended
	}
	// A pidfd polls readable once its process has exited, zombie or not.
	fds := []unix.PollFd{{Fd: int32(in.pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err != nil || n == 0
}
