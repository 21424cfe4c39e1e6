// Package backend is the BackendProtocol agent servers written in Go use for their file and shell
// tools: one Backend interface, Local (the host, for CLI mode), Remote (a sandbox through the
// broker's dataplane) and FromRunConfig, which picks between them from a run's configurable.
//
// Remote speaks only the wire format of package protocol. Local runs the file tools with package
// sandbox/workspace, the code a sandbox's own file operations use, so that paths resolve and
// errors read the same on the host; the package never imports the broker's server.
// Local and Remote answer alike, with the same results and the same *protocol.Error codes, so a
// tool behaves the same in both (backend/conformance tests that).
package backend

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/sbxbroker/broker/protocol"
)

// Backend runs an agent's file and shell tools. Paths are sandbox paths: absolute under
// /workspace, or relative to it. Errors are *protocol.Error; see Kind.
type Backend interface {
	// ID names the backend: the sandbox id, or "local:<root>".
	ID() string
	Stat(ctx context.Context, path string) (protocol.FileInfo, error)
	Ls(ctx context.Context, path string) ([]protocol.FileInfo, error)
	Read(ctx context.Context, a protocol.ReadArgs) (protocol.ReadResult, error)
	Write(ctx context.Context, a protocol.WriteArgs) (protocol.WriteResult, error)
	Edit(ctx context.Context, a protocol.EditArgs) (protocol.EditResult, error)
	Delete(ctx context.Context, a protocol.DeleteArgs) error
	Mkdir(ctx context.Context, a protocol.MkdirArgs) error
	Move(ctx context.Context, a protocol.MoveArgs) error
	Glob(ctx context.Context, a protocol.GlobArgs) (protocol.GlobResult, error)
	Grep(ctx context.Context, a protocol.GrepArgs) (protocol.GrepResult, error)
	// Exec runs a command. With Stdout set, output streams to the writers as it comes (Stderr nil
	// means combined into Stdout) and the result carries none; otherwise the result carries it.
	Exec(ctx context.Context, r ExecRequest) (protocol.ExecResult, error)
	// Upload writes r's bytes to path atomically; memory stays flat whatever the size.
	Upload(ctx context.Context, path string, r io.Reader) (protocol.WriteResult, error)
	// Download copies path's bytes to w and returns how many.
	Download(ctx context.Context, path string, w io.Writer) (int64, error)
	// Env is the environment commands see.
	Env(ctx context.Context) (map[string]string, error)
	Close() error
}

// ExecRequest is an exec with optional streaming writers.
type ExecRequest struct {
	protocol.ExecArgs
	// Stdout and Stderr, when Stdout is set, receive output as it comes. A write error of either
	// ends the call with that error, and Remote cancels the command at the broker (as a pipe's
	// reader going away ends its writer) rather than have its output read and dropped.
	Stdout io.Writer
	Stderr io.Writer
}

// Kind is what a tool needs to know about an error to tell the model.
type Kind int

// Kinds of error.
const (
	KindOther       Kind = iota
	KindNotFound         // the file, directory or sandbox does not exist
	KindNotAllowed       // the credential does not allow it (scope, command allowlist, revoked, expired, outside the workspace)
	KindInvalid          // the request itself is wrong (bad arguments, not unique, already exists)
	KindTimedOut         // the operation or the command timed out
	KindUnreachable      // the sandbox could not be reached; retrying later may work
	KindNotRunning       // the sandbox is stopped; its owner must resume it
)

// KindOf classifies an error.
func KindOf(err error) Kind {
	var pe *protocol.Error
	if errors.Is(err, context.DeadlineExceeded) {
		return KindTimedOut
	}
	if !errors.As(err, &pe) {
		return KindOther
	}
	switch pe.Code {
	case protocol.CodeFileNotFound, protocol.CodeNotFound:
		return KindNotFound
	case protocol.CodeScopeDenied, protocol.CodeCommandNotAllowed, protocol.CodeInvalidPath, protocol.CodePermissionDenied,
		protocol.CodeTokenRevoked, protocol.CodeTokenExpired, protocol.CodeUnauthenticated, protocol.CodeForbidden,
		protocol.CodeTokenSandbox, protocol.CodeDelegateForbidden:
		return KindNotAllowed
	case protocol.CodeTimeout:
		return KindTimedOut
	case protocol.CodeUnreachable, protocol.CodeUnavailable:
		return KindUnreachable
	case protocol.CodeNotRunning:
		return KindNotRunning
	case protocol.CodeInternal:
		return KindOther
	}
	if len(pe.Code) > 6 && pe.Code[:6] == "token_" {
		return KindNotAllowed
	}
	return KindInvalid
}

// Sentence turns an error into one sentence for a model: what went wrong and whether to retry.
func Sentence(err error) string {
	if err == nil {
		return ""
	}
	var pe *protocol.Error
	msg := err.Error()
	if errors.As(err, &pe) {
		msg = pe.Message
	}
	switch KindOf(err) {
	case KindUnreachable:
		return "The sandbox is unreachable right now (" + msg + "); try again shortly."
	case KindTimedOut:
		return "The operation timed out: " + msg
	case KindNotAllowed:
		return "Not allowed: " + msg
	case KindNotRunning:
		return "The sandbox is not running: " + msg + " Ask the user to resume it."
	}
	return msg
}

func unreachable(format string, args ...any) *protocol.Error {
	return &protocol.Error{Code: protocol.CodeUnreachable, Message: fmt.Sprintf(format, args...)}
}
