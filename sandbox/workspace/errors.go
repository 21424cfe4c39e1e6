package workspace

import (
	"errors"
	"io/fs"
	"os"
	"sync"
	"syscall"

	"github.com/sbxbroker/broker/protocol"
)

// errOutside is this package's own "the path leaves the workspace" (from realPath).
var errOutside = errors.New("path resolves outside the workspace")

// rootEscapeErr is the error value os.Root returns when a path or a symlink would leave the root.
// The standard library does not export it, and matching on its text is what we never do; so we
// capture the value itself once, by asking a Root for "..", and compare identities. Open does it
// on its own root before returning, so no error can reach fsErr before the value is known.
var (
	escapeOnce    sync.Once
	rootEscapeErr error
)

func captureEscapeErr(r *os.Root) {
	escapeOnce.Do(func() {
		_, err := r.Lstat("..")
		var pe *fs.PathError
		if errors.As(err, &pe) {
			if _, isErrno := pe.Err.(syscall.Errno); !isErrno {
				rootEscapeErr = pe.Err
			}
		}
	})
}

func isEscape(err error) bool {
	return errors.Is(err, errOutside) || (rootEscapeErr != nil && errors.Is(err, rootEscapeErr))
}

// fsErr maps an error from os.Root or an *os.File to the protocol error for the sandbox path sp.
// It is the one place that does: the raw error is never passed on, because an *os.File's errors
// carry the host path, and callers branch on codes, not on errnos.
func fsErr(sp string, err error) error {
	if err == nil {
		return nil
	}
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return pe
	}
	if isEscape(err) {
		return protocol.Errorf(protocol.CodeInvalidPath,
			"%s resolves outside the workspace through a symbolic link (links must be relative and stay inside %s)", sp, Root)
	}
	if errors.Is(err, os.ErrClosed) {
		return protocol.Errorf(protocol.CodeUnavailable, "the workspace is closed")
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.ENOENT:
			return protocol.Errorf(protocol.CodeFileNotFound, "%s does not exist", sp)
		case syscall.ENOTDIR:
			return protocol.Errorf(protocol.CodeNotDirectory, "%s, or one of its parent directories, is not a directory", sp)
		case syscall.EISDIR:
			return protocol.Errorf(protocol.CodeIsDirectory, "%s is a directory", sp)
		case syscall.EEXIST:
			return protocol.Errorf(protocol.CodeFileExists, "%s already exists", sp)
		case syscall.ENOTEMPTY:
			return protocol.Errorf(protocol.CodeInvalidArgument, "%s is a directory that is not empty", sp)
		case syscall.EACCES, syscall.EPERM:
			return protocol.Errorf(protocol.CodePermissionDenied, "permission denied on %s", sp)
		case syscall.EROFS:
			return protocol.Errorf(protocol.CodePermissionDenied, "%s is on a read-only file system", sp)
		case syscall.ELOOP:
			return protocol.Errorf(protocol.CodeInvalidPath, "%s cannot be resolved: too many levels of symbolic links", sp)
		case syscall.ENAMETOOLONG:
			return protocol.Errorf(protocol.CodeInvalidPath, "%s is too long for the file system", sp)
		case syscall.ENOSPC, syscall.EDQUOT:
			return protocol.Errorf(protocol.CodeTooLarge, "no space left in the workspace for %s; free some space and retry", sp)
		case syscall.EFBIG:
			return protocol.Errorf(protocol.CodeTooLarge, "%s would be larger than the file system allows", sp)
		case syscall.EXDEV:
			return protocol.Errorf(protocol.CodeInvalidArgument, "%s is on another file system; copy it instead of moving it", sp)
		case syscall.EINVAL:
			return protocol.Errorf(protocol.CodeInvalidArgument, "the operation is not valid for %s", sp)
		case syscall.EMFILE, syscall.ENFILE:
			return protocol.Errorf(protocol.CodeUnavailable, "the broker has too many open files; retry %s later", sp)
		}
		// An errno's text never names a path, so it is safe to show.
		return protocol.Errorf(protocol.CodeInternal, "unexpected file system error on %s: %s", sp, errno.Error())
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return protocol.Errorf(protocol.CodeFileNotFound, "%s does not exist", sp)
	case errors.Is(err, fs.ErrExist):
		return protocol.Errorf(protocol.CodeFileExists, "%s already exists", sp)
	case errors.Is(err, fs.ErrPermission):
		return protocol.Errorf(protocol.CodePermissionDenied, "permission denied on %s", sp)
	}
	return protocol.Errorf(protocol.CodeInternal, "unexpected file system error on %s", sp)
}

// notRegular is the answer for a FIFO, socket or device where a regular file is needed.
func notRegular(sp string, fi fs.FileInfo) error {
	kind := "special file"
	switch m := fi.Mode(); {
	case m&fs.ModeNamedPipe != 0:
		kind = "FIFO"
	case m&fs.ModeSocket != 0:
		kind = "socket"
	case m&fs.ModeDevice != 0:
		kind = "device"
	}
	return protocol.Errorf(protocol.CodeInvalidArgument, "%s is a %s, not a regular file; only regular files can be read or written", sp, kind)
}

func isNotDir(err error) bool { return errors.Is(err, syscall.ENOTDIR) }
