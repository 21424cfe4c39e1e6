package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
	"golang.org/x/sys/unix"
)

// The init and its wire format live in sbxinit, a leaf package, so that cmd/sbx-init links nothing
// else of the broker's (and is small and static). These names keep the broker's side of the
// protocol reading as before.

// InitArg is the argument that turns an executable into a sandbox's resident init.
const InitArg = sbxinit.InitArg

// RunInit runs the resident init and never returns (see sbxinit.RunInit).
func RunInit() { sbxinit.RunInit() }

type (
	request = sbxinit.Request
	reply   = sbxinit.Reply
)

const (
	opConfig   = sbxinit.OpConfig
	opExec     = sbxinit.OpExec
	opKill     = sbxinit.OpKill
	opReady    = sbxinit.OpReady
	opStarted  = sbxinit.OpStarted
	opForked   = sbxinit.OpForked
	opExit     = sbxinit.OpExit
	opError    = sbxinit.OpError
	errKindCwd = sbxinit.ErrKindCwd
	maxMessage = sbxinit.MaxMessage
)

var (
	parseRights = sbxinit.ParseRights
	closeFDs    = sbxinit.CloseFDs
	killTree    = sbxinit.KillTree
)

// ctlConn is the broker's end of the control socket. It goes through Go's poller, so that a thousand
// idle sandboxes hold no OS threads (the init's end blocks: see sbxinit).
type ctlConn struct {
	f  *os.File
	rc syscall.RawConn
}

func newCtlConn(fd int, name string) (*ctlConn, error) {
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &ctlConn{f: f, rc: rc}, nil
}

// send writes one message with optional fds. Concurrent sends are safe: the poller serializes writers
// and each message is atomic.
func (c *ctlConn) send(msg []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	var serr error
	err := c.rc.Write(func(fd uintptr) bool {
		serr = unix.Sendmsg(int(fd), msg, oob, nil, unix.MSG_NOSIGNAL)
		return serr != unix.EAGAIN
	})
	if err != nil {
		return err
	}
	return serr
}

// errInitNotTaking is a request the init did not take within its bound: its end of the socket is
// full because it stopped reading (stopped, hung or starved). It maps to "timed out; retry".
var errInitNotTaking = fmt.Errorf("the sandbox's init is not taking requests: %w", context.DeadlineExceeded)

// sendWithin is send that gives up after d with errInitNotTaking, so that a request to an init that
// stopped reading never blocks its caller past the request's own timeout. A message is sent whole or
// not at all, so giving up leaves the stream intact. waiting, if set, is called before the first
// wait.
func (c *ctlConn) sendWithin(msg []byte, fds []int, d time.Duration, waiting func()) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	var deadline time.Time
	for wait := 50 * time.Microsecond; ; wait = min(wait*2, 20*time.Millisecond) {
		var serr error
		if err := c.rc.Control(func(fd uintptr) {
			serr = unix.Sendmsg(int(fd), msg, oob, nil, unix.MSG_NOSIGNAL|unix.MSG_DONTWAIT)
		}); err != nil {
			return err
		}
		if serr != unix.EAGAIN {
			return serr
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(d)
			if waiting != nil {
				waiting()
			}
		} else if time.Now().After(deadline) {
			return errInitNotTaking
		}
		time.Sleep(wait)
	}
}

// recv reads one message into buf and its control data into oob. n == 0 with a nil error is the
// peer's end of file.
func (c *ctlConn) recv(buf, oob []byte) (n, oobn, flags int, err error) {
	var rerr error
	err = c.rc.Read(func(fd uintptr) bool {
		n, oobn, flags, _, rerr = unix.Recvmsg(int(fd), buf, oob, unix.MSG_CMSG_CLOEXEC)
		return rerr != unix.EAGAIN
	})
	if err == nil {
		err = rerr
	}
	return n, oobn, flags, err
}

func (c *ctlConn) close() error { return c.f.Close() }

// parseCreds returns the sender's pid from an SCM_CREDENTIALS message, translated by the kernel into
// the receiver's pid namespace.
func parseCreds(oob []byte) (int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return 0, err
	}
	for i := range msgs {
		if msgs[i].Header.Level == unix.SOL_SOCKET && msgs[i].Header.Type == unix.SCM_CREDENTIALS {
			cred, err := unix.ParseUnixCredentials(&msgs[i])
			if err != nil {
				return 0, err
			}
			return int(cred.Pid), nil
		}
	}
	return 0, errors.New("no credentials on the init's ready message")
}

func unwrapPathErr(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
