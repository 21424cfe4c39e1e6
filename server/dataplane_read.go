package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"runtime/debug"
	"unicode/utf8"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
)

// A dataplane connection's reading side: frames in, requests parsed and dispatched (which runs them,
// on the reader's goroutine or on their own), and the binary frames of uploads in flight.

// readerState is what the connection's reader reuses from frame to frame.
type readerState struct {
	text   bytes.Buffer
	chunk  []byte
	header []byte
}

// wireRequest is a client text frame with its args still raw.
type wireRequest struct {
	ID   *uint32         `json:"id"`
	Op   string          `json:"op"`
	Args json.RawMessage `json:"args"`
}

// readLoop reads frames until the connection ends, or until a request it runs moves the reading to
// another goroutine (dispatch answers moved), which then runs readLoop.
func (c *dpConn) readLoop() {
	moved := false
	defer func() {
		// The reader's own code (frames, dispatch, an op's prepare or control) failing must end
		// this connection, not the broker: a reader that took over from an exec runs on a
		// goroutine no HTTP middleware's recover reaches. (Ops themselves recover: dpConn.run.)
		if p := recover(); p != nil {
			c.s.log.Error("dataplane reader panic: the connection is closed", "sandbox_id", c.rec.ID, "panic", p, "stack", string(debug.Stack()))
			c.shutdown(websocket.CloseInternalServerErr, "internal error")
		}
		if !moved {
			close(c.readerDone)
		}
	}()
	text, chunk, header := &c.rd.text, c.rd.chunk, c.rd.header
	for {
		mt, r, err := c.conn.NextReader()
		if err != nil {
			if errors.Is(err, websocket.ErrReadLimit) {
				c.shutdown(websocket.CloseMessageTooBig, "frame over max_frame_bytes")
			}
			return
		}
		if mt == websocket.BinaryMessage {
			if _, err := io.ReadFull(r, header); err != nil {
				c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "%v", protocol.ErrShortFrame)})
				continue
			}
			hdrID := uint32(header[1])<<24 | uint32(header[2])<<16 | uint32(header[3])<<8 | uint32(header[4])
			if header[0] != protocol.FrameRequestBody {
				c.binary(header[0], hdrID, r, chunk)
				continue
			}
			payload, put, err := readBodyFrame(r)
			if err != nil {
				continue // the connection's error: NextReader reports it
			}
			id, op, args, body, perr := bodyRequest(hdrID, payload)
			if perr != nil {
				put()
				c.send(protocol.Response{Error: perr})
				continue
			}
			if moved = c.dispatch(id, op, args, body, put); moved {
				return
			}
			continue
		}
		text.Reset()
		if _, err := text.ReadFrom(r); err != nil {
			return
		}
		id, op, args, ok := parseRequest(text.Bytes())
		if !ok {
			c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidJSON, "a request is a JSON object {\"id\": <uint32>, \"op\": <string>, \"args\": {...}} in valid UTF-8, and nothing else")})
			continue
		}
		args = bytes.Clone(args) // text is reused for the next frame; the request outlives it
		if moved = c.dispatch(id, op, args, nil, nil); moved {
			return
		}
	}
}

// parseRequest reads a request object. The canonical form is split without decoding; its args are
// decoded once, strictly, by the operation. Any other form goes through the full decoder. args
// may point into b.
func parseRequest(b []byte) (id uint32, op string, args json.RawMessage, ok bool) {
	// RFC 6455 text frames are UTF-8; decoding would silently turn invalid bytes (in a path, say)
	// into U+FFFD, so refuse them instead.
	if !utf8.Valid(b) {
		return 0, "", nil, false
	}
	if id, op, args, ok := protocol.SplitRequest(b); ok {
		return id, op, args, true
	}
	var req wireRequest
	if err := decodeStrict(b, &req); err != nil || req.ID == nil || req.Op == "" {
		return 0, "", nil, false
	}
	return *req.ID, req.Op, req.Args, true
}

// binary routes a binary frame: only upload data and upload end go client -> server.
func (c *dpConn) binary(kind byte, id uint32, payload io.Reader, chunk []byte) {
	c.mu.Lock()
	req := c.inflight[id]
	c.mu.Unlock()
	if req != nil && req.shell != nil && (kind == protocol.FrameData || kind == protocol.FrameEnd) {
		c.shellInput(req.shell, kind, payload)
		return
	}
	if req == nil || req.upload == nil || (kind != protocol.FrameData && kind != protocol.FrameEnd) {
		io.Copy(io.Discard, payload)
		// Answered with id 0: request id may be in flight, and its one answer is still to come.
		c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "binary frame of kind %d for request %d, which is not an upload or a shell in progress", kind, id)})
		return
	}
	if kind == protocol.FrameData {
		for {
			n, err := io.ReadFull(payload, chunk)
			if n > 0 {
				if _, werr := req.upload.Write(chunk[:n]); werr != nil {
					c.finish(id)
					req.upload.Abort()
					c.fail(id, werr)
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	c.finish(id)
	res, written, err := req.upload.end()
	if err != nil {
		c.fail(id, err)
		return
	}
	if written != "" {
		c.emitPath(protocol.EventFileWritten, written)
	}
	c.send(protocol.Response{ID: id, Result: res})
}

// dispatch starts request id: the op table says whether the credential may run it and how it runs.
// body is the content of a request that came in a FrameRequestBody (nil for a text frame); put,
// when set, gives its buffer back, which happens on every path once nothing reads body any more.
// It answers moved when the request it ran took the calling goroutine, the reader, and the reading
// went on in another goroutine: the caller then stops reading.
func (c *dpConn) dispatch(id uint32, op string, args json.RawMessage, body []byte, put func()) (moved bool) {
	if c.s.readerHook != nil {
		c.s.readerHook(op)
	}
	if put == nil {
		put = func() {}
	}
	if id == 0 && op != protocol.OpCancel { // a cancel is never answered, whatever its id
		put()
		c.send(protocol.Response{Error: protocol.Errorf(protocol.CodeInvalidArgument, "request id 0 is reserved for errors not tied to a request; use 1 or more")})
		return false
	}
	if o, known := dpOps[op]; known {
		if withBody := body != nil; withBody != o.bodyIn {
			put()
			answerID := id
			if op == protocol.OpCancel {
				answerID = 0 // a cancel is never answered: its id names the request it cancels
			}
			if withBody {
				c.send(protocol.Response{ID: answerID, Error: protocol.Errorf(protocol.CodeInvalidArgument, "%s takes no body: send it as a text frame (binary frames of kind %d are for write); nothing was done", clipHeader(op), protocol.FrameRequestBody)})
			} else {
				c.send(protocol.Response{ID: answerID, Error: protocol.Errorf(protocol.CodeInvalidArgument, "%s carries its content as the body of a binary frame of kind %d, not in a text frame (%s, docs/dataplane.md); nothing was done", op, protocol.FrameRequestBody, protocol.Subprotocol)})
			}
			return false
		}
	}
	o, ctx, req, refusal := c.admit(id, op)
	switch {
	case refusal != nil:
		put()
		if refusal.Error != nil {
			c.send(*refusal)
		}
		return false
	case o.class == opInline:
		if o.control != nil {
			o.control(c, id, args)
		} else {
			o.inline(c, id)
		}
		return false
	}
	req.body = body

	if o.class == opUpload {
		_, err := o.run(ctx, c, req, args)
		put()
		if err != nil {
			c.finish(id)
			c.fail(id, err)
		}
		return false
	}
	c.running.Add(1)
	if o.startsOnReader {
		// Run here until the command is on its way to the sandbox (sandbox.ExecRequest.Started),
		// then let a new goroutine read on while this one waits for the command: the request
		// reaches the sandbox without a hand-off to another goroutine first (and a wakeup of
		// another thread to run it), and the new reader's start overlaps the command's.
		req.started = func() {
			moved = true
			go c.readLoop()
		}
		c.perform(ctx, req, o, args, put, true)
		return moved
	}
	if c.onReader(o, args) && c.perform(ctx, req, o, args, put, false) {
		return false
	}
	go c.perform(ctx, req, o, args, put, true)
	return false
}

// onReader says whether op o may run on the reader's goroutine: a one-file operation on local
// files, when no other request is in flight. Handing it to a goroutine of its own would wake
// another thread to take it (the Go scheduler does, to spread new goroutines), and each wakeup of
// an idle CPU costs more than the operation on a virtual machine; run here, a lone client's write
// or read costs one wakeup less each. Nothing waits behind it: requests sent meanwhile are read
// when it ends, well under a millisecond later. A deep path is not bounded work: creating its
// missing parents (mkdir, a move's or a write's destination) makes a directory per level, half a
// second of the kernel's mkdirs for the 2,000 levels 4096 bytes allow, which would hold up the
// connection's pings and cancels; such an op runs on its own goroutine.
func (c *dpConn) onReader(o dpOp, args json.RawMessage) bool {
	if !o.oneFile || !c.rt.LocalFiles || o.makesParents && pathSeparators(args) > dpReaderPathDepth {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.inflight) == 1
}

// dpReaderPathDepth bounds the path separators in the args of an op that creates parents, run on
// the reader.
const dpReaderPathDepth = 64

// pathSeparators counts what may be a path separator in raw JSON args: a '/' or any escape (a
// separator can be written "\/" or "\u002f"), without decoding them.
func pathSeparators(args json.RawMessage) int {
	return bytes.Count(args, []byte{'/'}) + bytes.Count(args, []byte{'\\'})
}
