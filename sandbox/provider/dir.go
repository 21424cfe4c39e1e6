package provider

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
)

// Dir is the plain-directory provider, for machines without namespaces: the same workspace layout
// and the same resident init, started directly on the host. There is no isolation and there are no
// limits besides exec timeouts: commands see the whole host. They never run as root: a broker
// running as root runs them as Config.UID/GID (a user of the host with no other rights); any other
// broker runs them as its own user.
type Dir struct {
	cfg     Config
	layout  layout
	user    string
	asRoot  bool // broker is root: commands run as cfg.UID/GID
	running running
}

// NewDir returns the dir provider.
func NewDir(cfg Config) (*Dir, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := checkExecutable(cfg.InitPath); err != nil {
		return nil, err
	}
	d := &Dir{cfg: cfg, layout: layout{dataDir: cfg.DataDir}, user: sandboxUser, asRoot: os.Geteuid() == 0}
	if u, err := user.Current(); err == nil && u.Username != "" && !d.asRoot {
		d.user = u.Username
	}
	if err := os.MkdirAll(cfg.DataDir, 0o711); err != nil {
		return nil, fmt.Errorf("%w: data dir: %v", ErrUnavailable, err)
	}
	if err := os.Mkdir(d.layout.root(), 0o711); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("%w: data dir: %v", ErrUnavailable, err)
	}
	if d.asRoot {
		// The init starts in the workspace as the sandbox uid, so it must reach it by path.
		if err := searchable(d.layout.root(), cfg.UID, cfg.GID); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
	}
	return d, nil
}

// ids are the host uid and gid commands run as, -1 when they run as the broker's user.
func (d *Dir) ids(spec Spec) (int, int) { return hostIDs(d.asRoot, d.cfg, spec) }

// Name is "dir".
func (d *Dir) Name() string { return kindDir }

// WorkspaceDir is <DataDir>/sandboxes/<id>/workspace, or "" for an invalid id.
func (d *Dir) WorkspaceDir(spec Spec) string {
	if !validID(spec.ID) {
		return ""
	}
	return d.layout.workspaceDir(spec.ID)
}

// Create makes the workspace and state directories; the workspace belongs to the user commands
// run as.
func (d *Dir) Create(ctx context.Context, spec Spec) error {
	uid, gid := d.ids(spec)
	return d.layout.create(spec.ID, uid, gid)
}

// Destroy removes the sandbox's directories. It refuses invalid ids and running sandboxes.
func (d *Dir) Destroy(ctx context.Context, spec Spec) error {
	return d.layout.destroy(spec.ID, &d.running)
}

// Start runs the init on the host, in its own session, in the workspace directory.
func (d *Dir) Start(ctx context.Context, spec Spec) (Instance, error) {
	if !validID(spec.ID) {
		return nil, fmt.Errorf("%w: %q", ErrInvalidID, spec.ID)
	}
	t := spec.Template
	if err := t.validateContent(); err != nil {
		return nil, fmt.Errorf("template %q: %w", t.Name, err)
	}
	if t.Rootfs != "" || len(t.Mounts) > 0 {
		// Running such a template on the host filesystem would run it against the wrong files.
		return nil, fmt.Errorf("%w: template %q needs the namespace provider (it sets rootfs or mounts)", ErrUnavailable, t.Name)
	}
	ws := d.layout.workspaceDir(spec.ID)
	if _, err := os.Stat(ws); err != nil {
		return nil, fmt.Errorf("%w: %s", ErrNotCreated, spec.ID)
	}
	uid, gid := d.ids(spec)
	if uid >= 0 {
		if err := adoptWorkspace(ws, uid, gid); err != nil {
			return nil, err
		}
	}
	if err := d.layout.secure(spec.ID, uid, gid); err != nil {
		return nil, err
	}
	if err := d.running.claim(spec.ID); err != nil {
		return nil, err
	}
	attr := &syscall.SysProcAttr{
		// Its own session, so that Stop (and the init itself) can find every process it started
		// even after their parents died; SIGTERM on the broker's death lets the init end them.
		Setsid:    true,
		Pdeathsig: syscall.SIGTERM,
	}
	path := d.cfg.InitPath
	var extra []*os.File
	if d.asRoot {
		attr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
		// As the sandbox uid the init may not reach its binary by path (a `go test` binary lives in
		// a 0700 directory); executing the inherited fd needs no path, as in the namespace provider.
		exe, err := os.Open(d.cfg.InitPath)
		if err != nil {
			d.running.release(spec.ID)
			return nil, fmt.Errorf("start sandbox %s: %w", spec.ID, err)
		}
		extra = []*os.File{exe} // fd 4, after the control socket at 3
		path = "/proc/self/fd/" + strconv.Itoa(initFD)
	}
	cmd := &exec.Cmd{
		Path:        path,
		Args:        []string{d.cfg.InitPath, InitArg},
		Dir:         ws,
		Env:         []string{}, // the commands' environment comes in the config message
		ExtraFiles:  extra,
		SysProcAttr: attr,
	}
	env := sandboxEnv(ws, d.user, loginShell(""), nil, t.Env)
	in, err := launch(ctx, launchSpec{
		kind:    kindDir,
		cmd:     cmd,
		config:  request{Op: opConfig, Env: env, Host: true},
		limits:  resolveLimits(d.cfg.Defaults, t.Limits),
		hostWS:  ws,
		release: func() { d.running.release(spec.ID) },
	})
	if err != nil {
		return nil, err // never a typed nil in the interface
	}
	return in, nil
}

// adoptWorkspace gives a workspace that commands used to reach as another user (root for a dir
// sandbox from before they ran as the sandbox uid, the shared uid for a sandbox from before each got
// its own) to uid, so that its files stay writable from inside. It is a no-op once the workspace
// belongs to uid. Only directories, symlinks and regular files with one
// link change owner: a hard link or a device node a root tenant planted must not hand a host file
// or a disk to the sandbox uid.
func adoptWorkspace(ws string, uid, gid int) error {
	var st syscall.Stat_t
	if err := syscall.Lstat(ws, &st); err != nil {
		return fmt.Errorf("%w: %v", ErrNotCreated, err)
	}
	if int(st.Uid) == uid && int(st.Gid) == gid {
		return nil
	}
	// The workspace itself changes owner last: it is what says the walk is done, so a walk cut
	// short (a crash) runs again at the next start.
	err := filepath.WalkDir(ws, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == ws {
			return nil
		}
		if err := syscall.Lstat(p, &st); err != nil {
			return err
		}
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR, syscall.S_IFLNK:
		case syscall.S_IFREG:
			if st.Nlink != 1 {
				return nil
			}
		default:
			return nil
		}
		return os.Lchown(p, uid, gid)
	})
	if err == nil {
		err = os.Lchown(ws, uid, gid)
	}
	if err != nil {
		return fmt.Errorf("give the workspace %s to the sandbox uid %d: %w", ws, uid, err)
	}
	return nil
}
