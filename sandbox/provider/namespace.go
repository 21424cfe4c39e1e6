package provider

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// sbxDir is reserved inside the sandbox for the provider's own files.
const sbxDir = "/.sbx"

// initFD is where bwrap finds the init binary: the broker opens it and bwrap executes
// /proc/self/fd/4. bwrap 0.8 resolves every bind source by path as the unprivileged sandbox uid, so a
// binary in a private directory (a `go test` binary in /tmp/go-build*, mode 0700) could not be
// bound; executing the inherited fd needs no path at all. The init closes the fd at once, like every
// other fd it inherits.
const initFD = 4

// The fds bwrap reads as it sets the sandbox up (startFiles opens them), after the init's at 4.
const (
	// seccompFD is bwrap's --seccomp: the syscall filter (seccomp.go).
	seccompFD = 5
	// passwdFD and groupFD are copied into the sandbox as /etc/passwd and /etc/group
	// (--ro-bind-data), so that no mount inside names the state dir on the host.
	passwdFD = 6
	groupFD  = 7
	// infoFD is bwrap's --info-fd, on which it reports the sandbox's pid (see launchSpec.info).
	infoFD = 8
)

// etcFiles is the host /etc the sandbox sees: what dynamic linking, name lookup, TLS and time zones
// need, and nothing that holds a secret (no shadow, gshadow, sudoers, ssl/private, ssh).
var etcFiles = []string{
	"/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/nsswitch.conf",
	"/etc/alternatives", "/etc/ssl/certs", "/etc/ssl/openssl.cnf", "/etc/ca-certificates",
	"/etc/ca-certificates.conf", "/etc/localtime", "/etc/host.conf", "/etc/hosts", "/etc/os-release",
}

var (
	_ Provider = (*Namespace)(nil)
	_ Provider = (*Dir)(nil)
	_ Instance = (*instance)(nil)
)

// Namespace is the bubblewrap provider: each sandbox is one bwrap (pid, ipc, uts, mount, user, cgroup
// and net namespaces; a network template adds pasta, network.go) running the resident init as pid 1,
// with memory, pids and cpu limits from cgroups.
type Namespace struct {
	cfg        Config
	layout     layout
	bwrap      string
	asRoot     bool // broker is root: sandboxes run as cfg.UID/GID on the host
	cg         *cgroupHost
	hostRoot   []string // bwrap args for the host's /usr, /bin..., /etc
	procMasks  []string // bwrap args hiding and freezing parts of /proc, after --proc
	hostShell  string
	initInterp string // the init binary's ELF interpreter, "" when static
	noUserns   bool   // bwrap has --disable-userns (0.8.0 and later)
	pasta      string // the network helper for network: true templates (network.go)
	pastaErr   error  // why there is none; a network: true sandbox then fails to start
	running    running
	vol        volumes    // disk quotas (volume.go)
	gv         gvisorHost // the gvisor level (gvisor.go)
}

// NewNamespace checks what the provider needs on this host (bwrap, a reachable data dir, cgroups)
// and returns it. Cgroups that are not usable are not an error: sandboxes then run without limits,
// and LimitsEnforced says why. Preflight also starts a throwaway sandbox; NewNamespace does not.
// It ends the sandbox processes an earlier broker on the same data dir left orphaned (see
// reapOrphans), so only one provider may use a data dir at a time: the broker's lock on it.
func NewNamespace(cfg Config) (*Namespace, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	bwrap, err := exec.LookPath(cfg.BwrapPath)
	if err != nil {
		return nil, fmt.Errorf("%w: bwrap not found (%s): install bubblewrap: apt-get install -y bubblewrap", ErrUnavailable, cfg.BwrapPath)
	}
	if err := checkExecutable(cfg.InitPath); err != nil {
		return nil, err
	}
	n := &Namespace{
		cfg:       cfg,
		layout:    layout{dataDir: cfg.DataDir},
		bwrap:     bwrap,
		asRoot:    os.Geteuid() == 0,
		hostShell: loginShell(""),
	}
	if err := n.prepareDataDir(); err != nil {
		return nil, err
	}
	reapOrphans(orphanMarker(cfg.DataDir)) // before the cgroup sweep, which then finds them empty
	n.cg = detectCgroups(cfg.CgroupParent)
	n.cg.sweepStale(staleCgroupAge)
	n.hostRoot = hostRootArgs()
	n.procMasks = procMaskArgs("/proc")
	n.noUserns = bwrapAtLeast(bwrap, 0, 8)
	if _, err := sandboxFilter(); err != nil {
		return nil, err
	}
	n.initInterp = elfInterp(cfg.InitPath)
	if err := n.initVolumes(); err != nil {
		return nil, err
	}
	if n.pasta, err = exec.LookPath(cfg.PastaPath); err != nil {
		n.pastaErr = fmt.Errorf("sandbox network: the template allows the network and pasta was not found (%s): install it: apt-get install -y passt", cfg.PastaPath)
	}
	n.initGvisor()
	return n, nil
}

func (n *Namespace) prepareDataDir() error {
	if err := os.MkdirAll(n.cfg.DataDir, 0o711); err != nil {
		return fmt.Errorf("%w: data dir: %v", ErrUnavailable, err)
	}
	if err := os.Mkdir(n.layout.root(), 0o711); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%w: data dir: %v", ErrUnavailable, err)
	}
	uid, gid := os.Geteuid(), os.Getegid()
	if n.asRoot {
		uid, gid = n.cfg.UID, n.cfg.GID
	}
	if err := searchable(n.layout.root(), uid, gid); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}

// Name is "namespace".
func (n *Namespace) Name() string { return kindNamespace }

// LimitsEnforced reports whether memory, pids and cpu limits are enforced, and if not, why.
func (n *Namespace) LimitsEnforced() (bool, string) { return n.cg.enforced(), n.cg.reason }

// WorkspaceDir is <DataDir>/sandboxes/<id>/workspace, or "" for an invalid id.
func (n *Namespace) WorkspaceDir(spec Spec) string {
	if !validID(spec.ID) {
		return ""
	}
	return n.layout.workspaceDir(spec.ID)
}

// ids are the host uid and gid the sandbox runs as, -1 when it runs as the broker's user.
func (n *Namespace) ids(spec Spec) (int, int) {
	return hostIDs(n.asRoot, n.cfg, spec)
}

// hostIDs is the sandbox's own uid (spec.UID) under a root broker, the shared Config.UID/GID for a
// sandbox that has none, and -1, -1 (the broker's user) under any other broker.
func hostIDs(asRoot bool, cfg Config, spec Spec) (int, int) {
	switch {
	case !asRoot:
		return -1, -1
	case spec.UID > 0:
		return spec.UID, spec.UID
	}
	return cfg.UID, cfg.GID
}

// Create makes the workspace (owned by the sandbox uid) and the state dir with the sandbox's
// /etc/passwd and /etc/group.
func (n *Namespace) Create(ctx context.Context, spec Spec) error {
	uid, gid := n.ids(spec)
	if err := checkReserve(n.cfg.DataDir, n.vol.reserve); err != nil {
		return fmt.Errorf("create sandbox %s: %w", spec.ID, err)
	}
	if err := n.layout.create(spec.ID, uid, gid); err != nil {
		return err
	}
	if err := n.createVolume(spec.ID, spec.Template.Disk, uid, gid); err != nil {
		return err
	}
	return n.writeIdentity(spec)
}

// writeIdentity writes the passwd and group files bound over /etc/passwd and /etc/group, so that
// `id`, `whoami` and shells see a named user with the workspace as home.
func (n *Namespace) writeIdentity(spec Spec) error {
	shell := n.hostShell
	if spec.Template.Rootfs != "" {
		shell = loginShell(spec.Template.Rootfs)
	}
	state := n.layout.stateDir(spec.ID)
	files := map[string]string{
		"passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n" +
			fmt.Sprintf("%s:x:%d:%d:sandbox user:%s:%s\n", sandboxUser, sandboxUID, sandboxGID, HomePath, shell) +
			"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
		"group": "root:x:0:\n" + fmt.Sprintf("%s:x:%d:\n", sandboxUser, sandboxGID) + "nogroup:x:65534:\n",
	}
	for name, content := range files {
		tmp := filepath.Join(state, "."+name+".tmp")
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			return fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
		if err := os.Rename(tmp, filepath.Join(state, name)); err != nil {
			return fmt.Errorf("create sandbox %s: %w", spec.ID, err)
		}
	}
	return nil
}

// Destroy removes the sandbox's directories and any cgroup of it still there. It refuses invalid
// ids and running sandboxes.
func (n *Namespace) Destroy(ctx context.Context, spec Spec) error {
	if !validID(spec.ID) {
		return fmt.Errorf("%w: %q", ErrInvalidID, spec.ID)
	}
	if n.running.isRunning(spec.ID) {
		return fmt.Errorf("%w: %s", ErrRunning, spec.ID)
	}
	n.payRefill(spec.ID) // created, never started
	if err := n.unmountVolume(spec.ID); err != nil {
		return err
	}
	if err := n.layout.destroy(spec.ID, &n.running); err != nil {
		return err
	}
	return n.cg.removeLeftover(spec.ID)
}

// Start starts bwrap with the init, moves it into the sandbox's cgroups and takes the environment
// snapshot.
func (n *Namespace) Start(ctx context.Context, spec Spec) (Instance, error) {
	if !validID(spec.ID) {
		return nil, fmt.Errorf("%w: %q", ErrInvalidID, spec.ID)
	}
	defer n.payRefill(spec.ID)
	if err := spec.Template.validateContent(); err != nil {
		return nil, fmt.Errorf("template %q: %w", spec.Template.Name, err)
	}
	gvisor := LevelOf(spec.Template) == IsolationGvisor
	if err := CheckIsolation(n, spec.Template); err != nil {
		return nil, err // never a weaker level than the one asked for
	}
	if spec.Template.Network.Enabled && !n.asRoot {
		return nil, errNetworkNeedsRoot(spec.Template.Name)
	}
	ws := n.layout.workspaceDir(spec.ID)
	if _, err := os.Stat(ws); err != nil {
		return nil, fmt.Errorf("%w: %s", ErrNotCreated, spec.ID)
	}
	if err := checkReserve(n.cfg.DataDir, n.vol.reserve); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", spec.ID, err)
	}
	if err := n.mountVolume(spec.ID); err != nil {
		return nil, err
	}
	uid, gid := n.ids(spec)
	if uid >= 0 {
		// A sandbox that ran as the shared uid and now has its own (or moved uids) gets its files:
		// inside, files of another host uid would be nobody's and read-only.
		if err := adoptWorkspace(ws, uid, gid); err != nil {
			return nil, err
		}
	}
	if err := n.layout.secure(spec.ID, uid, gid); err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(n.layout.stateDir(spec.ID), "passwd")); err != nil {
		if err := n.writeIdentity(spec); err != nil {
			return nil, err
		}
	}
	if err := n.running.claim(spec.ID); err != nil {
		return nil, err
	}
	release := func() { n.running.release(spec.ID) }
	if gvisor {
		return n.startGvisor(ctx, spec, release)
	}
	limits := resolveLimits(n.cfg.Defaults, spec.Template.Limits)
	cg, err := n.cg.create(spec.ID, limits)
	if err != nil {
		release()
		return nil, err
	}
	fail := func(err error) (Instance, error) {
		cg.remove()
		release()
		return nil, err
	}
	files, err := n.startFiles(spec)
	if err != nil {
		return fail(err)
	}
	closeFiles := func() {
		for _, f := range files {
			f.Close()
		}
	}
	var info, infoW *os.File
	var pre []string
	// Born in its cgroups, the sandbox's cgroup namespace is rooted at them; otherwise bwrap and its
	// child are moved there as soon as bwrap names the child.
	placed := cg.placeable()
	if cg != nil && !placed {
		if info, infoW, err = os.Pipe(); err != nil {
			closeFiles()
			return fail(err)
		}
		pre = []string{"--info-fd", strconv.Itoa(infoFD)}
	}
	cmd, err := n.command(spec, pre, []string{"/proc/self/fd/" + strconv.Itoa(initFD), InitArg})
	if err == nil {
		var exe *os.File
		if exe, err = os.Open(n.cfg.InitPath); err == nil {
			// fd 4, after the control socket at 3, then startFiles from seccompFD on, then infoFD.
			cmd.ExtraFiles = append([]*os.File{exe}, files...)
			if infoW != nil {
				cmd.ExtraFiles = append(cmd.ExtraFiles, infoW)
			}
			if err = hideArgs(cmd); err != nil {
				exe.Close()
			}
		}
	}
	if err != nil {
		closeFiles()
		if info != nil {
			info.Close()
			infoW.Close()
		}
		return fail(err)
	}
	shell := n.hostShell
	if spec.Template.Rootfs != "" {
		shell = loginShell(spec.Template.Rootfs)
	}
	env := sandboxEnv(HomePath, sandboxUser, shell, map[string]string{"HOSTNAME": "sandbox"}, spec.Template.Env)
	var network func(context.Context, int) (func(), error)
	if spec.Template.Network.Enabled {
		network = func(ctx context.Context, pid int) (func(), error) {
			h, err := n.startNetwork(ctx, spec, pid, spec.Template.Network)
			if err != nil {
				return nil, err
			}
			return h.stop, nil
		}
	}
	in, err := launch(ctx, launchSpec{
		kind:    kindNamespace,
		cmd:     cmd,
		config:  request{Op: opConfig, Env: env},
		cg:      cg,
		limits:  limits,
		release: release,
		info:    info,
		placed:  placed,
		network: network,
	})
	if err != nil {
		return nil, err
	}
	return in, nil
}

// startFiles opens what bwrap reads while it sets the sandbox up, in fd order from seccompFD: the
// syscall filter and the sandbox's passwd and group files.
func (n *Namespace) startFiles(spec Spec) ([]*os.File, error) {
	filter, err := filterFile()
	if err != nil {
		return nil, err
	}
	files := []*os.File{filter}
	state := n.layout.stateDir(spec.ID)
	for _, name := range []string{"passwd", "group"} {
		f, err := os.Open(filepath.Join(state, name))
		if err != nil {
			for _, f := range files {
				f.Close()
			}
			return nil, fmt.Errorf("start sandbox %s: %w", spec.ID, err)
		}
		files = append(files, f)
	}
	return files, nil
}

// command is the bwrap process for a sandbox running argv. The benchmarks use it to compare with a
// bwrap per command.
func (n *Namespace) command(spec Spec, pre, argv []string) (*exec.Cmd, error) {
	args, err := n.bwrapArgs(spec, argv)
	if err != nil {
		return nil, err
	}
	args = append(pre, args...)
	attr := &syscall.SysProcAttr{
		// Belt and braces with --die-with-parent: if the broker dies, so does bwrap, and with it
		// the whole pid namespace.
		Pdeathsig: syscall.SIGKILL,
	}
	if uid, gid := n.ids(spec); uid >= 0 {
		// bwrap then runs unprivileged and maps this uid to 1000 inside its user namespace, so
		// nothing in the sandbox is root on the host, not even through a kernel bug in the mapping.
		// Each sandbox has its own uid, so no per-uid kernel object (keyrings, inotify and user
		// namespace counts, RLIMIT_NPROC, signals) is shared with another sandbox.
		attr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	}
	return &exec.Cmd{
		Path:        n.bwrap,
		Args:        append([]string{"bwrap"}, args...),
		Dir:         "/",
		Env:         []string{orphanMarker(n.cfg.DataDir)}, // found by reapOrphans if orphaned
		SysProcAttr: attr,
	}, nil
}

// bwrapArgs is the sandbox's shape. Order matters to bwrap: later mounts go on top of earlier ones,
// and / is made read-only last.
func (n *Namespace) bwrapArgs(spec Spec, argv []string) ([]string, error) {
	t := spec.Template
	a := []string{
		"--unshare-user", "--uid", strconv.Itoa(sandboxUID), "--gid", strconv.Itoa(sandboxGID),
		"--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
		"--die-with-parent", "--new-session",
		"--seccomp", strconv.Itoa(seccompFD),
		// The init is pid 1: when it dies the kernel kills everything in the namespace, orphans
		// come to it, and there is no bwrap reaper process in between.
		"--as-pid-1",
		"--hostname", "sandbox",
	}
	if n.noUserns {
		// No user namespace can be made inside (bwrap sets the sandbox's user namespace limit),
		// belt and braces with the filter's refusal of CLONE_NEWUSER: one sandbox could otherwise
		// pin every user namespace the host allows, and then no sandbox could start.
		a = append(a, "--disable-userns")
	}
	// Every sandbox has its own network namespace; with network: true, pasta attaches to it
	// (network.go). The host's is never shared: its loopback is where the broker and Redis listen.
	a = append(a, "--unshare-net")
	bindIdentity := true
	if t.Rootfs == "" {
		a = append(a, n.hostRoot...)
		if t.Network.Enabled {
			a = append(a, "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf")
		}
	} else {
		ra, hasEtcFiles, err := n.rootfsArgs(t)
		if err != nil {
			return nil, err
		}
		a = append(a, ra...)
		bindIdentity = hasEtcFiles
	}
	if bindIdentity {
		a = append(a,
			"--ro-bind-data", strconv.Itoa(passwdFD), "/etc/passwd",
			"--ro-bind-data", strconv.Itoa(groupFD), "/etc/group")
	}
	a = append(a, "--proc", "/proc")
	a = append(a, n.procMasks...)
	// /tmp and /dev/shm are sized (volume.go): their pages count against the memory limit, and a
	// full one must answer ENOSPC rather than have the limit kill the sandbox.
	tmpSize := strconv.FormatInt(tmpfsSize(t, resolveLimits(n.cfg.Defaults, t.Limits)), 10)
	a = append(a,
		"--dev", "/dev",
		"--size", tmpSize, "--tmpfs", "/dev/shm",
		"--size", tmpSize, "--tmpfs", "/tmp",
		// The user's home is outside the workspace, so that tools' dotfiles and caches
		// (~/.gitconfig, ~/.npm) stay out of the project; it lives in /tmp's tmpfs (its size and
		// memory accounting) and, like /tmp, starts empty on each start.
		"--perms", "0700", "--dir", homeStore,
		"--symlink", homeStore, HomePath,
		"--bind", n.layout.workspaceDir(spec.ID), WorkspacePath)
	for _, m := range t.Mounts {
		a = append(a, "--ro-bind", m.Source, path.Clean(m.Target))
	}
	a = append(a,
		// Our root is a tmpfs holding only what is listed above; nothing may be added to it.
		"--remount-ro", "/",
		"--chdir", WorkspacePath,
		"--clearenv",
		// The init keeps the marker bwrap started with, so reapOrphans finds it after bwrap is gone.
		"--setenv", orphanEnv, orphanValue(n.cfg.DataDir),
		"--")
	return append(a, argv...), nil
}

// rootfsArgs binds a template's rootfs entry by entry on bwrap's tmpfs root, rather than the whole
// rootfs on /: a read-only / would leave no place to create /workspace and the other mount points.
// It reports whether the rootfs can take our /etc/passwd and /etc/group.
func (n *Namespace) rootfsArgs(t Template) ([]string, bool, error) {
	if n.initInterp != "" {
		if _, err := os.Stat(filepath.Join(t.Rootfs, n.initInterp)); err != nil {
			return nil, false, fmt.Errorf("template %q: the init binary %s is dynamically linked and the rootfs has no %s: install sbx-init (static: CGO_ENABLED=0 go build ./cmd/sbx-init) next to the broker, or add the host's libc to the rootfs", t.Name, n.cfg.InitPath, n.initInterp)
		}
	}
	entries, err := os.ReadDir(t.Rootfs)
	if err != nil {
		return nil, false, fmt.Errorf("template %q: rootfs: %w", t.Name, err)
	}
	var a []string
	hasEtc := false
	for _, e := range entries {
		name := e.Name()
		switch name {
		case "proc", "dev", "tmp", "sys", "workspace", ".sbx", "home":
			continue
		}
		src, dst := filepath.Join(t.Rootfs, name), "/"+name
		switch {
		case e.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(src)
			if err != nil {
				return nil, false, fmt.Errorf("template %q: rootfs: %w", t.Name, err)
			}
			a = append(a, "--symlink", target, dst)
		default:
			a = append(a, "--ro-bind", src, dst)
			if name == "etc" && e.IsDir() {
				hasEtc = true
			}
		}
	}
	if !hasEtc {
		return append(a, "--perms", "0755", "--dir", "/etc"), true, nil
	}
	// Inside a read-only bind we can only mount over files that exist.
	for _, f := range []string{"passwd", "group"} {
		if fi, err := os.Stat(filepath.Join(t.Rootfs, "etc", f)); err != nil || !fi.Mode().IsRegular() {
			return a, false, nil
		}
	}
	if t.Network.Enabled {
		if _, err := os.Stat(filepath.Join(t.Rootfs, "etc", "resolv.conf")); err == nil {
			a = append(a, "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf")
		}
	}
	return a, true, nil
}

// Docker's masked and read-only paths under /proc (its OCI defaults). The masked ones tell about the
// host's kernel, hardware and other tenants (/proc/keys lists every keyring the uid can see,
// /proc/timer_list other processes' timers, /proc/kcore is the kernel's memory); the read-only ones
// are the kernel's knobs. /sys is not mounted in a sandbox at all, so Docker's /sys/firmware needs
// nothing here.
var (
	procMasked = []string{"asound", "acpi", "kcore", "keys", "latency_stats", "timer_list",
		"timer_stats", "sched_debug", "scsi"}
	procReadOnly = []string{"bus", "fs", "irq", "sys", "sysrq-trigger"}
)

// procMaskArgs are the bwrap args, after --proc, that mask procMasked (a directory under an empty
// read-only tmpfs, a file under /dev/null, which reads as permission denied on the nodev mount) and
// make procReadOnly read-only. Only what this kernel has is listed: bwrap cannot mount on a missing
// path, and the sandbox's proc shows what the host's does. The read-only binds come from the
// host's proc: proc's sysctl, irq and bus files answer for the reader's namespaces, not the mount's.
func procMaskArgs(hostProc string) []string {
	var a []string
	for _, name := range procMasked {
		fi, err := os.Stat(filepath.Join(hostProc, name))
		switch {
		case err != nil:
		case fi.IsDir():
			a = append(a, "--tmpfs", "/proc/"+name, "--remount-ro", "/proc/"+name)
		default:
			a = append(a, "--ro-bind", "/dev/null", "/proc/"+name)
		}
	}
	for _, name := range procReadOnly {
		if _, err := os.Stat(filepath.Join(hostProc, name)); err == nil {
			a = append(a, "--ro-bind", filepath.Join(hostProc, name), "/proc/"+name)
		}
	}
	return a
}

// hostRootArgs replicates the host's /usr and its top-level links (on merged-/usr hosts /bin is a
// symlink to usr/bin; elsewhere it is a real directory and is bound) and a minimal /etc.
func hostRootArgs() []string {
	a := []string{"--ro-bind", "/usr", "/usr"}
	for _, d := range []string{"/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"} {
		fi, err := os.Lstat(d)
		switch {
		case err != nil:
		case fi.Mode()&fs.ModeSymlink != 0:
			if target, err := os.Readlink(d); err == nil {
				a = append(a, "--symlink", target, d)
			}
		case fi.IsDir():
			a = append(a, "--ro-bind", d, d)
		}
	}
	a = append(a, "--perms", "0755", "--dir", "/etc")
	for _, f := range etcFiles {
		a = append(a, "--ro-bind-try", f, f)
	}
	return a
}

// bwrapAtLeast reports whether `bwrap --version` ("bubblewrap 0.8.0") is major.minor or newer.
func bwrapAtLeast(bwrap string, major, minor int) bool {
	out, err := exec.Command(bwrap, "--version").Output()
	if err != nil {
		return false
	}
	var ma, mi int
	if _, err := fmt.Sscanf(string(out), "bubblewrap %d.%d", &ma, &mi); err != nil {
		return false
	}
	return ma > major || ma == major && mi >= minor
}

// searchable checks that uid/gid may traverse every directory from dir up to /, the way the kernel
// decides: the owner bits for the owner, the group bits for the group, else the other bits.
func searchable(dir string, uid, gid int) error {
	for p := dir; ; p = filepath.Dir(p) {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return fmt.Errorf("data dir: %s: %v", p, err)
		}
		var ok bool
		switch {
		case uid == 0:
			ok = true
		case int(st.Uid) == uid:
			ok = st.Mode&0o100 != 0
		case int(st.Gid) == gid:
			ok = st.Mode&0o010 != 0
		default:
			ok = st.Mode&0o001 != 0
		}
		if !ok {
			return fmt.Errorf("data dir: %s (mode %04o, owner %d) is not searchable by the sandbox uid %d, and bwrap needs to reach the workspaces as that user: chmod o+x %s, or choose another --data-dir",
				p, st.Mode&0o7777, st.Uid, uid, p)
		}
		if p == "/" || p == "." {
			return nil
		}
	}
}

func checkExecutable(p string) error {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return fmt.Errorf("%w: init binary %s: %v", ErrUnavailable, p, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Mode&0o111 == 0 {
		return fmt.Errorf("%w: init binary %s is not an executable file", ErrUnavailable, p)
	}
	return nil
}

// elfInterp returns the program interpreter (dynamic loader) an ELF binary needs, "" if static.
func elfInterp(p string) string {
	f, err := elf.Open(p)
	if err != nil {
		return ""
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			b := make([]byte, prog.Filesz)
			if _, err := prog.ReadAt(b, 0); err == nil {
				if i := len(b); i > 0 && b[i-1] == 0 {
					b = b[:i-1]
				}
				return string(b)
			}
		}
	}
	return ""
}
