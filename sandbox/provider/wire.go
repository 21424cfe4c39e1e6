package provider

import (
	"errors"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// The control protocol between the broker and the init. One SOCK_SEQPACKET message is one JSON
// object; the kernel keeps message boundaries, so there is no framing. File descriptors travel as
// SCM_RIGHTS on exec requests only.

// Request ops (broker → init).
const (
	opConfig = "config" // first message: the environment and how to behave
	opExec   = "exec"   // fork/exec a command; its stdio rides along as fds
	opKill   = "kill"   // end a command's whole process tree
)

// Reply ops (init → broker).
const (
	opReady   = "ready"   // the init is set up; sent once, after config
	opStarted = "started" // a background command started (Pid)
	opExit    = "exit"    // a foreground command ended (Code or Signal)
	opError   = "error"   // a command could not start (Err, Kind)
)

// Kinds of start errors, so the broker can map them without matching text.
const (
	errKindCwd   = "cwd"   // the working directory is missing or not enterable
	errKindStart = "start" // anything else (fork failed: pids limit, ...)
)

// maxMessage bounds one request. A SEQPACKET message must fit the socket's send buffer (default
// ~208 KiB); execve itself caps one argument at 128 KiB.
const maxMessage = 160 << 10

// request is one message from the broker to the init.
type request struct {
	Op string `json:"op"`
	ID uint64 `json:"id,omitempty"`
	// exec
	Argv []string `json:"argv,omitempty"`
	Env  []string `json:"env,omitempty"` // config: the whole environment; exec: overrides
	Dir  string   `json:"dir,omitempty"`
	// Stdio maps the command's fd 0, 1, 2 to an index into the passed fds; -1 is /dev/null.
	Stdio []int `json:"stdio,omitempty"`
	Bg    bool  `json:"bg,omitempty"`
	// config
	Host bool `json:"host,omitempty"` // dir provider: the init shares the host pid space
}

// reply is one message from the init to the broker.
type reply struct {
	Op     string `json:"op"`
	ID     uint64 `json:"id,omitempty"`
	Pid    int    `json:"pid,omitempty"`
	Code   int    `json:"code,omitempty"`
	Signal int    `json:"sig,omitempty"`
	Err    string `json:"err,omitempty"`
	Kind   string `json:"kind,omitempty"`
}

// ctlConn is one end of the control socket. The broker's end goes through Go's poller, so that a
// thousand idle sandboxes hold no OS threads. The init's end is blocking (see newBlockingCtlConn).
type ctlConn struct {
	f  *os.File        // nil when blocking
	rc syscall.RawConn // nil when blocking
	fd int             // the raw fd when blocking
}

// newBlockingCtlConn is the init's end: it blocks in recvmsg on its own thread, which the kernel
// wakes directly when a request arrives; going through the poller costs an extra goroutine hop on
// every exec, and the init has nothing else to do.
func newBlockingCtlConn(fd int) *ctlConn { return &ctlConn{fd: fd} }

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
	if c.rc == nil {
		for {
			err := unix.Sendmsg(c.fd, msg, oob, nil, unix.MSG_NOSIGNAL)
			if err != unix.EINTR {
				return err
			}
		}
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

// recv reads one message into buf and its control data into oob. n == 0 with a nil error is the
// peer's end of file.
func (c *ctlConn) recv(buf, oob []byte) (n, oobn, flags int, err error) {
	if c.rc == nil {
		for {
			n, oobn, flags, _, err = unix.Recvmsg(c.fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
			if err != unix.EINTR {
				return n, oobn, flags, err
			}
		}
	}
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

func (c *ctlConn) close() error {
	if c.f == nil {
		return unix.Close(c.fd)
	}
	return c.f.Close()
}

// parseRights returns the fds passed in oob (closing nothing).
func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for i := range msgs {
		if msgs[i].Header.Level == unix.SOL_SOCKET && msgs[i].Header.Type == unix.SCM_RIGHTS {
			got, err := unix.ParseUnixRights(&msgs[i])
			if err != nil {
				return fds, err
			}
			fds = append(fds, got...)
		}
	}
	return fds, nil
}

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

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
