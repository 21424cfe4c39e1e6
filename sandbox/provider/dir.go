package provider

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"os/user"
	"syscall"
)

// Dir is the plain-directory provider, for machines without namespaces: the same workspace layout
// and the same resident init, started directly on the host. There is no isolation and there are no
// limits besides exec timeouts: commands run as the broker's own user and see the whole host.
type Dir struct {
	cfg     Config
	layout  layout
	user    string
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
	d := &Dir{cfg: cfg, layout: layout{dataDir: cfg.DataDir}, user: "user"}
	if u, err := user.Current(); err == nil && u.Username != "" {
		d.user = u.Username
	}
	if err := os.MkdirAll(cfg.DataDir, 0o711); err != nil {
		return nil, fmt.Errorf("%w: data dir: %v", ErrUnavailable, err)
	}
	if err := os.Mkdir(d.layout.root(), 0o711); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("%w: data dir: %v", ErrUnavailable, err)
	}
	return d, nil
}

// Name is "dir".
func (d *Dir) Name() string { return kindDir }

// WorkspaceDir is <DataDir>/sandboxes/<id>/workspace, or "" for an invalid id.
func (d *Dir) WorkspaceDir(spec Spec) string {
	if !validID(spec.ID) {
		return ""
	}
	return d.layout.workspaceDir(spec.ID)
}

// Create makes the workspace and state directories (owned by the broker's user).
func (d *Dir) Create(ctx context.Context, spec Spec) error {
	return d.layout.create(spec.ID, -1, -1)
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
	if err := d.running.claim(spec.ID); err != nil {
		return nil, err
	}
	cmd := &exec.Cmd{
		Path: d.cfg.InitPath,
		Args: []string{d.cfg.InitPath, InitArg},
		Dir:  ws,
		Env:  []string{}, // the commands' environment comes in the config message
		SysProcAttr: &syscall.SysProcAttr{
			// Its own session, so that Stop (and the init itself) can find every process it started
			// even after their parents died; SIGTERM on the broker's death lets the init end them.
			Setsid:    true,
			Pdeathsig: syscall.SIGTERM,
		},
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
