package provider

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider/sbxinit"
	"golang.org/x/sys/unix"
)

// Isolation levels a template may ask for (Template.Isolation).
const (
	IsolationNamespace = protocol.IsolationNamespace
	IsolationGvisor    = protocol.IsolationGvisor
	IsolationMicroVM   = protocol.IsolationMicroVM
)

// ErrIsolationUnavailable is a template asking for an isolation level this host cannot give. The
// sandbox is refused: nothing ever runs it at a weaker level.
var ErrIsolationUnavailable = errors.New("isolation level unavailable on this host")

// LevelOf is the isolation level a template asks for ("" is namespace).
func LevelOf(t Template) string {
	if t.Isolation == "" {
		return IsolationNamespace
	}
	return t.Isolation
}

// Runner is the name recorded on a sandbox for what runs it: the provider's name, or "gvisor" for a
// namespace provider's sandbox at the gvisor level. Resume reads it back (RecordedIsolation), so a
// sandbox keeps the level it was created at whatever its template says later.
func Runner(p Provider, t Template) string {
	if p.Name() == kindNamespace && LevelOf(t) == IsolationGvisor {
		return kindGvisor
	}
	return p.Name()
}

// RecordedIsolation is the level a sandbox recorded with runner name r runs at, "" when r names no
// level the provider chooses between (dir).
func RecordedIsolation(r string) string {
	switch r {
	case kindGvisor:
		return IsolationGvisor
	case kindNamespace:
		return IsolationNamespace
	}
	return ""
}

// CheckIsolation says whether p can run sandboxes at the template's level, and if not, what the
// host needs. It is asked at create, before anything exists.
func CheckIsolation(p Provider, t Template) error {
	level := LevelOf(t)
	switch level {
	case IsolationMicroVM:
		return fmt.Errorf("%w: isolation microvm needs /dev/kvm and a microVM runtime (Firecracker or Cloud Hypervisor), which this broker does not run yet; use isolation gvisor for a kernel between the sandbox and the host", ErrIsolationUnavailable)
	case IsolationNamespace:
		if p.Name() == kindDir {
			// The dir provider's sandboxes are its own kind; the broker's --provider says so.
			return nil
		}
		return nil
	case IsolationGvisor:
		n, ok := p.(*Namespace)
		if !ok {
			return fmt.Errorf("%w: isolation gvisor needs the namespace provider (this broker runs %q): start the broker with --provider namespace on a host where bubblewrap and runsc work", ErrIsolationUnavailable, p.Name())
		}
		if n.gv.err != nil {
			return fmt.Errorf("%w: %v", ErrIsolationUnavailable, n.gv.err)
		}
		if t.Network.Enabled {
			if n.pastaErr != nil {
				return fmt.Errorf("%w: template %q asks for isolation gvisor with the network on: %v", ErrIsolationUnavailable, t.Name, n.pastaErr)
			}
			if n.gv.netErr != nil {
				return fmt.Errorf("%w: template %q asks for isolation gvisor with the network on: %v", ErrIsolationUnavailable, t.Name, n.gv.netErr)
			}
		}
		return nil
	}
	return fmt.Errorf("%w: isolation %q is not a level: use namespace, gvisor or microvm", ErrIsolationUnavailable, level)
}

// Levels are the isolation levels p offers on this host, and why the others are missing.
func Levels(p Provider) (offered []string, missing map[string]string) {
	missing = map[string]string{}
	if p.Name() == kindDir {
		missing[IsolationNamespace] = "the dir provider isolates nothing"
	} else {
		offered = append(offered, IsolationNamespace)
	}
	if err := CheckIsolation(p, Template{Isolation: IsolationGvisor}); err != nil {
		missing[IsolationGvisor] = strings.TrimPrefix(err.Error(), ErrIsolationUnavailable.Error()+": ")
	} else {
		offered = append(offered, IsolationGvisor)
	}
	missing[IsolationMicroVM] = "needs /dev/kvm and a microVM runtime"
	return offered, missing
}

// gvisorHost is what the gvisor level found on this host: runsc, or why there is none.
type gvisorHost struct {
	runsc string
	err   error
	skel  string // the read-only skeleton root: mount points and the host's top-level links

	unshare string // unshare(1), which makes a network sandbox's namespaces (gvisor_network.go)
	nsenter string // nsenter(1) and ip(8), which set up its interfaces
	ip      string
	netErr  error // why any is missing: gvisor templates with the network are then refused

	usrMu    sync.Mutex
	usrBound bool // the host's /usr is bound into skel (bindUsr), at the first gvisor start
}

// RunscCacheDir is where scripts/runsc.sh puts runsc: <cache>/sbx-broker/runsc-<version>/runsc.
func RunscCacheDir() string {
	base := os.Getenv("XDG_CACHE_HOME")
	if base == "" {
		home, _ := os.UserHomeDir()
		base = filepath.Join(home, ".cache")
	}
	return filepath.Join(base, "sbx-broker")
}

// FindRunsc is the runsc the broker uses: path when given (broker --runsc), else runsc in PATH, else
// the newest that scripts/runsc.sh built into its cache. It must be a static build: a cgo runsc
// fails at sandbox start.
func FindRunsc(path string) (string, error) {
	const install = "build it with scripts/runsc.sh (a static runsc from the Go module proxy, cached under " +
		"~/.cache/sbx-broker), or pass broker --runsc PATH"
	if path == "" {
		if p, err := exec.LookPath("runsc"); err == nil {
			path = p
		} else {
			matches, _ := filepath.Glob(filepath.Join(RunscCacheDir(), "runsc-*", "runsc"))
			sort.Slice(matches, func(i, j int) bool { return modTime(matches[i]).After(modTime(matches[j])) })
			if len(matches) == 0 {
				return "", fmt.Errorf("runsc (gVisor) not found in PATH nor in %s: %s", RunscCacheDir(), install)
			}
			path = matches[0]
		}
	}
	if err := checkExecutable(path); err != nil {
		return "", fmt.Errorf("runsc %s: %v: %s", path, err, install)
	}
	if interp := elfInterp(path); interp != "" {
		return "", fmt.Errorf("runsc %s is dynamically linked (%s), and a cgo runsc fails at sandbox start: %s", path, interp, install)
	}
	return path, nil
}

func modTime(p string) time.Time {
	fi, err := os.Stat(p)
	if err != nil {
		return time.Time{}
	}
	return fi.ModTime()
}

// initGvisor finds runsc and prepares the skeleton root. A host without them still runs namespace
// sandboxes; gvisor ones are refused with n.gv.err.
func (n *Namespace) initGvisor() {
	switch {
	case !n.asRoot:
		n.gv.err = errors.New("the gvisor level needs the broker to run as root (runsc sets up its sandbox and gofer with root's privileges)")
		return
	case os.Getenv("SBX_DISABLE_GVISOR") != "":
		n.gv.err = errors.New("the gvisor level is turned off (SBX_DISABLE_GVISOR)")
		return
	}
	runsc, err := FindRunsc(n.cfg.RunscPath)
	if err != nil {
		n.gv.err = err
		return
	}
	skel := filepath.Join(n.cfg.DataDir, "gvisor-root")
	if err := writeSkeleton(skel); err != nil {
		n.gv.err = fmt.Errorf("gvisor root: %w", err)
		return
	}
	n.gv.runsc, n.gv.skel = runsc, skel
	n.gv.unshare, err = exec.LookPath("unshare")
	if err == nil {
		n.gv.nsenter, err = exec.LookPath("nsenter")
	}
	if err != nil {
		n.gv.netErr = errors.New("the gvisor level's network needs unshare(1) and nsenter(1) (util-linux): apt-get install -y util-linux")
	} else if n.gv.ip, err = exec.LookPath("ip"); err != nil {
		n.gv.netErr = errors.New("the gvisor level's network needs ip(8) (iproute2): apt-get install -y iproute2")
	}
	n.reapGvisor()
}

// writeSkeleton makes the read-only root of a gvisor sandbox: the host's top-level links (/bin ->
// usr/bin), and an empty file or directory at every mount point, so that nothing has to be created
// in a read-only root.
func writeSkeleton(dir string) error {
	// The old skeleton holds the host's /usr (bindUsr): detach it before anything is removed, and
	// remove nothing while any mount is left under it.
	UnmountUnder(dir)
	if m := mountsAt(filepath.Join(dir, "usr")); len(m) > 0 {
		return fmt.Errorf("%s is still mounted; not rewriting the skeleton over it", m[0])
	}
	tmp := dir + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return err
	}
	dirs := []string{"usr", "etc", "proc", "dev", "tmp", "workspace", "home/" + sandboxUser, strings.TrimPrefix(sbxDir, "/")}
	for _, d := range []string{"/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"} {
		fi, err := os.Lstat(d)
		switch {
		case err != nil:
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(d)
			if err != nil {
				return err
			}
			if err := os.Symlink(target, filepath.Join(tmp, d)); err != nil {
				return err
			}
		case fi.IsDir():
			dirs = append(dirs, d[1:])
		}
	}
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(tmp, d), 0o755); err != nil {
			return err
		}
	}
	files := []string{sbxDir + "/init", "/etc/passwd", "/etc/group"}
	for _, f := range etcFiles {
		fi, err := os.Stat(f)
		switch {
		case err != nil:
		case fi.IsDir():
			if err := os.MkdirAll(filepath.Join(tmp, f), 0o755); err != nil {
				return err
			}
		default:
			files = append(files, f)
		}
	}
	for _, f := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(tmp, f)), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(tmp, f), nil, 0o644); err != nil {
			return err
		}
	}
	os.RemoveAll(dir)
	return os.Rename(tmp, dir)
}

// bindUsr binds the host's /usr read-only at the skeleton's usr, at the first gvisor start (a data
// dir that never runs one never holds the mount). The skeleton is the
// root mount, which runsc serves with exclusive file access: the sentry caches its dentries and
// pages, so an exec's loading of binaries and libraries costs no gofer round trip each time (a
// bind mount in the spec is served shared, revalidated at every access: a fork+exec of /bin/true
// inside took more than twice as long).
// /usr changes only when the host's packages do; a sandbox sees such a change at its next start.
func bindUsr(skel string) error {
	usr := filepath.Join(skel, "usr")
	if len(mountsAt(usr)) > 0 {
		return nil
	}
	if err := unix.Mount("/usr", usr, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind /usr: %w", err)
	}
	if err := unix.Mount("", usr, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		unix.Unmount(usr, unix.MNT_DETACH)
		return fmt.Errorf("bind /usr read-only: %w", err)
	}
	return nil
}

// mountsAt lists the mount points at exactly p.
func mountsAt(p string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && unescapeMount(f[4]) == p {
			out = append(out, p)
		}
	}
	return out
}

// gvisorDir is a sandbox's runsc state (its --root) and bundle: <state>/gvisor.
func (n *Namespace) gvisorDir(id string) string {
	return filepath.Join(n.layout.stateDir(id), "gvisor")
}

// startGvisor runs the sandbox under runsc: the same layout as a namespace sandbox (the host's /usr
// or the template's rootfs read-only, /workspace the host directory, shared both ways), limits in
// the OCI spec's cgroups, no network (or, with network on, gVisor's netstack in the namespace
// gvisor_network.go prepares), and the same resident init behind sbxinit's bridge.
func (n *Namespace) startGvisor(ctx context.Context, spec Spec, release func()) (Instance, error) {
	if spec.Template.Rootfs == "" {
		n.gv.usrMu.Lock()
		if !n.gv.usrBound {
			if err := bindUsr(n.gv.skel); err != nil {
				n.gv.usrMu.Unlock()
				release()
				return nil, fmt.Errorf("gvisor root: %w", err)
			}
			n.gv.usrBound = true
		}
		n.gv.usrMu.Unlock()
	}
	dir := n.gvisorDir(spec.ID)
	n.removeGvisorState(spec.ID) // a leftover from a crash would make runsc refuse the id
	if err := os.MkdirAll(filepath.Join(dir, "root"), 0o700); err != nil {
		release()
		return nil, err
	}
	uid, gid := n.ids(spec)
	if uid < 0 {
		uid, gid = sandboxUID, sandboxGID
	}
	shell := n.hostShell
	if spec.Template.Rootfs != "" {
		shell = loginShell(spec.Template.Rootfs)
	}
	// Inside gVisor the sandbox user has its host uid: the gofer creates workspace files with the
	// sandbox's uid, and the broker's own file operations give files that same owner.
	ident := map[string]string{
		"passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n" +
			fmt.Sprintf("%s:x:%d:%d:sandbox user:%s:%s\n", sandboxUser, uid, gid, HomePath, shell) +
			"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
		"group": "root:x:0:\n" + fmt.Sprintf("%s:x:%d:\n", sandboxUser, gid) + "nogroup:x:65534:\n",
	}
	for name, content := range ident {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			release()
			return nil, err
		}
	}
	limits := resolveLimits(n.cfg.Defaults, spec.Template.Limits)
	env := sandboxEnv(HomePath, sandboxUser, shell, map[string]string{"HOSTNAME": "sandbox"}, spec.Template.Env)
	var netns string
	if spec.Template.Network.Enabled {
		netns = filepath.Join(dir, gvisorNetnsFile)
	}
	oci, err := n.gvisorSpec(spec, dir, uid, gid, limits, env, netns)
	if err != nil {
		release()
		return nil, err
	}
	b, _ := json.MarshalIndent(oci, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600); err != nil {
		release()
		return nil, err
	}
	// The sandbox's cgroups are the broker's own, made here with the limits (pids counting gVisor's
	// own threads) and named in the spec: runsc joins them, adds the controllers it wants and
	// removes only those. Ours outlive runsc's cleanup, so that the end of a sandbox can still read
	// whether the memory limit's OOM killer took its sentry.
	hostLimits := limits
	hostLimits.Pids = 2*limits.Pids + gvisorPidsBase
	cg, err := n.cg.create(spec.ID, hostLimits)
	if err != nil {
		release()
		return nil, err
	}
	release = func(release func()) func() {
		return func() { cg.remove(); release() }
	}(release)
	if netns != "" {
		h, err := n.startGvisorNetwork(ctx, spec, netns, uid, gid)
		if err != nil {
			n.removeGvisorState(spec.ID)
			release()
			return nil, err
		}
		// After runsc and its state (the namespace's mount) are gone: the namespace, its tap and
		// its rules end with the last of them.
		release = func(release func()) func() {
			return func() { h.stop(); release() }
		}(release)
	}
	cmd := &exec.Cmd{
		Path: n.gv.runsc,
		Args: append([]string{"runsc"}, append(n.runscFlags(spec.ID, spec.Template), "run", "--bundle", dir, spec.ID)...),
		Dir:  "/",
		Env:  []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", orphanMarker(n.cfg.DataDir)},
		// If the broker dies, runsc run dies, and its attached sandbox and gofer with it.
		SysProcAttr: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setsid: true},
	}
	return launch(ctx, launchSpec{
		kind:   kindGvisor,
		cmd:    cmd,
		config: request{Op: opConfig, Env: env, UID: uid, GID: gid},
		limits: limits,
		relay:  true,
		id:     spec.ID,
		release: func() {
			n.removeGvisorState(spec.ID)
			release()
		},
		lostWhy: func() string {
			// The memory limit's OOM killer takes the sentry, which holds the sandbox's memory:
			// unlike at the namespace level the whole sandbox ends, not one command.
			if cg.oomKills() > 0 {
				return ReasonMemoryLimit
			}
			return ""
		},
	})
}

// runscFlags are runsc's global flags for one sandbox: its own state root, the systrap platform (no
// KVM here), no network (with the network on, the namespace the broker prepared:
// gvisor_network.go), no host UDS, and the workspace bind shared with the host (a write on either
// side is seen at once by the other). The host-/usr root is a skeleton with every mount
// point in place and needs no overlay; a template's rootfs gets one in memory (counted in the
// sandbox's), so that the mount points it lacks can be made without writing to it.
func (n *Namespace) runscFlags(id string, t Template) []string {
	overlay := "none"
	if t.Rootfs != "" {
		overlay = "root:memory"
	}
	network := "none"
	if t.Network.Enabled {
		network = "sandbox"
	}
	return []string{
		"--root", filepath.Join(n.gvisorDir(id), "root"),
		"--platform", "systrap",
		"--network", network,
		"--file-access-mounts", "shared",
		"--overlay2", overlay,
		"--host-uds", "none",
		"--ignore-cgroups=" + strconv.FormatBool(!n.cg.enforced()),
	}
}

// gvisorSpec is the sandbox's OCI runtime spec. netns is the network namespace runsc joins, "" for
// a new one of runsc's with a loopback only.
func (n *Namespace) gvisorSpec(spec Spec, dir string, uid, gid int, limits Limits, env []string, netns string) (*specs.Spec, error) {
	t := spec.Template
	root := n.gv.skel
	if t.Rootfs != "" {
		root = t.Rootfs
	}
	tmpSize := strconv.FormatInt(tmpfsSize(t, limits), 10)
	ro := []string{"rbind", "ro", "nosuid", "nodev"}
	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "mode=755"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "nodev", "size=" + tmpSize}},
		{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "size=" + tmpSize}},
		// Home is out of the workspace, empty on each start, as in a namespace sandbox.
		{Destination: HomePath, Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "mode=700",
			"uid=" + strconv.Itoa(uid), "gid=" + strconv.Itoa(gid), "size=" + tmpSize}},
	}
	if t.Rootfs != "" && n.initInterp != "" {
		if _, err := os.Stat(filepath.Join(t.Rootfs, n.initInterp)); err != nil {
			return nil, fmt.Errorf("template %q: the init binary %s is dynamically linked and the rootfs has no %s: install sbx-init (static: CGO_ENABLED=0 go build ./cmd/sbx-init) next to the broker, or add the host's libc to the rootfs", t.Name, n.cfg.InitPath, n.initInterp)
		}
	}
	if t.Rootfs == "" {
		// /usr is in the root itself (bindUsr): the root mount's files are the sentry's to cache.
		for _, d := range []string{"/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"} {
			if fi, err := os.Lstat(d); err == nil && fi.IsDir() {
				mounts = append(mounts, specs.Mount{Destination: d, Type: "bind", Source: d, Options: ro})
			}
		}
		for _, f := range etcFiles {
			if _, err := os.Stat(f); err == nil {
				mounts = append(mounts, specs.Mount{Destination: f, Type: "bind", Source: f, Options: ro})
			}
		}
	}
	mounts = append(mounts,
		specs.Mount{Destination: "/etc/passwd", Type: "bind", Source: filepath.Join(dir, "passwd"), Options: ro},
		specs.Mount{Destination: "/etc/group", Type: "bind", Source: filepath.Join(dir, "group"), Options: ro})
	mounts = append(mounts,
		specs.Mount{Destination: WorkspacePath, Type: "bind", Source: n.layout.workspaceDir(spec.ID),
			Options: []string{"rbind", "rw", "nosuid", "nodev"}},
		specs.Mount{Destination: sbxDir + "/init", Type: "bind", Source: n.cfg.InitPath, Options: ro})
	for _, m := range t.Mounts {
		mounts = append(mounts, specs.Mount{Destination: m.Target, Type: "bind", Source: m.Source, Options: ro})
	}
	period := uint64(100000)
	quota := int64(limits.CPUs * float64(period))
	mem := limits.MemoryBytes
	// The host counts gVisor's own tasks: the sentry's and the gofer's threads (about 60) and, on
	// systrap, about two per process of the sandbox. Below that the sentry cannot make the threads
	// a process of the sandbox needs, and dies.
	pids := 2*limits.Pids + gvisorPidsBase
	return &specs.Spec{
		Version: specs.Version,
		Root:    &specs.Root{Path: root, Readonly: true},
		Process: &specs.Process{
			// The init runs as gVisor's root, with only the capabilities it needs to start
			// commands as the sandbox user (uid) and end them. gVisor does not shield a pid 1 from
			// its namespace's SIGKILL as Linux does: as another user, the init is out of the
			// tenant's reach (no signal, no ptrace, no /proc/1). Commands lose every capability
			// at their setuid.
			User: specs.User{UID: 0, GID: 0},
			Args: []string{sbxDir + "/init", InitArg, sbxinit.BridgeArg},
			Env: append(append([]string(nil), env...),
				// The init keeps the marker runsc started with, as in a namespace sandbox.
				orphanEnv+"="+orphanValue(n.cfg.DataDir)),
			Cwd:             WorkspacePath,
			NoNewPrivileges: true,
			Capabilities: &specs.LinuxCapabilities{
				Bounding:  initCaps,
				Effective: initCaps,
				Permitted: initCaps,
			},
			// gVisor's kernel counts the sandbox's processes against RLIMIT_NPROC (its own count,
			// not the host's): a fork bomb meets EAGAIN there, before the host's pids limit could
			// take the sentry down.
			Rlimits: []specs.POSIXRlimit{{Type: "RLIMIT_NPROC", Hard: uint64(limits.Pids), Soft: uint64(limits.Pids)}},
		},
		Hostname: "sandbox",
		Mounts:   mounts,
		Linux: &specs.Linux{
			CgroupsPath: "/" + n.cfg.CgroupParent + "/" + spec.ID,
			Resources: &specs.LinuxResources{
				Memory: &specs.LinuxMemory{Limit: &mem},
				Pids:   &specs.LinuxPids{Limit: pids},
				CPU:    &specs.LinuxCPU{Quota: &quota, Period: &period},
			},
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
				{Type: specs.MountNamespace}, {Type: specs.NetworkNamespace, Path: netns},
			},
		},
	}, nil
}

// initCaps are the init's capabilities inside gVisor: setting the commands' user, and signalling them.
var initCaps = []string{"CAP_SETUID", "CAP_SETGID", "CAP_KILL"}

// gvisorPidsBase is the host tasks a gvisor sandbox needs beside its processes'.
const gvisorPidsBase = 128

// removeGvisorState ends whatever runsc still runs for the sandbox, unmounts what is left in its
// state (runsc's null-netns bind, a network sandbox's namespace) and removes the state.
func (n *Namespace) removeGvisorState(id string) {
	dir := n.gvisorDir(id)
	if _, err := os.Stat(dir); err != nil {
		return
	}
	if n.gv.runsc != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		args := append(n.runscFlags(id, Template{}), "delete", "--force", id)
		exec.CommandContext(ctx, n.gv.runsc, args...).Run()
		cancel()
	}
	UnmountUnder(dir)
	os.RemoveAll(dir)
}

// reapGvisor ends what an earlier broker on this data dir left of its gvisor sandboxes (a kill -9:
// runsc run dies with it, its sandbox and gofer with that, pasta too, but the state, the
// null-netns mount and a network sandbox's namespace bind stay): every sandbox's runsc state is
// deleted, its processes killed, its mounts detached (which frees a network namespace and its
// firewall).
func (n *Namespace) reapGvisor() {
	dirs, _ := filepath.Glob(filepath.Join(n.layout.root(), "*", "state", "gvisor"))
	for _, d := range dirs {
		id := filepath.Base(filepath.Dir(filepath.Dir(d)))
		if validID(id) {
			n.removeGvisorState(id)
		}
	}
}
