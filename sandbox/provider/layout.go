package provider

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"

	"github.com/sbxbroker/broker/protocol"
)

// validID is protocol.ValidSandboxID: every host path and cgroup name is built from the id, so
// nothing else (no "/", no "..") may pass.
func validID(id string) bool { return protocol.ValidSandboxID(id) }

// NewID is protocol.NewSandboxID (preflight's probe sandbox and the provider's tests).
func NewID() string { return protocol.NewSandboxID() }

// layout is where a provider keeps sandboxes on disk: <dataDir>/sandboxes/<id>/{workspace,state}.
type layout struct {
	dataDir string
}

func (l layout) root() string                  { return filepath.Join(l.dataDir, "sandboxes") }
func (l layout) sandboxDir(id string) string   { return filepath.Join(l.root(), id) }
func (l layout) workspaceDir(id string) string { return filepath.Join(l.sandboxDir(id), "workspace") }
func (l layout) stateDir(id string) string     { return filepath.Join(l.sandboxDir(id), "state") }

// create makes the sandbox's directories (see secure for their owners and modes). It is
// idempotent.
func (l layout) create(id string, uid, gid int) error {
	if !validID(id) {
		return fmt.Errorf("%w: %q", ErrInvalidID, id)
	}
	// The sandboxes directory is 0711: every sandbox uid passes through it by path (bwrap resolves
	// bind sources by path), and nobody may list it.
	if err := os.Mkdir(l.root(), 0o711); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create sandbox %s: %w", id, err)
	}
	for _, d := range []string{l.sandboxDir(id), l.stateDir(id), l.workspaceDir(id)} {
		if err := os.Mkdir(d, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create sandbox %s: %w", id, err)
		}
	}
	return l.secure(id, uid, gid)
}

// secure gives the sandbox's directories their owners and modes, so that no other local user (nor
// another sandbox's uid) can list, read or reach into them: the sandbox directory is root's with the
// sandbox's gid and mode 0710 (only the sandbox's own processes pass through it, and it cannot
// replace what is in it), the state directory 0700 root's, the workspace 0700 the sandbox's. A
// setuid file planted in a workspace is then out of every other user's reach. Under a broker that
// is not root (uid < 0) everything is 0700 the broker's. Start runs it again, so a sandbox made
// before gets it, and a sandbox that opened its workspace up (chmod 755 /workspace) is closed again.
func (l layout) secure(id string, uid, gid int) error {
	sd, ws := l.sandboxDir(id), l.workspaceDir(id)
	set := func(p string, owner, group int, mode fs.FileMode) error {
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory", p)
		}
		if owner >= 0 {
			if err := os.Lchown(p, owner, group); err != nil {
				return err
			}
		}
		return os.Chmod(p, mode)
	}
	var err error
	if uid >= 0 {
		err = errors.Join(set(sd, 0, gid, 0o710), set(l.stateDir(id), 0, 0, 0o700), set(ws, uid, gid, 0o700))
	} else {
		err = errors.Join(set(sd, -1, -1, 0o700), set(l.stateDir(id), -1, -1, 0o700), set(ws, -1, -1, 0o700))
	}
	if err != nil {
		return fmt.Errorf("sandbox %s: set its directories' owners and modes: %w", id, err)
	}
	return nil
}

// destroy removes everything of the sandbox unless it is running. The id is checked first: a
// hostile id never reaches a path.
func (l layout) destroy(id string, r *running) error {
	if !validID(id) {
		return fmt.Errorf("%w: %q", ErrInvalidID, id)
	}
	if r.isRunning(id) {
		return fmt.Errorf("%w: %s", ErrRunning, id)
	}
	dir := l.sandboxDir(id)
	err := os.RemoveAll(dir)
	if err != nil && os.Geteuid() != 0 {
		// A sandbox may leave directories without write permission (chmod 0500); an unprivileged
		// broker must restore it before it can remove their contents. RemoveAll never follows
		// symlinks, and neither does this walk.
		_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				_ = os.Chmod(p, 0o700)
			}
			return nil
		})
		err = os.RemoveAll(dir)
	}
	if err != nil {
		return fmt.Errorf("destroy sandbox %s: %w", id, err)
	}
	return nil
}

// sandboxCwd turns a request's cwd into a clean sandbox path under WorkspacePath. Relative paths are
// relative to the workspace. Anything that cleans to a path outside it is refused.
func sandboxCwd(cwd string) (string, error) {
	if cwd == "" {
		return WorkspacePath, nil
	}
	if strings.IndexByte(cwd, 0) >= 0 {
		return "", invalidRequest("cwd contains a NUL byte")
	}
	p := cwd
	if !path.IsAbs(p) {
		p = path.Join(WorkspacePath, p)
	}
	p = path.Clean(p)
	if p != WorkspacePath && !strings.HasPrefix(p, WorkspacePath+"/") {
		return "", invalidRequest("cwd %q is outside %s", cwd, WorkspacePath)
	}
	return p, nil
}

// running tracks the sandboxes a provider has started, so that a second Start or a Destroy of a
// running sandbox is refused instead of corrupting it.
type running struct {
	mu  sync.Mutex
	ids map[string]struct{}
}

func (r *running) claim(id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ids == nil {
		r.ids = make(map[string]struct{})
	}
	if _, ok := r.ids[id]; ok {
		return fmt.Errorf("%w: %s", ErrRunning, id)
	}
	r.ids[id] = struct{}{}
	return nil
}

func (r *running) release(id string) {
	r.mu.Lock()
	delete(r.ids, id)
	r.mu.Unlock()
}

func (r *running) isRunning(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.ids[id]
	return ok
}
