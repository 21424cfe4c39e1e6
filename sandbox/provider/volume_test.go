package provider

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// requireQuotas fails (never skips) where disk quotas cannot be enforced: the tests run as root.
func requireQuotas(t *testing.T, n *Namespace) {
	t.Helper()
	if ok, why := n.DiskQuotaEnforced(); !ok {
		t.Fatalf("disk quotas are not enforced on this host: %s", why)
	}
}

// mountedHere reports whether /proc/self/mountinfo has a mount point under dir.
func mountedHere(t *testing.T, dir string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir) {
			return true
		}
	}
	return false
}

// A sandbox that writes past its disk gets ENOSPC inside its own filesystem, and so does one that
// makes more files than its inodes; the data dir, another sandbox and the broker's writes into it
// keep working. Before quotas the 64 MiB went to the data dir's disk.
func TestDiskQuota(t *testing.T) {
	n := newNamespace(t, Config{})
	requireQuotas(t, n)
	small, spec := startSandbox(t, n, Template{Disk: 16 << 20})
	other, otherSpec := startSandbox(t, n, Template{Disk: 64 << 20})

	res, out := sh(t, small, "dd if=/dev/zero of=/workspace/big bs=1M count=64 2>&1")
	if res.ExitCode == 0 || !strings.Contains(out, "No space left") {
		t.Fatalf("writing 64 MiB in a 16 MiB sandbox: exit %d, %q; want ENOSPC", res.ExitCode, out)
	}
	// The workspace is a filesystem of its own: its mount line inside names neither the data dir
	// nor the sandbox id.
	if res, out := sh(t, small, "grep ' /workspace ' /proc/self/mountinfo"); res.ExitCode != 0 || strings.Contains(out, "sandboxes") || strings.Contains(out, spec.ID) {
		t.Fatalf("the /workspace mount line: exit %d, %q", res.ExitCode, out)
	}
	if fi, err := os.Stat(filepath.Join(n.WorkspaceDir(spec), "big")); err != nil || fi.Size() > 16<<20 {
		t.Fatalf("the file the sandbox wrote: %v, %v", fi, err)
	}
	// The broker writes into the data dir and into another sandbox's workspace (what the
	// dataplane's write does); the other sandbox writes for itself.
	payload := make([]byte, 8<<20)
	if err := os.WriteFile(filepath.Join(n.cfg.DataDir, "broker-file"), payload, 0o600); err != nil {
		t.Fatalf("the broker's write in the data dir: %v", err)
	}
	if err := os.WriteFile(filepath.Join(n.WorkspaceDir(otherSpec), "from-broker"), payload, 0o644); err != nil {
		t.Fatalf("the broker's write into another sandbox: %v", err)
	}
	if res, out := sh(t, other, "dd if=/dev/zero of=/workspace/mine bs=1M count=16 2>&1 && cat from-broker | wc -c"); res.ExitCode != 0 || !strings.Contains(out, "8388608") {
		t.Fatalf("another sandbox's write: exit %d, %q", res.ExitCode, out)
	}

	// Inodes: 16 MiB at 16 KiB an inode is 1,024 files.
	res, out = sh(t, small, "rm -f big; mkdir d && cd d && i=0; while [ $i -lt 5000 ]; do touch f$i || exit 3; i=$((i+1)); done 2>&1")
	if res.ExitCode != 3 || !strings.Contains(out, "No space left") || !strings.Contains(out, "f10") {
		t.Fatalf("5000 empty files in a 16 MiB sandbox: exit %d, %q; want ENOSPC near 1,000 files", res.ExitCode, out)
	}
	if res, out := sh(t, other, "touch /workspace/still-fine && echo ok"); res.ExitCode != 0 || !strings.Contains(out, "ok") {
		t.Fatalf("another sandbox after the inode exhaustion: exit %d, %q", res.ExitCode, out)
	}
}

// Files survive a stop and start, a broker restart (a new provider on the same data dir, with the
// image still mounted) and a host reboot (nothing mounted: Start mounts it again, as does the first
// file operation).
func TestDiskQuotaSurvivesStopAndRestart(t *testing.T) {
	n := newNamespace(t, Config{})
	requireQuotas(t, n)
	ctx := context.Background()
	spec := Spec{ID: NewID(), Template: Template{Name: "t", Disk: 16 << 20}}
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Destroy(context.Background(), spec) })
	ws := n.WorkspaceDir(spec)
	if entries, _ := os.ReadDir(ws); len(entries) != 0 {
		t.Fatalf("a new workspace holds %v; want it empty", entries)
	}
	in, err := n.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if res, out := sh(t, in, "echo kept > a && df -k /workspace | tail -1"); res.ExitCode != 0 {
		t.Fatalf("exit %d, %q", res.ExitCode, out)
	}
	if err := in.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	check := func(p *Namespace, what string) {
		t.Helper()
		in, err := p.Start(ctx, spec)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		defer in.Stop(ctx)
		res, out := sh(t, in, "cat a && df -k /workspace | tail -1")
		if res.ExitCode != 0 || !strings.HasPrefix(out, "kept\n") {
			t.Fatalf("%s: exit %d, %q", what, res.ExitCode, out)
		}
		// df's size column: about 16 MiB, not the data dir's disk.
		if f := strings.Fields(strings.Split(out, "\n")[1]); len(f) < 2 || len(f[1]) > 5 {
			t.Fatalf("%s: /workspace is not the 16 MiB image: %q", what, out)
		}
	}
	check(n, "after a stop")
	restarted := newNamespace(t, Config{DataDir: n.cfg.DataDir})
	check(restarted, "after a broker restart")
	// Unmounted and at once mounted again: the kernel may still hold the image's filesystem (and
	// its loop device) after umount returned, with the file only in its cache. The mount must
	// reuse it, never mount the image a second time from a second loop device.
	img := n.layout.diskImage(spec.ID)
	if err := unix.Unmount(ws, 0); err != nil {
		t.Fatal(err)
	}
	check(restarted, "after an unmount (mounted again at once)")
	if devs := loopsFor(t, img); len(devs) != 1 {
		t.Fatalf("the image is attached to %v; want exactly one loop device", devs)
	}
	// A reboot: nothing mounted and no loop device left.
	if err := unix.Unmount(ws, 0); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the image's loop device to be released", func() bool { return len(loopsFor(t, img)) == 0 })
	check(restarted, "after a reboot (nothing mounted)")
	if err := unix.Unmount(ws, 0); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the image's loop device to be released", func() bool { return len(loopsFor(t, img)) == 0 })
	if err := restarted.MountWorkspace(spec); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(ws, "a")); err != nil || string(b) != "kept\n" {
		t.Fatalf("file operations after a reboot: %q, %v", b, err)
	}
}

// Destroy unmounts the workspace and removes the image.
func TestDiskQuotaDestroy(t *testing.T) {
	n := newNamespace(t, Config{})
	requireQuotas(t, n)
	ctx := context.Background()
	spec := Spec{ID: NewID(), Template: Template{Name: "t", Disk: 16 << 20}}
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	dir := n.layout.sandboxDir(spec.ID)
	if !mountedHere(t, dir) {
		t.Fatal("the workspace is not a mount after Create")
	}
	if _, err := os.Stat(n.layout.diskImage(spec.ID)); err != nil {
		t.Fatal(err)
	}
	if err := n.Destroy(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if mountedHere(t, dir) {
		t.Fatal("a mount is left after Destroy")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the sandbox dir after Destroy: %v", err)
	}
}

// A workspace made before quotas (a plain directory with files and no image) keeps working as it is.
func TestDiskQuotaLegacyWorkspace(t *testing.T) {
	n := newNamespace(t, Config{})
	requireQuotas(t, n)
	id := NewID()
	if err := n.layout.create(id, n.cfg.UID, n.cfg.GID); err != nil {
		t.Fatal(err)
	}
	ws := n.layout.workspaceDir(id)
	if err := os.WriteFile(filepath.Join(ws, "old"), []byte("old\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	in, _ := func() (Instance, Spec) {
		spec := Spec{ID: id, Template: Template{Name: "t"}}
		if err := n.Create(context.Background(), spec); err != nil {
			t.Fatal(err)
		}
		in, err := n.Start(context.Background(), spec)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { in.Stop(context.Background()); n.Destroy(context.Background(), spec) })
		return in, spec
	}()
	if res, out := sh(t, in, "cat old"); res.ExitCode != 0 || out != "old\n" {
		t.Fatalf("exit %d, %q", res.ExitCode, out)
	}
	if _, err := os.Stat(n.layout.diskImage(id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a legacy workspace got an image: %v", err)
	}
}

// Below the reserve a create and a start are refused with a resource error that says what to do.
func TestDiskReserve(t *testing.T) {
	n := newNamespace(t, Config{DiskReserve: 1 << 60})
	err := n.Create(context.Background(), Spec{ID: NewID(), Template: Template{Name: "t"}})
	if !errors.Is(err, ErrResource) || !strings.Contains(err.Error(), "--disk-reserve") {
		t.Fatalf("create below the reserve: %v; want a resource error naming --disk-reserve", err)
	}
	d, derr := NewDir(Config{DataDir: testDataDir(t), DiskReserve: 1 << 60})
	if derr != nil {
		t.Fatal(derr)
	}
	if err := d.Create(context.Background(), Spec{ID: NewID(), Template: Template{Name: "t"}}); !errors.Is(err, ErrResource) {
		t.Fatalf("dir provider below the reserve: %v", err)
	}
}

// /tmp and /dev/shm are sized tmpfs: filling one answers ENOSPC, and the sandbox lives on.
func TestTmpfsSized(t *testing.T) {
	n := newNamespace(t, Config{})
	in, _ := startSandbox(t, n, Template{Tmp: 8 << 20, Limits: Limits{MemoryBytes: 256 << 20}})
	for _, dir := range []string{"/tmp", "/dev/shm"} {
		res, out := sh(t, in, "dd if=/dev/zero of="+dir+"/fill bs=1M count=32 2>&1")
		if res.ExitCode == 0 || !strings.Contains(out, "No space left") || res.Reason != "" {
			t.Fatalf("filling %s: exit %d, reason %q, %q; want ENOSPC", dir, res.ExitCode, res.Reason, out)
		}
	}
	if res, out := sh(t, in, "df -k /tmp /dev/shm | tail -2"); res.ExitCode != 0 || dfSizes(out) != "8192 8192" {
		t.Fatalf("df: exit %d, %q; want two 8 MiB tmpfs", res.ExitCode, out)
	}
	// Without a template size each is a quarter of the memory limit.
	in2, _ := startSandbox(t, n, Template{Limits: Limits{MemoryBytes: 256 << 20}})
	if res, out := sh(t, in2, "df -k /tmp /dev/shm | tail -2"); res.ExitCode != 0 || dfSizes(out) != "65536 65536" {
		t.Fatalf("df: exit %d, %q; want two 64 MiB tmpfs", res.ExitCode, out)
	}
}

func TestParseByteSize(t *testing.T) {
	for in, want := range map[string]ByteSize{"16MiB": 16 << 20, "2GiB": 2 << 30, "512M": 512 << 20, "4096": 4096, "1.5G": 3 << 29, "10 GB": 10 << 30} {
		if got, err := ParseByteSize(in); err != nil || got != want {
			t.Errorf("ParseByteSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "12XB", "GiB", "1e300G", "NaN"} {
		if _, err := ParseByteSize(in); err == nil {
			t.Errorf("ParseByteSize(%q) succeeded", in)
		}
	}
	if err := (Template{Name: "x", Disk: 1 << 20}).Validate(); err == nil || !strings.Contains(err.Error(), "disk") {
		t.Errorf("a 1 MiB disk validated: %v", err)
	}
}

// dfSizes is the size column of df -k lines.
func dfSizes(out string) string {
	var s []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if f := strings.Fields(line); len(f) > 1 {
			s = append(s, f[1])
		}
	}
	return strings.Join(s, " ")
}

// loopsFor lists the loop devices attached to img.
func loopsFor(t *testing.T, img string) []string {
	t.Helper()
	want, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var devs []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		if fi, err := os.Stat(strings.TrimSpace(string(b))); err == nil && os.SameFile(fi, want) {
			devs = append(devs, filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return devs
}

// waitFor polls cond until it holds, failing the test with what it waited for after limit.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(limit); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", limit, what)
		}
	}
}

// A create takes a workspace image the pool made ahead: its own filesystem of the size asked for,
// mounted nosuid,nodev, empty, the sandbox's, on one loop device bound to the sandbox's image file.
// The pool keeps the size the last create asked for, and a broker's next start removes it.
func TestDiskImagePool(t *testing.T) {
	n := newNamespace(t, Config{})
	requireQuotas(t, n)
	pool := n.vol.pool
	startSandbox(t, n, Template{Disk: 16 << 20}) // made on its path; the pool fills behind it
	pool.settle()
	pool.mu.Lock()
	ready := append([]pooledImage(nil), pool.ready...)
	pool.mu.Unlock()
	if len(ready) != imagePoolSize {
		t.Fatalf("the pool holds %d images; want %d", len(ready), imagePoolSize)
	}
	taken := ready[len(ready)-1]

	in, spec := startSandbox(t, n, Template{Disk: 16 << 20})
	if _, err := os.Stat(taken.img); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the pooled image %s is still in the pool: %v", taken.img, err)
	}
	img, ws := n.layout.diskImage(spec.ID), n.WorkspaceDir(spec)
	if devs := loopsFor(t, img); len(devs) != 1 {
		t.Fatalf("the sandbox's image is attached to %v; want one loop device", devs)
	}
	var st unix.Stat_t
	if err := unix.Stat(ws, &st); err != nil {
		t.Fatal(err)
	}
	if uid, gid := n.ids(spec); int(st.Uid) != uid || int(st.Gid) != gid || st.Mode&0o777 != 0o700 {
		t.Fatalf("the workspace is %d:%d %o; want %d:%d 700", st.Uid, st.Gid, st.Mode&0o777, uid, gid)
	}
	res, out := sh(t, in, "ls -A; grep ' /workspace ' /proc/self/mountinfo; df -k /workspace | tail -1")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if res.ExitCode != 0 || len(lines) != 2 {
		t.Fatalf("a pooled workspace inside (want empty): exit %d, %q", res.ExitCode, out)
	}
	if opts := strings.Fields(lines[0]); len(opts) < 6 || !strings.Contains(opts[5], "nosuid") || !strings.Contains(opts[5], "nodev") {
		t.Fatalf("the /workspace mount: %q; want nosuid,nodev", lines[0])
	}
	if f := strings.Fields(lines[1]); len(f) < 2 || len(f[1]) > 5 {
		t.Fatalf("/workspace is not the 16 MiB image: %q", lines[1])
	}
	if res, out := sh(t, in, "dd if=/dev/zero of=big bs=1M count=32 2>&1"); res.ExitCode == 0 || !strings.Contains(out, "No space left") {
		t.Fatalf("writing 32 MiB in a 16 MiB pooled workspace: exit %d, %q; want ENOSPC", res.ExitCode, out)
	}

	// Another size: made on its path, and the pool turns to it.
	startSandbox(t, n, Template{Disk: 32 << 20})
	pool.settle()
	pool.mu.Lock()
	size, count := pool.size, len(pool.ready)
	pool.mu.Unlock()
	if size != 32<<20 || count != imagePoolSize {
		t.Fatalf("after a 32 MiB create the pool holds %d images of %v", count, size)
	}

	// The next broker on the data dir starts from an empty pool: nothing of this one stays mounted.
	restarted := newNamespace(t, Config{DataDir: n.cfg.DataDir})
	if mountedHere(t, pool.dir+"/") {
		t.Fatalf("the old pool's images are still mounted under %s", pool.dir)
	}
	if entries, _ := os.ReadDir(pool.dir); len(entries) != 0 {
		t.Fatalf("the old pool's files are still there: %v", entries)
	}
	in2, _ := startSandbox(t, restarted, Template{Disk: 16 << 20})
	if res, _ := sh(t, in2, "touch /workspace/ok"); res.ExitCode != 0 {
		t.Fatal("a create after the restart")
	}
}

// A create that takes a pooled image leaves the pool's refill until its sandbox's start has ended,
// so that the fill's copy, attach and mount do not compete with that start; a sandbox created and
// never started refills it at its destroy.
func TestDiskImagePoolRefillsAfterTheStart(t *testing.T) {
	n := newNamespace(t, Config{})
	requireQuotas(t, n)
	pool := n.vol.pool
	startSandbox(t, n, Template{Disk: 16 << 20}) // made on its path; the pool fills behind it
	pool.settle()
	ready := func() (count int, filling bool) {
		pool.mu.Lock()
		defer pool.mu.Unlock()
		return len(pool.ready), pool.filling
	}
	ctx := context.Background()
	for _, start := range []bool{true, false} {
		spec := Spec{ID: NewID(), Template: Template{Name: "test", Disk: 16 << 20}}
		if err := n.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		if count, filling := ready(); count != imagePoolSize-1 || filling {
			t.Fatalf("after a create took an image the pool holds %d and fills: %v; want %d and no fill until the start ends", count, filling, imagePoolSize-1)
		}
		if start {
			in, err := n.Start(ctx, spec)
			if err != nil {
				t.Fatal(err)
			}
			if err := in.Stop(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if err := n.Destroy(ctx, spec); err != nil {
			t.Fatal(err)
		}
		pool.settle()
		if count, _ := ready(); count != imagePoolSize {
			t.Fatalf("after the sandbox's start (%v) and destroy the pool holds %d images; want %d", start, count, imagePoolSize)
		}
	}
}

// TestDiskImagePoolSharedDataDir: on a data dir whose mount is shared (systemd makes / shared;
// this machine's is not, so TestDiskImagePool alone never sees it) a create still takes a pooled
// image, the pool's images show in no other view of the data dir (its staging mount is private: a
// copy propagated there would keep a taken image's filesystem and loop device alive after its
// sandbox's destroy), the sandbox sees none of the pool, and its destroy frees the loop device.
func TestDiskImagePoolSharedDataDir(t *testing.T) {
	dir := testDataDir(t)
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		UnmountUnder(dir)
		unix.Unmount(dir, unix.MNT_DETACH)
	})
	if err := unix.Mount("", dir, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	// A second view of the data dir, in its peer group: what is mounted in one shows in the other.
	peer := t.TempDir()
	if err := unix.Mount(dir, peer, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		UnmountUnder(peer)
		unix.Unmount(peer, unix.MNT_DETACH)
	})
	n := newNamespace(t, Config{DataDir: dir})
	requireQuotas(t, n)
	pool := n.vol.pool
	startSandbox(t, n, Template{Disk: 16 << 20})
	pool.settle()
	pool.mu.Lock()
	ready := append([]pooledImage(nil), pool.ready...)
	pool.mu.Unlock()
	if len(ready) == 0 {
		t.Fatal("the pool made no image on a shared data dir")
	}
	taken := ready[len(ready)-1]
	pooledDev := loopsFor(t, taken.img)
	// (The empty staging mount itself shows there: made under a shared parent, it propagated before
	// it was made private. It holds no image.)
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], filepath.Join(peer, "disk-images")+"/") && strings.Contains(line, " /dev/loop") {
			t.Fatalf("a pooled image shows in another view of the data dir, where nothing unmounts it: %s", line)
		}
	}

	ctx := context.Background()
	spec := Spec{ID: NewID(), Template: Template{Name: "test", Disk: 16 << 20}}
	if err := n.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	img := n.layout.diskImage(spec.ID)
	dev := loopsFor(t, img)
	if len(dev) != 1 || len(pooledDev) != 1 || dev[0] != pooledDev[0] {
		t.Fatalf("the sandbox's image is on %v, the pooled one was on %v: the pooled image was not taken", dev, pooledDev)
	}
	in, err := n.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if res, out := sh(t, in, "grep -c disk-images /proc/self/mountinfo; ls -A /workspace"); res.ExitCode != 0 || out != "0\n" {
		t.Fatalf("the sandbox sees the pool or a non-empty workspace: exit %d, %q", res.ExitCode, out)
	}
	if err := in.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n.Destroy(ctx, spec); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the destroyed sandbox's loop device to be detached", func() bool {
		b, err := os.ReadFile(filepath.Join("/sys/block", dev[0], "loop", "backing_file"))
		return err != nil || !strings.Contains(string(b), spec.ID)
	})
}
