package provider

import (
	"log/slog"
	"os/exec"
	"runtime"
	"sync"
)

// spawner is one goroutine locked to its OS thread for the life of the process. Every init (or
// bwrap) is started from it because Pdeathsig fires when the *thread* that forked the child exits,
// not the process: the Go runtime may end an idle thread that a LockOSThread goroutine left behind,
// and a sandbox started from that thread would be killed for no reason.
var spawner struct {
	once sync.Once
	reqs chan spawnReq
}

type spawnReq struct {
	cmd *exec.Cmd
	in  *cgroupSet // fork the process inside these cgroups (placeThread); nil: where the broker is
	err chan error
}

// spawn starts cmd from the spawner thread, forked inside cg's cgroups when cg is not nil. The
// thread goes back to the broker's cgroups after the answer, off the caller's path.
func spawn(cmd *exec.Cmd, cg *cgroupSet) error {
	spawner.once.Do(func() {
		spawner.reqs = make(chan spawnReq)
		go func() {
			runtime.LockOSThread() // never unlocked: this thread must outlive every sandbox
			for r := range spawner.reqs {
				if r.in == nil {
					r.err <- r.cmd.Start()
					continue
				}
				if err := r.in.placeThread(); err != nil {
					r.err <- err
					continue
				}
				r.err <- r.cmd.Start()
				if err := r.in.homeThread(-1); err != nil {
					// Left in the sandbox's cgroups, the thread would keep them from being removed;
					// the next placement moves it on all the same.
					slog.Error("sandbox spawner", "err", err)
				}
			}
		}()
	})
	r := spawnReq{cmd: cmd, in: cg, err: make(chan error, 1)}
	spawner.reqs <- r
	return <-r.err
}
