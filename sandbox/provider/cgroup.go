package provider

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The controllers limits need, by the name both cgroup versions use.
var cgroupControllers = []string{"memory", "pids", "cpu"}

// cgroupHost is what this host offers for limits, found once per provider.
type cgroupHost struct {
	version string            // "v2", "v1", or "" when nothing is usable
	parents map[string]string // controller → <mount>/<parent>; on v2 all three are the same dir
	// homes (v1) is controller → the broker's own cgroup dir in that hierarchy, where the spawner
	// thread goes back after it forked a sandbox from inside the sandbox's cgroups (placeThread).
	homes map[string]string
	// reason says why some or all limits are not enforced; empty when all are.
	reason string
}

func (h *cgroupHost) enforced() bool { return h.version != "" && h.reason == "" }

// detectCgroups picks v2 when a cgroup2 mount offers memory, pids and cpu, else the v1 per-controller
// hierarchies, and creates <mount>/<parent> in each to prove they are writable. It never fails: what
// is not usable is recorded in reason and the sandboxes run without that limit.
func detectCgroups(parent string) *cgroupHost {
	h := &cgroupHost{parents: map[string]string{}}
	mounts, err := cgroupMounts()
	if err != nil {
		h.reason = "cannot read /proc/self/mountinfo: " + err.Error()
		return h
	}
	for _, m := range mounts {
		if !m.v2 {
			continue
		}
		ctrls, err := os.ReadFile(filepath.Join(m.dir, "cgroup.controllers"))
		if err != nil || !hasAll(strings.Fields(string(ctrls)), cgroupControllers) {
			continue
		}
		dir := filepath.Join(m.dir, parent)
		err = setupV2Parent(m.dir, dir)
		if err == nil {
			err = unix.Access(dir, unix.W_OK|unix.X_OK)
		}
		if err != nil {
			h.reason = fmt.Sprintf("cgroup v2 at %s is not usable: %v (run the broker as root or give it a delegated cgroup)", m.dir, err)
			return h
		}
		h.version = "v2"
		for _, c := range cgroupControllers {
			h.parents[c] = dir
		}
		return h
	}
	var missing, failed []string
	for _, c := range cgroupControllers {
		mnt := ""
		for _, m := range mounts {
			if !m.v2 && m.has(c) {
				mnt = m.dir
				break
			}
		}
		if mnt == "" {
			missing = append(missing, c)
			continue
		}
		dir := filepath.Join(mnt, parent)
		err := os.MkdirAll(dir, 0o755)
		if err == nil {
			// It may exist already (made by a root broker) without being ours to write.
			err = unix.Access(dir, unix.W_OK|unix.X_OK)
		}
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s (%s: %v)", c, dir, unwrapPathErr(err)))
			continue
		}
		h.parents[c] = dir
	}
	if len(h.parents) > 0 {
		h.version = "v1"
		h.homes = v1Homes(mounts)
	}
	var why []string
	if len(missing) > 0 {
		why = append(why, "no cgroup controller for "+strings.Join(missing, ", ")+" (no cgroup2 mount with them, no v1 hierarchy)")
	}
	if len(failed) > 0 {
		why = append(why, "cannot create cgroups for "+strings.Join(failed, ", ")+": run the broker as root or give it a delegated cgroup")
	}
	h.reason = strings.Join(why, "; ")
	return h
}

// setupV2Parent creates the parent cgroup and enables the controllers for its children. v2 only lets a
// cgroup use a controller its parent enabled in cgroup.subtree_control, all the way from the root.
func setupV2Parent(root, dir string) error {
	want := "+memory +pids +cpu"
	if err := os.WriteFile(filepath.Join(root, "cgroup.subtree_control"), []byte(want), 0); err != nil {
		return err
	}
	rel, _ := filepath.Rel(root, dir)
	cur := root
	for _, part := range strings.Split(rel, string(filepath.Separator)) {
		cur = filepath.Join(cur, part)
		if err := os.Mkdir(cur, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		if err := os.WriteFile(filepath.Join(cur, "cgroup.subtree_control"), []byte(want), 0); err != nil {
			return err
		}
	}
	return nil
}

// v1Homes is controller → the dir of this process's cgroup in that controller's v1 hierarchy, from
// /proc/self/cgroup ("4:memory:/some/path"), for the controllers limits use.
func v1Homes(mounts []cgroupMount) map[string]string {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil
	}
	homes := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			for _, m := range mounts {
				if !m.v2 && m.has(c) {
					homes[c] = filepath.Join(m.dir, f[2])
				}
			}
		}
	}
	return homes
}

type cgroupMount struct {
	dir  string
	v2   bool
	opts []string // v1 super options (holds the controller names)
}

func (m cgroupMount) has(c string) bool {
	for _, o := range m.opts {
		if o == c {
			return true
		}
	}
	return false
}

func cgroupMounts() ([]cgroupMount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []cgroupMount
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "36 25 0:31 / /sys/fs/cgroup/memory rw,relatime shared:15 - cgroup cgroup rw,memory"
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 {
			continue
		}
		switch qf[0] {
		case "cgroup2":
			out = append(out, cgroupMount{dir: unescapeMount(pf[4]), v2: true})
		case "cgroup":
			out = append(out, cgroupMount{dir: unescapeMount(pf[4]), opts: strings.Split(qf[2], ",")})
		}
	}
	return out, sc.Err()
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func hasAll(have, want []string) bool {
	for _, w := range want {
		found := false
		for _, h := range have {
			if h == w {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// staleCgroupAge is how old an empty sandbox cgroup must be before a starting provider removes it
// as a leftover. A live sandbox's cgroup is empty only for the milliseconds between its creation
// and the attach, so anything empty and older is what a crashed broker could not remove.
const staleCgroupAge = time.Minute

// sweepStale removes empty sandbox cgroups older than minAge under the parents: the leftovers of a
// broker that crashed (its sandboxes died with it, their cgroups stayed).
func (h *cgroupHost) sweepStale(minAge time.Duration) {
	seen := map[string]bool{}
	for _, parent := range h.parents {
		if seen[parent] {
			continue
		}
		seen[parent] = true
		entries, err := os.ReadDir(parent)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if !e.IsDir() || !validID(e.Name()) {
				continue
			}
			dir := filepath.Join(parent, e.Name())
			fi, err := e.Info()
			if err != nil || time.Since(fi.ModTime()) < minAge {
				continue
			}
			if procs, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil && len(bytes.TrimSpace(procs)) == 0 {
				os.Remove(dir) // fails harmlessly if a process joined meanwhile
			}
		}
	}
}

// cgroupSet is one sandbox's cgroups: one dir on v2, one per controller on v1.
type cgroupSet struct {
	v2     bool
	dirs   []string // distinct dirs, for attach and remove
	memDir string   // where the OOM-kill counter lives; "" without a memory controller
	// homes are, for each of dirs (v1), the broker's own cgroup in the same hierarchy; nil when the
	// sandbox cannot be born in its cgroups (v2, or a home unknown): see placeThread.
	homes []string
}

// create makes the sandbox's cgroups and writes its limits. An existing cgroup of the same name (a
// broker that crashed before removing it) is reused; its old limits are overwritten.
func (h *cgroupHost) create(id string, l Limits) (*cgroupSet, error) {
	if h.version == "" {
		return nil, nil
	}
	s := &cgroupSet{v2: h.version == "v2"}
	seen := map[string]bool{}
	for _, c := range cgroupControllers {
		parent, ok := h.parents[c]
		if !ok {
			continue
		}
		dir := filepath.Join(parent, id)
		if !seen[dir] {
			if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
				s.remove()
				return nil, fmt.Errorf("create cgroup %s: %w", dir, err)
			}
			seen[dir] = true
			s.dirs = append(s.dirs, dir)
			s.homes = append(s.homes, h.homes[c])
		}
		if err := s.writeLimit(c, dir, l); err != nil {
			s.remove()
			return nil, err
		}
		if c == "memory" {
			s.memDir = dir
		}
	}
	if s.v2 || slices.Contains(s.homes, "") {
		s.homes = nil
	}
	return s, nil
}

// callingThread is what a v1 "tasks" file takes for the thread that writes it. Named by its tid,
// the move takes the kernel's global threadgroup lock for writing, which waits for an RCU grace
// period (2-3 ms each here, 6-7 ms for a sandbox's three cgroups, more under load) and holds up
// every fork on the host meanwhile, bwrap's included. The writer itself cannot exit or exec under
// the move, so a kernel that knows it (6.18 here) skips the lock for "0": 0.05 ms a move. An older
// kernel takes the lock either way, as it did for the tid.
var callingThread = []byte("0")

// placeable reports whether a sandbox can be forked inside these cgroups (placeThread).
func (s *cgroupSet) placeable() bool { return s != nil && len(s.homes) > 0 }

// placeThread moves the calling OS thread, alone, into the set's cgroups (v1 lets threads of one
// process sit in different cgroups), so that a process it forks is born in them. bwrap clones the
// sandbox with its cgroup namespace right after it starts, before the broker could move it, and a
// cgroup namespace's root is its creator's cgroup: born inside, the sandbox sees its own cgroups as
// / in /proc/self/cgroup, where moved later it saw the broker's cgroup path and its own id below
// it. The caller must be locked to its thread and call homeThread after the fork.
func (s *cgroupSet) placeThread() error {
	for i, dir := range s.dirs {
		if err := os.WriteFile(filepath.Join(dir, "tasks"), callingThread, 0); err != nil {
			s.homeThread(i)
			return fmt.Errorf("place the spawner thread in cgroup %s: %w", dir, err)
		}
	}
	return nil
}

// homeThread moves the calling thread back to the broker's cgroups, for the first n dirs (-1: all).
// The sandbox's cgroups can be removed only once it is out.
func (s *cgroupSet) homeThread(n int) error {
	if n < 0 {
		n = len(s.dirs)
	}
	var errs []error
	for i := 0; i < n; i++ {
		if err := os.WriteFile(filepath.Join(s.homes[i], "tasks"), callingThread, 0); err != nil {
			errs = append(errs, fmt.Errorf("move the spawner thread back to cgroup %s: %w", s.homes[i], err))
		}
	}
	return errors.Join(errs...)
}

func (s *cgroupSet) writeLimit(controller, dir string, l Limits) error {
	type kv struct{ file, value string }
	var writes []kv
	optional := map[string]bool{}
	switch {
	case controller == "memory" && s.v2:
		writes = []kv{{"memory.max", itoa(l.MemoryBytes)}, {"memory.swap.max", "0"}}
		optional["memory.swap.max"] = true // absent without swap accounting
	case controller == "memory":
		// memsw caps memory+swap, so swap cannot dodge the limit; it must come after
		// limit_in_bytes (memsw >= memory is enforced) and is absent without swap accounting.
		// A reused cgroup may hold a smaller memsw limit, which would block raising the memory
		// limit; this first write fixes that and is redone below when lowering.
		_ = os.WriteFile(filepath.Join(dir, "memory.memsw.limit_in_bytes"), []byte(itoa(l.MemoryBytes)), 0)
		writes = []kv{{"memory.limit_in_bytes", itoa(l.MemoryBytes)}, {"memory.memsw.limit_in_bytes", itoa(l.MemoryBytes)}}
		optional["memory.memsw.limit_in_bytes"] = true
	case controller == "pids":
		writes = []kv{{"pids.max", itoa(l.Pids)}}
	case controller == "cpu" && s.v2:
		const period = 100000
		writes = []kv{{"cpu.max", fmt.Sprintf("%d %d", int64(l.CPUs*period), period)}}
	case controller == "cpu":
		const period = 100000
		writes = []kv{{"cpu.cfs_period_us", itoa(period)}, {"cpu.cfs_quota_us", itoa(int64(l.CPUs * period))}}
	}
	for _, w := range writes {
		p := filepath.Join(dir, w.file)
		if err := os.WriteFile(p, []byte(w.value), 0); err != nil {
			if optional[w.file] && errors.Is(err, fs.ErrNotExist) {
				continue
			}
			return fmt.Errorf("set cgroup limit %s=%s: %w", p, w.value, err)
		}
	}
	return nil
}

// attach moves processes (each with all its threads) into every cgroup of the set. Children forked
// afterwards inherit the cgroups, which is why this runs before the first command.
func (s *cgroupSet) attach(pids ...int) error {
	// "0" in cgroup.procs names the writer, and our own pid is the broker: either would put the
	// broker, every thread of it, under a tenant's limits (its OOM kills included).
	for _, pid := range pids {
		if pid <= 0 || pid == os.Getpid() {
			return fmt.Errorf("attach pid %d to a sandbox's cgroups: refused, it would move the broker itself", pid)
		}
	}
	for _, dir := range s.dirs {
		for _, pid := range pids {
			if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
				return fmt.Errorf("attach pid %d to cgroup %s: %w", pid, dir, err)
			}
		}
	}
	return nil
}

// oomKills is the cgroup's OOM-kill counter (v1 memory.oom_control, v2 memory.events), -1 if unknown.
func (s *cgroupSet) oomKills() int64 {
	if s == nil || s.memDir == "" {
		return -1
	}
	file := "memory.oom_control"
	if s.v2 {
		file = "memory.events"
	}
	b, err := os.ReadFile(filepath.Join(s.memDir, file))
	if err != nil {
		return -1
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("oom_kill ")); ok {
			n, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64)
			if err == nil {
				return n
			}
		}
	}
	return -1
}

// memoryLimit is the memory limit in bytes, -1 if unknown or unlimited.
func (s *cgroupSet) memoryLimit() int64 {
	if s == nil || s.memDir == "" {
		return -1
	}
	file := "memory.limit_in_bytes"
	if s.v2 {
		file = "memory.max"
	}
	b, err := os.ReadFile(filepath.Join(s.memDir, file))
	if err != nil {
		return -1
	}
	n, err := strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
	if err != nil {
		return -1
	}
	return n
}

// shmem is the cgroup's memory that no process holds: tmpfs files (/tmp, /dev/shm) and SysV shared
// memory, -1 if unknown.
func (s *cgroupSet) shmem() int64 {
	if s == nil || s.memDir == "" {
		return -1
	}
	b, err := os.ReadFile(filepath.Join(s.memDir, "memory.stat"))
	if err != nil {
		return -1
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		// v1 has shmem (this cgroup) and total_shmem (with children); v2 has shmem only.
		if v, ok := bytes.CutPrefix(line, []byte("shmem ")); ok {
			if n, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64); err == nil {
				return n
			}
		}
	}
	return -1
}

// watchOOM calls fn after each OOM event of the cgroup (v1: an eventfd registered on
// memory.oom_control) until the returned stop is called. Where it cannot watch (v2, no memory
// controller, no permission) it returns a no-op: callers then look only when a command was killed.
func (s *cgroupSet) watchOOM(fn func()) (stop func()) {
	nop := func() {}
	if s == nil || s.memDir == "" || s.v2 {
		return nop
	}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nop
	}
	oc, err := os.Open(filepath.Join(s.memDir, "memory.oom_control"))
	if err != nil {
		unix.Close(efd)
		return nop
	}
	defer oc.Close() // the registration holds its own reference
	reg := fmt.Sprintf("%d %d", efd, oc.Fd())
	if err := os.WriteFile(filepath.Join(s.memDir, "cgroup.event_control"), []byte(reg), 0); err != nil {
		unix.Close(efd)
		return nop
	}
	// The kernel signals the eventfd on removal only once the memory cgroup is freed, which may be
	// long after rmdir (while pages are still charged to it), so the owner closes it.
	ev := os.NewFile(uintptr(efd), "oom-events")
	go func() {
		var buf [8]byte
		for {
			if _, err := ev.Read(buf[:]); err != nil {
				return
			}
			fn()
		}
	}()
	return func() { ev.Close() }
}

// stat reads one value file of the set (tests and diagnostics): e.g. "pids.max".
func (s *cgroupSet) stat(file string) string {
	if s == nil {
		return ""
	}
	for _, dir := range s.dirs {
		if b, err := os.ReadFile(filepath.Join(dir, file)); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	return ""
}

// remove deletes the cgroups. A cgroup can be removed only once its last task is gone: killed
// processes leave it only as they finish exiting, which under load (hundreds of them, a busy host)
// takes more than a second, so it retries while the removal says busy, for up to cgroupDrainWait.
func (s *cgroupSet) remove() error {
	if s == nil {
		return nil
	}
	var errs []error
	dirs := append([]string(nil), s.dirs...)
	sort.Sort(sort.Reverse(sort.StringSlice(dirs)))
	deadline := time.Now().Add(cgroupDrainWait)
	for _, dir := range dirs {
		var err error
		for wait := time.Millisecond; ; wait = min(2*wait, 100*time.Millisecond) {
			err = os.Remove(dir)
			if err == nil || errors.Is(err, fs.ErrNotExist) {
				err = nil
				break
			}
			if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
				break
			}
			time.Sleep(wait)
		}
		if err != nil {
			if b, rerr := os.ReadFile(filepath.Join(dir, "cgroup.procs")); rerr == nil && len(b) > 0 {
				err = fmt.Errorf("%w (processes still in it: %s)", err, strings.Join(strings.Fields(string(b)), " "))
			}
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}

// cgroupDrainWait bounds how long remove waits for a sandbox's killed processes to leave its
// cgroups.
const cgroupDrainWait = 10 * time.Second

func itoa(v int64) string { return strconv.FormatInt(v, 10) }
