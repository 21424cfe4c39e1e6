package sbxinit

import "golang.org/x/sys/unix"

// Request ops (broker → init).
const (
	OpConfig = "config" // first message: the environment and how to behave
	OpExec   = "exec"   // fork/exec a command; its stdio rides along as fds
	OpKill   = "kill"   // end a command's whole process tree
)

// Reply ops (init → broker).
const (
	OpReady   = "ready"   // the init is set up; sent once, after config
	OpStarted = "started" // a background command started (Pid)
	OpForked  = "forked"  // a command on a terminal started (Pid), its master riding along; for one without a terminal only from an init given no PidTable and not behind the bridge (the broker needs the pid to end a command without us)
	OpExit    = "exit"    // a foreground command ended (Code or Signal)
	OpError   = "error"   // a command could not start (Err, Kind)
)

// Kinds of start errors, so the broker can map them without matching text.
const (
	ErrKindCwd   = "cwd"   // the working directory is missing or not enterable
	ErrKindStart = "start" // anything else (fork failed: pids limit, ...)
	// ErrKindProgram: a terminal command's program is not found or not executable (a command
	// without a terminal exits 127 or 126 instead, its message on its stderr).
	ErrKindProgram = "program"
	// ErrKindBusy: the command was refused, never started, because the sandbox has as many
	// commands' streams open as it may (the gvisor relay answers it, not the init).
	ErrKindBusy = "busy"
)

// MaxMessage bounds one request. A SEQPACKET message must fit the socket's send buffer (default
// ~208 KiB); execve itself caps one argument at 128 KiB.
const MaxMessage = 160 << 10

// Request is one message from the broker to the init.
type Request struct {
	Op string `json:"op"`
	ID uint64 `json:"id,omitempty"`
	// exec
	Argv []string `json:"argv,omitempty"`
	Env  []string `json:"env,omitempty"` // config: the whole environment; exec: overrides
	Dir  string   `json:"dir,omitempty"`
	// Stdio maps the command's fd 0, 1, 2 to an index into the passed fds; -1 is /dev/null.
	Stdio []int `json:"stdio,omitempty"`
	Bg    bool  `json:"bg,omitempty"`
	// TTY runs the command on a new pseudo-terminal of the sandbox's own devpts (see tty.go), its
	// window Rows x Cols: the command leads a new session with the terminal as its controlling tty
	// and stdio, and the forked reply carries the master. Stdio is then ignored.
	TTY  bool   `json:"tty,omitempty"`
	Rows uint16 `json:"rows,omitempty"`
	Cols uint16 `json:"cols,omitempty"`
	// config
	Host bool `json:"host,omitempty"` // dir provider: the init shares the host pid space
	// UID and GID, when set, are who commands run as: the init itself runs as another user that
	// no command can signal, trace or read (gvisor, where the kernel does not shield a pid 1).
	UID int `json:"uid,omitempty"`
	GID int `json:"gid,omitempty"`
}

// Reply is one message from the init to the broker.
type Reply struct {
	Op     string `json:"op"`
	ID     uint64 `json:"id,omitempty"`
	Pid    int    `json:"pid,omitempty"`
	Code   int    `json:"code,omitempty"`
	Signal int    `json:"sig,omitempty"`
	Err    string `json:"err,omitempty"`
	Kind   string `json:"kind,omitempty"`
}

// ctlConn is the init's end of the control socket. It blocks in recvmsg on its own thread, which the
// kernel wakes directly when a request arrives; going through the poller costs an extra goroutine
// hop on every exec, and the init has nothing else to do. (The broker's end goes through Go's poller,
// so that a thousand idle sandboxes hold no OS threads: see the provider.)
type ctlConn struct {
	fd int
}

func newBlockingCtlConn(fd int) *ctlConn { return &ctlConn{fd: fd} }

// send writes one message with optional fds; each message is atomic.
func (c *ctlConn) send(msg []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	for {
		err := unix.Sendmsg(c.fd, msg, oob, nil, unix.MSG_NOSIGNAL)
		if err != unix.EINTR {
			return err
		}
	}
}

// recv reads one message into buf and its control data into oob. n == 0 with a nil error is the
// peer's end of file.
func (c *ctlConn) recv(buf, oob []byte) (n, oobn, flags int, err error) {
	for {
		n, oobn, flags, _, err = unix.Recvmsg(c.fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err != unix.EINTR {
			return n, oobn, flags, err
		}
	}
}

// ParseRights returns the fds passed in oob (closing nothing).
func ParseRights(oob []byte) ([]int, error) {
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

// CloseFDs closes fds, ignoring errors.
func CloseFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
