package provider

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
	"github.com/sbxbroker/broker/tests/wait"
	"golang.org/x/sys/unix"
)

// The relay reads its bridge's frames from inside the sandbox, where the tenant's code runs: it
// must hold whatever those frames are without growing the host's memory, goroutines, fds or logs
// beyond its bounds. A real bridge (runsc) never sends these frames, so a fake one stands in for a
// corrupted or impersonated bridge here: the test holds the bridge's ends of the stream and the
// instance's end of the control socket, and the relay under test is the real one.

type hostileBridge struct {
	r        *relay
	instance int                  // the instance's end of the control socket
	toHost   *sbxinit.FrameWriter // frames as the bridge would write them
	stream   *os.File             // the bridge's stdout, the relay's input
	logs     *countingHandler
	requests chan []byte // the FrameRequests' payloads, as the bridge reads them
}

func newHostileBridge(t *testing.T) *hostileBridge {
	t.Helper()
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	initEnd := os.NewFile(uintptr(sp[1]), "init-end")
	defer initEnd.Close()
	cmd := &exec.Cmd{} // never started: the test is the bridge
	logs := &countingHandler{}
	r, _, err := startRelayOn(initEnd, cmd, slog.New(logs))
	if err != nil {
		t.Fatal(err)
	}
	fromHost := cmd.Stdin.(*os.File)
	stream := cmd.Stdout.(*os.File)
	requests := make(chan []byte, 16)
	go func() {
		// The relay's frames to the bridge: taken, never answered; the requests' heads kept.
		buf := make([]byte, sbxinit.MaxFrame)
		for {
			kind, _, p, err := sbxinit.ReadFrame(fromHost, buf)
			if err != nil {
				return
			}
			if kind == sbxinit.FrameRequest {
				select {
				case requests <- append([]byte(nil), p...):
				default:
				}
			}
		}
	}()
	t.Cleanup(func() {
		stream.Close()
		unix.Close(sp[0])
		fromHost.Close()
	})
	return &hostileBridge{r: r, instance: sp[0], toHost: sbxinit.NewFrameWriter(stream), stream: stream, logs: logs, requests: requests}
}

// sync sends a reply and waits for it at the instance: every frame sent before it was handled.
// Messages before it (replies the relay made) are returned, their fds closed as the instance
// closes those it has no call for.
func (b *hostileBridge) sync(t *testing.T) (withFD, without int) {
	t.Helper()
	if err := b.toHost.Write(sbxinit.FrameReply, 0, []byte(`{"op":"sync"}`)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for {
		var tv = unix.Timeval{Sec: 20}
		unix.SetsockoptTimeval(b.instance, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		n, oobn, _, _, err := unix.Recvmsg(b.instance, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 {
			t.Fatalf("the relay's messages ended before the sync: %v", err)
		}
		fds, _ := parseRights(oob[:oobn])
		closeFDs(fds)
		if string(buf[:n]) == `{"op":"sync"}` {
			return withFD, without
		}
		if len(fds) > 0 {
			withFD++
		} else {
			without++
		}
	}
}

// countingHandler counts the log records by message.
type countingHandler struct {
	mu   sync.Mutex
	msgs map[string]int
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, rec slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.msgs == nil {
		h.msgs = map[string]int{}
	}
	h.msgs[rec.Message]++
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func (h *countingHandler) count(sub string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for m, c := range h.msgs {
		if strings.Contains(m, sub) {
			n += c
		}
	}
	return n
}

// A bridge that reports discards (FrameUnknown), or sends frames for channels that are not open,
// by the thousand gets them counted, but logged a few times only: each was a log line, and a
// bridge could write the host's logs as fast as it could write frames.
func TestRelayDiscardLogsAreBounded(t *testing.T) {
	b := newHostileBridge(t)
	start := time.Unix(1_000_000, 0)
	now := start
	var mu sync.Mutex
	b.r.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	discards := relayDiscards.Load()
	const flood = 5000
	for i := range flood {
		b.toHost.Write(sbxinit.FrameUnknown, uint32(i), binary.BigEndian.AppendUint32([]byte{sbxinit.FrameData}, 1))
		b.toHost.Write(sbxinit.FrameData, 1000+uint32(i), []byte("x"))
	}
	b.sync(t)
	if d := relayDiscards.Load() - discards; d != 2*flood {
		t.Fatalf("%d discards counted, want %d", d, 2*flood)
	}
	logged := b.logs.count("discarded")
	if logged == 0 || logged > logBurst+1 {
		t.Fatalf("%d discards logged %d times: want at least once, at most %d", 2*flood, logged, logBurst+1)
	}
	// Later, discards are logged again, and the first says how many went unlogged.
	mu.Lock()
	now = start.Add(logEvery)
	mu.Unlock()
	b.toHost.Write(sbxinit.FrameUnknown, 7, binary.BigEndian.AppendUint32([]byte{sbxinit.FrameEOF}, 0))
	b.sync(t)
	if n := b.logs.count("discarded"); n != logged+1 {
		t.Fatalf("a discard a minute later: logged %d times in all, want %d", n, logged+1)
	}
}

// ended waits for the relay to end the stream: the instance reads the end of its socket.
func (b *hostileBridge) ended(t *testing.T) {
	t.Helper()
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	tv := unix.Timeval{Sec: 20}
	unix.SetsockoptTimeval(b.instance, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	for {
		n, oobn, _, _, err := unix.Recvmsg(b.instance, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err == unix.EINTR {
			continue
		}
		fds, _ := parseRights(oob[:oobn])
		closeFDs(fds)
		if err == unix.EAGAIN {
			t.Fatal("the relay did not end the stream")
		}
		if err != nil || n == 0 {
			return
		}
	}
}

// terminal sends a FrameTerminal as the bridge does: the channel, then the reply.
func (b *hostileBridge) terminal(ch uint32, id int) {
	p := binary.BigEndian.AppendUint32(nil, ch)
	b.toHost.Write(sbxinit.FrameTerminal, ch, append(p, fmt.Sprintf(`{"op":"forked","id":%d}`, id)...))
}

// exec sends the instance's request, with fds.
func (b *hostileBridge) exec(t *testing.T, msg string, fds ...int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if err := unix.Sendmsg(b.instance, []byte(msg), oob, nil, 0); err != nil {
		t.Fatal(err)
	}
}

// A FrameTerminal names its channel, chosen by the bridge. One naming a channel the host opened for
// a command's stdio (or any channel open already) replaced it in the relay's table: the command's
// receiver was orphaned, never ended even by the stream's end, its goroutine and its pipe held
// for as long as the broker runs, after the sandbox is gone. It is the bridge breaking the
// protocol: the relay ends the sandbox's stream, and every channel with it.
func TestRelayTerminalOnAnOpenChannelEndsTheStream(t *testing.T) {
	b := newHostileBridge(t)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	stdout := os.NewFile(uintptr(p[0]), "stdout")
	defer stdout.Close()
	b.exec(t, `{"op":"exec","id":1,"argv":["true"],"stdio":[-1,0,0]}`, p[1])
	unix.Close(p[1])
	b.exec(t, `{"op":"exec","id":2,"argv":["sh"],"tty":true}`)
	// The relay numbers its channels from 1: the command's stdout is 1.
	if !wait.Until(20*time.Second, func() bool { return b.r.open() == 2 }) {
		t.Fatalf("the command's channel and the terminal asked for: open %d, want 2", b.r.open())
	}
	b.terminal(1, 2)
	b.ended(t)
	got := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, stdout)
		got <- err
	}()
	select {
	case <-got:
	case <-time.After(20 * time.Second):
		t.Fatal("the command's output never ended: its channel was orphaned by the bridge's terminal")
	}
}

// A bridge sending a terminal nobody asked for ends its stream: each was a socket pair, goroutines
// and a table entry that (the instance closing the socket it did not ask for, the bridge never
// ending the channel) stayed for the sandbox's life, without bound.
func TestRelayUnaskedTerminalEndsTheStream(t *testing.T) {
	b := newHostileBridge(t)
	b.terminal(sbxinit.TerminalChannel|1, 9)
	b.ended(t)
	if n := b.r.mux.Open(); n != 0 {
		t.Fatalf("after the stream ended: %d channels open", n)
	}
}

// The terminal a command asked for is taken, once; one whose command ended without it (an error)
// is no longer asked for.
func TestRelayTerminalOnlyAsAskedFor(t *testing.T) {
	b := newHostileBridge(t)
	b.exec(t, `{"op":"exec","id":5,"argv":["sh"],"tty":true}`)
	b.exec(t, `{"op":"exec","id":6,"argv":["nope"],"tty":true}`)
	if !wait.Until(20*time.Second, func() bool { return b.r.open() == 2 }) {
		t.Fatalf("two terminals asked for: open %d, want 2", b.r.open())
	}
	b.terminal(sbxinit.TerminalChannel|1, 5)
	b.toHost.Write(sbxinit.FrameReply, 0, []byte(`{"op":"error","id":6,"err":"not found","kind":"program"}`))
	if withFD, without := b.sync(t); withFD != 1 || without != 1 {
		t.Fatalf("the instance got %d replies with a terminal and %d without, want 1 and 1", withFD, without)
	}
	if n := b.r.open(); n != 1 {
		t.Fatalf("one terminal open, none asked for: open %d, want 1", n)
	}
	b.terminal(sbxinit.TerminalChannel|2, 6) // its command ended with an error
	b.ended(t)
}

// A delegate asking for commands past the bound, in a loop, gets each refused but logged a few times
// only: each refusal was a log line, as fast as the delegate could ask.
func TestRelayRefusalLogsAreBounded(t *testing.T) {
	was := relayMaxChannels
	relayMaxChannels = 1
	defer func() { relayMaxChannels = was }()
	b := newHostileBridge(t)
	const asks = 500
	buf := make([]byte, 4096)
	for i := range asks {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		b.exec(t, fmt.Sprintf(`{"op":"exec","id":%d,"argv":["true"],"stdio":[0,1,1]}`, i+1), p[0], p[1])
		unix.Close(p[0])
		unix.Close(p[1])
		n, err := unix.Read(b.instance, buf)
		if err != nil || !strings.Contains(string(buf[:n]), sbxinit.ErrKindBusy) {
			t.Fatalf("command %d past the bound: %q %v", i, buf[:max(n, 0)], err)
		}
	}
	if n := b.logs.count("refused"); n == 0 || n > logBurst {
		t.Fatalf("%d refusals logged %d times: want at least once, at most %d", asks, n, logBurst)
	}
}

// A bridge that breaks the protocol is not trusted to end when the relay stops reading it: the
// relay ends the runtime's process, as Stop does. Before, the stream ended and the instance failed
// its calls, but a bridge that ignored the end of its input kept its sandbox running, taking its
// memory and CPU, until a stop. The runtime here is a process that ignores its stdin, as such a
// bridge would.
func TestRelayProtocolBreakEndsTheRuntime(t *testing.T) {
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sp[0])
	initEnd := os.NewFile(uintptr(sp[1]), "init-end")
	defer initEnd.Close()
	cmd := exec.Command("sleep", "600")
	_, after, err := startRelayOn(initEnd, cmd, slog.New(&countingHandler{}))
	if err != nil {
		t.Fatal(err)
	}
	// The test writes as the bridge too: its own copy of the stream's writing end.
	fd, err := unix.Dup(int(cmd.Stdout.(*os.File).Fd()))
	if err != nil {
		t.Fatal(err)
	}
	stream := os.NewFile(uintptr(fd), "stream")
	defer stream.Close()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	after()
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		close(exited)
	}()
	defer cmd.Process.Kill()
	sbxinit.NewFrameWriter(stream).Write(sbxinit.FrameCredit, 1, []byte{0, 0, 1}) // a credit is 4 bytes
	select {
	case <-exited:
	case <-time.After(20 * time.Second):
		t.Fatal("the runtime of a bridge that broke the protocol still runs")
	}
}

// The relay numbers the channels it opens from 1 up and the bridge numbers the terminals' with
// TerminalChannel set: the relay's numbers must never reach that bit, nor a number still open,
// however many commands a long-lived sandbox runs (past 2^31 channels they did).
func TestRelayChannelNumbersStayTheRelays(t *testing.T) {
	b := newHostileBridge(t)
	b.r.mu.Lock()
	b.r.next = sbxinit.TerminalChannel - 2
	b.r.mu.Unlock()
	var chans []uint32
	for i := range 3 {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		defer unix.Close(p[0])
		b.exec(t, fmt.Sprintf(`{"op":"exec","id":%d,"argv":["true"],"stdio":[-1,0,0]}`, i+1), p[1])
		unix.Close(p[1])
		select {
		case req := <-b.requests:
			if len(req) < 6 || req[0] != 1 {
				t.Fatalf("request %d: head %v", i, req[:min(len(req), 6)])
			}
			chans = append(chans, binary.BigEndian.Uint32(req[1:]))
		case <-time.After(20 * time.Second):
			t.Fatalf("request %d did not reach the bridge", i)
		}
	}
	seen := map[uint32]bool{}
	for _, ch := range chans {
		if ch == 0 || ch&sbxinit.TerminalChannel != 0 || seen[ch] {
			t.Fatalf("channels %v: each must be nonzero, below TerminalChannel and distinct", chans)
		}
		seen[ch] = true
	}
}
