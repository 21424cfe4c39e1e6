package backend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// The operations whose bytes stream as data frames: Upload and Untar send a reader's, Download, Tar
// and TarFiles write theirs to a writer as they come. None is retried: by the time the connection
// breaks, the reader or the writer has been used in part. A writer's error cancels the transfer at
// the broker and is the call's error.

// Upload streams src into path (atomically replaced when the upload completes). The bytes go
// through the dataplane's upload door, an HTTP PUT beside the WebSocket with the same credential
// and checks (docs/dataplane.md, "Uploads over HTTP"): a WebSocket client must mask every byte it
// sends, which with the copies around it cost half the upload's speed.
func (r *Remote) Upload(ctx context.Context, p string, src io.Reader) (protocol.WriteResult, error) {
	var out protocol.WriteResult
	if err := validPaths(p); err != nil {
		return out, err
	}
	r.mu.Lock()
	closed, ended := r.closed, r.ended
	r.mu.Unlock()
	switch {
	case closed:
		return out, protocol.Errorf(protocol.CodeInvalidArgument, "the backend is closed")
	case ended != nil:
		return out, ended
	}
	u, err := uploadURL(r.cfg.URL, p)
	if err != nil {
		return out, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, u, uploadBody{ctx, src})
	if err != nil {
		return out, protocol.Errorf(protocol.CodeInvalidArgument, "upload: %v", err)
	}
	req.Header.Set("Authorization", "Bearer "+r.cfg.Credential)
	// A refusal (scope, path, credential) comes before any byte of the body is sent.
	req.Header.Set("Expect", "100-continue")
	resp, err := r.uploads.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return out, ctx.Err()
		}
		var pe *protocol.Error
		if errors.As(err, &pe) {
			return out, pe
		}
		return out, unreachable("the upload to %s failed: %v", protocol.RedactURL(r.cfg.URL), errors.Unwrap(err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var eb protocol.ErrorBody
		if json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&eb) == nil && eb.Error.Code != "" {
			eb.Error.Status = resp.StatusCode
			return out, &eb.Error
		}
		return out, unreachable("the upload was answered %s", resp.Status)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&out); err != nil {
		return out, unreachable("the upload's answer is not a result: %v", err)
	}
	return out, nil
}

// newUploadClient is a Remote's client for its uploads, bounded by its DialTimeout as its
// WebSocket's dial is. Its connections are kept between uploads and closed with the Remote; like
// the WebSocket's dialer it uses no proxy, and it speaks HTTP/1.1, whose body is the socket's bytes.
func newUploadClient(dialTimeout time.Duration) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:           (&net.Dialer{Timeout: dialTimeout}).DialContext,
		TLSHandshakeTimeout:   dialTimeout,
		ExpectContinueTimeout: dialTimeout,
		MaxIdleConnsPerHost:   4,
		IdleConnTimeout:       30 * time.Second,
	}}
}

// uploadURL is the upload door beside the dataplane URL dp (ws://host/v1/sandboxes/<id>/dataplane).
func uploadURL(dp, p string) (string, error) {
	u, err := url.Parse(dp)
	if err != nil {
		return "", protocol.Errorf(protocol.CodeInvalidArgument, "dataplane_url %q is not a URL", protocol.RedactURL(dp))
	}
	switch u.Scheme {
	case "ws":
		u.Scheme = "http"
	case "wss":
		u.Scheme = "https"
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + "/upload"
	u.RawPath = ""
	u.RawQuery = url.Values{"path": {p}}.Encode()
	return u.String(), nil
}

// uploadBody is an upload's source as a request body of unknown length, which the HTTP client
// sends chunked, one chunk per write of WriteTo: a source held in memory in one write, any other in
// writes of 1 MiB. (With a known length the client copies the body 32 KiB at a time.) A source's
// error fails the request before its last chunk, so the broker never commits a cut file; so does
// the call's cancellation, however the source ended.
type uploadBody struct {
	ctx context.Context
	src io.Reader
}

func (b uploadBody) Read(p []byte) (int, error) {
	n, err := b.src.Read(p)
	if err == io.EOF && b.ctx.Err() != nil {
		return n, b.ctx.Err()
	}
	return n, err
}

func (b uploadBody) WriteTo(w io.Writer) (int64, error) {
	switch s := b.src.(type) {
	case *bytes.Reader:
		return s.WriteTo(w)
	case *bytes.Buffer:
		return s.WriteTo(w)
	case *strings.Reader:
		return s.WriteTo(w)
	}
	bp := readBuffers.Get().(*[]byte)
	defer readBuffers.Put(bp)
	var n int64
	for {
		m, err := fill(b.src, *bp)
		if m > 0 {
			k, werr := w.Write((*bp)[:m])
			n += int64(k)
			if werr != nil {
				return n, werr
			}
		}
		if err == io.EOF && b.ctx.Err() != nil {
			return n, b.ctx.Err()
		}
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
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
