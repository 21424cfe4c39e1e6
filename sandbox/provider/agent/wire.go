// Package agent is a sandbox's resident init when the sandbox is a pod (or any home the broker
// reaches over the network rather than a local socket): cmd/sbx-agent listens on TCP, and the
// broker's kubernetes provider runs commands and file operations through it. It links only the
// workspace package (the same traversal-safe file operations the broker runs host-side for a
// namespace sandbox) and the protocol, so sbx-agent is small and static.
//
// The wire, over one TCP connection:
//
//  0. TLS 1.3 with the sandbox's own certificate, which the broker pins (tls.go); everything below
//     runs inside it.
//  1. The agent sends a 32-byte random challenge; the broker answers it (Answer: an HMAC-SHA256
//     keyed by the secret) and sends a 32-byte challenge of its own, which the agent answers
//     (Proof) once the broker's answer holds. A wrong answer on either side closes the connection:
//     only the holder of the sandbox's secret gets further, the broker sends a request only to an
//     agent that holds it, and the secret itself never crosses the network.
//  2. Then frames, each a type byte, a 4-byte big-endian length and the payload. A request is a
//     FrameRequest holding JSON {op, args}; the agent answers with a FrameResult holding JSON
//     {result} or {error}. Unary operations (stat, ls, read, write, ...) may follow one another on
//     the same connection; exec and the streamed ones (create, open, extract, archive) use a
//     connection of their own, closed afterwards, and exchange data frames in between. A command
//     on a terminal (OpTTY) takes keystrokes within a window the agent credits back (TTYWindow).
//
// TLS keeps the traffic from other pods (it is neither readable nor changeable on the pod network),
// the pin keeps the broker from an impostor at the pod's address, and the secret keeps the agent
// from anyone but the broker (see tls.go and docs/operations.md). Handshakes from addresses that
// never proved the secret are rated (limits.go), since each costs the agent a signature.
package agent

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/sbxbroker/broker/protocol"
)

// Port is the agent's default TCP port.
const Port = 7450

// Frame types.
const (
	FrameRequest  = 'R' // broker → agent: JSON Request
	FrameResult   = 'Z' // agent → broker: JSON Result; ends the operation
	FrameStarted  = 'S' // agent → broker: the operation started (JSON: pid, or a file's info)
	FrameStdin    = 'I' // broker → agent: the command's standard input
	FrameStdinEOF = 'i' // broker → agent: end of the standard input
	FrameKill     = 'K' // broker → agent: end the command (cancelled)
	FrameStdout   = 'O' // agent → broker
	FrameStderr   = 'E' // agent → broker
	FrameData     = 'D' // either way: a streamed file's or tar's bytes
	FrameEnd      = 'd' // broker → agent: end of the streamed bytes (commit)
	FrameAbort    = 'A' // broker → agent: abandon the upload
	FrameResize   = 'W' // broker → agent: a terminal's new window (4 bytes: rows, cols, big-endian)
	FrameCredit   = 'C' // agent → broker: a terminal took this many input bytes (4 bytes, big-endian)
)

// TTYWindow bounds the keystrokes in flight to a terminal (OpTTY): the broker sends FrameStdin
// only within it, and the agent gives it back (FrameCredit) as the terminal takes them. So the
// agent never stops reading the connection (a kill, a resize or a cut is always seen, even while
// the program reads no input), and what it holds for a program that does not read stays bounded.
const TTYWindow = 64 << 10

// MaxFrame bounds one frame's payload.
const MaxFrame = 1 << 20

// ChallengeSize is the size of the challenge and of its answer.
const ChallengeSize = 32

// Ops.
const (
	OpEnv     = "env"
	OpExec    = "exec"
	OpTTY     = "tty" // exec on a terminal (ExecArgs with Rows, Cols)
	OpStat    = "stat"
	OpList    = "ls"
	OpRead    = "read"
	OpGlob    = "glob"
	OpGrep    = "grep"
	OpWrite   = "write"
	OpEdit    = "edit"
	OpDelete  = "delete"
	OpMkdir   = "mkdir"
	OpMove    = "move"
	OpCreate  = "create"
	OpOpen    = "open"
	OpExtract = "extract"
	OpArchive = "archive"
)

// Request is one operation.
type Request struct {
	Op   string          `json:"op"`
	Args json.RawMessage `json:"args,omitempty"`
}

// Result ends one operation: its result, or its error.
type Result struct {
	Result json.RawMessage `json:"result,omitempty"`
	Error  *Error          `json:"error,omitempty"`
}

// Error is an operation's error: a protocol error (Code set) the broker passes on as it is, a
// command that could not start (Kind set), or an internal cause.
type Error struct {
	Code    string `json:"code,omitempty"`
	Kind    string `json:"kind,omitempty"`
	Message string `json:"message"`
}

// Kinds of exec start errors.
const (
	KindCwd   = "cwd"   // the working directory is missing or not a directory
	KindStart = "start" // the program is missing or could not start
	KindArgs  = "args"  // a request the agent cannot run
)

func (e *Error) Error() string {
	if e.Code != "" {
		return e.Code + ": " + e.Message
	}
	return e.Message
}

// AsError is e as an error: a *protocol.Error when it carries a code.
func (e *Error) AsError() error {
	if e == nil {
		return nil
	}
	if e.Code != "" {
		return protocol.Errorf(e.Code, "%s", e.Message)
	}
	return e
}

func toError(err error) *Error {
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return &Error{Code: pe.Code, Message: pe.Message}
	}
	var ae *Error
	if errors.As(err, &ae) {
		return ae
	}
	return &Error{Message: err.Error()}
}

// ExecArgs is one command.
type ExecArgs struct {
	Argv []string `json:"argv"`
	Dir  string   `json:"dir"`
	Env  []string `json:"env,omitempty"` // overrides, KEY=VALUE
	// Stdin says input frames follow; Stdout that output is wanted; Stderr that stderr comes apart
	// (else it rides with stdout, interleaved).
	Stdin      bool  `json:"stdin,omitempty"`
	Stdout     bool  `json:"stdout,omitempty"`
	Stderr     bool  `json:"stderr,omitempty"`
	MaxOutput  int64 `json:"max_output,omitempty"`
	TimeoutMs  int64 `json:"timeout_ms,omitempty"`
	Background bool  `json:"background,omitempty"`
	// Rows and Cols are a terminal's window (OpTTY only).
	Rows uint16 `json:"rows,omitempty"`
	Cols uint16 `json:"cols,omitempty"`
}

// ExecResult is how a command ended.
type ExecResult struct {
	Code       int    `json:"code"`
	Signal     string `json:"signal,omitempty"`
	Reason     string `json:"reason,omitempty"`
	Truncated  bool   `json:"truncated,omitempty"`
	DurationUs int64  `json:"duration_us"`
	Pid        int    `json:"pid,omitempty"`
}

// Started is the FrameStarted payload.
type Started struct {
	Pid  int                `json:"pid,omitempty"`
	Info *protocol.FileInfo `json:"info,omitempty"`
	// Reuse says the agent takes further requests on the connection once this operation's result
	// is sent (a create that ends with FrameEnd or FrameAbort); without it the agent closes the
	// connection after the operation, as older agents do.
	Reuse bool `json:"reuse,omitempty"`
}

// CreateArgs starts an upload.
type CreateArgs struct {
	Path string `json:"path"`
	Mode string `json:"mode,omitempty"`
}

// PathArgs names a path (stat, open, archive, extract).
type PathArgs struct {
	Path string `json:"path"`
}

// The handshake proves the secret both ways before any request: the agent sends a challenge; the
// broker answers it (Answer) and sends a challenge of its own; the agent, having checked the answer,
// answers that one (Proof). Without the agent's proof the broker sends nothing, so whatever else
// listens at a pod's address (another pod given the IP of one that went) gets no request. The two
// answers are keyed apart, so neither side's answer can be reflected as the other's.

// Answer is the broker's answer to the agent's challenge for secret.
func Answer(secret, challenge []byte) []byte {
	return answer(secret, "sbx-agent broker\x00", challenge)
}

// Proof is the agent's answer to the broker's challenge for secret.
func Proof(secret, challenge []byte) []byte { return answer(secret, "sbx-agent agent\x00", challenge) }

func answer(secret []byte, side string, challenge []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(side))
	m.Write(challenge)
	return m.Sum(nil)
}

// WriteFrame writes one frame.
func WriteFrame(w io.Writer, typ byte, payload []byte) error {
	if len(payload) > MaxFrame {
		return fmt.Errorf("agent: frame of %d bytes over the %d limit", len(payload), MaxFrame)
	}
	var h [5]byte
	h[0] = typ
	binary.BigEndian.PutUint32(h[1:], uint32(len(payload)))
	if len(payload) == 0 {
		_, err := w.Write(h[:])
		return err
	}
	// One write: small frames leave in one segment.
	buf := make([]byte, 5+len(payload))
	copy(buf, h[:])
	copy(buf[5:], payload)
	_, err := w.Write(buf)
	return err
}

// WriteJSON writes v as one frame.
func WriteJSON(w io.Writer, typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return WriteFrame(w, typ, b)
}

// ReadFrame reads one frame into buf (grown as needed) and returns its type and payload.
func ReadFrame(r io.Reader, buf []byte) (byte, []byte, error) {
	var h [5]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(h[1:])
	if n > MaxFrame {
		return 0, nil, fmt.Errorf("agent: frame of %d bytes over the %d limit", n, MaxFrame)
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		return 0, nil, err
	}
	return h[0], buf, nil
}
