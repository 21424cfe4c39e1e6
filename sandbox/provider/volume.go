package provider

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Disk quotas. Each namespace sandbox's workspace is its own ext4 filesystem: a sparse image file
// (<sandbox dir>/disk.img, made with mkfs.ext4 at Create) loop-mounted nosuid,nodev on the workspace
// directory before bwrap binds it. A sandbox that fills it gets ENOSPC (or, out of inodes, ENOSPC on
// create) inside its own filesystem; the data dir's filesystem, where the broker and the embedded
// Redis write, keeps its space. This works on any host whose kernel has loop devices and ext4 — no
// project quotas or mount options on the data dir.
//
// The image stays mounted from Create to Destroy, stopped sandboxes included: the broker serves file
// operations on a stopped sandbox, and an unmount racing a workspace handle still open would either
// fail (busy) or, detached, leave the filesystem alive on a loop device while a resume mounted the
// same image a second time (two ext4 mounts of one image corrupt it). After a host reboot the image
// is mounted again on first use (Start, or the first file operation).
//
// The image is sparse: a sandbox uses on the host what it wrote, up to its size. Sizes may add up to
// more than the data dir holds (overcommit); the broker-wide reserve (Config.DiskReserve) refuses a
// create or a start when the data dir's free space is below it, so the broker and Redis stay
// writable, and docs/operations.md says what happens when the host's disk fills anyway.

// Disk defaults.
const (
	// DefaultDisk is a sandbox's workspace size when its template says none.
	DefaultDisk = 10 << 30
	// MinDisk is the smallest workspace mkfs.ext4 makes usable room in.
	MinDisk = 8 << 20
	// DefaultDiskReserve is the data dir's free space a create or start needs, unless 5% of the
	// data dir's filesystem is less.
	DefaultDiskReserve = 1 << 30
	// bytesPerInode sets the inode count from the size (mkfs.ext4 -i): 16 KiB per inode gives a
	// 10 GiB workspace 655,360 files and a 16 MiB one 1,024.
	bytesPerInode = 16 << 10
	// diskImage is the image's name in the sandbox dir.
	diskImage = "disk.img"
)

// ByteSize is a size in bytes that reads as a number or a string with a unit ("16MiB", "2GiB",
// "512M", "10G", "4096") in template files and flags. K, M, G and T are binary units, like KiB.
type ByteSize int64

// ParseByteSize reads "2GiB", "512MiB", "512M", "1.5G" or a plain number of bytes.
func ParseByteSize(s string) (ByteSize, error) {
	t := strings.TrimSpace(s)
	num := strings.TrimRightFunc(t, func(r rune) bool { return r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z' })
	unit := strings.ToLower(strings.TrimSpace(t[len(num):]))
	num = strings.TrimSpace(num)
	mult := map[string]float64{"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
		"m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
		"t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}[unit]
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || mult == 0 || v < 0 || math.IsInf(v, 0) || math.IsNaN(v) || v*mult > math.MaxInt64/2 {
		return 0, fmt.Errorf("size %q: use a number of bytes or a form like \"512MiB\" or \"2GiB\"", s)
	}
	return ByteSize(v * mult), nil
}

// String is the size in the largest binary unit that divides it ("2GiB"), else in bytes.
func (b ByteSize) String() string {
	for _, u := range []struct {
		s string
		n int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if b != 0 && int64(b)%u.n == 0 {
			return strconv.FormatInt(int64(b)/u.n, 10) + u.s
		}
	}
	return strconv.FormatInt(int64(b), 10)
}

// MarshalJSON writes the String form.
func (b ByteSize) MarshalJSON() ([]byte, error) { return json.Marshal(b.String()) }

// UnmarshalJSON reads a number of bytes or a string with a unit.
func (b *ByteSize) UnmarshalJSON(data []byte) error {
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		var n int64
		if err := json.Unmarshal(data, &n); err != nil {
			return fmt.Errorf("size must be a number of bytes or a string like \"2GiB\", got %s", data)
		}
		s = strconv.FormatInt(n, 10)
	}
	v, err := ParseByteSize(s)
	if err != nil {
		return err
	}
	*b = v
	return nil
}

// volumes is the namespace provider's disk quota state.
type volumes struct {
	enabled bool
	reason  string // why quotas are not enforced, when they are not
	mkfs    string
	reserve int64 // Config.DiskReserve: 0 the default, <0 off
	log     *slog.Logger

	mu     sync.Mutex // serializes mounting: a sandbox's image is never mounted twice
	baseMu sync.Mutex // serializes making base images
	// imagesDir holds the base images (<DataDir>/disk-images); preflight's probe shares its
	// provider's, so that a broker start makes the default one once for the data dir.
	imagesDir string
	legacy    map[string]struct{} // sandboxes already logged as having no image
	pool      *imagePool          // images made ahead (imagepool.go); nil without quotas
}

var warnNoQuotaOnce sync.Once

// initVolumes decides whether this broker can enforce disk quotas: it must be root (mounting needs
// it), have mkfs.ext4 and loop devices. Without them sandboxes keep plain-directory workspaces, as
// before quotas, with a warning once per process. Running out of something (open files) on the way
// is an error, not a reason to go without quotas.
func (n *Namespace) initVolumes() error {
	v := &n.vol
	v.reserve = int64(n.cfg.DiskReserve)
	v.log = slog.Default()
	v.imagesDir = filepath.Join(n.cfg.DataDir, "disk-images")
	switch mkfs, err := exec.LookPath("mkfs.ext4"); {
	case !n.asRoot:
		v.reason = "the broker is not root and cannot mount a filesystem per sandbox: a sandbox can fill the data dir's disk (run the broker as root to enforce disk quotas)"
	case err != nil:
		v.reason = "mkfs.ext4 not found: install e2fsprogs (apt-get install -y e2fsprogs) to enforce disk quotas"
	default:
		f, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
		switch {
		case err == nil:
			f.Close()
			v.enabled, v.mkfs = true, mkfs
			n.initImagePool()
		case errors.Is(err, unix.EMFILE), errors.Is(err, unix.ENFILE), errors.Is(err, unix.ENOMEM):
			return fmt.Errorf("disk quotas: %w", err)
		default:
			v.reason = fmt.Sprintf("no loop devices (%v): load the loop module (modprobe loop) or give the broker /dev/loop-control and /dev/loop* to enforce disk quotas", err)
		}
	}
	if !v.enabled {
		warnNoQuotaOnce.Do(func() {
			v.log.Warn("disk quotas are not enforced: " + v.reason)
		})
	}
	return nil
}

// DiskQuotaEnforced reports whether each sandbox's workspace is a filesystem of its own size, and if
// not, why.
func (n *Namespace) DiskQuotaEnforced() (bool, string) { return n.vol.enabled, n.vol.reason }

func (l layout) diskImage(id string) string { return filepath.Join(l.sandboxDir(id), diskImage) }

// checkReserve refuses when the data dir's filesystem has less free space than the reserve, so the
// broker and the embedded Redis stay writable however the sandboxes' images grow.
func checkReserve(dataDir string, reserve int64) error {
	if reserve < 0 {
		return nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dataDir, &st); err != nil {
		return fmt.Errorf("data dir %s: %w", dataDir, err)
	}
	bsize := uint64(st.Bsize)
	free, total := st.Bavail*bsize, st.Blocks*bsize
	want := uint64(reserve)
	if reserve == 0 {
		want = min(uint64(DefaultDiskReserve), total/20)
	}
	if free >= want {
		return nil
	}
	return &ResourceError{
		Errno:    unix.ENOSPC,
		Resource: "disk space in the data dir",
		Err:      fmt.Errorf("%s has %s free, less than the %s the broker keeps for itself and Redis", dataDir, ByteSize(free), ByteSize(want)),
		Fix:      "no sandbox is created or started until there is more: delete sandboxes you no longer need (sbctl delete), free space on that filesystem, or lower --disk-reserve",
	}
}

// mounted reports whether the workspace directory is a mount point (its device differs from its
// parent's), as it is after createVolume or a mount left by a broker that crashed.
func mounted(ws string) (bool, error) {
	var a, b unix.Stat_t
	if err := unix.Lstat(ws, &a); err != nil {
		return false, err
	}
	if err := unix.Lstat(filepath.Dir(ws), &b); err != nil {
		return false, err
	}
	return a.Dev != b.Dev, nil
}

// createVolume makes the sandbox's image and mounts it on the empty workspace directory, owned by
// uid/gid. A workspace that already holds files and has no image (a sandbox created before disk
// quotas) is left as it is.
func (n *Namespace) createVolume(id string, size ByteSize, uid, gid int) error {
	if !n.vol.enabled {
		return nil
	}
	img, ws := n.layout.diskImage(id), n.layout.workspaceDir(id)
	if _, err := os.Stat(img); err == nil {
		return n.mountVolume(id)
	}
	if entries, err := os.ReadDir(ws); err != nil || len(entries) > 0 {
		if err != nil {
			return fmt.Errorf("create sandbox %s: %w", id, err)
		}
		return n.mountVolume(id) // logs that it has no quota
	}
	if size == 0 {
		size = DefaultDisk
	}
	defer n.oweRefill(id, size)
	if pi, ok := n.vol.pool.take(size); ok {
		err := n.adoptPooled(id, pi)
		if err == nil {
			return n.layout.secure(id, uid, gid)
		}
		n.vol.log.Warn("disk image pool: a pooled image could not be used; making one", "sandbox_id", id, "err", err)
	}
	tmp := img + ".tmp"
	base, err := n.baseImage(size)
	if err == nil {
		err = copySparse(base, tmp, int64(size))
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("create sandbox %s: disk image: %w", id, err)
	}
	if err := os.Rename(tmp, img); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("create sandbox %s: disk image: %w", id, err)
	}
	if err := n.mountImage(id, true); err != nil {
		return err
	}
	// mkfs makes lost+found; the workspace starts empty (e2fsck makes it again if it needs it).
	_ = os.Remove(filepath.Join(ws, "lost+found"))
	// The filesystem's root is the workspace now: the sandbox's, 0700, like the directory under it.
	return n.layout.secure(id, uid, gid)
}

// mountVolume mounts the sandbox's image on its workspace directory unless it is mounted already (a
// broker that crashed leaves its mounts). A sandbox with no image (created before disk quotas, or by
// a broker that could not enforce them) keeps its plain-directory workspace, logged once.
func (n *Namespace) mountVolume(id string) error { return n.mountImage(id, false) }

// mountImage is mountVolume; fresh says the image was made just now, so no loop device can be
// attached to it yet and loopMount need not look for one (a look reads a file per loop device on
// the host: 20 ms with 500 of them, where the create's attach and mount take 3).
func (n *Namespace) mountImage(id string, fresh bool) error {
	v := &n.vol
	img, ws := n.layout.diskImage(id), n.layout.workspaceDir(id)
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, err := os.Stat(img); errors.Is(err, fs.ErrNotExist) {
		if v.enabled {
			if v.legacy == nil {
				v.legacy = map[string]struct{}{}
			}
			if _, seen := v.legacy[id]; !seen {
				v.legacy[id] = struct{}{}
				v.log.Warn("sandbox workspace has no disk image (it was created before disk quotas): it keeps working as a plain directory with no disk quota; recreate the sandbox to give it one",
					"sandbox_id", id)
			}
		}
		return nil
	}
	if ok, err := mounted(ws); err != nil {
		return fmt.Errorf("sandbox %s: workspace: %w", id, err)
	} else if ok {
		return nil
	}
	if !v.enabled {
		return fmt.Errorf("sandbox %s has a disk image and this broker cannot mount it (%s)", id, v.reason)
	}
	if err := loopMount(img, ws, fresh); err != nil {
		return fmt.Errorf("sandbox %s: mount its disk image: %w", id, err)
	}
	return nil
}

// MountWorkspace makes sure the sandbox's workspace is its mounted disk image before the broker
// opens it for file operations (after a host reboot nothing has mounted it yet).
func (n *Namespace) MountWorkspace(spec Spec) error {
	if !validID(spec.ID) {
		return fmt.Errorf("%w: %q", ErrInvalidID, spec.ID)
	}
	return n.mountVolume(spec.ID)
}

// unmountVolume unmounts the workspace if it is a mount point. A handle still open on it (the
// broker's own, released just before) makes the unmount lazy: the image is never mounted again.
func (n *Namespace) unmountVolume(id string) error {
	ws := n.layout.workspaceDir(id)
	n.vol.mu.Lock()
	defer n.vol.mu.Unlock()
	ok, err := mounted(ws)
	if err != nil || !ok {
		return nil
	}
	if err := unix.Unmount(ws, 0); err != nil {
		if err := unix.Unmount(ws, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("destroy sandbox %s: unmount workspace: %w", id, err)
		}
	}
	return nil
}

// WorkspaceMounter is a provider whose workspaces must be mounted before the broker opens them.
type WorkspaceMounter interface {
	MountWorkspace(spec Spec) error
}

var _ WorkspaceMounter = (*Namespace)(nil)

// tmpfsSize is the size of /tmp and of /dev/shm: the template's, else a quarter of the memory
// limit each, so that filling both leaves the sandbox's processes half of it. tmpfs pages count
// against the memory limit; a full tmpfs answers ENOSPC instead of the memory limit killing the
// sandbox.
func tmpfsSize(t Template, limits Limits) int64 {
	if t.Tmp > 0 {
		return int64(t.Tmp)
	}
	return max(limits.MemoryBytes/4, 1<<20)
}

// baseImage is a freshly made, empty ext4 image of the given size, made once per size with
// mkfs.ext4 under <DataDir>/disk-images (the preflight at start makes the default size's) and copied (holes kept) for each sandbox: a copy of its few
// MiB of metadata costs a few ms, where mkfs costs tens (a fork, an exec and its writes).
func (n *Namespace) baseImage(size ByteSize) (string, error) {
	dir := n.vol.imagesDir
	p := filepath.Join(dir, fmt.Sprintf("ext4-%d.img", int64(size)))
	n.vol.baseMu.Lock()
	defer n.vol.baseMu.Unlock()
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	tmp := p + ".tmp"
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err == nil {
		err = f.Truncate(int64(size))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		os.Remove(tmp)
		return "", err
	}
	// No reserved blocks (the sandbox user is not root), inodes from the size, the lazy inits and
	// no discard so that mkfs writes a few MiB whatever the size, and no blocks reserved for online
	// growth (they doubled mkfs's time).
	out, err := exec.Command(n.vol.mkfs, "-q", "-F", "-t", "ext4", "-b", "4096", "-i", strconv.Itoa(bytesPerInode),
		"-m", "0", "-O", "^resize_inode", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", tmp).CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("mkfs.ext4: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return "", err
	}
	return p, nil
}

// copySparse copies src's data regions to a new file dst of the given size, leaving holes as holes.
func copySparse(src, dst string, size int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = func() error {
		if err := out.Truncate(size); err != nil {
			return err
		}
		sfd, dfd := int(in.Fd()), int(out.Fd())
		for off := int64(0); off < size; {
			data, err := unix.Seek(sfd, off, unix.SEEK_DATA)
			if errors.Is(err, unix.ENXIO) {
				return nil
			} else if err != nil {
				return err
			}
			hole, err := unix.Seek(sfd, data, unix.SEEK_HOLE)
			if err != nil {
				return err
			}
			for r, w := data, data; r < hole; {
				k, err := unix.CopyFileRange(sfd, &r, dfd, &w, int(hole-r), 0)
				if err != nil {
					return err
				}
				if k == 0 {
					return fmt.Errorf("copy %s: short copy at %d", src, r)
				}
			}
			off = hole
		}
		return nil
	}()
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}

// loopMount mounts img nosuid,nodev,noatime on dir: through the loop device already bound to it
// if there is one, else through a free loop device it attaches (autoclear: the device goes with
// the last unmount). noinit_itable: the image is sparse, its unwritten inode tables read as zeros
// already, and zeroing them in the background would write tens of MiB per sandbox for nothing.
//
// A bound device means the image's filesystem may still be alive though nothing shows it mounted:
// the kernel lets go of a filesystem some time after the umount(2) of its last visible mount
// returned (the bind a stopped sandbox's mount namespace held is released after that namespace's
// last process is gone; we measured tens of ms, seconds under load), and only then does it write
// what the filesystem still held and detach the device. A second loop device attached meanwhile
// would mount the image as it was on disk, without the files still in the first filesystem's
// cache, and two live ext4 filesystems on one image corrupt it. Mounting the bound device instead
// reuses that filesystem, whose files are all there. fresh: img was made just now and is attached
// nowhere.
func loopMount(img, dir string, fresh bool) error {
	if fresh {
		return loopAttachMount(img, dir, volumeFlags)
	}
	for deadline := time.Now().Add(loopBusyWait); ; {
		dev, err := boundLoop(img)
		if err != nil {
			return err
		}
		if dev == "" {
			return loopAttachMount(img, dir, volumeFlags)
		}
		err = unix.Mount(dev, dir, "ext4", volumeFlags, "noinit_itable")
		if err == nil {
			return nil
		}
		// The device let go of the image between the look and the mount (its filesystem went
		// with its last user, and autoclear detaches it): look again.
		if time.Now().After(deadline) {
			return fmt.Errorf("mount %s, still attached to %s from an earlier mount: %w", dev, img, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// volumeFlags are a workspace mount's flags.
const volumeFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOATIME

// loopBusyWait bounds how long loopMount keeps finding the image on a loop device it cannot mount.
const loopBusyWait = 10 * time.Second

// boundLoop is the loop device (/dev/loopN) img is attached to, or "" if none is. It reads the
// backing files the kernel lists in /sys/block/loop*/loop; a host without /sys/block has no way
// to tell, and gets "".
func boundLoop(img string) (string, error) {
	want, err := os.Stat(img)
	if err != nil {
		return "", err
	}
	// The kernel lists the backing file's path with symlinks resolved.
	real, err := filepath.EvalSymlinks(img)
	if err != nil {
		return "", err
	}
	if real, err = filepath.Abs(real); err != nil {
		return "", err
	}
	entries, err := os.ReadDir("/sys/block")
	if err != nil {
		return "", nil
	}
	for _, e := range entries {
		name := e.Name()
		if !strings.HasPrefix(name, "loop") {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/sys/block", name, "loop", "backing_file"))
		if err != nil || strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)") != real {
			continue // not attached, or to another file
		}
		if fi, err := os.Stat(real); err == nil && os.SameFile(fi, want) {
			return "/dev/" + name, nil
		}
	}
	return "", nil
}

// loopAttachMount attaches img to a free loop device with autoclear and mounts it on dir.
func loopAttachMount(img, dir string, flags uintptr) error {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer ctl.Close()
	file, err := os.OpenFile(img, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer file.Close()
	for attempt := 0; ; attempt++ {
		num, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return fmt.Errorf("find a free loop device: %w", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", num)
		lo, err := os.OpenFile(dev, os.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		cfg := unix.LoopConfig{Fd: uint32(file.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		copy(cfg.Info.File_name[:], img)
		err = unix.IoctlLoopConfigure(int(lo.Fd()), &cfg)
		if errors.Is(err, unix.EBUSY) && attempt < 16 {
			lo.Close() // another mount took it between GET_FREE and here
			continue
		}
		if err != nil {
			lo.Close()
			return fmt.Errorf("attach %s: %w", dev, err)
		}
		err = unix.Mount(dev, dir, "ext4", flags, "noinit_itable")
		lo.Close() // the mount holds the device now; unmounted, autoclear detaches it
		if err != nil {
			return fmt.Errorf("mount %s: %w", dev, err)
		}
		return nil
	}
}

// UnmountUnder detaches every mount under dir, deepest first. A broker that stops leaves its
// sandboxes' disk images mounted for its next start; whoever removes a data dir (tests, benchmarks,
// an operator's tooling) detaches them first, or each keeps its image and a loop device. The image
// pools of providers on dir in this process stop first.
func UnmountUnder(dir string) {
	stopPoolsUnder(dir) // no image pool of a provider on it mounts anything meanwhile
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var points []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(unescapeMount(f[4]), dir+"/") {
			points = append(points, unescapeMount(f[4]))
		}
	}
	for i := len(points) - 1; i >= 0; i-- {
		_ = unix.Unmount(points[i], unix.MNT_DETACH)
	}
}
