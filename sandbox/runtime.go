package sandbox

import (
	"context"
	"errors"
	"io"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/workspace"
	"github.com/sbxbroker/broker/store"
)

// Runtime is the handle on a running sandbox that the manager gives out: its files, its commands
// and its end. It is the one seam between the broker's front ends (the dataplane, and the REST and
// MCP faces over it) and wherever the sandbox lives: nothing that holds a Runtime knows a host path,
// a host pid or a local cgroup, so a sandbox in a gVisor sandbox, a pod or a microVM can serve the
// same operations through its resident init. The namespace and dir providers keep their fast
// host-side file path: Files is the workspace directory's traversal-safe API (os.Root), in the
// broker's process, one call away.
type Runtime struct {
	// Files are the sandbox's file operations, by sandbox path (/workspace/...).
	Files Files
	// LocalFiles says Files are system calls on this host's disk, never a round trip to another
	// process or machine: a single file's operation ends in well under a millisecond.
	LocalFiles bool
	inst       provider.Instance
}

// Files are a sandbox's file operations (docs/dataplane.md, section 3). Paths are sandbox paths;
// nothing resolves outside the workspace. Errors are protocol errors a caller can act on, or
// internal causes.
type Files interface {
	Stat(path string) (protocol.FileInfo, error)
	ListContext(ctx context.Context, path string) (protocol.LsResult, error)
	ReadContext(ctx context.Context, a protocol.ReadArgs) (protocol.ReadResult, error)
	// ReadRaw is ReadContext with the content as raw bytes; a byte range is read into alloc(n)
	// (nil: a new buffer), so that the caller can send it from pooled memory.
	ReadRaw(ctx context.Context, a protocol.ReadArgs, alloc func(n int) []byte) (protocol.ReadHead, []byte, error)
	GlobContext(ctx context.Context, a protocol.GlobArgs) (protocol.GlobResult, error)
	Grep(ctx context.Context, a protocol.GrepArgs) (protocol.GrepResult, error)
	Write(a protocol.WriteArgs) (protocol.WriteResult, error)
	// EditContext draws what it holds (the file, then its result) from ctx's budget (membudget).
	EditContext(ctx context.Context, a protocol.EditArgs) (protocol.EditResult, error)
	Delete(a protocol.DeleteArgs) error
	Mkdir(a protocol.MkdirArgs) error
	Move(a protocol.MoveArgs) error
	// Create starts a streamed upload to path (mode protocol.WriteOverwrite, "" or
	// protocol.WriteCreate); the target is untouched until Commit.
	Create(path, mode string) (Upload, error)
	// OpenRead opens a file for a streamed download.
	OpenRead(path string) (io.ReadCloser, protocol.FileInfo, error)
	// Extract unpacks a tar stream into the directory dir (created if missing), refusing hostile
	// archives; nothing outside dir changes.
	Extract(ctx context.Context, dir string, r io.Reader) (protocol.TreeResult, error)
	// Archive writes path (a file, a symlink or a tree) to w as a tar stream.
	Archive(ctx context.Context, path string, w io.Writer) (protocol.TreeResult, error)
}

// Upload is a streamed write in progress: Write the bytes, then Commit, or Abort (a no-op after
// Commit).
type Upload interface {
	Write(p []byte) (int, error)
	Commit() (protocol.WriteResult, error)
	Abort() error
}

// ExecRequest is one command (a shell string or argv, cwd, env, stdin, output writers, timeout,
// output cap, background), as every provider takes it.
type ExecRequest = provider.ExecRequest

// ExecResult is how a command ended.
type ExecResult = provider.ExecResult

// TTY is a terminal for a command (ExecRequest.TTY), and WindowSize its size.
type (
	TTY        = provider.TTY
	WindowSize = provider.WindowSize
)

// WorkspaceRoot is the sandbox path of the workspace: the root of every file path and exec's
// default cwd.
const WorkspaceRoot = workspace.Root

// Exec runs one command in the sandbox. A request the sandbox cannot run (a cwd outside the
// workspace or missing) is an invalid_argument or invalid_path error, a sandbox that stopped is
// not_running; a command that runs and fails is a result with a non-zero exit code.
func (r *Runtime) Exec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	if req.Cwd != "" {
		if _, err := protocol.ResolvePath(req.Cwd); err != nil {
			return ExecResult{}, err
		}
	}
	if req.TTY != nil && !provider.SupportsTTY(r.inst) {
		return ExecResult{}, protocol.Errorf(protocol.CodeInvalidArgument, "this sandbox's provider has no terminals: use exec")
	}
	if req.Started != nil && !provider.CallsStarted(r.inst) {
		req.Started()
		req.Started = nil
	}
	res, err := r.inst.Exec(ctx, req)
	if err != nil {
		return res, execError(err)
	}
	return res, nil
}

// execError is the one translation of a provider's exec errors into the protocol's: its reason
// reaches the caller without the provider's prefix; anything else stays an internal cause.
func execError(err error) error {
	var ire *provider.InvalidRequestError
	var busy *provider.BusyError
	switch {
	case errors.As(err, &ire):
		return protocol.Errorf(protocol.CodeInvalidArgument, "%s", ire.Reason)
	case errors.Is(err, provider.ErrMemoryLimit):
		return protocol.Errorf(protocol.CodeNotRunning, "the sandbox stopped: it reached its memory limit (memory_limit); resume it, and keep /tmp, /dev/shm and processes within the template's memory")
	case errors.Is(err, provider.ErrStopped):
		return protocol.Errorf(protocol.CodeNotRunning, "the sandbox stopped")
	case errors.As(err, &busy):
		return protocol.Errorf(protocol.CodeTooManyRequests, "%s", busy.Reason)
	}
	return err
}

// Environment is the snapshot of what printenv shows inside the sandbox, captured when it started.
func (r *Runtime) Environment() map[string]string { return r.inst.Environment() }

// Done is closed when the sandbox's processes have ended, whatever ended them (stop, delete, a
// crash): a holder of the handle lets go of it then.
func (r *Runtime) Done() <-chan struct{} { return r.inst.Done() }

// CleanPath names a sandbox path the way results do (/workspace/...): the workspace root for a
// path that is not valid.
func CleanPath(p string) string {
	rel, err := protocol.ResolvePath(p)
	if err != nil || rel == "." {
		return workspace.Root
	}
	return workspace.Root + "/" + rel
}

// Runtime returns the handle on a running sandbox hosted here: wrong_node when another broker
// hosts it, not_running when it is not running here.
func (m *Manager) Runtime(rec store.Record) (*Runtime, error) {
	h, err := m.hostedHere(rec)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.inst == nil {
		return nil, protocol.Errorf(protocol.CodeNotRunning, "sandbox %s is %s: resume it first", rec.Name, rec.Status)
	}
	if fi, ok := h.inst.(filesInstance); ok {
		// A sandbox elsewhere (a pod) serves its files through its resident init.
		return &Runtime{Files: fi.Files(), inst: h.inst}, nil
	}
	ws, err := m.openWorkspace(context.Background(), h, rec, false)
	if err != nil {
		return nil, err
	}
	return &Runtime{Files: hostFiles{ws}, LocalFiles: true, inst: h.inst}, nil
}

// filesInstance is an instance that serves its own files: one of a provider.Remote, whose
// workspace is not on this host.
type filesInstance interface {
	Files() Files
}

// hostFiles serves Files from a workspace directory on this host.
type hostFiles struct{ *workspace.Workspace }

func (f hostFiles) Create(path, mode string) (Upload, error) {
	up, err := f.Workspace.Create(path, mode)
	if err != nil {
		return nil, err
	}
	return up, nil
}

// The provider types the broker is configured with, named here so that the packages above sandbox
// reach its providers only through it.
type (
	// Provider turns templates into running sandboxes (sandbox/provider).
	Provider = provider.Provider
	// Template is what a sandbox is made from.
	Template = provider.Template
	// ProviderReport is what preflight found about the provider in use.
	ProviderReport = provider.Report
	// WorkspaceOptions are the workspace's owner and caps.
	WorkspaceOptions = workspace.Options
)
