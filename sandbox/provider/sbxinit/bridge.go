package sbxinit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// BridgeArg, after InitArg (so that every main that dispatches InitArg to RunInit runs it), makes
// the init run behind a bridge: in a sandbox whose runtime cannot pass file descriptors in from the
// host (gVisor: a host socket imported into the sentry carries bytes, not SCM_RIGHTS). The bridge
// carries the init's messages and every command's stdio over one byte stream, the process's stdin
// and stdout (pipes the runtime imports from the host), and hands the init its requests, with the
// pipes it made for them, in the same process (serveInit). The init is the same one, with the same
// messages; only the carriage differs.
const BridgeArg = "sandbox-bridge"

// Frame kinds of the bridge's stream. A frame is a 9-byte header (kind, channel as a big-endian
// uint32, payload length as a big-endian uint32) and the payload.
const (
	// FrameRequest (host → bridge): a request for the init. Payload: a count byte, then per fd
	// the request passes (in Stdio order) a channel (uint32) and a direction byte (FrameIn: the
	// command reads it, FrameOut: the command writes it), then the request's JSON.
	FrameRequest = 1
	// FrameReply (bridge → host): a reply of the init, its JSON.
	FrameReply = 2
	// FrameData: bytes on a channel, from the side that writes it, within its credit (FrameCredit).
	FrameData = 3
	// FrameEOF: the writing side of a channel has finished. It is the last frame of every channel
	// a side writes (but the keystrokes of a terminal the host lets go: see FrameTerminal), and
	// the reading side forgets the channel when it comes.
	FrameEOF = 4
	// FrameClose: the reading side of a channel is gone; the writer stops, and ends the channel
	// with its FrameEOF. Data already on its way is discarded.
	FrameClose = 5
	// FrameTerminal (bridge → host): a reply of the init that passed a terminal's master (the
	// forked reply of a command on a terminal). Payload: the channel (uint32) the bridge opens
	// for the terminal, then the reply's JSON. The master stays here, in the sandbox; the
	// channel carries its bytes both ways, each way with its own credit: FrameData from the host
	// is typed on it, FrameData to the host is what it shows, FrameEOF from the host types its
	// end-of-file character, and FrameClose from the host closes it (the host's last frame on
	// it: it types nothing more, and the bridge ends the output with FrameEOF).
	FrameTerminal = 6
	// FrameResize (host → bridge): a terminal's new window. Payload: rows, then columns, each a
	// big-endian uint16.
	FrameResize = 7
	// FrameCredit: the reading side of a channel consumed bytes of it, and its writer may send
	// that many more (flow.go). Payload: the count, a big-endian uint32. A writer starts with
	// Window and never has more than Window sent and not given back.
	FrameCredit = 8
	// FrameUnknown (bridge → host): the bridge discarded a frame for a channel it does not have.
	// Payload: the frame's kind, then its payload's length (a big-endian uint32). Never expected:
	// the host logs it, since a silently dropped end of file once hid a hang.
	FrameUnknown = 9
)

// TerminalChannel marks the channels the bridge numbers (terminals); the host numbers the others
// from 1 up, so the two never meet.
const TerminalChannel = 1 << 31

// Directions of a channel, as the command sees its fd.
const (
	FrameIn  = 'r' // the command reads it (stdin): data flows host → sandbox
	FrameOut = 'w' // the command writes it (stdout, stderr): data flows sandbox → host
)

// FrameHeader is the size of a frame's header; MaxFrame bounds a payload.
const (
	FrameHeader = 9
	MaxFrame    = MaxMessage + 4096
)

// chunk is the most a data frame carries.
const chunk = 32 << 10

// FrameWriter writes whole frames to one stream; it is safe for concurrent use.
type FrameWriter struct {
	mu sync.Mutex
	w  io.Writer
}

// NewFrameWriter writes frames to w.
func NewFrameWriter(w io.Writer) *FrameWriter { return &FrameWriter{w: w} }

// Write sends one frame.
func (fw *FrameWriter) Write(kind byte, ch uint32, payload []byte) error {
	if len(payload) > MaxFrame {
		return fmt.Errorf("frame of %d bytes, more than %d", len(payload), MaxFrame)
	}
	b := make([]byte, FrameHeader+len(payload))
	b[0] = kind
	binary.BigEndian.PutUint32(b[1:], ch)
	binary.BigEndian.PutUint32(b[5:], uint32(len(payload)))
	copy(b[FrameHeader:], payload)
	fw.mu.Lock()
	defer fw.mu.Unlock()
	_, err := fw.w.Write(b)
	return err
}

// ReadFrame reads one frame; buf is reused when it is large enough.
func ReadFrame(r io.Reader, buf []byte) (kind byte, ch uint32, payload []byte, err error) {
	var h [FrameHeader]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, 0, nil, err
	}
	n := binary.BigEndian.Uint32(h[5:])
	if n > MaxFrame {
		return 0, 0, nil, fmt.Errorf("frame of %d bytes, more than %d", n, MaxFrame)
	}
	if int(n) > cap(buf) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		return 0, 0, nil, err
	}
	return h[0], binary.BigEndian.Uint32(h[1:]), buf, nil
}

// RunBridge runs the init behind the bridge and never returns: it ends when the host closes its
// stream, and with it (it is the sandbox's first process) the sandbox.
func RunBridge() {
	err := runBridge()
	if err != nil {
		fmt.Fprintf(os.Stderr, "sandbox-bridge: %v\n", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// bridge is the bridge's state: its channels, and the terminals' masters it holds by channel.
type bridge struct {
	out *FrameWriter
	// reqs carries the host's requests to the init, which runs in this process (serveInit).
	reqs chan bridgedRequest
	mux  *Mux
	mu   sync.Mutex
	// ttys are the terminals' masters, for their windows (FrameResize).
	ttys map[uint32]*os.File
	// nextTTY numbers the terminals' channels (with TerminalChannel); only replies uses it.
	nextTTY uint32
}

func runBridge() error {
	// Nothing inherited may stay open in the sandbox: ours is the stdio the runtime gave us.
	closeInherited(ctlFD)
	out := NewFrameWriter(os.Stdout)
	b := &bridge{
		out:  out,
		reqs: make(chan bridgedRequest, 64),
		ttys: make(map[uint32]*os.File),
	}
	// A frame for a channel the bridge does not have is discarded, and the host told, which logs
	// it: never silently (a dropped end of file once left a command waiting forever).
	b.mux = NewMux(out, func(kind byte, ch uint32, n int) {
		out.Write(FrameUnknown, ch, binary.BigEndian.AppendUint32([]byte{kind}, uint32(n)))
	})
	go func() {
		if err := b.requests(); err != nil {
			fmt.Fprintf(os.Stderr, "sandbox-bridge: %v\n", err)
			os.Exit(1)
		}
		os.Exit(0) // the host is gone: so is the sandbox
	}()
	// The init proper runs in this same process, the sandbox's pid 1, which nothing inside can
	// kill or stop; a second process would be the tenant's to kill (it runs as the tenant's uid).
	return b.serveInit()
}

// bridgedRequest is one request for the init and the fds the bridge made for it, now the init's.
type bridgedRequest struct {
	msg []byte
	fds []int
}

// serveInit runs the init on the host's requests: the first is its config. The init is the one of
// every level, but here it takes requests from a channel and replies through send, not over a
// control socket: under gVisor each sendmsg, recvmsg and wakeup of a thread blocked in one is a
// trap into the sentry, and a socket between two goroutines of one process bought nothing.
func (b *bridge) serveInit() error {
	r := <-b.reqs
	p, err := startInit(r.msg, b.send, nil)
	CloseFDs(r.fds)
	if err != nil {
		return err
	}
	for r := range b.reqs {
		p.handle(r.msg, r.fds, false)
	}
	return nil
}

// send is the init's reply path: one frame to the host, or for a command on a terminal (its forked
// reply with the master) a channel for the terminal, whose master stays here. As over a socket, the
// master passed is copied, and the init closes its own.
func (b *bridge) send(msg []byte, fds []int) error {
	if len(fds) == 1 && isTerminalMaster(fds[0]) {
		master, err := unix.FcntlInt(uintptr(fds[0]), unix.F_DUPFD_CLOEXEC, 0)
		if err == nil {
			if b.terminal(master, msg) != nil {
				os.Exit(1) // the host is gone
			}
			return nil
		}
		// No terminal: the reply goes alone, and the broker, seeing no master, ends the call.
	}
	if b.out.Write(FrameReply, 0, msg) != nil {
		os.Exit(1) // the host is gone
	}
	return nil
}

// requests reads the host's frames until the host closes the stream. It never waits for a
// command: a channel's data is queued within its window (flow.go), so a command that does not read
// its stdin holds up no other.
func (b *bridge) requests() error {
	buf := make([]byte, MaxFrame)
	for {
		kind, ch, p, err := ReadFrame(os.Stdin, buf)
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil // the host is gone
			}
			return err
		}
		switch kind {
		case FrameRequest:
			if err := b.request(p); err != nil {
				return err
			}
		case FrameResize:
			b.mu.Lock()
			f := b.ttys[ch]
			b.mu.Unlock()
			if f != nil && len(p) == 4 {
				ws := unix.Winsize{Row: binary.BigEndian.Uint16(p), Col: binary.BigEndian.Uint16(p[2:])}
				if ws.Row > 0 && ws.Col > 0 {
					// The sentry's line discipline sends SIGWINCH to the foreground job.
					if rc, err := f.SyscallConn(); err == nil {
						rc.Control(func(fd uintptr) { unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &ws) })
					}
				}
			}
		default:
			if kind == FrameClose && ch&TerminalChannel != 0 {
				// The broker let the terminal go: nothing more is typed on it either, and its
				// master closes (the Mux stops the output's sender, whose closer it is).
				b.mux.Drop(ch)
			}
			if _, err := b.mux.Handle(kind, ch, p); err != nil {
				return err
			}
		}
	}
}

// request makes a pipe for each channel the request names and hands the command's ends to the init
// with the request.
func (b *bridge) request(p []byte) error {
	if len(p) < 1 || len(p) < 1+5*int(p[0]) {
		return errors.New("short request frame")
	}
	n := int(p[0])
	var send []int
	for i := 0; i < n; i++ {
		e := p[1+5*i:]
		ch, dir := binary.BigEndian.Uint32(e), e[4]
		var fds [2]int
		if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
			CloseFDs(send)
			return fmt.Errorf("pipe: %w", err)
		}
		// Our end goes through the poller, so that a FrameClose can end a pump blocked in Read.
		ours := fds[0]
		if dir == FrameIn {
			ours = fds[1]
		}
		if err := unix.SetNonblock(ours, true); err != nil {
			CloseFDs(fds[:])
			CloseFDs(send)
			return err
		}
		if dir == FrameIn {
			// The command's stdin: the host's data as the command takes it. A failed write
			// (the command closed it, or exited) tells the host to stop sending.
			w := os.NewFile(uintptr(fds[1]), "stdin")
			in := b.mux.NewReceiver(ch)
			go func() {
				in.Deliver(w)
				w.Close()
			}()
			send = append(send, fds[0])
		} else {
			r := os.NewFile(uintptr(fds[0]), "output")
			out := b.mux.NewSender(ch, r)
			go func() {
				out.Pump(r)
				r.Close()
			}()
			send = append(send, fds[1])
		}
	}
	// The fds go to the init with the request; buf is the stream reader's, so the request is copied.
	b.reqs <- bridgedRequest{msg: append([]byte(nil), p[1+5*n:]...), fds: send}
	return nil
}

// isTerminalMaster reports whether fd is a pseudo-terminal's master (it has a terminal number).
func isTerminalMaster(fd int) bool {
	_, err := unix.IoctlGetUint32(fd, unix.TIOCGPTN)
	return err == nil
}

// terminal keeps a command's terminal master here and opens a channel for it: the host learns the
// channel with the reply before any of the terminal's output, since both go out in this order on
// the one stream.
func (b *bridge) terminal(master int, reply []byte) error {
	b.nextTTY++
	ch := TerminalChannel | b.nextTTY
	if err := unix.SetNonblock(master, true); err != nil {
		unix.Close(master)
		return b.out.Write(FrameReply, 0, reply) // the broker sees no master and ends the call
	}
	f := os.NewFile(uintptr(master), "tty-master")
	keys := b.mux.NewReceiver(ch)
	shows := b.mux.NewSender(ch, f)
	b.mu.Lock()
	b.ttys[ch] = f
	b.mu.Unlock()
	p := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(reply)), ch)
	if err := b.out.Write(FrameTerminal, ch, append(p, reply...)); err != nil {
		return err
	}
	go b.typeKeys(ch, f, keys)
	go func() {
		shows.Pump(f)
		b.mu.Lock()
		if b.ttys[ch] == f {
			delete(b.ttys, ch)
		}
		b.mu.Unlock()
		f.Close()
	}()
	return nil
}

// typeKeys types a terminal's keystrokes from the host. The end of the host's input is typed as the
// terminal's end-of-file character, which is how a terminal says it (as the broker does at the
// namespace level, tty.go). A failed write tells the host to stop sending.
func (b *bridge) typeKeys(ch uint32, f *os.File, keys *Receiver) {
	if !keys.Deliver(f) {
		return
	}
	b.mu.Lock()
	open := b.ttys[ch] == f // the host ended its input (FrameEOF), and the terminal is still there
	b.mu.Unlock()
	if open {
		typeEOF(f)
	}
}

// typeEOF writes the terminal's VEOF character (^D unless the program changed it) to its master.
func typeEOF(master *os.File) {
	rc, err := master.SyscallConn()
	if err != nil {
		return
	}
	eof := byte(4)
	rc.Control(func(fd uintptr) {
		// Terminal modes asked of a master are its slave's, which the program sets.
		if t, err := unix.IoctlGetTermios(int(fd), unix.TCGETS); err == nil && t.Cc[unix.VEOF] != 0 {
			eof = t.Cc[unix.VEOF]
		}
	})
	master.Write([]byte{eof})
}
