package kube

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// agentClient reaches one pod's agent (sandbox/provider/agent) over the pod network. Unary
// operations reuse idle authenticated connections; exec and streamed operations take one each,
// and an upload that ends in step with the agent gives its back (agent.Started.Reuse).
type agentClient struct {
	addr   string
	secret []byte
	// tls pins the sandbox's agent certificate (agent.ClientTLS); nil is refused at dial, never
	// clear text.
	tls *tls.Config
	// gone says why the pod is no longer there (nil while it runs), to tell a broken connection
	// from a stopped sandbox.
	gone func() error

	mu   sync.Mutex
	idle []*agentConn
	// refilled is open while a spare connection is being dialed (refill), closed when it is
	// pooled or failed; nil otherwise.
	refilled chan struct{}
	closed   bool // close ran: nothing is pooled any more

	// life is cancelled by close: it ends every operation still in flight (agentbound.go).
	lifeOnce sync.Once
	life     context.Context
	endLife  context.CancelFunc
}

const maxIdle = 8

type agentConn struct {
	net.Conn
	// raw is the TCP connection under TLS (abort).
	raw net.Conn
	r   *bufio.Reader
	buf []byte
	wmu sync.Mutex
	// idleSince is when it was last put in the idle pool.
	idleSince time.Time
}

func (c *agentConn) write(typ byte, p []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return agent.WriteFrame(c.Conn, typ, p)
}

func (c *agentConn) writeJSON(typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return c.write(typ, b)
}

func (c *agentConn) read() (byte, []byte, error) {
	typ, p, err := agent.ReadFrame(c.r, c.buf)
	if cap(p) > cap(c.buf) {
		c.buf = p[:0]
	}
	return typ, p, err
}

// dial opens and authenticates a connection. The agent drops the oldest connections still in their
// handshake past agent.MaxPendingHandshakes (a flood from another pod), which may be one of ours in
// a burst: a handshake cut short is tried again, a wrong proof never.
func (a *agentClient) dial(ctx context.Context) (*agentConn, error) {
	for attempt := 1; ; attempt++ {
		c, err := a.dialOnce(ctx)
		if !errors.Is(err, errHandshakeCut) || attempt == 3 || ctx.Err() != nil {
			return c, err
		}
	}
}

// errHandshakeCut marks a connection the agent closed during the handshake.
var errHandshakeCut = errors.New("the agent closed the connection during the handshake")

func (a *agentClient) dialOnce(ctx context.Context) (*agentConn, error) {
	if a.tls == nil {
		return nil, errors.New("the sandbox's agent has no pinned TLS certificate: the broker does not talk to it in clear")
	}
	d := net.Dialer{Timeout: 10 * time.Second}
	raw, err := d.DialContext(ctx, "tcp", a.addr)
	if err != nil {
		return nil, a.lost(fmt.Errorf("reaching the sandbox's agent at %s: %w", a.addr, err))
	}
	if tc, ok := raw.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	nc := tls.Client(raw, a.tls)
	if err := nc.HandshakeContext(ctx); err != nil {
		raw.Close()
		return nil, a.lost(a.tlsErr(err))
	}
	challenge := make([]byte, agent.ChallengeSize)
	if _, err := io.ReadFull(nc, challenge); err != nil {
		nc.Close()
		return nil, a.lost(fmt.Errorf("the sandbox's agent at %s did not greet: %w", a.addr, err))
	}
	// Our answer and our own challenge; the agent must answer it before it gets a request.
	ours := make([]byte, agent.ChallengeSize)
	rand.Read(ours)
	if _, err := nc.Write(append(agent.Answer(a.secret, challenge), ours...)); err != nil {
		nc.Close()
		return nil, a.lost(err)
	}
	proof := make([]byte, agent.ChallengeSize)
	if _, err := io.ReadFull(nc, proof); errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
		nc.Close()
		return nil, a.lost(fmt.Errorf("%w at %s", errHandshakeCut, a.addr))
	} else if err != nil || !hmac.Equal(proof, agent.Proof(a.secret, ours)) {
		nc.Close()
		return nil, a.lost(fmt.Errorf("what answers at %s did not prove it holds the sandbox's agent secret (a wrong secret, or another pod at the address): nothing was sent to it", a.addr))
	}
	raw.SetDeadline(time.Time{})
	return &agentConn{Conn: nc, raw: raw, r: bufio.NewReaderSize(nc, 64<<10)}, nil
}

// tlsErr says why the TLS handshake with what answers at the pod's address failed.
func (a *agentClient) tlsErr(err error) error {
	var rh tls.RecordHeaderError
	switch {
	case errors.Is(err, agent.ErrNotPinned):
		return fmt.Errorf("what answers at %s did not present the sandbox's agent certificate (another pod at the address, or a Secret changed behind the broker): nothing was sent to it", a.addr)
	case errors.As(err, &rh):
		return fmt.Errorf("what answers at %s does not speak TLS (an sbx-agent older than TLS on the agent channel: rebuild the sandbox image): nothing was sent to it", a.addr)
	case errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
		// The agent drops the oldest handshakes past its bound (a flood): tried again.
		return fmt.Errorf("%w at %s", errHandshakeCut, a.addr)
	}
	return fmt.Errorf("the TLS handshake with the sandbox's agent at %s: %w", a.addr, err)
}

// lost is err, or ErrStopped's wrapping when the pod is gone.
func (a *agentClient) lost(err error) error {
	if a.gone != nil {
		if g := a.gone(); g != nil {
			return g
		}
	}
	return err
}

func (a *agentClient) get(ctx context.Context) (*agentConn, error) {
	a.mu.Lock()
	if n := len(a.idle); n > 0 {
		c := a.idle[n-1]
		a.idle = a.idle[:n-1]
		a.mu.Unlock()
		return c, nil
	}
	a.mu.Unlock()
	return a.dial(ctx)
}

// streamIdleMax is how long an idle connection may have waited and still carry a streamed
// operation. A unary one on a connection that went stale is sent again on a fresh one; a command
// is not (it may have started), so it only takes connections recent enough not to be.
const streamIdleMax = 30 * time.Second

// getStream is get for a streamed operation: an idle connection idle for less than streamIdleMax
// (older ones are closed), the spare being dialed when there is one (it is nearer than a dial of
// its own), or a new one.
func (a *agentClient) getStream(ctx context.Context) (*agentConn, error) {
	for waited := false; ; waited = true {
		a.mu.Lock()
		for n := len(a.idle); n > 0; n = len(a.idle) {
			c := a.idle[n-1]
			a.idle = a.idle[:n-1]
			if time.Since(c.idleSince) < streamIdleMax {
				a.mu.Unlock()
				return c, nil
			}
			c.Close()
		}
		refilled := a.refilled
		a.mu.Unlock()
		if refilled == nil || waited {
			return a.dial(ctx)
		}
		select {
		case <-refilled:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func (a *agentClient) put(c *agentConn) {
	c.idleSince = time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.closed && len(a.idle) < maxIdle {
		a.idle = append(a.idle, c)
		return
	}
	c.Close()
}

// close drops the idle connections and ends the operations in flight.
func (a *agentClient) close() {
	a.lifeCtx()
	a.endLife()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, c := range a.idle {
		c.abort()
	}
	a.idle = nil
	a.closed = true
}

// refill dials a spare connection into the idle pool in the background when the pool is empty, so
// that the next streamed operation (an exec) takes one ready instead of waiting for a handshake.
// The spare is dialed as every connection is (the pin, then the secret both ways).
func (a *agentClient) refill() {
	a.mu.Lock()
	if a.refilled != nil || a.closed || len(a.idle) > 0 {
		a.mu.Unlock()
		return
	}
	refilled := make(chan struct{})
	a.refilled = refilled
	a.mu.Unlock()
	go func() {
		defer close(refilled)
		ctx, cancel := context.WithTimeout(a.lifeCtx(), 10*time.Second)
		defer cancel()
		c, err := a.dial(ctx)
		if err == nil {
			a.put(c)
		}
		a.mu.Lock()
		a.refilled = nil
		a.mu.Unlock()
	}()
}

// result reads the operation's end: a result frame, decoded into out.
func result(c *agentConn, out any) error {
	for {
		typ, p, err := c.read()
		if err != nil {
			return err
		}
		if typ != agent.FrameResult {
			continue
		}
		var r agent.Result
		if err := json.Unmarshal(p, &r); err != nil {
			return fmt.Errorf("the sandbox's agent answered garbage: %w", err)
		}
		if r.Error != nil {
			return &opError{r.Error}
		}
		if out != nil && len(r.Result) > 0 {
			return json.Unmarshal(r.Result, out)
		}
		return nil
	}
}

// opError is an error the agent answered (as opposed to a broken connection).
type opError struct{ e *agent.Error }

func (e *opError) Error() string { return e.e.Error() }
func (e *opError) Unwrap() error { return e.e.AsError() }

// unary runs one request/answer operation, on an idle connection when there is one. A stale idle
// connection (the agent restarted) is retried once on a fresh one. It ends with the client (the
// pod's end) and, when ctx has no deadline, after agentOpTimeout (agentbound.go).
func (a *agentClient) unary(ctx context.Context, op string, args, out any) error {
	raw, err := json.Marshal(args)
	if err != nil {
		return err
	}
	req, _ := json.Marshal(agent.Request{Op: op, Args: raw})
	ctx, cancel := a.bound(ctx)
	defer cancel()
	for attempt := 0; ; attempt++ {
		c, err := a.get(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			return err
		}
		stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
		err = c.write(agent.FrameRequest, req)
		if err == nil {
			err = result(c, out)
		}
		stopped := !stop()
		var oe *opError
		if err == nil || errors.As(err, &oe) {
			if stopped {
				c.Close()
			} else {
				a.put(c)
			}
			if oe != nil {
				return agentErr(oe)
			}
			return nil
		}
		c.abort()
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		if attempt == 0 {
			continue
		}
		return a.lost(fmt.Errorf("the sandbox's agent: %w", err))
	}
}

// agentErr is what an agent's error means to the broker: a protocol error as it is.
func agentErr(oe *opError) error {
	if oe.e.Code != "" {
		return oe.e.AsError()
	}
	return oe
}

// stream starts an operation on a connection of its own (the agent ends it with the operation):
// a recent idle one when there is one, which passed the pin and the secret at its own dial as every
// connection does, else a new one; and dials a spare in the background (refill), so that the next
// exec does not wait for a TCP connect, a TLS handshake and the secret's challenges.
func (a *agentClient) stream(ctx context.Context, op string, args any) (*agentConn, agent.Started, error) {
	raw, err := json.Marshal(args)
	if err != nil {
		return nil, agent.Started{}, err
	}
	c, err := a.getStream(ctx)
	if err != nil {
		return nil, agent.Started{}, err
	}
	a.refill()
	if err := c.writeJSON(agent.FrameRequest, agent.Request{Op: op, Args: raw}); err != nil {
		c.Close()
		return nil, agent.Started{}, a.lost(err)
	}
	return c, agent.Started{}, nil
}

// started reads the started frame of a streamed operation, or its error.
func started(c *agentConn) (agent.Started, error) {
	typ, p, err := c.read()
	if err != nil {
		return agent.Started{}, err
	}
	switch typ {
	case agent.FrameStarted:
		var s agent.Started
		return s, json.Unmarshal(p, &s)
	case agent.FrameResult:
		var r agent.Result
		if err := json.Unmarshal(p, &r); err != nil {
			return agent.Started{}, err
		}
		if r.Error != nil {
			return agent.Started{}, agentErr(&opError{r.Error})
		}
		return agent.Started{}, errors.New("the sandbox's agent ended the operation before it started")
	}
	return agent.Started{}, fmt.Errorf("the sandbox's agent sent frame %q before starting", typ)
}

// agentFiles serves sandbox.Files through the agent.
type agentFiles struct{ a *agentClient }

var _ sandbox.Files = agentFiles{}

func (f agentFiles) Stat(path string) (protocol.FileInfo, error) {
	var out protocol.FileInfo
	return out, f.a.unary(context.Background(), agent.OpStat, agent.PathArgs{Path: path}, &out)
}

func (f agentFiles) ListContext(ctx context.Context, path string) (protocol.LsResult, error) {
	var out protocol.LsResult
	return out, f.a.unary(ctx, agent.OpList, agent.PathArgs{Path: path}, &out)
}

func (f agentFiles) ReadContext(ctx context.Context, a protocol.ReadArgs) (protocol.ReadResult, error) {
	var out protocol.ReadResult
	return out, f.a.unary(ctx, agent.OpRead, a, &out)
}

// ReadRaw is ReadContext with the content as raw bytes (the agent answers in JSON, where content
// that is not UTF-8 comes base64-encoded); alloc is not used, the bytes are the decoded answer's.
func (f agentFiles) ReadRaw(ctx context.Context, a protocol.ReadArgs, _ func(n int) []byte) (protocol.ReadHead, []byte, error) {
	res, err := f.ReadContext(ctx, a)
	if err != nil {
		return protocol.ReadHead{}, nil, err
	}
	head := protocol.ReadHead{Path: res.Path, Size: res.Size, TotalLines: res.TotalLines, TotalLinesPartial: res.TotalLinesPartial, Truncated: res.Truncated}
	if res.Encoding == protocol.EncodingBase64 {
		b, err := base64.StdEncoding.DecodeString(res.Content)
		if err != nil {
			return protocol.ReadHead{}, nil, fmt.Errorf("the sandbox's agent answered a read with bad base64: %w", err)
		}
		return head, b, nil
	}
	return head, []byte(res.Content), nil
}

func (f agentFiles) GlobContext(ctx context.Context, a protocol.GlobArgs) (protocol.GlobResult, error) {
	var out protocol.GlobResult
	return out, f.a.unary(ctx, agent.OpGlob, a, &out)
}

func (f agentFiles) Grep(ctx context.Context, a protocol.GrepArgs) (protocol.GrepResult, error) {
	var out protocol.GrepResult
	return out, f.a.unary(ctx, agent.OpGrep, a, &out)
}

func (f agentFiles) Write(a protocol.WriteArgs) (protocol.WriteResult, error) {
	var out protocol.WriteResult
	return out, f.a.unary(context.Background(), agent.OpWrite, a, &out)
}

// EditContext runs in the pod's agent, whose memory is the pod's: it draws on no broker budget.
func (f agentFiles) EditContext(_ context.Context, a protocol.EditArgs) (protocol.EditResult, error) {
	var out protocol.EditResult
	return out, f.a.unary(context.Background(), agent.OpEdit, a, &out)
}

func (f agentFiles) Delete(a protocol.DeleteArgs) error {
	return f.a.unary(context.Background(), agent.OpDelete, a, nil)
}

func (f agentFiles) Mkdir(a protocol.MkdirArgs) error {
	return f.a.unary(context.Background(), agent.OpMkdir, a, nil)
}

func (f agentFiles) Move(a protocol.MoveArgs) error {
	return f.a.unary(context.Background(), agent.OpMove, a, nil)
}

// Create starts a streamed write. It and each frame of it end with the pod, or when the agent
// takes nothing for agentIdleTimeout.
func (f agentFiles) Create(path, mode string) (sandbox.Upload, error) {
	c, s, err := f.start(agent.OpCreate, agent.CreateArgs{Path: path, Mode: mode})
	if err != nil {
		return nil, err
	}
	return &upload{a: f.a, c: c, reuse: s.Reuse, stop: f.a.watch(context.Background(), c)}, nil
}

// start begins a streamed operation that its caller gives no context (Create, OpenRead) and reads
// its start, the wait bounded by agentIdleTimeout and the client's life.
func (f agentFiles) start(op string, args any) (*agentConn, agent.Started, error) {
	c, _, err := f.a.stream(f.a.lifeCtx(), op, args)
	if err != nil {
		return nil, agent.Started{}, err // the dial's own bounds, and the pod's end (lost)
	}
	stop := f.a.watch(context.Background(), c)
	defer stop()
	c.SetReadDeadline(time.Now().Add(agentIdleTimeout))
	s, err := started(c)
	if err != nil {
		c.abort()
		return nil, agent.Started{}, f.a.streamErr(nil, err)
	}
	c.SetReadDeadline(time.Time{})
	return c, s, nil
}

// upload is a streamed write through the agent.
type upload struct {
	a *agentClient
	c *agentConn
	// reuse: the agent takes further requests on c once the upload's result is read
	// (agent.Started.Reuse).
	reuse bool
	stop  func() // the watch that aborts c at the pod's end
	done  bool
}

// end ends the upload's use of its connection once its result was read (err nil or the agent's
// own error): the connection goes back to the pool when the agent keeps it (the next write does
// not pay a TLS handshake), else it is closed.
func (u *upload) end(err error) {
	u.stop()
	var oe *opError
	if u.reuse && (err == nil || errors.As(err, &oe)) && u.a.lifeCtx().Err() == nil && u.c.SetDeadline(time.Time{}) == nil {
		u.a.put(u.c)
		return
	}
	u.c.abort()
}

func (u *upload) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), 256<<10)]
		if err := u.c.writeIdle(agent.FrameData, chunk); err != nil {
			return n, u.a.streamErr(nil, err)
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

func (u *upload) Commit() (protocol.WriteResult, error) {
	var out protocol.WriteResult
	if u.done {
		return out, errors.New("upload already ended")
	}
	u.done = true
	if err := u.c.writeIdle(agent.FrameEnd, nil); err != nil {
		u.end(err)
		return out, u.a.streamErr(nil, err)
	}
	err := resultIdle(u.c, &out)
	u.end(err)
	var oe *opError
	if errors.As(err, &oe) {
		return out, agentErr(oe)
	}
	if err != nil {
		return out, u.a.streamErr(nil, err)
	}
	return out, nil
}

func (u *upload) Abort() error {
	if u.done {
		return nil
	}
	u.done = true
	if err := u.c.writeIdle(agent.FrameAbort, nil); err != nil {
		u.end(err)
		return nil
	}
	u.end(resultIdle(u.c, nil))
	return nil
}

// OpenRead starts a streamed read. Its start and each of its frames end with the pod, or when the
// agent sends nothing for agentIdleTimeout.
func (f agentFiles) OpenRead(path string) (io.ReadCloser, protocol.FileInfo, error) {
	c, s, err := f.start(agent.OpOpen, agent.PathArgs{Path: path})
	if err != nil {
		return nil, protocol.FileInfo{}, err
	}
	// A download sends the size the file had when opened, no more: without it, it would end empty
	// and look like success.
	if s.Info == nil {
		c.abort()
		return nil, protocol.FileInfo{}, fmt.Errorf("the sandbox's agent opened %s without saying its size, which a download needs: its image is older than or not the broker's sbx-agent; rebuild it", path)
	}
	return &download{a: f.a, c: c, stop: f.a.watch(context.Background(), c)}, *s.Info, nil
}

// download reads a file's data frames.
type download struct {
	a    *agentClient
	c    *agentConn
	stop func()
	rest []byte
	err  error
}

func (d *download) Read(p []byte) (int, error) {
	for len(d.rest) == 0 {
		if d.err != nil {
			return 0, d.err
		}
		typ, b, err := d.c.readIdle()
		switch {
		case err != nil:
			d.err = d.a.streamErr(nil, err)
		case typ == agent.FrameData:
			d.rest = b
		case typ == agent.FrameResult:
			var r agent.Result
			if jerr := json.Unmarshal(b, &r); jerr != nil {
				d.err = jerr
			} else if r.Error != nil {
				d.err = agentErr(&opError{r.Error})
			} else {
				d.err = io.EOF
			}
		}
	}
	n := copy(p, d.rest)
	d.rest = d.rest[n:]
	return n, nil
}

func (d *download) Close() error {
	d.stop()
	d.c.abort()
	return nil
}

// Extract streams a tar into dir. It ends with ctx or the pod, or when the agent takes nothing for
// agentIdleTimeout (time spent reading r does not count).
func (f agentFiles) Extract(ctx context.Context, dir string, r io.Reader) (protocol.TreeResult, error) {
	var out protocol.TreeResult
	c, _, err := f.a.stream(ctx, agent.OpExtract, agent.PathArgs{Path: dir})
	if err != nil {
		return out, err
	}
	defer c.abort()
	stop := f.a.watch(ctx, c)
	defer stop()
	buf := make([]byte, 256<<10)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if err := c.writeIdle(agent.FrameData, buf[:n]); err != nil {
				return out, f.a.streamErr(ctx, err)
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return out, rerr
		}
	}
	if err := c.writeIdle(agent.FrameEnd, nil); err != nil {
		return out, f.a.streamErr(ctx, err)
	}
	err = resultIdle(c, &out)
	var oe *opError
	if errors.As(err, &oe) {
		return out, agentErr(oe)
	}
	if err != nil {
		return out, f.a.streamErr(ctx, err)
	}
	return out, nil
}

// Archive streams path as a tar to w. It ends with ctx or the pod, or when the agent sends nothing
// for agentIdleTimeout (time spent writing to w does not count).
func (f agentFiles) Archive(ctx context.Context, path string, w io.Writer) (protocol.TreeResult, error) {
	var out protocol.TreeResult
	c, _, err := f.a.stream(ctx, agent.OpArchive, agent.PathArgs{Path: path})
	if err != nil {
		return out, err
	}
	defer c.abort()
	stop := f.a.watch(ctx, c)
	defer stop()
	for {
		typ, b, err := c.readIdle()
		if err != nil {
			return out, f.a.streamErr(ctx, err)
		}
		switch typ {
		case agent.FrameData:
			if _, err := w.Write(b); err != nil {
				return out, err
			}
		case agent.FrameResult:
			var r agent.Result
			if err := json.Unmarshal(b, &r); err != nil {
				return out, err
			}
			if r.Error != nil {
				return out, agentErr(&opError{r.Error})
			}
			return out, json.Unmarshal(r.Result, &out)
		}
	}
}
