package workspace

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path"
	"strings"
	"sync"
	"syscall"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/protocol"
	"golang.org/x/sys/unix"
)

const (
	tempPrefix = ".sbx-tmp-"
	filePerm   = 0o644 // new files
	dirPerm    = 0o755 // new directories (before the process umask)
	maxHops    = 40    // symlinks realPath follows, as the kernel does
)

// Write writes a whole file atomically and creates missing parent directories. A symlink at the
// path is written through when it resolves inside the workspace (the link stays a link); one that
// leads out is invalid_path. Overwriting keeps the file's permission bits.
func (w *Workspace) Write(a protocol.WriteArgs) (protocol.WriteResult, error) {
	var content []byte
	switch a.Encoding {
	case "", protocol.EncodingUTF8:
	case protocol.EncodingBase64:
		var err error
		if content, err = base64.StdEncoding.DecodeString(a.Content); err != nil {
			return protocol.WriteResult{}, protocol.Errorf(protocol.CodeInvalidArgument, "content is not valid base64: %v", err)
		}
	default:
		return protocol.WriteResult{}, protocol.Errorf(protocol.CodeInvalidArgument, "unknown encoding %s; use %q or %q", quote(a.Encoding), protocol.EncodingUTF8, protocol.EncodingBase64)
	}
	u, err := w.Create(a.Path, a.Mode)
	if err != nil {
		return protocol.WriteResult{}, err
	}
	defer u.Abort()
	if content != nil {
		_, err = u.Write(content)
	} else {
		_, err = u.writeString(a.Content)
	}
	if err != nil {
		return protocol.WriteResult{}, err
	}
	return u.Commit()
}

// Upload is a file being written by Create: its bytes go to a temporary file next to the target,
// which Commit renames into place and Abort removes. An Upload may be aborted from another
// goroutine; Write and Commit are meant for one writer.
type Upload struct {
	w      *Workspace
	sp     string // the requested sandbox path, for results and messages
	target string // the file to replace: the requested path, or where its symlink leads
	temp   string
	create bool // mode "create": never replace an existing file
	// old is what Create found at target (nil: nothing), so Commit need not look again.
	old fs.FileInfo

	mu   sync.Mutex
	f    *os.File
	n    int64
	done bool
}

// Create starts a streaming upload to path; mode is protocol.WriteOverwrite (also "") or
// protocol.WriteCreate. The target, and its missing parents, are untouched until Commit: an upload
// that never commits leaves nothing behind. Paths are
// handled like Write handles them, except that in mode "create" a symlink at the path (dangling or
// not) counts as existing. Callers should defer Abort, which is a no-op after Commit.
func (w *Workspace) Create(p string, mode string) (*Upload, error) {
	var create bool
	switch mode {
	case "", protocol.WriteOverwrite:
	case protocol.WriteCreate:
		create = true
	default:
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "unknown write mode %s; use %q or %q", quote(mode), protocol.WriteOverwrite, protocol.WriteCreate)
	}
	rel, sp, err := resolve(p)
	if err != nil {
		return nil, err
	}
	if namesDir(p) {
		// Resolve cleans "f/" to "f"; a file must not be made or replaced under the cleaned name.
		return nil, protocol.Errorf(protocol.CodeIsDirectory, "%s names a directory (it ends in /, /. or /..); a file cannot be written there", quote(p))
	}
	var target string
	var old fs.FileInfo
	if create {
		// Like O_CREAT|O_EXCL: anything at the path, a symlink too (dangling or not), exists.
		switch _, err := w.root.Lstat(rel); {
		case rel == ".":
			return nil, protocol.Errorf(protocol.CodeIsDirectory, "%s is a directory; a file cannot replace it", sp)
		case err == nil:
			return nil, protocol.Errorf(protocol.CodeFileExists, "%s already exists; write with mode %q to replace it", sp, protocol.WriteOverwrite)
		case !errors.Is(err, fs.ErrNotExist):
			return nil, fsErr(sp, err)
		}
		target = rel
	} else {
		if target, old, err = w.writeTarget(rel, sp); err != nil {
			return nil, err
		}
		if old != nil {
			if err := checkWritable(sp, old); err != nil {
				return nil, err
			}
		}
	}
	f, temp, err := w.createTemp(path.Dir(target), sp)
	if err != nil {
		return nil, err
	}
	return &Upload{w: w, sp: sp, target: target, temp: temp, create: create, f: f, old: old}, nil
}

// checkWritable refuses to replace what a file write must not: a directory, a FIFO, a socket, a
// device.
func checkWritable(sp string, fi fs.FileInfo) error {
	switch {
	case fi.IsDir():
		return protocol.Errorf(protocol.CodeIsDirectory, "%s is a directory; a file cannot replace it", sp)
	case !fi.Mode().IsRegular():
		return notRegular(sp, fi)
	}
	return nil
}

// Write appends p to the upload.
func (u *Upload) Write(p []byte) (int, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return 0, u.finished()
	}
	n, err := u.f.Write(p)
	u.n += int64(n)
	return n, fsErr(u.sp, err)
}

func (u *Upload) writeString(s string) (int, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return 0, u.finished()
	}
	n, err := u.f.WriteString(s)
	u.n += int64(n)
	return n, fsErr(u.sp, err)
}

func (u *Upload) finished() error {
	return protocol.Errorf(protocol.CodeInvalidArgument, "the upload to %s is already committed or aborted", u.sp)
}

// Commit puts the uploaded content in place atomically: readers see the old file or the new one.
// It keeps the replaced file's permission bits (0644 for a new file). In mode "create" it fails
// with file_exists, leaving the existing file alone, if the path appeared meanwhile. Whatever
// happens, the temporary file is gone afterwards.
func (u *Upload) Commit() (protocol.WriteResult, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return protocol.WriteResult{}, u.finished()
	}
	u.done = true
	defer u.w.lock(u.target)()
	created, err := u.w.commitTemp(u.f, u.temp, u.target, u.sp, u.create, u.old)
	if err != nil {
		return protocol.WriteResult{}, err
	}
	return protocol.WriteResult{Path: u.sp, Size: u.n, Created: created}, nil
}

// Abort drops the upload: the temporary file is removed and the target is untouched. It is a
// no-op after Commit or a previous Abort.
func (u *Upload) Abort() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return nil
	}
	u.done = true
	u.f.Close()
	defer u.w.dropTemp(u.temp)
	if err := u.w.root.Remove(u.temp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fsErr(u.sp, err)
	}
	return nil
}

// createTemp creates an empty temporary file in dir, owned by the sandbox user; when dir is
// missing, in the workspace's root (its file system too), so that nothing but the temporary file
// exists until a commit makes dir (commitTemp). O_EXCL never follows a symlink, so a planted name
// cannot redirect it.
func (w *Workspace) createTemp(dir, sp string) (*os.File, string, error) {
	for try := 0; ; try++ {
		temp := join(dir, fmt.Sprintf("%s%016x", tempPrefix, rand.Uint64()))
		// Held before it exists, so that a sweep (SweepTemps) never finds it unheld.
		w.holdTemp(temp)
		f, fast, err := w.fastOpen(temp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if !fast {
			f, err = w.root.OpenFile(temp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		}
		if err != nil {
			w.dropTemp(temp)
		}
		switch {
		case err == nil:
			if err := w.chownFile(f); err != nil {
				f.Close()
				w.root.Remove(temp)
				w.dropTemp(temp)
				return nil, "", fsErr(sp, err)
			}
			return f, temp, nil
		case errors.Is(err, fs.ErrNotExist) && dir != ".":
			dir = "."
		case errors.Is(err, fs.ErrExist) && try < 3: // a name collision: draw again
		default:
			return nil, "", fsErr(sp, err)
		}
	}
}

// commitTemp closes the temporary file f and puts it at target, with the permission bits of the
// file it replaces (or keep's, when given), and reports whether target is new. The caller holds
// target's stripe lock. The temporary file is removed on every path but success.
func (w *Workspace) commitTemp(f *os.File, temp, target, sp string, create bool, keep fs.FileInfo) (created bool, err error) {
	defer w.dropTemp(temp)
	defer func() {
		if err != nil {
			w.root.Remove(temp)
		}
	}()
	if dir := path.Dir(target); path.Dir(temp) != dir {
		// The temporary file waited in the root for dir to be made now (createTemp).
		if err := w.mkdirAll(dir); err != nil {
			f.Close()
			return false, fsErr(sp, err)
		}
	}
	perm := fs.FileMode(filePerm)
	old := keep
	if old == nil {
		switch fi, err := w.root.Lstat(target); {
		case err == nil:
			old = fi
		case !errors.Is(err, fs.ErrNotExist):
			f.Close()
			return false, fsErr(sp, err)
		}
	}
	if old != nil {
		if create {
			f.Close()
			return false, protocol.Errorf(protocol.CodeFileExists, "%s already exists; write with mode %q to replace it", sp, protocol.WriteOverwrite)
		}
		if old.IsDir() {
			f.Close()
			return false, protocol.Errorf(protocol.CodeIsDirectory, "%s is a directory; a file cannot replace it", sp)
		}
		if old.Mode().IsRegular() {
			// Only the permission bits: setuid, setgid and sticky never carry over to new content.
			perm = old.Mode().Perm()
		}
	}
	// Set the mode exactly (the umask applied at creation), before the file becomes visible.
	err = f.Chmod(perm)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, fsErr(sp, err)
	}
	if !create {
		rename := w.root.Rename
		if old != nil && old.Mode().IsRegular() && path.Dir(temp) == path.Dir(target) {
			rename = w.replace
		}
		if err := rename(temp, target); err != nil {
			return false, fsErr(sp, err)
		}
		return old == nil, nil
	}
	// Mode "create": a hard link fails if the name exists, so a file created concurrently (by the
	// sandbox or another caller) between the check above and now is never clobbered.
	switch err := w.root.Link(temp, target); {
	case err == nil:
		w.root.Remove(temp)
		return true, nil
	case errors.Is(err, fs.ErrExist):
		return false, protocol.Errorf(protocol.CodeFileExists, "%s already exists; write with mode %q to replace it", sp, protocol.WriteOverwrite)
	case errors.Is(err, fs.ErrNotExist), isEscape(err):
		return false, fsErr(sp, err)
	}
	// No hard links on this file system: create the target exclusively and copy into it. It is
	// not atomic for readers, but it still never replaces an existing file.
	return true, w.copyExclusive(temp, target, sp, perm)
}

func (w *Workspace) copyExclusive(temp, target, sp string, perm fs.FileMode) error {
	src, err := w.root.OpenFile(temp, openReadFlags, 0)
	if err != nil {
		return fsErr(sp, err)
	}
	defer src.Close()
	dst, err := w.root.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return fsErr(sp, err)
	}
	_, err = io.Copy(dst, src)
	if err == nil {
		err = w.chownFile(dst)
	}
	if err == nil {
		err = dst.Chmod(perm)
	}
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		w.root.Remove(target)
		return fsErr(sp, err)
	}
	w.root.Remove(temp)
	return nil
}

// writeTarget decides which file a write to rel replaces: rel itself, or, when rel is a symlink,
// the file it resolves to inside the workspace. fi is that file's lstat, nil if it does not exist.
func (w *Workspace) writeTarget(rel, sp string) (target string, fi fs.FileInfo, err error) {
	if rel == "." {
		return "", nil, protocol.Errorf(protocol.CodeIsDirectory, "%s is a directory; a file cannot replace it", sp)
	}
	fi, err = w.root.Lstat(rel)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return rel, nil, nil
	case err != nil:
		return "", nil, fsErr(sp, err)
	case fi.Mode()&fs.ModeSymlink == 0:
		return rel, fi, nil
	}
	// Renaming onto rel would replace the link itself; find the file it names instead. Parent
	// directories that are symlinks need no such care: the rename resolves them through the root.
	target, err = w.realPath(rel)
	if err != nil {
		return "", nil, fsErr(sp, err)
	}
	fi, err = w.root.Lstat(target)
	switch {
	case errors.Is(err, fs.ErrNotExist): // a dangling link inside the workspace: create its target
		return target, nil, nil
	case err != nil:
		return "", nil, fsErr(sp, err)
	}
	return target, fi, nil
}

// realPath resolves every symlink in rel, as the kernel would, and returns a relative path with
// none left, or errOutside when a link is absolute or climbs out. Every lookup goes through the
// root, so a concurrent change to the tree can make the answer stale but never point it outside.
// Components after a missing one are kept as they are.
func (w *Workspace) realPath(rel string) (string, error) {
	todo := strings.Split(rel, "/")
	var done []string
	hops := 0
	for len(todo) > 0 {
		c := todo[0]
		todo = todo[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(done) == 0 {
				return "", errOutside
			}
			done = done[:len(done)-1]
			continue
		}
		cur := strings.Join(append(done[:len(done):len(done)], c), "/")
		fi, err := w.root.Lstat(cur)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			p := path.Join(append([]string{cur}, todo...)...)
			if p == ".." || strings.HasPrefix(p, "../") {
				return "", errOutside
			}
			return p, nil
		case err != nil:
			return "", err
		case fi.Mode()&fs.ModeSymlink == 0:
			if len(todo) > 0 && !fi.IsDir() {
				return "", syscall.ENOTDIR
			}
			done = append(done, c)
			continue
		}
		if hops++; hops > maxHops {
			return "", syscall.ELOOP
		}
		link, err := w.root.Readlink(cur)
		if err != nil {
			return "", err
		}
		if path.IsAbs(link) {
			return "", errOutside
		}
		todo = append(strings.Split(link, "/"), todo...)
	}
	if len(done) == 0 {
		return ".", nil
	}
	return strings.Join(done, "/"), nil
}

// mkdirAll creates rel and its missing parents, each owned by the sandbox user. Existing
// directories (or symlinks to directories inside the workspace) are fine; a file in the way is
// ENOTDIR. When rel's parent exists, that is one Mkdir through the root; otherwise mkdirWalk.
func (w *Workspace) mkdirAll(rel string) error {
	w.lookUp(rel)
	err := w.root.Mkdir(rel, dirPerm)
	switch {
	case err == nil:
		return w.chownPath(rel)
	case errors.Is(err, fs.ErrExist):
		w.lookUp(rel)
		fi, err := w.root.Stat(rel)
		if err != nil {
			return err
		}
		if !fi.IsDir() {
			return syscall.ENOTDIR
		}
		return nil
	case errors.Is(err, fs.ErrNotExist) && path.Dir(rel) != ".":
		return w.mkdirWalk(rel)
	}
	return err
}

// mkdirWalk is mkdirAll for a path whose parent is missing. Retrying the root's Mkdir on each
// parent in turn would walk the path from the root once per level: quadratic in the depth, seconds
// of CPU for the thousands of levels 4096 bytes allow, at the bidding of anyone who may write. So
// the path is walked once, a component at a time on directory descriptors, each level opened or
// created relative to its parent.
func (w *Workspace) mkdirWalk(rel string) error {
	w.lookUp(".")
	f, err := w.root.OpenFile(".", os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return err
	}
	d, err := newDir(f)
	if err != nil {
		return err
	}
	hops := 0
	for start := 0; ; {
		end := len(rel)
		if i := strings.IndexByte(rel[start:], '/'); i >= 0 {
			end = start + i
		}
		sub, err := w.mkdirStep(d, rel[start:end], rel[:end], &hops)
		d.Close()
		if err != nil {
			return err
		}
		d = sub
		if end == len(rel) {
			break
		}
		start = end + 1
	}
	d.Close()
	return nil
}

// mkdirStep enters the directory name of d, creating it if missing; prefix is the path from the
// root to name. A directory is entered on d's descriptor, never through a symlink. Anything else
// (a symlink, a file) is resolved through the root from prefix, which follows links as the kernel
// would but never out of the workspace, and says ENOTDIR for a file. hops counts those walks from
// the root: each follows one link more than the last, and the root follows a few at most in one
// path (8 in Go 1.26), so more than maxHops of them is a sandbox swapping files and directories
// under the walk, which gets ELOOP rather than a walk from the root per level.
func (w *Workspace) mkdirStep(d *dir, name, prefix string, hops *int) (*dir, error) {
	w.lookUp(name)
	sub, err := d.open(name)
	if errors.Is(err, fs.ErrNotExist) {
		w.lookUp(name)
		switch err := d.mkdir(name, dirPerm); {
		case err == nil:
			return w.madeDir(d, name)
		case !errors.Is(err, fs.ErrExist):
			return nil, err
		}
		w.lookUp(name)
		sub, err = d.open(name) // someone made it meanwhile
	}
	if isNotDir(err) || errors.Is(err, syscall.ELOOP) {
		if *hops++; *hops > maxHops {
			return nil, syscall.ELOOP
		}
		w.lookUp(prefix)
		f, err := w.root.OpenFile(prefix, os.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return nil, err
		}
		return newDir(f)
	}
	return sub, err
}

// madeDir opens name, a directory mkdirStep just made in d, and gives it to the sandbox user. Had
// the sandbox swapped it for a symlink meanwhile, the open refuses the link instead of following it.
func (w *Workspace) madeDir(d *dir, name string) (*dir, error) {
	w.lookUp(name)
	sub, err := d.open(name)
	if err != nil {
		return nil, err
	}
	if err := w.chownFile(sub.f); err != nil {
		sub.Close()
		return nil, err
	}
	return sub, nil
}

// lookUp tells a test's countLookups how many components mkdirAll's next lookup resolves.
func (w *Workspace) lookUp(p string) {
	if w.countLookups != nil {
		w.countLookups(strings.Count(p, "/") + 1)
	}
}

func (w *Workspace) chownFile(f *os.File) error {
	if w.opts.UID <= 0 && w.opts.GID <= 0 {
		return nil
	}
	return f.Chown(ownerID(w.opts.UID), ownerID(w.opts.GID))
}

func (w *Workspace) chownPath(rel string) error {
	if w.opts.UID <= 0 && w.opts.GID <= 0 {
		return nil
	}
	// Lchown: if the sandbox swapped the new directory for a symlink, the link is what changes.
	return w.root.Lchown(rel, ownerID(w.opts.UID), ownerID(w.opts.GID))
}

// ownerID is the chown argument for one configured id: -1 (unchanged) unless it is positive.
func ownerID(id int) int {
	if id <= 0 {
		return -1
	}
	return id
}

// Edit replaces an exact string in a regular file and writes the result atomically, keeping the
// file's permission bits.
func (w *Workspace) Edit(a protocol.EditArgs) (protocol.EditResult, error) {
	return w.EditContext(context.Background(), a)
}

// EditContext is Edit drawing what it holds, the file's content and then its result, from the
// caller's budget in ctx (membudget), shared with other operations: one that would pass it is
// refused with the budget's error and the file is unchanged.
func (w *Workspace) EditContext(ctx context.Context, a protocol.EditArgs) (protocol.EditResult, error) {
	mem := membudget.From(ctx)
	switch {
	case a.Old == "":
		return protocol.EditResult{}, protocol.Errorf(protocol.CodeInvalidArgument, "old is empty; give the exact text to replace")
	case a.Old == a.New:
		return protocol.EditResult{}, protocol.Errorf(protocol.CodeInvalidArgument, "old and new are the same; nothing would change")
	}
	rel, sp, err := resolve(a.Path)
	if err != nil {
		return protocol.EditResult{}, err
	}
	target, fi, err := w.writeTarget(rel, sp)
	if err != nil {
		return protocol.EditResult{}, err
	}
	if fi == nil {
		return protocol.EditResult{}, protocol.Errorf(protocol.CodeFileNotFound, "%s does not exist", sp)
	}
	if err := checkRegular(sp, fi); err != nil {
		return protocol.EditResult{}, err
	}
	if err := fileByName(a.Path, sp, fi); err != nil {
		return protocol.EditResult{}, err
	}
	defer w.lock(target)()

	f, fi, err := w.openRegular(target, sp)
	if err != nil {
		return protocol.EditResult{}, err
	}
	limit := w.opts.MaxEditBytes
	if fi.Size() > limit {
		f.Close()
		return protocol.EditResult{}, tooLargeToEdit(sp, fi.Size(), limit)
	}
	// ReadAll's buffer grows past the size as it reads: twice it at most.
	if err := mem.Grow(2 * fi.Size()); err != nil {
		f.Close()
		return protocol.EditResult{}, err
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	f.Close()
	if err != nil {
		return protocol.EditResult{}, fsErr(sp, err)
	}
	if int64(len(data)) > limit { // it grew since the fstat
		return protocol.EditResult{}, tooLargeToEdit(sp, int64(len(data)), limit)
	}
	old := []byte(a.Old)
	n := bytes.Count(data, old)
	switch {
	case n == 0:
		return protocol.EditResult{}, protocol.Errorf(protocol.CodeNoMatch, "old text not found in %s; read the file and copy the text exactly, whitespace included", sp)
	case n > 1 && !a.ReplaceAll:
		return protocol.EditResult{}, protocol.Errorf(protocol.CodeNotUnique, "old text occurs %d times in %s; add surrounding context to make it unique, or pass replace_all", n, sp)
	}
	// The result is sized before it is built: a short old text replaced everywhere by a long new
	// one multiplies the file (8 MiB of "a", each made 1 MiB, is 8 TiB), and an allocation that
	// large is a fatal error of the whole broker, not a panic a recover catches.
	if size := int64(len(data)) + int64(n)*(int64(len(a.New))-int64(len(old))); size > limit {
		return protocol.EditResult{}, protocol.Errorf(protocol.CodeTooLarge, "the edit would make %s %d bytes; edit makes files up to %d bytes, so rewrite it with write instead", sp, size, limit)
	} else if err := mem.Grow(size); err != nil {
		return protocol.EditResult{}, err
	}
	data = bytes.Replace(data, old, []byte(a.New), n)

	tf, temp, err := w.createTemp(path.Dir(target), sp)
	if err != nil {
		return protocol.EditResult{}, err
	}
	if _, err := tf.Write(data); err != nil {
		tf.Close()
		w.root.Remove(temp)
		w.dropTemp(temp)
		return protocol.EditResult{}, fsErr(sp, err)
	}
	if _, err := w.commitTemp(tf, temp, target, sp, false, fi); err != nil {
		return protocol.EditResult{}, err
	}
	return protocol.EditResult{Path: sp, Occurrences: n}, nil
}

func tooLargeToEdit(sp string, size, limit int64) error {
	return protocol.Errorf(protocol.CodeTooLarge, "%s is %d bytes; edit accepts files up to %d bytes, so rewrite it with write instead", sp, size, limit)
}
