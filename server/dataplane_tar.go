package server

import (
	"context"
	"errors"
	"io"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
)

// The tree operations (docs/dataplane.md): untar extracts a tar stream that arrives in upload
// frames, tar streams one out in download frames. Both go through the runtime handle's Files, so
// the traversal-safe layer (and the disk quota under it) applies to every entry.

// inStream is what the binary frames of a request in flight feed: a file upload or an untar.
type inStream interface {
	Write(p []byte) (int, error)
	// Abort drops the stream: nothing more is written.
	Abort() error
	// end is the stream's end frame: it finishes and answers the result, and the sandbox path of a
	// file written (for file_written), or "".
	end() (any, string, error)
}

// fileStream is an upload's inStream.
type fileStream struct{ sandbox.Upload }

func (f fileStream) end() (any, string, error) {
	res, err := f.Commit()
	if err != nil {
		return nil, "", err
	}
	return res, res.Path, nil
}

// untarStream feeds a tar stream to an extraction running in its own goroutine through a pipe with
// untarAhead bytes of buffer: the reader's Write returns once the bytes are buffered, so receiving
// the next frames overlaps writing files, a slow disk still slows the client (backpressure) and
// memory stays at the buffer.
type untarStream struct {
	c    *dpConn
	pw   *aheadPipe
	done chan struct{}
	res  protocol.TreeResult
	err  error
}

// errUntarAborted ends an extraction whose request was cancelled or whose connection ended.
var errUntarAborted = errors.New("untar aborted")

func (s *untarStream) Write(p []byte) (int, error) {
	n, err := s.pw.Write(p)
	if err != nil {
		<-s.done
		if s.err != nil {
			return n, s.err // why the extractor stopped reading: a refused entry, a full disk
		}
		return n, protocol.Errorf(protocol.CodeInvalidArgument, "data after the end of the tar archive")
	}
	return n, nil
}

func (s *untarStream) Abort() error {
	s.pw.AbortWrite(errUntarAborted)
	<-s.done
	return nil
}

func (s *untarStream) end() (any, string, error) {
	s.pw.CloseWrite()
	<-s.done
	if s.err != nil {
		return nil, "", s.err
	}
	s.c.emitSynced(s.res, "in")
	return s.res, "", nil
}

// emitSynced reports a tree copy on the sandbox's stream: one event per copy, not one per file.
func (c *dpConn) emitSynced(res protocol.TreeResult, direction string) {
	files, bytes := res.Files, res.Bytes
	c.s.events.Emit(c.org, protocol.Event{Type: protocol.EventSynced, SandboxID: c.rec.ID, Name: c.rec.Name, Actor: c.actor, JTI: c.jti(),
		Path: res.Path, Files: &files, Bytes: &bytes, Direction: direction})
}

// untarAhead is what an untar buffers between the connection and the extractor.
const untarAhead = 1 << 20

// opUntarOpen starts the extraction on the reader's goroutine, so that the binary frames that
// follow find it; the end frame answers it (binary).
func opUntarOpen(ctx context.Context, c *dpConn, r *request, a protocol.UntarArgs) (any, error) {
	pr := newAheadPipe(untarAhead)
	pw := pr
	s := &untarStream{c: c, pw: pw, done: make(chan struct{})}
	// The request's context ends when its end frame arrives (finish), before the extraction has
	// taken the last bytes: the pipe is what stops it instead (Abort closes it).
	ctx = context.WithoutCancel(ctx)
	go func() {
		defer close(s.done)
		s.res, s.err = c.files.Extract(ctx, a.Path, pr)
		if s.err == nil {
			// The archive's end-of-archive blocks and any padding after them are read and dropped,
			// so that the client's last frames never wait on a reader that is gone.
			_, err := io.Copy(io.Discard, pr)
			if errors.Is(err, errUntarAborted) {
				s.err = context.Canceled
			}
		} else if errors.Is(s.err, errUntarAborted) {
			s.err = context.Canceled
		}
		pr.CloseRead(errUntarAborted)
	}()
	c.mu.Lock()
	r.upload = s
	closing := c.closing
	c.mu.Unlock()
	if closing {
		s.Abort()
	}
	return nil, nil
}

// opTar streams the archive of a path in data frames, each counted against the connection's queue.
func opTar(ctx context.Context, c *dpConn, r *request, a protocol.TarArgs) (any, error) {
	fw := &frameWriter{c: c, id: r.id}
	res, err := c.files.Archive(ctx, a.Path, fw)
	if err == nil {
		err = fw.flush()
	}
	fw.drop()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	c.emitSynced(res, "out")
	return res, nil
}

// frameWriter turns a byte stream into data frames of up to dpChunkBytes, each charged against the
// connection's queue before it is filled, as a download's are.
type frameWriter struct {
	c  *dpConn
	id uint32
	bp *[]byte
	n  int // bytes of payload in *bp
}

const fullChunk = protocol.FrameHeaderLen + dpChunkBytes

// errConnEnding stops a writer whose connection is ending.
var errConnEnding = errors.New("the dataplane connection is ending")

func (w *frameWriter) Write(p []byte) (int, error) {
	written := 0
	for len(p) > 0 {
		if w.bp == nil {
			if !w.c.charge(fullChunk) {
				return written, errConnEnding
			}
			w.bp = chunkPool.Get().(*[]byte)
			w.n = 0
		}
		k := copy((*w.bp)[protocol.FrameHeaderLen+w.n:], p)
		w.n += k
		written += k
		p = p[k:]
		if w.n == dpChunkBytes {
			if err := w.flush(); err != nil {
				return written, err
			}
		}
	}
	return written, nil
}

// flush sends the chunk being filled, if any.
func (w *frameWriter) flush() error {
	if w.bp == nil {
		return nil
	}
	bp, n := w.bp, w.n
	w.bp = nil
	if n == 0 {
		w.c.uncharge(fullChunk)
		chunkPool.Put(bp)
		return nil
	}
	buf := *bp
	protocol.PutFrameHeader(buf, protocol.FrameData, w.id)
	if !w.c.enqueueCharged(outFrame{kind: websocket.BinaryMessage, data: buf[:protocol.FrameHeaderLen+n], n: fullChunk, release: func() { chunkPool.Put(bp) }}) {
		return errConnEnding
	}
	return nil
}

// drop gives back a chunk that will not be sent.
func (w *frameWriter) drop() {
	if w.bp != nil {
		w.c.uncharge(fullChunk)
		chunkPool.Put(w.bp)
		w.bp = nil
	}
}
