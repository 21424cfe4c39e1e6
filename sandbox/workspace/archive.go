package workspace

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"path"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/tartree"
)

// Extract unpacks the tar stream r into the directory dir, creating it (and its parents) if missing.
// Everything goes through an os.Root opened on dir itself, so a hostile archive (absolute or ".."
// names, a symlink and then a file through it, hard links leaving the tree, device nodes, FIFOs,
// huge headers, control characters) is refused and changes nothing outside dir: see
// tartree.Extract. What is written counts against the workspace's disk quota like any other write,
// and memory stays flat whatever the size.
func (w *Workspace) Extract(ctx context.Context, dir string, r io.Reader) (protocol.TreeResult, error) {
	rel, sp, err := resolve(dir)
	if err != nil {
		return protocol.TreeResult{}, err
	}
	if rel != "." {
		if err := w.mkdirAll(rel); err != nil {
			return protocol.TreeResult{}, fsErr(sp, err)
		}
	}
	sub, err := w.openTree(rel, sp)
	if err != nil {
		return protocol.TreeResult{}, err
	}
	defer sub.Close()
	st, err := tartree.Extract(ctx, sub, r, tartree.ExtractOptions{UID: w.opts.UID, GID: w.opts.GID})
	res := treeResult(sp, st)
	return res, treeErr(rel, err)
}

// Archive writes p (a file, a symlink, or a directory and everything below it) to out as a tar
// stream whose names start at p's base name. Symlinks are archived as symlinks, never followed.
func (w *Workspace) Archive(ctx context.Context, p string, out io.Writer) (protocol.TreeResult, error) {
	rel, sp, err := resolve(p)
	if err != nil {
		return protocol.TreeResult{}, err
	}
	if namesDir(p) {
		// "f.txt/" names no directory: archiving f.txt under it would act on what open(2) refuses.
		fi, err := w.root.Stat(rel)
		if err != nil {
			return protocol.TreeResult{}, fsErr(sp, err)
		}
		if err := fileByName(p, sp, fi); err != nil {
			return protocol.TreeResult{}, err
		}
	}
	tw := tar.NewWriter(out)
	st, err := tartree.Add(ctx, tw, w.root, rel, path.Base(sp))
	if err == nil {
		err = tw.Close()
	}
	return treeResult(sp, st), treeErr(".", err)
}

func treeResult(sp string, st tartree.Stats) protocol.TreeResult {
	return protocol.TreeResult{Path: sp, Files: st.Files, Dirs: st.Dirs, Symlinks: st.Symlinks, Bytes: st.Bytes, Skipped: st.Skipped}
}

// treeErr translates tartree's file system errors, whose names are relative to base, into the
// protocol's, which name sandbox paths and never a host path.
func treeErr(base string, err error) error {
	var ee *tartree.EntryError
	if errors.As(err, &ee) {
		return fsErr(sandboxPath(join(base, ee.Name)), ee.Err)
	}
	return err
}
