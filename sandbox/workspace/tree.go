package workspace

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/protocol"
)

// openDirFlags open a directory only: O_DIRECTORY fails on anything else before it is opened, so a
// FIFO swapped in cannot block us.
const openDirFlags = os.O_RDONLY | syscall.O_DIRECTORY | syscall.O_NONBLOCK

// Stat describes one file without following a final symlink (lstat): a symlink is reported as
// type "symlink" with its target.
func (w *Workspace) Stat(p string) (protocol.FileInfo, error) {
	rel, sp, err := resolve(p)
	if err != nil {
		return protocol.FileInfo{}, err
	}
	fi, err := w.root.Lstat(rel)
	if err != nil {
		return protocol.FileInfo{}, fsErr(sp, err)
	}
	// "link/" follows the link, as stat(2) does, through the root (never out of the workspace);
	// "link" is the link itself. "f.txt/" and "link/" to a file name no file.
	if fi.Mode()&fs.ModeSymlink != 0 && namesDir(p) {
		if fi, err = w.root.Stat(rel); err != nil {
			return protocol.FileInfo{}, fsErr(sp, err)
		}
	}
	if err := fileByName(p, sp, fi); err != nil {
		return protocol.FileInfo{}, err
	}
	return w.describe(rel, sp, fi), nil
}

// List is ListContext without a deadline, returning only the entries.
func (w *Workspace) List(p string) ([]protocol.FileInfo, error) {
	res, err := w.ListContext(context.Background(), p)
	return res.Entries, err
}

// ListContext lists a directory (not recursively), sorted by name, at most MaxListEntries entries:
// the first ones by name, with Truncated set when there are more. It reads at most MaxScanEntries
// names, in batches, checking ctx between them, and describes (lstat) only the entries it returns;
// a directory with more names than that is listed from the names read, and Truncated. Entries
// are described like Stat describes them. A symlink to a directory inside the workspace is listed
// as that directory.
func (w *Workspace) ListContext(ctx context.Context, p string) (protocol.LsResult, error) {
	rel, sp, err := resolve(p)
	if err != nil {
		return protocol.LsResult{}, err
	}
	sc := w.newScan(ctx)
	d, names, err := w.openDir(rel, sc)
	if err != nil {
		if errors.Is(err, syscall.ENOTDIR) {
			if fi, serr := w.root.Stat(rel); serr == nil && !fi.IsDir() {
				return protocol.LsResult{}, protocol.Errorf(protocol.CodeNotDirectory, "%s is not a directory; read or stat it instead", sp)
			}
		}
		if pe := (*protocol.Error)(nil); errors.As(err, &pe) {
			return protocol.LsResult{}, err
		}
		return protocol.LsResult{}, fsErr(sp, err)
	}
	defer d.Close()
	res := protocol.LsResult{Truncated: sc.cut}
	if len(names) > w.opts.MaxListEntries {
		names, res.Truncated = names[:w.opts.MaxListEntries], true
	}
	res.Entries = make([]protocol.FileInfo, 0, len(names))
	for _, name := range names {
		fi, err := d.lstat(name)
		if err != nil {
			continue // vanished since it was listed
		}
		e := w.describe(join(rel, name), join(sp, name), fi)
		if err := sc.mem.Grow(infoCost(e)); err != nil {
			return protocol.LsResult{}, err
		}
		res.Entries = append(res.Entries, e)
	}
	return res, nil
}

// scan is the budget of one listing or walk: the directory entries it may still read, and its
// context.
type scan struct {
	ctx  context.Context
	left int
	cut  bool // the budget ran out with entries left unread
	// temps keeps the names of upload temporary files, which listings and searches leave out.
	temps bool
	// mem is the caller's budget for what the operation builds in memory: the names the scan
	// reads (all of them, until the operation ends) and the answer.
	mem membudget.Meter
}

func (w *Workspace) newScan(ctx context.Context) *scan {
	return &scan{ctx: ctx, left: w.opts.MaxScanEntries, mem: membudget.From(ctx)}
}

// infoCost is what holding one answered entry costs: its strings and the rest of the struct.
func infoCost(fi protocol.FileInfo) int64 {
	return membudget.StringCost(fi.Path) + membudget.StringCost(fi.Name) + membudget.StringCost(fi.Type) + membudget.StringCost(fi.Target) + 48
}

// openDir opens the directory rel through the root (a symlink inside the workspace is followed)
// and reads its names, sorted, drawing on sc. The caller closes the dir.
func (w *Workspace) openDir(rel string, sc *scan) (*dir, []string, error) {
	if err := ctxErr(sc.ctx); err != nil {
		return nil, nil, err
	}
	f, err := w.root.OpenFile(rel, openDirFlags, 0)
	if err != nil {
		return nil, nil, err
	}
	d, err := newDir(f)
	if err != nil {
		return nil, nil, err
	}
	names, err := d.names(sc)
	if err != nil {
		d.Close()
		return nil, nil, err
	}
	return d, names, nil
}

// openTree opens the directory rel as a root of its own. It opens rel/. so that rel is looked up as
// a directory (O_DIRECTORY): OpenRoot opens its last element with no flags, and an open for reading
// of a FIFO planted there would wait for a writer, holding the broker's thread (and the op's slot)
// for good, deaf to cancel.
func (w *Workspace) openTree(rel, sp string) (*os.Root, error) {
	sub, err := w.root.OpenRoot(rel + "/.")
	if err != nil {
		return nil, fsErr(sp, err)
	}
	return sub, nil
}

// openSub opens the subdirectory name of parent, which must still be want, and reads its names.
func openSub(parent *dir, name string, want fs.FileInfo, sc *scan) (*dir, []string, error) {
	if err := ctxErr(sc.ctx); err != nil {
		return nil, nil, err
	}
	d, err := parent.sub(name, want)
	if err != nil {
		return nil, nil, err
	}
	names, err := d.names(sc)
	if err != nil {
		d.Close()
		return nil, nil, err
	}
	return d, names, nil
}

// Delete removes a file or a symlink (never its target), an empty directory, or with Recursive a
// directory tree. The workspace itself cannot be deleted.
func (w *Workspace) Delete(a protocol.DeleteArgs) error {
	rel, sp, err := resolve(a.Path)
	if err != nil {
		return err
	}
	if rel == "." {
		return protocol.Errorf(protocol.CodeInvalidPath, "%s itself cannot be deleted; delete what is inside it", Root)
	}
	if err := dotTail(a.Path); err != nil {
		return err
	}
	fi, err := w.root.Lstat(rel)
	if err != nil {
		return fsErr(sp, err)
	}
	if err := fileByName(a.Path, sp, fi); err != nil {
		return err
	}
	if fi.IsDir() && a.Recursive {
		// RemoveAll works on directory descriptors and unlinks symlinks without following them.
		return fsErr(sp, w.root.RemoveAll(rel))
	}
	err = w.root.Remove(rel)
	if errors.Is(err, syscall.ENOTEMPTY) || (fi.IsDir() && errors.Is(err, syscall.EEXIST)) {
		return protocol.Errorf(protocol.CodeInvalidArgument, "%s is a directory that is not empty; pass recursive to delete it with its contents", sp)
	}
	return fsErr(sp, err)
}

// Mkdir creates a directory. Without Parents an existing path is file_exists and a missing parent
// is file_not_found; with Parents missing parents are created and an existing directory is fine.
func (w *Workspace) Mkdir(a protocol.MkdirArgs) error {
	rel, sp, err := resolve(a.Path)
	if err != nil {
		return err
	}
	if a.Parents {
		err := w.mkdirAll(rel)
		if errors.Is(err, syscall.ENOTDIR) {
			if fi, serr := w.root.Lstat(rel); serr == nil && !fi.IsDir() {
				return protocol.Errorf(protocol.CodeFileExists, "%s already exists and is not a directory", sp)
			}
		}
		return fsErr(sp, err)
	}
	err = w.root.Mkdir(rel, dirPerm)
	switch {
	case err == nil:
		return fsErr(sp, w.chownPath(rel))
	case errors.Is(err, fs.ErrNotExist):
		return protocol.Errorf(protocol.CodeFileNotFound, "the parent directory of %s does not exist; pass parents to create it too", sp)
	}
	return fsErr(sp, err)
}

// Move renames a file, symlink or directory within the workspace and creates the destination's
// missing parents. A symlink is moved itself. Without Overwrite an existing destination is
// file_exists; with it, a file or symlink is replaced but a directory never is.
func (w *Workspace) Move(a protocol.MoveArgs) error {
	from, fromSP, err := resolve(a.From)
	if err != nil {
		return err
	}
	to, toSP, err := resolve(a.To)
	if err != nil {
		return err
	}
	switch {
	case from == ".":
		return protocol.Errorf(protocol.CodeInvalidPath, "%s itself cannot be moved", Root)
	case to == ".":
		return protocol.Errorf(protocol.CodeInvalidPath, "%s itself cannot be replaced; move into a path under it", Root)
	case strings.HasPrefix(to, from+"/"):
		return protocol.Errorf(protocol.CodeInvalidArgument, "%s cannot be moved into itself (%s)", fromSP, toSP)
	}
	if err := dotTail(a.From); err != nil {
		return err
	}
	if err := dotTail(a.To); err != nil {
		return err
	}
	src, err := w.root.Lstat(from)
	if err != nil {
		return fsErr(fromSP, err)
	}
	if err := fileByName(a.From, fromSP, src); err != nil {
		return err
	}
	if !src.IsDir() && namesDir(a.To) {
		// rename(2) answers ENOTDIR: the cleaned name would replace the file f.txt for "f.txt/",
		// or make a file named new for "new/".
		return protocol.Errorf(protocol.CodeNotDirectory, "%s is not a directory; %s names one (it ends in /), so only a directory moves there", fromSP, quote(a.To))
	}
	if from == to {
		return nil
	}
	if dir := path.Dir(to); dir != "." {
		if err := w.mkdirAll(dir); err != nil {
			return fsErr(path.Dir(toSP), err)
		}
	}
	dst, err := w.root.Lstat(to)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		dst = nil
	case err != nil:
		return fsErr(toSP, err)
	}
	if dst != nil && os.SameFile(src, dst) {
		dst = nil // the same file under another name, e.g. a case change on a case-insensitive disk
	} else if dst != nil {
		switch {
		case !a.Overwrite:
			return protocol.Errorf(protocol.CodeFileExists, "%s already exists; pass overwrite to replace it", toSP)
		case dst.IsDir():
			return protocol.Errorf(protocol.CodeIsDirectory, "%s is a directory and is never replaced; delete it first", toSP)
		case src.IsDir():
			return protocol.Errorf(protocol.CodeNotDirectory, "%s is a file; a directory cannot replace it", toSP)
		}
		return w.rename(from, to, fromSP, toSP)
	}
	if !src.IsDir() && !a.Overwrite {
		// A hard link fails if the destination appeared since the check, where a rename would
		// silently replace it. (A directory cannot be linked, but the root's rename never
		// replaces a directory and the kernel never puts a directory over a file.)
		switch err := w.root.Link(from, to); {
		case err == nil:
			if err := w.root.Remove(from); err != nil {
				return fsErr(fromSP, err)
			}
			return nil
		case errors.Is(err, fs.ErrExist):
			return protocol.Errorf(protocol.CodeFileExists, "%s already exists; pass overwrite to replace it", toSP)
		}
		// No hard links here (another file system, a FUSE mount...): fall back to the rename.
	}
	return w.rename(from, to, fromSP, toSP)
}

func (w *Workspace) rename(from, to, fromSP, toSP string) error {
	err := w.root.Rename(from, to)
	if err == nil {
		return nil
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		err = le.Err
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fsErr(fromSP, err)
	case errors.Is(err, fs.ErrExist):
		return protocol.Errorf(protocol.CodeFileExists, "%s already exists; pass overwrite to replace it", toSP)
	}
	// Name the destination: most remaining failures (escape, not a directory) are about it.
	return fsErr(toSP, err)
}
