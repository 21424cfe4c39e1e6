package server

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"path"
	"strings"
	"unicode/utf8"

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

// untarBuffers is what an untar holds from its start to its end whatever the archive: the pipe's
// buffer and the extraction's copy buffer (tartree.Extract's 256 KiB).
const untarBuffers = untarAhead + 256<<10

// opUntarOpen starts the extraction on the reader's goroutine, so that the binary frames that
// follow find it; the end frame answers it (binary).
func opUntarOpen(ctx context.Context, c *dpConn, r *request, a protocol.UntarArgs) (any, error) {
	// The request's context ends when its end frame arrives (finish), before the extraction has
	// taken the last bytes: the pipe is what stops it instead (Abort closes it).
	ctx = context.WithoutCancel(ctx)
	// Its buffers and the names it remembers are drawn from the broker-wide budget until the
	// extraction ends, however it ends (its end frame, an abort, the connection's end all wait for
	// it). The buffers first, before they exist: a client may open max_inflight untars on each of
	// its connections and send them nothing.
	ctx, mem := c.meterOp(ctx, "")
	if err := mem.Grow(untarBuffers); err != nil {
		mem.free()
		return nil, err
	}
	mem.op = protocol.OpUntar // from here its refusal says what stays
	pr := newAheadPipe(untarAhead)
	pw := pr
	s := &untarStream{c: c, pw: pw, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		defer mem.free()
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
	if a.Paths != nil {
		return opTarFiles(ctx, c, r, a)
	}
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

// maxTarName bounds a name of a tar with paths, as untar bounds the names it accepts.
const maxTarName = 4096

// checkTarPaths refuses a batch whose names are not each a clean relative path, named once: a
// name is the entry's name in the archive, so it must be one the client can match to what it
// asked, and nothing that could climb out of the directory.
func checkTarPaths(paths []string) error {
	if len(paths) == 0 {
		return protocol.Errorf(protocol.CodeInvalidArgument, "paths is empty: name the files, or leave paths out to archive the whole path")
	}
	if len(paths) > protocol.MaxTarPaths {
		return protocol.Errorf(protocol.CodeInvalidArgument, "%d paths: at most %d in one tar", len(paths), protocol.MaxTarPaths)
	}
	seen := make(map[string]struct{}, len(paths))
	for _, p := range paths {
		switch {
		case p == "" || len(p) > maxTarName || !utf8.ValidString(p) || strings.ContainsRune(p, 0):
			return protocol.Errorf(protocol.CodeInvalidArgument, "paths: %.100q is not a name of 1 to %d bytes of UTF-8 without NUL", p, maxTarName)
		case strings.HasPrefix(p, "/") || path.Clean(p) != p || p == "." || p == ".." || strings.HasPrefix(p, "../"):
			return protocol.Errorf(protocol.CodeInvalidArgument, "paths: %.100q is not a clean path relative to path (no leading /, no . or .. components, no empty ones)", p)
		}
		if _, dup := seen[p]; dup {
			return protocol.Errorf(protocol.CodeInvalidArgument, "paths: %.100q is named twice", p)
		}
		seen[p] = struct{}{}
	}
	return nil
}

// ownError says whether err is a path's own refusal, which a batch reports for that path and goes
// on: what a download of the path alone answers for the path itself. Anything else (the sandbox
// stopping, a cancel, an internal fault) ends the batch.
func ownError(err error) (*protocol.Error, bool) {
	var pe *protocol.Error
	if !errors.As(err, &pe) {
		return nil, false
	}
	switch pe.Code {
	case protocol.CodeFileNotFound, protocol.CodeIsDirectory, protocol.CodeNotDirectory, protocol.CodePermissionDenied,
		protocol.CodeInvalidPath, protocol.CodeInvalidArgument:
		return pe, true
	}
	return nil, false
}

// opTarFiles is a tar with paths: a batch of downloads in one stream. Each file is opened as a
// download opens it (a symlink inside the workspace is followed) and written as one regular-file
// entry named as asked, its size the open file's; a path a download refuses is listed in the
// result's errors instead. A file that changes size while it is read ends the request, since its
// entry's header is already sent.
func opTarFiles(ctx context.Context, c *dpConn, r *request, a protocol.TarArgs) (any, error) {
	if err := checkTarPaths(a.Paths); err != nil {
		return nil, err
	}
	dir, err := c.files.Stat(a.Path)
	if err != nil {
		return nil, err
	}
	if dir.Type != "dir" {
		return nil, protocol.Errorf(protocol.CodeNotDirectory, "%s is not a directory: a tar with paths names files inside a directory", dir.Path)
	}
	fw := &frameWriter{c: c, id: r.id}
	defer fw.drop()
	tw := tar.NewWriter(fw)
	res := protocol.TreeResult{Path: dir.Path}
	for _, p := range a.Paths {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n, err := tarFile(tw, c, path.Join(dir.Path, p), p)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if pe, own := ownError(err); own && n < 0 {
				res.Errors = append(res.Errors, protocol.PathError{Path: p, Code: pe.Code, Message: pe.Message})
				continue
			}
			return nil, err
		}
		res.Files++
		res.Bytes += n
	}
	err = tw.Close()
	if err == nil {
		err = fw.flush()
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	c.emitSynced(res, "out")
	return res, nil
}

// tarFile writes the file at sandbox path sp as the entry name; n is -1 when nothing was written
// (the open failed), so that the batch can go on.
func tarFile(tw *tar.Writer, c *dpConn, sp, name string) (int64, error) {
	f, info, err := c.files.OpenRead(sp)
	if err != nil {
		return -1, err
	}
	defer f.Close()
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: name, Size: info.Size, Mode: int64(info.Mode & 0o7777), ModTime: info.ModTime, Format: tar.FormatPAX}
	if err := tw.WriteHeader(hdr); err != nil {
		return 0, err
	}
	n, err := io.CopyN(tw, f, info.Size)
	if errors.Is(err, io.EOF) {
		return n, protocol.Errorf(protocol.CodeInvalidArgument, "%s shrank while it was read; download it alone", info.Path)
	}
	if err != nil {
		return n, err
	}
	// A file that grew is as much a change: its entry holds the size it had when it was opened.
	var one [1]byte
	if k, _ := f.Read(one[:]); k > 0 {
		return n, protocol.Errorf(protocol.CodeInvalidArgument, "%s grew while it was read; download it alone", info.Path)
	}
	return n, nil
}
