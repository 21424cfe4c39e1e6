package server_test

import (
	"context"
	"errors"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

func startShell(t *testing.T, r *backend.Remote, ctx context.Context, a protocol.ShellArgs) (*backend.Shell, *wait.Buffer) {
	t.Helper()
	out := &wait.Buffer{}
	sh, err := r.Shell(ctx, backend.ShellRequest{ShellArgs: a, Output: out})
	if err != nil {
		t.Fatal(err)
	}
	return sh, out
}

func shellEnd(t *testing.T, sh *backend.Shell) (protocol.ExecResult, error) {
	t.Helper()
	select {
	case <-sh.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the shell did not end")
	}
	return sh.Wait()
}

// The shell op on real bubblewrap, and on real runsc at the gvisor level: the login shell on a
// terminal of the sandbox's own devpts, sized as asked and resized (stty size sees it), ^C typed
// interrupts the foreground job, ^Z stops it and the shell takes it back, the exit code comes back,
// and shell_started / shell_ended name the token.
func TestShellOnRealTerminal(t *testing.T) {
	t.Parallel()
	for _, level := range []string{provider.IsolationNamespace, provider.IsolationGvisor} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			shellOnRealTerminal(t, level, servertest.New(t, servertest.Options{Provider: "namespace",
				Templates: map[string]provider.Template{"default": levelTemplate(level)}}))
		})
	}
}

func shellOnRealTerminal(t *testing.T, level string, b *servertest.Broker) {
	r, m := dialToken(t, b, "term", protocol.MintRequest{Scopes: []string{"exec"}})
	if res, err := r.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "uname -r"}}); err != nil ||
		res.Stdout == nil || strings.Contains(*res.Stdout, "gvisor") != (level == provider.IsolationGvisor) {
		t.Fatalf("uname -r at the %s level: %+v %v", level, res, err)
	}
	sh, out := startShell(t, r, t.Context(), protocol.ShellArgs{Rows: 30, Cols: 100})
	sh.Write([]byte("echo \"$0 on $(tty) sized $(stty size)\"\n"))
	out.WaitFor(t, 20*time.Second, "/bin/bash on /dev/pts/0 sized 30 100")

	if err := sh.Resize(45, 132); err != nil {
		t.Fatal(err)
	}
	// The window and the keys take different paths, so a key may overtake the resize: ask again
	// until stty sees it.
	sh.Write([]byte("stty size\n"))
	next := time.Now().Add(300 * time.Millisecond)
	wait.Eventually(t, 20*time.Second, func() bool {
		if time.Now().After(next) {
			sh.Write([]byte("stty size\n"))
			next = time.Now().Add(300 * time.Millisecond)
		}
		return strings.Contains(out.String(), "45 132\r\n")
	}, "stty size to see the resize; the terminal shows %q", out)

	sh.Write([]byte("sleep 1000\n"))
	wait.Eventually(t, 10*time.Second, func() bool {
		res, err := r.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "pgrep -x sleep"}})
		return err == nil && res.ExitCode == 0
	}, "sleep running under the shell")
	sh.Write([]byte{0x03}) // ^C
	sh.Write([]byte("echo slept=$?\n"))
	out.WaitFor(t, 20*time.Second, "slept=130")

	if _, err := sh.Write([]byte("sleep 1001\n")); err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, 10*time.Second, func() bool {
		res, err := r.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "pgrep -f '[s]leep 1001'"}})
		return err == nil && res.ExitCode == 0
	}, "sleep 1001 running under the shell")
	sh.Write([]byte{0x1a}) // ^Z
	out.WaitFor(t, 20*time.Second, "Stopped")
	sh.Write([]byte("fg\n"))
	wait.Eventually(t, 10*time.Second, func() bool {
		res, err := r.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "ps -o stat= -C sleep"}})
		return err == nil && res.Stdout != nil && strings.HasPrefix(*res.Stdout, "S")
	}, "sleep 1001 running again in the foreground")
	sh.Write([]byte{0x03})
	sh.Write([]byte("exit 42\n"))
	res, err := shellEnd(t, sh)
	if err != nil || res.ExitCode != 42 {
		t.Fatalf("exit 42: %+v %v; the terminal showed %q", res, err, out.String())
	}

	// Its events, attributed to the token.
	var started, ended *protocol.Event
	wait.Eventually(t, 10*time.Second, func() bool {
		started, ended = nil, nil
		b.Client.Events(t.Context(), client.EventOptions{Ref: "term", Backlog: 200}, func(e protocol.Event) error {
			switch e.Type {
			case protocol.EventShellStarted:
				started = &e
			case protocol.EventShellEnded:
				ended = &e
			}
			return nil
		})
		return started != nil && ended != nil
	}, "shell_started and shell_ended")
	if started.JTI != m.JTI || ended.JTI != m.JTI || ended.ExitCode == nil || *ended.ExitCode != 42 || started.Command != "/bin/bash" {
		t.Fatalf("events: started %+v ended %+v (jti %s)", *started, *ended, m.JTI)
	}

	// A command of the caller's, and a program that is not there.
	sh, out = startShell(t, r, t.Context(), protocol.ShellArgs{Argv: []string{"sh", "-c", "echo $TERM; exit 3"}, Term: "vt100"})
	if res, err := shellEnd(t, sh); err != nil || res.ExitCode != 3 || !strings.Contains(out.String(), "vt100") {
		t.Fatalf("sh -c: %+v %v %q", res, err, out.String())
	}
	sh, _ = startShell(t, r, t.Context(), protocol.ShellArgs{Argv: []string{"nosuch-shell"}})
	if _, err := shellEnd(t, sh); backend.KindOf(err) != backend.KindInvalid || !strings.Contains(err.Error(), "nosuch-shell: command not found") {
		t.Fatalf("a missing program: %v", err)
	}
}

// A shell's session ends, its processes with it, when the token is revoked, when its context is
// cancelled, and when the sandbox stops; at both levels.
func TestShellEndsWithItsCredential(t *testing.T) {
	t.Parallel()
	for _, level := range []string{provider.IsolationNamespace, provider.IsolationGvisor} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			shellEndsWithItsCredential(t, servertest.New(t, servertest.Options{Provider: "namespace",
				Templates: map[string]provider.Template{"default": levelTemplate(level)}}))
		})
	}
}

// levelTemplate is the default template at an isolation level.
func levelTemplate(level string) provider.Template {
	tmpl := provider.DefaultTemplate()
	tmpl.Isolation = level
	return tmpl
}

func shellEndsWithItsCredential(t *testing.T, b *servertest.Broker) {
	r, m := dialToken(t, b, "ends", protocol.MintRequest{Scopes: []string{"exec"}})
	owner, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close()
	alive := func(pattern string) bool {
		res, err := owner.Exec(context.Background(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "pgrep -f '" + pattern + "' >/dev/null"}})
		return err == nil && res.ExitCode == 0
	}

	// Revoked: the connection closes (4001) and the shell with its jobs is gone.
	sh, out := startShell(t, r, t.Context(), protocol.ShellArgs{})
	sh.Write([]byte("sleep 2001 & sleep 2002 & echo started\n"))
	out.WaitFor(t, 20*time.Second, "started")
	wait.Eventually(t, 10*time.Second, func() bool { return alive("[s]leep 2001") && alive("[s]leep 2002") }, "the jobs running")
	if _, err := b.Client.Revoke(t.Context(), "ends", m.JTI); err != nil {
		t.Fatal(err)
	}
	_, err = shellEnd(t, sh)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeTokenRevoked {
		t.Fatalf("the shell of a revoked token ended with %v", err)
	}
	wait.Eventually(t, 10*time.Second, func() bool { return !alive("[s]leep 200[12]") }, "the revoked shell's jobs gone")

	// Cancelled: the answer is cancelled and the session is killed.
	ctx, cancel := context.WithCancel(t.Context())
	sh, out = startShell(t, owner, ctx, protocol.ShellArgs{})
	sh.Write([]byte("sleep 2003 & echo started\n"))
	out.WaitFor(t, 20*time.Second, "started")
	wait.Eventually(t, 10*time.Second, func() bool { return alive("[s]leep 2003") }, "the job running")
	cancel()
	if _, err := shellEnd(t, sh); !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled shell: %v", err)
	}
	wait.Eventually(t, 10*time.Second, func() bool { return !alive("[s]leep 2003") }, "the cancelled shell's job gone")

	// The sandbox stops under it.
	sh, out = startShell(t, owner, t.Context(), protocol.ShellArgs{})
	sh.Write([]byte("echo started\n"))
	out.WaitFor(t, 20*time.Second, "started")
	if _, err := b.Client.StopSandbox(t.Context(), "ends"); err != nil {
		t.Fatal(err)
	}
	if _, err := shellEnd(t, sh); !errors.As(err, &pe) || pe.Code != protocol.CodeNotRunning {
		t.Fatalf("the shell of a stopped sandbox: %v", err)
	}
}

// Under a command allowlist a shell runs only if the allowlist names it; a token without exec gets
// none.
func TestShellAllowlistAndScope(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	refused := func(r *backend.Remote, a protocol.ShellArgs, code string) {
		t.Helper()
		sh, err := r.Shell(t.Context(), backend.ShellRequest{ShellArgs: a})
		if err == nil {
			_, err = shellEnd(t, sh)
		}
		var pe *protocol.Error
		if !errors.As(err, &pe) || pe.Code != code {
			t.Fatalf("shell %v: %v, want %s", a.Argv, err, code)
		}
	}
	r, _ := dialToken(t, b, "allow", protocol.MintRequest{Scopes: []string{"exec"}, AllowCmd: []string{"pytest"}})
	refused(r, protocol.ShellArgs{}, protocol.CodeCommandNotAllowed)
	refused(r, protocol.ShellArgs{Argv: []string{"bash"}}, protocol.CodeCommandNotAllowed)
	r, _ = dialToken(t, b, "allow", protocol.MintRequest{Scopes: []string{"exec"}, AllowCmd: []string{"pytest", "bash"}})
	refused(r, protocol.ShellArgs{Env: map[string]string{"A": "1"}}, protocol.CodeCommandNotAllowed)
	sh, out := startShell(t, r, t.Context(), protocol.ShellArgs{Term: "xterm"})
	sh.Write([]byte("echo \"[$TERM]\"; exit 5\n"))
	if res, err := shellEnd(t, sh); err != nil || res.ExitCode != 5 || !strings.Contains(out.String(), "[xterm]") {
		t.Fatalf("the allowlisted shell: %+v %v %q", res, err, out.String())
	}
	r, _ = dialToken(t, b, "allow", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write"}})
	refused(r, protocol.ShellArgs{}, protocol.CodeScopeDenied)
}

// Hostile frames for a shell: absurd or malformed resizes, a resize of something that is not a
// shell and unknown binary kinds are each answered invalid_argument on id 0 and change nothing (the
// shell goes on, its window as it was); an end frame closes its input; an oversized frame closes
// the connection (1009) and the shell's session with it.
func TestShellHostileFrames(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "hostile"}); err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, dataplaneURL(b, "hostile"), b.Client.APIKey())
	c.sendJSON(protocol.Request{ID: 5, Op: "shell", Args: map[string]any{
		"argv": []string{"sh", "-c", "while read l; do echo got:$l; stty size; done; exit 9"}, "rows": 10, "cols": 20}})
	for _, args := range []string{`{"rows":0,"cols":80}`, `{"rows":-1,"cols":10}`, `{"rows":70000,"cols":80}`,
		`{"rows":24,"cols":1e9}`, `{"rows":24,"cols":80,"evil":1}`, `"big"`, `{"rows":"24","cols":80}`} {
		c.sendText(`{"id":5,"op":"resize","args":` + args + `}`)
		if a := c.await(0); a.code() != protocol.CodeInvalidArgument || !strings.Contains(a.Error.Message, "resize of request 5") {
			t.Fatalf("resize %s: %s", args, a)
		}
	}
	c.sendJSON(protocol.Request{ID: 99, Op: "resize", Args: protocol.ResizeArgs{Rows: 10, Cols: 10}})
	if a := c.await(0); a.code() != protocol.CodeInvalidArgument || !strings.Contains(a.Error.Message, "not a shell in progress") {
		t.Fatalf("resize of no shell: %s", a)
	}
	c.sendBinary(dataFrame(9, 5, []byte("x")))
	if a := c.await(0); a.code() != protocol.CodeInvalidArgument {
		t.Fatalf("a binary frame of kind 9 for the shell: %s", a)
	}
	c.sendJSON(protocol.Request{ID: 6, Op: "shell", Args: map[string]any{"rows": 5}})
	if a := c.await(6); a.code() != protocol.CodeInvalidArgument {
		t.Fatalf("a shell of 5 rows by 0 columns: %s", a)
	}
	c.sendJSON(protocol.Request{ID: 7, Op: "shell", Args: map[string]any{"term": "xterm\x1b]0;x"}})
	if a := c.await(7); a.code() != protocol.CodeInvalidArgument {
		t.Fatalf("a shell with an escape in its term: %s", a)
	}

	c.sendBinary(dataFrame(protocol.FrameData, 5, []byte("hello\n")))
	shown := func() string {
		var s strings.Builder
		for _, f := range c.bins[5] {
			s.Write(f[1:])
		}
		return s.String()
	}
	for !strings.Contains(shown(), "got:hello\r\n10 20\r\n") {
		if err := c.readOne(20 * time.Second); err != nil {
			t.Fatalf("the shell after the hostile frames: %v; it showed %q", err, shown())
		}
	}
	c.sendBinary(dataFrame(protocol.FrameEnd, 5, nil))
	a := c.await(5)
	var res protocol.ExecResult
	if a.Error != nil || a.decode(&res) != nil || res.ExitCode != 9 {
		t.Fatalf("the shell after its input closed: %s", a)
	}

	c.sendJSON(protocol.Request{ID: 8, Op: "shell", Args: map[string]any{"argv": []string{"sleep", "2004"}}})
	c.ping()
	closed := closeWatch(c)
	// The server may close before the whole frame is written; a write error is fine.
	go c.ws.WriteMessage(websocket.BinaryMessage, dataFrame(protocol.FrameData, 8, make([]byte, c.hello.Limits.MaxFrameBytes+1)))
	if got := <-closed; got.code != websocket.CloseMessageTooBig {
		t.Fatalf("an oversized keystroke frame: close %d %q", got.code, got.reason)
	}
	owner, err := backend.Dial(t.Context(), backend.Config{URL: dataplaneURL(b, "hostile"), Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close()
	wait.Eventually(t, 10*time.Second, func() bool {
		res, err := owner.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "pgrep -f '[s]leep 2004'"}})
		return err == nil && res.ExitCode == 1
	}, "the shell of the closed connection gone")
}

// A shell's session gives back everything it held, however it ended (the program exited, the
// request was cancelled, the connection closed): the terminal's master in the broker, the
// goroutines that served it, and its processes. Not parallel: it counts the process's terminals.
func TestShellReleasesWhatItHolds(t *testing.T) {
	for _, level := range []string{provider.IsolationNamespace, provider.IsolationGvisor} {
		t.Run(level, func(t *testing.T) {
			shellReleasesWhatItHolds(t, servertest.New(t, servertest.Options{Provider: "namespace",
				Templates: map[string]provider.Template{"default": levelTemplate(level)}}))
		})
	}
}

func shellReleasesWhatItHolds(t *testing.T, b *servertest.Broker) {
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "release"}); err != nil {
		t.Fatal(err)
	}
	url := dataplaneURL(b, "release")
	owner, err := backend.Dial(t.Context(), backend.Config{URL: url, Credential: b.Client.APIKey()})
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close()
	// masters counts the broker's open terminal masters (the sandbox's /dev/pts/ptmx) and, at the
	// gvisor level, where the master stays inside, the relay's ends of the sockets in their place
	// (one goroutine reads each).
	masters := func() int {
		n := 0
		d, _ := os.ReadDir("/proc/self/fd")
		for _, e := range d {
			if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); strings.HasSuffix(l, "ptmx") {
				n++
			}
		}
		buf := make([]byte, 4<<20)
		return n + strings.Count(string(buf[:runtime.Stack(buf, true)]), "provider.(*relay).terminalInput(")
	}
	// serving counts the goroutines that serve a shell.
	serving := func() int {
		buf := make([]byte, 4<<20)
		buf = buf[:runtime.Stack(buf, true)]
		n := 0
		for _, g := range strings.Split(string(buf), "\n\n") {
			for _, f := range []string{"provider.(*instance).runTTY", "provider.resizeLoop", "provider.typeEOF", "server.opShell", "server.(*shellSession)"} {
				if strings.Contains(g, f) {
					n++
					break
				}
			}
		}
		return n
	}
	alive := func() bool {
		res, err := owner.Exec(context.Background(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "pgrep -f '[s]leep 3000' >/dev/null"}})
		return err == nil && res.ExitCode == 0
	}
	for _, end := range []string{"exit", "cancel", "close", "exit", "cancel", "close"} {
		r, err := backend.Dial(t.Context(), backend.Config{URL: url, Credential: b.Client.APIKey()})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		sh, out := startShell(t, r, ctx, protocol.ShellArgs{})
		sh.Write([]byte("sleep 3000 & echo started\n"))
		out.WaitFor(t, 20*time.Second, "started")
		if masters() != 1 || serving() == 0 {
			t.Fatalf("a shell in progress: %d terminal masters and %d goroutines serving it, want 1 and some", masters(), serving())
		}
		switch end {
		case "exit":
			sh.Write([]byte("exit\n"))
		case "cancel":
			cancel()
		case "close":
			r.Close()
		}
		shellEnd(t, sh)
		wait.Eventually(t, 20*time.Second, func() bool { return masters() == 0 && serving() == 0 && !alive() },
			"after a shell ended by %s: %d terminal masters, %d goroutines serving it, its job alive %v", end, masters(), serving(), alive())
		cancel()
		r.Close()
	}
}

// A graceful shutdown lets an exec in flight finish, but a shell has no end of its own: it is ended
// at once with unavailable (and its session killed), instead of holding the shutdown for its
// whole timeout.
func TestShellEndsAtShutdown(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "down"}); err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, dataplaneURL(b, "down"), b.Client.APIKey())
	c.sendJSON(protocol.Request{ID: 1, Op: "shell", Args: map[string]any{"argv": []string{"sh", "-c", "echo up; sleep 1000"}}})
	for {
		var shown strings.Builder
		for _, f := range c.bins[1] {
			shown.Write(f[1:])
		}
		if strings.Contains(shown.String(), "up") {
			break
		}
		if err := c.readOne(20 * time.Second); err != nil {
			t.Fatalf("the shell never started: %v", err)
		}
	}
	start := time.Now()
	stopped := make(chan time.Duration, 1)
	go func() { b.StopWithin(30 * time.Second); stopped <- time.Since(start) }()
	if a := c.await(1); a.code() != protocol.CodeUnavailable || !strings.Contains(a.Error.Message, "shutting down") {
		t.Fatalf("a shell during a shutdown: %s", a)
	}
	if took := <-stopped; took > 10*time.Second {
		t.Errorf("the shutdown took %s with only a shell in flight", took)
	}
}

// TestShellInputBounded: keystrokes sent to shells whose programs do not read them wait in the
// broker only up to a bound per connection; past it the connection's reader waits (as for a client
// that does not read its answers). Each shell queued 64 frames of up to max_frame_bytes before, so
// one connection with 64 shells could make the broker hold 4 GiB. Not parallel: it measures the
// heap.
func TestShellInputBounded(t *testing.T) {
	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "flood"}); err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, dataplaneURL(b, "flood"), b.Client.APIKey())
	const shells = 4
	for id := uint32(1); id <= shells; id++ {
		c.sendJSON(protocol.Request{ID: id, Op: "shell", Args: map[string]any{"argv": []string{"sleep", "2006"}}})
	}
	c.ping()
	liveHeap := func() int64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return int64(m.HeapAlloc)
	}
	frames := make([][]byte, shells)
	for i := range frames {
		frames[i] = dataFrame(protocol.FrameData, uint32(i+1), make([]byte, 1<<20))
	}
	base := liveHeap()
	var sent atomic.Int64
	go func() {
		for i := 0; i < 100; i++ {
			if c.ws.WriteMessage(websocket.BinaryMessage, frames[i%shells]) != nil {
				return
			}
			sent.Add(1)
		}
	}()
	const bound = 16 << 20
	var held int64
	if wait.Until(5*time.Second, func() bool { held = liveHeap() - base; return held > bound }) {
		t.Fatalf("the broker holds %d MiB, over %d MiB, of keystrokes nobody reads (%d frames of 1 MiB sent)", held>>20, bound>>20, sent.Load())
	}
	if sent.Load() == 0 {
		t.Fatal("no keystroke frame was taken")
	}
	if u := server.Usage(b.Server); u.ShellInputBytes <= 0 || u.ShellInputBytes > 2*int64(len(frames[0])) {
		t.Errorf("%d bytes of keystrokes counted as waiting, not one frame or two", u.ShellInputBytes)
	}
	// Everything counted is given back when the shells end with their connection.
	c.ws.Close()
	wait.Eventually(t, 20*time.Second, func() bool { return server.Usage(b.Server).ShellInputBytes == 0 },
		"the closed connection's keystrokes given back (%d bytes still counted)", server.Usage(b.Server).ShellInputBytes)
}
