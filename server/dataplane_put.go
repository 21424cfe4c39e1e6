package server

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/gorilla/websocket"
	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/protocol"
)

// The dataplane's upload door: PUT /v1/sandboxes/{ref}/dataplane/upload?path=P[&mode=M], the
// upload operation with the file's bytes as the request's body (docs/dataplane.md, "Uploads over
// HTTP"). It exists for speed: a WebSocket client must mask every byte it sends (RFC 6455) and
// gorilla copies each frame to do so, and the broker unmasks them; here the body goes from the
// socket into the file with one read and one write per MiB, as raw TCP into a file does.
//
// It is the dataplane's upload, not a second implementation of it: the request is a dataplane
// connection that lives as long as the upload (the upgrade's checks in authorizeConn: credential,
// rate, connection caps, the running sandbox; a place in the hub, so revocation, expiry, the
// sandbox stopping and broker shutdown abort it), and one upload request on it (admit: scope,
// in-flight bounds; opUploadOpen: paths, modes and the workspace's own limits, its disk quota
// among them; the end frame's commit and file_written).

// dpDrainFor bounds how long an upload refused midway (its disk quota full) takes the rest of its
// body before answering.
const dpDrainFor = 30 * time.Second

// putConn and putAgain name the door's connection and what to do when it ends (endedErr).
const putConn, putAgain = "the upload's connection", "send the upload again"

// uploadRoute is the door's route.
const uploadRoute = "/v1/sandboxes/:ref/dataplane/upload"

// uploadID is the one request id of a door's connection.
const uploadID = 1

// putBuffers hold an upload's bytes between the request body and the file.
var putBuffers = sync.Pool{New: func() any { b := make([]byte, dpChunkBytes); return &b }}

// errBodyCut ends an upload whose body ended before its Content-Length, or broke.
var errBodyCut = protocol.Errorf(protocol.CodeInvalidArgument, "the upload's body was cut short: nothing was written; send it again")

// uploadPut serves the door: an upgrade's checks, then one upload request fed by the body.
func (s *Server) uploadPut(c echo.Context) error {
	r := c.Request()
	release, err := s.reserveConnection(c)
	if err != nil {
		return err
	}
	defer release()
	if err := s.checkOrigin(r); err != nil {
		return err
	}
	cred := bearer(r)
	if cred == "" {
		return errNoCredentials
	}
	q := r.URL.Query()
	path, mode := q.Get("path"), q.Get("mode")
	// JSON would turn invalid UTF-8 into U+FFFD, and name another file.
	if !utf8.ValidString(path) || !utf8.ValidString(mode) {
		return protocol.Errorf(protocol.CodeInvalidPath, "the path and the mode must be valid UTF-8")
	}
	args, err := json.Marshal(protocol.UploadArgs{Path: path, Mode: mode})
	if err != nil {
		return protocol.Errorf(protocol.CodeInvalidArgument, "invalid path or mode: %v", err)
	}
	conn, releaseShare, err := s.authorizeConn(r.Context(), cred, c.Param("ref"), c.Response().Header())
	if conn != nil {
		c.Set(ctxSandbox, conn.rec)
	}
	if err != nil {
		return err
	}
	defer releaseShare()
	// The access log names the credential, as the WebSocket's connection log does. An owner's key
	// as its principal: a 401 from here on (the key revoked while the body comes) is not a guess
	// (guardAuth).
	if conn.claims == nil {
		c.Set(ctxPrincipal, Principal{Org: conn.org, KeyID: conn.keyID})
	} else {
		c.Set(ctxJTI, conn.claims.ID)
	}
	_, unregister := conn.open(requestID(c))
	defer func() {
		conn.shutdown(websocket.CloseNormalClosure, "")
		conn.running.Wait()
		unregister()
	}()

	o, ctx, req, refusal := conn.admit(uploadID, protocol.OpUpload)
	if refusal != nil {
		if refusal.Error != nil {
			return refusal.Error
		}
		return conn.endedErr(putConn, putAgain)
	}
	if _, err := o.run(ctx, conn, req, args); err != nil {
		conn.finish(uploadID)
		return err
	}
	res, err := conn.receive(ctx, req, c.Response(), r.Body)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, res)
}

// receive copies body into req's upload and commits it. Whatever ends the connection (a
// revocation, the sandbox stopping, shutdown) aborts the upload and unblocks the body's read.
func (c *dpConn) receive(ctx context.Context, req *request, w http.ResponseWriter, body io.Reader) (any, error) {
	rc := http.NewResponseController(w)
	// Only while the body is read: once it has ended, the server reads ahead on the connection
	// for the next request, which a deadline in the past would break.
	stop := context.AfterFunc(ctx, func() { rc.SetReadDeadline(time.Now()) })
	defer stop()
	bp := putBuffers.Get().(*[]byte)
	defer putBuffers.Put(bp)
	buf := *bp
	fail := func(err error) (any, error) {
		stop()
		ended := ctx.Err() != nil
		c.finish(uploadID)
		req.upload.Abort()
		if ended {
			return nil, c.endedErr(putConn, putAgain)
		}
		return nil, err
	}
	idle := c.s.uploadIdle
	in := idleBody{ctx: ctx, body: body, rc: rc, idle: idle}
	for {
		n, err := fill(in, buf)
		if ctx.Err() != nil {
			return fail(ctx.Err())
		}
		if n > 0 {
			if _, werr := req.upload.Write(buf[:n]); werr != nil {
				res, err := fail(werr)
				if err == werr { // not ended by a revocation, the sandbox stopping, shutdown
					// The client is still sending: an answer sent now would be lost to the reset
					// that closing on its unread bytes causes. Take the rest (for a while), then
					// answer.
					rc.SetReadDeadline(time.Now().Add(dpDrainFor))
					io.CopyBuffer(io.Discard, struct{ io.Reader }{body}, buf)
				}
				return res, err
			}
		}
		if err == io.EOF {
			if !stop() {
				// Ended as the body did: the deadline it sets could land on the connection's next
				// request, and the upload was aborted or is being.
				return fail(ctx.Err())
			}
			break
		}
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return fail(protocol.Errorf(protocol.CodeInvalidArgument, "the upload's body sent nothing for %s: nothing was written", idle))
			}
			return fail(errBodyCut)
		}
	}
	c.finish(uploadID)
	res, written, err := req.upload.end()
	if err != nil {
		if c.ctx.Err() != nil { // shutdown aborted it before it could commit: say why
			return nil, c.endedErr(putConn, putAgain)
		}
		return nil, err
	}
	if written != "" {
		c.emitPath(protocol.EventFileWritten, written)
	}
	return res, nil
}

// idleBody is an upload's body read with an idle deadline, not a rate: a client may take as long
// as it likes to send, as long as it never stays silent for idle, as a WebSocket peer may not.
// (A deadline per buffer of 1 MiB would cut off any link slower than 14 KB/s.)
type idleBody struct {
	ctx  context.Context
	body io.Reader
	rc   *http.ResponseController
	idle time.Duration
}

func (b idleBody) Read(p []byte) (int, error) {
	b.rc.SetReadDeadline(time.Now().Add(b.idle))
	// Checked after the deadline is set: a cancellation from now on sets its own, in the past,
	// after this one; one before it would otherwise be overwritten and wait out the idle time.
	if err := b.ctx.Err(); err != nil {
		return 0, err
	}
	return b.body.Read(p)
}

// refuseBody readies the answer to a refused upload (errorHandler), whose body may still be coming:
// net/http would read up to 256 KiB more of it before writing the answer, with no deadline, so a
// client that sends slowly, or nothing more, would get no answer and hold the connection. The
// answer goes at once and the connection closes after it; the rest of the body is read meanwhile
// (up to 256 KiB, for dpDrainFor at most), so that a client still sending gets the answer, not a
// reset.
func refuseBody(c echo.Context) {
	c.Response().Header().Set(echo.HeaderConnection, "close")
	http.NewResponseController(c.Response()).SetReadDeadline(time.Now().Add(dpDrainFor))
}

// fill reads r into p until p is full or r ends (io.EOF). Unlike io.ReadFull it passes r's own
// errors through: a body cut short (io.ErrUnexpectedEOF) is a failed upload, never its end.
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

// endedErr is why the connection ended (it has, or is ending): the reason shutdown was given.
// what names the connection and again says what to do next, for the ends that are not final.
func (c *dpConn) endedErr(what, again string) *protocol.Error {
	c.mu.Lock()
	code, reason := c.endCode, c.endReason
	c.mu.Unlock()
	switch code {
	case protocol.CloseCredentialEnded, protocol.CloseSandboxGone:
		return &protocol.Error{Code: reason, Message: endMessage(reason)}
	case websocket.CloseGoingAway:
		return protocol.Errorf(protocol.CodeUnavailable, "the broker is shutting down: %s (the sandbox's broker will be back)", again)
	}
	return protocol.Errorf(protocol.CodeUnavailable, "%s was closed: %s", what, again)
}
