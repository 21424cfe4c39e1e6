package provider

import (
	"encoding/binary"
	"os"
	"os/exec"
	"sync"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
	"golang.org/x/sys/unix"
)

// relay is the host's end of a gVisor sandbox's bridge (sbxinit.RunBridge). The instance speaks to
// it as to any init: SEQPACKET messages with the commands' pipes as SCM_RIGHTS. The relay turns
// each message into a frame on the bridge's stdin and each passed pipe into a channel, and back:
// the sentry imports the runtime's stdio from the host but cannot carry fds across, so every byte of
// a command's stdio rides the one stream (docs/ARCHITECTURE.md, "Isolation levels").
type relay struct {
	// ctl is our end of the instance's control socket (blocking: each direction has its own
	// goroutine). closed once both have returned.
	ctl int
	out *sbxinit.FrameWriter
	in  *os.File // the bridge's stdout, read here

	mu   sync.Mutex
	next uint32
	ins  map[uint32]*os.File    // command stdin: we read the broker's pipe and send it
	outs map[uint32]chan []byte // command output: queued for the broker's pipe, closed at EOF
}

// startRelay wires cmd (runsc run) so that its container's stdin and stdout are the bridge's stream,
// and serves ctl (the init's end of the instance's control socket, which it takes). after closes
// the child's ends once cmd has started.
func startRelay(ctl *os.File, cmd *exec.Cmd) (after func(), err error) {
	fd, err := unix.Dup(int(ctl.Fd()))
	if err != nil {
		return nil, err
	}
	unix.CloseOnExec(fd)
	toR, toW, err := os.Pipe()
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	fromR, fromW, err := os.Pipe()
	if err != nil {
		unix.Close(fd)
		toR.Close()
		toW.Close()
		return nil, err
	}
	cmd.Stdin, cmd.Stdout = toR, fromW
	r := &relay{
		ctl:  fd,
		out:  sbxinit.NewFrameWriter(toW),
		in:   fromR,
		ins:  make(map[uint32]*os.File),
		outs: make(map[uint32]chan []byte),
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { r.fromBroker(toW); wg.Done() }()
	go func() { r.fromBridge(); wg.Done() }()
	go func() { wg.Wait(); unix.Close(fd) }() // both use the fd until they return
	return func() {
		toR.Close()
		fromW.Close()
	}, nil
}

// fromBroker forwards the instance's requests, and their pipes as channels, to the bridge. It ends
// when the instance closes its end (the sandbox is torn down), and closes the bridge's stdin then.
func (r *relay) fromBroker(toBridge *os.File) {
	// Closing the bridge's stdin ends the bridge, and with it the sandbox, if it still runs.
	defer toBridge.Close()
	buf := make([]byte, maxMessage+4096)
	oob := make([]byte, unix.CmsgSpace(8*4))
	for {
		var n, oobn int
		var err error
		for {
			n, oobn, _, _, err = unix.Recvmsg(r.ctl, buf, oob, unix.MSG_CMSG_CLOEXEC)
			if err != unix.EINTR {
				break
			}
		}
		if err != nil || n == 0 {
			return
		}
		fds, _ := parseRights(oob[:oobn])
		head := []byte{byte(len(fds))}
		// A command's stdin is copied only once its request is on the way: data or an EOF for a
		// channel the bridge has not heard of yet is dropped there, and the command waits forever.
		var senders []func()
		for _, fd := range fds {
			r.mu.Lock()
			r.next++
			ch := r.next
			r.mu.Unlock()
			dir := byte(sbxinit.FrameOut)
			if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0); err == nil && fl&unix.O_ACCMODE == unix.O_RDONLY {
				dir = sbxinit.FrameIn
			}
			head = binary.BigEndian.AppendUint32(head, ch)
			head = append(head, dir)
			unix.SetNonblock(fd, true) // through the poller, so closeAll ends a blocked copy
			f := os.NewFile(uintptr(fd), "exec-stdio")
			if dir == sbxinit.FrameIn {
				r.mu.Lock()
				r.ins[ch] = f
				r.mu.Unlock()
				senders = append(senders, func() { go r.send(ch, f) })
			} else {
				q := make(chan []byte, 64)
				r.mu.Lock()
				r.outs[ch] = q
				r.mu.Unlock()
				go r.deliver(ch, f, q)
			}
		}
		if r.out.Write(sbxinit.FrameRequest, 0, append(head, buf[:n]...)) != nil {
			return // the bridge is gone; fromBridge ends the channels
		}
		for _, start := range senders {
			start()
		}
	}
}

// send copies a command's stdin from the broker's pipe to the bridge, then says EOF.
func (r *relay) send(ch uint32, f *os.File) {
	b := make([]byte, 32<<10)
	for {
		n, err := f.Read(b)
		if n > 0 && r.out.Write(sbxinit.FrameData, ch, b[:n]) != nil {
			break
		}
		if err != nil {
			break
		}
	}
	r.mu.Lock()
	if r.ins[ch] == f {
		delete(r.ins, ch)
	}
	r.mu.Unlock()
	f.Close()
	r.out.Write(sbxinit.FrameEOF, ch, nil)
}

// deliver writes a command's output into the broker's pipe. Once the broker has closed its end
// (the exec returned), the bridge is told to stop and the rest is dropped.
func (r *relay) deliver(ch uint32, f *os.File, q chan []byte) {
	failed := false
	for p := range q {
		if failed {
			continue
		}
		if _, err := f.Write(p); err != nil {
			failed = true
			f.Close()
			r.out.Write(sbxinit.FrameClose, ch, nil)
		}
	}
	if !failed {
		f.Close()
	}
}

// fromBridge forwards the init's replies to the instance and the commands' output to their pipes.
// It ends when the bridge's stdout closes: the sandbox ended.
func (r *relay) fromBridge() {
	buf := make([]byte, sbxinit.MaxFrame)
	for {
		kind, ch, p, err := sbxinit.ReadFrame(r.in, buf)
		if err != nil {
			r.in.Close()
			r.closeAll()
			// The instance reads the end of its control socket and fails what is in flight;
			// fromBroker's read ends too.
			unix.Shutdown(r.ctl, unix.SHUT_RDWR)
			return
		}
		switch kind {
		case sbxinit.FrameReply:
			// An error means the instance is gone; keep draining so the bridge never blocks.
			for unix.Sendmsg(r.ctl, p, nil, nil, unix.MSG_NOSIGNAL) == unix.EINTR {
			}
		case sbxinit.FrameTerminal:
			if len(p) < 4 {
				continue
			}
			r.terminal(binary.BigEndian.Uint32(p), p[4:])
		case sbxinit.FrameData:
			r.mu.Lock()
			q := r.outs[ch]
			r.mu.Unlock()
			if q != nil {
				q <- append([]byte(nil), p...)
			}
		case sbxinit.FrameEOF:
			r.mu.Lock()
			q := r.outs[ch]
			delete(r.outs, ch)
			r.mu.Unlock()
			if q != nil {
				close(q)
			}
		case sbxinit.FrameClose:
			r.mu.Lock()
			f := r.ins[ch]
			delete(r.ins, ch)
			r.mu.Unlock()
			if f != nil {
				f.Close()
			}
		}
	}
}

// closeAll ends every channel; only fromBridge calls it (it alone sends on the queues).
func (r *relay) closeAll() {
	r.mu.Lock()
	ins, outs := r.ins, r.outs
	r.ins, r.outs = map[uint32]*os.File{}, map[uint32]chan []byte{}
	r.mu.Unlock()
	for _, f := range ins {
		f.Close()
	}
	for _, q := range outs {
		close(q)
	}
}

// Messages on a bridged terminal's socket, from the instance to the relay: a type byte, then its
// payload. The other way, each message is the terminal's output as it is.
const (
	ttyMsgData   = 'd' // keystrokes
	ttyMsgResize = 'r' // a window: rows, then columns, each a big-endian uint16
	ttyMsgEOF    = 'e' // the input ended: type the terminal's end-of-file character
)

// ttyMsgMax is the most keystrokes one message carries; a message is read whole or cut.
const ttyMsgMax = 16 << 10

// terminal hands the instance a bridged terminal: the reply, with one end of a fresh socket pair
// where the init would have passed the master. The master stays in the sandbox, with the bridge;
// the socket's messages become the channel's frames (terminalInput) and the channel's data the
// socket's messages (deliver). The instance cannot tell a socket from a master by what it reads,
// so it writes (tty.go, bridgedTerminal) in messages that say what they are.
func (r *relay) terminal(ch uint32, reply []byte) {
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		// No terminal: the reply alone, and the instance ends the call; the bridge closes the
		// master when its writes here fail.
		r.out.Write(sbxinit.FrameClose, ch, nil)
		for unix.Sendmsg(r.ctl, reply, nil, nil, unix.MSG_NOSIGNAL) == unix.EINTR {
		}
		return
	}
	unix.SetNonblock(sp[0], true) // through the poller, so closeAll ends a blocked read
	f := os.NewFile(uintptr(sp[0]), "tty-bridge")
	q := make(chan []byte, 64)
	r.mu.Lock()
	r.ins[ch] = f
	r.outs[ch] = q
	r.mu.Unlock()
	go r.deliver(ch, f, q)
	go r.terminalInput(ch, f)
	for unix.Sendmsg(r.ctl, reply, unix.UnixRights(sp[1]), nil, unix.MSG_NOSIGNAL) == unix.EINTR {
	}
	unix.Close(sp[1])
}

// terminalInput turns the instance's messages on a terminal's socket into the channel's frames.
// When the instance closes its end (the call returned), the bridge is told to close the master.
func (r *relay) terminalInput(ch uint32, f *os.File) {
	b := make([]byte, 1+ttyMsgMax)
	for {
		n, err := f.Read(b)
		if err != nil || n == 0 {
			break
		}
		switch b[0] {
		case ttyMsgData:
			err = r.out.Write(sbxinit.FrameData, ch, b[1:n])
		case ttyMsgResize:
			err = r.out.Write(sbxinit.FrameResize, ch, b[1:n])
		case ttyMsgEOF:
			err = r.out.Write(sbxinit.FrameEOF, ch, nil)
		}
		if err != nil {
			break
		}
	}
	r.mu.Lock()
	if r.ins[ch] == f {
		delete(r.ins, ch)
	}
	r.mu.Unlock()
	f.Close()
	r.out.Write(sbxinit.FrameClose, ch, nil)
}
