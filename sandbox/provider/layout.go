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

// create makes the sandbox's directories. Directories above the workspace are 0711 so that an
// unprivileged sandbox uid can reach the workspace by path (bwrap resolves bind sources by path) but
// cannot list other sandboxes. It is idempotent.
func (l layout) create(id string, uid, gid int) error {
	if !validID(id) {
		return fmt.Errorf("%w: %q", ErrInvalidID, id)
	}
	for _, d := range []string{l.root(), l.sandboxDir(id), l.stateDir(id)} {
		if err := os.Mkdir(d, 0o711); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create sandbox %s: %w", id, err)
		}
	}
	ws := l.workspaceDir(id)
	if err := os.Mkdir(ws, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create sandbox %s: %w", id, err)
	}
	if uid >= 0 {
		if err := os.Lchown(ws, uid, gid); err != nil {
			return fmt.Errorf("create sandbox %s: chown workspace: %w", id, err)
		}
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
