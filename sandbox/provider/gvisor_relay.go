package provider

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
	"golang.org/x/sys/unix"
)

// relay is the host's end of a gVisor sandbox's bridge (sbxinit.RunBridge). The instance speaks to
// it as to any init: SEQPACKET messages with the commands' pipes as SCM_RIGHTS. The relay turns
// each message into a frame on the bridge's stdin and each passed pipe into a channel, and back:
// the sentry imports the runtime's stdio from the host but cannot carry fds across, so every byte of
// a command's stdio rides the one stream (docs/ARCHITECTURE.md, "Isolation levels"). Each channel
// has its own window (sbxinit.Mux): the stream's reader never waits for a command's reader, so a
// command whose output the broker does not take holds up that command only.
type relay struct {
	// ctl is our end of the instance's control socket (blocking: each direction has its own
	// goroutine). closed once both have returned.
	ctl int
	out *sbxinit.FrameWriter
	in  *os.File // the bridge's stdout, read here
	mux *sbxinit.Mux
	log *slog.Logger

	max int // relayMaxChannels when it started

	mu   sync.Mutex
	next uint32
	// terminals are the terminal commands forwarded whose terminal has not come (by request id):
	// a FrameTerminal is taken only for one of them, once, and each counts against the bound
	// until it comes or the command's exit or error does. The bridge names a terminal's channel,
	// so unchecked it could open terminals nobody asked for, without bound, or name a channel
	// open already and orphan it (never ended, its goroutine and pipe held past the sandbox).
	terminals map[uint64]struct{}
	// stdins are the stdin channels still copied, by request id: a command's exit ends them.
	// Otherwise a process the command left behind holding its stdin, never reading it, held the
	// channel (the copy waiting for credit, deaf to the broker closing its end) until it ended.
	stdins map[uint64][]*sbxinit.Sender
	// proc is the runtime's process (runsc run) once it started: a bridge that breaks the
	// protocol is not trusted to end when its stream does, so the relay ends the sandbox itself.
	proc *os.Process

	// Discards and refusals are logged at most logBurst times per logEvery each: the bridge is
	// inside the sandbox and could write the host's log as fast as it can write frames, and a
	// delegate at the bound as fast as it can ask for commands.
	now      func() time.Time
	discards logLimit
	refusals logLimit
}

const (
	logBurst = 10
	logEvery = time.Minute
)

// logLimit lets a kind of log line through at most logBurst times per logEvery; what it holds back
// is counted and said by the first line it lets through after.
type logLimit struct {
	mu      sync.Mutex
	since   time.Time
	logged  int
	unheard int
}

// allow answers whether to log now, and attributes to add: how many were held back before, and
// on the last line let through, when the next may come.
func (l *logLimit) allow(now time.Time) (bool, []any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var attrs []any
	if now.Sub(l.since) >= logEvery {
		if l.unheard > 0 {
			attrs = append(attrs, "not_logged", l.unheard)
		}
		l.since, l.logged, l.unheard = now, 0, 0
	}
	if l.logged >= logBurst {
		l.unheard++
		return false, nil
	}
	l.logged++
	if l.logged == logBurst {
		attrs = append(attrs, "next_logged_after", logEvery.String())
	}
	return true, attrs
}

// relayMaxChannels bounds the channels open at once on one sandbox's relay. Each holds at most
// sbxinit.Window queued while the broker does not take its data, so a sandbox's relay holds at most
// relayMaxChannels x Window (64 MiB) however many of its commands stall; a request past it is
// refused (the exec fails with ErrBusy, saying so), never queued. A variable for its tests only,
// read when a relay starts (so a test may set it back while its sandbox still runs).
var relayMaxChannels = 512

// relayDiscards counts frames discarded, on either side of any sandbox's bridge, for a channel not
// open there. It stays 0 unless the relay or the bridge has a defect (each is logged too).
var relayDiscards atomic.Int64

// GvisorRelayDiscards is how many frames the gvisor bridges of this process discarded for a channel
// not open on their side (relayDiscards): 0 unless the relay or the bridge has a defect.
func GvisorRelayDiscards() int64 { return relayDiscards.Load() }

// startRelay wires cmd (runsc run) so that its container's stdin and stdout are the bridge's stream,
// and serves ctl (the init's end of the instance's control socket, which it takes). after closes
// the child's ends once cmd has started. log carries the sandbox's id.
func startRelay(ctl *os.File, cmd *exec.Cmd, log *slog.Logger) (after func(), err error) {
	_, after, err = startRelayOn(ctl, cmd, log)
	return after, err
}

// startRelayOn is startRelay, answering the relay too (for its tests).
func startRelayOn(ctl *os.File, cmd *exec.Cmd, log *slog.Logger) (_ *relay, after func(), err error) {
	fd, err := unix.Dup(int(ctl.Fd()))
	if err != nil {
		return nil, nil, err
	}
	unix.CloseOnExec(fd)
	toR, toW, err := os.Pipe()
	if err != nil {
		unix.Close(fd)
		return nil, nil, err
	}
	fromR, fromW, err := os.Pipe()
	if err != nil {
		unix.Close(fd)
		toR.Close()
		toW.Close()
		return nil, nil, err
	}
	cmd.Stdin, cmd.Stdout = toR, fromW
	r := &relay{ctl: fd, out: sbxinit.NewFrameWriter(toW), in: fromR, log: log, max: relayMaxChannels, now: time.Now,
		terminals: map[uint64]struct{}{}, stdins: map[uint64][]*sbxinit.Sender{}}
	r.mux = sbxinit.NewMux(r.out, func(kind byte, ch uint32, n int) { r.discarded("relay", kind, ch, n) })
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { r.fromBroker(toW); wg.Done() }()
	go func() { r.fromBridge(); wg.Done() }()
	go func() { wg.Wait(); unix.Close(fd) }() // both use the fd until they return
	return r, func() {
		toR.Close()
		fromW.Close()
		r.mu.Lock()
		r.proc = cmd.Process
		r.mu.Unlock()
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
		// A request without fds may open a terminal; only such a request is read (a terminal
		// command passes none), so that its terminal is known to be asked for.
		var tty *execHead
		if len(fds) == 0 {
			if h, ok := parseExecHead(buf[:n]); ok && h.TTY {
				tty = &h
			}
		}
		// One more for the terminal a request without fds may open.
		if open := r.open(); open+len(fds)+1 > r.max && r.refuse(buf[:n], fds, open) {
			continue
		}
		if tty != nil {
			r.mu.Lock()
			r.terminals[tty.ID] = struct{}{}
			r.mu.Unlock()
		}
		head := []byte{byte(len(fds))}
		// A command's stdin is copied only once its request is on the way: the bridge opens the
		// channel when the request comes, and anything before it would be discarded there.
		type stdin struct {
			s *sbxinit.Sender
			f *os.File
		}
		var stdins []stdin
		for _, fd := range fds {
			ch := r.channel()
			dir := byte(sbxinit.FrameOut)
			if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0); err == nil && fl&unix.O_ACCMODE == unix.O_RDONLY {
				dir = sbxinit.FrameIn
			}
			head = binary.BigEndian.AppendUint32(head, ch)
			head = append(head, dir)
			unix.SetNonblock(fd, true) // through the poller, so a FrameClose or the end ends a blocked copy
			f := os.NewFile(uintptr(fd), "exec-stdio")
			if dir == sbxinit.FrameIn {
				stdins = append(stdins, stdin{r.mux.NewSender(ch, f), f})
			} else {
				out := r.mux.NewReceiver(ch)
				go func() {
					// Once the broker has closed its end (the exec returned), the bridge is told
					// to stop, and the rest is discarded.
					out.Deliver(f)
					f.Close()
				}()
				go func() {
					// The broker's end may close while nothing comes (a process the command left
					// behind holds its stdout and writes nothing): a failed write would never
					// tell, and the channel would count against the bound until that process
					// ended. Its close lets the channel go as a failed write does.
					if readerGone(f) {
						out.Close()
					}
				}()
			}
		}
		var id uint64
		if len(stdins) > 0 {
			// Only a request with a stdin is read here, for its id.
			if h, ok := parseExecHead(buf[:n]); ok {
				id = h.ID
				r.mu.Lock()
				for _, in := range stdins {
					r.stdins[id] = append(r.stdins[id], in.s)
				}
				r.mu.Unlock()
			}
		}
		if r.out.Write(sbxinit.FrameRequest, 0, append(head, buf[:n]...)) != nil {
			for _, in := range stdins {
				in.s.Abandon()
				in.f.Close()
			}
			return // the bridge is gone; fromBridge ends the channels
		}
		for _, in := range stdins {
			go func() {
				in.s.Pump(in.f)
				in.f.Close()
				r.copied(id, in.s)
			}()
		}
	}
}

// channel numbers a new channel of the relay's: from 1 up, below TerminalChannel (the bridge's
// numbers), and, once the numbers wrapped (a long-lived sandbox's billions), none still open.
func (r *relay) channel() uint32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		r.next++
		if r.next&sbxinit.TerminalChannel != 0 {
			r.next = 1
		}
		if !r.mux.Has(r.next) {
			return r.next
		}
	}
}

// readerGone waits, parked in the runtime's poller (no thread), until the read end of the pipe
// whose write end is f is closed, and answers true; false once f is closed. The poller reports a
// pipe's write end readable only with an error (EPOLLERR: no reader left), and poll(2) says which.
func readerGone(f *os.File) bool {
	rc, err := f.SyscallConn()
	if err != nil {
		return false
	}
	gone := false
	err = rc.Read(func(fd uintptr) bool {
		p := []unix.PollFd{{Fd: int32(fd)}}
		for {
			_, err := unix.Poll(p, 0)
			if err != unix.EINTR {
				break
			}
		}
		gone = p[0].Revents&unix.POLLERR != 0
		return gone
	})
	return err == nil && gone
}

// refuse answers a command that would open channels past the relay's bound with an error, as the
// init answers a command it cannot start, and lets its pipes go. Anything else (a kill, a command
// with no stdio and no terminal) goes on: it answers false.
func (r *relay) refuse(msg []byte, fds []int, open int) bool {
	req, ok := parseExecHead(msg)
	if !ok {
		return false
	}
	channels := len(fds)
	if req.TTY {
		channels++
	}
	if channels == 0 || open+channels <= r.max {
		return false
	}
	closeFDs(fds)
	if ok, attrs := r.refusals.allow(r.now()); ok {
		r.log.Warn("gvisor relay: a command refused, too many channels open",
			append([]any{"open", open, "max", r.max}, attrs...)...)
	}
	b, _ := json.Marshal(&reply{Op: opError, ID: req.ID, Kind: sbxinit.ErrKindBusy,
		Err: fmt.Sprintf("too many command streams open in the sandbox (%d, this command's %d more would pass the %d it may have): wait for some of its commands to end",
			open, channels, r.max)})
	for unix.Sendmsg(r.ctl, b, nil, nil, unix.MSG_NOSIGNAL) == unix.EINTR {
	}
	return true
}

// execHead is what the relay reads of an exec request.
type execHead struct {
	Op  string `json:"op"`
	ID  uint64 `json:"id"`
	TTY bool   `json:"tty"`
}

func parseExecHead(msg []byte) (execHead, bool) {
	var h execHead
	if json.Unmarshal(msg, &h) != nil || h.Op != opExec {
		return h, false
	}
	return h, true
}

// open counts the channels open and the terminals asked for and not yet come.
func (r *relay) open() int {
	r.mu.Lock()
	n := len(r.terminals)
	r.mu.Unlock()
	return n + r.mux.Open()
}

// copied forgets a stdin channel whose copy ended.
func (r *relay) copied(id uint64, s *sbxinit.Sender) {
	r.mu.Lock()
	defer r.mu.Unlock()
	left := slices.DeleteFunc(r.stdins[id], func(x *sbxinit.Sender) bool { return x == s })
	if len(left) == 0 {
		delete(r.stdins, id)
	} else {
		r.stdins[id] = left
	}
}

// replied acts on a command's exit or error: a terminal asked for and not come is no longer, and
// its stdin channels still copied end (what the command did not read, nothing will: at the
// namespace level the broker closes the pipe then).
func (r *relay) replied(msg []byte) {
	r.mu.Lock()
	waiting := len(r.terminals) > 0 || len(r.stdins) > 0
	r.mu.Unlock()
	if !waiting {
		return // the usual case: no reply is read
	}
	var rep struct {
		Op string `json:"op"`
		ID uint64 `json:"id"`
	}
	if json.Unmarshal(msg, &rep) != nil || rep.Op != opExit && rep.Op != opError {
		return
	}
	r.mu.Lock()
	delete(r.terminals, rep.ID)
	stdins := r.stdins[rep.ID]
	delete(r.stdins, rep.ID)
	r.mu.Unlock()
	for _, s := range stdins {
		s.Stop()
	}
}

// askedTerminal checks a FrameTerminal: its channel is one the bridge numbers and not open, and
// its reply is for a terminal command forwarded whose terminal has not come. Anything else is the
// bridge breaking the protocol.
func (r *relay) askedTerminal(ch uint32, reply []byte) error {
	if ch&sbxinit.TerminalChannel == 0 || r.mux.Has(ch) {
		return fmt.Errorf("a terminal on channel %d, which is not the bridge's to open", ch)
	}
	var rep struct {
		ID uint64 `json:"id"`
	}
	json.Unmarshal(reply, &rep)
	r.mu.Lock()
	_, asked := r.terminals[rep.ID]
	delete(r.terminals, rep.ID)
	r.mu.Unlock()
	if !asked {
		return fmt.Errorf("a terminal for request %d, which asked for none", rep.ID)
	}
	return nil
}

// fromBridge forwards the init's replies to the instance and the commands' output to their
// channels. It never waits for a command's reader (a channel's data is queued within its window).
// It ends when the bridge's stdout closes (the sandbox ended) or the bridge breaks the protocol.
func (r *relay) fromBridge() {
	buf := make([]byte, sbxinit.MaxFrame)
	for {
		broken := false // the bridge broke the protocol, rather than its stream ended
		kind, ch, p, err := sbxinit.ReadFrame(r.in, buf)
		if err == nil {
			switch kind {
			case sbxinit.FrameReply:
				r.replied(p)
				// An error means the instance is gone; keep draining so the bridge never blocks.
				for unix.Sendmsg(r.ctl, p, nil, nil, unix.MSG_NOSIGNAL) == unix.EINTR {
				}
			case sbxinit.FrameTerminal:
				if len(p) < 4 {
					break
				}
				if err = r.askedTerminal(binary.BigEndian.Uint32(p), p[4:]); err != nil {
					r.log.Error("gvisor relay: the bridge opened a terminal it may not; ending the sandbox", "err", err)
					broken = true
					break
				}
				r.terminal(binary.BigEndian.Uint32(p), p[4:])
			case sbxinit.FrameUnknown:
				if len(p) == 5 {
					r.discarded("bridge", p[0], ch, int(binary.BigEndian.Uint32(p[1:])))
				}
			default:
				if _, err = r.mux.Handle(kind, ch, p); err != nil {
					// Past its window: the bridge is broken or not ours. Nothing more of it is
					// trusted; the sandbox ends.
					r.log.Error("gvisor relay: the bridge broke its flow control; ending the sandbox", "err", err)
					broken = true
				}
			}
		}
		if err != nil {
			if broken {
				// As Stop does: its sandbox and gofer die with runsc run. The instance sees
				// the runtime end, with everything in flight.
				r.mu.Lock()
				if r.proc != nil {
					r.proc.Kill()
				}
				r.mu.Unlock()
			}
			r.in.Close()
			r.mux.End()
			// The instance reads the end of its control socket and fails what is in flight;
			// fromBroker's read ends too.
			unix.Shutdown(r.ctl, unix.SHUT_RDWR)
			return
		}
	}
}

// discarded reports a frame dropped for a channel not open on side ("relay" or "bridge"): counted
// always, logged within r.discards.
func (r *relay) discarded(side string, kind byte, ch uint32, n int) {
	relayDiscards.Add(1)
	if ok, attrs := r.discards.allow(r.now()); ok {
		r.log.Warn("gvisor bridge: a frame for a channel that is not open was discarded",
			append([]any{"side", side, "frame", kind, "channel", ch, "bytes", n}, attrs...)...)
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
// socket's messages. The instance cannot tell a socket from a master by what it reads, so it writes
// (tty.go, bridgedTerminal) in messages that say what they are.
func (r *relay) terminal(ch uint32, reply []byte) {
	shows := r.mux.NewReceiver(ch)
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		// No terminal: the bridge closes the master, the reply goes alone, and the instance
		// ends the call. The output on its way is discarded until the bridge's end of file.
		shows.Close()
		for unix.Sendmsg(r.ctl, reply, nil, nil, unix.MSG_NOSIGNAL) == unix.EINTR {
		}
		return
	}
	unix.SetNonblock(sp[0], true) // through the poller, so the end of the stream ends a blocked read
	f := os.NewFile(uintptr(sp[0]), "tty-bridge")
	// When the bridge cannot type (FrameClose) or the stream ends, only the reading half goes:
	// the terminal's output still has the socket until the bridge's end of file.
	keys := r.mux.NewSender(ch, shutRead{f})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		shows.Deliver(f)
		wg.Done()
	}()
	go func() {
		r.terminalInput(ch, f, keys, shows)
		wg.Done()
	}()
	go func() {
		wg.Wait()
		f.Close()
	}()
	for unix.Sendmsg(r.ctl, reply, unix.UnixRights(sp[1]), nil, unix.MSG_NOSIGNAL) == unix.EINTR {
	}
	unix.Close(sp[1])
}

// terminalInput turns the instance's messages on a terminal's socket into the channel's frames,
// keystrokes within the channel's credit. When the instance closes its end (the call returned), the
// bridge is told to close the master: the host's last frame on the channel.
func (r *relay) terminalInput(ch uint32, f *os.File, keys *sbxinit.Sender, shows *sbxinit.Receiver) {
	b := make([]byte, 1+ttyMsgMax)
	for {
		n, err := f.Read(b)
		if err != nil || n == 0 {
			break
		}
		switch b[0] {
		case ttyMsgData:
			_, err = keys.Write(b[1:n])
		case ttyMsgResize:
			err = r.out.Write(sbxinit.FrameResize, ch, b[1:n])
		case ttyMsgEOF:
			keys.Finish()
		}
		if err != nil {
			break
		}
	}
	keys.Abandon()
	if !shows.Close() {
		// The output had ended (or failed) already; the bridge must still let the master go.
		r.out.Write(sbxinit.FrameClose, ch, nil)
	}
}

// shutRead ends the reading half of a socket, so that a Read blocked on it returns, and leaves the
// writing half to the terminal's output.
type shutRead struct{ f *os.File }

func (s shutRead) Close() error {
	rc, err := s.f.SyscallConn()
	if err != nil {
		return err
	}
	return rc.Control(func(fd uintptr) { unix.Shutdown(int(fd), unix.SHUT_RD) })
}
