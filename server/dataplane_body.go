package server

import (
	"context"
	"encoding/json"
	"io"
	"sync"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
)

// File content on the dataplane's hot path (docs/dataplane.md, "Frames with a body"): a write's
// content arrives as the raw body of one binary frame (protocol.FrameRequestBody) and a read's
// leaves as the raw body of one (protocol.FrameAnswerBody). Nothing is encoded, escaped, validated
// as text or decoded on the way; the bytes are copied once from the socket into a pooled buffer
// and written to the file from it, or read from the file into a pooled buffer and written to the
// socket from it (gorilla writes a server frame's payload with writev, without a copy).

// bodyPool is a pool of byte buffers in a few size classes: a request or answer takes the smallest
// that holds it, so a 4 KiB write does not hold a megabyte while it is in flight.
type bodyPool struct {
	sizes []int
	pools []sync.Pool
}

func newBodyPool(sizes ...int) *bodyPool {
	p := &bodyPool{sizes: sizes, pools: make([]sync.Pool, len(sizes))}
	for i, n := range sizes {
		p.pools[i].New = func() any { b := make([]byte, n); return &b }
	}
	return p
}

// get returns a buffer of at least n bytes (len = its class's size) and its put, which gives it back;
// a buffer bigger than every class is allocated and left to the collector.
func (p *bodyPool) get(n int) ([]byte, func()) {
	for i, size := range p.sizes {
		if n <= size {
			bp := p.pools[i].Get().(*[]byte)
			return *bp, func() { p.pools[i].Put(bp) }
		}
	}
	return make([]byte, n), func() {}
}

// readHeadroom is the room kept in front of a read's content for the answer's frame header and JSON
// (the path, the size, the line counts): they are written into it, so the content is never copied
// to make the frame. An answer whose JSON does not fit (a path of thousands of escaped characters)
// is copied into a frame of its own instead.
const readHeadroom = 4 << 10

var (
	// inBodies hold request frames with a body while their request runs: at most max_frame_bytes.
	inBodies = newBodyPool(64<<10, dpMaxFrameBytes)
	// outBodies hold a read's content behind its headroom, up to the read cap (8 MiB).
	outBodies = newBodyPool(readHeadroom+64<<10, readHeadroom+1<<20, readHeadroom+8<<20)
)

// readBodyFrame reads the rest of a FrameRequestBody (after its 5-byte header) into a pooled
// buffer: first into a small one, moving to a large one only when the frame is longer. The
// connection's read limit bounds it. err is the connection's error (the reader then ends).
func readBodyFrame(r io.Reader) (payload []byte, put func(), err error) {
	small, putSmall := inBodies.get(0)
	n, err := io.ReadFull(r, small)
	if err == io.ErrUnexpectedEOF || err == io.EOF {
		return small[:n], putSmall, nil
	}
	if err != nil {
		putSmall()
		return nil, nil, err
	}
	large, putLarge := inBodies.get(dpMaxFrameBytes)
	copy(large, small)
	putSmall()
	m, err := io.ReadFull(r, large[n:])
	if err == io.ErrUnexpectedEOF || err == io.EOF {
		return large[:n+m], putLarge, nil
	}
	putLarge()
	if err == nil { // the frame fills the largest buffer: only a frame over the limit does
		err = websocket.ErrReadLimit
	}
	return nil, nil, err
}

// bodyRequest parses a FrameRequestBody's payload: the request's JSON (which must name the header's
// id) and its body. A frame that lies about its lengths or ids is an error answered on id 0.
func bodyRequest(hdrID uint32, payload []byte) (id uint32, op string, args json.RawMessage, body []byte, perr *protocol.Error) {
	js, body, err := protocol.SplitBody(payload)
	if err != nil {
		return 0, "", nil, nil, protocol.Errorf(protocol.CodeInvalidArgument, "binary frame of kind %d for request %d: %v; nothing was done", protocol.FrameRequestBody, hdrID, err)
	}
	id, op, args, ok := parseRequest(js)
	if !ok {
		return 0, "", nil, nil, protocol.Errorf(protocol.CodeInvalidJSON, "binary frame of kind %d for request %d: its JSON is not a request object {\"id\": <uint32>, \"op\": <string>, \"args\": {...}}; nothing was done", protocol.FrameRequestBody, hdrID)
	}
	if id != hdrID {
		return 0, "", nil, nil, protocol.Errorf(protocol.CodeInvalidArgument, "binary frame of kind %d: its header names request %d and its JSON request %d; nothing was done", protocol.FrameRequestBody, hdrID, id)
	}
	return id, op, args, body, nil
}

// bodyAnswer is a result whose content leaves as the body of a FrameAnswerBody: head is the JSON
// result, body the content. body may sit in a pooled buffer behind readHeadroom bytes of room
// (frame), given back by put once the frame is written or dropped.
type bodyAnswer struct {
	head  any
	body  []byte
	frame []byte // the pooled buffer: frame[readHeadroom:] starts with body; nil when body has its own
	put   func()
}

// frame makes the answer's binary frame for request id. It writes the header and the JSON into the
// headroom in front of the content when they fit, so the content is not copied.
func (b *bodyAnswer) encode(id uint32) []byte {
	js := encode(protocol.Response{ID: id, Result: b.head})
	if b.frame != nil && len(js)+protocol.BodyHeaderLen <= readHeadroom {
		start := readHeadroom - len(js) - protocol.BodyHeaderLen
		protocol.PutBodyHeader(b.frame[start:], protocol.FrameAnswerBody, id, len(js))
		copy(b.frame[start+protocol.BodyHeaderLen:], js)
		return b.frame[start : readHeadroom+len(b.body)]
	}
	return protocol.AppendBodyFrame(make([]byte, 0, protocol.BodyHeaderLen+len(js)+len(b.body)), protocol.FrameAnswerBody, id, js, b.body)
}

// opRead reads into pooled memory behind the answer's headroom; the buffer goes back once the answer
// is written or dropped (the request's hold).
func opRead(ctx context.Context, c *dpConn, r *request, a protocol.ReadArgs) (any, error) {
	var frame []byte
	var put func()
	head, content, err := c.files.ReadRaw(ctx, a, func(n int) []byte {
		frame, put = outBodies.get(readHeadroom + n)
		return frame[readHeadroom:]
	})
	if err != nil {
		if put != nil {
			put()
		}
		return nil, err
	}
	ans := &bodyAnswer{head: head, body: content}
	if put != nil {
		r.hold.add(put)
		if len(content) > 0 && &frame[readHeadroom] == &content[0] || len(content) == 0 {
			ans.frame = frame
		}
	}
	return ans, nil
}

// opWrite writes the request's body, its content, to the file atomically.
func opWrite(_ context.Context, c *dpConn, r *request, a protocol.WriteHead) (any, error) {
	up, err := c.files.Create(a.Path, a.Mode)
	if err != nil {
		return nil, err
	}
	defer up.Abort()
	if _, err := up.Write(r.body); err != nil {
		return nil, err
	}
	res, err := up.Commit()
	if err == nil {
		c.emitPath(protocol.EventFileWritten, res.Path)
	}
	return res, err
}
