package server

import (
	"context"
	"io"
	"sync"

	"github.com/gorilla/websocket"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
)

// The file operations' handlers (dpOps). They run on the sandbox's workspace through its
// traversal-safe API; those that change files emit the owner's events.

func opEnv(_ context.Context, c *dpConn, _ *request, _ struct{}) (any, error) {
	return protocol.EnvResult{Env: c.rt.Environment()}, nil
}

func opStat(_ context.Context, c *dpConn, _ *request, a protocol.StatArgs) (any, error) {
	return c.files.Stat(a.Path)
}

func opLs(ctx context.Context, c *dpConn, _ *request, a protocol.LsArgs) (any, error) {
	res, err := c.files.ListContext(ctx, a.Path)
	if res.Entries == nil {
		res.Entries = []protocol.FileInfo{}
	}
	return res, err
}

func opGlob(ctx context.Context, c *dpConn, _ *request, a protocol.GlobArgs) (any, error) {
	return c.files.GlobContext(ctx, a)
}

func opGrep(ctx context.Context, c *dpConn, _ *request, a protocol.GrepArgs) (any, error) {
	return c.files.Grep(ctx, a)
}

func opEdit(ctx context.Context, c *dpConn, _ *request, a protocol.EditArgs) (any, error) {
	res, err := c.files.EditContext(ctx, a)
	if err == nil {
		c.emitPath(protocol.EventFileWritten, res.Path)
	}
	return res, err
}

func opDelete(_ context.Context, c *dpConn, _ *request, a protocol.DeleteArgs) (any, error) {
	if err := c.files.Delete(a); err != nil {
		return nil, err
	}
	p := sandbox.CleanPath(a.Path)
	c.emitPath(protocol.EventFileDeleted, p)
	return protocol.PathResult{Path: p}, nil
}

func opMkdir(_ context.Context, c *dpConn, _ *request, a protocol.MkdirArgs) (any, error) {
	if err := c.files.Mkdir(a); err != nil {
		return nil, err
	}
	return protocol.PathResult{Path: sandbox.CleanPath(a.Path)}, nil
}

func opMove(_ context.Context, c *dpConn, _ *request, a protocol.MoveArgs) (any, error) {
	if err := c.files.Move(a); err != nil {
		return nil, err
	}
	c.emitPath(protocol.EventFileDeleted, sandbox.CleanPath(a.From))
	c.emitPath(protocol.EventFileWritten, sandbox.CleanPath(a.To))
	return protocol.PathResult{Path: sandbox.CleanPath(a.To)}, nil
}

// opUploadOpen creates the upload's file on the reader's goroutine; the binary frames that follow
// feed it, and its end frame commits it (binary).
func opUploadOpen(_ context.Context, c *dpConn, r *request, a protocol.UploadArgs) (any, error) {
	up, err := c.files.Create(a.Path, a.Mode)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	r.upload = fileStream{up}
	closing := c.closing
	c.mu.Unlock()
	if closing {
		// shutdown ran while the file was being created and could not abort it.
		up.Abort()
	}
	return nil, nil
}

// chunkPool holds download buffers: a frame header followed by one chunk.
var chunkPool = sync.Pool{New: func() any { b := make([]byte, protocol.FrameHeaderLen+dpChunkBytes); return &b }}

// opDownload streams a file in data frames, each counted against the connection's queue. It sends
// at most the size the file had when opened: a process in the sandbox appending as fast as the
// file is read would otherwise make the download endless.
func opDownload(ctx context.Context, c *dpConn, r *request, a protocol.DownloadArgs) (any, error) {
	rc, info, err := c.files.OpenRead(a.Path)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	f := io.LimitReader(rc, info.Size)
	var size int64
	for {
		// The chunk is counted against the connection's queue from before it is filled: a client
		// that does not read holds no chunk that is not counted.
		const chunk = protocol.FrameHeaderLen + dpChunkBytes
		if !c.charge(chunk) {
			return nil, context.Canceled
		}
		bp := chunkPool.Get().(*[]byte)
		buf := *bp
		n, err := io.ReadFull(f, buf[protocol.FrameHeaderLen:])
		if n > 0 {
			protocol.PutFrameHeader(buf, protocol.FrameData, r.id)
			size += int64(n)
			if !c.enqueueCharged(outFrame{kind: websocket.BinaryMessage, data: buf[:protocol.FrameHeaderLen+n], n: chunk, release: func() { chunkPool.Put(bp) }}) {
				return nil, context.Canceled
			}
		} else {
			c.uncharge(chunk)
			chunkPool.Put(bp)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return protocol.DownloadResult{Path: info.Path, Size: size}, nil
		}
		if err != nil {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
}
