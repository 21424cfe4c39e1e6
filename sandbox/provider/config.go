package provider

import (
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// Config is what both providers take from the broker's configuration.
type Config struct {
	// DataDir holds every sandbox: <DataDir>/sandboxes/<id>/workspace and .../state. Required and
	// absolute. For the namespace provider it and its parents must be searchable (o+x) by every sandbox uid:
	// bubblewrap runs as that user and resolves its bind sources by path.
	DataDir string
	// InitPath is the executable re-run as the resident init (default os.Executable()). Its main must
	// call RunInit when os.Args[1] == InitArg.
	InitPath string
	// RunscPath is gVisor's runsc for gvisor-level templates; "" finds it (FindRunsc: PATH, then the
	// cache scripts/runsc.sh builds into). Without one, gvisor templates are refused at create.
	RunscPath string
	// BwrapPath is the bubblewrap binary; a bare name is looked up in PATH. Default "bwrap".
	BwrapPath string
	// PastaPath is pasta (Debian package passt), the user-mode network stack that gives a
	// network: true sandbox its egress; a bare name is looked up in PATH. Default "pasta".
	PastaPath string
	// UID and GID are the host ids sandbox processes run as when the broker runs as root (default
	// 100000). Inside the sandbox they appear as 1000. When the broker is not root, sandboxes run as
	// the broker's own user and these are ignored.
	UID, GID int
	// CgroupParent is the cgroup, under each hierarchy's root, that holds one child per sandbox.
	// Default "sbx-broker".
	CgroupParent string
	// DiskReserve is the free space the data dir's filesystem must keep: below it, a create or a
	// start is refused, so the broker and the embedded Redis stay writable. 0 means the smaller of
	// DefaultDiskReserve and 5% of the filesystem; negative turns the check off.
	DiskReserve ByteSize
	// Defaults are the limits that a template's zero values fall back to. Zero fields here fall back
	// to the built-in defaults (see DefaultLimits).
	Defaults Limits
}

// Built-in limits used where neither the template nor Config.Defaults says otherwise.
const (
	DefaultMemoryBytes    = 2 << 30
	DefaultPids           = 512
	DefaultCPUs           = 2
	DefaultExecTimeout    = 10 * time.Minute
	DefaultExecTimeoutMax = time.Hour
	DefaultUID            = 100000
	DefaultGID            = 100000
	DefaultCgroupParent   = "sbx-broker"
)

// sandboxUID and sandboxGID are the ids sandbox processes have inside the namespace provider.
const (
	sandboxUID  = 1000
	sandboxGID  = 1000
	sandboxUser = "user"
	// HomePath is the sandbox user's home (HOME, and its /etc/passwd entry) in a namespace sandbox:
	// a link to homeStore, a directory in the sandbox's /tmp.
	HomePath  = "/home/" + sandboxUser
	homeStore = "/tmp/home"
)

// basePath is PATH inside every sandbox.
const basePath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// SearchPath is the PATH a sandbox of template t under provider p finds a bare program name
// through, and whether the broker knows it: the template's own PATH, else the base one the broker
// gives every sandbox it runs here. A remote provider's sandbox (a kubernetes pod) without the
// template's PATH runs its image's, which the broker does not know: known is then false.
func SearchPath(p Provider, t Template) (path string, known bool) {
	if path, ok := t.Env["PATH"]; ok {
		return path, true
	}
	if IsRemote(p) {
		return "", false
	}
	return basePath, true
}

// Errors the providers return; callers test them with errors.Is.
var (
	// ErrInvalidID is returned for a sandbox id that is not "sb_" + a UUID. No path is ever built
	// from such an id.
	ErrInvalidID = errors.New("invalid sandbox id")
	// ErrNotCreated is returned by Start for a sandbox whose Create has not run.
	ErrNotCreated = errors.New("sandbox not created")
	// ErrRunning is returned by Start and Destroy for a sandbox that is running in this provider.
	ErrRunning = errors.New("sandbox is running")
	// ErrStopped is returned by Exec once the sandbox's init has exited (Stop, a crash, a kill).
	ErrStopped = errors.New("sandbox stopped")
	// ErrMemoryLimit is ErrStopped for a sandbox that ended at its memory limit: the OOM killer took
	// its init, or memory no process holds (tmpfs, shared memory) left no room to run anything.
	ErrMemoryLimit = fmt.Errorf("%w: it reached its memory limit", ErrStopped)
	// ErrInvalidRequest is what every *InvalidRequestError is (errors.Is): Exec returns one for a
	// request that cannot run as given (bad cwd, bad environment name, both or neither of Command
	// and Argv, a cwd that does not exist).
	ErrInvalidRequest = errors.New("invalid exec request")
	// ErrUnavailable is returned when a provider cannot run on this host; the message says how to fix it.
	ErrUnavailable = errors.New("provider unavailable")
	// ErrBusy is what every *BusyError is (errors.Is).
	ErrBusy = errors.New("sandbox busy")
)

// InvalidRequestError is the error Exec returns for a request that cannot run as given. Reason says
// why in words fit for the caller (sandbox paths only, never host paths); it is
// errors.Is(err, ErrInvalidRequest).
type InvalidRequestError struct {
	Reason string
}

func (e *InvalidRequestError) Error() string { return ErrInvalidRequest.Error() + ": " + e.Reason }

// Is makes every InvalidRequestError match ErrInvalidRequest.
func (e *InvalidRequestError) Is(target error) bool { return target == ErrInvalidRequest }

// BusyError is the error Exec returns for a command refused, never started, because the sandbox
// has as many commands' streams open as it may (the gvisor level's relay bounds them); it may run
// once some end. Reason says so in words fit for the caller; it is errors.Is(err, ErrBusy).
type BusyError struct {
	Reason string
}

func (e *BusyError) Error() string { return ErrBusy.Error() + ": " + e.Reason }

// Is makes every BusyError match ErrBusy.
func (e *BusyError) Is(target error) bool { return target == ErrBusy }

// CwdError is the refusal of a command whose working directory is missing or no directory: what
// the sandbox said, and what to do about it.
func CwdError(said string) error {
	return invalidRequest("%s; the working directory must be an existing directory of the sandbox: create it first (mkdir -p) or give another", said)
}

// invalidRequest makes an *InvalidRequestError with a formatted reason.
func invalidRequest(format string, args ...any) error {
	return &InvalidRequestError{Reason: fmt.Sprintf(format, args...)}
}

// withDefaults fills zero fields and checks the rest. It is shared by both providers.
func (c Config) withDefaults() (Config, error) {
	if c.DataDir == "" {
		return c, fmt.Errorf("%w: Config.DataDir is required", ErrUnavailable)
	}
	if !filepath.IsAbs(c.DataDir) {
		return c, fmt.Errorf("%w: Config.DataDir %q must be absolute", ErrUnavailable, c.DataDir)
	}
	c.DataDir = filepath.Clean(c.DataDir)
	if c.InitPath == "" {
		exe, err := os.Executable()
		if err != nil {
			return c, fmt.Errorf("%w: find own executable for the init: %v", ErrUnavailable, err)
		}
		c.InitPath = exe
	}
	if c.BwrapPath == "" {
		c.BwrapPath = "bwrap"
	}
	if c.PastaPath == "" {
		c.PastaPath = "pasta"
	}
	if c.UID == 0 {
		c.UID = DefaultUID
	}
	if c.GID == 0 {
		c.GID = DefaultGID
	}
	if c.CgroupParent == "" {
		c.CgroupParent = DefaultCgroupParent
	}
	p := path.Clean(c.CgroupParent)
	if path.IsAbs(p) || p == "." || p == ".." || strings.HasPrefix(p, "../") {
		return c, fmt.Errorf("%w: Config.CgroupParent %q must be a relative cgroup path", ErrUnavailable, c.CgroupParent)
	}
	c.CgroupParent = p
	if err := c.Defaults.validate(); err != nil {
		return c, fmt.Errorf("%w: Config.Defaults: %v", ErrUnavailable, err)
	}
	return c, nil
}

// DefaultLimits are the built-in limits.
func DefaultLimits() Limits {
	return Limits{
		MemoryBytes:    DefaultMemoryBytes,
		Pids:           DefaultPids,
		CPUs:           DefaultCPUs,
		ExecTimeout:    Duration(DefaultExecTimeout),
		ExecTimeoutMax: Duration(DefaultExecTimeoutMax),
	}
}

// resolveLimits layers a template's limits over the broker's defaults over the built-in ones. Zero
// means "not set" at every layer.
func resolveLimits(defaults, tmpl Limits) Limits {
	out := DefaultLimits()
	for _, l := range []Limits{defaults, tmpl} {
		if l.MemoryBytes > 0 {
			out.MemoryBytes = l.MemoryBytes
		}
		if l.Pids > 0 {
			out.Pids = l.Pids
		}
		if l.CPUs > 0 {
			out.CPUs = l.CPUs
		}
		if l.ExecTimeout > 0 {
			out.ExecTimeout = l.ExecTimeout
		}
		if l.ExecTimeoutMax > 0 {
			out.ExecTimeoutMax = l.ExecTimeoutMax
		}
	}
	if out.ExecTimeout > out.ExecTimeoutMax {
		out.ExecTimeout = out.ExecTimeoutMax
	}
	return out
}

func (l Limits) validate() error {
	switch {
	case l.MemoryBytes < 0:
		return errors.New("memory_bytes must not be negative")
	case l.Pids < 0:
		return errors.New("pids must not be negative")
	case l.CPUs < 0:
		return errors.New("cpus must not be negative")
	case l.ExecTimeout < 0:
		return errors.New("exec_timeout must not be negative")
	case l.ExecTimeoutMax < 0:
		return errors.New("exec_timeout_max must not be negative")
	case l.ExecTimeout > 0 && l.ExecTimeoutMax > 0 && l.ExecTimeout > l.ExecTimeoutMax:
		return errors.New("exec_timeout must not exceed exec_timeout_max")
	}
	return nil
}

// sandboxEnv is the environment every command starts from: the base variables, then the template's.
// home differs between providers (the dir provider has no /workspace).
func sandboxEnv(home, user, shell string, extra map[string]string, tmpl map[string]string) []string {
	env := map[string]string{
		"PATH":    basePath,
		"HOME":    home,
		"USER":    user,
		"LOGNAME": user,
		"LANG":    "C.UTF-8",
		"TERM":    "xterm-256color",
		"SHELL":   shell,
	}
	for k, v := range extra {
		env[k] = v
	}
	for k, v := range tmpl {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// loginShell is bash when the root (the host's or a template rootfs) has it, else sh.
func loginShell(root string) string {
	if fi, err := os.Stat(filepath.Join(root, "/usr/bin/bash")); err == nil && fi.Mode().IsRegular() {
		return "/bin/bash"
	}
	if fi, err := os.Stat(filepath.Join(root, "/bin/bash")); err == nil && fi.Mode().IsRegular() {
		return "/bin/bash"
	}
	return "/bin/sh"
}

// validEnvName is the POSIX shape of a variable name; anything else cannot be set reliably.
func validEnvName(k string) bool {
	if k == "" {
		return false
	}
	for i, r := range k {
		switch {
		case r == '_', r >= 'A' && r <= 'Z', r >= 'a' && r <= 'z':
		case r >= '0' && r <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}
