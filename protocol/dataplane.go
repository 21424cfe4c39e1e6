package protocol

import (
	"encoding/binary"
	"errors"
	"time"
)

// The dataplane is a WebSocket at GET /v1/sandboxes/{ref}/dataplane. docs/dataplane.md is the
// normative spec; these are its types.

// Subprotocol is the dataplane's WebSocket subprotocol; a client must offer it. v2 carries file
// content as raw bytes in binary frames (FrameRequestBody, FrameAnswerBody) where v1 carried it as
// text inside the JSON; a v1 client is refused at the upgrade with an error naming both versions.
const Subprotocol = "sbx.dataplane.v2"

// SubprotocolPrefix starts every version of the dataplane's subprotocol: an offer of another
// version is an old (or newer) client, refused by name.
const SubprotocolPrefix = "sbx.dataplane."

// BearerSubprotocolPrefix carries a credential for clients that cannot set headers (browsers):
// Sec-WebSocket-Protocol: sbx.dataplane.v2, sbx.bearer.<credential>. The server never echoes it.
const BearerSubprotocolPrefix = "sbx.bearer."

// Operations.
const (
	OpPing     = "ping"
	OpCancel   = "cancel"
	OpEnv      = "env"
	OpStat     = "stat"
	OpLs       = "ls"
	OpRead     = "read"
	OpWrite    = "write"
	OpEdit     = "edit"
	OpDelete   = "delete"
	OpMkdir    = "mkdir"
	OpMove     = "move"
	OpGlob     = "glob"
	OpGrep     = "grep"
	OpUpload   = "upload"
	OpDownload = "download"
	OpUntar    = "untar"
	OpTar      = "tar"
	OpChanges  = "changes"
	OpExec     = "exec"
)

// Request is a client text frame: {"id":7,"op":"read","args":{...}}. A cancel names the request it
// cancels by its own id: {"id":7,"op":"cancel"}.
type Request struct {
	ID   uint32 `json:"id"`
	Op   string `json:"op"`
	Args any    `json:"args,omitempty"`
}

// Response is a server text frame ending request ID with a Result or an Error. The first frame of
// a connection is instead {"type":"hello","hello":{...}}.
type Response struct {
	ID     uint32 `json:"id"`
	Result any    `json:"result,omitempty"`
	Error  *Error `json:"error,omitempty"`
	Type   string `json:"type,omitempty"`
	Hello  *Hello `json:"hello,omitempty"`
}

// Hello opens every connection: what this connection may do and its limits.
type Hello struct {
	Protocol  string   `json:"protocol"`
	SandboxID string   `json:"sandbox_id"`
	Workspace string   `json:"workspace"`
	Scopes    []string `json:"scopes"`
	AllowCmd  []string `json:"allow_cmd,omitempty"`
	// ExpiresAt is when the credential expires and the connection closes (nil for API keys).
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
	Limits    Limits     `json:"limits"`
}

// Limits of one connection.
type Limits struct {
	// MaxFrameBytes bounds every frame a client sends (text or binary, header included); a bigger
	// one closes the connection. Answers may be larger (up to 8 MiB of content, JSON-escaped).
	MaxFrameBytes int `json:"max_frame_bytes"`
	// MaxInflight bounds concurrent requests; more are answered too_many_requests.
	MaxInflight int `json:"max_inflight"`
	// MaxChunkBytes is the payload size of upload and download chunks (binary frames).
	MaxChunkBytes int `json:"max_chunk_bytes"`
	// MaxOutputBytes caps exec output a streamed request may ask for (non-streamed: 8 MiB).
	MaxOutputBytes int64 `json:"max_output_bytes"`
}

// ExecArgs runs a command: Command (a /bin/sh -c string) or Argv (no shell), not both.
type ExecArgs struct {
	Command string            `json:"command,omitempty"`
	Argv    []string          `json:"argv,omitempty"`
	Cwd     string            `json:"cwd,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	// Stdin is the command's whole standard input (UTF-8 text); empty means none.
	Stdin string `json:"stdin,omitempty"`
	// TimeoutMS kills the command's process tree when it passes; 0 = the sandbox's default, and it
	// is capped at the sandbox's maximum.
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
	// Stream sends output as binary frames as it comes (kinds stdout/stderr); otherwise the result
	// carries it.
	Stream bool `json:"stream,omitempty"`
	// Combined merges stderr into stdout, interleaved as written (one stream, kind stdout).
	Combined bool `json:"combined,omitempty"`
	// MaxOutput caps output bytes (0 = 1 MiB; at most 8 MiB, or Limits.MaxOutputBytes with Stream);
	// past it output is dropped and truncated is set.
	MaxOutput int64 `json:"max_output,omitempty"`
	// Background starts the command and answers at once with its pid; it runs until it exits or
	// the sandbox stops, output discarded.
	Background bool `json:"background,omitempty"`
}

// ExecResult is how a command ended.
type ExecResult struct {
	ExitCode int `json:"exit_code"`
	// Signal names the signal that ended it ("KILL"); exit_code is then 128+signal.
	Signal string `json:"signal,omitempty"`
	// Reason says why the broker or kernel ended it: timeout, cancelled, memory_limit.
	Reason     string `json:"reason,omitempty"`
	Truncated  bool   `json:"truncated,omitempty"`
	DurationMS int64  `json:"duration_ms"`
	Pid        int    `json:"pid,omitempty"`
	// Output (combined) or Stdout and Stderr, when not streamed. Invalid UTF-8 is replaced by U+FFFD;
	// stream to get exact bytes.
	Output *string `json:"output,omitempty"`
	Stdout *string `json:"stdout,omitempty"`
	Stderr *string `json:"stderr,omitempty"`
}

// UploadArgs starts an upload: data follows as binary frames of kind FrameData with the request's
// id, then one frame of kind FrameEnd. The file appears atomically when the upload ends.
type UploadArgs struct {
	Path string `json:"path"`
	Mode string `json:"mode,omitempty"` // "overwrite" (default) or "create"
}

// DownloadArgs asks for a file's bytes: they come as binary frames of kind FrameData, then the
// result (DownloadResult).
type DownloadArgs struct {
	Path string `json:"path"`
}

// DownloadResult ends a download.
type DownloadResult struct {
	Path string `json:"path"`
	Size int64  `json:"size"`
}

// UntarArgs starts an extraction: an uncompressed tar stream follows as binary frames of kind
// FrameData with the request's id, then one frame of kind FrameEnd, as for an upload. Path is the
// directory the archive's names are relative to; it is created if missing.
type UntarArgs struct {
	Path string `json:"path"`
}

// TarArgs asks for a file, symlink or directory tree as a tar stream: it comes as binary frames of
// kind FrameData, then the result (TreeResult). Entries are named from Path's base name down.
//
// With Paths, Path is a directory and the stream is a batch of downloads instead: one regular-file
// entry per path (relative to Path, named exactly as given) holding what a download of it would
// give, and a path a download would refuse listed in TreeResult.Errors instead (docs/dataplane.md).
type TarArgs struct {
	Path  string   `json:"path"`
	Paths []string `json:"paths,omitempty"`
}

// MaxTarPaths bounds TarArgs.Paths.
const MaxTarPaths = 10_000

// TreeResult ends an untar or a tar: the directory extracted into (or the path archived) and what
// moved. Bytes counts file content; Skipped the FIFOs, sockets and devices a tar left out; Errors
// the paths a tar with Paths left out, each with what a download of it would have answered.
type TreeResult struct {
	Path     string      `json:"path"`
	Files    int         `json:"files"`
	Dirs     int         `json:"dirs"`
	Symlinks int         `json:"symlinks"`
	Bytes    int64       `json:"bytes"`
	Skipped  int         `json:"skipped,omitempty"`
	Errors   []PathError `json:"errors,omitempty"`
}

// PathError is one path of a batch that failed on its own: Path as the request named it, and the
// error a request for that path alone would have answered.
type PathError struct {
	Path    string `json:"path"`
	Code    string `json:"code"`
	Message string `json:"message"`
}

// ChangesArgs asks what changed in a tree since its push baseline (sbctl push): Path is the tree
// (default /workspace); its baseline record is Path/.sbx/baseline (BaselineRecord). Entries named
// .git, and the tree's own .sbx, are never looked at.
type ChangesArgs struct {
	Path string `json:"path,omitempty"`
	// Paths, when given, limits the comparison to these paths (relative to Path): what a push is
	// about to overwrite or delete. At most MaxChangesPaths.
	Paths []string `json:"paths,omitempty"`
}

// MaxChangesPaths bounds ChangesArgs.Paths.
const MaxChangesPaths = 10_000

// BaselineRecord is where a pushed tree's baseline lives, relative to the tree.
const BaselineRecord = ".sbx/baseline"

// ChangesResult lists what differs from the baseline, by path (relative to the tree, sorted).
// Commit is the baseline's commit id as its pusher recorded it; Scanned counts the files and
// symlinks looked at, Hashed the bytes read to hash them.
type ChangesResult struct {
	Path    string   `json:"path"`
	Commit  string   `json:"commit"`
	Changes []Change `json:"changes"`
	Scanned int      `json:"scanned"`
	Hashed  int64    `json:"hashed"`
	// Skipped are names the tree holds that no git path can be (control characters, invalid
	// UTF-8), shown quoted; they are left out of Changes.
	Skipped []string `json:"skipped,omitempty"`
}

// Change is one path that differs from the baseline. Status is "added", "modified" or "deleted";
// Mode is the git mode of what is there now ("100644", "100755", "120000"; "" when deleted) and
// OID its git blob id (of a symlink: of its target's text).
type Change struct {
	Path   string `json:"path"`
	Status string `json:"status"`
	Mode   string `json:"mode,omitempty"`
	OID    string `json:"oid,omitempty"`
	Size   int64  `json:"size,omitempty"`
}

// The statuses of a Change.
const (
	ChangeAdded    = "added"
	ChangeModified = "modified"
	ChangeDeleted  = "deleted"
)

// EnvResult is the sandbox's environment snapshot.
type EnvResult struct {
	Env map[string]string `json:"env"`
}

// Binary frames: a 5-byte header (kind, then the request id as big-endian uint32), then payload.
const (
	FrameStdout byte = 1 // server -> client: exec output (all output when combined)
	FrameStderr byte = 2 // server -> client: exec stderr
	FrameData   byte = 3 // both ways: upload (client -> server) and download (server -> client) bytes
	FrameEnd    byte = 4 // client -> server: the upload is complete (empty payload)

	// FrameRequestBody (client -> server) is a request with a body: after the header, a 4-byte
	// big-endian length n, then n bytes of the request's JSON object (exactly a text frame's, with
	// the header's id), then the body: the rest of the frame. write's content travels so.
	FrameRequestBody byte = 5
	// FrameAnswerBody (server -> client) is an answer with a body, laid out like FrameRequestBody:
	// the answer's JSON ({"id":N,"result":{...}}), then the body. read's content travels so.
	FrameAnswerBody byte = 6

	FrameHeaderLen = 5
	// BodyHeaderLen is the fixed part of FrameRequestBody and FrameAnswerBody: the frame header,
	// then the length of the JSON that follows.
	BodyHeaderLen = FrameHeaderLen + 4
)

// ErrBodyFrame is a FrameRequestBody or FrameAnswerBody whose JSON length passes its end.
var ErrBodyFrame = errors.New("a frame with a body must hold a 4-byte JSON length and that many bytes of JSON after its 5-byte header")

// PutBodyHeader writes the fixed part of a frame with a body into b[:BodyHeaderLen]: kind, id and
// the length of the JSON that follows.
func PutBodyHeader(b []byte, kind byte, id uint32, jsonLen int) {
	PutFrameHeader(b, kind, id)
	binary.BigEndian.PutUint32(b[FrameHeaderLen:BodyHeaderLen], uint32(jsonLen))
}

// AppendBodyFrame appends a whole frame with a body to b.
func AppendBodyFrame(b []byte, kind byte, id uint32, js, body []byte) []byte {
	var h [BodyHeaderLen]byte
	PutBodyHeader(h[:], kind, id, len(js))
	b = append(b, h[:]...)
	b = append(b, js...)
	return append(b, body...)
}

// SplitBody splits the payload of a frame with a body (what follows the 5-byte header) into its
// JSON and its body. A length that passes the frame's end is ErrBodyFrame.
func SplitBody(payload []byte) (js, body []byte, err error) {
	if len(payload) < 4 {
		return nil, nil, ErrBodyFrame
	}
	n := binary.BigEndian.Uint32(payload[:4])
	if uint64(n) > uint64(len(payload)-4) {
		return nil, nil, ErrBodyFrame
	}
	return payload[4 : 4+n], payload[4+n:], nil
}

// ErrShortFrame is a binary frame shorter than its header.
var ErrShortFrame = errors.New("binary frame shorter than its 5-byte header")

// PutFrameHeader writes a binary frame header into b[:5].
func PutFrameHeader(b []byte, kind byte, id uint32) {
	b[0] = kind
	binary.BigEndian.PutUint32(b[1:5], id)
}

// ParseFrame splits a binary frame into kind, request id and payload.
func ParseFrame(b []byte) (kind byte, id uint32, payload []byte, err error) {
	if len(b) < FrameHeaderLen {
		return 0, 0, nil, ErrShortFrame
	}
	return b[0], binary.BigEndian.Uint32(b[1:5]), b[FrameHeaderLen:], nil
}

// WebSocket close codes the broker uses besides the standard ones (1001 going away on shutdown,
// 1008 policy, 1009 too big, 1011 internal). The close reason is the error code.
const (
	CloseCredentialEnded = 4001 // the token was revoked or expired (reason token_revoked / token_expired)
	CloseSandboxGone     = 4002 // the sandbox stopped or was deleted (reason sandbox_not_running / not_found)
)
