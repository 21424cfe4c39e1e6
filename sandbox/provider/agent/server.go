package agent

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/workspace"
	"golang.org/x/sys/unix"
)

// Config is what a Server serves.
type Config struct {
	// Secret authenticates the broker (at least 16 bytes).
	Secret []byte
	// Workspace is the directory that is the sandbox's /workspace.
	Workspace string
	// Env is the environment commands start from (the snapshot the broker reads with OpEnv).
	Env []string
	// Cert and Key are the sandbox's TLS certificate and key, PEM (tls.go): the agent speaks
	// only TLS 1.3 with them, never in clear.
	Cert, Key []byte
}

// MaxPendingHandshakes bounds the connections that have not yet proved the secret. Past it the
// oldest is dropped: the broker answers within a round trip, so only a connection that sits silent
// (a flood from another pod, where the cluster's CNI does not enforce the NetworkPolicy) is ever
// the oldest, and the agent's memory and fds stay bounded whatever reaches its port.
const MaxPendingHandshakes = 256

// handshakeTimeout bounds one handshake; the broker needs a round trip.
const handshakeTimeout = 5 * time.Second

// Server serves one sandbox's commands and files.
type Server struct {
	cfg    Config
	ws     *workspace.Workspace
	tls    *tls.Config
	limits *handshakeLimits

	mu      sync.Mutex
	pending []net.Conn // oldest first; each removed when its handshake ends
}

// NewServer opens the workspace.
func NewServer(cfg Config) (*Server, error) {
	if len(cfg.Secret) < 16 {
		return nil, errors.New("agent: the secret must be at least 16 bytes")
	}
	if len(cfg.Cert) == 0 || len(cfg.Key) == 0 {
		return nil, errors.New("agent: no TLS certificate and key: the agent does not serve in clear (the broker adds them to the sandbox's Secret at its next start)")
	}
	tc, err := ServerTLS(cfg.Cert, cfg.Key)
	if err != nil {
		return nil, err
	}
	ws, err := workspace.Open(cfg.Workspace, workspace.Options{})
	if err != nil {
		return nil, err
	}
	return &Server{cfg: cfg, ws: ws, tls: tc, limits: newHandshakeLimits()}, nil
}

// Serve accepts connections until ln closes.
func (s *Server) Serve(ln net.Listener) error {
	for {
		conn, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		s.admit(conn)
		go s.handle(conn)
	}
}

// admit records conn as pending its handshake, dropping the oldest pending one past the bound.
func (s *Server) admit(conn net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.pending) >= MaxPendingHandshakes {
		// Closing it ends its handle's read, which then calls settled.
		s.pending[0].Close()
		s.pending = s.pending[1:]
	}
	s.pending = append(s.pending, conn)
}

// settled removes conn from the pending handshakes (proved, failed or dropped).
func (s *Server) settled(conn net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, c := range s.pending {
		if c == conn {
			s.pending = append(s.pending[:i], s.pending[i+1:]...)
			return
		}
	}
}

// Main is cmd/sbx-agent: it reads the secret from $SBX_AGENT_SECRET_FILE (default
// /run/sbx/secret) and the TLS certificate and key from tls.crt and tls.key beside it
// ($SBX_AGENT_TLS_CERT, $SBX_AGENT_TLS_KEY), serves /workspace on $SBX_AGENT_ADDR (default :7450)
// and never returns.
func Main() {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "sbx-agent:", err)
		os.Exit(1)
	}
	secretFile := envOr("SBX_AGENT_SECRET_FILE", "/run/sbx/secret")
	secret, err := os.ReadFile(secretFile)
	if err != nil {
		fail(err)
	}
	// Missing files are refused by NewServer, saying why: never serve in clear.
	cert, _ := os.ReadFile(envOr("SBX_AGENT_TLS_CERT", filepath.Join(filepath.Dir(secretFile), CertFile)))
	key, _ := os.ReadFile(envOr("SBX_AGENT_TLS_KEY", filepath.Join(filepath.Dir(secretFile), KeyFile)))
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SBX_AGENT_") {
			env = append(env, kv)
		}
	}
	if envValue(env, "HOME") == "" {
		env = append(env, "HOME=/root")
	}
	s, err := NewServer(Config{Secret: []byte(strings.TrimSpace(string(secret))), Workspace: envOr("SBX_AGENT_WORKSPACE", "/workspace"), Env: env, Cert: cert, Key: key})
	if err != nil {
		fail(err)
	}
	ln, err := net.Listen("tcp", envOr("SBX_AGENT_ADDR", fmt.Sprintf(":%d", Port)))
	if err != nil {
		fail(err)
	}
	fail(s.Serve(ln))
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

type conn struct {
	net.Conn
	r   *bufio.Reader
	buf []byte
	wmu sync.Mutex
}

func (c *conn) read() (byte, []byte, error) {
	typ, p, err := ReadFrame(c.r, c.buf)
	if cap(p) > cap(c.buf) {
		c.buf = p[:0]
	}
	return typ, p, err
}

func (c *conn) write(typ byte, p []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return WriteFrame(c.Conn, typ, p)
}

func (c *conn) result(v any, err error) error {
	var r Result
	if err != nil {
		r.Error = toError(err)
	} else if v != nil {
		b, merr := json.Marshal(v)
		if merr != nil {
			r.Error = toError(merr)
		}
		r.Result = b
	}
	b, _ := json.Marshal(r)
	return c.write(FrameResult, b)
}

func (s *Server) handle(raw net.Conn) {
	defer raw.Close()
	nc, ok := s.handshake(raw)
	if !ok {
		return
	}
	c := &conn{Conn: nc, r: bufio.NewReaderSize(nc, 64<<10)}
	for {
		typ, p, err := c.read()
		if err != nil {
			return
		}
		if typ != FrameRequest {
			return
		}
		var req Request
		if err := json.Unmarshal(p, &req); err != nil {
			return
		}
		if !s.serve(c, req) {
			return
		}
	}
}

// handshake runs TLS (tls.go), then the challenges both ways (wire.go), all within
// handshakeTimeout; it answers the TLS connection once the peer proved the secret. A source past
// its handshake rate (limits.go) is closed before TLS costs anything.
func (s *Server) handshake(raw net.Conn) (net.Conn, bool) {
	defer s.settled(raw)
	src := sourceOf(raw)
	if !s.limits.allow(src) {
		return nil, false
	}
	if tc, ok := raw.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	raw.SetDeadline(time.Now().Add(handshakeTimeout))
	nc := tls.Server(raw, s.tls)
	if err := nc.Handshake(); err != nil {
		return nil, false // a peer without TLS 1.3 gets nothing but TLS's alert
	}
	challenge := make([]byte, ChallengeSize)
	rand.Read(challenge)
	if _, err := nc.Write(challenge); err != nil {
		return nil, false
	}
	// The broker's answer, then its own challenge, which this agent answers once the broker's
	// answer holds (wire.go, Proof).
	hs := make([]byte, 2*ChallengeSize)
	if _, err := io.ReadFull(nc, hs); err != nil {
		return nil, false
	}
	if !hmac.Equal(hs[:ChallengeSize], Answer(s.cfg.Secret, challenge)) {
		return nil, false
	}
	s.limits.proved(src)
	if _, err := nc.Write(Proof(s.cfg.Secret, hs[ChallengeSize:])); err != nil {
		return nil, false
	}
	return nc, raw.SetDeadline(time.Time{}) == nil
}

// serve runs one request; false ends the connection (streamed operations but an upload that ended
// in step, errors on the wire).
func (s *Server) serve(c *conn, req Request) bool {
	ctx := context.Background()
	unary := func(args any, fn func() (any, error)) bool {
		if args != nil && len(req.Args) > 0 {
			if err := json.Unmarshal(req.Args, args); err != nil {
				return c.result(nil, &Error{Kind: KindArgs, Message: "bad arguments: " + err.Error()}) == nil
			}
		}
		v, err := fn()
		return c.result(v, err) == nil
	}
	switch req.Op {
	case OpEnv:
		return unary(nil, func() (any, error) { return s.cfg.Env, nil })
	case OpStat:
		var a PathArgs
		return unary(&a, func() (any, error) { return s.ws.Stat(a.Path) })
	case OpList:
		var a PathArgs
		return unary(&a, func() (any, error) { return s.ws.ListContext(ctx, a.Path) })
	case OpRead:
		var a protocol.ReadArgs
		return unary(&a, func() (any, error) { return s.ws.ReadContext(ctx, a) })
	case OpGlob:
		var a protocol.GlobArgs
		return unary(&a, func() (any, error) { return s.ws.GlobContext(ctx, a) })
	case OpGrep:
		var a protocol.GrepArgs
		return unary(&a, func() (any, error) { return s.ws.Grep(ctx, a) })
	case OpWrite:
		var a protocol.WriteArgs
		return unary(&a, func() (any, error) { return s.ws.Write(a) })
	case OpEdit:
		var a protocol.EditArgs
		return unary(&a, func() (any, error) { return s.ws.Edit(a) })
	case OpDelete:
		var a protocol.DeleteArgs
		return unary(&a, func() (any, error) { return nil, s.ws.Delete(a) })
	case OpMkdir:
		var a protocol.MkdirArgs
		return unary(&a, func() (any, error) { return nil, s.ws.Mkdir(a) })
	case OpMove:
		var a protocol.MoveArgs
		return unary(&a, func() (any, error) { return nil, s.ws.Move(a) })
	case OpExec:
		var a ExecArgs
		if err := json.Unmarshal(req.Args, &a); err != nil {
			c.result(nil, &Error{Kind: KindArgs, Message: "bad arguments: " + err.Error()})
			return false
		}
		s.exec(c, a)
		return false
	case OpTTY:
		var a ExecArgs
		if err := json.Unmarshal(req.Args, &a); err != nil {
			c.result(nil, &Error{Kind: KindArgs, Message: "bad arguments: " + err.Error()})
			return false
		}
		s.execTTY(c, a)
		return false
	case OpCreate:
		var a CreateArgs
		return json.Unmarshal(req.Args, &a) == nil && s.create(c, a)
	case OpOpen:
		var a PathArgs
		if json.Unmarshal(req.Args, &a) == nil {
			s.open(c, a)
		}
		return false
	case OpExtract:
		var a PathArgs
		if json.Unmarshal(req.Args, &a) == nil {
			s.extract(c, a)
		}
		return false
	case OpArchive:
		var a PathArgs
		if json.Unmarshal(req.Args, &a) == nil {
			res, err := s.ws.Archive(ctx, a.Path, &frameWriter{c: c, typ: FrameData})
			c.result(res, err)
		}
		return false
	}
	return c.result(nil, protocol.Errorf(protocol.CodeInvalidArgument, "the sandbox's agent does not know the operation %q (is its image older than the broker?)", req.Op)) == nil
}

// frameWriter sends what is written as frames of one type.
type frameWriter struct {
	c   *conn
	typ byte
}

func (w *frameWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), 256<<10)]
		if err := w.c.write(w.typ, chunk); err != nil {
			return n, err
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

// create runs a streamed write; true when it ended in step with the broker (its end or abort
// frame taken, the result sent), so that the connection carries the broker's next request
// (Started.Reuse): the dataplane's every write is one, and a connection per write would cost a
// TLS handshake per write.
func (s *Server) create(c *conn, a CreateArgs) bool {
	up, err := s.ws.Create(a.Path, a.Mode)
	if err != nil {
		c.result(nil, err)
		return false
	}
	if err := WriteJSON(c, FrameStarted, Started{Reuse: true}); err != nil {
		up.Abort()
		return false
	}
	var werr error
	for {
		typ, p, err := c.read()
		if err != nil {
			up.Abort()
			return false
		}
		switch typ {
		case FrameData:
			if werr == nil {
				_, werr = up.Write(p)
			}
		case FrameEnd:
			if werr != nil {
				up.Abort()
				return c.result(nil, werr) == nil
			}
			res, err := up.Commit()
			return c.result(res, err) == nil
		case FrameAbort:
			up.Abort()
			return c.result(nil, nil) == nil
		default: // out of step: the connection ends
			up.Abort()
			c.result(nil, nil)
			return false
		}
	}
}

func (c *conn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.Conn.Write(p)
}

func (s *Server) open(c *conn, a PathArgs) {
	rc, info, err := s.ws.OpenRead(a.Path)
	if err != nil {
		c.result(nil, err)
		return
	}
	defer rc.Close()
	if err := WriteJSON(c, FrameStarted, Started{Info: &info}); err != nil {
		return
	}
	buf := make([]byte, 256<<10)
	for {
		n, err := rc.Read(buf)
		if n > 0 {
			if werr := c.write(FrameData, buf[:n]); werr != nil {
				return
			}
		}
		if err == io.EOF {
			c.result(nil, nil)
			return
		}
		if err != nil {
			c.result(nil, err)
			return
		}
	}
}

func (s *Server) extract(c *conn, a PathArgs) {
	pr, pw := io.Pipe()
	type out struct {
		res protocol.TreeResult
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := s.ws.Extract(context.Background(), a.Path, pr)
		pr.CloseWithError(errors.New("extract ended"))
		done <- out{res, err}
	}()
	for {
		typ, p, err := c.read()
		if err != nil {
			pw.CloseWithError(err)
			<-done
			return
		}
		if typ == FrameData {
			pw.Write(p) // an error means Extract stopped; keep reading to the end
			continue
		}
		pw.Close()
		o := <-done
		c.result(o.res, o.err)
		return
	}
}

// exec runs one command on its connection.
func (s *Server) exec(c *conn, a ExecArgs) {
	if len(a.Argv) == 0 || a.Argv[0] == "" {
		c.result(nil, &Error{Kind: KindArgs, Message: "no command"})
		return
	}
	dir, derr := s.commandDir(a.Dir)
	if derr != nil {
		c.result(nil, derr)
		return
	}
	env := mergeEnv(s.cfg.Env, a.Env)
	prog, err := lookPath(a.Argv[0], envValue(env, "PATH"), dir)
	if err != nil {
		// As a shell reports it: a message on stderr and 127 (not found) or 126 (not executable).
		code, what := 126, err.Error()
		if errors.Is(err, errNotFound) || errors.Is(err, os.ErrNotExist) {
			code, what = 127, "command not found"
		}
		msg := a.Argv[0] + ": " + what
		if a.Background {
			c.result(nil, &Error{Kind: KindStart, Message: msg})
			return
		}
		switch {
		case a.Stderr:
			c.write(FrameStderr, []byte(msg+"\n"))
		case a.Stdout:
			c.write(FrameStdout, []byte(msg+"\n"))
		}
		c.result(ExecResult{Code: code}, nil)
		return
	}
	cmd := &exec.Cmd{Path: prog, Args: a.Argv, Dir: dir, Env: env}
	if a.Background {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := cmd.Start(); err != nil {
			c.result(nil, &Error{Kind: KindStart, Message: err.Error()})
			return
		}
		go cmd.Wait()
		c.result(ExecResult{Pid: cmd.Process.Pid}, nil)
		return
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var stdinW *os.File
	var outR, errR *os.File
	var closeAfter []*os.File
	if a.Stdin {
		r, w, err := os.Pipe()
		if err != nil {
			c.result(nil, err)
			return
		}
		cmd.Stdin, stdinW = r, w
		closeAfter = append(closeAfter, r)
	}
	if a.Stdout {
		r, w, err := os.Pipe()
		if err != nil {
			c.result(nil, err)
			return
		}
		cmd.Stdout, cmd.Stderr, outR = w, w, r
		closeAfter = append(closeAfter, w)
	}
	if a.Stderr {
		r, w, err := os.Pipe()
		if err != nil {
			c.result(nil, err)
			return
		}
		cmd.Stderr, errR = w, r
		closeAfter = append(closeAfter, w)
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		for _, f := range append(closeAfter, stdinW, outR, errR) {
			if f != nil {
				f.Close()
			}
		}
		c.result(nil, &Error{Kind: KindStart, Message: err.Error()})
		return
	}
	for _, f := range closeAfter {
		f.Close()
	}
	pid := cmd.Process.Pid
	var mu sync.Mutex
	reason, ended := "", false
	kill := func(why string) {
		mu.Lock()
		defer mu.Unlock()
		if ended {
			return // reaped: its pid may be another's now
		}
		if reason == "" {
			reason = why
		}
		unix.Kill(-pid, unix.SIGKILL)
	}
	if err := WriteJSON(c, FrameStarted, Started{Pid: pid}); err != nil {
		kill(protocol.ExecReasonCancelled)
	}
	var timer *time.Timer
	if a.TimeoutMs > 0 {
		timer = time.AfterFunc(time.Duration(a.TimeoutMs)*time.Millisecond, func() { kill(protocol.ExecReasonTimeout) })
	}
	// The broker's frames: input, its end, a kill. A broken connection kills the command.
	stdin := make(chan []byte, 64)
	go func() {
		defer close(stdin)
		for {
			typ, p, err := ReadFrame(c.r, nil)
			if err != nil {
				kill(protocol.ExecReasonCancelled)
				return
			}
			switch typ {
			case FrameStdin:
				stdin <- p
			case FrameStdinEOF:
				if stdinW != nil {
					stdin <- nil
				}
			case FrameKill:
				kill(protocol.ExecReasonCancelled)
			}
		}
	}()
	if stdinW != nil {
		go func() {
			for p := range stdin {
				if p == nil {
					stdinW.Close()
					continue
				}
				stdinW.Write(p) // fails once the command closed its input or ended: dropped
			}
			stdinW.Close()
		}()
	} else {
		go func() {
			for range stdin {
			}
		}()
	}
	limit := protocol.NewExecOutputLimit(a.MaxOutput)
	var wg sync.WaitGroup
	pump := func(f *os.File, typ byte) {
		defer wg.Done()
		w := &frameWriter{c: c, typ: typ}
		buf := make([]byte, 64<<10)
		for {
			n, err := f.Read(buf)
			if n > 0 {
				if limit.Deliver(w, buf[:n]) != nil {
					kill(protocol.ExecReasonCancelled)
				}
			}
			if err != nil {
				return
			}
		}
	}
	for _, p := range []struct {
		f   *os.File
		typ byte
	}{{outR, FrameStdout}, {errR, FrameStderr}} {
		if p.f != nil {
			wg.Add(1)
			go pump(p.f, p.typ)
		}
	}
	// Wait without reaping, so that a kill racing the end never reaches a reused pid.
	var info unix.Siginfo
	for {
		if err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil); err != unix.EINTR {
			break
		}
	}
	mu.Lock()
	ended = true
	mu.Unlock()
	cmd.Wait()
	// The command ended; a child it left behind may still hold its output open: give it a moment,
	// then stop reading.
	drained := make(chan struct{})
	go func() { wg.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(time.Second):
		for _, f := range []*os.File{outR, errR} {
			if f != nil {
				f.SetReadDeadline(time.Now())
			}
		}
		<-drained
	}
	for _, f := range []*os.File{outR, errR} {
		if f != nil {
			f.Close()
		}
	}
	if timer != nil {
		timer.Stop()
	}
	mu.Lock()
	res := exitResult(cmd.ProcessState, time.Since(start), limit.Truncated(), pid, reason)
	mu.Unlock()
	c.result(res, nil)
}

// exitResult is a finished command's answer: its exit code, or 128 plus the signal that ended it.
func exitResult(ps *os.ProcessState, took time.Duration, truncated bool, pid int, reason string) ExecResult {
	res := ExecResult{DurationUs: took.Microseconds(), Truncated: truncated, Pid: pid, Reason: reason}
	ws := ps.Sys().(syscall.WaitStatus)
	switch {
	case ws.Signaled():
		res.Code = 128 + int(ws.Signal())
		res.Signal = strings.TrimPrefix(unix.SignalName(ws.Signal()), "SIG")
	default:
		res.Code = ws.ExitStatus()
	}
	return res
}

// commandDir is a command's working directory: the sandbox path /workspace is the served
// workspace directory (the same in a pod).
func (s *Server) commandDir(d string) (string, *Error) {
	dir := cmpOr(d, workspace.Root)
	if dir == workspace.Root || strings.HasPrefix(dir, workspace.Root+"/") {
		dir = filepath.Join(s.cfg.Workspace, strings.TrimPrefix(dir, workspace.Root))
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return "", &Error{Kind: KindCwd, Message: fmt.Sprintf("cwd %s: not a directory in the sandbox", dir)}
	}
	return dir, nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func envValue(env []string, key string) string {
	for i := len(env) - 1; i >= 0; i-- {
		if k, v, ok := strings.Cut(env[i], "="); ok && k == key {
			return v
		}
	}
	return ""
}

func mergeEnv(base, overrides []string) []string {
	if len(overrides) == 0 {
		return base
	}
	drop := map[string]bool{}
	for _, kv := range overrides {
		k, _, _ := strings.Cut(kv, "=")
		drop[k] = true
	}
	out := make([]string, 0, len(base)+len(overrides))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if !drop[k] {
			out = append(out, kv)
		}
	}
	return append(out, overrides...)
}

// lookPath finds name in pathEnv (a name with a slash is taken as it is, relative to dir).
func lookPath(name, pathEnv, dir string) (string, error) {
	if strings.Contains(name, "/") {
		p := name
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := executable(p); err != nil {
			return "", err
		}
		return p, nil
	}
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, name)
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", errNotFound
}

var errNotFound = errors.New("command not found")

func executable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if fi.IsDir() || fi.Mode()&0o111 == 0 {
		return fmt.Errorf("%s: permission denied", p)
	}
	return nil
}
