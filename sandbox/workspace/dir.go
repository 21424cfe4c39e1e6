package workspace

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"slices"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sbxbroker/broker/membudget"
)

// A walk reads a directory's names in batches (no stat each, as os.File.ReadDir does in a Root),
// then looks entries up relative to the directory's descriptor: lstat with fstatat, and a
// subdirectory with openat(O_DIRECTORY|O_NOFOLLOW|O_NONBLOCK), so a name swapped for a symlink, a
// FIFO or a device is refused, never followed or blocked on. Names come from readdir, one path
// element each, so nothing resolves outside the directory.

// dirBatch is how many names one read of a directory takes: the unit between checks of the
// context and the scan budget.
const dirBatch = 1024

// dirFlags open a directory without following a final symlink and without blocking on anything
// else swapped in.
const dirFlags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_CLOEXEC

// dir is an open directory being walked.
type dir struct {
	f  *os.File
	rc syscall.RawConn
}

func newDir(f *os.File) (*dir, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &dir{f: f, rc: rc}, nil
}

func (d *dir) Close() error { return d.f.Close() }

// lstat describes the entry name of d without following a symlink.
func (d *dir) lstat(name string) (fs.FileInfo, error) {
	fi := &statInfo{name: name}
	var err error
	if cerr := d.rc.Control(func(fd uintptr) {
		err = ignoringEINTR(func() error { return unix.Fstatat(int(fd), name, &fi.st, unix.AT_SYMLINK_NOFOLLOW) })
	}); cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, &fs.PathError{Op: "lstat", Path: name, Err: err}
	}
	return fi, nil
}

// sub opens the subdirectory name of d, which must still be the file want (an lstat of it).
func (d *dir) sub(name string, want fs.FileInfo) (*dir, error) {
	sd, err := d.open(name)
	if err != nil {
		return nil, err
	}
	if err := sd.same(want); err != nil {
		sd.Close()
		return nil, err
	}
	return sd, nil
}

// open opens the subdirectory name of d. A symlink there is refused (ENOTDIR or ELOOP), never
// followed.
func (d *dir) open(name string) (*dir, error) {
	var (
		nfd int
		err error
	)
	if cerr := d.rc.Control(func(fd uintptr) {
		err = ignoringEINTR(func() (e error) { nfd, e = unix.Openat(int(fd), name, dirFlags, 0); return e })
	}); cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, &fs.PathError{Op: "openat", Path: name, Err: err}
	}
	return newDir(os.NewFile(uintptr(nfd), name))
}

// mkdir creates the directory name in d; it never follows a symlink at name (that is EEXIST).
func (d *dir) mkdir(name string, perm uint32) error {
	var err error
	if cerr := d.rc.Control(func(fd uintptr) {
		err = ignoringEINTR(func() error { return unix.Mkdirat(int(fd), name, perm) })
	}); cerr != nil {
		return cerr
	}
	if err != nil {
		return &fs.PathError{Op: "mkdirat", Path: name, Err: err}
	}
	return nil
}

// same fails with fs.ErrNotExist unless d is the file want describes: a directory swapped since it
// was listed in its parent is not entered.
func (d *dir) same(want fs.FileInfo) error {
	w, ok := want.(*statInfo)
	if !ok {
		return fs.ErrNotExist
	}
	var st unix.Stat_t
	var err error
	if cerr := d.rc.Control(func(fd uintptr) { err = unix.Fstat(int(fd), &st) }); cerr != nil {
		return cerr
	}
	if err != nil {
		return err
	}
	if st.Dev != w.st.Dev || st.Ino != w.st.Ino {
		return fs.ErrNotExist
	}
	return nil
}

// names reads the names of d, sorted, in batches that draw on sc.
func (d *dir) names(sc *scan) ([]string, error) {
	var names []string
	for {
		if err := ctxErr(sc.ctx); err != nil {
			return nil, err
		}
		n := min(dirBatch, sc.left)
		if n == 0 {
			// The budget is spent: one more name says whether it cut anything.
			if more, _ := d.f.Readdirnames(1); len(more) > 0 {
				sc.cut = true
			}
			break
		}
		batch, err := d.f.Readdirnames(n)
		var cost int64
		for _, name := range batch {
			cost += membudget.StringCost(name)
		}
		if err := sc.mem.Grow(cost); err != nil {
			return nil, err
		}
		names = append(names, batch...)
		sc.left -= len(batch)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if !sc.temps {
		// An upload's temporary file is the broker's, not the tenant's: listing it would show
		// half a file under a name nobody wrote (and a path that vanishes at commit).
		names = slices.DeleteFunc(names, isTempName)
	}
	slices.Sort(names)
	return names, nil
}

func ignoringEINTR(fn func() error) error {
	for {
		if err := fn(); !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// statInfo is an fs.FileInfo from a raw stat, converted as package os converts one.
type statInfo struct {
	name string
	st   unix.Stat_t
}

func (s *statInfo) Name() string       { return s.name }
func (s *statInfo) Size() int64        { return s.st.Size }
func (s *statInfo) IsDir() bool        { return s.Mode().IsDir() }
func (s *statInfo) Sys() any           { return &s.st }
func (s *statInfo) ModTime() time.Time { return time.Unix(int64(s.st.Mtim.Sec), int64(s.st.Mtim.Nsec)) }

func (s *statInfo) Mode() fs.FileMode {
	m := uint32(s.st.Mode)
	mode := fs.FileMode(m & 0o777)
	switch m & unix.S_IFMT {
	case unix.S_IFBLK:
		mode |= fs.ModeDevice
	case unix.S_IFCHR:
		mode |= fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFDIR:
		mode |= fs.ModeDir
	case unix.S_IFIFO:
		mode |= fs.ModeNamedPipe
	case unix.S_IFLNK:
		mode |= fs.ModeSymlink
	case unix.S_IFSOCK:
		mode |= fs.ModeSocket
	}
	if m&unix.S_ISGID != 0 {
		mode |= fs.ModeSetgid
	}
	if m&unix.S_ISUID != 0 {
		mode |= fs.ModeSetuid
	}
	if m&unix.S_ISVTX != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}
