package backend

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
	"unsafe"

	"github.com/sbxbroker/broker/protocol"
)

// The dataplane's operations (docs/dataplane.md), one method each, but for those that stream a file's
// or a tree's bytes (remote_stream.go) and the shell (shell.go). Each is one round trip on the
// connection (conn.roundTrip, remote.go); those safe to repeat are retried once on a fresh connection
// when the old one broke under them. Paths are checked before they are sent (validPaths).

// validPaths refuses paths that JSON cannot carry: encoding would silently turn invalid UTF-8 into
// U+FFFD and name another file.
func validPaths(paths ...string) error {
	for _, p := range paths {
		if !utf8.ValidString(p) {
			return protocol.Errorf(protocol.CodeInvalidPath, "path %q is not valid UTF-8", p)
		}
	}
	return nil
}

// call runs op and decodes its result into out. Requests safe to repeat are retried once on a new
// connection when the old one broke under them.
func (r *Remote) call(ctx context.Context, op string, args, out any, retry bool) error {
	_, err := r.callBody(ctx, op, args, out, retry, nil)
	return err
}

// callBody is call for a request that may carry a body (in) and an answer that may carry one (the
// []byte returned).
func (r *Remote) callBody(ctx context.Context, op string, args, out any, retry bool, in *string) ([]byte, error) {
	cl, err := r.callRaw(ctx, op, args, retry, in)
	if err != nil {
		return nil, err
	}
	if out != nil && len(cl.result) > 0 && !protocol.DecodeFlat(cl.result, out) {
		if err := json.Unmarshal(cl.result, out); err != nil {
			return nil, fmt.Errorf("dataplane answered %s with an unexpected result: %w", op, err)
		}
	}
	return cl.body, nil
}

// callRaw runs op and returns its answer as it came, undecoded. With retry (the request is safe to
// repeat) it is sent once more on a new connection when the old one broke under it.
func (r *Remote) callRaw(ctx context.Context, op string, args any, retry bool, in *string) (*call, error) {
	for attempt := 0; ; attempt++ {
		c, err := r.connection(ctx)
		if err != nil {
			return nil, err
		}
		cl := &call{}
		if in != nil {
			cl.in, cl.hasIn = *in, true
		}
		err = c.roundTrip(ctx, op, args, cl, nil)
		var pe *protocol.Error
		if err != nil && retry && attempt == 0 && errors.As(err, &pe) && pe.Code == protocol.CodeUnreachable {
			continue
		}
		if err != nil {
			return nil, err
		}
		return cl, nil
	}
}

// read runs a read: its answer's body is the content, raw.
func (r *Remote) read(ctx context.Context, a protocol.ReadArgs) (protocol.ReadResult, error) {
	var head protocol.ReadHead
	body, err := r.callBody(ctx, protocol.OpRead, a, &head, true, nil)
	if err != nil {
		return protocol.ReadResult{}, err
	}
	// body is this call's alone and never changes: the string shares its memory instead of copying
	// the content a second time.
	return head.Result(unsafe.String(unsafe.SliceData(body), len(body))), nil
}

// write runs a write: its content goes as the request frame's body.
func (r *Remote) write(ctx context.Context, a protocol.WriteArgs) (protocol.WriteResult, error) {
	var out protocol.WriteResult
	head, content, err := a.Body()
	if err != nil {
		return out, err
	}
	// An overwrite of the same bytes is safe to repeat; a create-only write is not.
	_, err = r.callBody(ctx, protocol.OpWrite, head, &out, a.Mode != protocol.WriteCreate, &content)
	return out, err
}

// Call runs one dataplane operation with args and returns its result exactly as the broker sent it,
// for front ends that pass results through unchanged (the MCP server). Operations that only read
// are retried once on a fresh connection when the old one broke under them, as the typed methods
// do; others fail with KindUnreachable. Upload and download, which stream, are not for Call.
func (r *Remote) Call(ctx context.Context, op string, args any) (json.RawMessage, error) {
	var retry bool
	switch op {
	case protocol.OpStat, protocol.OpLs, protocol.OpRead, protocol.OpGlob, protocol.OpGrep, protocol.OpEnv, protocol.OpPing:
		retry = true
	case protocol.OpUpload, protocol.OpDownload, protocol.OpUntar, protocol.OpTar:
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "%s streams its bytes: use Upload or Download", op)
	}
	// read and write carry their content as frame bodies; Call answers them as JSON all the same.
	switch op {
	case protocol.OpRead, protocol.OpWrite:
		var res any
		var err error
		switch a := args.(type) {
		case protocol.ReadArgs:
			res, err = r.Read(ctx, a)
		case protocol.WriteArgs:
			res, err = r.Write(ctx, a)
		default:
			return nil, protocol.Errorf(protocol.CodeInvalidArgument, "Call(%s) takes protocol.%sArgs, not %T", op, map[string]string{protocol.OpRead: "Read", protocol.OpWrite: "Write"}[op], args)
		}
		if err != nil {
			return nil, err
		}
		return json.Marshal(res)
	}
	cl, err := r.callRaw(ctx, op, args, retry, nil)
	if err != nil {
		return nil, err
	}
	return cl.result, nil
}

// Ping measures a round trip.
func (r *Remote) Ping(ctx context.Context) error { return r.call(ctx, protocol.OpPing, nil, nil, true) }

// Stat describes the file at p (the stat operation); retried once when the connection broke.
func (r *Remote) Stat(ctx context.Context, p string) (protocol.FileInfo, error) {
	var out protocol.FileInfo
	if err := validPaths(p); err != nil {
		return out, err
	}
	return out, r.call(ctx, protocol.OpStat, protocol.StatArgs{Path: p}, &out, true)
}

// Ls lists the directory p; retried once when the connection broke.
func (r *Remote) Ls(ctx context.Context, p string) ([]protocol.FileInfo, error) {
	var out protocol.LsResult
	if err := validPaths(p); err != nil {
		return nil, err
	}
	err := r.call(ctx, protocol.OpLs, protocol.LsArgs{Path: p}, &out, true)
	return out.Entries, err
}

// Read reads a file, its content carried raw as the answer's body; retried once when the
// connection broke.
func (r *Remote) Read(ctx context.Context, a protocol.ReadArgs) (protocol.ReadResult, error) {
	if err := validPaths(a.Path); err != nil {
		return protocol.ReadResult{}, err
	}
	return r.read(ctx, a)
}

// Write writes a file, its content carried raw as the request's body. An overwrite is retried once
// when the connection broke; a create-only write (protocol.WriteCreate) is not.
func (r *Remote) Write(ctx context.Context, a protocol.WriteArgs) (protocol.WriteResult, error) {
	if err := validPaths(a.Path); err != nil {
		return protocol.WriteResult{}, err
	}
	return r.write(ctx, a)
}

// Edit replaces a.Old with a.New in a file; never retried (the first attempt may have applied).
func (r *Remote) Edit(ctx context.Context, a protocol.EditArgs) (protocol.EditResult, error) {
	var out protocol.EditResult
	if err := validPaths(a.Path); err != nil {
		return out, err
	}
	return out, r.call(ctx, protocol.OpEdit, a, &out, false)
}

// Delete removes a path; never retried (the first attempt may have applied).
func (r *Remote) Delete(ctx context.Context, a protocol.DeleteArgs) error {
	if err := validPaths(a.Path); err != nil {
		return err
	}
	return r.call(ctx, protocol.OpDelete, a, nil, false)
}

// Mkdir makes a directory; retried once when the connection broke only with a.Parents set, which
// makes a second attempt harmless.
func (r *Remote) Mkdir(ctx context.Context, a protocol.MkdirArgs) error {
	if err := validPaths(a.Path); err != nil {
		return err
	}
	return r.call(ctx, protocol.OpMkdir, a, nil, a.Parents)
}

// Move renames a path; never retried (the first attempt may have applied).
func (r *Remote) Move(ctx context.Context, a protocol.MoveArgs) error {
	if err := validPaths(a.From, a.To); err != nil {
		return err
	}
	return r.call(ctx, protocol.OpMove, a, nil, false)
}

// Glob finds the paths that match a pattern; retried once when the connection broke.
func (r *Remote) Glob(ctx context.Context, a protocol.GlobArgs) (protocol.GlobResult, error) {
	var out protocol.GlobResult
	if err := validPaths(a.Path, a.Pattern); err != nil {
		return out, err
	}
	return out, r.call(ctx, protocol.OpGlob, a, &out, true)
}

// Grep searches files for a pattern; retried once when the connection broke.
func (r *Remote) Grep(ctx context.Context, a protocol.GrepArgs) (protocol.GrepResult, error) {
	var out protocol.GrepResult
	if err := validPaths(a.Path); err != nil {
		return out, err
	}
	return out, r.call(ctx, protocol.OpGrep, a, &out, true)
}

// Env is the environment commands in the sandbox see; retried once when the connection broke.
func (r *Remote) Env(ctx context.Context) (map[string]string, error) {
	var out protocol.EnvResult
	return out.Env, r.call(ctx, protocol.OpEnv, nil, &out, true)
}

// Exec runs a command; it is never retried (a command may not be safe to run twice).
func (r *Remote) Exec(ctx context.Context, req ExecRequest) (protocol.ExecResult, error) {
	c, err := r.connection(ctx)
	if err != nil {
		return protocol.ExecResult{}, err
	}
	a := req.ExecArgs
	cl := &call{}
	if req.Stdout != nil {
		a.Stream = true
		cl.stdout, cl.stderr = req.Stdout, req.Stderr
		if req.Stderr == nil {
			a.Combined = true
		}
	}
	var out protocol.ExecResult
	if err := c.roundTrip(ctx, protocol.OpExec, a, cl, nil); err != nil {
		return out, err
	}
	if protocol.DecodeFlat(cl.result, &out) {
		return out, nil
	}
	if err := json.Unmarshal(cl.result, &out); err != nil {
		return out, fmt.Errorf("dataplane answered exec with an unexpected result: %w", err)
	}
	return out, nil
}
