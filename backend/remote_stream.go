package backend

import (
	"context"
	"encoding/json"
	"io"

	"github.com/sbxbroker/broker/protocol"
)

// The operations whose bytes stream as data frames: Upload and Untar send a reader's, Download, Tar
// and TarFiles write theirs to a writer as they come. None is retried: by the time the connection
// breaks, the reader or the writer has been used in part.

// Upload streams r into path (atomically replaced when the upload completes).
func (r *Remote) Upload(ctx context.Context, p string, src io.Reader) (protocol.WriteResult, error) {
	if err := validPaths(p); err != nil {
		return protocol.WriteResult{}, err
	}
	c, err := r.connection(ctx)
	if err != nil {
		return protocol.WriteResult{}, err
	}
	cl := &call{}
	var out protocol.WriteResult
	if err := c.roundTrip(ctx, protocol.OpUpload, protocol.UploadArgs{Path: p}, cl, src); err != nil {
		return out, err
	}
	return out, json.Unmarshal(cl.result, &out)
}

// Download streams path's bytes into w.
func (r *Remote) Download(ctx context.Context, p string, w io.Writer) (int64, error) {
	if err := validPaths(p); err != nil {
		return 0, err
	}
	c, err := r.connection(ctx)
	if err != nil {
		return 0, err
	}
	cw := &countingWriter{w: w}
	cl := &call{data: cw}
	if err := c.roundTrip(ctx, protocol.OpDownload, protocol.DownloadArgs{Path: p}, cl, nil); err != nil {
		return cw.n, err
	}
	return cw.n, nil
}

// Untar streams the tar archive src into the directory dir (created if missing) in one round trip:
// the broker extracts it with its traversal-safe file layer, keeping modes, mtimes and symlinks, and
// refuses a hostile archive (absolute or ".." names, links leaving the tree, devices, FIFOs) without
// changing anything outside dir. It needs the fs:write scope.
func (r *Remote) Untar(ctx context.Context, dir string, src io.Reader) (protocol.TreeResult, error) {
	var out protocol.TreeResult
	if err := validPaths(dir); err != nil {
		return out, err
	}
	c, err := r.connection(ctx)
	if err != nil {
		return out, err
	}
	cl := &call{}
	if err := c.roundTrip(ctx, protocol.OpUntar, protocol.UntarArgs{Path: dir}, cl, src); err != nil {
		return out, err
	}
	return out, json.Unmarshal(cl.result, &out)
}

// Tar streams p (a file, a symlink, or a directory and everything below it) into w as an
// uncompressed tar archive whose names start at p's base name, in one round trip. Symlinks are
// archived as symlinks. It needs the fs:read scope.
func (r *Remote) Tar(ctx context.Context, p string, w io.Writer) (protocol.TreeResult, error) {
	var out protocol.TreeResult
	if err := validPaths(p); err != nil {
		return out, err
	}
	c, err := r.connection(ctx)
	if err != nil {
		return out, err
	}
	cl := &call{data: w}
	if err := c.roundTrip(ctx, protocol.OpTar, protocol.TarArgs{Path: p}, cl, nil); err != nil {
		return out, err
	}
	return out, json.Unmarshal(cl.result, &out)
}

// TarFiles streams the regular files names (relative to the directory dir) into w as one
// uncompressed tar archive, in one round trip: a batch of downloads. Each entry is named exactly as
// asked and holds what Download would give; a name Download would refuse (missing, a directory,
// not readable, leading out of the workspace) has no entry and is listed in the result's Errors
// with that error instead. It needs the fs:read scope, and a broker that knows TarArgs.Paths.
func (r *Remote) TarFiles(ctx context.Context, dir string, names []string, w io.Writer) (protocol.TreeResult, error) {
	var out protocol.TreeResult
	if len(names) == 0 {
		return out, protocol.Errorf(protocol.CodeInvalidArgument, "no files named")
	}
	if err := validPaths(append([]string{dir}, names...)...); err != nil {
		return out, err
	}
	c, err := r.connection(ctx)
	if err != nil {
		return out, err
	}
	cl := &call{data: w}
	if err := c.roundTrip(ctx, protocol.OpTar, protocol.TarArgs{Path: dir, Paths: names}, cl, nil); err != nil {
		return out, err
	}
	return out, json.Unmarshal(cl.result, &out)
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
