package backend

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
)

// Config says how to reach a sandbox's dataplane.
type Config struct {
	// URL is the dataplane URL (ws://host/v1/sandboxes/<id>/dataplane).
	URL string
	// Credential is a delegation token or an owner API key. It is sent in the Authorization header.
	Credential string
	// SandboxID, when set, must match the sandbox the broker says this connection reaches.
	SandboxID string
	// DialTimeout bounds one connection attempt, the WebSocket's or an upload's (default 10s).
	DialTimeout time.Duration
	// Reconnects is how many times a broken connection is re-dialled, with backoff, before calls fail
	// with KindUnreachable (default 5).
	Reconnects int
}

// Remote is a Backend on a sandbox, through the broker's dataplane. It is safe for concurrent use:
// calls share one connection, each with its own request id. A broken connection is re-dialled on
// the next call; calls that are safe to repeat (reads, listings, searches, overwrites) are retried
// once on a fresh connection, others fail with KindUnreachable.
type Remote struct {
	cfg    Config
	mu     sync.Mutex
	conn   *conn
	closed bool
	// ended is set when the broker closed the connection for good (revoked, expired, stopped).
	ended *protocol.Error
	hello protocol.Hello
	// endedCh is closed, once, when the broker ends a connection for good; see Ended.
	endedCh   chan struct{}
	endedOnce sync.Once
	endedErr  *protocol.Error
	// uploads sends Upload's requests (newUploadClient).
	uploads *http.Client
}

// Dial connects to a sandbox's dataplane.
func Dial(ctx context.Context, cfg Config) (*Remote, error) {
	if cfg.URL == "" || cfg.Credential == "" {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "a dataplane URL and a credential are required")
	}
	if !strings.HasPrefix(cfg.URL, "ws://") && !strings.HasPrefix(cfg.URL, "wss://") {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "dataplane_url %q must be a ws:// or wss:// URL", protocol.RedactURL(cfg.URL))
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.Reconnects == 0 {
		cfg.Reconnects = 5
	}
	r := &Remote{cfg: cfg, endedCh: make(chan struct{}), uploads: newUploadClient(cfg.DialTimeout)}
	if _, err := r.connection(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// ID is the sandbox id.
func (r *Remote) ID() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hello.SandboxID
}

// Hello is what the broker said when the connection opened: scopes, limits, expiry.
func (r *Remote) Hello() protocol.Hello {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hello
}

// Close closes the connection.
func (r *Remote) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	if r.conn != nil {
		r.conn.close(nil)
	}
	r.uploads.CloseIdleConnections()
	return nil
}

// connection returns a live connection, dialling (with backoff) when there is none.
func (r *Remote) connection(ctx context.Context) (*conn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "the backend is closed")
	}
	if r.ended != nil {
		return nil, r.ended
	}
	if r.conn != nil && !r.conn.isDead() {
		return r.conn, nil
	}
	if r.conn != nil {
		if end := r.conn.endedBy(); end != nil {
			r.ended = end
			return nil, end
		}
	}
	var last error
	for attempt := 0; attempt <= r.cfg.Reconnects; attempt++ {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(min(100*time.Millisecond<<(attempt-1), 5*time.Second)):
			}
		}
		c, hello, err := dial(ctx, r.cfg, r.markEnded)
		if err == nil {
			r.conn, r.hello = c, hello
			return c, nil
		}
		last = err
		var pe *protocol.Error
		if errors.As(err, &pe) && pe.Code != protocol.CodeUnreachable && pe.Code != protocol.CodeUnavailable {
			return nil, err // refused for a reason that retrying does not change
		}
	}
	return nil, last
}

// Ended is closed when the broker ends the connection for good: the credential was revoked or
// expired, or the sandbox stopped. Every later call fails with EndedErr. A front end that serves a
// session over this backend (the MCP server) ends that session then, instead of waiting for its
// next call to find out.
func (r *Remote) Ended() <-chan struct{} { return r.endedCh }

// EndedErr is why the broker ended the connection (nil until Ended is closed).
func (r *Remote) EndedErr() *protocol.Error {
	select {
	case <-r.endedCh:
		return r.endedErr
	default:
		return nil
	}
}

func (r *Remote) markEnded(e *protocol.Error) {
	r.endedOnce.Do(func() {
		r.endedErr = e
		close(r.endedCh)
	})
}

func dial(ctx context.Context, cfg Config, onEnd func(*protocol.Error)) (*conn, protocol.Hello, error) {
	d := websocket.Dialer{
		HandshakeTimeout: cfg.DialTimeout,
		Subprotocols:     []string{protocol.Subprotocol},
		ReadBufferSize:   64 << 10,
		// Client frames are masked into this buffer: it must hold a whole frame (a 1 MiB upload
		// chunk, a write of max_frame_bytes), or it would go out as many small ones. It is taken
		// from a pool only while a message is written, so idle connections hold none.
		WriteBufferSize: 1<<20 + 64<<10 + 64,
		WriteBufferPool: writeBuffers,
	}
	hdr := http.Header{}
	hdr.Set("Authorization", "Bearer "+cfg.Credential)
	ws, resp, err := d.DialContext(ctx, cfg.URL, hdr)
	if err != nil {
		if resp != nil {
			defer resp.Body.Close()
			var eb protocol.ErrorBody
			if json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&eb) == nil && eb.Error.Code != "" {
				eb.Error.Status = resp.StatusCode
				return nil, protocol.Hello{}, &eb.Error
			}
			return nil, protocol.Hello{}, unreachable("the dataplane answered %s", resp.Status)
		}
		return nil, protocol.Hello{}, unreachable("cannot reach %s: %v", protocol.RedactURL(cfg.URL), err)
	}
	ws.SetReadLimit(maxAnswerBytes)
	var first protocol.Response
	ws.SetReadDeadline(time.Now().Add(cfg.DialTimeout))
	if err := ws.ReadJSON(&first); err != nil || first.Type != "hello" || first.Hello == nil {
		ws.Close()
		return nil, protocol.Hello{}, unreachable("the dataplane did not greet: %v", err)
	}
	ws.SetReadDeadline(time.Time{})
	if cfg.SandboxID != "" && first.Hello.SandboxID != cfg.SandboxID {
		ws.Close()
		return nil, protocol.Hello{}, protocol.Errorf(protocol.CodeTokenSandbox, "the dataplane reached sandbox %s, not %s", first.Hello.SandboxID, cfg.SandboxID)
	}
	slots := first.Hello.Limits.MaxInflight
	if slots <= 0 {
		slots = 64
	}
	c := &conn{ws: ws, pending: map[uint32]*call{}, dead: make(chan struct{}), slots: make(chan struct{}, slots),
		maxFrame: first.Hello.Limits.MaxFrameBytes, onEnd: onEnd}
	go c.readLoop()
	return c, *first.Hello, nil
}

// writeBuffers are the connections' write buffers, held only while a message is written.
var writeBuffers = &sync.Pool{}

// maxAnswerBytes bounds one frame from the broker. max_frame_bytes bounds only what the broker
// reads: its answers are bigger (a read carries up to 8 MiB, base64-encoded when binary; an exec up
// to max_output_bytes of output, which JSON escaping of control bytes grows up to sixfold), and a
// limit below them breaks the connection under every call sharing it.
const maxAnswerBytes = 512 << 20

// conn is one WebSocket connection and its requests in flight.
type conn struct {
	ws      *websocket.Conn
	wmu     sync.Mutex // one writer at a time
	nextID  atomic.Uint32
	mu      sync.Mutex
	pending map[uint32]*call
	dead    chan struct{}
	// slots holds one token per request in flight, up to the broker's max_inflight: callers beyond
	// it wait here instead of being refused too_many_requests.
	slots chan struct{}
	// maxFrame is the broker's max_frame_bytes (0: unknown); a bigger request is refused here.
	maxFrame int
	err      error           // why it died
	end      *protocol.Error // set when the broker ended it for good
	onEnd    func(*protocol.Error)
}

// call is one request in flight: its final answer, and sinks for the binary frames it receives.
type call struct {
	done   chan struct{}
	result json.RawMessage
	err    *protocol.Error
	stdout io.Writer
	stderr io.Writer
	data   io.Writer
	// sent, when set, is told the request's id once the request is on the wire (a shell's input
	// and resizes name it).
	sent func(id uint32)
	// in, when hasIn, is the request's body: it goes in one protocol.FrameRequestBody with the
	// request (a write's content). body is the answer's, when it came in a protocol.FrameAnswerBody
	// (a read's content); nothing else holds it.
	in    string
	hasIn bool
	body  []byte

	// mu orders the reader's writes into the sinks with the caller giving up on the call: once
	// detached, nothing more is written into them, since the caller may be using its writer again.
	mu       sync.Mutex
	detached bool
	sinkErr  error
	// sinkFailed is closed when a sink's write first fails: the caller then cancels the call at the
	// broker rather than have the rest of it read and discarded.
	sinkFailed chan struct{}
}

// detach stops writes into the call's sinks (waiting for one in progress) and returns their error.
func (cl *call) detach() error {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	cl.detached = true
	return cl.sinkErr
}

func (c *conn) isDead() bool {
	select {
	case <-c.dead:
		return true
	default:
		return false
	}
}

func (c *conn) endedBy() *protocol.Error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.end
}

func (c *conn) close(err error) {
	c.mu.Lock()
	select {
	case <-c.dead:
		c.mu.Unlock()
		return
	default:
	}
	c.err = err
	close(c.dead)
	pending := c.pending
	c.pending = map[uint32]*call{}
	c.mu.Unlock()
	c.ws.Close()
	for _, cl := range pending {
		cl.err = c.failure()
		close(cl.done)
	}
}

// failure is the error calls in flight get when the connection dies. Callers must not hold c.mu.
func (c *conn) failure() *protocol.Error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.end != nil {
		return c.end
	}
	return unreachable("the dataplane connection broke: %v", c.err)
}

type wireResponse struct {
	ID     uint32          `json:"id"`
	Result json.RawMessage `json:"result"`
	Error  *protocol.Error `json:"error"`
}

func (c *conn) readLoop() {
	var text bytes.Buffer
	// Binary payloads (download chunks, exec output) stream into their sinks through a pooled
	// buffer that holds a whole chunk (one read from the socket per chunk when it has arrived): no
	// allocation per frame, one copy, and none held by an idle connection.
	header := make([]byte, protocol.FrameHeaderLen)
	for {
		mt, r, err := c.ws.NextReader()
		if err != nil {
			var ce *websocket.CloseError
			if errors.As(err, &ce) && (ce.Code == protocol.CloseCredentialEnded || ce.Code == protocol.CloseSandboxGone) {
				end := &protocol.Error{Code: ce.Text, Message: closeMessage(ce)}
				c.mu.Lock()
				c.end = end
				c.mu.Unlock()
				c.close(err)
				if c.onEnd != nil {
					c.onEnd(end)
				}
				return
			}
			c.close(err)
			return
		}
		if mt == websocket.BinaryMessage {
			if _, err := io.ReadFull(r, header); err != nil {
				continue
			}
			kind, id := header[0], binary.BigEndian.Uint32(header[1:])
			if kind == protocol.FrameAnswerBody {
				if err := c.bodyAnswer(id, r); err != nil {
					c.close(err)
					return
				}
				continue
			}
			c.mu.Lock()
			cl := c.pending[id]
			c.mu.Unlock()
			var w io.Writer
			if cl != nil {
				switch kind {
				case protocol.FrameStdout:
					w = cl.stdout
				case protocol.FrameStderr:
					w = cl.stderr
				case protocol.FrameData:
					w = cl.data
				}
			}
			if w == nil {
				copyPooled(io.Discard, r)
				continue
			}
			// A read error means the connection broke (NextReader reports it next); a write error
			// is the caller's sink refusing bytes, which ends that call only.
			copyPooled(&sinkWriter{w: w, cl: cl}, r)
			continue
		}
		text.Reset()
		if _, err := text.ReadFrom(r); err != nil {
			c.close(err)
			return
		}
		// The broker writes successful answers in the canonical form: split them without decoding
		// (the caller decodes the result once); anything else is decoded in full.
		var resp wireResponse
		if id, result, ok := protocol.SplitResult(text.Bytes()); ok {
			resp.ID, resp.Result = id, bytes.Clone(result)
		} else if json.Unmarshal(text.Bytes(), &resp) != nil {
			continue
		}
		c.mu.Lock()
		cl := c.pending[resp.ID]
		delete(c.pending, resp.ID)
		c.mu.Unlock()
		if cl == nil {
			continue // an answer to a request nobody waits for (a frame error with id 0, a cancelled call)
		}
		cl.result, cl.err = resp.Result, resp.Error
		close(cl.done)
	}
}

// bodyAnswer reads the rest of a protocol.FrameAnswerBody for request id (its JSON answer, then its
// body) and ends the call. The body is read straight into a buffer of its own, sized from the
// answer's size when it says one, so it is copied once, from the socket.
func (c *conn) bodyAnswer(hdrID uint32, r io.Reader) error {
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return fmt.Errorf("a frame with a body ended in its header: %w", err)
	}
	jsLen := binary.BigEndian.Uint32(n[:])
	if jsLen > maxAnswerBytes {
		return fmt.Errorf("a frame with a body says its JSON is %d bytes", jsLen)
	}
	js := make([]byte, jsLen)
	if _, err := io.ReadFull(r, js); err != nil {
		return fmt.Errorf("a frame with a body ended in its JSON: %w", err)
	}
	id, result, ok := protocol.SplitResult(js)
	if !ok || id != hdrID {
		return fmt.Errorf("a frame with a body for request %d does not hold its answer", hdrID)
	}
	var head struct {
		Size int64 `json:"size"`
	}
	json.Unmarshal(result, &head) // only a hint
	body, err := readRest(r, min(max(head.Size, 0), maxReadHint)+1)
	if err != nil {
		return err
	}
	c.mu.Lock()
	cl := c.pending[id]
	delete(c.pending, id)
	c.mu.Unlock()
	if cl == nil {
		return nil // cancelled
	}
	cl.result, cl.body = result, body
	close(cl.done)
	return nil
}

// maxReadHint bounds the buffer a body answer starts with: the broker's read cap.
const maxReadHint = 8 << 20

// readRest reads r to its end into a buffer of capacity hint, growing it if r has more.
func readRest(r io.Reader, hint int64) ([]byte, error) {
	b := make([]byte, 0, hint)
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// readBuffers hold binary payloads on their way from the socket to a sink.
var readBuffers = sync.Pool{New: func() any { b := make([]byte, 1<<20); return &b }}

func copyPooled(w io.Writer, r io.Reader) {
	bp := readBuffers.Get().(*[]byte)
	io.CopyBuffer(w, r, *bp)
	readBuffers.Put(bp)
}

// sinkWriter writes payload bytes into one of a call's sinks under the call's lock, and keeps the
// sink's write error on the call. Once the call is detached (its caller returned and may be using
// the writer again) or its sink failed, bytes are dropped. It also hides the sink's ReadFrom, so
// io.CopyBuffer uses the shared buffer.
type sinkWriter struct {
	w  io.Writer
	cl *call
}

func (s *sinkWriter) Write(p []byte) (int, error) {
	s.cl.mu.Lock()
	defer s.cl.mu.Unlock()
	if s.cl.detached || s.cl.sinkErr != nil {
		return len(p), nil
	}
	n, err := s.w.Write(p)
	if err != nil {
		s.cl.sinkErr = err
		close(s.cl.sinkFailed) // once: later writes return above
	}
	return n, err
}

func closeMessage(ce *websocket.CloseError) string {
	switch ce.Text {
	case protocol.CodeTokenRevoked:
		return "the sandbox's owner revoked this credential"
	case protocol.CodeTokenExpired:
		return "this credential expired; the owner must send a fresh run config"
	case protocol.CodeNotRunning:
		return "the sandbox stopped; its owner must resume it"
	}
	return "the broker closed the connection: " + ce.Text
}

// roundTrip sends one request and waits for its answer; frames of kind data/stdout/stderr for it go
// to the call's sinks. upload, when set, streams its bytes as data frames after the request.
func (c *conn) roundTrip(ctx context.Context, op string, args any, cl *call, upload io.Reader) error {
	select {
	case c.slots <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	case <-c.dead:
		return c.failure()
	}
	// The broker frees a slot when it takes the answer to send; holding ours until the answer (or
	// our cancel) arrives keeps us within its count.
	defer func() { <-c.slots }()
	id := c.nextID.Add(1)
	if id == 0 {
		id = c.nextID.Add(1)
	}
	req, err := json.Marshal(protocol.Request{ID: id, Op: op, Args: args})
	if err != nil {
		return err
	}
	if size := frameSize(req, cl); c.maxFrame > 0 && size > c.maxFrame {
		// The broker would close the connection, under every call sharing it.
		return protocol.Errorf(protocol.CodeTooLarge, "the %s request is %d bytes, over the dataplane's limit of %d per frame; send large content with upload",
			op, size, c.maxFrame)
	}
	cl.done, cl.sinkFailed = make(chan struct{}), make(chan struct{})
	c.mu.Lock()
	if c.isDead() {
		c.mu.Unlock()
		return c.failure()
	}
	c.pending[id] = cl
	c.mu.Unlock()
	if cl.hasIn {
		err = c.writeBody(id, req, cl.in)
	} else {
		err = c.write(websocket.TextMessage, req)
	}
	if err != nil {
		cl.detach()
		return c.failure()
	}
	if cl.sent != nil {
		cl.sent(id)
	}
	if upload != nil {
		if err := c.sendData(ctx, id, upload, cl.done); err != nil {
			c.cancel(id)
			cl.detach()
			return err
		}
	}
	select {
	case <-cl.done:
	case <-cl.sinkFailed:
		// The caller's writer failed (a full disk, a capped buffer): what is left of the transfer
		// would only be discarded, a file of any size read and sent for nothing. Sent from here,
		// not from the reader goroutine, which must never wait for the writer.
		c.cancel(id)
		return cl.detach()
	case <-ctx.Done():
		c.cancel(id)
		cl.detach()
		return ctx.Err()
	}
	// done may have been closed by a connection failure while the reader was writing a sink.
	sinkErr := cl.detach()
	if cl.err != nil {
		return cl.err
	}
	return sinkErr
}

func (c *conn) write(kind int, data []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.ws.SetWriteDeadline(time.Now().Add(time.Minute))
	err := c.ws.WriteMessage(kind, data)
	if err != nil {
		c.close(err)
	}
	return err
}

// frameSize is the size of the frame that carries req (and cl's body).
func frameSize(req []byte, cl *call) int {
	if cl.hasIn {
		return protocol.BodyHeaderLen + len(req) + len(cl.in)
	}
	return len(req)
}

// writeBody sends request id as one protocol.FrameRequestBody: the request's JSON, then body. The
// body is copied once, into the connection's write buffer, where the frame is masked.
func (c *conn) writeBody(id uint32, req []byte, body string) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.ws.SetWriteDeadline(time.Now().Add(time.Minute))
	w, err := c.ws.NextWriter(websocket.BinaryMessage)
	if err == nil {
		var h [protocol.BodyHeaderLen]byte
		protocol.PutBodyHeader(h[:], protocol.FrameRequestBody, id, len(req))
		w.Write(h[:])
		w.Write(req)
		io.WriteString(w, body)
		err = w.Close()
	}
	if err != nil {
		c.close(err)
	}
	return err
}

// sendData streams r as data frames, then the end frame; it stops early when the upload's answer
// arrives first (the broker refused it: sending the rest would only be discarded).
func (c *conn) sendData(ctx context.Context, id uint32, r io.Reader, answered <-chan struct{}) error {
	buf := make([]byte, protocol.FrameHeaderLen+1<<20)
	for {
		select {
		case <-answered:
			return nil
		default:
		}
		n, err := fill(r, buf[protocol.FrameHeaderLen:])
		if n > 0 {
			protocol.PutFrameHeader(buf, protocol.FrameData, id)
			if werr := c.write(websocket.BinaryMessage, buf[:protocol.FrameHeaderLen+n]); werr != nil {
				return c.failure()
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	// A call cancelled while its source was read is not completed, however the source ended.
	if ctx.Err() != nil {
		return ctx.Err()
	}
	protocol.PutFrameHeader(buf, protocol.FrameEnd, id)
	if err := c.write(websocket.BinaryMessage, buf[:protocol.FrameHeaderLen]); err != nil {
		return c.failure()
	}
	return nil
}

// fill reads r into p until p is full or r ends (io.EOF). Unlike io.ReadFull it passes r's own
// errors through unchanged: a source that fails with io.ErrUnexpectedEOF (an HTTP body cut short)
// is a failed upload, not its end, and must never complete a truncated file.
func fill(r io.Reader, p []byte) (int, error) {
	n := 0
	for n < len(p) {
		m, err := r.Read(p[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// cancel asks the broker to stop request id and stops waiting for it.
func (c *conn) cancel(id uint32) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
	req, _ := json.Marshal(protocol.Request{ID: id, Op: protocol.OpCancel})
	c.write(websocket.TextMessage, req)
}
