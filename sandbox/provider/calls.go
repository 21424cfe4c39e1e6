package provider

// The calls in flight on an init's control socket: each command's call, the reply loop that hands
// the init's replies to them, their registration (an id and a slot of the pid table) and the
// requests sent.

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
	"golang.org/x/sys/unix"
)

// call is one command in flight.
type call struct {
	id   uint64
	done chan struct{} // closed once, when the command ended, failed to start, or the init died
	outs []*os.File    // our read ends of its output pipes
	// hostWS is the workspace's host path for the dir provider ("" in a namespace), rewritten to
	// /workspace in error messages.
	hostWS string

	mu     sync.Mutex
	exited bool
	rep    reply
	err    error
	reason string // set when we asked the init to kill it
	// pid is a terminal command's pid as the init sees it (its process group too), from the forked
	// reply; 0 until the init said. Other commands' pids are in the instance's pid table.
	pid int
	// outside ends the command from the broker's side if the init has not, killGrace after reason
	// was set (outside.go).
	outside *time.Timer
	// pty receives a terminal command's master from the forked reply (tty.go); nil otherwise.
	pty chan *os.File
	// ptyTaken says the master came: another forked reply's fd is not taken (tty.go).
	ptyTaken bool
}

// readLoop demultiplexes the init's replies to the calls waiting for them.
func (in *instance) readLoop() {
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(16*4))
	for {
		n, oobn, flags, err := in.ctl.recv(buf, oob)
		var fds []int
		if oobn > 0 {
			// Only a terminal's master comes with a reply (forked, for a TTY call); any other fd
			// is not ours to keep.
			fds, _ = parseRights(oob[:oobn])
		}
		if err != nil || n == 0 {
			closeFDs(fds)
			in.fail(in.endErr())
			return
		}
		var r reply
		if flags&unix.MSG_TRUNC != 0 || json.Unmarshal(buf[:n], &r) != nil {
			closeFDs(fds)
			continue
		}
		switch r.Op {
		case opExit, opError, opStarted:
			closeFDs(fds)
		case opForked:
			in.mu.Lock()
			c := in.calls[r.ID]
			in.mu.Unlock()
			if c != nil {
				c.mu.Lock()
				c.pid = r.Pid
				c.mu.Unlock()
			}
			if c == nil || !c.takeTerminal(fds) {
				closeFDs(fds)
			}
			continue
		default:
			closeFDs(fds)
			continue
		}
		in.mu.Lock()
		c := in.calls[r.ID]
		if c != nil {
			in.forgetLocked(c)
		}
		in.mu.Unlock()
		if c != nil {
			c.complete(r)
		}
	}
}

// complete records the command's end and gives output readers a short grace to reach EOF.
func (c *call) complete(r reply) {
	c.mu.Lock()
	if c.exited {
		c.mu.Unlock()
		return
	}
	c.exited = true
	c.rep = r
	if r.Op == opError {
		if r.Kind == errKindCwd || r.Kind == sbxinit.ErrKindProgram {
			// The dir provider's init names host paths; callers see sandbox paths only.
			msg := r.Err
			if c.hostWS != "" {
				msg = strings.ReplaceAll(msg, c.hostWS, WorkspacePath)
			}
			if r.Kind == errKindCwd {
				c.err = CwdError(msg)
			} else {
				c.err = invalidRequest("%s", msg)
			}
		} else if r.Kind == sbxinit.ErrKindBusy {
			c.err = &BusyError{Reason: r.Err}
		} else {
			c.err = fmt.Errorf("exec: %s", r.Err)
		}
	}
	if len(c.outs) > 0 {
		d := time.Now().Add(exitGrace)
		for _, f := range c.outs {
			f.SetReadDeadline(d)
		}
	}
	c.mu.Unlock()
	close(c.done)
}

// fail ends every call in flight with err and refuses new ones.
func (in *instance) fail(err error) {
	in.mu.Lock()
	if in.deadErr != nil {
		in.mu.Unlock()
		return
	}
	in.deadErr = err
	calls := in.calls
	in.calls = map[uint64]*call{}
	in.slots = map[uint64]uint64{}
	in.mu.Unlock()
	for _, c := range calls {
		c.mu.Lock()
		if c.exited {
			c.mu.Unlock()
			continue
		}
		c.exited = true
		c.err = err
		for _, f := range c.outs {
			f.SetReadDeadline(time.Now())
		}
		c.mu.Unlock()
		close(c.done)
	}
}

func (in *instance) register(c *call) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.deadErr != nil {
		return in.deadErr
	}
	in.nextID++
	if in.pids != nil {
		if len(in.slots) >= sbxinit.PidSlots {
			return &BusyError{Reason: fmt.Sprintf("%d commands are in flight", len(in.slots))}
		}
		// A slot still held by a call in flight (a long-running command) is skipped.
		for {
			if _, taken := in.slots[sbxinit.PidSlot(in.nextID)]; !taken {
				break
			}
			in.nextID++
		}
		in.slots[sbxinit.PidSlot(in.nextID)] = in.nextID
	}
	c.id = in.nextID
	in.calls[c.id] = c
	return nil
}

func (in *instance) unregister(c *call) {
	in.mu.Lock()
	in.forgetLocked(c)
	in.mu.Unlock()
}

// forgetLocked takes c off the calls in flight (in.mu held), freeing its pid table slot.
func (in *instance) forgetLocked(c *call) {
	if in.calls[c.id] != c {
		return
	}
	delete(in.calls, c.id)
	if slot := sbxinit.PidSlot(c.id); in.slots[slot] == c.id {
		delete(in.slots, slot)
	}
}

// commandPid is the pid (and process group) of call c's command as the sandbox sees it, 0 if the
// init has not forked it.
func (in *instance) commandPid(c *call) int {
	c.mu.Lock()
	pid := c.pid
	c.mu.Unlock()
	if pid > 0 {
		return pid
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.pids != nil {
		pid, _ = in.pids.Get(c.id)
	}
	return pid
}

// send marshals and sends one request, giving up after within if the init does not take it.
func (in *instance) send(r *request, fds []int, within time.Duration) error {
	return in.sendOr(r, fds, within, nil)
}

// sendOr is send that calls waiting, if set, before it waits for the init to take the request.
func (in *instance) sendOr(r *request, fds []int, within time.Duration, waiting func()) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if len(b) > maxMessage {
		return invalidRequest("command and environment are %d bytes, more than %d", len(b), maxMessage)
	}
	if err := in.ctl.sendWithin(b, fds, within, waiting); err != nil {
		if err == errInitNotTaking {
			return err
		}
		in.mu.Lock()
		dead := in.deadErr
		in.mu.Unlock()
		if dead != nil {
			return dead
		}
		return fmt.Errorf("%w: %v", ErrStopped, err)
	}
	return nil
}
